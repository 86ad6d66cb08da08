"""Communication's share of a step: the most any change to communication alone can speed it up.

What it measures
    For each workload and executor (a registered baseline), the median step time twice:

    * ``real``: on ``world`` gloo ranks (the rank pool, one thread per rank), per step the slowest
      rank after a barrier, as every other benchmark here measures;
    * ``local``: the same build, executor and step on one process holding rank 0 of a ``fake``
      process group of the same world size (one thread): every rank-local computation is the
      same, every collective returns at once without moving data.

    ``share = 1 - local / real`` is the fraction of the step that communication costs (waiting on
    it, issuing it, copying to and from its buffers), and ``bound = real / local`` the speed-up an
    executor would get if its communication cost nothing and its compute stayed as it is: no
    rewrite of collectives (fewer bytes, fewer messages, overlap) can beat it. A workload whose
    bound is below a target speed-up cannot reach that target by communication alone.

Caveats (printed with the table): the fake group leaves collective outputs uninitialised, so the
local step computes on whatever those buffers hold; denormals are flushed there to keep that from
slowing the arithmetic, and data-dependent compute (MoE routing: tokens per expert) may differ
from the real run's. The local process has the machine's other core to itself, the real ranks
share two cores with gloo's threads.

    python benchmarks/comm_share.py [--steps N] [--warmup N] WORKLOAD[@EXECUTOR] ...
    (executor default: ``eager``, ``ga:eager`` for families with micro-batches)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

# Runnable as a script from a checkout (the rank pool copies sys.path into its workers).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

__all__ = ["share_row", "timed_steps"]


def timed_steps(workload: str, executor: str, warmup: int, steps: int) -> list[float]:
    """Rank job (also run on a fake group): ``workload`` built for this rank, ``executor``'s first
    step and ``warmup`` more untimed, then ``steps`` timed ones (seconds, each after a barrier)."""
    import benchmarks.declared  # noqa: F401  (registers the declared families)
    from benchmarks.baselines import get_baseline
    from benchmarks.measure import _timed, step_of
    from benchmarks.workloads import get_workload

    built = get_workload(workload).build(dist.get_world_size(), dist.get_rank())
    with get_baseline(executor).session(built) as session:
        step = step_of(session, built)
        for _ in range(1 + warmup):
            step()
        return [_timed(step) for _ in range(steps)]


def share_row(workload: str, executor: str, real_s: list[float], local_s: list[float]) -> dict[str, Any]:
    """The table row: medians, communication's share of the real step and the speed-up bound."""
    real, local = statistics.median(real_s), statistics.median(local_s)
    return {
        "workload": workload,
        "executor": executor,
        "real_ms": real * 1e3,
        "local_ms": local * 1e3,
        "share": 1.0 - local / real,
        "bound": real / local,
        "real_s": real_s,
        "local_s": local_s,
    }


def _local_steps(workload: str, executor: str, world: int, warmup: int, steps: int) -> list[float]:
    from commfuse.testing.fake_pg import fake_process_group

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        torch._dynamo.reset()
        with fake_process_group(world, rank=0):
            return timed_steps(workload, executor, warmup, steps)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


def _parse(spec: str) -> tuple[str, str]:
    from benchmarks.workloads import get_workload

    workload, _, executor = spec.partition("@")
    if not executor:
        executor = "ga:eager" if get_workload(workload).params.get("microbatches", 1) > 1 else "eager"
    return workload, executor


def main(argv: list[str] | None = None) -> int:
    import benchmarks.declared  # noqa: F401
    from benchmarks.workloads import get_workload
    from commfuse.tools.rank_pool import RankPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="+", metavar="WORKLOAD[@EXECUTOR]")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"load before: {os.getloadavg()[0]:.1f}", flush=True)
    for spec in args.specs:
        workload, executor = _parse(spec)
        world = get_workload(workload).family.world or 2
        with RankPool(world, timeout_s=3600) as pool:
            ranks = pool.run(timed_steps, workload, executor, args.warmup, args.steps, timeout=3600)
        real = [max(r[i] for r in ranks) for i in range(args.steps)]
        local = _local_steps(workload, executor, world, args.warmup, args.steps)
        row = share_row(workload, executor, real, local)
        row["world"] = world
        rows.append(row)
        print(
            f"{workload} @ {executor}, {world} ranks: real {row['real_ms']:.1f} ms, local {row['local_ms']:.1f} ms, "
            f"communication {100 * row['share']:.1f}% of the step, bound {row['bound']:.3f}x "
            f"(load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    print(
        "\n| workload | executor | ranks | real step ms | local step ms | communication share | speed-up bound |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['executor']} | {r['world']} | {r['real_ms']:.1f} | {r['local_ms']:.1f} | "
            f"{100 * r['share']:.1f}% | {r['bound']:.3f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    # the imported module's main: the ranks import its job function by name
    from benchmarks.comm_share import main as _main

    sys.exit(_main())
