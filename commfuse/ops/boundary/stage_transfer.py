"""``commfuse::stage_transfer``: point-to-point transfer across a pipeline boundary (Table 1 "P2P").

    torch.ops.commfuse.stage_transfer(Tensor x, int[] src, int[] dst, int group_size,
                                      str group_name) -> Tensor          # then wait_tensor

Contract
- ``src`` and ``dst`` are equally long lists of *group* ranks of G (``group_name``,
  resolved at run time, never created), without duplicates inside a list: ``src[i]``
  sends its whole ``x`` to ``dst[i]``. A rank may be a source of one pair and the
  destination of another (it sends and receives); ``src[i] == dst[i]`` is a local copy.
- Shapes are SPMD-symmetric: every rank passes an ``x`` of the same shape and dtype (a
  receiver's ``x`` has its sender's shape; its values are not read unless it also sends).
- Output (contiguous, x's shape and dtype): on ``dst[i]``, the data ``src[i]`` sent; on
  a rank that is no destination, zeros (the pipeline runner never reads it; zeros keep
  values backend-independent and make the backward exact: a source that receives
  nothing gets a zero gradient).
- Asynchronous: issues the transfers, ties them to the output with ``register_work``;
  the graph waits with ``_c10d_functional.wait_tensor``. ``x`` is copied before sending.
  Fake kernel: ``empty_like(x)`` (contiguous).
- Ranks of G in no pair need not call the op (it is point-to-point); calling it is a
  no-op that returns zeros.

Implementation: ``isend``/``irecv`` (:mod:`commfuse.ops.boundary.p2p`), matched per pair in posting
order, so the two sides of a pipeline boundary may interleave forward and backward
transfers differently (1F1B) without a deadlock. Zero-element tensors send nothing.

Autograd: ``commfuse::stage_transfer_autograd`` (issues and waits inside) has
``register_autograd``; its backward is ``stage_transfer_autograd`` of the gradient from
``dst`` back to ``src``. :func:`stage_transfer` (the wrapper) uses it when ``x`` needs a
gradient, else the async op + wait.

Source: Chimera Table 1 (P2P).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from commfuse.core.torch_private import c10d_functional, register_work
from commfuse.ops.boundary.common import (
    as_rank_list,
    check_group_size,
    check_ranks,
    group_name_and_size,
    resolve_group,
    want_autograd,
)
from commfuse.ops.boundary.p2p import BatchedWork, Transfer, issue_batched

_OP = "commfuse::stage_transfer"


def _check_args(src, dst, group_size: int, op: str) -> tuple[list[int], list[int]]:
    check_group_size(group_size, op)
    src, dst = as_rank_list(src, "src", op), as_rank_list(dst, "dst", op)
    if len(src) != len(dst):
        raise ValueError(
            f"{op}: src has {len(src)} ranks and dst {len(dst)}; they must pair up (src[i] -> dst[i])"
        )
    check_ranks(src, "src", group_size, op)
    check_ranks(dst, "dst", group_size, op)
    return src, dst


@dataclass(frozen=True)
class StageTransferArgs:
    """The arguments of one stage_transfer call (either op variant), normalised."""

    x: Any
    src: tuple[int, ...]
    dst: tuple[int, ...]
    group_size: int
    group_name: str

    def sends_to(self, rank: int) -> Optional[int]:
        """The group rank ``rank`` sends x to (None: it sends nothing; itself: a local copy)."""
        return self.dst[self.src.index(rank)] if rank in self.src else None

    def receives_from(self, rank: int) -> Optional[int]:
        """The group rank ``rank`` receives from (None: it receives nothing)."""
        return self.src[self.dst.index(rank)] if rank in self.dst else None

    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.src, self.dst, strict=True))


def parse_stage_transfer(node_or_args: Any, kwargs: Optional[dict] = None) -> StageTransferArgs:
    """Read a stage_transfer call: an fx Node of either op variant, or its ``args`` (+ ``kwargs``)."""
    import torch.fx as fx

    if isinstance(node_or_args, fx.Node):
        if node_or_args.target not in (STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD):
            raise ValueError(
                f"parse_stage_transfer: node {node_or_args.name} calls {node_or_args.target}, "
                "not commfuse::stage_transfer"
            )
        args, kwargs = node_or_args.args, dict(node_or_args.kwargs)
    else:
        args, kwargs = tuple(node_or_args), dict(kwargs or {})
    names = ("x", "src", "dst", "group_size", "group_name")
    x, src, dst, gsize, gname = (args[k] if len(args) > k else kwargs[n] for k, n in enumerate(names))
    src, dst = _check_args(src, dst, gsize, "parse_stage_transfer")
    return StageTransferArgs(x, tuple(src), tuple(dst), int(gsize), str(gname))


def _issue(
    x: Tensor, src: list[int], dst: list[int], group_size: int, group_name: str
) -> tuple[Tensor, BatchedWork]:
    src, dst = _check_args(src, dst, group_size, _OP)
    pg = resolve_group(group_name, group_size, _OP)
    import torch.distributed as dist

    me = dist.get_rank(pg)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    if me in dst:
        peer = src[dst.index(me)]
        if peer == me:
            out.copy_(x)
        elif x.numel():
            recvs.append(Transfer(peer, out))
    else:
        out.zero_()
    if me in src and x.numel():
        peer = dst[src.index(me)]
        if peer != me:
            sends.append(Transfer(peer, x.clone(memory_format=torch.contiguous_format)))
    return out, issue_batched(pg, sends, recvs)


_ST_SCHEMA = "(Tensor x, int[] src, int[] dst, int group_size, str group_name) -> Tensor"


@torch.library.custom_op("commfuse::stage_transfer", mutates_args=(), schema=_ST_SCHEMA)
def stage_transfer_op(x: Tensor, src: list[int], dst: list[int], group_size: int, group_name: str) -> Tensor:
    out, work = _issue(x, src, dst, group_size, group_name)
    register_work(out, work)
    return out


@torch.library.custom_op("commfuse::stage_transfer_autograd", mutates_args=(), schema=_ST_SCHEMA)
def stage_transfer_autograd_op(
    x: Tensor, src: list[int], dst: list[int], group_size: int, group_name: str
) -> Tensor:
    out, work = _issue(x, src, dst, group_size, group_name)
    work.wait()
    return out


def _fake(x, src, dst, group_size, group_name):
    _check_args(src, dst, group_size, _OP)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


stage_transfer_op.register_fake(_fake)
stage_transfer_autograd_op.register_fake(_fake)


def _setup_context(ctx, inputs, output) -> None:
    _, src, dst, group_size, group_name = inputs
    ctx.pairs = (list(src), list(dst), group_size, group_name)


def _backward(ctx, grad: Tensor):
    src, dst, group_size, group_name = ctx.pairs
    return STAGE_TRANSFER_AUTOGRAD(grad, dst, src, group_size, group_name), None, None, None, None


stage_transfer_autograd_op.register_autograd(_backward, setup_context=_setup_context)

STAGE_TRANSFER = torch.ops.commfuse.stage_transfer.default
STAGE_TRANSFER_AUTOGRAD = torch.ops.commfuse.stage_transfer_autograd.default


def stage_transfer(x: Tensor, src: Any, dst: Any, group: Any) -> Tensor:
    """Send ``x`` from each ``src[i]`` to ``dst[i]`` (group ranks of ``group``, a ProcessGroup or
    its name; an int is one rank). Returns the received tensor on destinations, zeros
    elsewhere (waited). Differentiable: the gradient goes back from dst to src."""
    if not isinstance(x, Tensor):
        raise ValueError(f"stage_transfer: x must be a Tensor, got {type(x).__name__}")
    name, size = group_name_and_size(group, "stage_transfer")
    src_l, dst_l = _check_args(src, dst, size, "stage_transfer")
    if want_autograd(x):
        return STAGE_TRANSFER_AUTOGRAD(x, src_l, dst_l, size, name)
    return c10d_functional.wait_tensor.default(STAGE_TRANSFER(x, src_l, dst_l, size, name))


__all__ = [
    "STAGE_TRANSFER",
    "STAGE_TRANSFER_AUTOGRAD",
    "StageTransferArgs",
    "parse_stage_transfer",
    "stage_transfer",
]
