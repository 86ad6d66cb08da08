"""Fuzz programs: a JSON-able description of a hybrid-parallel program, and how to trace it.

A :class:`Program` is a straight-line list of ops over named values::

    {"op": "matmul", "in": ["v0", "w1"], "out": ["v2"]}
    {"op": "all_gather", "in": ["v2"], "out": ["v3"], "group": "p1", "dim": 1}
    {"op": "moe_layer", "in": ["v3", "w4", "w5", "w6", "w7"], "out": ["v8", "v9", "v10", "v11"],
     "group": "p1", "top_k": 2, "capacity_factor": 1.0, "token_groups": 2}
    {"op": "m2ms", "in": ["v3"], "out": ["v12"], "group": "world", "dim": 1, "src": [0, 2],
     "dst": [1, 2, 3], "splits": [[1, 2, 0], [3, 0, 1]], "pad": 4}
    {"op": "stage_transfer", "in": ["v12"], "out": ["v13"], "group": "world", "src": [0, 1], "dst": [2, 3]}

Inputs are activations or parameters (``inputs``; ``"replicated": true`` marks one that
is the same on every rank, e.g. an MoE router weight), ``groups`` maps a role name to a
partition of the world (``"world"`` is ``[[0..N-1]]``; ``"p1"`` might be
``[[0, 2], [1, 3]]``), and every collective names a role: each rank uses its block.
Values are SSA names except that ``mutate`` updates a value in place (later readers
see the new contents, as in the Python program).

:func:`build_callable` turns a program into a Python function written with
``torch.distributed._functional_collectives`` / ``_c10d_functional`` ops (what DTensor
and traced programs use), and :func:`trace_program` traces it with ``make_fx`` on a
fake world, giving graphs with fake-tensor metadata on every node. With ``joint``
the function also calls ``torch.autograd.grad`` and returns the gradients, so the
graph is a joint forward+backward graph.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from commfuse.ir.graph_ir import PHASE_META_KEY
from commfuse.moe import moe_layer
from commfuse.ops import M2MS, STAGE_TRANSFER, m2ms, stage_transfer
from commfuse.train_step import MICROBATCH_META_KEY

c10d = torch.ops._c10d_functional
_W = c10d.wait_tensor.default

FORMAT = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Program:
    world_size: int
    groups: dict[str, list[list[int]]]
    inputs: list[dict]  # {"name", "shape", "init": act|weight|bias|ln_weight}
    ops: list[dict]
    outputs: list[str]
    dtype: str = "float32"
    joint: bool = False
    seed: int = 0  # data seed
    family: str = "mixed"
    # The tensor-parallel contract: every rank gets the same inputs, and the passes are told
    # every group is a TP group (Config.group_roles), so they may treat inputs as replicated.
    tp_contract: bool = False
    # Joint programs only: run the program M times (micro-batch k on its floating inputs scaled by
    # 1 + k/4), each forward and its backward tagged with its micro-batch and phase as a fused
    # train-step graph is (dhelix.fused_partition), the gradients summed in micro-batch order.
    microbatches: int = 1

    # ------------------------------------------------------------------ queries
    @property
    def per_rank(self) -> bool:
        """True when ranks run different code (p2p peers, uneven all_to_all splits) or hold inputs
        of different sizes (``rows``: a local batch per rank): one graph per rank."""
        return any(OPS[o["op"]].rank_dependent for o in self.ops) or any("rows" in i for i in self.inputs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def collectives(self) -> list[dict]:
        return [o for o in self.ops if OPS[o["op"]].collective]

    def max_group_size(self) -> int:
        sizes = [len(self.groups[o["group"]][0]) for o in self.collectives()]
        return max(sizes, default=1)

    def summary(self) -> str:
        kinds = ",".join(o["op"] for o in self.ops)
        mb = f" x{self.microbatches} micro-batches" if self.microbatches > 1 else ""
        return (
            f"N={self.world_size} {self.dtype}{' joint' if self.joint else ''}{mb} {self.family} "
            f"{len(self.ops)} ops [{kinds}]"
        )

    # ------------------------------------------------------------------ json
    def to_json(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Program":
        d = dict(d)
        fmt = d.pop("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(
                f"fuzz program format {fmt} is not supported (this commfuse reads format {FORMAT})"
            )
        return cls(**d)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    def copy(self) -> "Program":
        return Program.from_json(copy.deepcopy(self.to_json()))


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


@dataclass
class Ctx:
    rank: int
    world_size: int
    pgs: dict[str, Any]  # role -> this rank's ProcessGroup
    group_rank: dict[str, int]
    group_size: dict[str, int]
    joint: bool


@dataclass(frozen=True)
class OpDef:
    fn: Callable[..., list]  # fn(ctx, op, *inputs) -> list of outputs
    collective: bool = False
    rank_dependent: bool = False
    inplace: bool = False  # mutates its first input (non-joint programs only)


def _unary(ctx, op, x):
    f = op["fn"]
    if f == "scale":
        return [x * op.get("c", 0.5)]
    return [
        {
            "relu": torch.relu,
            "gelu": F.gelu,
            "tanh": torch.tanh,
            "sigmoid": torch.sigmoid,
            "silu": F.silu,
            "neg": torch.neg,
            "abs": torch.abs,
        }[f](x)
    ]


def _binary(ctx, op, a, b):
    return [{"add": torch.add, "sub": torch.sub, "mul": torch.mul}[op["fn"]](a, b)]


def _matmul(ctx, op, x, w):
    return [x @ w]


def _linear(ctx, op, x, w, b):
    return [x @ w + b]


def _scores(ctx, op, q, k):
    return [(q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))]


def _layer_norm(ctx, op, x, *affine):
    w, b = affine if affine else (None, None)
    return [F.layer_norm(x, (x.shape[-1],), w, b)]


def _softmax(ctx, op, x):
    d = op["dim"]
    return [torch.log_softmax(x, d) if op.get("log") else torch.softmax(x, d)]


def _router_topk(ctx, op, x, wr):
    logits = x @ wr
    probs = torch.softmax(logits.float(), dim=-1).to(x.dtype)
    top_v, top_i = torch.topk(probs, op["k"], dim=-1)
    mask = torch.zeros_like(probs).scatter(-1, top_i, 1.0)
    gate = top_v.sum(dim=-1, keepdim=True)
    return [x * gate, probs * mask]


def _reduce(ctx, op, x):
    f, d = op["fn"], op["dim"]
    if f == "amax":
        return [x.amax(dim=d, keepdim=True)]
    return [getattr(x, f)(dim=d, keepdim=True)]


def _contract_rows(ctx, op, a, b):
    # a^T b over every dim but the last (a weight gradient's contraction over the local tokens),
    # scaled by 1/16 (the largest local batch) so the sums stay small
    return [(a.reshape(-1, a.shape[-1]).transpose(0, 1) @ b.reshape(-1, b.shape[-1])) * 0.0625]


def _transpose(ctx, op, x):
    return [x.transpose(*op["dims"])]


def _permute(ctx, op, x):
    return [x.permute(*op["perm"])]


def _split_dim(ctx, op, x):
    d, f = op["dim"], op["factor"]
    s = list(x.shape)
    return [x.reshape(*s[:d], f, s[d] // f, *s[d + 1 :])]


def _merge_dims(ctx, op, x):
    d = op["dim"]
    s = list(x.shape)
    return [x.reshape(*s[:d], s[d] * s[d + 1], *s[d + 2 :])]


def _contiguous(ctx, op, x):
    return [x.contiguous()]


def _cat(ctx, op, a, b):
    return [torch.cat([a, b], dim=op["dim"])]


def _row_perm(x):
    # the rows reversed: a fixed permutation of dim 0 (as a dropless MoE's sort by expert is) that
    # needs no data and is valid for every rank's row count, an uneven all_to_all's included
    return torch.arange(x.shape[0] - 1, -1, -1, device=x.device)


def _gather_rows(ctx, op, x):
    # a row gather (aten.index on dim 0): the received tokens regrouped by expert
    return [x[_row_perm(x)]]


def _scatter_rows(ctx, op, x):
    # the inverse of gather_rows: rows put back into a fresh buffer (aten.index_put into
    # new_zeros), as a dropless MoE unsorts its expert outputs before the combine
    return [torch.index_put(x.new_zeros(x.shape), (_row_perm(x),), x)]


def _moe_layer(ctx, op, x, router_w, w1, w3, w2):
    # commfuse's expert-parallel MoE layer as a model calls it (MoELayer.forward): tokens are
    # every leading dim flattened; the EP group is the op's "group" ("ep": false -> no EP, all
    # experts local). Outputs: out (x's shape) and the router statistics per token (the op's
    # sums divided by the token count, as RouterStats turns them into losses: O(1) values, so
    # the fuzz loss's sin() weighting does not amplify the rounding of large sums).

    name = ctx.pgs[op["group"]].group_name if op.get("ep", True) else ""
    tokens = x.reshape(-1, x.shape[-1])
    out, probs_sum, top1, z = moe_layer(
        tokens, router_w, w1, w3, w2, op["top_k"], float(op["capacity_factor"]), op["token_groups"], name
    )
    t = tokens.shape[0]
    return [out.view(x.shape), probs_sum / t, top1 / t, z / t]


def _take_shard(ctx, op, x):
    # DTensor's Replicate -> Shard(d): this rank's chunk of a full value, no communication
    n, g, d = ctx.group_size[op["group"]], ctx.group_rank[op["group"]], op["dim"]
    return [torch.split(x, x.shape[d] // n, d)[g]]


def _moe_aux_loss(ctx, op, probs_mean, top1_frac, z_mean):
    # Switch load-balancing loss + ST-MoE z-loss from the per-token statistics (RouterStats)
    return [probs_mean.shape[0] * (top1_frac * probs_mean).sum() + 1e-3 * z_mean]


def _mutate(ctx, op, a, b):
    # in-place update of an existing value (e.g. an optimizer step on a parameter)
    if op["fn"] == "add_":
        a.add_(b)
    else:
        a.mul_(b)
    return [a]


# -- collectives ---------------------------------------------------------------------
class _AllReduce(torch.autograd.Function):
    """all_reduce(sum/avg) with its SPMD adjoint (the same all_reduce of the gradient)."""

    @staticmethod
    def forward(ctx, x, op, pg):
        ctx.op, ctx.pg = op, pg
        return funcol.all_reduce(x, op, pg)

    @staticmethod
    def backward(ctx, gy):
        return funcol.all_reduce(gy, ctx.op, ctx.pg), None, None


def _pg(ctx, op):
    return ctx.pgs[op["group"]]


def _nograd(ctx, *xs):
    return [x.detach() for x in xs] if ctx.joint else list(xs)


def _all_reduce(ctx, op, x):
    red, pg = op["reduce"], _pg(ctx, op)
    if ctx.joint and red in ("sum", "avg"):
        return [_AllReduce.apply(x, red, pg)]
    (x,) = _nograd(ctx, x)
    return [funcol.all_reduce(x, red, pg)]


def _all_gather(ctx, op, x):
    pg = _pg(ctx, op)
    if ctx.joint:
        return [funcol.all_gather_single_autograd(x, op["dim"], pg)]
    return [funcol.all_gather_single(x, op["dim"], pg)]


def _reduce_scatter(ctx, op, x):
    pg = _pg(ctx, op)
    if ctx.joint and op["reduce"] == "sum":  # the autograd variant only differentiates 'sum'
        return [funcol.reduce_scatter_single_autograd(x, op["reduce"], op["dim"], pg)]
    (x,) = _nograd(ctx, x)
    return [funcol.reduce_scatter_single(x, op["reduce"], op["dim"], pg)]


def _all_to_all(ctx, op, x):
    # DTensor's Shard(s) -> Shard(c): split dim s into n pieces stacked on dim 0, a dim-0
    # all_to_all, then the received pieces concatenated on dim c.
    pg, n = _pg(ctx, op), ctx.group_size[op["group"]]
    s, c = op["split_dim"], op["concat_dim"]
    a2a = funcol.all_to_all_single_autograd if ctx.joint else funcol.all_to_all_single
    inp = x if s == 0 else torch.cat(torch.chunk(x, n, dim=s), dim=0)
    out = a2a(inp.contiguous(), None, None, pg)
    if c != 0:
        out = torch.cat(torch.chunk(out, n, dim=0), dim=c)
    return [out]


def _all_to_all_uneven(ctx, op, x):
    # MoE dispatch (or, with "inverse", combine): group rank g sends splits[g][j] rows to j.
    pg, g = _pg(ctx, op), ctx.group_rank[op["group"]]
    S = op["splits"]
    send, recv = list(S[g]), [row[g] for row in S]
    if op.get("inverse"):
        send, recv = recv, send
    a2a = funcol.all_to_all_single_autograd if ctx.joint else funcol.all_to_all_single
    return [a2a(x.contiguous(), recv, send, pg)]


def _broadcast(ctx, op, x):
    (x,) = _nograd(ctx, x)
    return [funcol.broadcast(x, op["src"], _pg(ctx, op))]


def _all_reduce_coalesced(ctx, op, *xs):
    return list(funcol.all_reduce_coalesced(_nograd(ctx, *xs), op["reduce"], _pg(ctx, op)))


def _all_gather_coalesced(ctx, op, *xs):
    return list(funcol.all_gather_single_coalesced(_nograd(ctx, *xs), _pg(ctx, op)))


def _reduce_scatter_coalesced(ctx, op, *xs):
    return list(
        funcol.reduce_scatter_single_coalesced(_nograd(ctx, *xs), op["reduce"], [0] * len(xs), _pg(ctx, op))
    )


def _all_reduce_inplace(ctx, op, x):
    # "read_buffer": later ops read the buffer itself (after the wait), as code written with
    # in-place collectives does, instead of the wait's result
    (x,) = _nograd(ctx, x)
    buf = x.clone()
    r = _W(c10d.all_reduce_.default(buf, op["reduce"], _pg(ctx, op).group_name))
    return [buf if op.get("read_buffer") else r]


def _all_reduce_coalesced_inplace(ctx, op, *xs):
    bufs = [x.clone() for x in _nograd(ctx, *xs)]
    outs = c10d.all_reduce_coalesced_.default(bufs, op["reduce"], _pg(ctx, op).group_name)
    outs = [_W(o) for o in outs]
    return bufs if op.get("read_buffer") else outs


def _broadcast_inplace(ctx, op, x):
    (x,) = _nograd(ctx, x)
    buf = x.clone()
    r = _W(c10d.broadcast_.default(buf, op["src"], _pg(ctx, op).group_name))
    return [buf if op.get("read_buffer") else r]


def _p2p(ctx, op, x):
    # ring shift inside the group: send to group rank g+shift, receive from g-shift (peers are group ranks)
    (x,) = _nograd(ctx, x)
    pg, g, n = _pg(ctx, op), ctx.group_rank[op["group"]], ctx.group_size[op["group"]]
    dst, src, name = (g + op["shift"]) % n, (g - op["shift"]) % n, pg.group_name
    x = x.contiguous()
    if op.get("batch"):
        outs = c10d.batch_p2p_ops.default(
            ["isend", "irecv"], [dst, src], [0, 0], [x, torch.empty_like(x)], name
        )
        _W(outs[0])
        return [_W(outs[1])]
    s = c10d.isend.default(x, dst, 0, name)
    r = c10d.irecv.default(torch.empty_like(x), src, 0, name)
    _W(s)
    return [_W(r)]


# -- commfuse's boundary ops (commfuse.ops.boundary) ------------------------------------
def _m2ms(ctx, op, x):
    # many-to-many scatter from op["src"] to op["dst"] (group ranks of the op's group) along
    # op["dim"] with the piece matrix op["splits"]: this rank's input is the first (its row
    # sum) slices of x along dim; what it receives is zero-padded to op["pad"] (the largest
    # column sum), so the value has one shape on every rank. Joint programs call the
    # differentiable wrapper (commfuse::m2ms_autograd when x needs a gradient).

    pg, g, n = _pg(ctx, op), ctx.group_rank[op["group"]], ctx.group_size[op["group"]]
    d, S, src, dst = op["dim"], op["splits"], op["src"], op["dst"]
    inp = x.narrow(d, 0, sum(S[src.index(g)]) if g in src else 0)
    if ctx.joint:
        y = m2ms(inp, d, S, src, dst, pg)
    else:
        y = _W(M2MS(inp, d, [s for row in S for s in row], src, dst, n, pg.group_name))
    if y.shape[d] < op["pad"]:
        shape = list(y.shape)
        shape[d] = op["pad"] - y.shape[d]
        y = torch.cat([y, y.new_zeros(shape)], dim=d)
    return [y]


def _stage_transfer(ctx, op, x):
    # point-to-point stage transfer src[i] -> dst[i] (group ranks); zeros on non-destinations

    pg, n = _pg(ctx, op), ctx.group_size[op["group"]]
    if ctx.joint:
        return [stage_transfer(x, op["src"], op["dst"], pg)]
    return [_W(STAGE_TRANSFER(x, op["src"], op["dst"], n, pg.group_name))]


OPS: dict[str, OpDef] = {
    "unary": OpDef(_unary),
    "binary": OpDef(_binary),
    "matmul": OpDef(_matmul),
    "linear": OpDef(_linear),
    "scores": OpDef(_scores),
    "layer_norm": OpDef(_layer_norm),
    "softmax": OpDef(_softmax),
    "router_topk": OpDef(_router_topk),
    "reduce": OpDef(_reduce),
    "contract_rows": OpDef(_contract_rows),
    "transpose": OpDef(_transpose),
    "permute": OpDef(_permute),
    "split_dim": OpDef(_split_dim),
    "merge_dims": OpDef(_merge_dims),
    "contiguous": OpDef(_contiguous),
    "cat": OpDef(_cat),
    "gather_rows": OpDef(_gather_rows),
    "scatter_rows": OpDef(_scatter_rows),
    "mutate": OpDef(_mutate, inplace=True),
    "moe_layer": OpDef(_moe_layer),  # communicates inside (synchronously), not a functional collective
    "moe_aux_loss": OpDef(_moe_aux_loss),
    "take_shard": OpDef(_take_shard, rank_dependent=True),
    "all_reduce": OpDef(_all_reduce, collective=True),
    "all_gather": OpDef(_all_gather, collective=True),
    "reduce_scatter": OpDef(_reduce_scatter, collective=True),
    "all_to_all": OpDef(_all_to_all, collective=True),
    "all_to_all_uneven": OpDef(_all_to_all_uneven, collective=True, rank_dependent=True),
    "broadcast": OpDef(_broadcast, collective=True),
    "all_reduce_coalesced": OpDef(_all_reduce_coalesced, collective=True),
    "all_gather_coalesced": OpDef(_all_gather_coalesced, collective=True),
    "reduce_scatter_coalesced": OpDef(_reduce_scatter_coalesced, collective=True),
    "all_reduce_inplace": OpDef(_all_reduce_inplace, collective=True),
    "all_reduce_coalesced_inplace": OpDef(_all_reduce_coalesced_inplace, collective=True),
    "broadcast_inplace": OpDef(_broadcast_inplace, collective=True),
    "p2p": OpDef(_p2p, collective=True, rank_dependent=True),
    # input sizes along dim differ per rank (its row of the piece matrix): one graph per rank
    "m2ms": OpDef(_m2ms, collective=True, rank_dependent=True),
    "stage_transfer": OpDef(_stage_transfer, collective=True),
}


# ---------------------------------------------------------------------------
# Running / tracing
# ---------------------------------------------------------------------------


def _loss_terms(outs: list[torch.Tensor]) -> torch.Tensor | None:
    terms = [
        (o.float() * torch.sin(o.float()).detach()).sum()
        for o in outs
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    return sum(terms) if terms else None


MICROBATCH_PHASE = (
    "commfuse_fuzz_phase"  # meta["custom"] key of a micro-batch's backward, moved by trace_rank
)


def build_callable(program: Program, ctx: Ctx) -> Callable[..., list]:
    """The program as a Python function of its inputs (for one rank: ``ctx``)."""
    names = [i["name"] for i in program.inputs]

    def body(*args) -> list:
        env: dict[str, Any] = dict(zip(names, args, strict=True))
        for op in program.ops:
            outs = OPS[op["op"]].fn(ctx, op, *[env[v] for v in op["in"]])
            if len(outs) != len(op["out"]):
                raise ValueError(f"op {op['op']} produced {len(outs)} values for outputs {op['out']}")
            env.update(zip(op["out"], outs, strict=True))
        return [env[v] for v in program.outputs]

    def fn(*args):
        outs = body(*args)
        if not program.joint:
            return outs
        loss = _loss_terms(outs)
        if loss is None:
            return outs
        params = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return outs + [g for g in grads if g is not None]

    def microbatched(*args):
        from torch.fx.traceback import annotate

        params = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        all_outs: list = []
        total: list = [None] * len(params)
        for k in range(program.microbatches):
            with annotate({MICROBATCH_META_KEY: k}):
                xs = [
                    a * (1.0 + 0.25 * k) if isinstance(a, torch.Tensor) and a.requires_grad else a
                    for a in args
                ]
                outs = body(*xs)
                loss = _loss_terms(outs)
            all_outs.extend(outs)
            if loss is None:
                continue
            with annotate({MICROBATCH_META_KEY: k, MICROBATCH_PHASE: "backward"}):
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            total = [
                g if t is None else (t if g is None else t + g) for t, g in zip(total, grads, strict=True)
            ]
        return all_outs + [g for g in total if g is not None]

    return microbatched if program.joint and program.microbatches > 1 else fn


def make_inputs(program: Program, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s input values: deterministic in (program seed, rank, input index)."""
    out = []
    for idx, spec in enumerate(program.inputs):
        data_rank = 0 if program.tp_contract else rank
        g = torch.Generator().manual_seed((program.seed * 1_000_003 + data_rank * 7_919 + idx) % (2**63))
        shape = spec["shape"]
        if "rows" in spec:  # this rank's local batch (uneven_batch)
            shape = [spec["rows"][rank], *shape[1:]]
        t = torch.randn(*shape, generator=g)
        if spec.get("replicated"):  # the same on every rank (e.g. a router weight)
            g = torch.Generator().manual_seed((program.seed * 1_000_003 + idx) % (2**63))
            t = torch.randn(*shape, generator=g)
        init = spec.get("init", "act")
        if init == "weight":
            t = t / math.sqrt(shape[0])
        elif init in ("router", "expert"):  # router [E, H], expert weights [E_local, in, out]
            t = t / math.sqrt(shape[-1] if init == "router" else shape[-2])
        elif init == "ln_weight":
            t = 1.0 + 0.1 * t
        elif init == "bias":
            t = 0.1 * t
        out.append(t.to(program.torch_dtype))
    return out


def create_groups(program: Program, rank: int) -> tuple[Ctx, dict[str, list[int]]]:
    """Create the program's process groups (every rank creates every block, in one fixed order).

    The role ``"world"`` is the default group; every block of every other role is a
    ``new_group`` of its own, with the block's order as the group-rank order
    (``sort_ranks=False`` for a block not in increasing order), so two roles with the same
    blocks are groups of the same ranks under two names, and a block in another order is
    another group (``group_pairs``).
    Returns the rank's Ctx and name -> ranks of every group this rank belongs to."""
    pgs, grank, gsize, names = {}, {}, {}, {}
    world = list(range(program.world_size))
    for role in sorted(program.groups):
        for block in program.groups[role]:
            if role == "world" and list(block) == world:
                pg = dist.group.WORLD
            elif list(block) == sorted(block):
                pg = dist.new_group(list(block))
            else:  # another group-rank order (group_pairs)
                pg = dist.new_group(list(block), sort_ranks=False)
            if rank in block:
                pgs[role], grank[role], gsize[role] = pg, list(block).index(rank), len(block)
                names[pg.group_name] = list(block)
    ctx = Ctx(
        rank=rank,
        world_size=program.world_size,
        pgs=pgs,
        group_rank=grank,
        group_size=gsize,
        joint=program.joint,
    )
    return ctx, names


@dataclass
class Traced:
    """Graphs of one program: one SPMD graph (traced on rank 0) or one per rank."""

    program: Program
    graphs: list  # GraphModules, one (SPMD) or world_size (per rank)
    groups: dict[str, Any]  # group name -> partition (SPMD) or block (per rank)
    inputs: list[list[torch.Tensor]]  # per rank

    @property
    def per_rank(self) -> bool:
        return len(self.graphs) > 1


def trace_rank(program: Program, rank: int, inputs: list[torch.Tensor]):
    """make_fx-trace ``program`` as ``rank``; must run inside ``fake_process_group``.

    Returns (GraphModule, group name -> ranks of the groups this rank belongs to)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta

    ctx, names = create_groups(program, rank)
    args = []
    for t in inputs:
        t = t.clone()
        if program.joint and t.is_floating_point():
            t.requires_grad_(True)
        args.append(t)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # invalid candidates of the shrinker would log every meta failure
    try:
        # micro-batch tags ride on node meta (torch.fx.traceback.annotate): only those traces pay
        # for preserving it
        batched = program.joint and program.microbatches > 1
        with warnings.catch_warnings(), preserve_node_meta() if batched else contextlib.nullcontext():
            warnings.simplefilter("ignore")
            gm = make_fx(build_callable(program, ctx), tracing_mode="fake")(*args)
    finally:
        fake_log.setLevel(level)
    if program.joint and program.microbatches > 1:
        _tag_phases(gm)
    return gm, names


def _tag_phases(gm) -> None:
    """Phase tags of a fused train-step graph: a micro-batch's backward nodes (tagged at trace
    time) and everything computed from them (the accumulation) are "backward", the rest "forward"."""

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        custom = n.meta.get("custom") or {}
        back = custom.get(MICROBATCH_PHASE) == "backward" or any(
            a.meta.get(PHASE_META_KEY) == "backward" for a in n.all_input_nodes
        )
        n.meta[PHASE_META_KEY] = "backward" if back else "forward"


def value_shapes(program: Program) -> dict[str, tuple]:
    """Shapes of every value on rank 0, computed on meta tensors without a process group.

    Collectives are modelled by their shape effect only. Used by the shrinker to find a
    same-shaped replacement for a removed op's outputs."""
    shapes: dict[str, tuple] = {i["name"]: tuple(i["shape"]) for i in program.inputs}
    for op in program.ops:
        try:
            outs = _shape_rule(program, op, [shapes[v] for v in op["in"]])
        except Exception:  # noqa: BLE001 - unknown shape: the shrinker then drops dependents instead
            return shapes
        shapes.update(zip(op["out"], outs, strict=True))
    return shapes


def _shape_rule(program: Program, op: dict, ins: list[tuple]) -> list[tuple]:
    name = op["op"]
    if name in (
        "all_reduce",
        "broadcast",
        "all_reduce_inplace",
        "broadcast_inplace",
        "p2p",
        "all_reduce_coalesced",
        "all_reduce_coalesced_inplace",
    ):
        return list(ins)
    n = len(program.groups[op["group"]][0]) if "group" in op else 1
    if name == "all_gather":
        s = list(ins[0])
        s[op["dim"]] *= n
        return [tuple(s)]
    if name == "reduce_scatter":
        s = list(ins[0])
        s[op["dim"]] //= n
        return [tuple(s)]
    if name == "all_gather_coalesced":
        return [(s[0] * n, *s[1:]) for s in ins]
    if name == "reduce_scatter_coalesced":
        return [(s[0] // n, *s[1:]) for s in ins]
    if name == "all_to_all":
        s = list(ins[0])
        s[op["split_dim"]] //= n
        s[op["concat_dim"]] *= n
        return [tuple(s)]
    if name == "m2ms":
        S, src, dst, d = op["splits"], op["src"], op["dst"], op["dim"]
        if (
            len(S) != len(src)
            or any(len(r) != len(dst) for r in S)
            or any(v < 0 for r in S for v in r)
            or any(not 0 <= g < n for g in (*src, *dst))
            or len(set(src)) != len(src)
            or len(set(dst)) != len(dst)
        ):
            raise ValueError(f"m2ms: inconsistent src {src} / dst {dst} / splits {S} for a group of {n}")
        s = list(ins[0])
        if not -len(s) <= d < len(s) or max(sum(r) for r in S) > s[d]:
            raise ValueError(f"m2ms: rows {S} do not fit dim {d} of {ins[0]}")
        cols = max(sum(r[j] for r in S) for j in range(len(dst)))
        if op["pad"] < cols:
            raise ValueError(f"m2ms: pad {op['pad']} below the largest column sum {cols}")
        s[d] = op["pad"]
        return [tuple(s)]
    if name == "stage_transfer":
        src, dst = op["src"], op["dst"]
        if (
            len(src) != len(dst)
            or len(set(src)) != len(src)
            or len(set(dst)) != len(dst)
            or any(not 0 <= g < n for g in (*src, *dst))
        ):
            raise ValueError(f"stage_transfer: bad pairs {src} -> {dst} for a group of {n}")
        return list(ins)
    if name == "all_to_all_uneven":
        S = op["splits"]
        rows = sum(S[0]) if op.get("inverse") else sum(row[0] for row in S)
        return [(rows, *ins[0][1:])]
    if name == "moe_layer":
        x, rw, w1, w3, w2 = ins
        e, h = rw
        local = e // n if op.get("ep", True) else e
        if (
            len(x) < 2
            or x[-1] != h
            or w1 != w3
            or w1[:2] != (local, h)
            or w2 != (local, w1[2], h)
            or (op.get("ep", True) and e % n)
            or not 1 <= op["top_k"] <= e
        ):
            raise ValueError(f"moe_layer: inconsistent shapes {ins} for a group of {n}")
        if op["capacity_factor"] > 0 and math.prod(x[:-1]) % op["token_groups"]:
            raise ValueError(
                f"moe_layer: {math.prod(x[:-1])} tokens do not split into {op['token_groups']} groups"
            )
        return [tuple(x), (e,), (e,), ()]
    if name == "moe_aux_loss":
        return [()]
    if name == "take_shard":
        s = list(ins[0])
        if s[op["dim"]] % n:
            raise ValueError(f"take_shard: dim {op['dim']} of {ins[0]} does not split over {n} ranks")
        s[op["dim"]] //= n
        return [tuple(s)]
    # compute ops: evaluate on meta tensors
    meta = [torch.empty(s, device="meta", dtype=program.torch_dtype) for s in ins]
    ctx = Ctx(rank=0, world_size=program.world_size, pgs={}, group_rank={}, group_size={}, joint=False)
    return [tuple(o.shape) for o in OPS[name].fn(ctx, op, *meta)]
