"""centauri_partition_forced: every collective cut as Centauri's Algorithm 1 says for its
group-partitioned form, the simulator not asked.

Contract
- Matches: what ``centauri_partition`` searches (all_gather, reduce_scatter, all_reduce
  of a scheduled graph, a topology known, a graph every rank sees alike), whose group
  ``group_partition`` can split into intra- and inter-node levels.
- Does: for each such collective in graph order, the leaf of :func:`group_granularity`
  (Algorithm 1 with the hierarchical sequence's costs: which level goes first, and the
  chunk granularity) when it is uneven: the workload partition cuts the collective and its
  chain in those proportions (rounded to what the shapes divide), then each chunk is
  group-partitioned. The chosen sizes go to ``decisions``.
- Why it exists: the search applies an uneven leaf only when the simulator prices it
  cheapest, which the fuzzer's small programs rarely make happen; this name runs the
  same building blocks (``apply_scheme``) on every collective Algorithm 1 cuts unevenly,
  so the fuzzer and the multi-rank tests check the uneven rewrite. Test-only: not in the
  product pass table (registered by :func:`commfuse.fuzz.forced.register_forced_passes`).
- Guarantees: those of ``centauri_partition`` (values equal up to reduction order; the
  decision is a function of the graph, config and topology, the same on every rank).
- Leaves alone (one line each): collectives Algorithm 1 does not cut unevenly (even
  granularity, no chain, not group-partitionable), with its reason; collectives whose leaf
  fails on a copy of the graph (a chunk too small for the hierarchical sequence).

Source: Centauri (ASPLOS '24) §3.2, Algorithm 1 (group-partitioned branch).
"""

from __future__ import annotations

from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms.group_partition import GroupPartition
from commfuse.transforms.partition_search import (
    SEARCHED_KINDS,
    InfeasibleLeaf,
    _copy_context,
    apply_scheme,
    graph_refusal,
    group_granularity,
    work_plan,
)


class CentauriPartitionForced(GraphPass):
    __doc__ = __doc__
    name = "centauri_partition_forced"
    stage = Stage.SCHEDULE
    gated = False  # forced: applies its rewrite whatever the prediction (what it exists for)
    # The search's fuzz set-up (2 nodes x 4, sub-groups set up by check.py), where Algorithm 1
    # picks uneven granularities (inter-first 1:3, or 4:1:3): tolerance compare scaled by magnitude,
    # as for its building blocks (sums regrouped over chunks and levels).
    fuzz = FuzzSpec(
        generators=("tp", "sp", "fsdp", "mixed"),
        world_sizes=(8,),
        scaled_tolerance=True,
        topology=GroupPartition.fuzz.topology,
    )

    def run(self, ctx: PassContext) -> PassResult:
        why = graph_refusal(ctx, "Algorithm 1's costs, and the chunks chosen,")
        if why is not None:
            return PassResult(changed=False, refusals=[why])
        refusals: list[str] = []
        decisions: list[dict] = []
        for name in [c.name for c in ctx.ir.collectives if c.kind in SEARCHED_KINDS]:
            c = next((x for x in ctx.ir.collectives if x.name == name), None)
            if c is None:
                continue
            scheme, why = group_granularity(ctx, c)
            if scheme is None or scheme.sizes is None:
                refusals.append(f"{name}: not cut unevenly: {why}")
                continue
            # A chunk may be too small for the hierarchical sequence (the whole collective was
            # not): try the leaf on a copy, as the search does, so a refused step leaves the graph.
            trial = _copy_context(ctx)
            try:
                apply_scheme(trial, next(x for x in trial.ir.collectives if x.name == name), scheme)
            except InfeasibleLeaf as e:
                refusals.append(f"{name}: not cut unevenly: {why}; {scheme.describe()} infeasible ({e})")
                continue
            plan = work_plan(ctx, c, scheme)
            apply_scheme(ctx, c, scheme)
            decisions.append(
                {
                    "collective": name,
                    "kind": c.kind.value,
                    "group": c.group.name,
                    "scheme": scheme.describe(),
                    "chunk_sizes": list(plan.extents),
                    "granularity": why,
                }
            )
        if decisions:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(
            changed=bool(decisions),
            counts={"collectives_partitioned": len(decisions)},
            refusals=refusals,
            decisions=decisions,
        )
