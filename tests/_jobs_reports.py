"""Rank-pool jobs for the report tests (module-level so the pool can pickle them).

`record_example` follows `_multirank_jobs.compiled_matches_eager`'s recording pattern: the
example model compiled with commfuse (eager inner compiler, strict) and trained with SGD under
`commfuse.record`; here every rank also dumps (into its own ``rank<r>/`` directory) and writes
its recorder trace, so the parent validates from files as `commfuse validate` does. One
unrecorded warm-up step first, so the recorded runs do not include the other ranks' compiles.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import commfuse
from commfuse.lowering.recorder import KERNEL_GRAPH
from commfuse.reports import predict_timelines
from commfuse.reports.validate import validate_run

from _multirank_jobs import LOSSES, _example, example_config


def _loss(name: str, out: Any) -> torch.Tensor:
    fn = LOSSES.get(name)
    if fn is not None:
        return fn(out)
    return out.float().mean() if isinstance(out, torch.Tensor) else sum(o.float().mean() for o in out)


def record_example(
    name: str,
    out_dir: str,
    steps: int = 2,
    predict: bool = False,
    svg_max_nodes: int = 1,
    profile: str | None = None,
) -> dict[str, Any]:
    """Compile example `name` (every rank given ``out_dir/dumps``, which commfuse splits into
    ``rank<r>/``), run one warm-up step, then `steps` SGD steps recorded into ``out_dir/record``.
    Also validates in memory on this rank (recorder + backend). ``profile``: cost profile for the predicted timelines."""
    t0 = time.perf_counter()
    rank = dist.get_rank()
    model_factory, inputs = _example(name, torch.float32)
    torch._dynamo.reset()
    # svg_max_nodes=1: condensed pictures only (Graphviz on full graphs costs seconds per dump).
    be = commfuse.backend(
        example_config(
            name,
            inner_compiler="eager",
            strict=True,
            svg_max_nodes=svg_max_nodes,
            dump_dir=f"{out_dir}/dumps",
        )
    )  # each rank writes dumps/rank<r>/
    model = model_factory()
    compiled = torch.compile(model, backend=be)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss = _loss(name, compiled(inputs(i)))
        loss.backward()
        opt.step()
        losses.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))

    with predict_timelines(profile=profile) if predict else _Null():
        step(0)
    with commfuse.record(f"{out_dir}/record") as rec:
        for i in range(1, steps + 1):
            step(i)
    mem = validate_run(rec, be, profile=profile)
    planned_calls = [c for c in rec.collectives if c.graph != KERNEL_GRAPH]  # not the MoE op's own exchanges
    return {
        "rank": rank,
        "calls": len(planned_calls),
        "kernel_calls": len(rec.collectives) - len(planned_calls),
        "in_memory_mismatches": [m.describe() for m in mem.mismatches],
        "in_memory_checks": len(mem.checks),
        "losses": losses,
        "seconds": time.perf_counter() - t0,
        "planned": sum(len(p.collectives) for p in be.plans),
    }


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
