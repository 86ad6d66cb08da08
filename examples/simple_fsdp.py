"""Train a Llama-style decoder with SimpleFSDP (or DDP), compiled.

Every parameter is sharded along dim 0 over the ranks and all-gathered inside the
forward by a parametrization
(``commfuse.models.simple_fsdp.data_parallel``), so under ``torch.compile``
the all_gathers and the gradient reduce_scatters are part of the graphs
(FSDP2's ``fully_shard`` hooks are invisible to torch.compile). Trains a few
SGD steps eagerly and then under ``torch.compile(model, backend=BACKEND)``
from the same weights and prints both loss curves. CPU ranks use gloo, GPU ranks
NCCL (one GPU each). BACKEND is ``commfuse``; override it with ``--backend``. Usage::

    torchrun --nproc-per-node 4 examples/simple_fsdp.py [--steps 4] [--mode replicate] [--backend aot_eager]

The rank count must divide the batch of 8 and the sharded dims (1, 2, 4 or 8).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commfuse.models.common import (
    batch_to,
    default_backend,
    global_loss,
    init_distributed,
    print_loss_comparison,
)
from commfuse.models.llama import LlamaConfig, build_llama
from commfuse.models.simple_fsdp import data_parallel, loss_fn, make_inputs

CONFIG = LlamaConfig(n_layers=4, dim=64, n_heads=8, ffn_dim=128)
BATCH, SEQ = 8, 32


def train(device: str, backend: object | None, steps: int, mode: str) -> list[float]:
    """``steps`` SGD steps with data parallelism; ``backend=None`` runs eagerly."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    model = data_parallel(build_llama(CONFIG, seed=0).to(device), mesh, mode)  # type: ignore[arg-type]
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    # model.parameters() are the DTensor shards (parametrizations.*.original):
    # the optimizer updates only this rank's slice of each weight.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # Rank r gets its BATCH/world rows; gradients are averaged like DDP.
    batch = batch_to(make_inputs(CONFIG, BATCH, SEQ, rank=dist.get_rank(), world_size=world), device)
    losses = []
    for _ in range(steps):
        loss = loss_fn(run(batch.inputs), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, batch).item())  # mean of the local means
    return losses


def worker(device: str, backend_name: str | None, steps: int, mode: str) -> None:
    backend = backend_name or default_backend()
    eager = train(device, None, steps, mode)
    compiled = train(device, backend, steps, mode)
    if dist.get_rank() == 0:
        title = f"Llama {CONFIG.n_layers} layers, SimpleFSDP mode={mode}, DP={dist.get_world_size()}"
        print_loss_comparison(title, backend, eager, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: commfuse)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mode", default="fully_shard", choices=("fully_shard", "replicate"))
    args = parser.parse_args()
    device = init_distributed()
    try:
        worker(device, args.backend, args.steps, args.mode)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
