"""Quickstart: a tensor-parallel model compiled with commfuse, launched the way you launch training.

    torchrun --nproc-per-node 2 examples/quickstart.py

Runs unchanged on CPU (gloo) and on GPUs (NCCL, one GPU per rank): the device and the
process-group backend follow ``torch.cuda.is_available()``. Each rank builds the same model
(same seed), shards it Megatron-style over a ``tp`` mesh with DTensor, compiles it with
``backend="commfuse"`` (the default executor: commfuse's runtime issuing the collectives,
Inductor compiling the compute between them) and trains a few SGD steps. Rank 0 prints the
losses and, per compiled graph, the collectives before and after commfuse's passes.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import commfuse


class Block(nn.Module):
    """Pre-norm SwiGLU MLP with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w3 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))

    torch.manual_seed(0)  # the same weights and batch on every rank
    model = nn.Sequential(*[Block(128) for _ in range(2)]).to(device)
    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    for block in model:
        parallelize_module(block, mesh, plan)

    compiled = torch.compile(model, backend="commfuse")
    # DTensor weights beside plain ones (the norms): the foreach kernels CUDA optimizers
    # default to take one kind per call
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(8, 64, 128, device=device)
    for step in range(4):
        loss = compiled(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.5f}")

    if dist.get_rank() == 0:  # collectives per kind, before -> after, per compiled graph
        for r in commfuse.recent_reports():
            print(f"{r.graph}: {r.input_kinds} -> {r.output_kinds}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
