"""Train a Llama-style decoder with tensor + sequence parallelism, compiled.

Shards the model Megatron-style over all ranks with DTensor
(``commfuse.models.llama.parallelize_llama``) and trains a few SGD steps twice from
the same weights: eagerly, then under ``torch.compile(model, backend=BACKEND)``.
Prints both loss curves and checks they agree. CPU ranks use gloo, GPU ranks NCCL
(one GPU each). BACKEND is ``commfuse``; override it with ``--backend``. Usage::

    torchrun --nproc-per-node 4 examples/llama_tp_sp.py [--steps 4] [--no-sp] [--backend aot_eager]

The rank count must divide the 8 heads and, with SP, the 32 positions (1, 2, 4 or 8).
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
from commfuse.models.llama import LlamaConfig, build_llama, loss_fn, make_inputs, parallelize_llama

CONFIG = LlamaConfig(n_layers=4, dim=64, n_heads=8, ffn_dim=128)
BATCH, SEQ = 4, 32


def train(device: str, backend: object | None, steps: int, sp: bool) -> list[float]:
    """``steps`` SGD steps on the TP(+SP) model; ``backend=None`` runs eagerly."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
    model = parallelize_llama(build_llama(CONFIG, seed=0).to(device), mesh, sequence_parallel=sp)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # With SP each rank gets its share of the sequence: [BATCH, SEQ/world, dim];
    # without SP the full [BATCH, SEQ, dim]. One fixed batch: the loss must drop.
    batch = batch_to(
        make_inputs(CONFIG, BATCH, SEQ, rank=dist.get_rank(), world_size=world, sequence_parallel=sp), device
    )
    losses = []
    for _ in range(steps):
        loss = loss_fn(run(batch.inputs), batch)
        loss.backward()
        # SP norm-weight grads are Partial DTensors: the optimizer's update
        # reduces them (DTensor redistributes them to the weights' Replicate).
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, batch).item())
    return losses


def worker(device: str, backend_name: str | None, steps: int, sp: bool) -> None:
    backend = backend_name or default_backend()
    eager = train(device, None, steps, sp)
    compiled = train(device, backend, steps, sp)
    if dist.get_rank() == 0:
        title = f"Llama {CONFIG.n_layers} layers, TP={dist.get_world_size()}{' + SP' if sp else ''}"
        print_loss_comparison(title, backend, eager, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: commfuse)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--no-sp", dest="sp", action="store_false", help="TP only (all_reduce) instead of TP+SP"
    )
    args = parser.parse_args()
    device = init_distributed()
    try:
        worker(device, args.backend, args.steps, args.sp)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
