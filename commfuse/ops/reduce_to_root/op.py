"""``commfuse::reduce_to_root``: an asynchronous rooted reduce, waited with ``wait_tensor``.

``_c10d_functional`` has a broadcast but no reduce, and Centauri's substitution of a
reduce_scatter by "reduces of distinct roots" (Table 2) needs one. This module defines it
as a custom op that behaves like a functional collective:

    reduce_to_root(x, root, reduce_op, group_size, group_name) -> Tensor   (then wait_tensor)

* It issues ``dist.reduce`` asynchronously on the process group the graph names (resolved
  at run time, never created) and ties the work to its result with c10d's work registry,
  so the graph waits on it with ``_c10d_functional.wait_tensor`` exactly like on
  ``all_reduce``: start and wait can be scheduled apart, and the verifier's "waited
  exactly once" and total-order checks apply unchanged.
* ``root`` is a *group* rank (as for ``_c10d_functional.broadcast``). After the wait the
  result is, on the root, the reduction of every member's ``x``; on every other member
  it is a tensor of ``-0.0`` (integers: 0). ``-0.0`` is the exact identity of IEEE
  addition (``v + -0.0 == v`` bit for bit, for every ``v`` including ``-0.0``, inf and
  NaN), so a graph that is the same on every rank can assemble "my piece" from N
  rooted reduces by adding their results: on rank r only reduce r contributes. The
  alternatives were worse: leaving non-root results undefined (gloo's ring reduce
  leaves partial sums there) would make the program's values depend on the backend,
  and selecting by rank would make the graph rank-dependent.
* ``x`` is copied into a fresh buffer before the call (the backends reduce in place and
  use every rank's buffer as scratch), so the op mutates nothing and its input may be
  freed or reused as soon as it returns; the work keeps the buffer alive until waited.
* ``reduce_op``: ``sum``, ``product``, ``max``, ``min``, ``band``, ``bor``, ``bxor``
  (``avg`` is not a ``dist.reduce`` op on gloo: callers reduce with ``sum`` and divide).

The op is registered as collective kind ``reduce`` with the IR (``register_collective_op``);
its reference semantics are :func:`commfuse.reference.semantics.reduce` (by kind), its
cost model ``CollectiveModel`` kind ``reduce``. Importing :mod:`commfuse.lowering` (which
``import commfuse`` does) registers everything.

Runs under the eager lowering op by op, and under Inductor as a fallback kernel
(custom ops with a real kernel need no lowering); its partitioner placement is pinned
by the pass that emits it (``recompute`` = MUST_SAVE, as the partitioner does for
``_c10d_functional`` ops), so the collective is never duplicated into the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from commfuse.core.torch_private import register_work, resolve_process_group
from commfuse.ir.kinds import CollectiveArgs, CollectiveKind, CollectiveOpSpec, register_collective_op

ROOTED_REDUCE_OPS = ("sum", "product", "max", "min", "band", "bor", "bxor")


def _dist_op(name: str):
    import torch.distributed as dist

    ops = {
        "sum": dist.ReduceOp.SUM,
        "product": dist.ReduceOp.PRODUCT,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR,
    }
    if name not in ops:
        raise ValueError(
            f"commfuse::reduce_to_root: reduce_op must be one of {ROOTED_REDUCE_OPS}, got {name!r}"
        )
    return ops[name]


@torch.library.custom_op("commfuse::reduce_to_root", mutates_args=())
def reduce_to_root(x: Tensor, root: int, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    import torch.distributed as dist

    op = _dist_op(reduce_op)
    pg = resolve_process_group(group_name)
    if pg is None:
        raise RuntimeError(f"commfuse::reduce_to_root: no process group named {group_name!r} in this process")
    if pg.size() != group_size:
        raise RuntimeError(
            f"commfuse::reduce_to_root: group {group_name!r} has {pg.size()} ranks, "
            f"the graph says group_size {group_size}"
        )
    if not 0 <= root < group_size:
        raise ValueError(
            f"commfuse::reduce_to_root: root {root} is not a group rank of a group of {group_size}"
        )
    buf = x.clone(memory_format=torch.contiguous_format)
    work = dist.reduce(buf, op=op, group=pg, async_op=True, group_dst=root)
    # Non-roots get the additive identity, never the backend's scratch (see module docstring).
    out = buf if dist.get_rank(pg) == root else torch.full_like(buf, -0.0)
    register_work(out, work)
    return out


@reduce_to_root.register_fake
def _(x, root, reduce_op, group_size, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


REDUCE_TO_ROOT = torch.ops.commfuse.reduce_to_root.default


def _kw(a: tuple, k: dict, idx: int, name: str):
    return a[idx] if len(a) > idx else k[name]


def _parse(a: tuple, k: dict) -> CollectiveArgs:
    return CollectiveArgs(
        (a[0],),
        str(_kw(a, k, 4, "group_name")),
        group_size=_kw(a, k, 3, "group_size"),
        reduce_op=_kw(a, k, 2, "reduce_op"),
        src_or_dst=_kw(a, k, 1, "root"),
    )


def register() -> None:
    """The op's collective kind with the IR (called by :func:`commfuse.ops.install`)."""
    register_collective_op(REDUCE_TO_ROOT, CollectiveOpSpec(CollectiveKind.REDUCE, _parse))


__all__ = ["REDUCE_TO_ROOT", "ROOTED_REDUCE_OPS", "reduce_to_root"]
