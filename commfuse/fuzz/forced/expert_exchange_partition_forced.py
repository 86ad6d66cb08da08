"""expert_exchange_partition_forced: every expert exchange on a group spanning nodes cut in
Centauri's Algorithm 1 uneven granularity, the pipeline model not asked.

Contract
- Matches: what ``expert_exchange_partition`` cuts (a capacity dispatch all_to_all, its expert
  chain, the combine on the same group), on a group ``group_partition`` can split into intra-
  and inter-node levels with the sub-groups ``setup()`` created, a topology known.
- Does: for each such exchange in graph order, Algorithm 1 on the two-level exchange
  (:func:`~commfuse.transforms.expert_exchange_partition.two_level_granularity`); when it
  chooses uneven proportions, the exchange and its chain cut in them (whole units of every
  expert's capacity slots, rounded as the pass rounds them), exactly as
  ``expert_exchange_partition`` cuts when its pipeline model prices the uneven cut fastest.
  The sizes go to ``decisions``.
- Why it exists: that pass takes the uneven cut only where the pipeline model predicts it no
  slower than the best even cut, which flat chunk exchanges (one more launch) almost never
  are; this name runs the same building blocks on every exchange Algorithm 1 cuts unevenly,
  so the fuzzer checks the uneven rewrite. Test-only: not in the product pass table
  (registered by :func:`commfuse.fuzz.forced.register_forced_passes`).
- Guarantees: those of ``expert_exchange_partition`` (values equal up to floating-point
  rounding; the same bytes on the same group; decided from the graph, config and topology).
- Leaves alone (one line each): exchanges the pass would refuse, groups inside one node (no
  level times), even granularities, and proportions no rounding fits the shapes to.

Source: Centauri (ASPLOS '24) §3.2, Algorithm 1 (group-partitioned branch), applied to the
expert exchange.
"""

from __future__ import annotations

from commfuse.ir import rewrite
from commfuse.ir.kinds import CollectiveKind
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms.expert_exchange_partition import (
    _best,
    _emit,
    _plan,
    _uneven_cut,
    two_level_granularity,
    why_not_exchange,
)
from commfuse.transforms.group_partition import GroupPartition


class ExpertExchangePartitionForced(GraphPass):
    __doc__ = __doc__
    name = "expert_exchange_partition_forced"
    stage = Stage.SCHEDULE
    gated = False  # forced: applies its rewrite whatever the prediction (what it exists for)
    # group_partition's fuzz set-up (2 nodes x 4, sub-groups set up by check.py): the moe
    # family's capacity exchanges over the world span both nodes. Tolerance compare scaled by
    # magnitude, as for expert_exchange_partition.
    fuzz = FuzzSpec(
        generators=("moe",), world_sizes=(8,), scaled_tolerance=True, topology=GroupPartition.fuzz.topology
    )

    def run(self, ctx: PassContext) -> PassResult:
        refusals: list[str] = []
        decisions: list[dict] = []
        gone: set[str] = set()
        for name in [c.name for c in ctx.ir.collectives if c.kind is CollectiveKind.ALL_TO_ALL]:
            c = next((x for x in ctx.ir.collectives if x.name == name), None)
            if c is None or name in gone:
                continue
            why = why_not_exchange(ctx, c)
            probe = why or _best(ctx, c, 2)
            if isinstance(probe, str):
                refusals.append(f"{name}: not cut unevenly: {probe}")
                continue
            chain, c2, _ = probe
            granularity, why = two_level_granularity(ctx, c, c2, chain)
            if granularity is None:
                refusals.append(f"{name}: not cut unevenly: {why}")
                continue
            cut = _uneven_cut(ctx, c, granularity)
            if isinstance(cut, str):
                refusals.append(f"{name}: not cut unevenly: {why}; {cut}")
                continue
            units, best, note = cut
            plan = _plan(c, best, units, f"{why}{'; ' + note if note else ''}")
            chain, c2, split2 = best
            _emit(ctx.gm, rewrite.fake_mode_of(ctx.gm), chain, c2, split2, units)
            gone.add(c2.name)
            ctx.invalidate()
            decisions.append(
                {
                    "collective": plan.dispatch,
                    "combine": plan.combine,
                    "chunks": plan.chunks,
                    "sizes": list(plan.sizes),
                    "decision": plan.describe(),
                }
            )
        if decisions:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(
            changed=bool(decisions),
            counts={"exchanges_cut_unevenly": len(decisions)},
            refusals=refusals,
            decisions=decisions,
        )
