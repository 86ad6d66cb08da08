"""chimera: the Chimera communication-fusion pipeline as one pass.

Contract
- Runs, on the joint (or inference) graph: ``split_all_reduce`` (every all_reduce
  becomes reduce_scatter + all_gather), ``collective_motion`` (all_gathers move later
  through computation that works on shards, so collectives meet or the compute
  between them runs on shards), then ``fuse_collectives`` (adjacent pairs on one
  group become one collective; a reduce_scatter + all_gather pair nothing used is
  fused back into the all_reduce it came from). Each step is also a pass of its own.
- The split is only kept where it enabled something: if, at the end, the collective
  sequence is the one the graph started with (same kinds, groups, shapes, order) and
  no computation moved, the graph is restored exactly and the pass reports no change.
- Reports every step's counts (prefixed with the step) and every refusal ("why not
  moved / fused") of every step.
- Guarantees: those of its steps (values equal up to summation order; decisions from
  the graph, config and roles only; no process group created); the verifier runs
  between steps when ``Config.verify``.

The MoE dispatch region (Chimera §3.2's gating move) needs no step of its own:
``moe_recognition`` makes it one ``commfuse::moe_layer`` op, whose shard rules
(:mod:`commfuse.analysis.moe_rules`) let ``collective_motion`` run it on token shards and
move the all_gather past it (docs/chimera-moe.md).

Source: Chimera (ISCA '25) §3: split, reorder, fuse (Table 3), applied repeatedly.
"""

from __future__ import annotations

from commfuse.passmgr.base import FuzzSpec, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.pipeline import PassPipeline, restore_graph, snapshot_graph
from commfuse.transforms.collective_motion import CollectiveMotion
from commfuse.transforms.fuse_collectives import FuseCollectives
from commfuse.transforms.split_all_reduce import SplitAllReduce


class Chimera(PassPipeline):
    __doc__ = __doc__
    name = "chimera"
    stage = Stage.JOINT
    # Chimera composes the three steps above: the families where they meet (MoE layer included).
    fuzz = FuzzSpec(generators=("tp", "sp", "moe", "mixed", "moe_layer", "group_pairs"))
    steps = (SplitAllReduce, CollectiveMotion, FuseCollectives)

    def run(self, ctx: PassContext) -> PassResult:
        start_hash = ctx.ir.order_hash()
        snapshot = snapshot_graph(ctx.gm.graph)
        results = self.run_steps(ctx)
        moved = dict(results)[CollectiveMotion.name].changed
        if not moved and ctx.ir.order_hash() == start_hash:
            restore_graph(ctx.gm.graph, snapshot)
            ctx.gm.recompile()
            ctx.invalidate()
            refusals = self.combine(results).refusals
            refusals.append(
                "chimera: nothing moved and the collective sequence is unchanged (any split was fused "
                "back); graph restored"
            )
            return PassResult(False, counts={}, refusals=refusals)
        return self.combine(results)


STEPS = tuple(step.name for step in Chimera.steps)
