"""Trace boundary ops "as" another member: ``trace_position`` and ``trace_as_rank``.

A pipeline runner traces stages that its own rank does not run (to learn the shapes its
peers will produce). The input and output shapes of ``commfuse::m2ms`` depend on which
member runs it (the row of the piece matrix it sends, the column it receives), and its
fake kernel normally takes both from this process's rank in the op's group. Two contexts
change that, for fake kernels only (real kernels always use the process's own rank, so
neither can change what is sent):

* ``trace_position(group_name, p)`` -- a pipeline rank at position ``p`` of every stage:
  the input side is traced as ``src[p]`` and the output side as ``dst[p]`` (a side whose
  list is shorter than ``p + 1`` is "no member": size 0). This is symmetric under the
  reverse scatter (its ``src`` is the forward's ``dst``), so a backward traced in the same
  context gets the forward's shapes back. ``p=None``: no member on either side.
* ``trace_as_rank(group_name, r)`` -- one group rank ``r`` on both sides (a member of
  overlapping groups traced as another member); ``r=None``: no member.

``group_name=None`` applies to every group. Contexts nest (the innermost matching one
wins) and are per thread. A differentiable m2ms records the context its forward was
traced under and re-enters it for its backward (:mod:`commfuse.ops.boundary.m2ms`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


@dataclass(frozen=True)
class _Entry:
    group_name: Optional[str]  # None: applies to every group
    position: Optional[int]  # position in the op's dst list (None: in no receiving group)
    rank: Optional[int] = None  # a group rank instead of a position (set by trace_as_rank)
    by_rank: bool = False


_local = threading.local()


def _stack() -> list[_Entry]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def _check_name(group_name: Optional[str], who: str) -> None:
    if group_name is not None and not isinstance(group_name, str):
        raise ValueError(f"{who}: group_name must be a str or None, got {type(group_name).__name__}")


@contextmanager
def trace_position(group_name: Optional[str], position: Optional[int]) -> Iterator[None]:
    """Fake kernels of m2ms on ``group_name`` (None: any group) trace their input as
    ``src[position]`` and their output as ``dst[position]``."""
    _check_name(group_name, "trace_position")
    if position is not None and (isinstance(position, bool) or not isinstance(position, int) or position < 0):
        raise ValueError(f"trace_position: position must be a non-negative int or None, got {position!r}")
    _stack().append(_Entry(group_name, position))
    try:
        yield
    finally:
        _stack().pop()


@contextmanager
def trace_as_rank(group_name: Optional[str], rank: Optional[int]) -> Iterator[None]:
    """Like :func:`trace_position` but names the traced member by its group rank (None: no member)."""
    _check_name(group_name, "trace_as_rank")
    _stack().append(_Entry(group_name, None, rank, by_rank=True))
    try:
        yield
    finally:
        _stack().pop()


def _active(group_name: str) -> Optional[_Entry]:
    for e in reversed(_stack()):
        if e.group_name is None or e.group_name == group_name:
            return e
    return None


def traced_sides(
    group_name: str, src: Sequence[int], dst: Sequence[int], own_rank: Optional[int]
) -> tuple[Optional[int], Optional[int]]:
    """The group ranks a fake kernel of an op sending from ``src`` to ``dst`` should act as,
    (input side, output side); None is "a rank in no group of that side".

    ``own_rank`` is this process's rank in the group (None when the group is not resolvable
    here)."""
    e = _active(group_name)
    if e is None:
        return own_rank, own_rank
    if e.by_rank:
        return e.rank, e.rank
    if e.position is None:
        return None, None
    if e.position >= len(src) and e.position >= len(dst):
        raise ValueError(
            f"trace_position: position {e.position} is outside src {list(src)} and dst "
            f"{list(dst)} of an op on group {group_name!r}"
        )
    return (
        int(src[e.position]) if e.position < len(src) else None,
        int(dst[e.position]) if e.position < len(dst) else None,
    )


@contextmanager
def reenter(entry: Optional[_Entry]) -> Iterator[None]:
    """Re-enter a context captured with :func:`active_entry` (None: nothing)."""
    if entry is None:
        yield
        return
    _stack().append(entry)
    try:
        yield
    finally:
        _stack().pop()


def active_entry(group_name: str) -> Optional[_Entry]:
    """The context that applies to ``group_name`` now (for :func:`reenter` in a backward)."""
    return _active(group_name)


def tracing_as_other(group_name: str) -> bool:
    """True while a trace_position / trace_as_rank context applies to ``group_name`` in this thread."""
    return _active(group_name) is not None


__all__ = ["active_entry", "reenter", "trace_as_rank", "trace_position", "traced_sides", "tracing_as_other"]
