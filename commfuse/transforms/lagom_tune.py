"""lagom_tune: choose each collective's communicator setting (Lagom) and record it on the graph.

Contract
- Matches: every collective of a scheduled graph (forward, backward, inference, or a whole
  ``make_fx`` training step) when the topology is a GPU/NCCL one (``num_sms > 0``). Runs
  on the graph's current order, so put it after the schedule passes
  (``Config(passes=[*DEFAULT_PIPELINE, "lagom_tune"])``); not in the default pipeline.
- Does: Lagom's search (``costmodel/lagom.py``: Algorithms 1-2 with the step rule written
  there, judged by the timeline simulator with contention from the settings in flight)
  picks per collective a setting -- channels NC, chunk C, threads NT (recorded) -- and
  writes it to ``start_node.meta["commfuse_comm_setting"]`` as a plain dict
  (``min_ctas``, ``max_ctas``, ``chunk_bytes``, ``nthreads``, ``pool_group_alias``,
  ``channels``, ``source``). With a communicator pool from
  ``commfuse.setup(communicator_ctas=...)`` NC is restricted to the pool's CTA
  configurations and ``pool_group_alias`` names the pool group the lowering issues the
  collective on (None: the graph's own group). Without a pool the settings are advisory
  (recorded, alias None). Every decision (per collective and a summary with the predicted
  makespan at NCCL's defaults and with the settings, the evaluation count, the step trace
  and the estimated memory of the extra communicators) goes into the pass report and so into
  ``pipeline.json`` of the dumps.
- Guarantees: no node is added, removed, reordered or changed -- only ``meta`` is written, so
  values are bitwise equal and the verifier's sequence hashes are unchanged. ``changed`` stays
  False: in commfuse ``changed`` means the graph's ops or order changed (it triggers recompile,
  verification and an ``after_<pass>`` dump whose code would be identical); the annotations are
  reported through ``counts`` and ``decisions``. Decisions come only from the graph, the
  topology, the config (``lagom_max_evaluations``, a count) and the pool ``commfuse.setup``
  created on every rank: the same settings on every rank.
- Leaves alone (reported): CPU/gloo topologies (gloo has none of these knobs: a no-op with a
  note), graphs without a topology or without collectives; collectives whose group has no
  pool communicator (kept on their own group); collectives with nothing to send.

Source: Lagom (Xu et al., §3.3-3.4: priority metric H, Algorithms 1-2); the per-communicator
CTA bounds of NCCL (``ncclConfig_t.minCTAs/maxCTAs``) as PyTorch exposes them.
"""

from __future__ import annotations

from dataclasses import asdict

from commfuse.core.meta import SETTING_META
from commfuse.costmodel.lagom import MEMORY_FORMULA, CommunicatorPool, lagom_search
from commfuse.costmodel.topology import PRESETS, Topology
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext


def session_pool(ctx: PassContext) -> CommunicatorPool | None:
    """The communicator pool ``commfuse.setup`` created in this process (None: none)."""
    return CommunicatorPool.from_plan(ctx.session.communicator_pool_plan)


class LagomTune(GraphPass):
    __doc__ = __doc__
    name = "lagom_tune"
    stage = Stage.SCHEDULE
    # Lagom communicator settings: the pass only writes node.meta (no node added, moved or changed), so
    # values must be bitwise equal and the collective sequence untouched. Fuzzed under a GPU topology
    # (DGX-H100 figures, 2 nodes x 2 ranks: intra- and inter-node groups) so the search really runs on
    # every family's collectives (a CPU topology makes it a no-op).
    fuzz = FuzzSpec(
        exact=True,
        keeps_collective_order=True,
        world_sizes=(4,),
        topology=Topology(
            **{**PRESETS["dgx-h100"], "name": "fuzz-gpu-2x2", "num_nodes": 2, "ranks_per_node": 2}
        ),
    )

    def run(self, ctx: PassContext) -> PassResult:
        topo = ctx.topology
        if topo is None:
            return PassResult(
                False,
                refusals=[
                    "no topology (Config.topology or commfuse.setup): no cost model to "
                    "tune communicator settings against"
                ],
            )
        if not topo.is_gpu:
            return PassResult(
                False,
                {"collectives_tuned": 0},
                decisions=[
                    {
                        "note": f"topology {topo.name!r} is a CPU/gloo topology (num_sms == 0): gloo has no per-collective "
                        "communicator settings (channels, chunk, threads); nothing tuned, graph unchanged"
                    }
                ],
            )
        ir = ctx.ir
        if not ir.collectives:
            return PassResult(
                False, {"collectives_tuned": 0}, decisions=[{"note": "no collectives: nothing to tune"}]
            )
        est = ctx.cost.model
        assert est is not None
        pool = session_pool(ctx)
        res = lagom_search(ctx.gm, est, pool=pool, max_evaluations=ctx.config.lagom_max_evaluations, ir=ir)
        decisions: list[dict] = [
            {
                "summary": "lagom",
                "graph": ctx.graph_kind,
                "predicted_makespan_default_us": res.makespan_default_us,
                "predicted_makespan_us": res.makespan_us,
                "predicted_speedup": res.speedup,
                "default": asdict(res.default) if res.default else None,
                "chosen": asdict(res.chosen) if res.chosen else None,
                "evaluations": res.evaluations,
                "brute_force_combinations": res.brute_force_combinations,
                "kept_default": res.kept_default,
                "budget_exhausted": res.budget_exhausted,
                "pool": None if pool is None else [list(c) for c in pool.ctas],
                "extra_communicators": dict(res.extra_communicators),
                "extra_memory_bytes_estimate": res.extra_memory_bytes,
                "memory_formula": MEMORY_FORMULA,
                "notes": list(res.notes),
                "trace": [asdict(s) for s in res.trace],
            }
        ]
        tuned = pooled = 0
        by_name = {c.name: c for c in ir.collectives}
        for c in ir.collectives:
            c.start.meta.pop(SETTING_META, None)  # a setting from an earlier run must not survive
        for name, s in res.settings.items():
            c = by_name[name]
            c.start.meta[SETTING_META] = s.to_meta()
            if s.source != "default":
                tuned += 1
            if s.pool_group_alias:
                pooled += 1
            default_us, chosen_us = res.comm_time_us.get(name, (None, None))
            decisions.append(
                {
                    "collective": name,
                    "kind": c.kind.value,
                    "group": c.group.name,
                    "setting": s.to_meta(),
                    "predicted_comm_us_default": default_us,
                    "predicted_comm_us": chosen_us,
                }
            )
        counts = {
            "collectives": len(ir.collectives),
            "settings_written": len(res.settings),
            "collectives_tuned": tuned,
            "pool_group_settings": pooled,
            "evaluations": res.evaluations,
        }
        return PassResult(False, counts, decisions=decisions)
