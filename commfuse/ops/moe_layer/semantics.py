"""Reference semantics of ``commfuse::moe_layer`` and ``commfuse::moe_layer_backward``.

The two ops (:mod:`commfuse.ops.moe_layer.op`) are whole expert-parallel MoE layers: their
kernels issue ``all_to_all``\\ s on the process group named by their ``group_name``
argument, synchronously, so every rank of that group must call them together. The
interpreter treats them as *group-synchronous ops* (see
:func:`~commfuse.reference.semantics.register_sync_op`): a rank that reaches one
blocks until every member of the group has reached it; then the functions here
compute every member's results from all members' arguments, with no
``torch.distributed`` (the single-process op with all experts local,
``group_name=""``). ``group_name == ""`` (no expert parallelism) is computed on the
calling rank alone.

Meaning, for the members ``0..N-1`` of the group in group-rank order, member ``i``
with tokens ``X_i`` (``T_i`` rows), the (identical) router ``R`` and local experts
``w1_i, w3_i, w2_i`` (``E/N`` each); ``W* = cat_i(w*_i)`` the global experts:

* forward: member ``i`` gets ``moe_forward(X_i, R, W1, W3, W2, top_k, capacity_factor,
  token_groups, "")``: routing and capacity are computed per rank on its own tokens;
* backward: ``grad_x_i`` and ``grad_router_w_i`` are the single-process backward on
  member ``i``'s own ``(X_i, grad_out_i, grad_probs_sum_i, grad_z_sum_i)``; the expert
  weight gradients of member ``j`` are the sum over members ``i`` (in group-rank order)
  of the single-process full-expert gradients on member ``i``'s data, restricted to
  ``j``'s experts, times member ``j``'s ``expert_grad_scale``.

Checked (else :class:`CollectiveMismatchError`, naming every rank's node): the
members agree on ``top_k``, ``capacity_factor``, ``token_groups``, hold bitwise equal
routers, agree on dtypes and on the expert shapes, and ``E`` experts split as ``E/N``
per member; in capacity mode their capacity buffers (``token_groups * C`` slots per
expert, which depend on ``T_i``) have one size, because the op exchanges them with
equal-split ``all_to_all``\\ s (dropless mode allows different ``T_i``). Arguments the
op itself rejects (``T_i`` not divisible by ``token_groups``, ``top_k`` out of range)
raise :class:`ReferenceSemanticsError` naming the rank and node.

Numerics: experts run on each member's rows separately, not on the rows of every
member batched as on real ranks, so results agree with a real multi-rank run within
the tolerance policy (the routing, computed from the same rows in the same way, is
identical).
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.ir.kinds import CollectiveArgs
from commfuse.ops.moe_layer import op as moe_ops
from commfuse.ops.moe_layer.routing import capacity
from commfuse.reference.errors import ReferenceSemanticsError
from commfuse.reference.semantics import RankCall, _mismatch, register_sync_op

MOE_LAYER = moe_ops.MOE_LAYER
MOE_LAYER_BACKWARD = moe_ops.MOE_LAYER_BACKWARD

_OPERANDS = ("x", "router_w", "w1", "w3", "w2", "top_k", "capacity_factor", "token_groups", "group_name")
_FWD_NAMES = (*_OPERANDS, "chunks")
_BWD_NAMES = ("grad_out", "grad_probs_sum", "grad_z_sum", *_OPERANDS, "expert_grad_scale", "chunks")
_ATTRS = ("top_k", "capacity_factor", "token_groups")
_DEFAULTS = {"chunks": 1}


def _named(names: tuple[str, ...], a: tuple, k: dict) -> dict[str, Any]:
    out = {}
    for i, name in enumerate(names):
        if i < len(a):
            out[name] = a[i]
        elif name in k:
            out[name] = k[name]
        elif name in _DEFAULTS:
            out[name] = _DEFAULTS[name]
        else:
            raise KeyError(name)
    return out


def _parse(names: tuple[str, ...]):
    def parse(a: tuple, k: dict) -> CollectiveArgs:
        v = _named(names, a, k)
        tensors = tuple(
            v[n] for n in names if n not in _ATTRS and n not in ("group_name", "expert_grad_scale", "chunks")
        )
        g = v["group_name"]
        return CollectiveArgs(tensors, g if isinstance(g, str) else str(getattr(g, "group_name", g)))

    return parse


def _values(calls: list[RankCall], names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [_named(names, c.raw_args, c.raw_kwargs) for c in calls]


def _check_members(calls: list[RankCall], vals: list[dict[str, Any]]) -> tuple[int, int]:
    """Cross-rank checks shared by forward and backward; returns (experts E, local experts per member)."""
    for attr in _ATTRS:
        got = [v[attr] for v in vals]
        if any(g != got[0] for g in got[1:]):
            raise _mismatch(calls, f"{attr} differs between ranks: {got}")
    routers = [v["router_w"] for v in vals]
    r0 = routers[0]
    for v, c in zip(vals, calls, strict=True):
        r = v["router_w"]
        if r.shape != r0.shape or r.dtype != r0.dtype or not _same_bits(r, r0):
            desc = [f"{tuple(t.shape)}/{t.dtype}" for t in routers]
            raise _mismatch(
                calls,
                f"router_w differs between ranks (first difference: {c.where()}; "
                f"every rank of the expert-parallel group must hold the same router weight; "
                f"shapes {desc})",
            )
    xs = [v["x"] for v in vals]
    if any(x.dtype != xs[0].dtype or x.dim() != 2 or x.shape[1] != xs[0].shape[1] for x in xs):
        raise _mismatch(
            calls,
            f"token inputs x differ in dtype or hidden size between ranks: "
            f"{[f'{tuple(x.shape)}/{x.dtype}' for x in xs]}",
        )
    for name in ("w1", "w3", "w2"):
        ws = [v[name] for v in vals]
        if any(w.shape != ws[0].shape or w.dtype != ws[0].dtype for w in ws):
            raise _mismatch(
                calls,
                f"expert weights {name} differ in shape/dtype between ranks: "
                f"{[f'{tuple(w.shape)}/{w.dtype}' for w in ws]}",
            )
    n, e, local = len(calls), r0.shape[0] if r0.dim() == 2 else -1, vals[0]["w1"].shape[0]
    if r0.dim() != 2 or local * n != e:
        raise _mismatch(
            calls,
            f"router_w {tuple(r0.shape)} has {e} experts but the {n} ranks hold "
            f"{local} local experts each (need E = {n} x local experts)",
        )
    cf, k, tg = vals[0]["capacity_factor"], vals[0]["top_k"], vals[0]["token_groups"]
    if cf > 0 and n > 1:
        slots = [tg * capacity(cf, k, x.shape[0] // max(int(tg), 1), e) for x in xs]
        if any(s != slots[0] for s in slots):
            raise _mismatch(
                calls,
                f"capacity buffers differ between ranks ({slots} slots per expert for "
                f"{[x.shape[0] for x in xs]} tokens): the op exchanges them with equal-split "
                f"all_to_alls, so every rank must route the same number of tokens",
            )
    return e, local


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _full(vals: list[dict[str, Any]], name: str) -> torch.Tensor:
    return torch.cat([v[name] for v in vals], dim=0)


def _run(call: RankCall, fn, *args):
    try:
        return fn(*args)
    except (ValueError, IndexError, RuntimeError) as e:
        raise ReferenceSemanticsError(
            f"{call.where()} on group {call.group_name!r} {list(call.group)}: the op "
            f"fails on this rank's arguments: {e}"
        ) from e


def moe_layer_semantics(calls: list[RankCall]) -> list[Any]:
    vals = _values(calls, _FWD_NAMES)
    _check_members(calls, vals)
    w1, w3, w2 = _full(vals, "w1"), _full(vals, "w3"), _full(vals, "w2")
    out = []
    for c, v in zip(calls, vals, strict=True):
        res = _run(
            c,
            moe_ops.moe_forward,
            v["x"],
            v["router_w"],
            w1,
            w3,
            w2,
            v["top_k"],
            v["capacity_factor"],
            v["token_groups"],
            "",
            v["chunks"],
        )
        out.append(tuple(res))
    return out


def moe_layer_backward_semantics(calls: list[RankCall]) -> list[Any]:
    vals = _values(calls, _BWD_NAMES)
    _, local = _check_members(calls, vals)
    for c, v in zip(calls, vals, strict=True):
        if v["grad_out"].shape != v["x"].shape:
            raise _mismatch(
                calls,
                f"{c.where()}: grad_out {tuple(v['grad_out'].shape)} does not match x {tuple(v['x'].shape)}",
            )
    w1, w3, w2 = _full(vals, "w1"), _full(vals, "w3"), _full(vals, "w2")
    per_rank = []
    for c, v in zip(calls, vals, strict=True):
        per_rank.append(
            _run(
                c,
                moe_ops.moe_backward,
                v["grad_out"],
                v["grad_probs_sum"],
                v["grad_z_sum"],
                v["x"],
                v["router_w"],
                w1,
                w3,
                w2,
                v["top_k"],
                v["capacity_factor"],
                v["token_groups"],
                "",
                1.0,
                v["chunks"],
            )
        )
    # expert gradients: the sum over members (group-rank order) of each member's full-expert gradients
    summed = []
    for k in (2, 3, 4):
        acc = per_rank[0][k].clone()
        for g in per_rank[1:]:
            acc.add_(g[k])
        summed.append(acc)
    out = []
    for j, (v, g) in enumerate(zip(vals, per_rank, strict=True)):
        sl = slice(j * local, (j + 1) * local)
        scale = v["expert_grad_scale"]
        experts = [
            (s[sl] * scale).to(v[name].dtype) for s, name in zip(summed, ("w1", "w3", "w2"), strict=True)
        ]
        out.append((g[0].clone(), g[1].clone(), *experts))
    return out


def register() -> None:
    """Both MoE ops' semantics with the reference interpreter (called by :func:`commfuse.ops.install`)."""
    register_sync_op(
        MOE_LAYER,
        _parse(_FWD_NAMES),
        moe_layer_semantics,
        replicated=(_FWD_NAMES.index("router_w"),),
        replace=True,
    )
    register_sync_op(
        MOE_LAYER_BACKWARD,
        _parse(_BWD_NAMES),
        moe_layer_backward_semantics,
        replicated=(_BWD_NAMES.index("router_w"),),
        replace=True,
    )


__all__ = ["moe_layer_backward_semantics", "moe_layer_semantics", "register"]
