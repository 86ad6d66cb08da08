"""Rank-pool jobs for tests/test_train_step.py (module level: the pool pickles them by reference).

Each job builds one DTensor-parallelised Llama block on the 4 gloo ranks and, for each given
micro-batch count (1, 2, 4), runs two SGD steps of

* the plain eager gradient-accumulation loop (the definition of the semantics), and
* `commfuse.compile_train_step` with the default pipeline (strict, eager inner compiler),

asserts loss, gradients and parameters close under the tolerance policy, and returns what
the compiler saw so the test can assert that the micro-batches were in one joint graph.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.models import llama, simple_fsdp
from commfuse.reference.numerics import assert_close_tree
from commfuse.train_step import compile_train_step

CFG = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)
LOCAL_BATCH = 4
STEPS = 2
LR = 0.05


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Mean over this rank's shard: gradients of magnitude O(1), the scale the policy assumes.
    return (out.float() - target).pow(2).mean()


def _setup(
    layout: str,
) -> tuple[
    Callable[[], torch.nn.Module], Callable[[int], tuple[torch.Tensor, torch.Tensor]], commfuse.Config
]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    if layout in ("simple_fsdp", "ddp"):
        mode = "fully_shard" if layout == "simple_fsdp" else "replicate"

        def model() -> torch.nn.Module:
            return simple_fsdp.data_parallel(llama.build_llama(CFG, seed=0), mesh, mode)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            b = simple_fsdp.make_inputs(CFG, world * LOCAL_BATCH, 8, rank=rank, world_size=world, seed=step)
            return b.inputs, b.target

        cfg = commfuse.Config(inner_compiler="eager", strict=True)
    elif layout == "tp_sp":

        def model() -> torch.nn.Module:
            return llama.parallelize_llama(llama.build_llama(CFG, seed=0), mesh, sequence_parallel=True)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            b = llama.make_inputs(CFG, LOCAL_BATCH, 8, rank=rank, world_size=world, seed=step)
            return b.inputs, b.target  # this rank's sequence shard of every sample

        # TP groups are declared, as a user would with commfuse.setup(mesh=...).
        cfg = commfuse.Config(
            inner_compiler="eager", strict=True, group_roles={mesh.get_group().group_name: "tp"}
        )
    else:
        raise ValueError(layout)
    return model, batch, cfg


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().clone()


def _state(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "grads": {n: _local(p.grad) for n, p in model.named_parameters()},
        "params": {n: _local(p) for n, p in model.named_parameters()},
    }


def _plain_loop(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """The reference: gradient accumulation written the ordinary way, eagerly."""
    total = None
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        loss = _mse(model(xi), yi) / m
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def _train(model: torch.nn.Module, batch, step_fn) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads_step0 = [], None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step)
        losses.append(step_fn(x, y))
        if step == 0:
            grads_step0 = _state(model)["grads"]
        opt.step()
    return {"loss": losses, "grads0": grads_step0, **_state(model)}


def train_step_matches_loop(layout: str, microbatches: list[int]) -> dict[str, Any]:
    """For each micro-batch count: compiled step vs plain loop (2 SGD steps); returns per count what
    the compiler saw (Dynamo graphs, nodes per micro-batch tag, collectives of the joint graph)."""
    make_model, batch, cfg = _setup(layout)
    where = f"on rank {dist.get_rank()}"
    seen: dict[int, Any] = {}
    full_batch_grads = None
    for m in microbatches:
        torch._dynamo.reset()
        ref_model = make_model()
        ref = _train(ref_model, batch, lambda x, y, mod=ref_model, m=m: _plain_loop(mod, x, y, m))
        model = make_model()
        step = compile_train_step(model, _mse, microbatches=m, config=cfg)
        got = _train(model, batch, lambda x, y: step(x, targets=y))  # noqa: B023 - _train runs it now
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"{where}, microbatches={m}")
        # Equal micro-batches of a mean loss: accumulation gives the full batch's gradient.
        if m == 1:
            full_batch_grads = got["grads0"]
        elif full_batch_grads is not None:
            assert_close_tree(
                got["grads0"], full_batch_grads, dtype=torch.float32, msg=f"{where}, microbatches={m} vs 1"
            )
        joint = [r for r in step.reports if r.graph == "joint"]
        seen[m] = {
            "graph_count": step.graph_count,
            "dynamo_graphs": len(step.graphs),  # 1: the second step reused the compiled graph
            "nodes_per_microbatch": step.graphs[0].nodes_per_microbatch,
            "linear": step.graphs[0].op_counts.get("linear", 0),
            "joint_graphs": len(joint),
            "joint_kinds": {k: t.count for k, t in joint[0].analysis.by_kind.items()},
            "passes_failed": [p.name for r in step.reports for p in r.passes if p.error],
        }
    return seen
