"""A small Llama-style decoder, tensor- and sequence-parallelised the torchtitan way.

Model
-----
:class:`LlamaModel` stacks :class:`TransformerBlock` s::

    h   = x + Attention(RMSNorm(x))        # causal MHA, optional RoPE, SDPA
    out = h + FeedForward(RMSNorm(h))      # SwiGLU: w2(silu(w1 h) * w3 h)

With ``vocab=None`` (the default, what the benchmarks stack 4..32 layers of)
the model maps activations ``[batch, seq, dim]`` to ``[batch, seq, dim]`` and is
trained with an MSE loss against a random target. With ``vocab=V`` it has a
token embedding, a final norm and an output head, takes token ids ``[batch,
seq]`` and is trained with cross-entropy.

Parallelisation (:func:`parallelize_llama`)
------------------------------------------
``torch.distributed.tensor.parallel.parallelize_module`` over a 1-D TP mesh:

* attention ``wq/wk/wv``: ``ColwiseParallel`` (heads are split across ranks;
  the forward views with ``-1`` heads so it works on the local head count),
  ``wo``: ``RowwiseParallel``;
* feed-forward ``w1/w3``: ``ColwiseParallel``, ``w2``: ``RowwiseParallel``;
* with ``sequence_parallel=True`` (Megatron SP) the norms run on sequence
  shards (``SequenceParallel``), attention / feed-forward inputs are
  all-gathered along the sequence (``PrepareModuleInput`` Shard(1) ->
  Replicate) and the row-parallel outputs are reduce-scattered back to
  sequence shards (``output_layouts=Shard(1)``);
* optional embedding: ``RowwiseParallel`` (vocab-sharded), output head:
  ``ColwiseParallel`` with the logits gathered to ``Replicate``.

Collectives (forward / backward graph under ``torch.compile``):

* SP: ``all_gather_into_tensor`` (before attention and FFN) and
  ``reduce_scatter_tensor`` (after ``wo`` and ``w2``) in the forward, and the
  mirror images in the backward. The norm-weight gradients come out as
  ``Partial`` DTensors: their all_reduce happens where they are consumed
  (optimizer step, ``full_tensor()``), outside the compiled graph;
* TP only: ``all_reduce`` after ``wo``/``w2`` in the forward; in the backward
  one ``all_reduce`` per column-parallel layer for its input gradient (5 per
  block: wq, wk and wv each reduce theirs although they share the input).

Inputs per rank (:func:`make_inputs`)
------------------------------------
* ``vocab=None`` with SP: the rank's sequence shard ``[batch, seq/N, dim]``
  (plain local tensor, rank r holds positions ``[r*seq/N, (r+1)*seq/N)``);
  the output and target are sequence shards as well;
* ``vocab=None`` without SP: the full ``[batch, seq, dim]`` on every rank;
* ``vocab=V``: the full token ids ``[batch, seq]`` on every rank (as in
  torchtitan) and the full, replicated logits ``[batch, seq, V]`` out.

Loss convention (:func:`loss_fn`): each rank's loss is its share of the
global loss (``sum`` of its elements / global element count), so with SP the
global loss is the SUM of the per-rank losses (``Batch.loss_reduce``) and
without SP every rank holds the full loss. Gradients then equal the unsharded
model's gradients of the global mean loss exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from commfuse.models.common import Batch, init_weights_

__all__ = [
    "Attention",
    "FeedForward",
    "LlamaConfig",
    "LlamaModel",
    "RMSNorm",
    "TransformerBlock",
    "build_llama",
    "loss_fn",
    "make_inputs",
    "parallelize_llama",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a :class:`LlamaModel`; the defaults are CPU-test sized."""

    n_layers: int = 2
    dim: int = 64
    n_heads: int = 8
    ffn_dim: int = 128
    vocab: int | None = None
    rope: bool = True


# ------------------------------------------------------------------ modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written with elementwise ops (not F.rms_norm) so that it runs on
        # sequence-sharded DTensors under SequenceParallel: every op is local
        # along the feature dim.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half form) for ``[batch, seq, heads, head_dim]``.

    Positions are ``0..seq-1`` of the tensor it is given, so it must see the
    full sequence (attention always does: SP gathers the sequence before it).
    Real arithmetic only, no complex tensors, to keep tracing simple.
    """
    seq, head_dim = q.shape[1], q.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=q.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=q.device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[None, :, None, :]  # [1, seq, 1, hd]
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, rope: bool = True) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim {dim} not divisible by n_heads {n_heads}")
        self.head_dim = dim // n_heads
        self.rope = rope
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them (the local
        # shape of the column-parallel output), like torchtitan.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.rope:
            q, k = apply_rope(q, k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn_dim: int, rope: bool = True) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, rope)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(nn.Module):
    """``n_layers`` Llama blocks; with ``vocab`` also embedding, norm and head."""

    def __init__(
        self,
        n_layers: int,
        dim: int,
        n_heads: int,
        ffn_dim: int,
        vocab: int | None = None,
        rope: bool = True,
    ) -> None:
        super().__init__()
        self.config = LlamaConfig(n_layers, dim, n_heads, ffn_dim, vocab, rope)
        self.tok_embeddings = nn.Embedding(vocab, dim) if vocab else None
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, ffn_dim, rope) for _ in range(n_layers))
        self.norm = RMSNorm(dim) if vocab else None
        self.output = nn.Linear(dim, vocab, bias=False) if vocab else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def build_llama(config: LlamaConfig | None = None, seed: int = 0) -> LlamaModel:
    """A :class:`LlamaModel` with deterministic weights (same on every rank);
    ``config`` defaults to ``LlamaConfig()``."""
    config = config or LlamaConfig()
    model = LlamaModel(config.n_layers, config.dim, config.n_heads, config.ffn_dim, config.vocab, config.rope)
    return init_weights_(model, seed)


# ---------------------------------------------------------- parallelisation


def _block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if not sequence_parallel:
        return {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    # The residual stream stays a plain local tensor holding this rank's
    # sequence shard; SequenceParallel wraps it as a Shard(1) DTensor for the
    # norm, and PrepareModuleInput all-gathers the sequence for the
    # attention / FFN inputs. The gathered input must stay a DTensor
    # (use_local_output=False): then the gradient reaching the all_gather is
    # a Partial DTensor and its backward is one reduce_scatter. Handing the
    # column-parallel layers a plain tensor instead makes them re-wrap it as
    # Replicate, whose backward is an all_reduce followed by a local slice.
    gather_seq = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attention_norm": SequenceParallel(),
        "attention": gather_seq,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather_seq,
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize_llama(model: LlamaModel, mesh: DeviceMesh, *, sequence_parallel: bool = True) -> LlamaModel:
    """Apply TP (+SP) in place over the 1-D ``mesh``; returns ``model``.

    Weights become DTensors (``Shard(0)`` for column-parallel, ``Shard(1)`` for
    row-parallel, ``Replicate`` for norms under SP; the norms stay plain
    tensors without SP). ``n_heads``, ``ffn_dim`` and ``vocab`` must be
    divisible by the mesh size, and with SP so must the sequence length.
    Every rank must hold the same full weights on entry (see
    :func:`build_llama`): no weight is communicated (``src_data_rank=None``).
    """
    cfg = model.config
    tp = mesh.size()
    for what, n in (("n_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim), ("vocab", cfg.vocab or tp)):
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by the TP degree {tp}")
    for block in model.layers:
        parallelize_module(block, mesh, _block_plan(sequence_parallel), src_data_rank=None)
    if cfg.vocab:
        seq_layout = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {
            # Vocab-sharded lookup -> partial sums -> reduce_scatter (SP) or all_reduce.
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_layout),
            # Full, replicated logits so the loss is the ordinary cross-entropy.
            "output": ColwiseParallel(input_layouts=seq_layout, output_layouts=Replicate()),
        }
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        parallelize_module(model, mesh, plan, src_data_rank=None)
    return model


# ------------------------------------------------------------ data and loss


def make_inputs(
    config: LlamaConfig,
    batch: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    sequence_parallel: bool = True,
    seed: int = 1234,
) -> Batch:
    """Rank ``rank``'s share of a deterministic global batch.

    ``world_size=1`` (or ``sequence_parallel=False``) gives the full batch, which
    is what the unsharded reference consumes. See the module docstring for the
    per-rank layouts.
    """
    gen = torch.Generator().manual_seed(seed)
    if config.vocab:
        tokens = torch.randint(0, config.vocab, (batch, seq_len + 1), generator=gen)
        # Token ids (and the replicated logits) are never sequence-sharded.
        return Batch(tokens[:, :-1], tokens[:, 1:], batch * seq_len, loss_reduce="none")
    x = torch.randn(batch, seq_len, config.dim, generator=gen)
    target = torch.randn(batch, seq_len, config.dim, generator=gen)
    denom = x.numel()
    if not sequence_parallel or world_size == 1:
        return Batch(x, target, denom, loss_reduce="none")
    if seq_len % world_size:
        raise ValueError(f"seq_len {seq_len} not divisible by world size {world_size}")
    shard = seq_len // world_size
    sl = slice(rank * shard, (rank + 1) * shard)
    return Batch(x[:, sl].contiguous(), target[:, sl].contiguous(), denom, loss_reduce="sum")


def loss_fn(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """This rank's share of the global mean loss (cross-entropy for token
    models, MSE otherwise); see the module docstring for the convention."""
    if batch.target.dtype == torch.long:
        loss = F.cross_entropy(out.flatten(0, 1).float(), batch.target.flatten(), reduction="sum")
    else:
        loss = (out.float() - batch.target).pow(2).sum()
    return loss / batch.loss_denominator
