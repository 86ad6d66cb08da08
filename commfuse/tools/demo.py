"""`python -m commfuse demo`: 4 CPU gloo ranks, a TP+SP Llama block, compiled with commfuse.

Each rank builds the same model twice (identical seeds), parallelises both with
DTensor TP+SP, compiles one with `backend=commfuse.backend(...)`, and trains both
for a few SGD steps on the same data. The demo fails (exit 1) when the compiled
loss leaves the eager loss's tolerance on any rank, and prints what the compiler
saw: every graph's collectives with logged and wire bytes per rank, and where the
graph dumps are.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import time
from typing import Any

from commfuse.backend import backend as commfuse_backend
from commfuse.config import Config
from commfuse.core.errors import ConfigError
from commfuse.models import llama
from commfuse.reference.numerics import tolerances
from commfuse.session import setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        setup(mesh=mesh)
        cfg = llama.LlamaConfig(n_layers=args.layers, dim=64, n_heads=8, ffn_dim=128)
        eager = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        config = Config(inner_compiler=args.inner, dump_dir=args.dump_dir if rank == 0 else None)
        be = commfuse_backend(config)
        compiled = torch.compile(model, backend=be, fullgraph=True)
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
        opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
        rtol, atol = tolerances(torch.float32)
        losses = []
        t0 = time.perf_counter()
        for step in range(args.steps):
            batch = llama.make_inputs(
                cfg, 2, 32, rank=rank, world_size=world, sequence_parallel=True, seed=step
            )
            le = llama.loss_fn(eager(batch.inputs), batch)
            lc = llama.loss_fn(compiled(batch.inputs), batch)
            for loss, opt in ((le, opt_e), (lc, opt_c)):
                opt.zero_grad()
                loss.backward()
                opt.step()
            # Global loss = sum of per-rank shares (SP convention of the model).
            pair = torch.stack([le.detach(), lc.detach()])
            dist.all_reduce(pair)
            losses.append((float(pair[0]), float(pair[1])))
        elapsed = time.perf_counter() - t0
        ok = all(abs(c - e) <= atol + rtol * abs(e) for e, c in losses)
        if rank == 0:
            import json

            payload: dict[str, Any] = {
                "losses": losses,
                "ok": ok,
                "seconds": elapsed,
                "reports": [r.model_dump() for r in be.reports],
            }
            with open(out_path, "w") as f:
                json.dump(payload, f)
        flags = torch.tensor([int(ok)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not bool(flags.item()):
            raise SystemExit(f"rank {rank}: compiled loss differs from eager: {losses}")
    finally:
        dist.destroy_process_group()


def _print_summary(payload: dict, dump_dir: str | None, world: int) -> None:
    print("\nstep   eager loss        commfuse loss")
    for i, (e, c) in enumerate(payload["losses"]):
        print(f"{i:>4}   {e:.10f}    {c:.10f}")
    print(
        f"\nloss matches eager on all {world} ranks: {payload['ok']}  "
        f"({payload['seconds']:.1f} s for {len(payload['losses'])} steps incl. compile)"
    )
    print("\nWhat commfuse saw (per rank; logged = NCCL count semantics, wire = ring bytes sent):")
    for r in payload["reports"]:
        a = r["analysis"]
        passes = ", ".join(f"{p['name']}{'*' if p['changed'] else ''}" for p in r["passes"]) or "-"
        print(f"\n  {r['graph']} graph: {a['num_nodes']} nodes, passes: {passes}")
        print(f"    {'kind':<16}{'count':>6}{'logged B':>12}{'wire B':>12}   roles")
        for kind, t in a["by_kind"].items():
            roles = sorted(
                {c["role"] + "/dim" + str(c["logical_dim"]) for c in a["collectives"] if c["kind"] == kind}
            )
            print(
                f"    {kind:<16}{t['count']:>6}{str(t['logged_bytes']):>12}{str(t['wire_bytes']):>12}   {', '.join(roles)}"
            )
    if dump_dir:
        print(
            f"\nGraph dumps of rank 0 (FX code, SVG, analysis JSON per pass): {os.path.join(dump_dir, 'rank0')} "
            f"(index: {os.path.join(dump_dir, 'index.json')})"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=4, help="gloo ranks (processes) to start")
    p.add_argument("--steps", type=int, default=3, help="SGD steps, each compared with eager")
    p.add_argument("--layers", type=int, default=2, help="transformer layers of the Llama-style model")
    p.add_argument(
        "--inner",
        choices=["eager", "inductor"],
        default="eager",
        help="inner compiler (inductor: cold compiles of 4 ranks on 2 cores take minutes)",
    )
    p.add_argument("--dump-dir", default=None, help="graph dumps (default: a new temp directory)")


def run(args: argparse.Namespace) -> int:
    """Exit status 1 (with the reason on stderr) when the compiled loss left eager's tolerance."""
    if args.world_size < 1 or args.steps < 1 or args.layers < 1:
        raise ConfigError("--world-size, --steps and --layers must be positive")
    args.dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="commfuse_demo_")
    import torch.multiprocessing as mp

    out_path = os.path.join(args.dump_dir, "demo_result.json")
    print(
        f"commfuse demo: {args.world_size} gloo ranks on CPU, Llama-style TP+SP ({args.layers} layers), "
        f"inner compiler {args.inner}, {args.steps} SGD steps vs eager"
    )
    sys.stdout.flush()  # before the rank processes write to the same stdout
    try:
        mp.start_processes(
            _rank_main,
            args=(args.world_size, _free_port(), args, out_path),
            nprocs=args.world_size,
            join=True,
            start_method="spawn",
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        # A rank raised, or exited: the loss check ends every rank with SystemExit when the
        # compiled loss left the tolerance on any of them (its message is in the rank's stderr).
        print(f"commfuse demo: exit status 1: a rank failed:\n{e}", file=sys.stderr)
        return 1
    import json

    with open(out_path) as f:
        payload = json.load(f)
    _print_summary(payload, args.dump_dir, args.world_size)
    if payload["ok"]:
        return 0
    sys.stdout.flush()
    print(
        "commfuse demo: exit status 1: the compiled loss left the eager loss's tolerance (table above)",
        file=sys.stderr,
    )
    return 1
