"""schedule_overlap: issue collectives early and waits late, in one total order, within memory limits.

Contract
- Matches: every scheduled graph (forward, backward, inference, or a whole ``make_fx``
  training step): its collectives, their waits and the compute between them.
- Does: builds a new order of the graph's nodes with a greedy list scheduler
  (``schedule.list_scheduler``) that simulates the machine while it orders: each collective is
  issued as soon as its inputs are computed, unless the bytes in flight on its process
  group's stream would pass ``Config.schedule_max_inflight_bytes`` or the live memory plus
  its output buffer would pass ``Config.schedule_memory_budget`` x the input order's peak;
  each wait goes right before the first node that needs its result; compute runs in
  program order except that compute which would block on an unfinished collective is
  postponed behind compute that would not, and compute the next collective needs goes
  first (Inductor-style). One picker setting is memory-aware: it repairs the order while
  building it, deferring compute that would take the live memory past the budget (now, or
  over the stretch of the input order it is moved across) and running ready nodes that free
  memory first, so that an order is not built over the budget only to be discarded (the
  other settings' over-budget orders are retried with the in-flight cap halved, then
  dropped). Several picker settings are tried, on the input order and on the
  preferred orders of Centauri's layer level (backward graphs, Eq. 1: ``layer_level``) and
  model level (``compile_train_step`` graphs, Eq. 2: ``model_level``); windows of the best order with
  the most exposed communication (at most ``Config.schedule_cpsat_max_nodes`` nodes) are then
  re-solved exactly with OR-Tools CP-SAT (``schedule.cpsat``). Every candidate is judged by
  the timeline simulator (``costmodel.simulator``) under the graph's estimator
  (``passmgr/cost.py``; without a topology, the DGX-H100 preset with enough nodes for the
  graph's ranks: the choice only ranks orders, it never changes values). The new order is
  kept only if its simulated makespan is not worse than the input order's and its peak
  memory is within the budget.
- Guarantees: a pure reorder: no node is added, removed or changed, so values are bitwise
  equal. The collectives keep their relative issue order across all process groups (the
  per-group sequence hashes and the total-order hash of the verifier are unchanged), so every
  rank issues the same collectives in the same order even where ranks' graphs differ in shapes
  or compute (uneven shards, per-rank p2p programs) and their cost estimates would differ --
  except when the layer-level candidate wins: it re-chains collectives inside a backward layer
  from the graph and the cost model (``Config.schedule_layer_level=False`` keeps the input
  order everywhere; the counts then say ``collectives_reordered``). The layer and model
  levels are not tried on a graph whose ranks may differ (point-to-point ops, per-rank
  all_to_all sizes, symbolic shapes: ``analysis.rank_local``); the decision says so.
  Every decision is a deterministic function of the graph, the config and the topology: ties
  break by original node index; CP-SAT runs with one worker, a fixed seed and a
  deterministic-time limit (never wall-clock). One ``decisions`` entry records the predicted
  makespan, exposed communication and peak memory of the input, every greedy candidate and
  the CP-SAT order; which was kept (``kept``: its label; ``winner``: ``greedy <knobs>``,
  ``greedy memory-repaired``, ``layer-level <knobs>``, ``model-level L=k <knobs>``, or
  ``cpsat (<the candidate it refined>)``); and, whichever wins, commfuse's own picker on its
  own (``own_picker``: the best list-scheduler order on the input order, before CP-SAT and
  without a level's preferred order).
- Never moves a node past a barrier: an op that mutates memory (``copy_``, in-place ops,
  input mutations), an in-place collective or its wait, an op called for its side effect.
  The graph is cut into segments at them; nodes stay in their segment. Ops that draw from
  the global RNG keep their relative order (the same numbers are drawn).
- Leaves alone (reported): graphs without collectives; graphs where no order beats the input's
  simulated makespan within the memory budget.

Source: Centauri §3.2 (operation- and layer-level scheduling: overlap each collective with
independent compute), the latency-hiding list schedulers of XLA and Inductor
(``overlap_scheduling.py``, ``comms.raise_comms`` / ``sink_waits``) for issue-early /
wait-late with in-flight and memory limits. Choices the paper leaves open: docs/scheduler.md.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch.fx as fx

from commfuse.analysis.rank_local import rank_local_reason
from commfuse.core.meta import microbatch_of
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.simulator import NODE_COLLECTIVE, NODE_COMPUTE, NODE_WAIT, SimResult, Simulator
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.schedule.cpsat import refine_windows, solver_missing
from commfuse.schedule.layer_level import backward_layers, chain_of, preferred_order
from commfuse.schedule.list_scheduler import (
    Priority,
    ScheduleProblem,
    apply_order,
    build_problem,
    list_schedule,
    max_inflight,
)
from commfuse.schedule.model_level import best_grouping, grouped_order, grouping_costs, microbatch_graph

# Picker settings tried, in this order (the first of equal makespans wins). The memory-aware one
# repairs orders the others would take over the memory budget (see ``list_schedule``).
PRIORITIES = (Priority(True, True), Priority(False, True), Priority(False, False), Priority(True, True, True))
# Schedules over the memory budget are retried with the in-flight cap halved, at most this often.
MEMORY_RETRIES = 6


def default_estimator(ctx: PassContext) -> tuple[AnalyticCostModel, str]:
    """The graph's estimator: the cost policy's model, or its documented default."""
    return ctx.cost.default_model(ctx.ir)


class Candidate(NamedTuple):
    """An order found for one scheduling problem (its collective chain is the problem's)."""

    problem: ScheduleProblem
    order: list[int]
    result: SimResult
    label: str


def candidate_name(label: str) -> str:
    """The candidate family of a greedy label, as the decisions name the winner: ``greedy <knobs>``,
    ``greedy memory-repaired``, ``layer-level <knobs>``, ``model-level L=k <knobs>``, ``cpsat (<base>)``."""
    base, refined, _ = label.partition("+cpsat")
    level, _, knobs = base.rpartition(":")
    if level == "layer":
        name = f"layer-level {knobs}"
    elif level.startswith("model"):
        name = f"model-level {level.partition(':')[2]} {knobs}"
    else:
        name = f"greedy {knobs}"
    return f"cpsat ({name})" if refined else name


def _summary(r: SimResult) -> dict:
    return {
        "makespan_us": round(float(r.makespan_us), 3),
        "exposed_comm_us": round(float(r.exposed_comm_us), 3),
        "peak_memory_bytes": int(r.peak_memory_bytes),
    }


class ScheduleOverlap(GraphPass):
    __doc__ = __doc__
    name = "schedule_overlap"
    stage = Stage.SCHEDULE
    # The overlap scheduler only reorders nodes: values bitwise equal, every family. Its layer level
    # (Eq. 1) re-chains collectives inside a backward layer, so the issue order may change where a graph
    # has backward nodes (tangent inputs or phase tags); the fuzzer's micro-batched joint programs are
    # the first fuzzed graphs with them, so the order contract is not claimed.
    fuzz = FuzzSpec(exact=True)
    # True in the fuzzer's schedule_overlap_layer_forced (commfuse.fuzz.forced): every graph is one
    # backward; only the layer-level order is tried
    force_layer_level = False

    def run(self, ctx: PassContext) -> PassResult:
        ir = ctx.ir
        if not ir.collectives:
            return PassResult(changed=False, refusals=["no collectives: nothing to overlap"])
        cfg = ctx.config
        est, est_name = default_estimator(ctx)
        sim = Simulator(ctx.gm, est, ir=ir)
        prob = build_problem(ctx.gm, sim, ir)
        original = list(range(prob.size))
        before = sim.simulate(record=False)
        mem_limit = max(
            cfg.schedule_memory_budget * before.peak_memory_bytes,
            before.peak_memory_bytes + (cfg.schedule_memory_headroom_bytes or 0),
        )
        inflight_limit = cfg.schedule_max_inflight_bytes

        def score(order: list[int]) -> SimResult:
            return sim.simulate(order=[prob.nodes[i] for i in order], record=False)

        def acceptable(order: list[int], r: SimResult) -> bool:
            if r.peak_memory_bytes > mem_limit:
                return False
            if inflight_limit is not None and max_inflight(prob, order) > max(
                inflight_limit, max_inflight(prob, original)
            ):
                return False
            return True

        def greedy(problem: ScheduleProblem, pname: str, tried: list) -> Optional[Candidate]:
            """Every picker setting on ``problem`` (with memory retries); the best within limits."""
            best = None
            for pr in PRIORITIES:
                if pr.memory_aware and pname != "input":
                    # a level's preferred order is judged as Eq. 1 / Eq. 2 chose it: one that keeps more
                    # live is rejected by the budget, not reshaped into another order
                    continue
                cap = inflight_limit
                for _attempt in range(MEMORY_RETRIES + 1):
                    res = list_schedule(problem, pr, max_inflight_bytes=cap, memory_limit=mem_limit)
                    r = score(res.order)
                    ok = acceptable(res.order, r)
                    label = (f"{pname}:" if pname != "input" else "") + pr.describe()
                    tried.append(
                        {
                            "priority": label,
                            "inflight_cap": cap,
                            **_summary(r),
                            "within_limits": ok,
                            "deferred_inflight": res.deferred_inflight,
                            "deferred_memory": res.deferred_memory,
                            "forced": res.forced,
                        }
                    )
                    if ok and (best is None or r.makespan_us < best.result.makespan_us):
                        best = Candidate(
                            problem, res.order, r, label + (f",cap={cap}" if cap != inflight_limit else "")
                        )
                    if ok or r.peak_memory_bytes <= mem_limit:
                        break
                    # Over the memory budget: buffers issued early stay live across the input order's
                    # peak. Prefetch less: halve the bytes one stream may hold in flight (the check at
                    # issue time only sees the memory of that moment, not the peak ahead of it).
                    held = max_inflight(problem, res.order)
                    if held <= 1 or (cap is not None and held > cap):  # one collective alone: no progress
                        break
                    cap = held // 2
            return best

        def judge(problem: ScheduleProblem, depth_first: bool) -> dict:
            found = greedy(problem, "brute", [])
            if found is not None and (not depth_first or found.result.makespan_us <= before.makespan_us):
                return {**_summary(found.result), "within_limits": True}
            # depth-first is the captured order: the pass can always keep it as it is
            return {**_summary(before), "within_limits": True} if depth_first else {"within_limits": False}

        problems = [] if self.force_layer_level else [("input", prob)]
        layer_info = model_info = None
        # The levels re-chain collectives from the graph's costs: where ranks may hold different
        # graphs or sizes, their chains could differ between ranks (and hang them), so only the
        # input's collective order is scheduled around.
        local = None if self.force_layer_level else rank_local_reason(ir.collectives, ctx.gm)
        want_layer = self.force_layer_level or (
            cfg.schedule_layer_level and bool(ir.backward_nodes) and local is None
        )
        want_model = (
            cfg.schedule_model_level
            and not self.force_layer_level
            and local is None
            and any(microbatch_of(n) is not None for n in ctx.gm.graph.nodes)
        )
        # the problem without a collective chain: the levels build their preferred orders on it
        free = build_problem(ctx.gm, sim, ir, chain=()) if want_layer or want_model else None
        if want_layer:
            lprob, layer_info = _layer_level_problem(ctx.gm, sim, ir, free, self.force_layer_level)
            if lprob is not None:
                problems.append(("layer", lprob))
        if want_model:
            mprob, model_info = _model_level_problem(
                ctx.gm, sim, ir, free, cfg.model_level_memory_bytes, judge, cfg.model_level_brute_force
            )
            if mprob is not None:
                problems.append((f"model:L={model_info['eq2']['L']}", mprob))
        best: Optional[Candidate] = None
        own: Optional[Candidate] = None
        tried: list = []
        for pname, problem in problems:
            found = greedy(problem, pname, tried)
            if pname == "input":
                own = found
            if found is not None and (best is None or found.result.makespan_us < best.result.makespan_us):
                best = found
        decision: dict = {
            "graph": ctx.graph_kind,
            "estimator": est_name,
            "nodes": prob.size,
            "segments": len(prob.segments),
            "collectives": len(prob.collectives),
            "input": _summary(before),
            "greedy": tried,
        }
        if local is not None:
            decision["levels_skipped"] = f"{local}: the collective order is kept as the input has it"
        if layer_info is not None:
            decision["layer_level"] = layer_info
        if model_info is not None:
            decision["model_level"] = model_info
        missing = solver_missing() if cfg.schedule_cpsat_max_nodes > 0 else None
        cpsat_info: dict = {"enabled": cfg.schedule_cpsat_max_nodes > 0 and missing is None}
        if missing is not None:
            cpsat_info["why"] = missing
        if best is not None and cpsat_info["enabled"]:
            order, r, cpsat_info = refine_windows(
                best.problem,
                sim,
                best.order,
                best.result,
                max_nodes=cfg.schedule_cpsat_max_nodes,
                det_time_s=cfg.schedule_cpsat_time_limit_s,
                acceptable=acceptable,
                memory_limit=mem_limit,
            )
            cpsat_info["greedy_makespan_us"] = round(float(best.result.makespan_us), 3)
            if r.makespan_us < best.result.makespan_us:
                best = Candidate(best.problem, order, r, best.label + "+cpsat")
        decision["cpsat"] = cpsat_info
        refusals: list[str] = []
        if not problems:
            refusals.append(
                "no layer has a layer-level choice (collectives of other kinds or roles): order kept"
            )
        elif best is None:
            refusals.append("every greedy order exceeds the memory budget or the in-flight limit: order kept")
        elif best.result.makespan_us > before.makespan_us and not self.force_layer_level:
            refusals.append(
                f"best order predicted slower ({float(best.result.makespan_us):.1f} us) than the input's "
                f"({float(before.makespan_us):.1f} us): order kept"
            )
            best = None
        changed = best is not None and best.order != original
        decision["kept"] = best.label if changed else "input"
        decision["winner"] = candidate_name(best.label) if changed else "input"
        # commfuse's own picker (the list scheduler on the input order, no CP-SAT, no level's order),
        # reported on its own whichever candidate wins
        decision["own_picker"] = (
            {"candidate": candidate_name(own.label), **_summary(own.result)}
            if own is not None
            else {"candidate": None, "within_limits": False}
        )
        decision["output"] = _summary(best.result) if changed else decision["input"]
        counts = {"collectives": len(prob.collectives)}
        if changed:
            assert best is not None
            counts.update(_moves(prob, best.order))
            if best.problem is not prob:
                counts["collectives_reordered"] = sum(
                    a != b for a, b in zip(prob.collectives, best.problem.collectives, strict=True)
                )
            _check_collective_order(best.problem, best.order)
            apply_order(ctx.gm, [prob.nodes[i] for i in best.order])
        return PassResult(changed=changed, counts=counts, refusals=refusals, decisions=[decision])


def _layer_level_problem(
    gm: fx.GraphModule, sim: Simulator, ir, free: ScheduleProblem, every_node: bool = False
) -> tuple[Optional[ScheduleProblem], dict]:
    """The backward's layer-level problem (Eq. 1): chain and baseline order from each layer's choice."""
    layers = backward_layers(free, ir, every_node=every_node)
    info: dict = {"layers": [lay.describe() for lay in layers]}
    order = preferred_order(free, layers)
    if order is None:
        info["applied"] = False
        return None, info
    info["applied"] = True
    return build_problem(gm, sim, ir, chain=chain_of(free, order), baseline=order), info


def _model_level_problem(
    gm: fx.GraphModule,
    sim: Simulator,
    ir,
    free: ScheduleProblem,
    memory: Optional[int],
    judge,
    brute_force: bool,
) -> tuple[Optional[ScheduleProblem], Optional[dict]]:
    """A train-step graph's model-level problem (Eq. 2): micro-batches in groups of the solved L.
    With ``brute_force`` every L is also scheduled and judged, to check Eq. 2 against."""
    g = microbatch_graph(free)
    if g is None:
        return None, None
    x = grouping_costs(free, ir, g, memory)
    sol = best_grouping(x)
    group = sol.l2 if ir.backward_nodes else sol.l1
    info: dict = {
        "phase": "backward" if ir.backward_nodes else "forward",
        "microbatches": x.microbatches,
        "layers": len(g.layers),
        "inputs_us_bytes": {
            k: round(float(v), 3)
            for k, v in (("C_AG", x.c_ag), ("C_RS", x.c_rs), ("C_fw", x.c_fw), ("C_bw", x.c_bw), ("m", x.m))
        },
        "memory_M": memory,
        "eq2": {"L1": sol.l1, "L2": sol.l2, "T_us": round(sol.t, 3), "L": group},
    }

    def problem_for(k: int) -> ScheduleProblem:
        # L = 1 is the order the graph was captured in (one micro-batch after the other). The
        # collectives keep the input's issue order: the grouping only says which compute the
        # scheduler prefers (regrouping the gradient reductions themselves is not done).
        order = grouped_order(free, g, k) if k > 1 else list(range(free.size))
        return build_problem(gm, sim, ir, baseline=order)

    chosen = problem_for(group) if group > 1 else None
    if brute_force:  # every L scheduled and simulated: what Eq. 2 is checked against
        brute = [{"L": k, **judge(problem_for(k), k == 1)} for k in range(1, x.microbatches + 1)]
        info["brute_force"] = brute
        ok = [b for b in brute if b["within_limits"]]  # judge(): the scheduler's best within limits
        info["brute_force_best_L"] = min(ok, key=lambda b: (b["makespan_us"], b["L"]))["L"] if ok else None
    return chosen, info


def _moves(p: ScheduleProblem, order: list[int]) -> dict[str, int]:
    """How many collectives were issued, and waits placed, after fewer / more compute nodes."""

    def compute_before(seq: list[int]) -> dict[int, int]:
        out, k = {}, 0
        for i in seq:
            if p.code[i] == NODE_COMPUTE:
                k += 1
            elif p.code[i] in (NODE_COLLECTIVE, NODE_WAIT):
                out[i] = k
        return out

    a, b = compute_before(list(range(p.size))), compute_before(order)
    raised = sum(1 for i in a if p.code[i] == NODE_COLLECTIVE and b[i] < a[i])
    sunk = sum(1 for i in a if p.code[i] == NODE_WAIT and b[i] > a[i])
    return {"collectives_raised": raised, "waits_sunk": sunk}


def _check_collective_order(p: ScheduleProblem, order: list[int]) -> None:
    colls = [i for i in order if i in p.coll_bytes]
    if colls != p.collectives:  # a scheduler bug: would hang ranks whose graphs differ
        raise RuntimeError("schedule_overlap: the new order changes the collectives' issue order")
