"""DHelix strand interleaving: run one micro-batch's backward beside the next one's forward.

Contract
- Matches: the fused forward+backward graph ``Config(dhelix=True)`` gives a
  ``compile_train_step`` with M >= 2 micro-batches (``dhelix.fused_partition``). Any other
  graph (a plain forward or backward graph, one micro-batch) is left unchanged with the
  reason.
- Decides: the unit size L from Centauri's Eq. 2 with its concurrency constraint (forward and
  backward micro-batches are in flight together here; ``schedule_model_level=False``: L = 1),
  then the interleaved order of ``dhelix.interleave.plan_interleaving``: the chain
  F(u0) | B(u0)+F(u1) | ... | B(u_last), each pair layer by layer, segments paired by the
  DP of DHelix Eq. 2 with the OEF table (``Config.dhelix_oef_profile``, measured by
  ``python -m commfuse profile-overlap``; without one, the illustrative default factors).
- Keeps the interleaved order only if the simulator's peak memory of it stays within
  ``schedule_memory_budget`` times that of the non-interleaved step (``sequential_order``:
  every forward, then every backward, in micro-batch order, same graph); otherwise that
  non-interleaved order is applied (or the input order kept, if it holds less) and the reason
  reported. Both peaks, and the activation peaks (peak
  minus the gradients the step returns), are reported.
  Predicted makespans of both orders are reported, not used to refuse: the cost model has no
  concurrency between two compute streams, so it cannot see all of the gain.
- Guarantees: the output order is a topological order of the graph; it changes the order of
  collectives (the strands' collectives interleave), decided from the graph, the config and
  the OEF profile only, so every rank issues the same sequence; the plan's digest is
  reported for checking that. A graph with an all_to_all whose split sizes are given per rank
  (uneven, or data-dependent as in dropless MoE) is left in its input order: its simulated
  cost differs between ranks, and so could the plan.
- Execution hints for the lowering (docs/lowering.md): every node of a paired step gets
  ``node.meta["commfuse_barrier"]`` (its barrier interval: the lowering plan orders every
  stream's work of one interval after all streams' work of the previous one), the forward
  strand's compute in paired steps runs on compute stream 1 (``commfuse_stream``; the backward
  strand and every collective issue stay on stream 0; c10d runs each transfer on its group's
  own stream, so intra- and inter-node groups get separate communication streams), and each
  collective is labelled ``commfuse_dhelix_comm`` = "comm_local" / "comm_cross". On CPU (gloo)
  streams do not exist: the same order runs with asynchronous work handles.

Source: DHelix (Wang et al.), Sec. 4 (strand interleaving, Eq. 1-2); Centauri Sec. 3.2.3
(model level). Docs: docs/dhelix.md.
"""

from __future__ import annotations

from typing import Optional

from commfuse.core.meta import BARRIER_META, DHELIX_COMM_META, PHASE_META_KEY, STREAM_META, stream_hint
from commfuse.costmodel.simulator import NODE_COMPUTE, Simulator, tensor_bytes
from commfuse.dhelix.fused_partition import is_fused_graph
from commfuse.dhelix.interleave import InterleavePlan, plan_interleaving, segment_comm_kind, sequential_order
from commfuse.dhelix.overlap import OEFTable, default_oef
from commfuse.dhelix.profile import load_oef_profile
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.schedule.list_scheduler import apply_order, build_problem
from commfuse.schedule.model_level import GroupingCosts, best_grouping, microbatch_graph
from commfuse.transforms.schedule_overlap import _summary, default_estimator

COMM_META_KEY = DHELIX_COMM_META
FORWARD_STREAM = 1  # the forward strand's compute in paired steps; the backward strand stays on 0


def oef_table_for(path: Optional[str]) -> tuple[OEFTable, str]:
    if path is None:
        return default_oef(), "default (illustrative)"

    return load_oef_profile(path), path


def unit_size(ctx: PassContext, sim: Simulator) -> tuple[int, dict]:
    """Eq. 2 with L1 + L2 <= M (module docstring): the micro-batches one unit holds."""
    if not ctx.config.schedule_model_level:
        return 1, {"model_level": "off"}
    free = build_problem(ctx.gm, sim, ctx.ir, chain=())
    g = microbatch_graph(free)  # None without layers: one micro-batch per unit
    if g is None:
        return 1, {}
    n_layers, n_mb = max(1, len(g.layers)), len(g.mb_order)
    bwd = ctx.ir.backward_nodes
    ag = rs = fw = bw = 0.0
    idx = {n: i for i, n in enumerate(free.nodes)}
    for c in ctx.ir.collectives:
        i = idx[c.start]
        if c.kind is CollectiveKind.ALL_GATHER and c.start not in bwd:
            ag += free.time[i]
        elif c.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE) and c.start in bwd:
            rs += free.time[i]
    saved = 0
    for i in g.mb:
        if free.code[i] != NODE_COMPUTE:
            continue
        n = free.nodes[i]
        if n in bwd:
            bw += free.time[i]
        else:
            fw += free.time[i]
            # a forward value a backward node reads is an activation kept for backward
            if any(u in bwd for u in n.users):
                saved += sim.value_bytes(n)  # as the cost policy sizes it: what every rank shares
    x = GroupingCosts(
        c_ag=ag / n_layers,
        c_rs=rs / (n_layers * n_mb),
        c_fw=fw / (n_layers * n_mb),
        c_bw=bw / (n_layers * n_mb),
        m=saved / n_mb,
        memory=ctx.config.model_level_memory_bytes,
        microbatches=n_mb,
        concurrent=True,
    )
    sol = best_grouping(x)
    return max(1, min(sol.l1, sol.l2)), {"L1": sol.l1, "L2": sol.l2, "T_us": round(sol.t, 3)}


class DHelixInterleave(GraphPass):
    __doc__ = __doc__
    name = "dhelix_interleave"
    stage = Stage.SCHEDULE
    # DHelix interleaving reorders a fused train-step graph (micro-batch and phase tags; the fuzzer's
    # micro-batched joint programs): only the order changes, so values are bitwise equal; the two
    # strands' collectives interleave, so the issue order changes. tp/sp/fsdp/moe: the families of
    # the models it targets.
    fuzz = FuzzSpec(generators=("tp", "sp", "fsdp", "moe"), exact=True, microbatches=True)

    def run(self, ctx: PassContext) -> PassResult:
        if not is_fused_graph(ctx.gm):
            return PassResult(
                changed=False,
                refusals=[
                    "not a fused forward+backward train-step graph: nothing to interleave (compile_train_step with "
                    "Config(dhelix=True) and microbatches >= 2 builds one)"
                ],
            )
        local = [c.name for c in ctx.ir.collectives if c.extra.get("rank_local_sizes")]
        if local:
            # the plan is chosen from simulated costs: with sizes that differ per rank, ranks could
            # choose different orders and pair different collectives on one group
            return PassResult(
                changed=False,
                refusals=[
                    f"all_to_all {', '.join(local[:3])}{' ...' if len(local) > 3 else ''} has split sizes given per "
                    "rank (uneven or data-dependent): its cost, and so the interleaved order, could differ between "
                    "ranks; input order kept"
                ],
            )
        est, est_name = default_estimator(ctx)
        sim = Simulator(ctx.gm, est, ir=ctx.ir)
        oef, oef_name = oef_table_for(ctx.config.dhelix_oef_profile)
        group, eq2 = unit_size(ctx, sim)
        before = sim.simulate(record=False)
        seq_order = sequential_order(ctx.gm, sim, ctx.ir)
        sequential = sim.simulate(order=seq_order, record=False)
        plan = plan_interleaving(ctx.gm, sim, ctx.ir, est.topology, oef, group=group)
        decision: dict = {
            "graph": ctx.graph_kind,
            "estimator": est_name,
            "oef": oef_name,
            "eq2": eq2,
            "input": _summary(before),
            "sequential": _summary(sequential),
        }
        if isinstance(plan, str):
            return PassResult(changed=False, refusals=[plan], decisions=[decision])
        after = sim.simulate(order=plan.order, record=False)
        decision.update(
            {
                "plan": plan.summary(),
                "interleaved": _summary(after),
                "activation_peak_bytes": {
                    "sequential": activation_peak(sequential.peak_memory_bytes, ctx),
                    "interleaved": activation_peak(after.peak_memory_bytes, ctx),
                },
            }
        )
        limit = ctx.config.schedule_memory_budget * sequential.peak_memory_bytes
        if after.peak_memory_bytes > limit:
            # The non-interleaved order instead: its backwards run in micro-batch order, the order the
            # fused partition accumulates in, so it never holds more than the input order.
            use_seq = (
                seq_order != list(ctx.gm.graph.nodes)
                and sequential.peak_memory_bytes <= before.peak_memory_bytes
            )
            decision["kept"] = "sequential" if use_seq else "input"
            if use_seq:
                apply_order(ctx.gm, seq_order)
            return PassResult(
                changed=use_seq,
                decisions=[decision],
                refusals=[
                    f"interleaved peak memory {after.peak_memory_bytes} B exceeds schedule_memory_budget="
                    f"{ctx.config.schedule_memory_budget} x the non-interleaved step's {sequential.peak_memory_bytes} B: "
                    f"{decision['kept']} order kept"
                ],
            )
        decision["kept"] = "interleaved"
        changed = plan.order != list(ctx.gm.graph.nodes)
        if changed:
            apply_order(ctx.gm, plan.order)
        _annotate(ctx, plan)
        return PassResult(
            changed=changed,
            decisions=[decision],
            counts={
                "units": len(plan.units),
                "paired_segments": plan.summary()["pairs"],
                "collectives": len(ctx.ir.collectives),
            },
        )


def activation_peak(peak: int, ctx: PassContext) -> int:
    """Peak minus what the step must hold anyway at its end: the gradients it returns."""
    out = ctx.gm.graph.output_node()
    kept = sum(
        tensor_bytes(a.meta.get("val"))
        for a in out.all_input_nodes
        if a.op != "placeholder" and a.meta.get(PHASE_META_KEY) == "backward"
    )
    return max(0, int(peak) - int(kept))


def _annotate(ctx: PassContext, plan: InterleavePlan) -> None:
    """Stream of every collective and barrier interval of every planned node, for the lowering."""
    topo = default_estimator(ctx)[0].topology
    for c in ctx.ir.collectives:
        c.start.meta[COMM_META_KEY] = segment_comm_kind(c, topo)
    for n, s in plan.step_of.items():
        n.meta[BARRIER_META] = s
        if n.meta.get(PHASE_META_KEY) == "forward" and stream_hint(n) == 0 and _is_compute(n):
            n.meta[STREAM_META] = FORWARD_STREAM


def _is_compute(n) -> bool:
    return n.op == "call_function" and collective_spec(n.target) is None and not is_wait(n.target)
