"""Collectives an op issues from inside its own kernel, announced to one listener.

The runtime issues the graph's collectives itself and records them when asked
(:mod:`commfuse.lowering.recorder`). An op that communicates inside its kernel -- commfuse's
MoE layer exchanges tokens with ``all_to_all_single`` calls (:mod:`commfuse.ops.moe_layer.exchange`)
-- is below the runtime and cannot reach the recorder, so it announces each call here, and the
recorder, while recording, listens.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# (kind, group name, bytes handed to c10d, bytes received, Work or None, op name) -> None
Listener = Callable[[str, str, int, int, Any, str], None]

_listener: Optional[Listener] = None


def set_listener(listener: Optional[Listener]) -> None:
    """Listen to every announced collective (None: stop)."""
    global _listener
    _listener = listener


def announce(kind: str, group: str, sent_bytes: int, received_bytes: int, work: Any, op: str) -> None:
    """An op issued a collective (``work``: its c10d Work when asynchronous)."""
    if _listener is not None:
        _listener(kind, group, sent_bytes, received_bytes, work, op)


__all__ = ["Listener", "announce", "set_listener"]
