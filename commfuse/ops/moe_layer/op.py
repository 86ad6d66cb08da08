"""``commfuse::moe_layer``: a whole expert-parallel MoE layer as one graph op.

Why one op: router -> dispatch -> all_to_all -> experts -> all_to_all -> combine
computes each token's output from that token alone, whichever rank routes it --
but the ATen ops of a dispatch do not show it (capacity slots come from a cumsum
over tokens, dropless dispatch from a sort with data-dependent split sizes). As
one op with known semantics the graph passes can move it onto token shards
(:mod:`commfuse.analysis.moe_rules`) like any token-wise op. The IR counts the
all_to_alls it issues (:mod:`.comm_volume`).

``moe_layer(x [..., H], router_w [E, H], w1 [E/N, H, F], w3 [E/N, H, F],
w2 [E/N, F, H], top_k, capacity_factor, token_groups, group_name, chunks=1)`` returns
``(out [..., H], probs_sum [E], top1_count [E], z_sum [])``:

* ``out[t] = sum_j gate[t, j] * SwiGLU_{expert[t, j]}(x[t])`` over the kept
  assignments of token ``t`` (:mod:`.routing`);
* the statistics are sums over this call's tokens (for the auxiliary losses).

Experts ``[r*E/N, (r+1)*E/N)`` live on rank ``r`` of the process group named
``group_name`` (``""``: no expert parallelism, all E experts local). Every rank
of the group must call the op together (it issues collectives); the group is
resolved at run time from its name, so the graph holds only strings.

``chunks > 1`` (dropless routing only; :func:`token_chunk_count`) pipelines the exchange:
the tokens are cut into that many contiguous chunks, one all_to_all sends every chunk's
per-expert counts, every chunk's rows are sent asynchronously, and each chunk's expert
outputs start back while the next chunk's experts compute. Same values (the expert weight
gradients are summed over chunks); the ``expert_exchange_partition`` pass chooses it.

Backward (``moe_layer_backward``) recomputes the routing, re-sends each kept
assignment's token with its output gradient and gate (``2H + 1`` values), runs
the expert VJP where the expert lives and sends back the input gradient and the
gate gradient (``H + 1``): no received-token buffer is kept between forward and
backward. ``expert_grad_scale`` multiplies the expert weight gradients; autograd
passes 1 (the pass that moves the op onto shards changes it, see moe_rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import Argument

from commfuse.ops.moe_layer.exchange import Exchange, token_chunk_exchanges, token_chunks
from commfuse.ops.moe_layer.routing import Assignments, assign, router_probs, router_statistics, top_k_gates

Tensor = torch.Tensor


def resolve_group(group_name: str) -> Optional[dist.ProcessGroup]:
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    return (F.silu(x @ w1) * (x @ w3)) @ w2


# The VJPs are written out: inside a custom op's kernel the autograd dispatch key is
# excluded, so torch.autograd cannot be used there.
def swiglu_vjp(
    x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, g: Tensor
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``(y, dx, (dw1, dw3, dw2))`` of ``y = swiglu(x)`` for output gradient ``g``."""
    a, b = x @ w1, x @ w3
    sig = torch.sigmoid(a)
    s = a * sig
    hidden = s * b
    dh = g @ w2.t()
    da = dh * b * (sig * (1 + a * (1 - sig)))
    db = dh * s
    return hidden @ w2, da @ w1.t() + db @ w3.t(), (x.t() @ da, x.t() @ db, hidden.t() @ g)


def router_vjp(
    x: Tensor,
    router_w: Tensor,
    logits: Tensor,
    probs: Tensor,
    gates: Tensor,
    experts: Tensor,
    grad_gates: Tensor,
    grad_probs_sum: Tensor,
    grad_z_sum: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(dx, drouter_w)`` through logits -> softmax -> top-k (renormalised) gates, the
    probability sums and the z-loss sum, given that forward's values."""
    top_k = experts.shape[-1]
    if top_k > 1:
        total = probs.gather(-1, experts).sum(-1, keepdim=True)
        d_picked = (grad_gates - (grad_gates * gates).sum(-1, keepdim=True)) / total
    else:
        d_picked = grad_gates
    d_probs = torch.zeros_like(probs).scatter_(1, experts, d_picked) + grad_probs_sum
    d_logits = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
    d_logits = d_logits + grad_z_sum * 2 * torch.logsumexp(logits, -1, keepdim=True) * probs
    return (d_logits @ router_w.float()).to(x.dtype), (d_logits.t() @ x.float()).to(router_w.dtype)


def _check(x: Tensor, router_w: Tensor, w1: Tensor, top_k: int, group_size: int) -> None:
    if x.dim() < 1 or router_w.dim() != 2 or x.shape[-1] != router_w.shape[1]:
        raise ValueError(
            f"moe_layer: x must be [..., H] and router_w [E, H]; got {tuple(x.shape)}, "
            f"{tuple(router_w.shape)}"
        )
    if w1.shape[0] * group_size != router_w.shape[0]:
        raise ValueError(
            f"moe_layer: {router_w.shape[0]} experts over {group_size} ranks needs "
            f"{router_w.shape[0] // group_size} local experts, w1 has {w1.shape[0]}"
        )
    if not 1 <= top_k <= router_w.shape[0]:
        raise ValueError(f"moe_layer: top_k={top_k} out of range for {router_w.shape[0]} experts")


def _route(x: Tensor, router_w: Tensor, top_k: int, capacity_factor: float, token_groups: int):
    logits, probs = router_probs(x, router_w)
    gates, experts = top_k_gates(probs, top_k)
    return logits, probs, gates, experts, assign(experts, router_w.shape[0], capacity_factor, token_groups)


def token_chunk_count(chunks: int, capacity_factor: float) -> int:
    """The exchanges a call is cut into: ``chunks`` for dropless routing, else 1 -- capacity
    slots are counted over a token group, and cutting it would change which assignments are
    dropped. Not bounded by the tokens: ranks may hold different token counts and must issue
    the same all_to_alls (a chunk without tokens exchanges empty buffers)."""
    return max(1, chunks) if capacity_factor <= 0 else 1


def _exchanges(
    a: Assignments, tokens: int, num_experts: int, group: Optional[dist.ProcessGroup], chunks: int
) -> list[Exchange]:
    if chunks == 1:
        return [Exchange(a, num_experts, group)]
    return token_chunk_exchanges(token_chunks(a, tokens, chunks), num_experts, group)


def _pipelined(exchanges: list[Exchange], rows: list[Tensor], experts_fn) -> Tensor:
    """Every chunk's rows sent out, then per chunk: wait for its rows, ``experts_fn(per local
    expert rows)`` and send the answers back while the next chunk's experts compute; the
    answers of every assignment, in assignment order."""
    sent = [ex.start_to_experts(r) for ex, r in zip(exchanges, rows, strict=True)]
    back = [ex.start_to_tokens(experts_fn(s.wait())) for ex, s in zip(exchanges, sent, strict=True)]
    return torch.cat([b.wait() for b in back])


def moe_forward(
    x: Tensor,
    router_w: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    top_k: int,
    capacity_factor: float,
    token_groups: int,
    group_name: str,
    chunks: int = 1,
):
    group = resolve_group(group_name)
    _check(x, router_w, w1, top_k, 1 if group is None else dist.get_world_size(group))
    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    logits, probs, gates, experts, a = _route(x, router_w, top_k, capacity_factor, token_groups)
    chunks = token_chunk_count(chunks, capacity_factor)
    exchanges = _exchanges(a, x.shape[0], router_w.shape[0], group, chunks)
    rows = x[a.token].split([ex.a.token.numel() for ex in exchanges])
    y = _pipelined(
        exchanges, rows, lambda received: [swiglu(r, w1[e], w3[e], w2[e]) for e, r in enumerate(received)]
    )  # [A, H]
    gate = gates[a.token, a.choice].to(x.dtype)
    out = torch.zeros_like(x).index_add_(0, a.token, y * gate.unsqueeze(1))
    return (out.view(shape), *router_statistics(logits, probs, experts))


def moe_backward(
    grad_out: Tensor,
    grad_probs_sum: Tensor,
    grad_z_sum: Tensor,
    x: Tensor,
    router_w: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    top_k: int,
    capacity_factor: float,
    token_groups: int,
    group_name: str,
    expert_grad_scale: float,
    chunks: int = 1,
):
    group = resolve_group(group_name)
    shape, h = x.shape, x.shape[-1]
    x, grad_out = x.reshape(-1, h), grad_out.reshape(-1, h)
    logits, probs, gates, experts, a = _route(x, router_w, top_k, capacity_factor, token_groups)
    chunks = token_chunk_count(chunks, capacity_factor)
    exchanges = _exchanges(a, x.shape[0], router_w.shape[0], group, chunks)
    gate = gates[a.token, a.choice].to(x.dtype)
    payload = torch.cat([x[a.token], grad_out[a.token], gate.unsqueeze(1)], dim=1)
    grads_w = [torch.zeros_like(w) for w in (w1, w3, w2)]

    def expert_vjps(received: list[Tensor]) -> list[Tensor]:
        back = []
        for e, rows in enumerate(received):
            xe, ge, gate_e = rows[:, :h], rows[:, h : 2 * h], rows[:, 2 * h :]
            y, gx, gw = swiglu_vjp(xe, w1[e], w3[e], w2[e], ge * gate_e)
            for acc, g in zip(grads_w, gw, strict=True):
                acc[e] += g * expert_grad_scale  # summed over token chunks
            back.append(torch.cat([gx, (y * ge).sum(1, keepdim=True)], dim=1))
        return back

    rows = payload.split([ex.a.token.numel() for ex in exchanges])
    returned = _pipelined(exchanges, rows, expert_vjps)  # [A, H + 1]
    grad_x = torch.zeros_like(x).index_add_(0, a.token, returned[:, :h])
    grad_gate = torch.zeros_like(gates)
    grad_gate[a.token, a.choice] = returned[:, h].to(gates.dtype)
    gxr, gwr = router_vjp(x, router_w, logits, probs, gates, experts, grad_gate, grad_probs_sum, grad_z_sum)
    return (grad_x + gxr.to(x.dtype)).view(shape), gwr.to(router_w.dtype), *grads_w


# -- registration as custom ops --------------------------------------------------
@torch.library.custom_op("commfuse::moe_layer", mutates_args=())
def moe_layer(
    x: Tensor,
    router_w: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    top_k: int,
    capacity_factor: float,
    token_groups: int,
    group_name: str,
    chunks: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return moe_forward(x, router_w, w1, w3, w2, top_k, capacity_factor, token_groups, group_name, chunks)


@moe_layer.register_fake
def _(x, router_w, w1, w3, w2, top_k, capacity_factor, token_groups, group_name, chunks=1):
    e = router_w.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    return torch.empty_like(x), x.new_empty(e, **f32), x.new_empty(e, **f32), x.new_empty((), **f32)


@torch.library.custom_op("commfuse::moe_layer_backward", mutates_args=())
def moe_layer_backward(
    grad_out: Tensor,
    grad_probs_sum: Tensor,
    grad_z_sum: Tensor,
    x: Tensor,
    router_w: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    top_k: int,
    capacity_factor: float,
    token_groups: int,
    group_name: str,
    expert_grad_scale: float,
    chunks: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return moe_backward(
        grad_out,
        grad_probs_sum,
        grad_z_sum,
        x,
        router_w,
        w1,
        w3,
        w2,
        top_k,
        capacity_factor,
        token_groups,
        group_name,
        expert_grad_scale,
        chunks,
    )


@moe_layer_backward.register_fake
def _(grad_out, grad_probs_sum, grad_z_sum, x, router_w, w1, w3, w2, *args):
    return tuple(torch.empty_like(t) for t in (x, router_w, w1, w3, w2))


def _setup_context(ctx, inputs, output) -> None:
    x, router_w, w1, w3, w2, top_k, capacity_factor, token_groups, group_name, *chunks = inputs
    ctx.save_for_backward(x, router_w, w1, w3, w2)
    ctx.attrs = (top_k, capacity_factor, token_groups, group_name)
    ctx.chunks = chunks[0] if chunks else 1


def _backward(ctx, grad_out, grad_probs_sum, grad_top1, grad_z_sum):
    x, router_w, w1, w3, w2 = ctx.saved_tensors
    # Outputs that did not reach the loss arrive as None: zeros keep one backward signature.
    grad_out = torch.zeros_like(x) if grad_out is None else grad_out
    e = router_w.shape[0]
    grad_probs_sum = x.new_zeros(e, dtype=torch.float32) if grad_probs_sum is None else grad_probs_sum
    grad_z_sum = x.new_zeros((), dtype=torch.float32) if grad_z_sum is None else grad_z_sum
    grads = moe_layer_backward(
        grad_out.contiguous(),
        grad_probs_sum,
        grad_z_sum,
        x,
        router_w,
        w1,
        w3,
        w2,
        *ctx.attrs,
        1.0,
        ctx.chunks,
    )
    return (*grads, None, None, None, None, None)


moe_layer.register_autograd(_backward, setup_context=_setup_context)
MOE_LAYER = torch.ops.commfuse.moe_layer.default
MOE_LAYER_BACKWARD = torch.ops.commfuse.moe_layer_backward.default
MOE_OPS = (MOE_LAYER, MOE_LAYER_BACKWARD)


def arg_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The op's argument names, in schema order (a graph node's positional order)."""
    return tuple(a.name for a in op._schema.arguments)


# the position of each op's ``chunks`` argument
CHUNKS_ARG = {op: arg_names(op).index("chunks") for op in MOE_OPS}


@dataclass(frozen=True)
class MoeOperands:
    """The arguments of one ``moe_layer`` / ``moe_layer_backward`` call, by their schema names.

    The fields are named as the ops' schemas name their arguments, and :meth:`of` fills them by
    those names, so no reader of a graph node counts positions. Tensor operands are what the
    node holds (``fx.Node``\\ s in a graph); ``chunks`` is the schema default when the node
    omits it. ``grad_out``, ``grad_probs_sum``, ``grad_z_sum`` and ``expert_grad_scale`` are
    the backward op's alone (None for the forward op).
    """

    op: torch._ops.OpOverload
    x: Argument  # the tokens, [..., H]
    router_w: Argument  # [E, H]
    w1: Argument  # this rank's experts: [E/N, H, F]
    w3: Argument  # [E/N, H, F]
    w2: Argument  # [E/N, F, H]
    top_k: int
    capacity_factor: float
    token_groups: int
    group_name: str
    chunks: int = 1
    grad_out: Argument = None
    grad_probs_sum: Argument = None
    grad_z_sum: Argument = None
    expert_grad_scale: Optional[float] = None

    @property
    def backward(self) -> bool:
        return self.op is MOE_LAYER_BACKWARD

    @classmethod
    def of(cls, node: fx.Node) -> "MoeOperands":
        """The operands of ``node``, a call of either op (positional or keyword arguments);
        TypeError for any other node."""
        if node.op != "call_function" or node.target not in MOE_OPS:
            raise TypeError(
                f"{node.name} ({node.op} {node.target}) is not a call of commfuse::moe_layer "
                "or commfuse::moe_layer_backward"
            )
        schema = node.target._schema.arguments
        unknown = sorted(set(node.kwargs) - {a.name for a in schema})
        if len(node.args) > len(schema) or unknown:
            raise TypeError(
                f"{node.name}: {len(node.args)} positional arguments and keywords {unknown} do "
                f"not fit {node.target}'s schema {list(arg_names(node.target))}"
            )
        values = {}
        for i, a in enumerate(schema):
            if i < len(node.args):
                values[a.name] = node.args[i]
            elif a.name in node.kwargs:
                values[a.name] = node.kwargs[a.name]
            elif a.has_default_value():
                values[a.name] = a.default_value
            else:
                raise TypeError(f"{node.name}: {node.target} without its {a.name!r} argument")
        return cls(node.target, **values)

    def args(self) -> tuple:
        """Positional arguments of a call of the op with these operands (e.g. after
        ``dataclasses.replace``); trailing arguments at their schema default are left out,
        as tracing leaves them out."""
        schema = self.op._schema.arguments
        values = [getattr(self, a.name) for a in schema]
        end = len(values)
        while (
            end and schema[end - 1].has_default_value() and values[end - 1] == schema[end - 1].default_value
        ):
            end -= 1
        return tuple(values[:end])
