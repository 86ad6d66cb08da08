"""Train a Llama-style decoder with tensor + sequence parallelism, compiled.

Spawns 4 gloo CPU ranks (no torchrun needed), shards the model Megatron-style
with DTensor (``commfuse.models.llama.parallelize_llama``), and trains a few
SGD steps twice from the same weights: eagerly, then under
``torch.compile(model, backend=BACKEND)``. Prints both loss curves.

BACKEND is ``commfuse``;
override it with ``--backend``. Usage::

    python examples/llama_tp_sp.py [--steps 4] [--no-sp] [--backend aot_eager]
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
from commfuse.models.llama import LlamaConfig, build_llama, loss_fn, make_inputs, parallelize_llama

WORLD = 4
CONFIG = LlamaConfig(n_layers=4, dim=64, n_heads=8, ffn_dim=128)
BATCH, SEQ = 4, 32


def train(backend: object | None, steps: int, sp: bool) -> list[float]:
    """``steps`` SGD steps on the TP(+SP) model; ``backend=None`` runs eagerly."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    model = parallelize_llama(build_llama(CONFIG, seed=0), mesh, sequence_parallel=sp)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # With SP each rank gets its quarter of the sequence: [BATCH, SEQ/4, dim];
    # without SP the full [BATCH, SEQ, dim]. One fixed batch: the loss must drop.
    batch = make_inputs(CONFIG, BATCH, SEQ, rank=dist.get_rank(), world_size=WORLD, sequence_parallel=sp)
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


def worker(backend_name: str | None, steps: int, sp: bool) -> None:
    backend = backend_name or default_backend()
    eager = train(None, steps, sp)
    compiled = train(backend, steps, sp)
    if dist.get_rank() == 0:
        title = f"Llama {CONFIG.n_layers} layers, TP={WORLD}{' + SP' if sp else ''}"
        print_loss_comparison(title, backend, eager, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: commfuse)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="TP only (all_reduce) instead of TP+SP")
    args = parser.parse_args()
    spawn_gloo(worker, WORLD, args.backend, args.steps, args.sp)


if __name__ == "__main__":
    main()
