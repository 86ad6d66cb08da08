"""Rank-pool jobs for tests/test_boundary_fusion.py (module level, so the pool can pickle them)."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from benchmarks.boundary_volume import STAGES_2x2, WORKLOADS, build_stages, workload_data
from commfuse.transforms.boundary_fusion import boundary_fusion_pass
from commfuse.pipeline import PipelineRunner, setup_pipeline


def _shapes(stages) -> list[dict[str, tuple]]:
    return [{k: tuple(v.shape) for k, v in st.state_dict().items()} for st in stages]


def _run(
    layout, w, fused: bool, m: int, sched: str, x, t, loss_fn, steps: int = 1, dump_dir: Optional[str] = None
) -> dict[str, Any]:
    import torch.distributed as dist

    stages = build_stages(w, layout.stages, layout.position)
    before = _shapes(stages)
    hook = boundary_fusion_pass(w.options) if fused else None
    runner = PipelineRunner(
        layout, stages, loss_fn, m, sched, forward_passes=[hook] if hook else (), dump_dir=dump_dir
    )
    times = []
    loss = None
    for _ in range(steps):
        for st in stages:
            st.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        loss = runner.step(x, t)
        times.append(time.perf_counter() - t0)
    out = {
        "loss": loss,
        "grads": {
            k: p.grad.clone() for k, p in stages[layout.stage].named_parameters() if p.grad is not None
        },
        "state_dict": _shapes(stages),
        "state_dict_unchanged": _shapes(stages) == before,
        # ownership: only this rank's stage's parameters received gradients
        "other_grads_untouched": all(
            p.grad is None for s, st in enumerate(stages) if s != layout.stage for p in st.parameters()
        ),
        "times": times,
    }
    if hook is not None:
        rep = hook.reports[-1]
        out["counts"] = rep.counts
        out["refusals"] = rep.refusals
        out["volumes"] = [d.volume.to_json() for d in rep.decisions if d.volume is not None]
        out["joint_ops"] = sorted(
            {
                str(n.target)
                for n in runner.program.joint.graph.nodes
                if n.op == "call_function" and "commfuse" in str(n.target)
            }
        )
    return out


def fused_vs_unfused(
    workload: str,
    microbatches: Sequence[int] = (2, 3),
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    batch: int = 6,
    seq: int = 8,
    dump_dir: Optional[str] = None,
) -> dict[str, Any]:
    """Run ``workload`` on 2 stages x 2 ranks with the plain and the fused forward graph for
    every (micro-batches, schedule); this rank's losses, gradients, state_dict shapes, reports."""
    w = WORKLOADS[workload]
    layout = setup_pipeline(STAGES_2x2)
    x, t, loss_fn = workload_data(w, layout.stage_size, layout.position, batch, seq)
    out: dict[str, Any] = {"stage": layout.stage, "position": layout.position, "runs": {}}
    for m in microbatches:
        for sched in schedules:
            out["runs"][f"{m}-{sched}"] = {
                "plain": _run(layout, w, False, m, sched, x, t, loss_fn),
                "fused": _run(
                    layout,
                    w,
                    True,
                    m,
                    sched,
                    x,
                    t,
                    loss_fn,
                    dump_dir=dump_dir if (m, sched) == (microbatches[0], schedules[0]) else None,
                ),
            }
    return out


def step_times(
    workload: str,
    microbatches: int = 4,
    schedule: str = "1f1b",
    steps: int = 6,
    batch: int = 8,
    seq: int = 16,
    dim: Optional[int] = None,
) -> dict[str, Any]:
    """Measured step times (seconds) of the plain and the fused pipeline, steps interleaved
    (plain, fused, plain, ...) so that load changes on the machine hit both alike; the first
    step of each (which traces and partitions) is not timed. Also the last step's loss and
    gradients of both."""
    import dataclasses

    import torch.distributed as dist

    w = WORKLOADS[workload]
    if dim is not None:
        w = dataclasses.replace(w, dim=dim, ffn_dim=2 * dim)
    layout = setup_pipeline(STAGES_2x2)
    x, t, loss_fn = workload_data(w, layout.stage_size, layout.position, batch, seq)
    runs = {}
    for kind in ("plain", "fused"):
        stages = build_stages(w, layout.stages, layout.position)
        hook = boundary_fusion_pass(w.options) if kind == "fused" else None
        runs[kind] = (
            stages,
            PipelineRunner(
                layout, stages, loss_fn, microbatches, schedule, forward_passes=[hook] if hook else ()
            ),
            [],
            [None],
        )
    for k in range(steps + 1):
        for stages, runner, times, last in runs.values():
            for st in stages:
                st.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            last[0] = runner.step(x, t)
            if k:
                times.append(time.perf_counter() - t0)
    out = {}
    for kind, (stages, _runner, times, last) in runs.items():
        out[kind] = {
            "times": times,
            "loss": last[0],
            "grads": {
                n: p.grad.clone() for n, p in stages[layout.stage].named_parameters() if p.grad is not None
            },
        }
    return out


# ------------------------------------------------------------------------------------ randomized rule cases
class _RandStage(torch.nn.Module):
    """One stage of a random boundary case (see :func:`random_case`): small element-wise work
    around the collective the rule fuses, written with commfuse.pipeline's stage collectives."""

    def __init__(self, case: dict, stage: int, group, position: int) -> None:
        super().__init__()
        self.case, self.stage, self.group = case, stage, group
        gen = torch.Generator().manual_seed(case["seed"] * 10 + stage)
        last = case["shape"][-1]
        self.w = torch.nn.Parameter(torch.randn(last, generator=gen) * 0.5 + 1.0)
        if case["rule"] == "ar_p2p" and stage == 0:  # a partial sum differs per position
            pg = torch.Generator().manual_seed(case["seed"] * 10 + 5 + position)
            self.w = torch.nn.Parameter(torch.randn(last, generator=pg))
        if case["rule"] == "p2p_a2a" and stage == 1:  # router + GShard dispatch + experts
            from benchmarks.boundary_volume import MoEGate

            self.moe = MoEGate(last, 8, case["experts"], case["top_k"], case["capacity_factor"])
            self.moe.init_full_(gen)
            self.moe.shard_(group, position)

    def forward(self, x):
        from commfuse.pipeline.collectives import all_gather, all_to_all, reduce_from_group

        c, g = self.case, self.group
        rule, d = c["rule"], c["dim"]
        if self.stage == 0:
            h = torch.tanh(x * self.w)
            if rule == "ag_p2p":
                y = all_gather(h, d, g)
                return y.reshape(y.shape[0], -1) if c["view"] else y
            if rule in ("p2p_ag", "p2p_a2a"):
                return h
            if rule == "a2a_p2p":
                if c["view"]:
                    b, s, k = h.shape
                    return all_to_all(h.reshape(b * s, k), g).reshape(b, s * k)
                return all_to_all(h, g)
            y = reduce_from_group(h, g)  # ar_p2p: g + replicated residuals in a random order
            for kind, left in c["residuals"]:
                r = x if kind == "x" else torch.sigmoid(x)
                y = r + y if left else y + r
            return y
        if rule == "p2p_a2a":
            return self._scale(self.moe(x))
        if rule == "p2p_ag":
            u = self._scale(all_gather(x, d, g))
            if c["view"]:  # another user of the received shard on the receiving stage
                u = u + x.sum(d, keepdim=True) * 0.5
            return u
        return self._scale(x)

    def _scale(self, u):
        return u * self.w if u.shape[-1] == self.w.shape[0] else u * self.w.mean()


def random_case(seed: int) -> dict[str, Any]:
    """A random boundary case: rule, dim, shape (the stage-0 input of one rank), view / other
    user, residuals, micro-batches and schedule (the same on every rank: drawn from ``seed``)."""
    import random

    rng = random.Random(seed)
    rule = ("ag_p2p", "p2p_ag", "a2a_p2p", "ar_p2p", "p2p_a2a")[seed % 5]
    mb = rng.choice([1, 2, 3])
    # micro-batch rows: even for the all_to_all (it splits dim 0), any for the others (an odd
    # count makes ar_p2p scatter along dim 1)
    rows = 2 * rng.choice([1, 2]) if rule == "a2a_p2p" else rng.choice([1, 2, 3])
    shape = [mb * rows, 2 * rng.choice([1, 2, 3]), 2 * rng.choice([1, 2, 3])]
    case = {
        "seed": seed,
        "rule": rule,
        "microbatches": mb,
        "schedule": rng.choice(["gpipe", "1f1b"]),
        "dim": rng.choice([0, 1, 2]) if rule in ("ag_p2p", "p2p_ag") else 0,
        "view": rng.random() < 0.5,
        "shape": shape,
        "residuals": [],
    }
    if rule == "ar_p2p":
        case["residuals"] = [
            (rng.choice(["x", "sigmoid"]), rng.random() < 0.5) for _ in range(rng.randint(0, 2))
        ]
    if rule == "p2p_a2a":  # hidden size large enough against the router weight for the fusion to pay
        case.update(
            schedule="gpipe",
            experts=rng.choice([2, 4]),
            top_k=rng.choice([1, 2]),
            capacity_factor=rng.choice([1.0, 1.5]),
        )
        shape[0], shape[2] = mb * rng.choice([2, 4]), 64
    return case


def random_cases(seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Each case on 2 stages x 2 ranks, plain and fused: this rank's loss, gradients and report."""
    from commfuse.analysis.boundary import BoundaryFusionOptions

    layout = setup_pipeline(STAGES_2x2)
    out = []
    for seed in seeds:
        case = random_case(seed)
        gen = torch.Generator().manual_seed(
            1000 + seed + (0 if case["rule"] == "ar_p2p" else layout.position)
        )
        x = torch.randn(case["shape"], generator=gen)  # ar_p2p: replicated over the stage (declared)
        t = torch.randn(case["shape"][0], 1, generator=torch.Generator().manual_seed(2000 + seed))
        tp = case["rule"] == "ar_p2p"
        options = BoundaryFusionOptions(
            rules=(case["rule"],),
            tp_stages=(0, 1) if tp else (),
            replicated_inputs=("x",) if tp else (),
            reverse_transfers=case["rule"] == "p2p_a2a",
        )

        def loss_fn(o, tt):  # o's rows need not match tt's (a gather along dim 0 doubles them)
            return ((o.reshape(-1) - tt.mean()) ** 2).mean()

        res = {"case": case}
        for fused in (False, True):
            stages = [_RandStage(case, s, layout.stages[s], layout.position) for s in range(2)]
            hook = boundary_fusion_pass(options) if fused else None
            runner = PipelineRunner(
                layout,
                stages,
                loss_fn,
                case["microbatches"],
                case["schedule"],
                forward_passes=[hook] if hook else (),
            )
            loss = runner.step(x, t)
            r = {
                "loss": loss,
                "grads": {
                    k: p.grad.clone()
                    for k, p in stages[layout.stage].named_parameters()
                    if p.grad is not None
                },
            }
            if hook is not None:
                r["counts"], r["refusals"] = hook.reports[-1].counts, hook.reports[-1].refusals
            res["fused" if fused else "plain"] = r
        out.append(res)
    return out
