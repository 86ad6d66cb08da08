"""Boundary fusion (Chimera across pipeline stages): bytes per rank before/after, Table 2, step time.

    python benchmarks/run.py --boundary-volume [--json out.json]
    python benchmarks/boundary_volume.py [--json out.json] [--markdown out.md]

For each workload (a 2-stage pipeline whose boundary is one of Table 2's transitions, built
from commfuse.pipeline's stage blocks): the forward graph is traced (fake tensors, one
process), ``boundary_fusion`` rewrites it, and the per-rank boundary bytes of the rewritten
pair (Chimera Table 1 conventions, measured from the CollectiveIR) are printed next to the
closed-form derivation of docs/boundary-fusion.md, the ratio, and Table 2's range. Then the
workloads run on 4 gloo ranks (2 stages x 2) with the plain and the fused forward graph
(same PipelineRunner, GPipe and 1F1B): the measured step time and the largest difference of
losses and gradients (fused vs unfused).

Workloads (``WORKLOADS``; used by tests/test_boundary_fusion.py too):

* ``sp_pp``     SP stage ending in the sequence all_gather -> stage transfer (rule ag_p2p)
* ``sp_pp_b``   SP stage output (sequence shard) -> stage transfer -> all_gather on the next
                stage, whose residual also reads the shard (rule p2p_ag)
* ``tp_pp``     commfuse.models.pipeline_models' TP model: g + residual -> stage transfer
                (rule ar_p2p; TP contract declared)
* ``a2a_pp``    a token all_to_all at the end of a data-parallel stage -> stage transfer
                (rule a2a_p2p)
* ``pp_ep``     stage transfer -> router + GShard dispatch + all_to_all on an expert-parallel
                stage (rule p2p_a2a; the router weight travels back each micro-batch: GPipe)

Step times are wall-clock on gloo over loopback with 2 cores shared by 4 ranks: they show
that the fused pipeline runs and what one m2ms costs against its pair on this machine, not
interconnect behaviour.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from commfuse.models.pipeline_models import (  # noqa: E402
    DPBlock,
    PipelineModelConfig,
    ShardedBlock,
    SPBlock,
    TPBlock,
    _rms_norm,
    make_full_data,
    make_loss_fn,
    position_view,
)
from commfuse.analysis.boundary import BoundaryFusionOptions  # noqa: E402
from commfuse.pipeline.collectives import all_gather, all_to_all, copy_to_group, reduce_scatter  # noqa: E402

STAGES_2x2 = [[0, 1], [2, 3]]


# ------------------------------------------------------------------------------------ glue blocks
class NormGather(ShardedBlock):
    """End of an SP stage: RMSNorm on the sequence shard, then the sequence all_gather (the
    next stage's first layer is column-parallel and needs the whole sequence)."""

    SHARD_DIMS = {"norm_weight": None}

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return all_gather(_rms_norm(x, copy_to_group(self.norm_weight, self.group)), 1, self.group)


class MLPTail(ShardedBlock):
    """Start of an SP stage that receives the gathered sequence: column/row-parallel MLP,
    reduce_scatter back to sequence shards (no residual: the cut fell after the norm)."""

    SHARD_DIMS = {"w1": 1, "w2": 0}

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(ffn_dim, dim))

    def forward(self, y):
        return reduce_scatter(F.silu(y @ self.w1) @ self.w2, 1, self.group)


class GatherMLP(ShardedBlock):
    """Start of an SP stage cut between the norm and the gather: ``z + RS(MLP(AG(z)))``."""

    SHARD_DIMS = {"w1": 1, "w2": 0}

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(ffn_dim, dim))

    def forward(self, z):
        h = all_gather(z, 1, self.group)
        return z + reduce_scatter(F.silu(h @ self.w1) @ self.w2, 1, self.group)


class Norm(ShardedBlock):
    """RMSNorm on the sequence shard (its replicated weight through f)."""

    SHARD_DIMS = {"norm_weight": None}

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return _rms_norm(x, copy_to_group(self.norm_weight, self.group))


class TokenAllToAll(ShardedBlock):
    """Each rank's tokens cut in ``n`` equal row blocks, block j sent to rank j (an expert/
    sequence re-sharding at the end of a data-parallel stage)."""

    SHARD_DIMS: dict = {}

    def forward(self, x):
        b, s, h = x.shape
        return all_to_all(x.reshape(b * s, h), self.group).reshape(b, s, h)


class MoEGate(ShardedBlock):
    """The first block of an expert-parallel stage: router (replicated weight through f), GShard
    top-k gating with capacity, dispatch all_to_all, SwiGLU experts (``E/N`` per rank), the
    all_to_all back and the combine; no norm and no residual on the received activation, so the
    whole router/dispatch region can run on the previous stage (commfuse.models.pipeline_models'
    EPMoEBlock without its pre-norm and residual)."""

    SHARD_DIMS = {"router": None, "w1": 0, "w3": 0, "w2": 0}

    def __init__(
        self, dim: int, ffn_dim: int, num_experts: int = 4, top_k: int = 1, capacity_factor: float = 1.0
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Parameter(torch.empty(num_experts, dim))
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def forward(self, x):
        import math

        from commfuse.models.moe import gshard_gating

        g = self.group
        bsz, seq, dim = x.shape
        tokens = x.reshape(1, -1, dim)
        e = self.num_experts
        capacity = max(1, math.ceil(self.capacity_factor * self.top_k * tokens.shape[1] / e))
        probs = F.softmax(tokens @ copy_to_group(self.router, g).t(), dim=-1)
        combine, dispatch, _aux = gshard_gating(probs, self.top_k, capacity)
        dispatched = torch.einsum("gtec,gtd->gecd", dispatch.to(x.dtype), tokens)  # [1, E, C, D]
        n, local = g.size, e // g.size
        recv = all_to_all(dispatched.reshape(e * capacity, dim), g)  # rank j: the slots of its experts
        flat = recv.reshape(n, local, capacity, dim).transpose(0, 1).reshape(local, n * capacity, dim)
        out = torch.bmm(F.silu(torch.bmm(flat, self.w1)) * torch.bmm(flat, self.w3), self.w2)
        out = out.reshape(local, n, capacity, dim).transpose(0, 1)
        out = all_to_all(out.reshape(e * capacity, dim), g).reshape(1, e, capacity, dim)
        return torch.einsum("gtec,gecd->gtd", combine.to(x.dtype), out).reshape(bsz, seq, dim)


# ------------------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Workload:
    name: str
    transition: str  # Table 2 row
    rule: str
    data_kind: str  # pipeline_models' data layout: sp (sequence shards), tp (replicated), ep (own rows)
    options: BoundaryFusionOptions
    dim: int = 16
    ffn_dim: int = 32


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("sp_pp", "SP+PP", "ag_p2p", "sp", BoundaryFusionOptions()),
        Workload("sp_pp_b", "SP+PP (gather on the receiving stage)", "p2p_ag", "sp", BoundaryFusionOptions()),
        Workload(
            "tp_pp",
            "TP+PP",
            "ar_p2p",
            "tp",
            BoundaryFusionOptions(tp_stages=(0, 1), replicated_inputs=("x",)),
        ),
        Workload("a2a_pp", "A2A+P2P (EP -> PP)", "a2a_p2p", "ep", BoundaryFusionOptions()),
        Workload(
            "pp_ep",
            "PP+EP",
            "p2p_a2a",
            "ep",
            BoundaryFusionOptions(reverse_transfers=True),
            dim=128,
            ffn_dim=64,
        ),
    )
}


def _blocks(w: Workload, stage: int) -> list[ShardedBlock]:
    d, f = w.dim, w.ffn_dim
    if w.name == "sp_pp":
        return [SPBlock(d, f), NormGather(d)] if stage == 0 else [MLPTail(d, f), SPBlock(d, f)]
    if w.name == "sp_pp_b":
        return [SPBlock(d, f), Norm(d)] if stage == 0 else [GatherMLP(d, f), SPBlock(d, f)]
    if w.name == "tp_pp":
        return [TPBlock(d, f), TPBlock(d, f)]
    if w.name == "a2a_pp":
        return [DPBlock(d, f), TokenAllToAll()] if stage == 0 else [DPBlock(d, f)]
    if w.name == "pp_ep":
        return [DPBlock(d, f)] if stage == 0 else [MoEGate(d, f), DPBlock(d, f)]
    raise KeyError(w.name)


def build_stages(w: Workload, stage_groups, position: int, seed: int = 0) -> list[nn.Sequential]:
    """Both stages, full weights from ``(seed, stage, block)`` sharded for ``position``."""
    stages = []
    for s in range(2):
        blocks = []
        for b, blk in enumerate(_blocks(w, s)):
            blk.init_full_(torch.Generator().manual_seed(seed * 1000 + s * 100 + b))
            blk.shard_(None if stage_groups is None else stage_groups[s], position)
            blocks.append(blk)
        stages.append(nn.Sequential(*blocks))
    return stages


def workload_data(w: Workload, n: int, position: int, batch: int, seq: int):
    """This position's input and target, and the loss function (pipeline_models' conventions)."""
    cfg = PipelineModelConfig(kind=w.data_kind, dim=w.dim, ffn_dim=w.ffn_dim)
    x_full, t_full = make_full_data(cfg, n, batch, seq)
    return (
        position_view(cfg, n, position, x_full),
        position_view(cfg, n, position, t_full),
        make_loss_fn(cfg, n),
    )


# ------------------------------------------------------------------------------------ volume (one process)
def trace_workload(w: Workload, position: int = 0, batch: int = 4, seq: int = 8, microbatches: int = 2):
    """(program, input tensors) of ``w``'s forward graph for ``position`` of a 2 x 2 pipeline,
    traced on fake tensors in this process (no group is created or resolved)."""
    from commfuse.pipeline import plan_layout, trace_forward
    from commfuse.pipeline.trace import collect_inputs

    layout = plan_layout(STAGES_2x2, rank=STAGES_2x2[0][position])
    stages = build_stages(w, layout.stages, position)
    x, t, loss_fn = workload_data(w, layout.stage_size, position, batch, seq)
    xm, tm = x.tensor_split(microbatches)[0], t.tensor_split(microbatches)[0]
    program = trace_forward(layout, stages, loss_fn, xm, tm)
    _, tensors = collect_inputs(stages)
    return program, [*tensors, xm, tm]


# ------------------------------------------------------------------------------------ formulas
# docs/boundary-fusion.md: per-rank boundary bytes of one micro-batch, Chimera Table 1 conventions,
# M = B*S*H*e (the activation [B, S, H] of e-byte elements), N ranks per stage. (before, after).
def formula(rule: str, B: int, S: int, H: int, N: int, e: int = 4) -> tuple[int, int]:
    from fractions import Fraction as Fr

    M = Fr(B * S * H * e)
    if rule == "ag_p2p":  # AG (N-1)M/N + P2P M  ->  M2MS M
        before, after = (N - 1) * M / N + M, M
    elif rule == "p2p_ag":  # P2P M/N + AG (N-1)M/N  ->  M2MS M
        before, after = M / N + (N - 1) * M / N, M
    elif rule == "ar_p2p":  # AR 2(N-1)M/N + P2P M  ->  RS (N-1)M/N + M2MS M/N + AG (N-1)M/N
        before, after = 2 * (N - 1) * M / N + M, (N - 1) * M / N + M / N + (N - 1) * M / N
    elif rule == "a2a_p2p":  # A2A (N-1)M/N + P2P M  ->  M2MS M
        before, after = (N - 1) * M / N + M, M
    elif rule == "p2p_a2a":  # see pp_ep_formula (needs E, k, capacity)
        raise KeyError("p2p_a2a: use pp_ep_formula")
    else:
        raise KeyError(rule)
    assert before.denominator == 1 and after.denominator == 1, (rule, before, after)
    return int(before), int(after)


def pp_ep_formula(
    B: int, S: int, H: int, N: int, E: int, k: int, capacity_factor: float, e: int = 4, index_bytes: int = 8
) -> tuple[int, int]:
    """PP+EP (docs/boundary-fusion.md): P2P M + dispatch A2A (N-1)D/N  ->  M2MS D + the router
    weight back (E*H*e) + the top-k weights and expert indices forward (B*S*k*(e + index_bytes)),
    D = E*C*H*e the dispatch buffer, C = ceil(capacity_factor*k*B*S/E) slots per expert."""
    import math

    M = B * S * H * e
    C = max(1, math.ceil(capacity_factor * k * B * S / E))
    D = E * C * H * e
    before = M + (N - 1) * D // N
    after = D + E * H * e + B * S * k * (e + index_bytes)
    return before, after


# Chimera Table 2 (ratio = real demand / current) and Table 3 rows the rules implement
TABLE = {
    "ag_p2p": ("Table 2 SP+PP", "50-66.7%"),
    "p2p_ag": ("Table 3 P2P + A-G -> M2MS", "equal (100%)"),
    "ar_p2p": ("Table 2 TP+PP", "60-80%"),
    "a2a_p2p": ("Table 3 A2A + P2P -> M2MS", "lower"),
    "p2p_a2a": ("Table 2 PP+EP", "0-66.7%"),
}


def ratio_formula(rule: str, N: int) -> str:
    return {
        "ag_p2p": f"N/(2N-1) = {N}/{2 * N - 1}",
        "p2p_ag": "1",
        "ar_p2p": f"(2N-1)/(3N-2) = {2 * N - 1}/{3 * N - 2}",
        "a2a_p2p": f"N/(2N-1) = {N}/{2 * N - 1}",
        "p2p_a2a": "(D+W+r)/(M+(N-1)D/N)",
    }[rule]


def volume_row(w: Workload, batch: int = 8, seq: int = 16, microbatches: int = 2) -> dict[str, Any]:
    """Trace ``w`` (position 0), fuse, and compare the rewritten pair's bytes with the formula."""
    from commfuse.transforms.boundary_fusion import fuse_boundaries

    program, _ = trace_workload(w, 0, batch, seq, microbatches)
    rep = fuse_boundaries(
        program.forward, program.layout, options=w.options, input_names=[s.name for s in program.inputs]
    )
    applied = [d for d in rep.decisions if d.applied]
    n = program.layout.stage_size
    # the boundary activation [B, S, H]: one micro-batch (ep: this position's rows; sp: the whole
    # sequence, whose shards the stage holds)
    B, S, H = batch // microbatches, seq, w.dim
    row: dict[str, Any] = {
        "workload": w.name,
        "transition": w.transition,
        "rule": w.rule,
        "N": n,
        "B": B,
        "S": S,
        "H": H,
        "dtype_bytes": 4,
        "applied": [d.applied for d in applied],
        "refusals": rep.refusals,
    }
    if not applied:
        return row
    vol = applied[0].volume
    if w.rule == "p2p_a2a":
        f_before, f_after = pp_ep_formula(B, S, H, n, E=4, k=1, capacity_factor=1.0)
    else:
        f_before, f_after = formula(w.rule, B, S, H, n)
    total_before = sum(sum(v.values()) for v in rep.bytes_before.values())
    total_after = sum(sum(v.values()) for v in rep.bytes_after.values())
    table, rng = TABLE[w.rule]
    row.update(
        {
            "ops_before": [vars(o) for o in vol.before],
            "ops_after": [vars(o) for o in vol.after],
            "bytes_before": vol.bytes_before,
            "bytes_after": vol.bytes_after,
            "formula_before": f_before,
            "formula_after": f_after,
            "formula_matches": (vol.bytes_before, vol.bytes_after) == (f_before, f_after),
            "ratio": vol.bytes_after / vol.bytes_before,
            "ratio_formula": ratio_formula(w.rule, n),
            "table": table,
            "table_range": rng,
            "graph_bytes_before": total_before,
            "graph_bytes_after": total_after,
            "graph_difference_matches": total_before - total_after == vol.bytes_before - vol.bytes_after,
        }
    )
    return row


# ------------------------------------------------------------------------------------ timing (4 gloo ranks)
def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def timing_row(
    pool,
    w: Workload,
    microbatches: int = 4,
    schedule: str = "1f1b",
    steps: int = 20,
    batch: int = 8,
    seq: int = 64,
    dim: int = 64,
) -> dict[str, Any]:
    sys.path.insert(0, str(Path(_REPO) / "tests"))
    import _jobs_boundary_fusion as jobs

    res = pool.run(jobs.step_times, w.name, microbatches, schedule, steps, batch, seq, dim, timeout=600)
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out: dict[str, Any] = {
        "workload": w.name,
        "microbatches": microbatches,
        "schedule": schedule,
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "dim": dim,
    }
    for kind in ("plain", "fused"):
        per_step = [max(r[kind]["times"][i] for r in res) for i in range(steps)]  # the slowest rank
        out[f"{kind}_median_ms"] = statistics.median(per_step) * 1e3
        out[f"{kind}_iqr_ms"] = _iqr(per_step) * 1e3
    diffs = []
    for r in res:
        p, f = r["plain"], r["fused"]
        if p["loss"] is not None:
            diffs.append(float((p["loss"] - f["loss"]).abs()))
        diffs += [float((p["grads"][k] - f["grads"][k]).abs().max()) for k in p["grads"]]
    out["max_abs_diff"] = max(diffs) if diffs else 0.0
    out["speedup"] = out["plain_median_ms"] / out["fused_median_ms"]
    out["load_1min"] = load
    return out


def run_boundary_volume(timing: bool = True) -> dict[str, Any]:
    volume = [volume_row(w) for w in WORKLOADS.values()]
    report: dict[str, Any] = {
        "volume": volume,
        "timing": [],
        "settings": {
            "volume": "one micro-batch, position 0 of 2 stages x 2 ranks, fp32, bytes per rank in Chimera Table 1 "
            "conventions (sum over the transition's collectives of the bytes one rank of each runs)",
            "timing": "4 gloo ranks (2 stages x 2) on this machine's 2 cores, PipelineRunner, 1F1B (pp_ep: GPipe), 4 "
            "micro-batches of [2, 64, 64] fp32 per rank; plain and fused steps interleaved; per step the "
            "slowest rank, median/IQR over 20 timed steps (the first, which traces, excluded); load_1min = "
            "load average after the run",
        },
    }
    if timing:
        from commfuse.tools.rank_pool import get_pool

        pool = get_pool(4)
        try:
            # p2p_a2a sends the router weight back each micro-batch: GPipe only (docs/boundary-fusion.md)
            report["timing"] = [
                timing_row(pool, w, schedule="gpipe" if w.rule == "p2p_a2a" else "1f1b")
                for w in WORKLOADS.values()
            ]
        finally:
            pool.shutdown()
    return report


def boundary_volume_tables(report: dict[str, Any]) -> str:
    lines = [
        "Boundary bytes per rank (one micro-batch, fp32; Chimera Table 1 conventions)",
        "",
        f"{'workload':<9} {'rule':<8} {'B,S,H,N':<12} {'before':>8} {'after':>8} {'formula':>15} {'ratio':>6} "
        f"{'ratio formula':<18} {'Chimera':<26} {'range':<12}",
    ]
    for r in report["volume"]:
        if "bytes_before" not in r:
            lines.append(f"{r['workload']:<9} {r['rule']:<8} not applied: {r['refusals']}")
            continue
        shape = f"{r['B']},{r['S']},{r['H']},{r['N']}"
        formula_s = f"{r['formula_before']}/{r['formula_after']}" + ("" if r["formula_matches"] else " (!)")
        lines.append(
            f"{r['workload']:<9} {r['rule']:<8} {shape:<12} {r['bytes_before']:>8} {r['bytes_after']:>8} "
            f"{formula_s:>15} {r['ratio']:>6.1%} {r['ratio_formula']:<18} {r['table']:<26} "
            f"{r['table_range']:<12}"
        )
    if report.get("timing"):
        lines += [
            "",
            "Measured step time, 4 gloo ranks (2 stages x 2), PipelineRunner",
            f"{'workload':<9} {'M':>2} {'sched':<6} {'unfused ms':>16} {'fused ms':>16} {'speedup':>8} "
            f"{'max |diff|':>10}",
        ]
        for t in report["timing"]:
            lines.append(
                f"{t['workload']:<9} {t['microbatches']:>2} {t['schedule']:<6} "
                f"{t['plain_median_ms']:>9.2f} ±{t['plain_iqr_ms']:>5.2f} "
                f"{t['fused_median_ms']:>9.2f} ±{t['fused_iqr_ms']:>5.2f} {t['speedup']:>7.2f}x "
                f"{t['max_abs_diff']:>10.2e}"
            )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    out = [
        "# Boundary fusion: bytes per rank and step time",
        "",
        "Generated by `python benchmarks/run.py --boundary-volume` (benchmarks/boundary_volume.py). "
        "Derivation: docs/boundary-fusion.md.",
        "",
        "| workload | rule | B,S,H,N | before (B) | after (B) | formula | ratio | ratio formula | Chimera | range |",
        "|---|---|---|---:|---:|---|---:|---|---|---|",
    ]
    for r in report["volume"]:
        if "bytes_before" not in r:
            out.append(f"| {r['workload']} | {r['rule']} | | | | not applied | | | | |")
            continue
        out.append(
            f"| {r['workload']} | {r['rule']} | {r['B']},{r['S']},{r['H']},{r['N']} | {r['bytes_before']} | "
            f"{r['bytes_after']} | {'matches' if r['formula_matches'] else 'DIFFERS'} | {r['ratio']:.1%} | "
            f"{r['ratio_formula']} | {r['table']} | {r['table_range']} |"
        )
    if report.get("timing"):
        out += [
            "",
            "Measured on 4 gloo ranks (2 stages x 2), 2 shared CPU cores, PipelineRunner "
            "(median ± IQR of the slowest rank per step):",
            "",
            "| workload | micro-batches | schedule | unfused ms | fused ms | speedup | max abs diff |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for t in report["timing"]:
            out.append(
                f"| {t['workload']} | {t['microbatches']} | {t['schedule']} | {t['plain_median_ms']:.2f} ± "
                f"{t['plain_iqr_ms']:.2f} | {t['fused_median_ms']:.2f} ± {t['fused_iqr_ms']:.2f} | "
                f"{t['speedup']:.2f}x | {t['max_abs_diff']:.1e} |"
            )
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--no-timing", action="store_true", help="bytes only (one process, no gloo ranks)")
    args = ap.parse_args(argv)
    report = run_boundary_volume(timing=not args.no_timing)
    print(boundary_volume_tables(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
