"""Rank jobs of the third-party conformance tier (tests/test_conformance_*.py): third-party models
built, parallelised and trained the way their own code does it, compiled with commfuse's
default config and executor, compared with eager."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import commfuse


def _torchrun_env() -> None:
    """What torchrun would have set (Hugging Face's distributed loading reads it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _kinds(reports) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in reports:
        if r.analysis is None:
            continue
        for c in r.analysis.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
    return out


def hf_llama_tp_trains_like_eager(checkpoint: str, use_setup: bool, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """transformers' LlamaForCausalLM loaded with ``DistributedConfig(tp_size=world)`` (its
    ``tp_plan``), one SGD step per input shape, eager vs ``torch.compile(backend="commfuse")``
    (default Config and executor); ``use_setup``: ``commfuse.setup(mesh=<the parameters' mesh>)``
    first. Returns losses, every local gradient, the collectives the compiled graphs issue and
    commfuse's warnings."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    _torchrun_env()

    def load():
        return AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(
            tp_size=dist.get_world_size()), dtype=torch.float32, attn_implementation="sdpa")

    ref, model = load(), load()
    try:
        return _train_both(ref, model, use_setup, shapes)
    finally:
        commfuse.session.reset()  # the next job of this worker starts without this mesh's roles


def _train_both(ref, model, use_setup: bool, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    if use_setup:
        mesh = next(p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh"))
        commfuse.setup(mesh=mesh)
    be = commfuse.CommfuseBackend()  # what backend="commfuse" builds; kept to read its reports
    # dynamic=False: the second shape recompiles with static shapes. With automatic dynamic
    # shapes, AOTAutograd's trace of this model's backward dies with a RecursionError under
    # backend="aot_eager" too (torch 2.13, transformers 5.24): not a commfuse path.
    compiled = torch.compile(model, backend=be, dynamic=False)
    out: dict[str, Any] = {"loss": [], "ref_loss": [], "grads": [], "ref_grads": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (b, s) in enumerate(shapes):
            ids = torch.randint(0, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(step))
            for m, fn, key in ((ref, ref, "ref_"), (model, compiled, "")):
                m.zero_grad(set_to_none=True)
                loss = fn(input_ids=ids, labels=ids).loss
                loss.backward()
                out[key + "loss"].append(float(loss))
                out[key + "grads"].append({n: _local(p.grad) for n, p in m.named_parameters() if p.grad is not None})
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p.sub_(0.1 * p.grad)
    out["collectives"] = _kinds(be.reports)
    out["graphs"] = sorted({r.graph for r in be.reports})
    out["warnings"] = sorted({str(w.message)[:300] for w in caught if "commfuse" in str(w.message)})
    return out
