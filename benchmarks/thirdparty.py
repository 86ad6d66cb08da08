"""Third-party models built and parallelised by their libraries' own code, on CPU gloo ranks.

Shared by the declared benchmark workloads (``benchmarks/declared.py``) and the third-party
conformance tests (``tests/_jobs_conformance.py``): torchtitan's llama3 / deepseek_v3 built the
way its Trainer builds them and parallelised by its own ``parallelize_*`` functions, and Hugging
Face transformers models loaded with its ``DistributedConfig`` (the model's own ``tp_plan``).
What it takes to run them on CPU gloo ranks (device type, attention, FSDP2 vs gloo) is handled
by the functions below, each saying why.

Every function here runs inside a rank of a live gloo process group; the libraries are imported
lazily, so importing this module needs neither of them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "TitanParallel",
    "hf_from_pretrained",
    "hf_llama",
    "shared_titan_meshes",
    "titan_loss",
    "titan_model",
    "titan_on_cpu",
    "titan_parallel",
    "titan_parallelize",
    "torchrun_env",
]


@contextlib.contextmanager
def torchrun_env() -> Iterator[None]:
    """What torchrun would have set, for the block only (Hugging Face's distributed loading reads it;
    commfuse detects its topology from it). A rank pool's workers run other jobs afterwards."""
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


# ---------------------------------------------------------------- Hugging Face transformers


def hf_from_pretrained(checkpoint: str, distributed: dict[str, int]) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with ``DistributedConfig(**distributed)`` (its own
    ``tp_plan`` / ``ep_plan`` on a DeviceMesh with dim ``tp``), fp32, SDPA attention. Call it under
    :func:`torchrun_env`."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(
        checkpoint,
        distributed_config=DistributedConfig(**distributed),
        dtype=torch.float32,
        attn_implementation="sdpa",
    )


def hf_llama(
    tp: int, *, n_layers: int, dim: int, n_heads: int, ffn_dim: int, vocab: int, seq: int, seed: int = 0
) -> nn.Module:
    """A ``LlamaForCausalLM`` of these sizes with seeded weights, tensor parallel over ``tp`` ranks by
    transformers' own plan. ``from_config`` takes no distributed config, so rank 0 saves the seeded
    model as a user's checkpoint would be (transformers writes on the main process only) and every
    rank loads it back the distributed way."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=ffn_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        max_position_embeddings=seq,
        use_cache=False,
    )
    _forget_earlier_meshes()
    with contextlib.ExitStack() as stack:
        path = [
            stack.enter_context(tempfile.TemporaryDirectory(prefix="commfuse-hf-llama-"))
            if dist.get_rank() == 0
            else None
        ]
        dist.broadcast_object_list(path, src=0)
        if dist.get_rank() == 0:
            torch.manual_seed(seed)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path[0])
        dist.barrier()
        with torchrun_env():
            model = hf_from_pretrained(path[0], {"tp_size": tp})
        dist.barrier()  # every rank has read the checkpoint before rank 0 removes it
    return model


# ---------------------------------------------------------------- torchtitan 0.3.0


def titan_on_cpu() -> None:
    """torchtitan picks "cuda" as its device type when no accelerator is present; point it at the
    CPU before any of its parallelize functions read it."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"


def _resized_config(
    family: str,
    mod: Any,
    *,
    n_layers: int,
    dim: int,
    n_heads: int,
    vocab: int,
    ffn_dim: int,
    num_experts: int = 0,
) -> Any:
    """A model config of ``family`` at these sizes, written the way torchtitan's own flavors are
    (its registry's layer builders and initialisers; deepseek_v3: every layer a MoE layer, the
    debug model's MLA head dims)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    if family == "llama3":
        layers = mod._build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=ffn_dim,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
        )
        extra: dict[str, Any] = {}
        config_cls = mod.Llama3Model.Config
    else:
        rope_dim = 64
        layers = mod._build_dsv3_layers(
            n_layers=n_layers,
            n_dense_layers=0,
            dim=dim,
            n_heads=n_heads,
            q_lora_rank=0,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=rope_dim,
            v_head_dim=128,
            mscale=0.70,
            dense_hidden_dim=ffn_dim,
            moe_hidden_dim=ffn_dim,
            num_experts=num_experts,
            num_shared_experts=2,
            router_top_k=3,
            router_score_func="softmax",
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(
                dim=rope_dim,
                max_seq_len=4096 * 4,
                theta=10000.0,
                scaling="yarn",
                rope_factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_seq_len=4096,
            ),
        )
        extra = {"mtp_layers": []}
        config_cls = mod.DeepSeekV3Model.Config
    return config_cls(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=mod._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=mod._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=mod._output_linear_init(dim)),
        layers=layers,
        **extra,
    )


def titan_model(
    family: str, n_layers: int, parallelism: Any, *, seed: int = 0, **sizes: int
) -> tuple[Any, Any]:
    """torchtitan's own debug model of ``family`` ("llama3" or "deepseek_v3") truncated to
    ``n_layers`` (deepseek_v3: its MoE layers), or with ``sizes`` (``dim``, ``n_heads``, ``vocab``,
    ``ffn_dim``, deepseek_v3 ``num_experts``) a model of those sizes; SDPA attention (the registry
    offers flex/varlen only; torchtitan's graph_trainer tests swap the same way), built on meta and
    initialised identically on every rank. Returns (model spec, model)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    mod = importlib.import_module(f"torchtitan.models.{family}")
    spec = mod.model_registry("debugmodel")
    if sizes:
        spec.model = _resized_config(family, mod, n_layers=n_layers, **sizes)
    cfg = spec.model
    # deepseek_v3's first layer is dense: start after it, so that one layer is a MoE layer
    first = 1 if family == "deepseek_v3" and not sizes else 0
    cfg.layers = cfg.layers[first : first + n_layers]
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


@dataclass
class TitanParallel:
    """torchtitan's parallelism config, its ParallelDims with the mesh built, and the training config."""

    parallelism: Any
    dims: Any
    training: Any


def _forget_earlier_meshes() -> None:
    """DTensor caches sharding and redistribution decisions keyed by specs whose DeviceMesh equals
    any mesh of the same shape and dim names (equality ignores the process groups): in a process
    that built the same mesh before (a rank pool's earlier job, its groups since destroyed), a hit
    hands back the earlier mesh and a collective on a group that no longer exists."""
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    redistribute.clear_redistribute_planner_cache()


# Set by shared_titan_meshes for its block: (world size, degrees) -> the TitanParallel built for them.
_shared_parallels: dict[tuple[int, tuple[tuple[str, int], ...]], TitanParallel] | None = None


@contextlib.contextmanager
def shared_titan_meshes() -> Iterator[None]:
    """In the block, :func:`titan_parallel` builds one :class:`TitanParallel` (one DeviceMesh) per
    degrees and hands it to every later call: several copies of a model built in one process (the
    A/B mode's one per executor) share their mesh, as one trainer's models would.

    With a mesh each, the copies cannot be compiled side by side. DTensor's sharding-propagation
    and redistribution caches are keyed by specs whose DeviceMesh compares equal to any mesh of the
    same ranks, shape and dim names (the process groups are not compared; see
    :func:`_forget_earlier_meshes`), so once one copy has run, the other copy's ops hit its entries
    and produce DTensors on the first copy's mesh object (the second copy's logits are on the
    first copy's mesh). torch.compile tracks a DeviceMesh by identity (an opaque graph input of
    AOTAutograd): a forward output on a mesh that is no input of the graph gets its mesh from the
    tangent AOTAutograd builds for it, and the partitioner rejects the joint graph ("Node
    tangents_2 was invalid, but is output")."""
    global _shared_parallels
    if _shared_parallels is not None:
        raise RuntimeError("shared_titan_meshes blocks do not nest")
    _shared_parallels = {}
    try:
        yield
    finally:
        _shared_parallels = None


def titan_parallel(degrees: dict[str, int]) -> TitanParallel:
    """torchtitan's parallel dims for ``degrees`` (``tp``, ``ep``, ``dp_shard``) over the whole world,
    mesh built; ``spmd_backend="partial_dtensor"`` so that the collectives land in compiled graphs.
    Inside :func:`shared_titan_meshes` the one built for the same degrees earlier in the block."""
    key = (dist.get_world_size(), tuple(sorted(degrees.items())))
    if _shared_parallels is not None and key in _shared_parallels:
        return _shared_parallels[key]
    par = _build_titan_parallel(degrees)
    if _shared_parallels is not None:
        _shared_parallels[key] = par
    return par


def _build_titan_parallel(degrees: dict[str, int]) -> TitanParallel:
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    # registers c10d's "fake" backend, which ParallelDims gives its unused mesh dims; torchtitan's
    # model code imports it, but only after the mesh is built here
    importlib.import_module("torch.testing._internal.distributed.fake_pg")
    titan_on_cpu()
    _forget_earlier_meshes()
    set_spmd_backend("partial_dtensor")  # what torchtitan's Trainer does with parallelism.spmd_backend
    parallelism = ParallelismConfig(
        tensor_parallel_degree=degrees.get("tp", 1),
        expert_parallel_degree=degrees.get("ep", 1),
        data_parallel_shard_degree=degrees.get("dp_shard", 1),
        spmd_backend="partial_dtensor",
    )
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    return TitanParallel(parallelism, dims, training)


def titan_parallelize(
    family: str,
    par: TitanParallel,
    *,
    n_layers: int,
    compiled: bool = False,
    backend: str = "commfuse",
    ac: str | None = None,
    parallelize_fn: bool = True,
    **sizes: int,
) -> nn.Module:
    """:func:`titan_model` parallelised by torchtitan's own code: its ``parallelize_*`` function
    (TP/SP/EP, per-block compile with ``backend`` when ``compiled``), or, with sharded data
    parallel, TP then graph_trainer's SimpleFSDP: torchtitan's FSDP2 reduces with PREMUL_SUM,
    which gloo lacks. ``ac``: None, "selective" or "full" activation checkpointing.

    ``parallelize_fn=False``: the model's own ``parallelize`` (TP/SP/EP) instead of the
    ``parallelize_*`` function, which also wraps every block in FSDP2 even at shard degree 1 (no
    communication, fp32 here) and whose hooks graph-break a whole-model ``torch.compile``."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac_config = {None: None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[ac]
    spec, model = titan_model(family, n_layers, par.parallelism, **sizes)
    compile_config = CompileConfig(enable=compiled, components=["model"], backend=backend)
    dims = par.dims
    if parallelize_fn and not dims.dp_shard_enabled:
        return spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=par.training,
            parallelism=par.parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder="",
        )
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

    # graph_trainer's order: TP, then SimpleFSDP
    if dims.tp_enabled or dims.ep_enabled:
        model.parallelize(dims)
    if ac_config is not None:
        ac_config.build(dump_folder="").apply(model)
    if dims.dp_shard_enabled:
        # graph_trainer caches its wrapper class per module class, and the class's parameter
        # properties call the parametrization of the first module it wrapped: in a process that
        # builds the model again (a rank pool's next job) that one gathers over destroyed groups
        importlib.import_module("torchtitan.experiments.graph_trainer.simple_fsdp")._wrap_class_cache.clear()
        model = apply_simple_fsdp(model, parallel_dims=dims, training=par.training)
    if compiled:
        apply_compile(model, compile_config=compile_config, parallel_dims=dims)
    return model


def titan_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross-entropy (vocab-parallel when the logits are vocab-sharded), mean over the
    tokens, as a plain tensor."""
    from torchtitan.components.loss import cross_entropy_loss

    loss = cross_entropy_loss(logits, labels) / labels.numel()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
