"""Train a GShard mixture-of-experts block with expert parallelism, compiled.

Spawns 4 gloo CPU ranks; each holds 2 of the 8 experts and its own quarter of
the batch. Tokens travel to their experts and back with two all_to_alls per
forward (``commfuse.models.moe``). Trains a few SGD steps eagerly and then
under ``torch.compile(model, backend=BACKEND)`` from the same weights and
prints both loss curves (MSE + load-balancing auxiliary loss).

BACKEND is ``commfuse``;
override it with ``--backend``. Usage::

    python examples/moe_ep.py [--steps 4] [--top-k 2] [--backend aot_eager]
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
from commfuse.models.moe import build_moe, loss_fn, make_inputs, parallelize_moe

WORLD = 4
DIM, NUM_EXPERTS, FFN_DIM = 64, 8, 128
BATCH, SEQ = 8, 32


def train(backend: object | None, steps: int, top_k: int) -> list[float]:
    """``steps`` SGD steps on the EP model; ``backend=None`` runs eagerly."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    model = build_moe(DIM, NUM_EXPERTS, FFN_DIM, top_k=top_k, capacity_factor=1.25, seed=0)
    model = parallelize_moe(model, mesh)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # Rank r gets batch rows [2r, 2r+2): [BATCH/4, SEQ, DIM]. Capacity is
    # computed from these local tokens.
    batch = make_inputs(BATCH, SEQ, DIM, rank=dist.get_rank(), world_size=WORLD)
    losses = []
    for _ in range(steps):
        out, aux = run(batch.inputs)
        loss = loss_fn(out, aux, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, batch).item())  # per-rank losses sum up
    return losses


def worker(backend_name: str | None, steps: int, top_k: int) -> None:
    backend = backend_name or default_backend()
    eager = train(None, steps, top_k)
    compiled = train(backend, steps, top_k)
    if dist.get_rank() == 0:
        title = f"MoE {NUM_EXPERTS} experts top-{top_k}, EP={WORLD}"
        print_loss_comparison(title, backend, eager, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: commfuse)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2, choices=(1, 2))
    args = parser.parse_args()
    spawn_gloo(worker, WORLD, args.backend, args.steps, args.top_k)


if __name__ == "__main__":
    main()
