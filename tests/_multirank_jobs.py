"""Jobs run on every rank of a gloo pool (module-level so the pool can pickle them)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.testing.numerics import assert_close_tree, train_step_outputs


def _example(name: str, dtype: torch.dtype) -> tuple[Callable[[], torch.nn.Module], Callable[[int], Any]]:
    """(model factory, input factory) for one example model on the current world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    if name == "llama_tp_sp":
        from commfuse.models import llama

        cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

        def model():
            return llama.parallelize_llama(llama.build_llama(cfg, seed=0).to(dtype), mesh, sequence_parallel=True)

        def inputs(step):
            return llama.make_inputs(cfg, 2, 8, rank=rank, world_size=world, seed=step).inputs.to(dtype)
    elif name == "moe_ep":
        from commfuse.models import moe

        def model():
            return moe.parallelize_moe(moe.build_moe(dim=16, num_experts=world * 2, ffn_dim=32, seed=0).to(dtype), mesh)

        def inputs(step):
            return moe.make_inputs(world * 2, 4, 16, rank=rank, world_size=world, seed=step).inputs.to(dtype)
    elif name == "simple_fsdp":
        from commfuse.models import llama, simple_fsdp

        cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)

        def model():
            return simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0).to(dtype), mesh, "fully_shard")

        def inputs(step):
            return simple_fsdp.make_inputs(cfg, world * 2, 8, rank=rank, world_size=world, seed=step).inputs.to(dtype)
    else:
        raise ValueError(name)
    return model, inputs


def compiled_matches_eager(name: str, dtype_name: str, inner: str = "eager", steps: int = 2) -> dict:
    """Train `steps` SGD steps eagerly and with backend=commfuse; assert outputs, grads, params close."""
    dtype = getattr(torch, dtype_name)
    model, inputs = _example(name, dtype)
    torch._dynamo.reset()
    ref = train_step_outputs(model, inputs, steps=steps, lr=0.05)
    be = commfuse.backend(commfuse.Config(inner_compiler=inner, strict=True))
    got = train_step_outputs(model, inputs, backend=be, steps=steps, lr=0.05)
    assert_close_tree(got, ref, dtype=dtype, msg=f"{name} {dtype_name} rank {dist.get_rank()}")
    kinds = sorted({k for r in be.reports if r.analysis for k in r.analysis.by_kind})
    return {"kinds": kinds, "graphs": [r.graph for r in be.reports], "state_dict": _state_dict_meta(model, inputs)}


def _state_dict_meta(model_factory, inputs) -> list:
    """Compile and run a fresh model; parameter names, shapes and dtypes must not change."""
    m = model_factory()
    before = {k: (tuple(v.shape), str(v.dtype)) for k, v in m.state_dict().items()}
    torch._dynamo.reset()
    torch.compile(m, backend=commfuse.backend(inner_compiler="eager"))(inputs(0))
    after = {k: (tuple(v.shape), str(v.dtype)) for k, v in m.state_dict().items()}
    assert before == after, (before, after)
    return sorted(before)
