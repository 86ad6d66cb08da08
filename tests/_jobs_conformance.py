"""Rank jobs of the third-party conformance tier (tests/test_conformance_*.py): third-party models
built, parallelised and trained the way their own code does it, compiled with commfuse's
default config and executor, compared with eager."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

import commfuse
from benchmarks.thirdparty import (
    hf_from_pretrained,
    titan_loss,
    titan_parallel,
    titan_parallelize,
    torchrun_env,
)


def _record_step(out: dict[str, Any], key: str, model, loss: torch.Tensor, lr: float) -> None:
    """After ``loss.backward()``: record the loss and every local gradient under ``key``, then
    take one SGD step."""
    out[key + "loss"].append(float(loss))
    out[key + "grads"].append({n: _local(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


def _summary(out: dict[str, Any], reports, caught) -> dict[str, Any]:
    """What commfuse did to the compiled graphs, and its warnings."""
    out["collectives_before"] = _kinds(reports, before=True)
    out["collectives"] = _kinds(reports)
    out["graphs"] = sorted({r.graph for r in reports})
    out["passes_changed"] = sorted({p.name for r in reports for p in r.passes if p.changed})
    out["topology"] = sorted({r.topology for r in reports})
    out["wire_bytes"] = _wire_bytes(reports)
    # the step-time gate's verdicts: "<graph>/<pass>" -> [verdict, ...]
    out["gate"] = {
        f"{r.graph}/{p.name}": [d for d in p.decisions if "gate" in d]
        for r in reports
        for p in r.passes
        if any("gate" in d for d in p.decisions)
    }
    out["warnings"] = sorted({str(w.message)[:300] for w in caught if "commfuse" in str(w.message)})
    return out


def _wire_bytes(reports) -> list[tuple[str, Any, Any]]:
    """Per compiled graph: (graph, wire bytes per rank before commfuse's pipeline, after)."""
    return [(r.graph, r.input_wire_bytes, r.output_wire_bytes) for r in reports]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _kinds(reports, before: bool = False) -> dict[str, int]:
    """Collectives per kind over the compiled graphs, after commfuse's pipeline (or before it)."""
    out: dict[str, int] = {}
    for r in reports:
        for k, n in (r.input_kinds if before else r.output_kinds).items():
            out[k] = out.get(k, 0) + n
    return out


def hf_trains_like_eager(
    checkpoint: str, distributed: dict[str, int], shapes: list[tuple[int, int]], use_setup: bool = False
) -> dict[str, Any]:
    """A transformers causal LM loaded with ``DistributedConfig(**distributed)`` (its own
    ``tp_plan`` / ``ep_plan``), one SGD step per input shape, eager vs
    ``torch.compile(backend="commfuse")`` (default Config and executor); ``use_setup``:
    ``commfuse.setup(mesh=<the parameters' mesh>)`` first. Returns losses, every local gradient,
    the collectives the compiled graphs issue before and after commfuse, and commfuse's warnings."""
    torch._dynamo.reset()  # earlier jobs of this worker compiled the same model code

    with torchrun_env():
        ref, model = hf_from_pretrained(checkpoint, distributed), hf_from_pretrained(checkpoint, distributed)
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
            ids = torch.randint(
                0, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(step)
            )
            for m, fn, key in ((ref, ref, "ref_"), (model, compiled, "")):
                m.zero_grad(set_to_none=True)
                loss = fn(input_ids=ids, labels=ids).loss
                loss.backward()
                _record_step(out, key, m, loss, 0.1)
    return _summary(out, be.reports, caught)


# ---------------------------------------------------------------- torchtitan 0.3.0


def titan_trains_like_eager(
    family: str,
    degrees: dict[str, int],
    shapes: list[tuple[int, int]],
    ac: str | None = None,
    n_layers: int = 1,
    lr: float = 0.1,
    backend: str = "commfuse",
    env_config: str | None = None,
) -> dict[str, Any]:
    """A torchtitan model parallelised by its own ``parallelize_*`` function (DTensor TP/SP/EP,
    ``spmd_backend="partial_dtensor"`` so the collectives are in the compiled graphs), with
    torchtitan's per-block compile (``CompileConfig(backend="commfuse")``) against the same model
    parallelised the same way and run eagerly; torchtitan's loss (vocab-parallel when the output is
    vocab-sharded), one SGD step per input shape. ``env_config``: commfuse's config given through
    the ``COMMFUSE_CONFIG`` environment variable (torchtitan passes a backend *name*)."""
    par = titan_parallel(degrees)

    def build(compiled: bool):
        return titan_parallelize(family, par, n_layers=n_layers, compiled=compiled, backend=backend, ac=ac)

    torch._dynamo.reset()  # earlier jobs of this worker compiled the same block code
    if env_config is not None:
        os.environ[commfuse.CONFIG_ENV] = env_config
    try:
        with torchrun_env():
            ref, model = build(False), build(True)
            return _train_titan(ref, model, shapes, lr)
    finally:
        os.environ.pop(commfuse.CONFIG_ENV, None)


def _train_titan(ref, model, shapes, lr) -> dict[str, Any]:
    seen = len(commfuse.recent_reports())
    out: dict[str, Any] = {"loss": [], "ref_loss": [], "grads": [], "ref_grads": []}
    vocab = model.tok_embeddings.weight.shape[0]  # the global size, DTensor or not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (b, s) in enumerate(shapes):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, vocab, (b, s + 1), generator=g)
            inputs, labels = ids[:, :-1], ids[:, 1:]
            for m, key in ((ref, "ref_"), (model, "")):
                m.zero_grad(set_to_none=True)
                logits = m(inputs)
                out["logits"] = str(getattr(logits, "placements", "local"))
                loss = titan_loss(logits, labels)
                loss.backward()
                _record_step(out, key, m, loss, lr)
    return _summary(out, commfuse.recent_reports()[seen:], caught)
