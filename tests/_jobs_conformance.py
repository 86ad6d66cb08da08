"""Rank jobs of the third-party conformance tier (tests/test_conformance_*.py): third-party models
built, parallelised and trained the way their own code does it, compiled with commfuse's
default config and executor, compared with eager."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

import commfuse


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
    out["warnings"] = sorted({str(w.message)[:300] for w in caught if "commfuse" in str(w.message)})
    return out


def _wire_bytes(reports) -> list[tuple[str, Any, Any]]:
    """Per compiled graph: (graph, wire bytes per rank before commfuse's pipeline, after)."""
    return [(r.graph, r.input_wire_bytes, r.output_wire_bytes) for r in reports]


@contextlib.contextmanager
def _torchrun_env():
    """What torchrun would have set, for the job only (Hugging Face's distributed loading reads it;
    commfuse detects its topology from it). The pool's workers run other tests' jobs afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _kinds(reports, before: bool = False) -> dict[str, int]:
    """Collectives per kind over the compiled graphs, after commfuse's pipeline (or before it)."""
    out: dict[str, int] = {}
    for r in reports:
        for k, n in (r.input_kinds if before else r.output_kinds).items():
            out[k] = out.get(k, 0) + n
    return out


def hf_trains_like_eager(checkpoint: str, distributed: dict[str, int], shapes: list[tuple[int, int]],
                         use_setup: bool = False) -> dict[str, Any]:
    """A transformers causal LM loaded with ``DistributedConfig(**distributed)`` (its own
    ``tp_plan`` / ``ep_plan``), one SGD step per input shape, eager vs
    ``torch.compile(backend="commfuse")`` (default Config and executor); ``use_setup``:
    ``commfuse.setup(mesh=<the parameters' mesh>)`` first. Returns losses, every local gradient,
    the collectives the compiled graphs issue before and after commfuse, and commfuse's warnings."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch._dynamo.reset()  # earlier jobs of this worker compiled the same model code

    def load():
        return AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(**distributed),
                                                    dtype=torch.float32, attn_implementation="sdpa")

    with _torchrun_env():
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
                _record_step(out, key, m, loss, 0.1)
    return _summary(out, be.reports, caught)


# ---------------------------------------------------------------- torchtitan 0.3.0


def _titan_on_cpu() -> None:
    """torchtitan picks "cuda" as its device type when no accelerator is present; point it at the
    CPU before any of its parallelize functions read it."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"


def _titan_model(family: str, n_layers: int, parallelism, *, seed: int = 0):
    """torchtitan's own debug model of ``family`` ("llama3" or "deepseek_v3") truncated to
    ``n_layers`` (deepseek_v3: its MoE layers), SDPA attention (the registry offers flex/varlen only; torchtitan's graph_trainer
    tests swap the same way), built on meta and initialised identically on every rank."""
    import importlib

    from torchtitan.models.common.attention import ScaledDotProductAttention

    mod = importlib.import_module(f"torchtitan.models.{family}")
    spec = mod.model_registry("debugmodel")
    cfg = spec.model
    # deepseek_v3's first layer is dense: start after it, so that one layer is a MoE layer
    first = 1 if family == "deepseek_v3" else 0
    cfg.layers = cfg.layers[first:first + n_layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()

    class _RuntimeConfig:  # what update_from_config reads from a Trainer.Config
        pass

    rc = _RuntimeConfig()
    rc.parallelism = parallelism
    cfg.update_from_config(config=rc)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return spec, model


def titan_trains_like_eager(family: str, degrees: dict[str, int], shapes: list[tuple[int, int]],
                            ac: str | None = None, n_layers: int = 1, lr: float = 0.1,
                            backend: str = "commfuse", env_config: str | None = None) -> dict[str, Any]:
    """A torchtitan model parallelised by its own ``parallelize_*`` function (DTensor TP/SP/EP,
    ``spmd_backend="partial_dtensor"`` so the collectives are in the compiled graphs), with
    torchtitan's per-block compile (``CompileConfig(backend="commfuse")``) against the same model
    parallelised the same way and run eagerly; torchtitan's loss (vocab-parallel when the output is
    vocab-sharded), one SGD step per input shape. ``env_config``: commfuse's config given through
    the ``COMMFUSE_CONFIG`` environment variable (torchtitan passes a backend *name*)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from torchtitan.distributed.utils import set_spmd_backend

    _titan_on_cpu()
    set_spmd_backend("partial_dtensor")  # what torchtitan's Trainer does with parallelism.spmd_backend
    world = dist.get_world_size()
    parallelism = ParallelismConfig(
        tensor_parallel_degree=degrees.get("tp", 1), expert_parallel_degree=degrees.get("ep", 1),
        data_parallel_shard_degree=degrees.get("dp_shard", 1), spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    ac_config = {None: None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[ac]
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")

    def build(compiled: bool):
        spec, model = _titan_model(family, n_layers, parallelism)
        compile_config = CompileConfig(enable=compiled, components=["model"], backend=backend)
        if not dims.dp_shard_enabled:
            return spec.parallelize_fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                       compile_config=compile_config, ac_config=ac_config, dump_folder="")
        # torchtitan's data-parallel sharding (FSDP2) reduces with PREMUL_SUM, which gloo lacks:
        # shard the SimpleFSDP way, with torchtitan's graph_trainer (its order: TP, then SimpleFSDP)
        from torchtitan.distributed.compile import apply_compile
        from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

        if dims.tp_enabled:
            model.parallelize(dims)
        if ac_config is not None:
            ac_config.build(dump_folder="").apply(model)
        model = apply_simple_fsdp(model, parallel_dims=dims, training=training)
        if compiled:
            apply_compile(model, compile_config=compile_config, parallel_dims=dims)
        return model

    torch._dynamo.reset()  # earlier jobs of this worker compiled the same block code
    if env_config is not None:
        os.environ[commfuse.CONFIG_ENV] = env_config
    try:
        with _torchrun_env():
            ref, model = build(False), build(True)
            return _train_titan(ref, model, shapes, lr, cross_entropy_loss)
    finally:
        os.environ.pop(commfuse.CONFIG_ENV, None)


def _train_titan(ref, model, shapes, lr, cross_entropy_loss) -> dict[str, Any]:
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
                loss = cross_entropy_loss(logits, labels) / labels.numel()
                loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
                loss.backward()
                _record_step(out, key, m, loss, lr)
    return _summary(out, commfuse.recent_reports()[seen:], caught)
