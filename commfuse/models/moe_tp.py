"""A Llama-style MoE decoder with tensor-parallel attention and expert parallelism.

Model
-----
:class:`MoETransformer` stacks blocks::

    h   = x + Attention(RMSNorm(x))          # TP over the mesh (commfuse.models.llama)
    out = h + MoELayer(RMSNorm(h))           # commfuse.moe.MoELayer, EP over the same mesh

and returns ``(out, aux)`` where ``aux`` is the mean over blocks of
``load_balancing_loss + 1e-3 * z_loss`` (router statistics summed over the
block's tokens). The EP group is the TP group (Chimera's [TP, EP] and [SP, EP]
configurations with one mesh); :func:`parallelize_moe_block` takes an ``ep_mesh`` to put the
experts on another dim of a 2-D mesh instead.

Parallelisation (:func:`parallelize_moe_tp`), two layouts of the token stream
around the MoE layer -- the two Chimera transitions this model exists for:

* ``"tp_ep"``: plain TP. ``wo`` is ``RowwiseParallel`` with a replicated output
  (all_reduce); the norm and the MoE layer see every token on every rank, so
  every rank routes and dispatches *all* tokens and each expert processes N
  copies of each (the layer is correct, only redundant). Chimera TP+EP.
* ``"sp_ep_sp"``: sequence parallel. The residual stream holds sequence shards,
  attention gathers/reduce-scatters like Megatron SP; the MoE layer's input is
  all-gathered (end of SP: ``Shard(1) -> Replicate``), routed and dispatched on
  all tokens, and its output goes back to sequence shards (``Replicate ->
  Shard(1)``, a local chunk). Chimera SP+EP+SP.

In both, the expert weights are split over the mesh (``MoELayer.expert_parallel``);
the router and norms are plain replicated parameters (identical on every rank:
the TP contract, declare the mesh's role as ``tp``).

With ``vocab`` (``"tp_ep"`` only) the model takes token ids, has a vocab-parallel
embedding (its all_reduce starts the residual stream) and a column-parallel
head whose logits are gathered (as :mod:`commfuse.models.llama`).

Loss: the caller's loss on ``out`` plus ``aux_weight * aux``; with ``"tp_ep"``
every rank holds the full output and the full loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from commfuse.models.common import init_weights_
from commfuse.models.llama import Attention, RMSNorm
from commfuse.moe import MoELayer

Layout = Literal["tp_ep", "sp_ep_sp"]


@dataclass(frozen=True)
class MoETPConfig:
    n_layers: int = 1
    dim: int = 32
    n_heads: int = 4
    num_experts: int = 8
    ffn_dim: int = 32
    top_k: int = 2
    capacity_factor: float = 0.0  # <= 0: dropless
    token_groups: int = 1
    z_loss_weight: float = 1e-3
    vocab: int | None = None  # token embedding + final norm + output head (vocab-parallel)


class MoETransformerBlock(nn.Module):
    def __init__(self, cfg: MoETPConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg.dim, cfg.n_heads)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.moe = MoELayer(
            cfg.dim, cfg.num_experts, cfg.ffn_dim, cfg.top_k, cfg.capacity_factor, cfg.token_groups
        )
        self.z_loss_weight = cfg.z_loss_weight
        self.mesh: DeviceMesh | None = None  # set for "sp_ep_sp"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        if self.mesh is not None:  # end of SP: every rank gets every token
            y = y.redistribute(self.mesh, [Replicate()]).to_local()
        out, stats = self.moe(y)
        if self.mesh is not None:  # back to this rank's sequence shard
            out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
            out = out.redistribute(self.mesh, [Shard(1)]).to_local()
        aux = stats.load_balancing_loss() + self.z_loss_weight * stats.z_loss()
        return h + out, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoETPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim) if cfg.vocab else None
        self.layers = nn.ModuleList(MoETransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim) if cfg.vocab else None
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False) if cfg.vocab else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        aux = torch.zeros((), dtype=torch.float32, device=h.device)
        for layer in self.layers:
            h, a = layer(h)
            aux = aux + a
        if self.output is not None:
            h = self.output(self.norm(h))
        return h, aux / len(self.layers)


def build_moe_tp(cfg: MoETPConfig | None = None, seed: int = 0) -> MoETransformer:
    """Deterministic weights (the same on every rank)."""
    return init_weights_(MoETransformer(cfg or MoETPConfig()), seed, std=0.1)


def parallelize_moe_block(
    block: nn.Module, mesh: DeviceMesh, layout: Layout, ep_mesh: DeviceMesh | None = None
) -> nn.Module:
    """TP attention (+ SP norms for ``sp_ep_sp``) and EP experts of one decoder block, in place.

    The block has ``attention_norm``, ``attention`` (wq/wk/wv/wo), ``ffn_norm``, ``moe`` (with
    ``expert_parallel(group)``) and a ``mesh`` attribute its forward uses to leave SP.

    ``ep_mesh``: the experts split over this 1-D mesh's group instead of ``mesh``'s -- the other
    dim of a 2-D mesh (``mesh2d["tp"]`` for TP, ``mesh2d["ep"]`` for EP), so TP and EP are
    separate mesh dims. The TP contract then holds per TP group: the ranks of one TP group get
    the same input (``tp_ep``) or shards of one sequence (``sp_ep_sp``); the EP peers (one TP
    position in each TP group) route their own tokens, as data-parallel ranks do."""
    if layout not in ("tp_ep", "sp_ep_sp"):
        raise ValueError(f"layout must be 'tp_ep' or 'sp_ep_sp', got {layout!r}")
    sp = layout == "sp_ep_sp"
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
    }
    if sp:
        plan.update(
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "ffn_norm": SequenceParallel(),
            }
        )
        block.mesh = mesh
    parallelize_module(block, mesh, plan, src_data_rank=None)
    block.moe.expert_parallel((mesh if ep_mesh is None else ep_mesh).get_group())
    return block


def parallelize_moe_tp(
    model: MoETransformer, mesh: DeviceMesh, layout: Layout, ep_mesh: DeviceMesh | None = None
) -> MoETransformer:
    """TP attention + EP experts over the 1-D ``mesh`` in place (see the module docstring);
    ``ep_mesh``: the experts over that mesh instead (:func:`parallelize_moe_block`)."""
    sp = layout == "sp_ep_sp"
    for block in model.layers:
        parallelize_moe_block(block, mesh, layout, ep_mesh=ep_mesh)
    if model.config.vocab:
        if sp:
            raise ValueError("the vocab head is only built for layout 'tp_ep'")
        parallelize_module(
            model,
            mesh,
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
            },
            src_data_rank=None,
        )
    return model
