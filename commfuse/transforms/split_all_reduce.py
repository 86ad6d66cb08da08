"""split_all_reduce: all_reduce -> reduce_scatter + all_gather on the same group.

Contract
- Matches: every functional ``all_reduce`` (not in-place, not coalesced) with a
  reduce op in {sum, avg, max, min}, a static input shape and a single wait.
- Does: replaces ``wait(all_reduce(x))`` by ``all_gather_d(reduce_scatter_d(x))``
  along a dim ``d`` whose size the group size divides. ``d`` is the lowest such
  dim other than the last one (the hidden dim that norms normalise), falling back
  to the last dim; the IR then sees a dim-``d`` reduce_scatter and all_gather
  (DTensor's split/cat shuffle for d != 0). Nothing divides: left alone, reported.
- Guarantees: same values up to the reduction order of the backend (the
  reduce_scatter reduces exactly the elements the all_reduce did; the all_gather
  only copies); same group; on every rank the same decision, since it depends only
  on the graph. Wire bytes are equal under ring conventions (2(N-1)/N·M before,
  (N-1)/N·M twice after).
- On its own the split does not pay on any backend (and costs a full all_reduce
  on gloo, whose reduce_scatter is emulated): it exists to expose the two halves
  to ``collective_motion`` and ``fuse_collectives``. The ``chimera`` pipeline fuses
  any pair that nothing used back into one all_reduce.

Source: Chimera §3.1 (splitting all_reduce into the two basic operators),
Megatron-LM sequence parallelism (all_reduce = reduce_scatter + all_gather).
"""

from __future__ import annotations

from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext

SPLITTABLE_OPS = ("sum", "avg", "max", "min")


def split_dim(shape, n: int) -> int | None:
    """The dim to split an all_reduce of ``shape`` over ``n`` ranks along (None: none divides)."""
    if shape is None or not all(isinstance(s, int) for s in shape) or not shape:
        return None
    dims = [d for d, s in enumerate(shape) if s > 0 and s % n == 0]
    inner = [d for d in dims if d != len(shape) - 1]
    return (inner or dims or [None])[0]


def why_not_splittable(c: Collective) -> str | None:
    if c.kind is not CollectiveKind.ALL_REDUCE:
        return "not an all_reduce"
    if c.inplace or c.coalesced:
        return "in-place or coalesced all_reduce"
    if c.reduce_op not in SPLITTABLE_OPS:
        return f"reduce op {c.reduce_op!r} has no reduce_scatter equivalent"
    if len(c.waits) != 1:
        return "not exactly one wait"
    if c.group.size is None:
        return "group size unknown"
    shape = c.input_shapes[0] if c.input_shapes else None
    if shape is None or not all(isinstance(s, int) for s in shape):
        return "input shape not static"
    if split_dim(shape, c.group.size) is None:
        return f"no dim of shape {list(shape)} is divisible by the group size {c.group.size}"
    return None


def split_one(ctx: PassContext, c: Collective) -> None:
    """Rewrite one splittable all_reduce in place (caller checked :func:`why_not_splittable`)."""
    n = c.group.size
    d = split_dim(c.input_shapes[0], n)
    (wait,) = c.waits

    def body(x, op, dim, size, group):
        return rewrite.all_gather(rewrite.reduce_scatter(x, op, dim, size, group), dim, size, group)

    # The start's live argument, not the IR's record: an earlier split in the same run may
    # have replaced this all_reduce's input (a chain of all_reduces).
    out = rewrite.splice(
        ctx.gm,
        body,
        [c.start.args[0]],
        consts=(c.reduce_op, d, n, c.group.name),
        before=wait,
        meta_from=c.start,
    )
    wait.replace_all_uses_with(out)
    rewrite.erase_dead(ctx.gm, [wait])


class SplitAllReduce(GraphPass):
    __doc__ = __doc__
    name = "split_all_reduce"
    stage = Stage.JOINT
    # The split reduces exactly the elements the all_reduce did (the interpreter sums ranks
    # in the same order), so values are bitwise equal; the collective sequence changes.
    fuzz = FuzzSpec(exact=True)

    def run(self, ctx: PassContext) -> PassResult:
        split, refusals = 0, []
        for c in list(ctx.ir.collectives):
            if c.kind is not CollectiveKind.ALL_REDUCE:
                continue
            why = why_not_splittable(c)
            if why is not None:
                refusals.append(f"{c.name}: not split: {why}")
                continue
            split_one(ctx, c)
            split += 1
        if split:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(changed=split > 0, counts={"all_reduce_split": split}, refusals=refusals)
