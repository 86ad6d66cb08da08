"""commfuse's scheduling next to Inductor's overlap scheduler: same graphs, same estimates, one judge.

What is compared
    Three blocks, each as the forward and the backward post-partition ATen graph AOTAutograd
    hands a backend (``commfuse.testing.graphs.capture_aot_graphs``), traced on a ``fake``
    process group of 16 ranks = DGX-H100 x2 (two nodes of eight), fp32:

    * ``llama_tp_sp``: a Llama-style decoder layer, Megatron TP + SP over the 8 ranks of one
      node (mesh ``("dp", "tp") = (2, 8)``; the ``dp`` dim only places the TP group);
    * ``simple_fsdp``: the same layer with SimpleFSDP ``fully_shard`` over all 16 ranks
      (``partition_report``'s LAYER shapes);
    * ``moe_sp_ep_sp``: SP attention + a GShard MoE written in plain PyTorch
      (``commfuse.models.moe_styles``, static capacity, explicit ``all_to_all_single``),
      EP = TP = the 8 ranks of one node.

    Each graph is scheduled four ways ("rows"), each on its own copy of the captured graph:

    * ``input``: the captured order, untouched;
    * ``inductor``: ``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing``
      via ``schedule_overlap_bucketing_from_inductor_configs`` (how Inductor's post-grad pass
      calls it when ``aten_distributed_optimizations.enable_overlap_scheduling`` is on), with
      the defaults of torch 2.13's config except the knobs below;
    * ``commfuse``: commfuse's default pipeline (``commfuse.optimize`` with
      ``Config(topology=DGX-H100 x2)``: moe_recognition (pre-autograd, a no-op on these
      graphs), chimera, schedule_overlap, bucket_collectives, sink_waits) -- it may change the
      collectives themselves;
    * ``commfuse_reorder``: ``schedule_overlap`` alone (a pure reorder, like Inductor's
      scheduler without its pre-bucketing);
    * ``commfuse_picker``: commfuse's own picker alone: ``schedule_overlap`` with CP-SAT and
      the layer and model levels off, i.e. the best of the list scheduler's settings (the
      memory-repaired one included) on the input order.

    The commfuse rows name the candidate that won (``schedule_overlap``'s ``decisions``:
    ``greedy memory-repaired``, ``cpsat (layer-level ...)``, ...; ``reverted`` where the
    pipeline's step-time gate undid the pass), and every row's peak memory is printed next to
    its allowance: commfuse's ``schedule_memory_budget`` x the input order's peak, Inductor's
    input peak + max(1 GiB, 5 %) (the judge's input peak standing in for Inductor's own
    baseline estimate); the ``input`` row shows its own peak there.

    The commfuse rows run with commfuse's defaults: a memory allowance of +10 % over the input
    order's simulated peak (``Config.schedule_memory_budget``), tighter than Inductor's default
    (the larger of +1 GiB and +5 % over its own baseline).

    Judge: ONE ``costmodel.simulator.Simulator`` with ``AnalyticCostModel(dgx-h100 x2,
    backend="nccl")`` on every scheduled graph: exposed communication, makespan, peak memory.

Same runtime estimates
    Inductor gets ``custom_runtime_estimation = SimulatorEstimates(model)``: for every node
    it returns ``Simulator(graph, model).node_info(node).time_us / 1000`` (ms), i.e. exactly
    the judge's time for that node -- compute nodes (roofline per op family), collectives
    (NCCL algorithm model on the topology), 0 for waits, views and other free nodes. The
    simulator is built on the graph Inductor is scheduling and estimates nodes it has not
    seen lazily, so collectives Inductor creates (its FSDP pre-bucketing) are priced from
    the node itself, not from a precomputed table. ``override_size`` (Inductor asks for a
    collective's latency as its time at size 0) is answered by the same collective model
    at the message size scaled by ``override_size / Inductor's size of the node``, with at
    least one byte: commfuse's model gives 0 for an empty message, its fixed cost at 1 byte.
    Every call is counted per node class (``estimate_calls``).

Inductor knobs (``config.aten_distributed_optimizations``; everything else at its default:
``collective_bucketing`` off, ``pre_bucketing_fsdp_collectives`` on, memory budget
``max(1 GB, 5 %)`` over its own baseline, ``max_in_flight_gb`` 5, ``max_compute_pre_fetch``
200, ``bucket_mode`` "default")
    * ``custom_runtime_estimation``: as above;
    * ``compute_estimator="analytical"`` (default "benchmark"): in benchmark mode the custom
      value is only used after a lookup in Inductor's on-disk benchmark cache (a stale entry
      would win), real tensors are allocated per compute node and the medians are
      all-gathered over the default group (meaningless on a fake group). In analytical mode
      the alignment step keeps the custom estimates untouched;
    * ``enable_fusion_regions=False`` (config default True): fusion-aware costs would
      REPLACE the custom estimates of fusible nodes, i.e. Inductor would schedule with times
      the judge does not use;
    * ``insert_overlap_deps=False`` (Inductor's post-grad pass forces True): the control-dep
      HOPs only pin the chosen order for Inductor's own later scheduler; without them the
      graph's node order IS the schedule and the simulator can run it unchanged.

    Patched for the run only: ``torch._inductor.comm_analysis.get_gpu_type`` returns HOPPER
    (see ``benchmarks/inductor_estimator.py``): the FSDP pre-bucketing sizes its buckets from
    Inductor's NCCL model, which would otherwise assume an A100 on a CPU-only machine; and
    ``torch.utils._runtime_estimation.get_gpu_dram_gbps`` returns 3350 (H100 HBM3): Inductor
    computes a roofline for every compute node before the custom estimate replaces it, and
    that lookup needs Triton, absent on CPU (the value is discarded).

Pass/fail rule (computed, printed)
    Per block (forward + backward together: exposed comm summed, peak = max of the two
    graphs' peaks) and, separately, per graph: commfuse's exposed communication must be
    lower than Inductor's (by more than 0.1 %, ``LOWER_EPS``) on at least two of the three blocks, never more than 5 %
    higher on any (ratio commfuse / inductor <= 1.05; both zero counts as 1.0), and its peak
    memory at most 5 % above Inductor's. Judged for the default pipeline (the row that
    counts) and, for information, for ``schedule_overlap`` alone. Per-graph verdicts use
    ``k / 6`` with the same thresholds. Separately (``picker_check``): commfuse's own picker's
    exposed communication at most Inductor's on every graph, and its peak within commfuse's
    allowance.

    python benchmarks/run.py --overlap-vs-inductor [--json out.json]
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import time
from typing import Any, Callable, Iterator

TOPOLOGY = ("dgx-h100", 2)
WORLD, NODE = 16, 8
FULL = {
    "llama_tp_sp": dict(dim=2048, n_heads=16, ffn_dim=8192, batch=1, seq=2048),
    "simple_fsdp": dict(dim=2048, n_heads=16, ffn_dim=8192, batch=1, seq=2048),
    "moe_sp_ep_sp": dict(dim=1024, n_heads=16, ffn_dim=2048, experts=8, batch=1, seq=2048),
}
SMALL = {
    "llama_tp_sp": dict(dim=64, n_heads=8, ffn_dim=128, batch=1, seq=64),
    "simple_fsdp": dict(dim=64, n_heads=8, ffn_dim=128, batch=1, seq=64),
    "moe_sp_ep_sp": dict(dim=64, n_heads=8, ffn_dim=64, experts=8, batch=1, seq=64),
}
ROWS = ("input", "inductor", "commfuse", "commfuse_reorder", "commfuse_picker")
# commfuse's own picker alone: the list scheduler on the input order, without CP-SAT or a level's order
PICKER_ONLY = {"schedule_cpsat_max_nodes": 0, "schedule_layer_level": False, "schedule_model_level": False}
INDUCTOR_MEMORY = (2**30, 0.05)  # Inductor's default allowance over its baseline: max(+1 GiB, +5 %)
KINDS = ("forward", "backward")
TOLERANCE = 1.05
LOWER_EPS = 1e-3

__all__ = ["SimulatorEstimates", "overlap_tables", "run_overlap_vs_inductor"]


# ----------------------------------------------------------------- the shared estimates
class SimulatorEstimates:
    """Inductor's ``custom_runtime_estimation(node, override_size) -> ms``, answered by the judge.

    One ``Simulator`` per graph (keyed by the GraphModule object, kept alive here so ids are
    never reused); new nodes are estimated lazily by the simulator itself."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: collections.Counter[str] = collections.Counter()
        self.seen: dict[int, set[str]] = {}  # id(graph module) -> names of the nodes answered
        self._sims: dict[int, tuple[Any, Any]] = {}
        self._irs: dict[int, Any] = {}

    def _sim(self, gm: Any) -> Any:
        from commfuse.costmodel.simulator import Simulator

        hit = self._sims.get(id(gm))
        if hit is None or hit[0] is not gm:
            hit = self._sims[id(gm)] = (gm, Simulator(gm, self.model))
        return hit[1]

    def __call__(self, node: Any, override_size: int | None = None) -> float:
        from commfuse.costmodel.simulator import NODE_COLLECTIVE, NODE_COMPUTE, NODE_WAIT

        gm = node.graph.owning_module
        info = self._sim(gm).node_info(node)
        self.seen.setdefault(id(gm), set()).add(node.name)
        self.calls[
            {NODE_COLLECTIVE: "collective", NODE_COMPUTE: "compute", NODE_WAIT: "wait"}.get(info.code, "free")
        ] += 1
        if override_size is None or info.code != NODE_COLLECTIVE:
            return info.time_us / 1000.0
        self.calls["collective_override_size"] += 1
        return self._resized(node, override_size) / 1000.0

    def _resized(self, node: Any, override_size: int) -> float:
        import torch._inductor.comm_analysis as ca

        from commfuse.ir import CollectiveIR

        gm = node.graph.owning_module
        ir = self._irs.get(id(gm))
        if ir is None or all(c.start is not node for c in ir.collectives):
            ir = self._irs[id(gm)] = CollectiveIR(gm)
        c = next(c for c in ir.collectives if c.start is node)
        theirs = max(1, ca.estimate_fx_collective_size(node))
        scale = override_size / theirs

        def scaled(b: Any) -> Any:
            return None if b is None else max(1, int(int(b) * scale))

        return self.model.collective(
            dataclasses.replace(c, input_bytes=scaled(c.input_bytes), output_bytes=scaled(c.output_bytes))
        ).time_us


@contextlib.contextmanager
def _inductor_patched(estimate: Callable[..., float]) -> Iterator[None]:
    import torch._inductor.comm_analysis as ca
    from torch._inductor import config

    import torch.utils._runtime_estimation as rt

    saved = ca.get_gpu_type, rt.get_gpu_dram_gbps
    ca.get_gpu_type = lambda: ca.NVIDIA_GPU_TYPE.HOPPER  # DGX-H100, not the CPU fallback (A100)
    # Inductor computes a roofline for every compute node before the custom estimate replaces
    # it; its DRAM bandwidth comes from Triton, absent on CPU. H100 SXM HBM3; value discarded.
    rt.get_gpu_dram_gbps = lambda: 3350
    try:
        with config.patch(
            {
                "aten_distributed_optimizations.custom_runtime_estimation": estimate,
                "aten_distributed_optimizations.compute_estimator": "analytical",
                "aten_distributed_optimizations.enable_fusion_regions": False,
                "aten_distributed_optimizations.insert_overlap_deps": False,
            }
        ):
            yield
    finally:
        ca.get_gpu_type, rt.get_gpu_dram_gbps = saved


# ----------------------------------------------------------------- schedulers
def _copy(gm: Any) -> Any:
    import torch.fx as fx

    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = dict(gm.meta)
    return new


def _inductor(gm: Any, estimate: SimulatorEstimates) -> tuple[Any, float]:
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing_from_inductor_configs

    gm = _copy(gm)
    t = time.perf_counter()
    with _inductor_patched(estimate):
        out = schedule_overlap_bucketing_from_inductor_configs(gm)
    seconds = time.perf_counter() - t
    out.graph.lint()
    out.recompile()
    # every node Inductor's schedule holds must have been priced by the judge's estimates
    seen = estimate.seen.get(id(out), set())
    out.meta["not_estimated"] = [
        n.name for n in out.graph.nodes if n.op == "call_function" and n.name not in seen
    ]
    return out, seconds


def _commfuse(gm: Any, topo: Any, kind: str, passes: list[str] | None, **options: Any) -> tuple[Any, float]:
    import commfuse

    gm = _copy(gm)
    t = time.perf_counter()
    # commfuse's defaults: its memory allowance (+10 % of the input order's peak) is tighter than
    # Inductor's (the larger of +1 GiB and +5 %); Config.schedule_memory_headroom_bytes=2**30
    # would give it Inductor's.
    commfuse.optimize(
        gm, commfuse.Config(passes=passes, topology=topo, strict=True, **options), graph_kind=kind
    )
    return gm, time.perf_counter() - t


def _candidate(gm: Any) -> dict[str, Any]:
    """Which ``schedule_overlap`` candidate won on ``gm``, and its own picker's result."""
    from commfuse.api import last_report

    rep = last_report(gm)
    for rec in rep.passes if rep is not None else []:
        if rec.name == "schedule_overlap" and rec.decisions:
            d = rec.decisions[0]
            reverted = any(x.get("gate") == "reverted" for x in rec.decisions)
            return {
                "candidate": "reverted" if reverted else d.get("winner", d.get("kept")),
                "own_picker": d.get("own_picker"),
            }
    return {"candidate": "not run", "own_picker": None}


# ----------------------------------------------------------------- judging
def collective_multiset(gm: Any) -> dict[str, dict[str, int]]:
    """Per ``kind@group``: how many collectives and their total logged bytes (a reorder keeps
    both; a bucketing keeps the bytes and lowers the count)."""
    from commfuse.costmodel.collectives import message_bytes
    from commfuse.ir import CollectiveIR

    out: dict[str, dict[str, int]] = {}
    for c in CollectiveIR(gm).collectives:
        d = out.setdefault(f"{c.kind.value}@{c.group.name}", {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += message_bytes(c)
    return out


def _judge(gm: Any, seconds: float, model: Any) -> dict[str, Any]:
    from commfuse.costmodel.simulator import simulate

    sim = simulate(gm, model)
    s = sim.summary()
    extra = {"not_estimated": gm.meta["not_estimated"]} if "not_estimated" in gm.meta else {}
    worst = sorted(sim.collectives, key=lambda c: c.hidden_us - c.duration_us)[:3]
    return {
        "exposed_comm_us": s["exposed_comm_us"],
        "makespan_us": s["makespan_us"],
        "peak_memory_bytes": s["peak_memory_bytes"],
        "comm_us": s["comm_us"],
        "compute_us": s["compute_us"],
        "collectives": len(sim.collectives),
        "scheduler_s": seconds,
        "multiset": collective_multiset(gm),
        # the collectives least covered by compute: where the exposed time comes from
        "least_hidden": [
            {
                "name": c.name,
                "kind": c.kind,
                "group": c.group,
                "duration_us": c.duration_us,
                "hidden_us": c.hidden_us,
            }
            for c in worst
        ],
        **extra,
    }


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return 1.0 if a == 0 else float("inf")
    return a / b


def verdict(pairs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """``pairs``: (label, ours, inductor) with ``exposed_comm_us`` / ``peak_memory_bytes``."""
    # "lower" = lower by more than LOWER_EPS relative: sub-0.1 % differences are float noise
    # of two orders that differ only in where zero-time nodes sit
    lower = [lbl for lbl, a, b in pairs if a["exposed_comm_us"] < b["exposed_comm_us"] * (1 - LOWER_EPS)]
    exposed = {lbl: _ratio(a["exposed_comm_us"], b["exposed_comm_us"]) for lbl, a, b in pairs}
    peak = {lbl: _ratio(a["peak_memory_bytes"], b["peak_memory_bytes"]) for lbl, a, b in pairs}
    n = len(pairs)
    need = (2 * n + 2) // 3  # "two of the three", scaled to n
    ok = len(lower) >= need and max(exposed.values()) <= TOLERANCE and max(peak.values()) <= TOLERANCE
    return {
        "lower": lower,
        "of": n,
        "need": need,
        "exposed_ratio": exposed,
        "peak_ratio": peak,
        "worst_exposed_ratio": max(exposed.values()),
        "worst_peak_ratio": max(peak.values()),
        "pass": ok,
    }


def picker_check(pairs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """commfuse's own picker: exposed comm at most Inductor's on every graph, peak within its allowance."""
    worse = [lbl for lbl, a, b in pairs if a["exposed_comm_us"] > b["exposed_comm_us"] * (1 + LOWER_EPS)]
    over = [lbl for lbl, a, _ in pairs if a["peak_memory_bytes"] > a["allowance_bytes"]]
    return {
        "not_above_inductor": [lbl for lbl, _, _ in pairs if lbl not in worse],
        "above_inductor": worse,
        "over_allowance": over,
        "met": not worse and not over,
    }


def _block_total(graphs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "exposed_comm_us": sum(g["exposed_comm_us"] for g in graphs.values()),
        "makespan_us": sum(g["makespan_us"] for g in graphs.values()),
        "peak_memory_bytes": max(g["peak_memory_bytes"] for g in graphs.values()),
    }


# ----------------------------------------------------------------- workloads
def _capture_tp(mesh: Any, s: dict[str, int]) -> Any:
    from commfuse.models import llama
    from commfuse.testing.graphs import capture_aot_graphs

    tp = mesh["tp"]
    cfg = llama.LlamaConfig(n_layers=1, dim=s["dim"], n_heads=s["n_heads"], ffn_dim=s["ffn_dim"])
    model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), tp, sequence_parallel=True)
    data = llama.make_inputs(cfg, s["batch"], s["seq"], rank=0, world_size=tp.size(), sequence_parallel=True)
    return capture_aot_graphs(model, data.inputs, loss=lambda out: llama.loss_fn(out, data))


def _capture_moe(mesh: Any, s: dict[str, int]) -> Any:
    import torch

    from commfuse.models import moe_styles as ms
    from commfuse.testing.graphs import capture_aot_graphs

    tp = mesh["tp"]
    cfg = ms.MoEStyleConfig(
        style="gshard",
        dim=s["dim"],
        num_experts=s["experts"],
        ffn_dim=s["ffn_dim"],
        top_k=2,
        capacity_factor=1.25,
        n_heads=s["n_heads"],
    )
    block = ms.parallelize_moe_style_tp(ms.build_moe_style_tp(cfg), tp, "sp_ep_sp")
    x = torch.randn(s["batch"], s["seq"] // tp.size(), s["dim"], generator=torch.Generator().manual_seed(1))
    return capture_aot_graphs(block, x, loss=lambda out: out[0].float().pow(2).mean() + 0.01 * out[1])


def _capture_fsdp(mesh: Any, s: dict[str, int]) -> Any:
    from benchmarks.schedule_report import _fsdp_graphs

    return _fsdp_graphs(
        mesh, dict(n_layers=1, dim=s["dim"], n_heads=s["n_heads"], ffn_dim=s["ffn_dim"]), s["batch"], s["seq"]
    )


# block -> (mesh shape, mesh dim names, capture)
_BLOCKS: dict[str, tuple[tuple[int, ...], tuple[str, ...], Callable[[Any, dict[str, int]], Any]]] = {
    "llama_tp_sp": ((WORLD // NODE, NODE), ("dp", "tp"), _capture_tp),
    "simple_fsdp": ((WORLD,), ("fsdp",), _capture_fsdp),
    "moe_sp_ep_sp": ((WORLD // NODE, NODE), ("dp", "tp"), _capture_moe),
}


def _describe(block: str, s: dict[str, int]) -> str:
    par = {
        "llama_tp_sp": "TP+SP over 8 ranks (one node)",
        "simple_fsdp": "SimpleFSDP fully_shard over 16 ranks",
        "moe_sp_ep_sp": f"SP attention + GShard MoE ({s.get('experts')} experts, top-2, capacity 1.25), "
        "EP = TP over 8 ranks",
    }[block]
    return f"{par}; dim {s['dim']}, heads {s['n_heads']}, ffn {s['ffn_dim']}, batch {s['batch']}, seq {s['seq']}, fp32"


def run_overlap_vs_inductor(small: bool = False) -> dict[str, Any]:
    """Capture, schedule four ways, judge; ``small=True``: tiny shapes (tests)."""
    import commfuse
    from commfuse.costmodel import AnalyticCostModel, Topology
    from commfuse.testing.fake_pg import fake_mesh

    preset, nodes = TOPOLOGY
    topo = Topology.preset(preset, num_nodes=nodes)
    model = AnalyticCostModel(topo, backend="nccl")
    sizes = SMALL if small else FULL
    estimate = SimulatorEstimates(model)
    blocks: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for block, (shape, names, capture) in _BLOCKS.items():
        with fake_mesh(topo.world_size, shape, names) as mesh:
            commfuse.setup(topology=topo, mesh=mesh)
            try:
                t = time.perf_counter()
                graphs = capture(mesh, sizes[block])
                capture_s = time.perf_counter() - t
                rows: dict[str, dict[str, Any]] = {r: {} for r in ROWS}
                for kind in KINDS:
                    gm = graphs[kind]
                    rows["input"][kind] = _judge(_copy(gm), 0.0, model)
                    rows["inductor"][kind] = _judge(*_inductor(gm, estimate), model=model)
                    for row, passes, options in (
                        ("commfuse", None, {}),
                        ("commfuse_reorder", ["schedule_overlap"], {}),
                        ("commfuse_picker", ["schedule_overlap"], PICKER_ONLY),
                    ):
                        out, secs = _commfuse(gm, topo, kind, passes, **options)
                        rows[row][kind] = {**_judge(out, secs, model), **_candidate(out)}
                    peak = rows["input"][kind]["peak_memory_bytes"]
                    budget = commfuse.Config().schedule_memory_budget
                    for row in ROWS:
                        rows[row][kind]["allowance_bytes"] = (
                            peak + max(INDUCTOR_MEMORY[0], INDUCTOR_MEMORY[1] * peak)
                            if row == "inductor"
                            else budget * peak
                            if row.startswith("commfuse")
                            else peak
                        )
            finally:
                commfuse.session.reset()
        for r in ROWS:
            rows[r]["block"] = _block_total({k: rows[r][k] for k in KINDS})
        blocks.append(
            {
                "block": block,
                "workload": _describe(block, sizes[block]),
                "capture_s": capture_s,
                "nodes": {k: len(graphs[k].graph.nodes) for k in KINDS},
                "rows": rows,
            }
        )

    def pairs(ours: str, per_graph: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        keys = KINDS if per_graph else ("block",)
        return [
            (f"{b['block']}/{k}" if per_graph else b["block"], b["rows"][ours][k], b["rows"]["inductor"][k])
            for b in blocks
            for k in keys
        ]

    return {
        "topology": f"{preset} x{nodes} ({topo.world_size} ranks), analytic model, backend nccl",
        "small": small,
        "blocks": blocks,
        "verdict": {
            ours: {"per_block": verdict(pairs(ours, False)), "per_graph": verdict(pairs(ours, True))}
            for ours in ("commfuse", "commfuse_reorder")
        },
        "picker_check": picker_check(pairs("commfuse_picker", True)),
        "estimate_calls": dict(estimate.calls),
        "inductor_knobs": {
            "compute_estimator": "analytical",
            "enable_fusion_regions": False,
            "insert_overlap_deps": False,
            "custom_runtime_estimation": "SimulatorEstimates",
            "get_gpu_type": "HOPPER (patched)",
            "other": "torch 2.13 defaults",
        },
        "wall_s": time.perf_counter() - t_all,
    }


# ----------------------------------------------------------------- tables
def _verdict_line(name: str, v: dict[str, Any], unit: str) -> str:
    return (
        f"  {name:<18} {unit}: lower on {len(v['lower'])}/{v['of']} (need {v['need']}), worst exposed ratio "
        f"{v['worst_exposed_ratio']:.3f}, worst peak ratio {v['worst_peak_ratio']:.3f} "
        f"(<= {TOLERANCE}) -> {'PASS' if v['pass'] else 'FAIL'}"
    )


def overlap_tables(doc: dict[str, Any]) -> str:
    lines = [
        f"commfuse vs Inductor's overlap scheduler -- {doc['topology']}; same per-node estimates "
        "(Inductor's custom_runtime_estimation = the judge's), one simulator judges all"
    ]
    head = (
        f"  {'row':<17}{'graph':<9}{'exposed us':>11}{'makespan us':>13}{'peak MiB':>10}{'allow MiB':>10}"
        f"{'colls':>7}{'sched s':>9}  candidate"
    )
    for b in doc["blocks"]:
        lines.append(
            f"\n{b['block']}: {b['workload']} (nodes fw {b['nodes']['forward']}, "
            f"bw {b['nodes']['backward']}; capture {b['capture_s']:.1f} s)"
        )
        lines.append(head)
        for r in ROWS:
            for k in (*KINDS, "block"):
                g = b["rows"][r][k]
                colls = "" if k == "block" else str(g["collectives"])
                secs = "" if k == "block" else f"{g['scheduler_s']:.2f}"
                label = "fw+bw" if k == "block" else k
                allow = (
                    ""
                    if k == "block" or "allowance_bytes" not in g
                    else f"{g['allowance_bytes'] / 2**20:.1f}"
                )
                lines.append(
                    f"  {r if k == 'forward' else '':<17}{label:<9}{g['exposed_comm_us']:>11.1f}"
                    f"{g['makespan_us']:>13.1f}{g['peak_memory_bytes'] / 2**20:>10.1f}{allow:>10}{colls:>7}"
                    f"{secs:>9}  {g.get('candidate', '')}".rstrip()
                )
    lines.append(
        "\nRule: commfuse exposed comm lower (by > 0.1 %) than Inductor's on >= 2 of 3 blocks (fw+bw summed; "
        f"per graph: >= 4 of 6), never > {TOLERANCE}x Inductor's, peak memory <= {TOLERANCE}x Inductor's"
    )
    for ours, v in doc["verdict"].items():
        lines.append(_verdict_line(ours, v["per_block"], "per block"))
        lines.append(_verdict_line(ours, v["per_graph"], "per graph"))
        ratios = ", ".join(f"{k} {x:.3f}" for k, x in v["per_graph"]["exposed_ratio"].items())
        lines.append(f"    exposed ratio per graph: {ratios}")
    pc = doc.get("picker_check")
    if pc is not None:
        above, over = ", ".join(pc["above_inductor"]) or "none", ", ".join(pc["over_allowance"]) or "none"
        lines.append(
            f"commfuse's own picker (commfuse_picker row) exposed comm <= Inductor's on every graph and peak "
            f"within its allowance: {'met' if pc['met'] else 'NOT met'} (above Inductor: {above}; "
            f"over allowance: {over})"
        )
    calls = ", ".join(f"{k} {n}" for k, n in sorted(doc["estimate_calls"].items()))
    lines.append(f"custom_runtime_estimation calls by node class: {calls}")
    lines.append(f"total wall time {doc['wall_s']:.1f} s")
    return "\n".join(lines)
