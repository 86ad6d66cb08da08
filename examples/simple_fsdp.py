"""Train a Llama-style decoder with SimpleFSDP (or DDP), compiled.

Spawns 4 gloo CPU ranks. Every parameter is sharded along dim 0 over the 4
ranks and all-gathered inside the forward by a parametrization
(``commfuse.models.simple_fsdp.data_parallel``), so under ``torch.compile``
the all_gathers and the gradient reduce_scatters are part of the graphs
(FSDP2's ``fully_shard`` hooks are invisible to torch.compile). Trains a few
SGD steps eagerly and then under ``torch.compile(model, backend=BACKEND)``
from the same weights and prints both loss curves.

BACKEND is ``commfuse``;
override it with ``--backend``. Usage::

    python examples/simple_fsdp.py [--steps 4] [--mode replicate] [--backend aot_eager]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commfuse.models.common import default_backend, global_loss, print_loss_comparison, spawn_gloo
from commfuse.models.llama import LlamaConfig, build_llama
from commfuse.models.simple_fsdp import data_parallel, loss_fn, make_inputs

WORLD = 4
CONFIG = LlamaConfig(n_layers=4, dim=64, n_heads=8, ffn_dim=128)
BATCH, SEQ = 8, 32


def train(backend: object | None, steps: int, mode: str) -> list[float]:
    """``steps`` SGD steps with data parallelism; ``backend=None`` runs eagerly."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    model = data_parallel(build_llama(CONFIG, seed=0), mesh, mode)  # type: ignore[arg-type]
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    # model.parameters() are the DTensor shards (parametrizations.*.original):
    # the optimizer updates only this rank's slice of each weight.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # Rank r gets batch rows [2r, 2r+2); gradients are averaged like DDP.
    batch = make_inputs(CONFIG, BATCH, SEQ, rank=dist.get_rank(), world_size=WORLD)
    losses = []
    for _ in range(steps):
        loss = loss_fn(run(batch.inputs), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, batch).item())  # mean of the local means
    return losses


def worker(backend_name: str | None, steps: int, mode: str) -> None:
    backend = backend_name or default_backend()
    eager = train(None, steps, mode)
    compiled = train(backend, steps, mode)
    if dist.get_rank() == 0:
        title = f"Llama {CONFIG.n_layers} layers, SimpleFSDP mode={mode}, DP={WORLD}"
        print_loss_comparison(title, backend, eager, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: commfuse)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mode", default="fully_shard", choices=("fully_shard", "replicate"))
    args = parser.parse_args()
    spawn_gloo(worker, WORLD, args.backend, args.steps, args.mode)


if __name__ == "__main__":
    main()
