"""Issue one functional collective as an asynchronous c10d call on a chosen process group.

``issue(target, args, kwargs, group) -> Issued``: the same result tensor(s) the
functional op would return (fresh buffers; inputs are never mutated), the c10d
``Work`` handles, and an in-place ``finish`` step the wait runs after the work
completes. The group argument in ``args`` is ignored in favour of ``group`` -- that is
how a plan routes a collective to a communicator-pool group or a sub-group.

Why own calls and not the functional ops: the runtime needs the ``Work`` (its future
tells the recorder when the transfer ended) and the freedom to pick the group object.

* ``avg`` reductions: NCCL has ``ReduceOp.AVG``; gloo does not, so there the runtime
  sums and ``finish`` divides by the group size (what functional collectives do on gloo).
* Coalesced ops issue one call per tensor; the graph waits each output separately. The
  runtime waits every ``Work`` exactly once (at the first output's wait) and applies
  ``finish`` to each output at its own wait: gloo's reduce-scatter ``Work`` copies its
  result into the output again on every ``wait()``, so a second wait would undo a finish.
* Ops without an entry here (in-place variants, point-to-point, commfuse's own
  ``reduce_to_root``) are run as the graph's op itself with the group name swapped
  (:func:`issue_fallback`); the recorder then only knows when the wait returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from commfuse.core.torch_private import c10d_all_gather_single, c10d_reduce_scatter_single
from commfuse.core.torch_private import c10d_functional as F
from commfuse.ops.boundary import M2MS, M2MS_AUTOGRAD, parse_m2ms

_F_OPS = {
    "sum": "SUM",
    "avg": "AVG",
    "product": "PRODUCT",
    "min": "MIN",
    "max": "MAX",
    "band": "BAND",
    "bor": "BOR",
    "bxor": "BXOR",
}


@dataclass
class Issued:
    outputs: list[Tensor]
    works: list[Any]
    finish: Optional[Callable[[Tensor], object]] = None  # applied in place to each output after its wait
    sent_bytes: int = 0  # bytes of the tensors handed to c10d on this rank (input side)
    received_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _backend(pg) -> str:
    try:
        return str(pg.name()).lower()
    except (AttributeError, RuntimeError):
        return ""


def _reduce_op(name: str, pg) -> tuple[Any, Optional[Callable[[Tensor], object]]]:
    import torch.distributed as dist

    key = str(name).lower()
    if key not in _F_OPS:
        raise ValueError(f"commfuse lowering: unsupported reduce_op {name!r}")
    if key == "avg" and "nccl" not in _backend(pg):
        n = pg.size()
        if n == 1:
            return dist.ReduceOp.SUM, None
        return dist.ReduceOp.SUM, lambda t: t.div_(n)
    return getattr(dist.ReduceOp, _F_OPS[key]), None


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _all_reduce(inp: Tensor, reduce_op: str, pg) -> Issued:
    import torch.distributed as dist

    op, finish = _reduce_op(reduce_op, pg)
    out = inp.clone(memory_format=torch.contiguous_format)
    w = dist.all_reduce(out, op=op, group=pg, async_op=True)
    return Issued([out], [w], finish, _nbytes(out), _nbytes(out))


def _all_gather(inp: Tensor, group_size: int, pg) -> Issued:
    src = inp.contiguous()
    out = src.new_empty((src.shape[0] * group_size, *src.shape[1:]))
    w = c10d_all_gather_single()(out, src, group=pg, async_op=True)
    return Issued([out], [w], None, _nbytes(src), _nbytes(out))


def _reduce_scatter(inp: Tensor, reduce_op: str, group_size: int, pg) -> Issued:
    op, finish = _reduce_op(reduce_op, pg)
    src = inp.contiguous()
    out = src.new_empty((src.shape[0] // group_size, *src.shape[1:]))
    w = c10d_reduce_scatter_single()(out, src, op=op, group=pg, async_op=True)
    return Issued([out], [w], finish, _nbytes(src), _nbytes(out))


def _all_to_all(inp: Tensor, out_splits, in_splits, pg) -> Issued:
    import torch.distributed as dist

    src = inp.contiguous()
    out_splits = [int(s) for s in out_splits] if out_splits else None
    in_splits = [int(s) for s in in_splits] if in_splits else None
    rows = sum(out_splits) if out_splits else src.shape[0]
    out = src.new_empty((rows, *src.shape[1:]))
    w = dist.all_to_all_single(out, src, out_splits, in_splits, group=pg, async_op=True)
    return Issued([out], [w], None, _nbytes(src), _nbytes(out))


def _broadcast(inp: Tensor, src: int, pg) -> Issued:
    import torch.distributed as dist

    out = inp.clone(memory_format=torch.contiguous_format)
    w = dist.broadcast(out, group=pg, group_src=int(src), async_op=True)
    return Issued([out], [w], None, _nbytes(out), _nbytes(out))


def _coalesced(one: Callable[..., Issued], inputs, *rest) -> Issued:
    parts = [one(t, *rest) for t in inputs]
    finish = next((p.finish for p in parts if p.finish is not None), None)
    return Issued(
        [p.outputs[0] for p in parts],
        [p.works[0] for p in parts],
        finish,
        sum(p.sent_bytes for p in parts),
        sum(p.received_bytes for p in parts),
    )


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs[name]


# target -> issue(args, kwargs, pg); args follow the functional op's schema
_ISSUERS: dict[Any, Callable[[tuple, dict, Any], Issued]] = {
    F.all_reduce.default: lambda a, k, pg: _all_reduce(
        _arg(a, k, 0, "input"), _arg(a, k, 1, "reduce_op"), pg
    ),
    F.all_gather_into_tensor.default: lambda a, k, pg: _all_gather(
        _arg(a, k, 0, "input"), int(_arg(a, k, 1, "group_size")), pg
    ),
    F.reduce_scatter_tensor.default: lambda a, k, pg: _reduce_scatter(
        _arg(a, k, 0, "input"), _arg(a, k, 1, "reduce_op"), int(_arg(a, k, 2, "group_size")), pg
    ),
    F.all_to_all_single.default: lambda a, k, pg: _all_to_all(
        _arg(a, k, 0, "input"), _arg(a, k, 1, "output_split_sizes"), _arg(a, k, 2, "input_split_sizes"), pg
    ),
    F.broadcast.default: lambda a, k, pg: _broadcast(_arg(a, k, 0, "input"), _arg(a, k, 1, "src"), pg),
    F.all_reduce_coalesced.default: lambda a, k, pg: _coalesced(
        _all_reduce, _arg(a, k, 0, "inputs"), _arg(a, k, 1, "reduce_op"), pg
    ),
    F.all_gather_into_tensor_coalesced.default: lambda a, k, pg: _coalesced(
        _all_gather, _arg(a, k, 0, "inputs"), int(_arg(a, k, 1, "group_size")), pg
    ),
    F.reduce_scatter_tensor_coalesced.default: lambda a, k, pg: _coalesced(
        _reduce_scatter,
        _arg(a, k, 0, "inputs"),
        _arg(a, k, 1, "reduce_op"),
        int(_arg(a, k, 2, "group_size")),
        pg,
    ),
}

# Where each op keeps its group name (schema position), for the fallback's swap.
_GROUP_ARG = {
    "all_reduce_": 2,
    "broadcast_": 2,
    "isend": 3,
    "irecv": 3,
    "batch_p2p_ops": 4,
    "reduce_to_root": 4,
    "m2ms": 6,
    "stage_transfer": 4,
}


def has_issuer(target: Any) -> bool:
    return target in _ISSUERS


def issue(target: Any, args: tuple, kwargs: dict, pg) -> Issued:
    return _ISSUERS[target](args, kwargs, pg)


def _m2ms_sent_bytes(args: tuple, kwargs: dict, pg) -> int:
    """What this rank puts on the wire in one many-to-many scatter (its own piece excluded)."""
    import torch.distributed as dist

    m = parse_m2ms(args, kwargs)
    x = m.x
    if pg is None or not isinstance(x, Tensor):
        return 0
    return m.sent_units(dist.get_rank(pg)) * m.unit_numel(x.shape) * x.element_size()


# Ops run as they are (issue_fallback) whose bytes on the wire this rank can still count.
_FALLBACK_SENT = {M2MS: _m2ms_sent_bytes, M2MS_AUTOGRAD: _m2ms_sent_bytes}


def issue_fallback(
    target: Any, args: tuple, kwargs: dict, group_name: Optional[str], pg: Any = None
) -> Issued:
    """Run the graph's own op (it registers its work for ``wait_tensor``), routed to `group_name`
    (``pg``: that group, to count the bytes this rank sends where the op's arguments say)."""
    pos = _GROUP_ARG.get(getattr(getattr(target, "_overloadpacket", None), "__name__", ""))
    if group_name is not None and pos is not None and len(args) > pos:
        args = (*args[:pos], group_name, *args[pos + 1 :])
    sent = _FALLBACK_SENT[target](args, kwargs, pg) if target in _FALLBACK_SENT else 0
    out = target(*args, **kwargs)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return Issued(
        outs, [], None, sent, sum(_nbytes(t) for t in outs if isinstance(t, Tensor)), extra={"fallback": True}
    )


def wait_fallback(t: Tensor) -> Tensor:
    return F.wait_tensor.default(t)
