"""What the cross-rank agreement net costs per compiled graph: time and c10d Store traffic at its
first execution (the only one that pays), at 2 and 4 real gloo ranks, and the Store traffic it
needs at 1024 ranks.

    python benchmarks/run.py --agreement-cost --json out.json
    python -m benchmarks.agreement_cost --json out.json --markdown out.md

What is measured on real ranks (spawned gloo processes of this machine, one thread each)
    Two programs, each compiled with the default config (the net on, eager inner compiler) and
    run for one training step: ``simple_fsdp`` (SimpleFSDP data parallel, the README's style: a
    2-layer MLP whose weights are gathered in forward and whose gradients are reduce-scattered in
    backward; one group, the world) at 2 and 4 ranks, and ``tp_dp_2x2`` (a TP all_reduce then a
    DP all_reduce on a 2 x 2 mesh: two groups per rank) at 4 ranks. Per compiled frame and rank:

    * ``first run``: the exchange at the first execution as it happened, on the rank pool's
      Store (a FileStore); its time includes waiting for the peers that compile slower;
    * ``exchange``: the same exchange replayed after a barrier on a TCPStore (what torchrun
      gives) hosted by rank 0, under fresh frame names, ``REPS`` times: median over repetitions
      of the slowest rank's time, i.e. the protocol's own cost when every rank is there;
    * ``settled``: a recompile on rank 0 alone of a frame its groups already agreed on (what an
      uneven batch causes): reads only, no waiting; median of ``REPS``;
    * Store requests and bytes per rank (keys and values both ways, without TCP framing and the
      process group's own key prefix), the most any rank sent;
    * the compile time of the program as written (the fallback, compiled beside the frame) next
      to the frame's own compile.

What is counted at 1024 ranks (no machine has them here)
    The protocol run by 1024 threads on one in-process Store (HashStore), each a rank, with the
    groups and signatures of the 4-rank programs laid out as a 1024-rank data-parallel group and
    as FSDP 128 x TP 8: requests and bytes per rank and at the Store server, for the first
    execution and for a recompile on one rank. Times of threads on 2 shared cores say nothing
    about 1024 real ranks and are not reported.

Caveats
    A shared 2-core machine: the 4 ranks oversubscribe it and other processes run beside; the
    1-minute load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REPS = 20
WORKLOADS = (("simple_fsdp", 2), ("simple_fsdp", 4), ("tp_dp_2x2", 4))


# ------------------------------------------------------------------ rank job
def _program(name: str):
    """(compiled-by-torch.compile step, input) of one workload on this rank."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if name == "simple_fsdp":
        from commfuse.models import simple_fsdp

        torch.manual_seed(0)
        model = simple_fsdp.data_parallel(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
            init_device_mesh("cpu", (world,)),
            "fully_shard",
        )

        def step(x):
            model(x).pow(2).mean().backward()

        return model, step, torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    import torch.distributed._functional_collectives as funcol

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()

    def tp_dp(x):
        return funcol.all_reduce(funcol.all_reduce(x * 2, "sum", tp) + 1, "sum", dp).sum()

    return tp_dp, tp_dp, torch.full((2,), float(rank))


def _tcp_store(tag: str):
    import torch.distributed as dist

    from commfuse.core.torch_private import default_store

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
        default_store().set(f"agreement_cost/{tag}/port", str(store.port))
        return store
    port = int(default_store().get(f"agreement_cost/{tag}/port").decode())
    return dist.TCPStore("127.0.0.1", port, world, False)


def bench_job(name: str, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import commfuse
    from commfuse.agreement import Exchange

    rank = dist.get_rank()
    torch._dynamo.reset()
    target, step, x = _program(name)
    be = commfuse.backend(commfuse.Config(inner_compiler="eager"))
    if isinstance(target, torch.nn.Module):
        compiled = torch.compile(target, backend=be)

        def run():
            compiled(x).pow(2).mean().backward()
    else:
        fn = torch.compile(target, backend=be)

        def run():
            fn(x)

    run()
    out: dict[str, Any] = {"rank": rank, "frames": []}
    store = _tcp_store(name)
    for i, v in enumerate(be.agreements):
        frame: dict[str, Any] = {
            "frame": v.frame,
            "action": v.action,
            "groups": [list(e.ranks) for e in v.groups],
            "first_run_s": v.seconds,
            "first_run_ops": v.store_ops,
            "first_run_bytes": v.store_bytes,
            "compile_s": v.compile_s,
            "compile_as_written_s": v.compile_as_written_s,
            "record_bytes": max(
                len(json.dumps({"compiled": e.compiled_sigs, "fallback": e.fallback_sigs})) for e in v.groups
            ),
            "exchange_s": [],
            "settled_s": [],
        }
        for rep in range(reps):
            dist.barrier()
            ex = Exchange(store, frame=f"bench/{name}/{i}/{rep}", config_digest="d", rank=rank, timeout_s=120)
            r = ex.run(v.groups)
            assert r.action == "compiled", r
            frame["exchange_s"].append(r.seconds)
            frame["exchange_ops"], frame["exchange_bytes"] = r.store_ops, r.store_bytes
        dist.barrier()
        if rank == 0:  # a recompile on one rank of a frame its groups settled: reads only
            for _ in range(reps):
                r = Exchange(
                    store, frame=f"bench/{name}/{i}/0", config_digest="d", rank=0, timeout_s=120
                ).run(v.groups)
                assert r.action == "compiled" and r.rounds == 0, r
                frame["settled_s"].append(r.seconds)
                frame["settled_ops"], frame["settled_bytes"] = r.store_ops, r.store_bytes
        out["frames"].append(frame)
        out.setdefault("entries", []).append(
            [
                {"ranks": list(e.ranks), "compiled_sigs": e.compiled_sigs, "fallback_sigs": e.fallback_sigs}
                for e in v.groups
            ]
        )
    dist.barrier()
    torch._dynamo.reset()
    return out


# ------------------------------------------------------------------ 1024 simulated ranks
def _layout(kind: str, world: int, sigs: list[tuple]) -> dict[int, list]:
    """rank -> its GroupEntries: ``dp`` (one group of ``world``) or ``fsdp_tp`` (TP groups of 8
    and FSDP groups of world / 8), each group issuing ``sigs`` (one per group of the 4-rank run)."""
    from commfuse.agreement import GroupEntry, sequence_hash

    def entry(ranks: tuple, s: tuple) -> GroupEntry:
        h = sequence_hash([list(x) for x in s])
        return GroupEntry(ranks, h, h, s, s)

    if kind == "dp":
        g = tuple(range(world))
        return {r: [entry(g, sigs[0])] for r in range(world)}
    tp_size = 8
    out = {}
    for r in range(world):
        tp = tuple(range(r - r % tp_size, r - r % tp_size + tp_size))
        fsdp = tuple(range(r % tp_size, world, tp_size))
        out[r] = [entry(tp, sigs[0]), entry(fsdp, sigs[-1])]
    return out


def simulate(world: int, kind: str, sigs: list[tuple]) -> dict[str, Any]:
    import torch.distributed as dist

    from commfuse.agreement import Exchange

    store = dist.HashStore()
    per_rank = _layout(kind, world, sigs)
    verdicts: dict[int, Any] = {}

    def rank(r: int) -> None:
        verdicts[r] = Exchange(store, frame="sim", config_digest="d", rank=r, timeout_s=600).run(per_rank[r])

    old = threading.stack_size(512 * 1024)
    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        threading.stack_size(old)
    assert len(verdicts) == world and {v.action for v in verdicts.values()} == {"compiled"}
    again = Exchange(store, frame="sim", config_digest="d", rank=0, timeout_s=60).run(per_rank[0])
    ops = [v.store_ops for v in verdicts.values()]
    nbytes = [v.store_bytes for v in verdicts.values()]
    return {
        "world": world,
        "layout": kind,
        "groups_per_rank": len(per_rank[0]),
        "ops_per_rank_max": max(ops),
        "ops_per_rank_median": statistics.median(ops),
        "bytes_per_rank_max": max(nbytes),
        "bytes_per_rank_median": statistics.median(nbytes),
        "store_ops_total": sum(ops),
        "store_bytes_total": sum(nbytes),
        "settled_ops": again.store_ops,
        "settled_bytes": again.store_bytes,
    }


def run_agreement_cost(reps: int = REPS) -> dict[str, Any]:
    from commfuse.tools.rank_pool import RankPool

    report: dict[str, Any] = {
        "settings": {
            "reps": reps,
            "workloads": [list(w) for w in WORKLOADS],
            "config": "commfuse.Config(inner_compiler='eager'), net on (default)",
        },
        "load_before": os.getloadavg()[0],
        "rows": [],
        "simulated": [],
    }
    t0 = time.perf_counter()
    sigs: dict[str, list[tuple]] = {}
    for world in sorted({w for _, w in WORKLOADS}):
        with RankPool(world, timeout_s=1800) as pool:
            for name, w in WORKLOADS:
                if w != world:
                    continue
                per_rank = pool.run(bench_job, name, reps, timeout=1800)
                for i, frame in enumerate(per_rank[0]["frames"]):
                    frames = [r["frames"][i] for r in per_rank]
                    slowest = [max(ts) for ts in zip(*(f["exchange_s"] for f in frames), strict=True)]
                    report["rows"].append(
                        {
                            "workload": name,
                            "world": world,
                            "frame": frame["frame"],
                            "groups": frame["groups"],
                            "action": sorted({f["action"] for f in frames}),
                            "first_run_s_max": max(f["first_run_s"] for f in frames),
                            "first_run_s_min": min(f["first_run_s"] for f in frames),
                            "first_run_ops_max": max(f["first_run_ops"] for f in frames),
                            "first_run_bytes_max": max(f["first_run_bytes"] for f in frames),
                            "exchange_s_median": statistics.median(slowest),
                            "exchange_s_q25_q75": list(statistics.quantiles(slowest, n=4)[::2]),
                            "exchange_ops_max": max(f["exchange_ops"] for f in frames),
                            "exchange_bytes_max": max(f["exchange_bytes"] for f in frames),
                            "settled_s_median": statistics.median(frames[0]["settled_s"]),
                            "settled_ops": frames[0]["settled_ops"],
                            "settled_bytes": frames[0]["settled_bytes"],
                            "record_bytes": max(f["record_bytes"] for f in frames),
                            "compile_s_max": max(f["compile_s"] for f in frames),
                            "compile_as_written_s_max": max(f["compile_as_written_s"] for f in frames),
                        }
                    )
                    sigs.setdefault(
                        name, [tuple(map(tuple, e["compiled_sigs"])) for e in per_rank[0]["entries"][i]]
                    )
    for kind, name in (("dp", "simple_fsdp"), ("fsdp_tp", "tp_dp_2x2")):
        report["simulated"].append(simulate(1024, kind, sigs[name]))
    report["wall_s"] = time.perf_counter() - t0
    report["load_after"] = os.getloadavg()[0]
    report["date"] = datetime.date.today().isoformat()
    return report


# ------------------------------------------------------------------ tables
def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _kib(b: float) -> str:
    return f"{b / 1024:.1f}"


def agreement_cost_tables(report: dict[str, Any]) -> str:
    lines = [
        "Agreement net, per compiled graph, first execution only (real gloo ranks; Store: keys + values both ways)",
        "",
        "| workload | ranks | groups/rank | verdict | first run ms (min..max rank) | exchange ms, TCPStore "
        "(median, slowest rank) | requests/rank | KiB/rank | settled recompile ms | requests | KiB | "
        "record KiB | compile s | + as written s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['workload']} | {r['world']} | {len(r['groups'])} | "
            f"{'/'.join(r['action'])} | {_ms(r['first_run_s_min'])}..{_ms(r['first_run_s_max'])} | "
            f"{_ms(r['exchange_s_median'])} | {r['exchange_ops_max']} | {_kib(r['exchange_bytes_max'])} | "
            f"{_ms(r['settled_s_median'])} | {r['settled_ops']} | {_kib(r['settled_bytes'])} | "
            f"{_kib(r['record_bytes'])} | {r['compile_s_max']:.2f} | {r['compile_as_written_s_max']:.2f} |"
        )
    lines += [
        "",
        "Store traffic at 1024 ranks (1024 simulated ranks on one in-process Store; counted, not timed)",
        "",
        "| layout | groups/rank | requests/rank (max) | KiB/rank (max) | requests at the Store | MiB at the Store | "
        "settled recompile: requests | KiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["simulated"]:
        layout = "DP 1024" if s["layout"] == "dp" else "FSDP 128 x TP 8"
        lines.append(
            f"| {layout} | {s['groups_per_rank']} | {s['ops_per_rank_max']} | {_kib(s['bytes_per_rank_max'])} | "
            f"{s['store_ops_total']} | {s['store_bytes_total'] / 2**20:.2f} | {s['settled_ops']} | "
            f"{_kib(s['settled_bytes'])} |"
        )
    lines += [
        "",
        f"load average {report['load_before']:.1f} before, {report['load_after']:.1f} after; "
        f"{report['wall_s']:.0f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--json", type=Path, help="write the report here (the layout benchmarks/run.py writes)")
    ap.add_argument("--markdown", type=Path, help="write the tables here")
    ap.add_argument("--from-json", type=Path, help="render a stored report instead of measuring")
    a = ap.parse_args(argv)
    from benchmarks.report import stand_alone_report

    return stand_alone_report(
        a, "agreement_cost", lambda: run_agreement_cost(reps=a.reps), agreement_cost_tables
    )


if __name__ == "__main__":
    sys.exit(main())
