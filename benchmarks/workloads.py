"""Benchmark workloads: the example models of ``commfuse.models`` at named sizes.

A workload is ``family:size`` (e.g. ``llama_tp_sp:s``). A family is one
parallelisation of one example model; its builder runs inside every rank (a
live process group of the run's world size) and returns the parallelised
model, this rank's inputs and the loss that turns the model output into this
rank's scalar loss. Sizes are keyword arguments of the builder.

Adding a workload::

    def _build_mine(world: int, rank: int, *, dim: int, batch: int) -> Built: ...
    register_family(Family("mine", "what it is", _build_mine,
                           sizes={"s": {"dim": 32, "batch": 4}}))

Builders must be deterministic (seeded weights and inputs) so that every
baseline trains the same numbers, and must only use sizes divisible by the
world size where the parallelisation requires it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "Built",
    "Family",
    "Workload",
    "get_workload",
    "register_family",
    "workload_names",
]


@dataclass
class Built:
    """What a builder returns on one rank.

    ``model(*inputs)`` is the compiled region (users compile the model, not
    the loss); ``loss(output)`` is this rank's scalar loss.
    """

    model: nn.Module
    inputs: tuple[Any, ...]
    loss: Callable[[Any], torch.Tensor]
    # process-group name -> parallel role, as a user declares it (commfuse.Config.group_roles)
    roles: dict[str, str] = field(default_factory=dict)
    # micro-batches per training step: the ga:* baselines split every input along dim 0 into this
    # many and accumulate their gradients (benchmarks/baselines.py); the others run one step on all
    microbatches: int = 1


Builder = Callable[..., Built]


@dataclass(frozen=True)
class Family:
    """One parallelised example model; ``sizes`` maps a size label to builder kwargs."""

    name: str
    description: str
    builder: Builder
    sizes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # ranks the family needs (e.g. 4 for a 2x2 mesh); None: the suite's world size
    world: int | None = None


@dataclass(frozen=True)
class Workload:
    """One family at one size; ``name`` is ``family:size``."""

    family: Family
    size: str

    @property
    def name(self) -> str:
        return f"{self.family.name}:{self.size}"

    @property
    def params(self) -> dict[str, int]:
        return dict(self.family.sizes[self.size])

    def build(self, world: int, rank: int) -> Built:
        return self.family.builder(world, rank, **self.params)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"workload family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def get_workload(name: str) -> Workload:
    """``family:size`` -> :class:`Workload` (raises ``KeyError`` naming the known ones)."""
    family_name, _, size = name.partition(":")
    family = _FAMILIES.get(family_name)
    if family is None or size not in family.sizes:
        raise KeyError(f"unknown workload {name!r}; known: {workload_names()}")
    return Workload(family, size)


def workload_names() -> list[str]:
    return [f"{f.name}:{s}" for f in _FAMILIES.values() for s in f.sizes]


# ----------------------------------------------------------------- builders
# The DeviceMesh is built inside the builder: the rank pool destroys a job's
# sub-groups before the next job, so nothing may outlive one job.


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _llama_tp(
    world: int,
    rank: int,
    *,
    sequence_parallel: bool,
    n_layers: int,
    dim: int,
    n_heads: int,
    ffn_dim: int,
    batch: int,
    seq: int,
) -> Built:
    from commfuse.models import llama

    cfg = llama.LlamaConfig(n_layers=n_layers, dim=dim, n_heads=n_heads, ffn_dim=ffn_dim)
    mesh = _mesh(world)
    model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=sequence_parallel)
    data = llama.make_inputs(
        cfg, batch, seq, rank=rank, world_size=world, sequence_parallel=sequence_parallel, seed=1
    )
    return Built(
        model, (data.inputs,), lambda out: llama.loss_fn(out, data), roles={mesh.get_group().group_name: "tp"}
    )


def _build_llama_tp_sp(world: int, rank: int, **sizes: int) -> Built:
    return _llama_tp(world, rank, sequence_parallel=True, **sizes)


def _build_llama_tp(world: int, rank: int, **sizes: int) -> Built:
    return _llama_tp(world, rank, sequence_parallel=False, **sizes)


def _build_moe_ep(
    world: int, rank: int, *, dim: int, experts_per_rank: int, ffn_dim: int, batch_per_rank: int, seq: int
) -> Built:
    from commfuse.models import moe

    num_experts = experts_per_rank * world
    model = moe.parallelize_moe(
        moe.build_moe(dim=dim, num_experts=num_experts, ffn_dim=ffn_dim, seed=0), _mesh(world)
    )
    data = moe.make_inputs(batch_per_rank * world, seq, dim, rank=rank, world_size=world, seed=1)
    return Built(model, (data.inputs,), lambda out: moe.loss_fn(out[0], out[1], data))


def _simple_fsdp(
    world: int,
    rank: int,
    *,
    mode: str,
    n_layers: int,
    dim: int,
    n_heads: int,
    ffn_dim: int,
    batch_per_rank: int,
    seq: int,
) -> Built:
    from commfuse.models import llama, simple_fsdp

    cfg = llama.LlamaConfig(n_layers=n_layers, dim=dim, n_heads=n_heads, ffn_dim=ffn_dim)
    model = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), _mesh(world), mode)  # type: ignore[arg-type]
    data = simple_fsdp.make_inputs(cfg, batch_per_rank * world, seq, rank=rank, world_size=world, seed=1)
    return Built(model, (data.inputs,), lambda out: simple_fsdp.loss_fn(out, data))


def _build_fsdp(world: int, rank: int, **sizes: int) -> Built:
    return _simple_fsdp(world, rank, mode="fully_shard", **sizes)


def _build_dp(world: int, rank: int, **sizes: int) -> Built:
    return _simple_fsdp(world, rank, mode="replicate", **sizes)


# Sizes: "s" is what the quick suite runs; "m"/"l" add depth and width for the
# full suite. All head/ffn/sequence/expert counts are divisible by 2 and 8
# (the benchmark world sizes). Kept CPU sized: one step is tens of ms on one
# core per rank.
_LLAMA_SIZES: dict[str, dict[str, int]] = {
    "s": {"n_layers": 2, "dim": 64, "n_heads": 8, "ffn_dim": 128, "batch": 2, "seq": 32},
    "m": {"n_layers": 4, "dim": 128, "n_heads": 8, "ffn_dim": 256, "batch": 2, "seq": 64},
    "l": {"n_layers": 4, "dim": 256, "n_heads": 8, "ffn_dim": 512, "batch": 2, "seq": 128},
}
_DP_SIZES: dict[str, dict[str, int]] = {
    "s": {"n_layers": 2, "dim": 64, "n_heads": 8, "ffn_dim": 128, "batch_per_rank": 2, "seq": 32},
    "m": {"n_layers": 4, "dim": 128, "n_heads": 8, "ffn_dim": 256, "batch_per_rank": 2, "seq": 64},
    "l": {"n_layers": 4, "dim": 256, "n_heads": 8, "ffn_dim": 512, "batch_per_rank": 2, "seq": 128},
}
_MOE_SIZES: dict[str, dict[str, int]] = {
    "s": {"dim": 64, "experts_per_rank": 2, "ffn_dim": 128, "batch_per_rank": 2, "seq": 32},
    "m": {"dim": 128, "experts_per_rank": 4, "ffn_dim": 256, "batch_per_rank": 2, "seq": 64},
    "l": {"dim": 256, "experts_per_rank": 4, "ffn_dim": 512, "batch_per_rank": 2, "seq": 128},
}

register_family(
    Family(
        "llama_tp_sp",
        "Llama-style decoder, tensor + sequence parallel (Megatron SP)",
        _build_llama_tp_sp,
        _LLAMA_SIZES,
    )
)
register_family(
    Family("llama_tp", "Llama-style decoder, tensor parallel only", _build_llama_tp, _LLAMA_SIZES)
)
register_family(
    Family(
        "moe_ep",
        "GShard MoE block, expert parallel (all_to_all), router/norm data parallel",
        _build_moe_ep,
        _MOE_SIZES,
    )
)
register_family(
    Family(
        "simple_fsdp",
        "Llama-style decoder, SimpleFSDP fully_shard (param all_gather, grad reduce_scatter)",
        _build_fsdp,
        _DP_SIZES,
    )
)
register_family(
    Family("dp", "Llama-style decoder, SimpleFSDP replicate = DDP (grad all_reduce)", _build_dp, _DP_SIZES)
)


def _moe_tp(
    world: int,
    rank: int,
    *,
    layout: str,
    n_layers: int,
    dim: int,
    n_heads: int,
    experts_per_rank: int,
    ffn_dim: int,
    batch: int,
    seq: int,
    vocab: int = 0,
) -> Built:
    """TP attention + commfuse.moe.MoELayer (dropless) with EP over the same ranks."""
    from commfuse.models import moe_tp

    cfg = moe_tp.MoETPConfig(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        num_experts=experts_per_rank * world,
        ffn_dim=ffn_dim,
        vocab=vocab or None,
    )
    mesh = _mesh(world)
    model = moe_tp.parallelize_moe_tp(moe_tp.build_moe_tp(cfg, seed=0), mesh, layout)
    gen = torch.Generator().manual_seed(1 + (rank if layout == "sp_ep_sp" else 0))
    if vocab:
        inputs = torch.randint(0, vocab, (batch, seq), generator=gen)  # replicated token ids
    else:
        inputs = torch.randn(batch, seq // world, dim, generator=gen)  # this rank's sequence shard

    def loss(out):
        return out[0].float().pow(2).mean() + 0.01 * out[1]

    return Built(model, (inputs,), loss, roles={mesh.get_group().group_name: "tp"})


def _build_moe_tp_ep(world: int, rank: int, **sizes: int) -> Built:
    return _moe_tp(world, rank, layout="tp_ep", **sizes)


def _build_moe_sp_ep_sp(world: int, rank: int, **sizes: int) -> Built:
    return _moe_tp(world, rank, layout="sp_ep_sp", **sizes)


_MOE_TP_SIZES: dict[str, dict[str, int]] = {
    "s": {
        "n_layers": 2,
        "dim": 64,
        "n_heads": 8,
        "experts_per_rank": 2,
        "ffn_dim": 64,
        "batch": 2,
        "seq": 32,
    },
    "m": {
        "n_layers": 4,
        "dim": 128,
        "n_heads": 8,
        "experts_per_rank": 2,
        "ffn_dim": 128,
        "batch": 2,
        "seq": 64,
    },
}
register_family(
    Family(
        "moe_tp_ep",
        "TP attention + commfuse MoE layer, EP over the TP ranks, vocab head (Chimera TP+EP)",
        _build_moe_tp_ep,
        {k: {**v, "vocab": 128} for k, v in _MOE_TP_SIZES.items()},
    )
)
register_family(
    Family(
        "moe_sp_ep_sp",
        "SP attention + commfuse MoE layer on gathered tokens, back to sequence shards (Chimera SP+EP+SP)",
        _build_moe_sp_ep_sp,
        _MOE_TP_SIZES,
    )
)


def _build_moe_style_sp_ep_sp(
    world: int,
    rank: int,
    *,
    dim: int,
    n_heads: int,
    experts_per_rank: int,
    ffn_dim: int,
    batch: int,
    seq: int,
) -> Built:
    """SP attention + a GShard MoE written in plain PyTorch (one-hot/cumsum dispatch, all_to_all):
    ``moe_recognition`` must first prove it one region before motion can drop the gather."""
    from commfuse.models import moe_styles as ms

    # capacity_factor = world: capacity cannot bind, so token shards route exactly as the full batch
    cfg = ms.MoEStyleConfig(
        style="gshard",
        dim=dim,
        num_experts=experts_per_rank * world,
        ffn_dim=ffn_dim,
        top_k=2,
        capacity_factor=float(world),
        n_heads=n_heads,
    )
    mesh = _mesh(world)
    model = ms.parallelize_moe_style_tp(ms.build_moe_style_tp(cfg), mesh, "sp_ep_sp")
    gen = torch.Generator().manual_seed(1 + rank)
    inputs = torch.randn(batch, seq // world, dim, generator=gen)  # this rank's sequence shard

    def loss(out):
        return out[0].float().pow(2).mean() + 0.01 * out[1]

    return Built(model, (inputs,), loss, roles={mesh.get_group().group_name: "tp"})


register_family(
    Family(
        "moe_style_sp_ep_sp",
        "SP attention + hand-written GShard MoE (recognised into commfuse's MoE op), back to sequence shards",
        _build_moe_style_sp_ep_sp,
        {k: {kk: vv for kk, vv in v.items() if kk != "n_layers"} for k, v in _MOE_TP_SIZES.items()},
    )
)

# The declared third-party workloads register themselves (docs/benchmarks.md, "Declared workloads").
import benchmarks.declared  # noqa: E402,F401


# ----------------------------------------------------------------- gradient accumulation
class _RegressionLoss(nn.Module):
    """A model and its MSE loss as one module: ``forward(x, target)`` is the scalar loss of that
    slice of the rank's batch, normalised by the WHOLE local batch's element count, so the losses
    of the micro-batches of a step add up to the step's loss (no 1/M scaling anywhere: the GA
    baselines sum them, ``compile_train_step(reduction="sum")``). Inputs and targets travel together,
    so every baseline splits them into micro-batches the same way (dim 0)."""

    def __init__(self, model: nn.Module, denominator: int) -> None:
        super().__init__()
        self.model = model
        self.denominator = denominator

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self.model(x).float() - target).pow(2).sum() / self.denominator


def _build_simple_fsdp_ga(
    world: int,
    rank: int,
    *,
    n_layers: int,
    dim: int,
    n_heads: int,
    ffn_dim: int,
    microbatch_size: int,
    seq: int,
    microbatches: int,
) -> Built:
    """SimpleFSDP (fully_shard) Llama trained with gradient accumulation: each rank's step is
    ``microbatches`` micro-batches of ``microbatch_size`` x ``seq`` tokens."""
    from commfuse.models import llama, simple_fsdp

    cfg = llama.LlamaConfig(n_layers=n_layers, dim=dim, n_heads=n_heads, ffn_dim=ffn_dim)
    model = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), _mesh(world), "fully_shard")
    local = microbatch_size * microbatches
    data = simple_fsdp.make_inputs(cfg, local * world, seq, rank=rank, world_size=world, seed=1)
    return Built(
        _RegressionLoss(model, data.loss_denominator),
        (data.inputs, data.target),
        lambda loss: loss,
        microbatches=microbatches,
    )


# "s": test sized. "d": the declared size (docs/benchmarks.md, "Declared workloads"): dim 512, 2 layers,
# fp32, the declared 2 x 1024 tokens per rank per step as M = 4 micro-batches of 1 x 512. "d8k": the
# size first measured, 4 micro-batches of 2 x 1024 (8192 tokens per rank per step, four times the
# declared step; kept so that stored results stay reproducible).
_GA_SIZES: dict[str, dict[str, int]] = {
    "s": {
        "n_layers": 1,
        "dim": 32,
        "n_heads": 4,
        "ffn_dim": 64,
        "microbatch_size": 2,
        "seq": 8,
        "microbatches": 4,
    },
    "d": {
        "n_layers": 2,
        "dim": 512,
        "n_heads": 8,
        "ffn_dim": 1536,
        "microbatch_size": 1,
        "seq": 512,
        "microbatches": 4,
    },
    "d8k": {
        "n_layers": 2,
        "dim": 512,
        "n_heads": 8,
        "ffn_dim": 1536,
        "microbatch_size": 2,
        "seq": 1024,
        "microbatches": 4,
    },
}

register_family(
    Family(
        "simple_fsdp_ga",
        "Llama-style decoder, SimpleFSDP fully_shard, gradient accumulation over M micro-batches "
        "(the model returns the loss; run it with the ga:* baselines)",
        _build_simple_fsdp_ga,
        _GA_SIZES,
    )
)
