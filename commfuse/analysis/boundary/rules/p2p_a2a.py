"""Rule p2p_a2a: the stage transfer followed by a router, gating, dispatch and an all_to_all on
the receiving stage -> the router region on the sending stage + one m2ms (Chimera Table 3,
P2P + A2A, and the PP+EP case study: gating moved before the P2P).

Matches: a forward transfer ``z = T(y)`` and the first all_to_all (equal splits, known concat
dim) on the receiving stage group SB that depends on z, with M = the nodes after T that
depend on z but not on the all_to_all's result and may run anywhere (deterministic ATen ops):
the router, gating, capacity and dispatch.
Produces: M runs on stage A on y; values of stage B that M reads (the router weight after f)
are sent B -> A by stage_transfer (the parameter stays B's graph input, its gradient comes
back by the transfer's backward, so ownership and ``state_dict`` do not change); the dispatch
becomes ``M(dispatch buffer, 0, S[i][j] = rows/n)``
(:func:`~commfuse.analysis.boundary.templates.fused_a2a_transfer`: source i's slot block j
goes to B_j, what B_j's all_to_all received); of M's values that B still needs after the
all_to_all (the combine weights) B receives the cheapest set it can recompute them from (a
minimum vertex cut by bytes, e.g. the top-k values and slot indices instead of the dense
[T, E, C] combine tensor) and recomputes the rest.
Refuses: the transferred value reaches no all_to_all; the all_to_all fails the common checks
(:func:`~commfuse.analysis.boundary.matching._collective_ok`, on SB) or has unequal splits or
no known concat dim; the dispatch cannot move (a node between communicates, is random, mutates
or is not an ATen op); the transferred activation has other users on B (the transfer must
stay, so moving the router cannot pay); the graph's input names are unknown; the
all_to_all's input has other users; what B needs from the region is not a static,
non-bool tensor, or is the whole transferred activation; the region reads values depending on
inputs of stages other than B; it reads B's values and ``reverse_transfers`` is off; the
stages differ in size; the all_to_all's input is dynamic or its split dim is not divisible by
n.

Opt-in (``BoundaryFusionOptions(reverse_transfers=True)``): the values sent B -> A every
micro-batch share that channel with the backward's messages, which commfuse.pipeline's runner
orders correctly under GPipe only.

Notation (A, B, SA, SB, T, n, ``x_i``, ``chunk_i``, ``M(v, d, S)``): :mod:`commfuse.analysis.boundary`.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from commfuse.analysis.boundary.matching import Env, Match, Site, _collective_ok, _static, _uniform
from commfuse.analysis.boundary.splicing import splice_autograd
from commfuse.analysis.boundary.templates import fused_a2a_transfer
from commfuse.analysis.boundary.volume import OpBytes, RuleVolume, _nbytes, ring_bytes
from commfuse.ir import rewrite
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.ir.shapes import shape_of
from commfuse.ir.walk import descendants
from commfuse.ops import STAGE_TRANSFER_AUTOGRAD
from commfuse.pipeline.collectives import COPY_TO_GROUP, REDUCE_FROM_GROUP

K = CollectiveKind


def _ancestors(node: fx.Node) -> set:
    seen = {node}
    stack = [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _movable(n: fx.Node) -> Optional[str]:
    """Why ``n`` cannot run on another stage (None: it can: deterministic, no side effect)."""

    t = n.target
    if n.op != "call_function":
        return f"{n.name} is a {n.op}"
    if is_wait(t) or collective_spec(t) is not None or t in (COPY_TO_GROUP, REDUCE_FROM_GROUP):
        return f"{n.name} communicates"
    if t is operator.getitem:
        return None
    if not isinstance(t, torch._ops.OpOverload):
        return f"{n.name} calls {t}, not an ATen op"
    if torch.Tag.nondeterministic_seeded in t.tags:
        return f"{n.name} is random"
    if t._schema.is_mutable:
        return f"{n.name} mutates"
    return None


def _stable_toposort(gm: fx.GraphModule) -> None:
    """Reorder ``gm``'s nodes topologically, keeping the current order wherever it is already
    valid (a node moves down only as far as its inputs require)."""
    import heapq

    nodes = list(gm.graph.nodes)
    index = {n: k for k, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n.name) for n in nodes if pending[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        n = by_name[name]
        order.append(n)
        for u in n.users:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (index[u], u.name))
    assert len(order) == len(nodes), "boundary fusion: the graph has a cycle"
    if order == nodes:
        return
    anchor = None
    for n in order:
        if anchor is not None:
            anchor.append(n)
        anchor = n


def _transfer_template(v, src, dst, gsize, gname):
    return STAGE_TRANSFER_AUTOGRAD(v, src, dst, gsize, gname)


def _min_vertex_cut(nodes: list[fx.Node], cap: dict[fx.Node, int], source: fx.Node, sinks: set) -> set:
    """The cheapest set of ``nodes`` (vertex capacities ``cap``) separating ``source`` from the
    ``sinks`` (nodes with a use outside), along the graph's edges among ``nodes`` (Edmonds-Karp
    on the split-vertex graph; a few dozen nodes)."""
    inf = sum(cap.values()) + 1
    idx = {n: k for k, n in enumerate(nodes)}
    S, T = 2 * len(nodes), 2 * len(nodes) + 1
    residual: dict[int, dict[int, int]] = {}

    def edge(a: int, b: int, c: int) -> None:
        residual.setdefault(a, {})[b] = residual.get(a, {}).get(b, 0) + c
        residual.setdefault(b, {}).setdefault(a, 0)

    for n in nodes:
        k = idx[n]
        edge(2 * k, 2 * k + 1, cap[n])  # in -> out: the node's bytes
        for u in n.users:
            if u in idx:
                edge(2 * k + 1, 2 * idx[u], inf)
        if n in sinks:
            edge(2 * k + 1, T, inf)
    edge(S, 2 * idx[source], inf)
    while True:  # augmenting paths
        prev = {S: None}
        queue = [S]
        while queue and T not in prev:
            a = queue.pop(0)
            for b, c in residual.get(a, {}).items():
                if c > 0 and b not in prev:
                    prev[b] = a
                    queue.append(b)
        if T not in prev:
            break
        path, b = [], T
        while prev[b] is not None:
            path.append((prev[b], b))
            b = prev[b]
        f = min(residual[a][b] for a, b in path)
        for a, b in path:
            residual[a][b] -= f
            residual[b][a] += f
    reach = set(prev)
    return {n for n in nodes if 2 * idx[n] in reach and 2 * idx[n] + 1 not in reach}


def match_p2p_a2a(site: Site, env: Env) -> Match | str:
    """P2P + router + A2A -> router on the sending stage + M2MS (Chimera's PP+EP case study).

    M = the nodes after the transfer that depend on the transferred value z, not on the
    dispatch all_to_all's result, and may run anywhere (deterministic ATen ops): the router,
    gating, capacity and dispatch. M runs on stage A on the value before the transfer; values
    of stage B that M reads (the router weight after f) are sent B -> A by stage_transfer (the
    parameter stays B's graph input, its gradient comes back by the transfer's backward); of
    M's values that B still needs after the all_to_all (the combine weights) B receives the
    cheapest set it can recompute them from (a minimum vertex cut by bytes, e.g. the top-k
    weights and slot indices instead of the dense [T, E, C] combine tensor) and recomputes
    the rest; the dispatch becomes one m2ms (source i's slot block j goes to B_j, what B_j's
    all_to_all received)."""
    t, bd = site.node, site.boundary
    y = t.args[0]
    cone = descendants(t)
    cands = [c for c in env.ir.collectives if c.kind is K.ALL_TO_ALL and c.logical_input in cone]
    if not cands:
        return "the transferred value reaches no all_to_all"
    c = cands[0]
    why = _collective_ok(c, bd.b.group, bd.b.size)
    if why:
        return why
    if not c.extra.get("equal_splits", False) or c.logical_concat_dim is None:
        return f"{c.name} has unequal splits or no known concat dim"
    after = descendants(c.start)
    a2a_nodes = {c.start, *c.layout_nodes}
    movable: list[fx.Node] = []  # M, graph order
    mset: set = set()
    why_not: dict[fx.Node, str] = {}
    for n in env.gm.graph.nodes:
        if n is t or n not in cone or n in after:
            continue
        w = _movable(n)
        if w is None and all(a is t or a in mset or a not in cone for a in n.all_input_nodes):
            movable.append(n)
            mset.add(n)
        elif w is not None:
            why_not[n] = w
    if c.logical_input not in mset:
        w = next(iter(why_not.values()), "it depends on values computed after the all_to_all")
        return f"the dispatch before {c.name} cannot move to stage {bd.a.stage}: {w}"
    others = [u for u in t.users if u not in mset]
    if others:
        users = ", ".join(u.name for u in others)
        return (
            f"the transferred activation has other users on stage {bd.b.stage} ({users}, e.g. a residual): the "
            "stage transfer must stay, so moving the router cannot pay"
        )
    if env.input_stage is None:
        return "the graph's input names are unknown (needed to tell which values belong to which stage)"
    if any(u not in a2a_nodes for u in c.logical_input.users):
        return f"the all_to_all's input {c.logical_input.name} has other users"
    # what B needs from M after the all_to_all: the cheapest cut (bytes) that lets it recompute them
    sinks = {
        n
        for n in movable
        if n is not c.logical_input and any(u not in mset and u not in a2a_nodes for u in n.users)
    }
    big = 1 << 62

    def cap(n: fx.Node) -> int:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or not _static(n) or v.dtype == torch.bool:
            return big  # tuples, dynamic shapes, bool (no gloo p2p): never sent
        return _nbytes(n)

    nodes = [t, *movable]
    caps = {n: cap(n) for n in nodes}
    caps[t] = _nbytes(t)
    cut = _min_vertex_cut(nodes, caps, t, sinks) if sinks else set()
    if any(caps[n] >= big for n in cut):
        return "what stage B needs from the router region cannot be sent (not a static tensor)"
    if t in cut:
        return (
            f"stage {bd.b.stage} needs the whole transferred activation after the all_to_all: the stage transfer "
            "must stay"
        )
    send = [n for n in movable if n in cut]
    # A runs every node of M that the dispatch or a sent value needs
    need = set()
    for root in [c.logical_input, *send]:
        need |= {a for a in _ancestors(root) if a in mset}
    on_a = [n for n in movable if n in need]
    b_inputs: list[fx.Node] = []
    for n in on_a:
        for a in n.all_input_nodes:
            if a is t or a in mset or a in b_inputs:
                continue
            stages = {env.input_stage.get(p) for p in _ancestors(a) if p.op == "placeholder"}
            if not stages:
                continue  # a constant: the partition copies it into every stage that reads it
            if stages != {bd.b.stage}:
                return f"{a.name}, read by the router region, depends on inputs of stages {sorted(stages, key=str)}"
            b_inputs.append(a)
    if b_inputs and not env.options.reverse_transfers:
        return (
            f"moving the router sends {', '.join(a.name for a in b_inputs)} from stage {bd.b.stage} to stage "
            f"{bd.a.stage} every micro-batch (and the gradient back): forward and backward messages then share "
            f"the stage {bd.b.stage} -> {bd.a.stage} channel, which commfuse.pipeline's runner orders correctly "
            "under GPipe only (1F1B interleaves them differently on the two ends); allow it with "
            "BoundaryFusionOptions(reverse_transfers=True) when the pipeline runs GPipe"
        )
    if bd.a.size != bd.b.size:
        return f"stages of {bd.a.size} and {bd.b.size} ranks"
    x, s, cdim, n = c.logical_input, c.logical_dim, c.logical_concat_dim, bd.a.size
    if not _static(x) or shape_of(x)[s] % n:
        return f"{c.name}'s input is dynamic or its split dim is not divisible by {n}"
    splits = _uniform(n, n, shape_of(x)[s] // n)
    vol = RuleVolume(
        (
            OpBytes("stage_transfer", bd.a.stage, _nbytes(y)),
            OpBytes("all_to_all", bd.b.stage, ring_bytes("all_to_all", n, _nbytes(x))),
        ),
        (
            OpBytes("m2ms", bd.a.stage, _nbytes(x)),
            *[OpBytes("stage_transfer", bd.b.stage, _nbytes(a)) for a in b_inputs],
            *[OpBytes("stage_transfer", bd.a.stage, _nbytes(e)) for e in send],
        ),
    )
    fwd_pairs = (list(bd.a.boundary_ranks), list(bd.b.boundary_ranks), bd.group_size, bd.group)
    back_pairs = (list(bd.b.boundary_ranks), list(bd.a.boundary_ranks), bd.group_size, bd.group)

    def apply() -> None:
        gm, pos = env.gm, env.bmap.position
        order = {nd: k for k, nd in enumerate(gm.graph.nodes)}
        at = min([c.start, *c.layout_nodes], key=order.__getitem__)
        mapping: dict[fx.Node, fx.Node] = {t: y}
        for a in b_inputs:  # B's values the region reads, sent to A (their gradients come back)
            mapping[a] = splice_autograd(
                gm, _transfer_template, [a], consts=back_pairs, before=at, position=pos, meta_from=t
            )
        for nd in on_a:  # the region, on A
            with gm.graph.inserting_before(at):
                new = gm.graph.node_copy(nd, lambda arg: mapping.get(arg, arg))
            new.meta.update(nd.meta)
            mapping[nd] = new
        out = splice_autograd(
            gm,
            fused_a2a_transfer,
            [mapping[x]],
            before=at,
            position=pos,
            meta_from=t,
            consts=(s, cdim, n, splits, *fwd_pairs),
        )
        c.logical_output.replace_all_uses_with(out)
        for e in send:  # B recomputes what it needs from these
            te = splice_autograd(
                gm, _transfer_template, [mapping[e]], consts=fwd_pairs, before=at, position=pos, meta_from=t
            )
            e.replace_all_uses_with(te, delete_user_cb=lambda u: u is not te)  # noqa: B023 - called during the replace
        rewrite.erase_dead(gm, [c.logical_output])
        rewrite.erase_dead(gm, [nd for nd in reversed(movable) if not nd._erased] + [t])
        _stable_toposort(gm)  # B's recomputation (before the all_to_all in graph order) follows its inputs

    moved = f"; {len(b_inputs)} value(s) sent back, {len(send)} forward" if b_inputs or send else ""
    return Match(
        "p2p_a2a",
        site,
        apply,
        vol,
        f"{t.name} + {len(on_a)} router/dispatch nodes + {c.name} (all_to_all {s}->{cdim} on "
        f"{bd.b.group}) -> region on stage {bd.a.stage} + m2ms dim {s}{moved}",
    )


__all__ = ["match_p2p_a2a"]
