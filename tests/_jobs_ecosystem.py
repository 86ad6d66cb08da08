"""Rank-pool jobs for tests/test_ecosystem.py (module-level so the pool can pickle them)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.passes import GraphPass, Stage, register_pass, unregister_pass


class AlwaysFails(GraphPass):
    """Test-only pass that raises on every rank alike: the pipeline undoes it and warns."""

    name = "test_always_fails"
    stage = Stage.JOINT

    def run(self, ctx):
        raise RuntimeError("planted failure")


def _traced() -> torch.fx.GraphModule:
    def f(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD).sum()

    return make_fx(f)(torch.ones(4))


def warnings_and_dumps(out_dir: str) -> dict[str, Any]:
    """On every rank: a pass failure (the same on every rank) and a dump dir that only rank 1
    cannot write (its own problem), both through ``commfuse.optimize`` with one shared dump dir.
    Returns the warnings this rank raised and the graph dumps it wrote."""
    rank = dist.get_rank()
    blocked = Path(out_dir) / "blocked"
    if rank == 1:  # a file where rank 1's directory would go
        blocked.mkdir(parents=True, exist_ok=True)
        (blocked / "rank1").write_text("not a directory")
    dist.barrier()
    register_pass(AlwaysFails)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            commfuse.optimize(
                _traced(), commfuse.Config(passes=["test_always_fails"], dump_dir=f"{out_dir}/dumps")
            )
            commfuse.optimize(_traced(), commfuse.Config(passes=[], dump_dir=str(blocked)))
    finally:
        unregister_pass("test_always_fails")
    dist.barrier()  # both ranks have dumped: the index the last of them wrote lists both
    mine = Path(out_dir) / "dumps" / f"rank{rank}"
    return {
        "rank": rank,
        "warnings": [str(w.message) for w in caught if "commfuse" in str(w.message)],
        "graphs": sorted(p.name for p in mine.iterdir()),
    }
