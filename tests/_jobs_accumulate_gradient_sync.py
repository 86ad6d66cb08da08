"""Rank-pool job for tests/test_accumulate_gradient_sync.py (module level: the pool pickles it by reference).

SimpleFSDP (``fully_shard``) Llama block on the 4 gloo ranks, 4 micro-batches: one step of the plain
eager accumulation loop (a reduce_scatter per parameter per micro-batch) against
`compile_train_step` with the default pipeline (strict, eager inner compiler), whose
`accumulate_gradient_sync` syncs each gradient once. Loss and gradients must be equal under the
default fp32 tolerances of `torch.testing.assert_close`; returns what the pass decided. Also the
benchmark's "sync on the last micro-batch by hand" baseline (`ga:by-hand`) against the same loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from benchmarks.baselines import by_hand_accumulate
from benchmarks.workloads import get_workload
from commfuse.models import llama, simple_fsdp
from commfuse.train_step import compile_train_step

CFG = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)
M = 4
LOCAL_BATCH = 4


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def simple_fsdp_matches_loop() -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    b = simple_fsdp.make_inputs(CFG, world * LOCAL_BATCH, 8, rank=rank, world_size=world, seed=3)
    x, y = b.inputs, b.target

    torch._dynamo.reset()
    ref = simple_fsdp.data_parallel(llama.build_llama(CFG, seed=0), mesh, "fully_shard")
    ref_loss = None
    for xi, yi in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
        loss = _mse(ref(xi), yi) / M
        loss.backward()
        ref_loss = loss.detach() if ref_loss is None else ref_loss + loss.detach()

    model = simple_fsdp.data_parallel(llama.build_llama(CFG, seed=0), mesh, "fully_shard")
    step = compile_train_step(
        model, _mse, microbatches=M, config=commfuse.Config(inner_compiler="eager", strict=True)
    )
    loss = step(x, targets=y)
    where = f"rank {rank}"
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{where}: loss: {m}")
    got, want = _grads(model), _grads(ref)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], msg=lambda m, name=name: f"{where}: grad {name}: {m}"
        )

    _check_by_hand(world, rank)

    (joint,) = [r for r in step.reports if r.graph == "joint"]
    (rec,) = [p for p in joint.passes if p.name == "accumulate_gradient_sync"]
    return {
        "kept": [d["kept"] for d in rec.decisions if "kept" in d],
        # the pipeline's step-time gate, where it runs, adds its verdict to the pass's decisions
        "gate": [d["gate"] for d in rec.decisions if "gate" in d],
        "counts": dict(rec.counts),
        "refusals": list(rec.refusals),
        "input_kinds": dict(joint.input_kinds),
        "joint_reduce_scatters": joint.output_kinds.get("reduce_scatter", 0),
        "passes_failed": [p.name for r in step.reports for p in r.passes if p.error],
    }


def _check_by_hand(world: int, rank: int) -> None:
    """`ga:by-hand` (micro-batches 1..M-1 keep their unsharded gradients, the last reduce-scatters the
    sum) gives the plain loop's loss and gradients on the `simple_fsdp_ga:s` workload."""
    workload = get_workload("simple_fsdp_ga:s")
    ref = workload.build(world, rank)
    ref_loss = None
    for xs in zip(*(t.tensor_split(ref.microbatches) for t in ref.inputs), strict=True):
        loss = ref.loss(ref.model(*xs))
        loss.backward()
        ref_loss = loss.detach() if ref_loss is None else ref_loss + loss.detach()
    hand = workload.build(world, rank)
    torch.testing.assert_close(by_hand_accumulate(hand), ref_loss)
    got, want = _grads(hand.model), _grads(ref.model)
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], msg=lambda m, name=name: f"rank {rank}: by-hand {name}: {m}"
        )
