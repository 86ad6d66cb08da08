"""Per-rank byte counts of one collective, in the two conventions that matter.

* **logged bytes** follow NCCL's logging (count x dtype size): all_gather logs the
  per-rank *send* count, reduce_scatter the per-rank *receive* count, all_reduce,
  broadcast, all_to_all and p2p the buffer they are given.
* **wire bytes** are what one rank sends under ring conventions (the NCCL
  bus-bandwidth factors): all_reduce 2(N-1)/N·S, all_gather (N-1)·s_in,
  reduce_scatter (N-1)·s_out, all_to_all (N-1)/N·S (equal splits), broadcast S,
  send S, recv 0, reduce (rooted, commfuse's own) S: a pipelined chain to the root, every
  rank but the root forwards the whole buffer once (the mirror image of broadcast).

Keeping them apart is the lesson of the volume validation in the NCCL-trace thesis
(L. Borzyk, "Understanding LLM Communication", Heidelberg University, 2026, §5.3.5):
mixing them looks like a 2-4x model error. Values are exact (sympy Rational for fractions, sympy expressions for
symbolic shapes).
"""

from __future__ import annotations

import sympy

from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import Size


def _exact(x: sympy.Expr | int) -> Size:
    x = sympy.nsimplify(x) if not isinstance(x, int) else x
    if isinstance(x, int):
        return x
    if x.is_Integer:
        return int(x)
    return x


def logged_bytes(kind: CollectiveKind, in_bytes: Size | None, out_bytes: Size | None) -> Size | None:
    if kind is CollectiveKind.REDUCE_SCATTER:
        return out_bytes
    return in_bytes


def wire_bytes(
    kind: CollectiveKind,
    n: int | None,
    in_bytes: Size | None,
    out_bytes: Size | None,
    *,
    send_bytes: Size | None = None,
) -> Size | None:
    """Bytes one rank sends. `send_bytes` is the sent part of a batched p2p call."""
    K = CollectiveKind
    if kind in (K.SEND, K.BROADCAST, K.M2MS, K.REDUCE):
        return in_bytes
    if kind is K.RECV:
        return 0
    if kind is K.BATCH_P2P:
        return send_bytes
    if n is None or in_bytes is None:
        return None
    if kind is K.ALL_REDUCE:
        return _exact(sympy.Rational(2 * (n - 1), n) * in_bytes)
    if kind is K.ALL_GATHER:
        return _exact((n - 1) * in_bytes)
    if kind is K.REDUCE_SCATTER:
        return None if out_bytes is None else _exact((n - 1) * out_bytes)
    if kind is K.ALL_TO_ALL:
        return _exact(sympy.Rational(n - 1, n) * in_bytes)
    return None
