"""Train a GShard mixture-of-experts block with expert parallelism, compiled.

Each rank holds 8 / world of the 8 experts and its own share of the batch. Tokens
travel to their experts and back with two all_to_alls per forward
(``commfuse.models.moe``). Trains a few SGD steps eagerly and then under
``torch.compile(model, backend=BACKEND)`` from the same weights and prints both loss
curves (MSE + load-balancing auxiliary loss). CPU ranks use gloo, GPU ranks NCCL (one
GPU each). BACKEND is ``commfuse``; override it with ``--backend``. Usage::

    torchrun --nproc-per-node 4 examples/moe_ep.py [--steps 4] [--top-k 2] [--backend aot_eager]

The rank count must divide the 8 experts and the batch of 8 (1, 2, 4 or 8).
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
from commfuse.models.moe import build_moe, loss_fn, make_inputs, parallelize_moe

DIM, NUM_EXPERTS, FFN_DIM = 64, 8, 128
BATCH, SEQ = 8, 32


def train(device: str, backend: object | None, steps: int, top_k: int) -> list[float]:
    """``steps`` SGD steps on the EP model; ``backend=None`` runs eagerly."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("ep",))
    model = build_moe(DIM, NUM_EXPERTS, FFN_DIM, top_k=top_k, capacity_factor=1.25, seed=0).to(device)
    model = parallelize_moe(model, mesh)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    # DTensor experts beside the plain router: the foreach kernels CUDA optimizers default to
    # take one kind per call
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    # Rank r gets its BATCH/world rows: [BATCH/world, SEQ, DIM]. Capacity is
    # computed from these local tokens.
    batch = batch_to(make_inputs(BATCH, SEQ, DIM, rank=dist.get_rank(), world_size=world), device)
    losses = []
    for _ in range(steps):
        out, aux = run(batch.inputs)
        loss = loss_fn(out, aux, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, batch).item())  # per-rank losses sum up
    return losses


def worker(device: str, backend_name: str | None, steps: int, top_k: int) -> None:
    backend = backend_name or default_backend()
    eager = train(device, None, steps, top_k)
    compiled = train(device, backend, steps, top_k)
    if dist.get_rank() == 0:
        title = f"MoE {NUM_EXPERTS} experts top-{top_k}, EP={dist.get_world_size()}"
        print_loss_comparison(title, backend, eager, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: commfuse)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2, choices=(1, 2))
    args = parser.parse_args()
    device = init_distributed()
    try:
        worker(device, args.backend, args.steps, args.top_k)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
