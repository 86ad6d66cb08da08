"""MoE regions recognised by what they compute, whatever the spelling.

The templates (:mod:`.templates`) explain a region op by op and so know two spellings.
Here a region is checked against the meaning of ``commfuse::moe_layer`` instead: run on
probe values for every rank of its group, does it give the op's output?

Contract
- Matches: a router -- ``topk`` over the softmax of float32 logits ``linear(x, W)`` or
  ``x @ W.T`` (tokens ``x [T, H]``, router weight ``W [E, H]``) -- and the first value
  ``y`` after it with the tokens' size and dtype for which the rest holds. The region is
  the backward slice of ``y`` down to ``x``, ``W`` and the expert weights (every other
  graph input it reaches: stacked ``[E/N, ., .]`` -- a fused gate/up ``[E/N, 2F, H]``
  included -- or one 2-D weight per expert and SwiGLU role), with the in-place updates
  of its own buffers.
- Proves: on three seeded probes (random tokens; every token the same row, so that any
  capacity below the token count drops; tokens drawn from three rows), run for the ``N`` ranks of the region's one process group by the
  reference interpreter (:mod:`commfuse.reference`), every rank's ``y`` equals
  ``commfuse::moe_layer`` 's output (single-process, all ``E`` experts, as
  :mod:`commfuse.ops.moe_layer.semantics` defines the op) for one assignment of the
  expert weights to the SwiGLU roles, one capacity (dropless first, then the sizes
  the region's shapes hold) and one number of token groups. Probe values depend on
  the graph only: every rank decides the same.
- Refuses, with the reason: sigmoid (or no softmax) scores, logits not in float32, an
  unstable sort in the region (ties ordered by the implementation), graph inputs the
  region reads besides tokens and weights, collectives over several groups, shapes that
  are not static, a region larger than a compile-time probe should run, a collective of
  the region still needed outside it (e.g. an intermediate used by other code), and a
  region that computes something else on the probes.
- Guarantees of the rewrite (:mod:`commfuse.transforms.moe_recognition`): the region's
  uses of ``y`` read the op instead; values of the region that other code reads are kept
  (router statistics, counts); nothing else changes.

A probe is evidence, not a proof for all inputs: the checks above (stable sorts, one
group, float32 logits, static shapes) remove the known ways a region can agree on the
probes and differ elsewhere. Gradients: the op's backward is the exact gradient of its
forward; the region's is that of the user's forward through the same functional
collectives, so equal forwards give equal gradients.

Source: Chimera (ISCA '25) §3.2 (the MoE dispatch as one region with known semantics);
GShard (Lepikhin et al. 2020, §2.2) for the capacity rule.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx

from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.ir.walk import descendants
from commfuse.moe.patterns import Call, op_name, static_shape, value
from commfuse.ops.moe_layer.op import moe_forward
from commfuse.ops.moe_layer.routing import capacity_factor_for
from commfuse.reference.interpreter import ReferenceInterpreter

# Beyond this many multiply-adds a probe costs more than a compile should spend.
PROBE_MACS_LIMIT = 2e9
# Candidate combined outputs tried per router (an expert loop's partial sums come first).
_MAX_OUTPUTS = 256
_SCORE_OPS = ("softmax", "float", "to", "type", "contiguous")
_LAYOUT_OPS = ("t", "transpose", "float", "to", "type", "contiguous", "permute")
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}
_SORTS = ("sort", "argsort")


@dataclass(frozen=True)
class Router:
    topk: fx.Node
    logits: fx.Node
    x: fx.Node  # the tokens as the logits read them, [T, H]
    weight: fx.Node  # graph input holding the router weight
    weight_transposed: bool  # stored [H, E]
    num_experts: int
    hidden: int
    top_k: int


@dataclass(frozen=True)
class WeightRecipe:
    """How one SwiGLU role ``[E/N, in, out]`` is built from graph inputs."""

    leaves: tuple[fx.Node, ...]  # one stacked leaf, or one 2-D leaf per local expert
    transpose: bool
    half: Optional[tuple[int, int]] = None  # (dim, which half) of a fused gate/up leaf

    def build(self, get: Callable[[fx.Node], Any], call: Callable[..., Any]) -> Any:
        def one(leaf: Any) -> Any:
            if self.half is not None:
                dim, which = self.half
                size = static_shape(self.leaves[0])[dim] // 2
                index = [slice(None)] * 3
                index[dim] = slice(which * size, (which + 1) * size)
                leaf = call(operator.getitem, leaf, tuple(index))
            return call(torch.transpose, leaf, -2, -1) if self.transpose else leaf

        if len(self.leaves) == 1 and len(static_shape(self.leaves[0])) == 3:
            return one(get(self.leaves[0]))
        return call(torch.stack, [one(get(leaf)) for leaf in self.leaves])


@dataclass
class MeaningMatch:
    router: Router
    tokens: fx.Node  # the op's input (tokens before the router flattened them)
    out: fx.Node  # the region's combined output
    weights: tuple[WeightRecipe, WeightRecipe, WeightRecipe]  # w1 (gate), w3 (up), w2 (down)
    capacity: int
    capacity_factor: float
    token_groups: int
    group_name: str
    dead: list[fx.Node]  # nodes the rewrite erases, in graph order
    region: set[fx.Node] = field(default_factory=set)


class NotMoE(Exception):
    """The region is not (provably) ``commfuse::moe_layer``; the message says why. ``depth``:
    how far the check got (the report names the candidate that came closest)."""

    def __init__(self, why: str, depth: int = 0) -> None:
        super().__init__(why)
        self.depth = depth


# ------------------------------------------------------------------ routers
def _back(n: Any, names: tuple[str, ...]) -> tuple[Any, list[str]]:
    seen = []
    while isinstance(n, fx.Node) and op_name(n) in names:
        seen.append(op_name(n))
        n = Call(n).input
    return n, seen


def _leaf(n: Any) -> tuple[Optional[fx.Node], bool]:
    """The graph input behind ``n`` (through casts and transposes) and whether it is transposed."""
    transposed = False
    while isinstance(n, fx.Node) and op_name(n) in _LAYOUT_OPS:
        if op_name(n) in ("t", "transpose", "permute"):
            transposed = not transposed
        n = Call(n).input
    if isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr"):
        return n, transposed
    return None, transposed


def routers(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, Optional[fx.Node], Router | str]]:
    """Every ``topk`` over router-like scores (a softmax or sigmoid): ``(topk, logits, router)``
    with its :class:`Router`, or why ``commfuse::moe_layer`` cannot be that router."""
    for n in gm.graph.nodes:
        if op_name(n) != "topk":
            continue
        c = Call(n)
        k = c.arg(1, "k", None)
        scores, passed = _back(c.input, _SCORE_OPS)
        if isinstance(scores, fx.Node) and op_name(scores) == "sigmoid":
            logits, _ = _back(Call(scores).input, _SCORE_OPS)
            yield (
                n,
                logits if isinstance(logits, fx.Node) else None,
                "router scores are a sigmoid; commfuse::moe_layer routes by softmax",
            )
            continue
        if "softmax" not in passed:
            continue  # a top-k of something else
        logits = scores
        lc = Call(logits) if isinstance(logits, fx.Node) else None
        if lc is None or lc.name not in ("linear", "matmul", "mm"):
            yield n, lc and logits, "the router logits are not one linear/matmul of the tokens"
            continue
        yield n, logits, _router(n, c, lc, k)


def _router(topk: fx.Node, c: Call, lc: Call, k: Any) -> Router | str:
    logits = lc.node
    x, w = lc.input, lc.arg(1, "weight", None)
    weight, transposed = _leaf(w)
    if lc.name != "linear":
        transposed = not transposed  # x @ W.T reads W [E, H] transposed
    e = (static_shape(logits) or (None,))[-1]
    xs = static_shape(x)
    if weight is None or e is None or not xs or not isinstance(k, int):
        return "router weight, token shape or k are not static graph facts"
    h = xs[-1]
    if static_shape(weight) != ((h, e) if transposed else (e, h)):
        return f"router weight {weight.name} has shape {list(static_shape(weight) or [])}, not [E, H]"
    if value(logits).dtype != torch.float32 or value(x).dtype != torch.float32:
        return (
            f"router logits computed in {value(x).dtype}; commfuse::moe_layer computes them in torch.float32"
        )
    dim = c.arg(2, "dim", -1)
    if dim not in (-1, len(static_shape(c.input)) - 1):
        return f"top-k over dim {dim}, not the experts"
    return Router(topk, logits, x, weight, transposed, e, h, k)


# ------------------------------------------------------------------ the region
def _mutates(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("_")
    if n.op == "call_function":
        if n.target in _INPLACE_OPERATORS:
            return True
        name = getattr(n.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_") and name not in ("sym_sum_",)
    return False


def backward_slice(out: fx.Node, stop: fx.Node) -> set[fx.Node]:
    """Nodes ``out`` is computed from, down to ``stop`` and the graph inputs, with the in-place
    updates (before ``out``) of every buffer on the way."""
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    seen: set[fx.Node] = set()
    todo = [out]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is stop:
            continue
        todo.extend(n.all_input_nodes)
        todo.extend(u for u in n.users if _mutates(u) and u.args and u.args[0] is n and order[u] < order[out])
    return seen


def _overload(target: Any) -> Any:
    """Dynamo records functional collectives as op packets; the tables know their overloads."""
    return target.default if isinstance(target, torch._ops.OpOverloadPacket) else target


def _communicates(n: fx.Node) -> bool:
    t = _overload(n.target)
    return n.op == "call_function" and (collective_spec(t) is not None or is_wait(t))


def _group(nodes: set[fx.Node]) -> tuple[str, int]:
    names = set()
    for n in nodes:
        spec = collective_spec(_overload(n.target)) if n.op == "call_function" else None
        if spec is not None:
            names.add(spec.parse(tuple(n.args), dict(n.kwargs)).group_name)
    if not names:
        return "", 1
    if len(names) > 1:
        raise NotMoE(f"collectives over several groups {sorted(names)}")
    (name,) = names
    from torch.distributed.distributed_c10d import _resolve_process_group

    return name, _resolve_process_group(name).size()


# ------------------------------------------------------------------ expert weights
def weight_assignments(leaves: list[fx.Node], h: int, local: int) -> Iterator[tuple[WeightRecipe, ...]]:
    """Candidate ``(w1, w3, w2)`` recipes from the expert leaves (graph order of first use)."""
    shapes = [static_shape(leaf) for leaf in leaves]
    if any(s is None for s in shapes):
        return
    if all(len(s) == 3 and s[0] == local for s in shapes):
        mats = [s[1:] for s in shapes]
        ffns = {d for m in mats for d in m if d != h} or {h}
        for f in sorted(ffns):
            if len(leaves) == 3:
                for gate, up, down in itertools.permutations(range(3)):
                    for tg, tu, td in _orient(mats[gate], mats[up], mats[down], h, f):
                        yield (
                            WeightRecipe((leaves[gate],), tg),
                            WeightRecipe((leaves[up],), tu),
                            WeightRecipe((leaves[down],), td),
                        )
            elif len(leaves) == 2:
                for fused, down in ((0, 1), (1, 0)):
                    m = mats[fused]
                    for dim, transpose in ((2, False), (1, True)):
                        if m[dim - 1] != 2 * f or m[2 - dim] != h:
                            continue
                        for td in _options(mats[down], "FH", h, f):
                            for first in (0, 1):
                                yield (
                                    WeightRecipe((leaves[fused],), transpose, (dim, first)),
                                    WeightRecipe((leaves[fused],), transpose, (dim, 1 - first)),
                                    WeightRecipe((leaves[down],), td),
                                )
        return
    if all(len(s) == 2 for s in shapes) and len(leaves) == 3 * local:
        per_expert = [leaves[3 * i : 3 * i + 3] for i in range(local)]
        first = [static_shape(leaf) for leaf in per_expert[0]]
        if any([static_shape(leaf) for leaf in group] != first for group in per_expert):
            return
        ffns = {d for s in first for d in s if d != h} or {h}
        for f in sorted(ffns):
            for gate, up, down in itertools.permutations(range(3)):
                for tg, tu, td in _orient(first[gate], first[up], first[down], h, f):
                    yield (
                        WeightRecipe(tuple(g[gate] for g in per_expert), tg),
                        WeightRecipe(tuple(g[up] for g in per_expert), tu),
                        WeightRecipe(tuple(g[down] for g in per_expert), td),
                    )


def _orient(gate: tuple, up: tuple, down: tuple, h: int, f: int) -> Iterator[tuple[bool, bool, bool]]:
    for tg in _options(gate, "HF", h, f):
        for tu in _options(up, "HF", h, f):
            for td in _options(down, "FH", h, f):
                yield tg, tu, td


def _options(shape: tuple, role: str, h: int, f: int) -> list[bool]:
    opts = []
    if shape == ((h, f) if role == "HF" else (f, h)):
        opts.append(False)
    if shape == ((f, h) if role == "HF" else (h, f)):
        opts.append(True)
    return opts


# ------------------------------------------------------------------ probing
def _probe_graph(
    gm: fx.GraphModule, region: set[fx.Node], tokens: fx.Node, leaves: list[fx.Node], outs: list[fx.Node]
) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in [tokens, *leaves]:
        env[n] = g.placeholder(n.name)
        env[n].meta.update(n.meta)
    for n in gm.graph.nodes:
        if n in region and n not in env:
            env[n] = g.node_copy(n, lambda a: env[a])
            if n.op == "call_function":
                env[n].target = _overload(n.target)
    g.output(tuple(env[o] for o in outs))
    return fx.GraphModule(gm, g)


def _probe_inputs(
    tokens: fx.Node, router: Router, experts: list[fx.Node], ranks: int, seed: int, distinct_rows: int
) -> list[list[torch.Tensor]]:
    """Per rank: tokens, router weight (the same on every rank), this rank's expert weights.

    ``distinct_rows``: 0 for random tokens; else the tokens repeat that many rows, so that
    experts get up to every token (one row: any capacity below the token count drops)."""
    gen = torch.Generator().manual_seed(seed)
    shape, h = static_shape(tokens), router.hidden
    t = torch.Size(shape).numel() // h

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float32)

    rw = randn(router.num_experts, h) * (4.0 / h**0.5)
    rw = (rw.t() if router.weight_transposed else rw).contiguous().to(value(router.weight).dtype)
    inputs = []
    for _ in range(ranks):
        if distinct_rows:
            rows = randn(distinct_rows, h)
            x = rows[torch.randint(0, distinct_rows, (t,), generator=gen)]
        else:
            x = randn(t, h)
        ws = [randn(*static_shape(w)) * static_shape(w)[-1] ** -0.5 for w in experts]
        inputs.append(
            [
                x.reshape(shape).to(value(tokens).dtype),
                rw.clone(),
                *[w.to(value(e).dtype) for w, e in zip(ws, experts, strict=True)],
            ]
        )
    return inputs


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to summation order (the tolerance of the tokens' dtype)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 3e-2
    a, b = a.double(), b.double()
    scale = max(1.0, b.abs().max().item())
    return bool(((a - b).abs() <= tol * scale + tol * b.abs()).all())


def _capacities(region: set[fx.Node], t: int, k: int) -> list[int]:
    sizes = set()
    for n in region:
        for d in static_shape(n) or ():
            if 1 <= d <= t * k:
                sizes.add(d)
        if op_name(n) == "one_hot":
            c = Call(n).arg(1, "num_classes", None)
            if isinstance(c, int) and c >= 1:
                sizes.add(c)
    return [0, *sorted(sizes)]


def _token_groups(region: set[fx.Node], t: int) -> list[int]:
    groups = {d for n in region for d in (static_shape(n) or ())[:1] if 1 < d < t and t % d == 0}
    return [1, *sorted(groups)]


def _macs(router: Router, t: int, experts: list[fx.Node], ranks: int) -> float:
    params = sum(torch.Size(static_shape(w)).numel() for w in experts) * ranks
    return ranks * t * router.top_k * params / router.num_experts + t * router.hidden * router.num_experts


_TOKEN_PATH = ("float", "to", "type", "reshape", "view", "contiguous")


def source_tokens(x: fx.Node, hidden: int) -> fx.Node:
    """The tokens the router's input was cast or reshaped from (the op's input: it casts for
    the router and flattens itself)."""
    while op_name(x) in _TOKEN_PATH and isinstance(Call(x).input, fx.Node):
        src = static_shape(Call(x).input)
        if not src or src[-1] != hidden:
            break
        x = Call(x).input
    return x


def recognise(gm: fx.GraphModule, r: Router) -> MeaningMatch:
    """The region of router ``r`` and the op arguments that reproduce it, or :class:`NotMoE`."""
    tokens = source_tokens(r.x, r.hidden)
    shape = static_shape(tokens)
    if shape is None:
        raise NotMoE("the tokens' shape is not static")
    h, dtype = r.hidden, value(tokens).dtype
    numel = torch.Size(shape).numel()
    after = descendants(r.topk)
    outs = [
        n
        for n in gm.graph.nodes
        if n in after
        and n.op in ("call_function", "call_method")
        and isinstance(value(n), torch.Tensor)
        and value(n).dtype == dtype
        and static_shape(n) is not None
        and static_shape(n)[-1:] == (h,)
        and torch.Size(static_shape(n)).numel() == numel
    ][:_MAX_OUTPUTS]
    if not outs:
        raise NotMoE("no value after the top-k has the tokens' shape and dtype (no combined output)")
    closest: Optional[NotMoE] = None
    for out in outs:
        try:
            return _prove(gm, r, tokens, out)
        except NotMoE as e:
            why = e
        except Exception as e:  # noqa: BLE001 - a region the checks cannot read is not proven
            why = NotMoE(f"could not be checked ({type(e).__name__}: {str(e)[:160]})", 1)
        if closest is None or why.depth > closest.depth:
            closest = NotMoE(f"{out.name}: {why}", why.depth)
    raise closest


def _first_use(n: fx.Node, order: dict) -> int:
    return min((order[u] for u in n.users), default=order[n])


def _prove(gm: fx.GraphModule, r: Router, tokens: fx.Node, out: fx.Node) -> MeaningMatch:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    region = backward_slice(out, tokens)
    leaves = [n for n in region if n.op in ("placeholder", "get_attr") and n is not tokens]
    if r.weight not in leaves:
        raise NotMoE("it does not depend on the router weight")
    experts = sorted((n for n in leaves if n is not r.weight), key=lambda n: _first_use(n, order))
    bad = [
        n.name for n in experts if not isinstance(value(n), torch.Tensor) or not value(n).is_floating_point()
    ]
    if bad:
        raise NotMoE(f"reads graph inputs besides tokens and weights: {', '.join(bad)}")
    unstable = sorted(
        n.name for n in region if op_name(n) in _SORTS and not Call(n).kwargs.get("stable", False)
    )
    if unstable:
        raise NotMoE(f"unstable sort {', '.join(unstable)}: the order of ties is the implementation's")
    group, ranks = _group(region)
    if r.num_experts % ranks:
        raise NotMoE(f"{r.num_experts} experts do not split over {ranks} ranks")
    local = r.num_experts // ranks
    h = r.hidden
    t = torch.Size(static_shape(tokens)).numel() // h
    recipes = list(weight_assignments(experts, h, local))
    if not recipes:
        shapes = ", ".join(f"{n.name} {list(static_shape(n) or [])}" for n in experts)
        raise NotMoE(
            f"expert weights not recognised as SwiGLU gate/up/down of {local} local experts: {shapes}", 1
        )
    if _macs(r, t, experts, ranks) > PROBE_MACS_LIMIT:
        raise NotMoE(f"too large to probe at compile time (over {PROBE_MACS_LIMIT:.0e} multiply-adds)", 2)
    names = [r.weight, *experts]
    interp = ReferenceInterpreter(
        _probe_graph(gm, region, tokens, names, [out]), ranks, {group: list(range(ranks))} if group else None
    )
    probes = []
    for seed, distinct_rows in ((20261127, 0), (20261128, 1), (20261129, 3)):
        inputs = _probe_inputs(tokens, r, experts, ranks, seed, distinct_rows)
        try:
            got = interp.run(inputs)
        except Exception as e:  # noqa: BLE001 - a region that cannot run on probes is not proven
            raise NotMoE(f"does not run on probe values ({type(e).__name__}: {str(e)[:160]})", 2) from e
        probes.append((inputs, [g[0].reshape(t, h) for g in got]))

    def reproduces(recipe: tuple[WeightRecipe, ...], cf: float, groups: int) -> bool:
        for inputs, got in probes:
            local_weights = [[_build(w, inp, names) for w in recipe] for inp in inputs]
            full = [torch.cat([lw[i] for lw in local_weights]) for i in range(3)]
            for inp, y in zip(inputs, got, strict=True):
                router_w = inp[1].t() if r.weight_transposed else inp[1]
                want = moe_forward(inp[0].reshape(t, h), router_w, *full, r.top_k, cf, groups, "")[0]
                if not _close(y, want):
                    return False
        return True

    for recipe, cap, groups in _candidates(recipes, region, t, r.top_k):
        cf = capacity_factor_for(cap, r.top_k, t // groups, r.num_experts) if cap else 0.0
        if cf is None or not reproduces(recipe, cf, groups):
            continue
        dead = _dead_after_rewrite(out, region, leaves, tokens)
        kept = sorted(n.name for n in region - set(dead) if _communicates(n))
        if kept:
            raise NotMoE(
                f"collectives {', '.join(kept)} are still needed outside the region (an intermediate "
                "value is read by other code)",
                3,
            )
        return MeaningMatch(r, tokens, out, recipe, cap, cf, groups, group, dead, region)
    raise NotMoE(
        "computes something other than commfuse::moe_layer on the probes (no assignment of the "
        "expert weights, capacity and token groups reproduces it)",
        2,
    )


def _candidates(recipes, region, t, k) -> Iterator[tuple[tuple[WeightRecipe, ...], int, int]]:
    for recipe in recipes:
        for cap in _capacities(region, t, k):
            for groups in [1] if cap == 0 else _token_groups(region, t):
                yield recipe, cap, groups


def _build(recipe: WeightRecipe, inputs: list[torch.Tensor], names: list[fx.Node]) -> torch.Tensor:
    by_node = dict(zip(names, inputs[1:], strict=True))
    return recipe.build(by_node.__getitem__, lambda f, *a: f(*a))


def _dead_after_rewrite(
    out: fx.Node, region: set[fx.Node], leaves: list[fx.Node], x: fx.Node
) -> list[fx.Node]:
    """Region nodes nothing reads once ``out`` 's users read the op: the rewrite erases them,
    with what is computed from the region alone and read by nothing else (the runtime asserts
    Dynamo records on the region's symbols)."""
    inner = set(region) - set(leaves) - {x}
    graph_order = list(out.graph.nodes)
    derived: set[fx.Node] = set()
    for n in graph_order:
        if (
            n not in inner
            and n.op in ("call_function", "call_method")
            and n.all_input_nodes
            and all(a in inner or a in derived for a in n.all_input_nodes)
        ):
            derived.add(n)
    dead = inner | derived
    changed = True
    while changed:
        changed = False
        for n in list(dead):
            users = [u for u in n.users if u not in dead and not (n is out and u not in region)]
            buffer = n.args[0] if _mutates(n) and n.args else None
            if users or (isinstance(buffer, fx.Node) and buffer not in dead):
                dead.discard(n)
                changed = True
    return [n for n in graph_order if n in dead]
