"""Differentiable stage collectives on a :class:`StageGroup`, traceable by non-members.

Stage modules of a pipeline call these instead of ``torch.distributed`` or DTensor: every
rank traces every stage (commfuse.pipeline.trace), including stages it is not a member
of, so a collective must name its group by the layout's alias and size and never
resolve it while tracing. Each helper takes ``group: StageGroup | None``; ``None`` means
"no parallelism" (a single-process model: every helper is then the identity), which is
how the unsharded reference of a model runs the same module code.

Helper -> forward, backward (the adjoint autograd uses), ops in the graph:

=====================  =============================  ==========================================
helper                 forward                        backward
=====================  =============================  ==========================================
``all_gather(x, d)``   members' x concatenated        reduce_scatter(sum) of the gradient along
                       along d (rank order)           d: the exact adjoint.
                       ``_c10d_functional_autograd.all_gather_into_tensor`` + wait
``reduce_scatter``     sum over members, piece r      all_gather of the gradient along d: the
``(x, d)``             of dim d kept by rank r        exact adjoint.
                       ``_c10d_functional_autograd.reduce_scatter_tensor`` + wait
``all_to_all(x)``      dim 0 in N equal pieces,       the inverse all_to_all: the exact adjoint.
                       piece j to rank j              ``_c10d_functional_autograd.all_to_all_single`` + wait
``copy_to_group(x)``   identity                       all_reduce(sum) of the gradient.
  (Megatron "f")       ``commfuse::copy_to_group``
``reduce_from_group``  all_reduce(sum)                identity.
``(x)`` (Megatron "g") ``commfuse::reduce_from_group``
=====================  =============================  ==========================================

``f`` and ``g`` are Megatron's tensor-parallel conventions, not adjoints of one map: ``f``
marks a value every member holds identically whose downstream computation is split over
the members (column-parallel input, or a replicated weight applied to each member's own
shard of the tokens): the true gradient is the sum of the members' partial gradients.
``g`` marks the end of a split computation whose result is then used *replicated*: every
member computes the same downstream loss, which counts once, so the gradient passes
through unchanged. ``all_reduce`` below is ``g``.

Why custom ops for f and g: ``torch.autograd.Function`` is inlined by pre-dispatch
tracing (its backward is lost) and ``_c10d_functional`` has no differentiable
all_reduce. ``commfuse::copy_to_group`` / ``commfuse::reduce_from_group`` are custom ops
with ``register_autograd``: the forward graph (make_fx ``pre_dispatch=True``) keeps them
as single nodes, and :data:`JOINT_DECOMPOSITIONS` turns them into what they are when the
joint graph is traced (``aten.alias``; ``_c10d_functional.all_reduce`` + ``wait_tensor``),
so the joint graph, and every part the runner executes, holds only functional
collectives the IR knows. The same table lowers ``_c10d_functional_autograd.*`` to
``_c10d_functional.*`` (what AOTAutograd does before partitioning).

Gathers/scatters along a dim other than 0 are written the way DTensor writes them (a
dim-0 collective plus split/cat shuffles), which :mod:`commfuse.ir.layout` recognises as
the logical dim.

Source: Megatron-LM (Shoeybi et al. 2019, §3, the f/g operators).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from commfuse.core.torch_private import c10d_functional, c10d_functional_autograd
from commfuse.pipeline.layout import StageGroup

aten = torch.ops.aten


def _wait(t: Tensor) -> Tensor:
    return c10d_functional.wait_tensor(t)


# ---------------------------------------------------------------- f and g as custom ops
@torch.library.custom_op("commfuse::copy_to_group", mutates_args=())
def copy_to_group_op(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return x.clone()


@copy_to_group_op.register_fake
def _(x, group_size, group_name):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output) -> None:
    ctx.group_name = inputs[2]


def _copy_backward(ctx, grad):
    return _wait(c10d_functional.all_reduce(grad, "sum", ctx.group_name)), None, None


copy_to_group_op.register_autograd(_copy_backward, setup_context=_copy_setup)


@torch.library.custom_op("commfuse::reduce_from_group", mutates_args=())
def reduce_from_group_op(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return _wait(c10d_functional.all_reduce(x.contiguous(), "sum", group_name))


@reduce_from_group_op.register_fake
def _(x, group_size, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _reduce_backward(ctx, grad):
    return grad, None, None


reduce_from_group_op.register_autograd(_reduce_backward)

COPY_TO_GROUP = torch.ops.commfuse.copy_to_group.default
REDUCE_FROM_GROUP = torch.ops.commfuse.reduce_from_group.default


def _decomp_copy(x, group_size, group_name):
    # below autograd: the forward of f is the identity
    return aten.alias(x)


def _decomp_reduce(x, group_size, group_name):
    return _wait(c10d_functional.all_reduce(x.contiguous(), "sum", group_name))


def _lower(functional_op):
    def decomp(*args, **kwargs):
        return functional_op(*args, **kwargs)

    return decomp


# Applied by make_fx while tracing the joint graph, i.e. below autograd (the backward
# formulas are already recorded by then): what each autograd-level op is, functionally.
JOINT_DECOMPOSITIONS = {
    COPY_TO_GROUP: _decomp_copy,
    REDUCE_FROM_GROUP: _decomp_reduce,
    c10d_functional_autograd.all_gather_into_tensor.default: _lower(
        c10d_functional.all_gather_into_tensor.default
    ),
    c10d_functional_autograd.reduce_scatter_tensor.default: _lower(
        c10d_functional.reduce_scatter_tensor.default
    ),
    c10d_functional_autograd.all_to_all_single.default: _lower(c10d_functional.all_to_all_single.default),
}


# ---------------------------------------------------------------- helpers
def _check(group: Optional[StageGroup], what: str) -> None:
    if group is not None and not isinstance(group, StageGroup):
        raise TypeError(
            f"{what}: group must be a commfuse.pipeline.StageGroup or None, got {type(group).__name__}"
        )


def all_gather(x: Tensor, dim: int, group: Optional[StageGroup]) -> Tensor:
    """Members' ``x`` concatenated along ``dim`` in group-rank order (backward: reduce_scatter)."""
    _check(group, "all_gather")
    if group is None or group.size == 1:
        return x
    n = group.size
    dim = dim % x.dim()
    w = _wait(c10d_functional_autograd.all_gather_into_tensor(x.contiguous(), n, group.name))
    if dim == 0:
        return w
    return torch.cat(torch.split(w, x.shape[0], 0), dim=dim)


def reduce_scatter(x: Tensor, dim: int, group: Optional[StageGroup]) -> Tensor:
    """Sum over members; rank r keeps piece r of ``dim`` (backward: all_gather)."""
    _check(group, "reduce_scatter")
    if group is None or group.size == 1:
        return x
    n = group.size
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by the "
            f"group size {n} of {group.name}"
        )
    if dim != 0:
        x = torch.cat(torch.split(x, x.shape[dim] // n, dim), dim=0)
    return _wait(c10d_functional_autograd.reduce_scatter_tensor(x.contiguous(), "sum", n, group.name))


def all_to_all(x: Tensor, group: Optional[StageGroup]) -> Tensor:
    """Dim 0 cut in ``size`` equal pieces, piece j sent to group rank j; received pieces
    concatenated in source order (backward: the inverse all_to_all)."""
    _check(group, "all_to_all")
    if group is None or group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(
            f"all_to_all: dim 0 of size {x.shape[0]} is not divisible by the group size "
            f"{group.size} of {group.name}"
        )
    splits = [x.shape[0] // group.size] * group.size
    return _wait(c10d_functional_autograd.all_to_all_single(x.contiguous(), splits, splits, group.name))


def copy_to_group(x: Tensor, group: Optional[StageGroup]) -> Tensor:
    """Megatron ``f``: identity forward, all_reduce(sum) of the gradient backward."""
    _check(group, "copy_to_group")
    if group is None or group.size == 1:
        return x
    return COPY_TO_GROUP(x, group.size, group.name)


def reduce_from_group(x: Tensor, group: Optional[StageGroup]) -> Tensor:
    """Megatron ``g``: all_reduce(sum) forward, identity backward."""
    _check(group, "reduce_from_group")
    if group is None or group.size == 1:
        return x
    return REDUCE_FROM_GROUP(x, group.size, group.name)


all_reduce = reduce_from_group

__all__ = [
    "COPY_TO_GROUP",
    "JOINT_DECOMPOSITIONS",
    "REDUCE_FROM_GROUP",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "copy_to_group",
    "reduce_from_group",
    "reduce_scatter",
]
