"""Compute time of one FX node: FLOPs and bytes moved, roofline against the device.

What it models
    For each ATen op (from the shapes and dtypes in ``node.meta["val"]``):

    * ``flops`` (multiply-add = 2 FLOPs, the convention of
      ``torch.utils.flop_counter``): mm/addmm 2MKN, bmm/baddbmm 2BMKN, matmul/
      linear 2 x numel(out) x K, convolution 2 x numel(out) x prod(w.shape[1:])
      (backward: once per computed gradient), SDPA forward 2BH·L·S·(E+Ev),
      backward 2BH·L·S·(3E+2Ev) (recompute QK^T, dO·V^T, P^T·dO, dS·K, dS^T·Q;
      causal masks not discounted, as in flop_counter), layer/RMS/group norm 8
      (fwd) / 16 (bwd) per element, softmax 5 / 4 per element, pointwise ops
      (``torch.Tag.pointwise``) 1 per output element, reductions 1 per input
      element, embedding/gather 0.
    * ``bytes``: every tensor read plus every tensor written, once (no cache
      reuse); embedding/gather/index_select read only the selected rows.
    * free ops: views (``OpOverload.is_view``), ``getitem``, ``_unsafe_view``,
      allocation (``empty*``), symbolic-size ops, placeholders/outputs, and
      collectives/waits (the collective model prices those).
    * ``time_us = max(flops / peak(dtype family), bytes / memory bandwidth)``
      (roofline) x a calibration multiplier per op family, plus a per-op overhead;
      or, when the profile has a fit for the family, ``a_us + b x flops`` (or
      ``x bytes``): the form `commfuse calibrate` fits for matmuls on CPU.
    * unknown ops: bytes-based (memory-bound) estimate, ``flagged=True``.

Sources
    FLOP conventions: ``torch/utils/flop_counter.py`` (mm, bmm, conv, SDPA fwd/bwd);
    roofline: Williams et al., CACM 2009. Families follow commfuse.ir.dims'
    vocabulary loosely: matmul, attention, attention_bw (SDPA backward kernels: a
    different kernel with its own efficiency, calibrated apart), conv, norm,
    softmax, pointwise, reduction, embedding, memory, free, unknown. A family
    without a fit or multiplier of its own uses its parent's (attention_bw ->
    attention), so profiles written before it existed still load and answer.

Assumptions
    Peaks are dense tensor-core peaks for bf16/fp16 and the non-tensor peak for
    fp32 (PyTorch's default ``allow_tf32=False`` for matmuls); other dtypes use
    the fp32 peak. Symbolic sizes take rank-invariant, bounded hints
    (:func:`~commfuse.costmodel.symbol_hints.hinted`), never a SymInt's example value.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, field_validator

from commfuse.costmodel.collectives import concrete
from commfuse.costmodel.symbol_hints import SymbolHints, hinted_shape
from commfuse.costmodel.topology import Topology
from commfuse.ir.kinds import collective_spec, is_wait

FAMILIES = (
    "matmul",
    "attention",
    "attention_bw",
    "conv",
    "norm",
    "softmax",
    "pointwise",
    "reduction",
    "embedding",
    "memory",
    "view",
    "free",
    "unknown",
)

# a family without its own fit/multiplier falls back to its parent's
_PARENT = {"attention_bw": "attention"}

_FLOP_PER_US_PER_TFLOPS = 1e6
_BYTES_PER_US_PER_GBPS = 1e3


# --------------------------------------------------------------------------- results & params


@dataclass(frozen=True)
class OpCost:
    """Work of one node, independent of the device."""

    flops: int
    bytes: int
    family: str
    dtype_family: str  # "bf16" (bf16/fp16) or "fp32"
    out_numel: int
    known: bool = True  # False: an op without a formula (bytes-based guess)


@dataclass(frozen=True)
class ComputeEstimate:
    time_us: float
    flops: int
    bytes: int
    family: str
    bound: str  # "compute", "memory", "fitted", "free"
    flagged: bool  # unknown op: bytes-based guess
    out_numel: int = 0
    dtype_family: str = "fp32"


class FamilyFit(BaseModel):
    """``time_us = a_us + b_us_per_unit x (flops | bytes)`` for one op family."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a_us: NonNegativeFloat
    b_us_per_unit: NonNegativeFloat
    unit: str = Field(default="flops", pattern="^(flops|bytes)$")


def _check_families(d: dict) -> dict:
    bad = sorted(set(d) - set(FAMILIES))
    if bad:
        raise ValueError(f"unknown op families {bad}; known: {list(FAMILIES)}")
    return d


class ComputeParams(BaseModel):
    """Calibration of the compute model (every field optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multiplier: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="family -> time multiplier"
    )
    fits: dict[str, FamilyFit] = Field(default_factory=dict, description="family -> fitted a + b x unit")
    overhead_us: NonNegativeFloat = Field(
        default=0.0, description="added to every non-free op (launch/dispatch)"
    )
    view_us: NonNegativeFloat = Field(
        default=0.0,
        description="time of an ATen view/metadata op (free on a GPU stream; a dispatch on CPU eager)",
    )

    @field_validator("multiplier", "fits")
    @classmethod
    def _families(cls, v: dict) -> dict:
        return _check_families(v)


# --------------------------------------------------------------------------- shapes


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _tensors(x: Any) -> list[torch.Tensor]:
    """Tensors (meta values) among fx-node args, lists flattened."""
    out: list[torch.Tensor] = []
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append(v)
    elif isinstance(x, (list, tuple)):
        for y in x:
            out.extend(_tensors(y))
    elif isinstance(x, dict):
        for y in x.values():
            out.extend(_tensors(y))
    return out


def _out_tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for y in v for t in _out_tensors(y)]
    return []


class _Sizes:
    def __init__(self, symbol_hint: "int | SymbolHints") -> None:
        self.hint = symbol_hint

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        # the symbols of one shape are hinted together: bounded (symbol_hints.hinted)
        if all(isinstance(s, int) for s in t.shape):
            return tuple(t.shape)
        try:
            return hinted_shape(t.shape, self.hint)
        except Exception:  # noqa: BLE001 - an expression sympy cannot evaluate: size by size
            return tuple(self.size(s) for s in t.shape)

    def size(self, s: Any) -> int:
        if isinstance(s, int):
            return s
        v = concrete(s, self.hint)
        return int(self.hint) if v is None else v

    def numel(self, t: torch.Tensor) -> int:
        return math.prod(self.shape(t))

    def nbytes(self, t: torch.Tensor) -> int:
        return self.numel(t) * t.dtype.itemsize


def value_bytes(val: Any, symbol_hint: "int | SymbolHints" = 4096) -> int:
    """Bytes of a ``meta["val"]`` (a tensor, or a list of them), symbols at rank-invariant hints."""
    sizes = _Sizes(symbol_hint)
    return sum(sizes.nbytes(t) for t in _out_tensors(val))


def _dtype_family(ts: list[torch.Tensor]) -> str:
    for t in ts:
        if t.is_floating_point():
            return "bf16" if t.dtype in (torch.bfloat16, torch.float16) else "fp32"
    return "fp32"


# --------------------------------------------------------------------------- per-op formulas

_Formula = Callable[[fx.Node, _Sizes, list, list], tuple[int, str]]  # -> (flops, family)


def _arg(node: fx.Node, i: int) -> Optional[torch.Tensor]:
    a = node.args[i] if len(node.args) > i else None
    v = _val(a)
    return v if isinstance(v, torch.Tensor) else None


def _mm(node, sz, ins, outs):
    a, b = _arg(node, 0), _arg(node, 1)
    (m, k), n = sz.shape(a), sz.shape(b)[-1]
    return 2 * m * k * n, "matmul"


def _addmm(node, sz, ins, outs):
    a, b = _arg(node, 1), _arg(node, 2)
    (m, k), n = sz.shape(a), sz.shape(b)[-1]
    return 2 * m * k * n, "matmul"


def _bmm(node, sz, ins, outs, first=0):
    a, b = _arg(node, first), _arg(node, first + 1)
    bs, m, k = sz.shape(a)
    n = sz.shape(b)[-1]
    return 2 * bs * m * k * n, "matmul"


def _matmul_like(node, sz, ins, outs):
    # matmul / linear: every output element is a K-long dot product
    k = sz.shape(_arg(node, 0))[-1]
    return 2 * sz.numel(outs[0]) * k, "matmul"


def _conv_fwd_flops(sz, x, w, out, transposed):
    per = math.prod(sz.shape(w)[1:])
    return 2 * (sz.numel(x) if transposed else sz.numel(out)) * per


def _conv(node, sz, ins, outs):
    x, w = _arg(node, 0), _arg(node, 1)
    transposed = bool(node.args[6]) if len(node.args) > 6 else False
    return _conv_fwd_flops(sz, x, w, outs[0], transposed), "conv"


def _conv_bwd(node, sz, ins, outs):
    grad_out, x, w = _arg(node, 0), _arg(node, 1), _arg(node, 2)
    transposed = bool(node.args[7]) if len(node.args) > 7 else False
    mask = node.args[10] if len(node.args) > 10 else [True, True, True]
    f = _conv_fwd_flops(sz, x, w, grad_out, transposed)
    return f * (int(bool(mask[0])) + int(bool(mask[1]))), "conv"


def _qkv(node, sz, first, bshd):
    q, k, v = (sz.shape(_arg(node, first + i)) for i in range(3))
    if bshd:  # (B, L, H, E) layout of _flash_attention_forward / _efficient_attention_forward
        q, k, v = ((s[0], s[2], s[1], s[3]) for s in (q, k, v))
    b, h, lq, e = q
    s_k, ev = k[2], v[3]
    return b, h, lq, s_k, e, ev


def _sdpa_fwd(bshd=False):
    def f(node, sz, ins, outs):
        b, h, lq, s, e, ev = _qkv(node, sz, 0, bshd)
        return 2 * b * h * lq * s * (e + ev), "attention"

    return f


def _sdpa_bwd(bshd=False):
    def f(node, sz, ins, outs):
        b, h, lq, s, e, ev = _qkv(node, sz, 1, bshd)
        return 2 * b * h * lq * s * (3 * e + 2 * ev), "attention_bw"

    return f


def _per_elem(k: int, family: str, of: str = "in"):
    def f(node, sz, ins, outs):
        ts = ins if of == "in" else outs
        return k * (max((sz.numel(t) for t in ts), default=0)), family

    return f


_FORMULAS: dict[str, _Formula] = {
    "mm": _mm,
    "addmm": _addmm,
    "_scaled_mm": _mm,
    "bmm": _bmm,
    "baddbmm": lambda n, s, i, o: _bmm(n, s, i, o, first=1),
    "matmul": _matmul_like,
    "linear": _matmul_like,
    "convolution": _conv,
    "_convolution": _conv,
    "convolution_backward": _conv_bwd,
    "scaled_dot_product_attention": _sdpa_fwd(),
    "_scaled_dot_product_flash_attention": _sdpa_fwd(),
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_fwd(),
    "_scaled_dot_product_efficient_attention": _sdpa_fwd(),
    "_scaled_dot_product_cudnn_attention": _sdpa_fwd(),
    "_flash_attention_forward": _sdpa_fwd(bshd=True),
    "_efficient_attention_forward": _sdpa_fwd(bshd=True),
    "_scaled_dot_product_flash_attention_backward": _sdpa_bwd(),
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_bwd(),
    "_scaled_dot_product_efficient_attention_backward": _sdpa_bwd(),
    "_scaled_dot_product_cudnn_attention_backward": _sdpa_bwd(),
    "_flash_attention_backward": _sdpa_bwd(bshd=True),
    "_efficient_attention_backward": _sdpa_bwd(bshd=True),
    "native_layer_norm": _per_elem(8, "norm"),
    "layer_norm": _per_elem(8, "norm"),
    "_fused_rms_norm": _per_elem(8, "norm"),
    "rms_norm": _per_elem(8, "norm"),
    "native_group_norm": _per_elem(8, "norm"),
    "native_batch_norm": _per_elem(8, "norm"),
    "_native_batch_norm_legit": _per_elem(8, "norm"),
    "_native_batch_norm_legit_no_training": _per_elem(8, "norm"),
    "native_layer_norm_backward": _per_elem(16, "norm"),
    "_fused_rms_norm_backward": _per_elem(16, "norm"),
    "native_group_norm_backward": _per_elem(16, "norm"),
    "native_batch_norm_backward": _per_elem(16, "norm"),
    "_softmax": _per_elem(5, "softmax"),
    "_log_softmax": _per_elem(5, "softmax"),
    "softmax": _per_elem(5, "softmax"),
    "log_softmax": _per_elem(5, "softmax"),
    "_safe_softmax": _per_elem(5, "softmax"),
    "_softmax_backward_data": _per_elem(4, "softmax"),
    "_log_softmax_backward_data": _per_elem(4, "softmax"),
}

# gather-like: read only the selected rows (output) + the indices, write the output
_GATHER = {"embedding", "index_select", "gather", "index", "take"}
_FREE = {
    "_unsafe_view",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "sym_storage_offset",
    "_assert_scalar",
    "_assert_tensor_metadata",
    "sym_constrain_range_for_size",
    "_local_scalar_dense",
}
_MEMORY = {
    "clone",
    "_to_copy",
    "copy",
    "copy_",
    "cat",
    "stack",
    "contiguous",
    "lift_fresh_copy",
    "zeros",
    "ones",
    "full",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "scalar_tensor",
    "arange",
    "index_put",
    "index_put_",
    "scatter",
    "scatter_add",
    "slice_scatter",
    "select_scatter",
    "constant_pad_nd",
    "embedding_dense_backward",
    "fill",
    "fill_",
    "split_with_sizes_copy",
    "view_copy",
    "tril",
    "triu",
    "expand_copy",
    "permute_copy",
    "_reshape_copy",
}


def _packet_name(target: Any) -> Optional[str]:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return None


def op_cost(node: fx.Node, symbol_hint: "int | SymbolHints" = 4096) -> OpCost:
    """FLOPs, bytes and family of one node (device-independent)."""
    free = OpCost(0, 0, "free", "fp32", 0)
    if node.op != "call_function":
        return free
    target = node.target
    if target is operator.getitem or collective_spec(target) is not None or is_wait(target):
        return free
    name = _packet_name(target)
    outs = _out_tensors(node.meta.get("val"))
    if name is None:  # python callables (sym ops, builtins): free when they make no tensor
        if not outs:
            return free
        name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload) and target.is_view or name in _FREE or not outs:
        # No data moves, but an eager run still dispatches the op (ComputeParams.view_us).
        return OpCost(0, 0, "view", "fp32", 0) if isinstance(target, torch._ops.OpOverload) and outs else free
    sz = _Sizes(symbol_hint)
    ins = _tensors(list(node.args) + list(node.kwargs.values()))
    dfam = _dtype_family(ins + outs)
    out_numel = sum(sz.numel(t) for t in outs)
    out_bytes = sum(sz.nbytes(t) for t in outs)
    in_bytes = sum(sz.nbytes(t) for t in ins)
    if name in _GATHER:
        idx = sum(sz.nbytes(t) for t in ins if not t.is_floating_point())
        return OpCost(0, 2 * out_bytes + idx, "embedding", dfam, out_numel)
    formula = _FORMULAS.get(name)
    if formula is not None:
        try:
            flops, family = formula(node, sz, ins, outs)
            return OpCost(int(flops), in_bytes + out_bytes, family, dfam, out_numel)
        except (TypeError, ValueError, IndexError, AttributeError):
            pass  # unexpected arg layout: fall through to the bytes-based guess, flagged
    elif name in _MEMORY:
        reads = (
            0
            if name.endswith("like")
            or name
            in ("zeros", "ones", "full", "new_zeros", "new_ones", "new_full", "scalar_tensor", "arange")
            else in_bytes
        )
        return OpCost(0, reads + out_bytes, "memory", dfam, out_numel)
    else:
        tags = getattr(target, "tags", ())
        if torch.Tag.pointwise in tags:
            return OpCost(out_numel, in_bytes + out_bytes, "pointwise", dfam, out_numel)
        if torch.Tag.reduction in tags:
            return OpCost(
                max((sz.numel(t) for t in ins), default=0), in_bytes + out_bytes, "reduction", dfam, out_numel
            )
    return OpCost(0, in_bytes + out_bytes, "unknown", dfam, out_numel, known=False)


# --------------------------------------------------------------------------- the model


class ComputeModel:
    """Roofline compute model over a topology's device, with calibration."""

    def __init__(
        self,
        topology: Topology,
        params: Optional[ComputeParams] = None,
        *,
        symbol_hint: "int | SymbolHints" = 4096,
    ):
        self.topology = topology
        self.params = params or ComputeParams()
        self.symbol_hint = symbol_hint

    def estimate(self, node: fx.Node) -> ComputeEstimate:
        return self.estimate_cost(op_cost(node, self.symbol_hint))

    def time_us(self, node: fx.Node) -> float:
        return self.estimate(node).time_us

    def estimate_cost(self, c: OpCost) -> ComputeEstimate:
        p = self.params
        if c.family == "free":
            return ComputeEstimate(0.0, 0, 0, "free", "free", False, 0, c.dtype_family)
        if c.family == "view":
            return ComputeEstimate(p.view_us, 0, 0, "view", "free", False, 0, c.dtype_family)
        fit = p.fits.get(c.family)
        parent = _PARENT.get(c.family)
        if fit is None and parent is not None:
            fit = p.fits.get(parent)
        if fit is not None:
            t = fit.a_us + fit.b_us_per_unit * (c.flops if fit.unit == "flops" else c.bytes)
            bound = "fitted"
        else:
            tc = c.flops / (self.topology.peak_tflops(c.dtype_family) * _FLOP_PER_US_PER_TFLOPS)
            tm = c.bytes / (self.topology.memory_bandwidth_GBps * _BYTES_PER_US_PER_GBPS)
            t = max(tc, tm) * p.multiplier.get(c.family, p.multiplier.get(parent, 1.0) if parent else 1.0)
            bound = "compute" if tc >= tm else "memory"
        return ComputeEstimate(
            t + p.overhead_us, c.flops, c.bytes, c.family, bound, not c.known, c.out_numel, c.dtype_family
        )
