"""Boundary rules: Chimera's fusions of a pipeline stage transfer with its neighbouring collectives.

Each rule matches one ``commfuse::stage_transfer_autograd`` node T of a pipeline FORWARD graph
(:func:`commfuse.pipeline.trace_forward`: autograd-level ops, every stage traced by every rank
"as" its own position ``p``) together with the collective next to it, and replaces both by an
eager function traced with ``make_fx(pre_dispatch=True)`` under the graph's fake mode and
spliced in where T was (the rewrite.py discipline, at the autograd level: the backward is
derived afterwards by ``trace_joint``, so each fused op's backward is its autograd formula).

Notation: boundary ``b`` joins stage A (``n`` ranks, stage group ``SA``, position ``i`` = group
rank ``i`` of SA) and stage B (``n`` ranks, ``SB``); T sends the whole value of A's position
``i`` to B's position ``i`` (``src[i]``/``dst[i]`` are their ranks in the boundary group G).
``x_i`` is a value on A's position i; ``chunk_i(v, d)`` the i-th of n equal pieces of v along d;
``M(v, d, S)`` is ``commfuse::m2ms_autograd`` over G from ``src`` to ``dst`` with piece matrix S.

=========  ============================  ===============================================  ==========
rule       matches (A side -> B side)    replacement                                      Table 3
=========  ============================  ===============================================  ==========
ag_p2p     y = AG_d(x) on SA; T(y)       M(cat^d of n copies of x_i, d, S[i][j] = l)       A-G + P2P
p2p_ag     z = T(y); w = AG_d(z) on SB   M(cat^d of n copies of y_i, d, S[i][j] = l)       P2P + A-G
                                         (other users of z on B: chunk_p(w, d))
a2a_p2p    y = A2A_s->c(x) on SA; T(y)   v = M(x_i, s, S[i][j] = L/n); on B:               A2A + P2P
                                         y = cat_j^c chunk_j(v, s)
ar_p2p     y = g(h) (+ replicated        A: s_i = RS_d(h) (+ chunk_i(x, d)); M(s_i, d,     TP+PP (Table 2:
           residuals) on SA; T(y)        diagonal S); B: w = AG_d (own chunk keeps its     R-S + M2MS +
                                         gradient)                                         A-G)
p2p_a2a    z = T(y); router + gating +   the router/dispatch region on A; its B inputs     P2P + A2A
           dispatch on SB; A2A on SB     (router weight) sent B -> A; M(dispatch buffer,   (PP+EP case
                                         0, S[i][j] = rows/n); what B needs after the      study)
                                         A2A sent as a minimum cut (top-k values)
=========  ============================  ===============================================  ==========

Why each is the same program (values and gradients):

* ag_p2p: B_j receives, in src order, x_0..x_{n-1} = AG(x) (what every A rank sent). Backward:
  A_i receives the gradient of its piece from every B_j and the n copies' gradients are added:
  ``sum_j grad_w_j[chunk i]``, which is the all_gather's reduce_scatter of the gradients T
  brought back. ``l`` = x's size along d.
* p2p_ag: the same data movement seen from B (B_j receives z_0..z_{n-1} = AG(z)); a user of z
  on B_p other than the gather reads ``chunk_p(w)`` = z_p, bit for bit.
* a2a_p2p: B_p needs ``cat_i^c chunk_p(x_i, s)``; A_i's pieces along s are exactly
  ``chunk_j(x_i, s)`` for B_j, received in src order along s and re-laid along c locally.
* ar_p2p (Megatron TP on both stages): y = x + g(h) with g = all_reduce (backward identity) and
  x replicated over SA. A_i reduce-scatters h and adds its chunk of x; the diagonal m2ms sends
  chunk i to B_i; B all-gathers. Gradients: B's gather keeps only its own chunk's gradient
  (B_i's chunk goes back to A_i) and A's reduce_scatter all-gathers the chunks (its backward),
  so A_i gets ``cat_j grad_y_j[chunk j]``: the full gradient, equal to the unfused ``grad_y``
  because under the TP contract every B rank holds the same gradient of the received
  activation. The residual x gets that gradient through a zero-valued tie
  ``h + (x - x.detach())`` (value h, gradient to both) so one all_gather serves both; its
  forward value uses ``x.detach()``'s chunk. This needs the rank's position (the chunk) and
  the TP contract of stage B (declared: :class:`BoundaryFusionOptions.tp_stages`); the
  residual operands must be proven replicated over SA (:func:`replicated_values`).
* p2p_a2a: see :func:`match_p2p_a2a`; the router weight stays B's graph input (its gradient
  returns by the transfer's backward), so ownership and ``state_dict`` do not change. Opt-in
  (``reverse_transfers``): GPipe only under commfuse.pipeline's runner.

Every rule refuses (reason in the report) unless the groups are exactly the two stages of
the boundary, T pairs positions (``src``/``dst`` = the stages' ranks in position order), the
collective has one wait and static shapes and the intermediate values have no other users
(p2p_ag: other users allowed, served locally); kept only when the per-rank boundary bytes
(Chimera Table 1 conventions, :func:`rule_volume`) do not grow.

Source: Chimera (ISCA '25) §3.3 Table 3 (A-G + P2P, P2P + A-G, A2A + P2P, P2P + A2A -> M2MS),
Table 2 (TP+PP: R-S + M2MS + A-G, the Alpa cross-mesh resharding) and the PP+EP case study
(gating moved before the P2P); Megatron-LM's sequence-parallel region ops for the gradient
conventions (gather with split backward).
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.core.meta import LAYOUT_META_KEY
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.ir.shapes import shape_of, tensor_meta
from commfuse.ir.walk import descendants
from commfuse.ops import M2MS_AUTOGRAD, STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, parse_stage_transfer, trace_position
from commfuse.pipeline.collectives import COPY_TO_GROUP, REDUCE_FROM_GROUP, all_gather, reduce_scatter
from commfuse.pipeline.layout import BOUNDARY_PREFIX, STAGE_PREFIX, StageGroup

aten = torch.ops.aten
K = CollectiveKind

RULES = ("ag_p2p", "p2p_ag", "a2a_p2p", "ar_p2p", "p2p_a2a")

# ops that only re-view a value (replayed on the receiving side after a fused transfer)
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.flatten.using_ints}


# ------------------------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class StageSide:
    """One stage at a boundary: its group alias, size and its positions' ranks in the boundary group."""

    stage: int
    group: str
    size: int
    boundary_ranks: tuple[int, ...]  # boundary-group rank of position 0..size-1


@dataclass(frozen=True)
class Boundary:
    index: int
    group: str
    group_size: int
    a: StageSide  # sending stage (forward)
    b: StageSide  # receiving stage


@dataclass(frozen=True)
class BoundaryMap:
    """The pipeline's boundaries by boundary-group name, and this rank's position (None: unknown)."""

    boundaries: dict[str, Boundary]
    position: Optional[int]
    source: str  # "layout" | "graph"
    stage_groups: dict[str, int] = field(default_factory=dict)  # stage group name -> stage

    @classmethod
    def from_layout(cls, layout) -> "BoundaryMap":
        bds = {}
        for b, g in enumerate(layout.boundaries):
            src, dst = layout.boundary_pairs(b)
            sa, sb = layout.stages[b], layout.stages[b + 1]
            bds[g.name] = Boundary(b, g.name, g.size, StageSide(b, sa.name, sa.size, tuple(src)),
                                   StageSide(b + 1, sb.name, sb.size, tuple(dst)))
        return cls(bds, layout.position, "layout", {g.name: s for s, g in enumerate(layout.stages)})

    @classmethod
    def from_graph(cls, gm: fx.GraphModule) -> tuple["BoundaryMap", list[str]]:
        """The map a pipeline forward graph implies through commfuse.pipeline's aliases
        (``commfuse.pp.boundary<b>`` joins ``commfuse.pp.stage<b>`` and ``<b+1>``; a forward
        transfer pairs positions). Position unknown. Returns the map and notes on what did not fit."""

        notes: list[str] = []
        pairs: dict[str, set] = {}
        sizes: dict[str, int] = {}
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target is not STAGE_TRANSFER_AUTOGRAD:
                continue
            a = parse_stage_transfer(n)
            if not a.group_name.startswith(BOUNDARY_PREFIX) or not a.group_name[len(BOUNDARY_PREFIX):].isdigit():
                notes.append(f"{n.name}: group {a.group_name!r} is not a commfuse.pipeline boundary alias")
                continue
            pairs.setdefault(a.group_name, set()).add((a.src, a.dst))
            sizes[a.group_name] = a.group_size
        bds: dict[str, Boundary] = {}
        for name, found in pairs.items():
            if len(found) != 1:  # e.g. a router weight sent back by p2p_a2a: which way is forward?
                notes.append(f"{name}: transfers in more than one direction; without the pipeline layout "
                             f"(gm.meta[{LAYOUT_META_KEY!r}]) the stage order is unknown, boundary left alone")
                continue
            (src, dst), = found
            b = int(name[len(BOUNDARY_PREFIX):])
            if sizes[name] == len(src) + len(dst) and not set(src) & set(dst):
                bds[name] = Boundary(b, name, sizes[name], StageSide(b, f"{STAGE_PREFIX}{b}", len(src), src),
                                     StageSide(b + 1, f"{STAGE_PREFIX}{b + 1}", len(dst), dst))
        stage_groups = {s.group: s.stage for bd in bds.values() for s in (bd.a, bd.b)}
        return cls(bds, None, "graph", stage_groups), notes

    def stage_size(self, group: str) -> Optional[int]:
        for bd in self.boundaries.values():
            for s in (bd.a, bd.b):
                if s.group == group:
                    return s.size
        return None


@dataclass(frozen=True)
class BoundaryFusionOptions:
    """What the rules may assume beyond the graph.

    ``tp_stages``: stages that follow Megatron's tensor-parallel contract (activations and
    their gradients are the same on every rank of the stage): rule ar_p2p needs it of the
    receiving stage. ``replicated_inputs``: names of graph inputs (``InputSpec.name``, e.g.
    ``"x"``) that hold the same value on every rank of the stage owning them (TP input data).
    ``reverse_transfers``: allow rule p2p_a2a to send values of the receiving stage (the router
    weight) to the sending stage every micro-batch; their gradients come back in the backward.
    The channel from the receiving to the sending stage then carries forward and backward
    messages, which commfuse.pipeline's point-to-point matching (one tag per pair of ranks)
    keeps in order under GPipe but not under 1F1B (measured: gloo aborts on a size mismatch);
    docs/boundary-fusion.md says what the runner needs for 1F1B.
    ``rules``: the rules to try, in this order."""

    rules: tuple[str, ...] = RULES
    tp_stages: tuple[int, ...] = ()
    replicated_inputs: tuple[str, ...] = ()
    reverse_transfers: bool = False

    def __post_init__(self) -> None:
        bad = [r for r in self.rules if r not in RULES]
        if bad:
            raise ValueError(f"BoundaryFusionOptions.rules: unknown rules {bad}; known: {list(RULES)}")
        for s in self.tp_stages:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"BoundaryFusionOptions.tp_stages: stage indices are non-negative ints, got {s!r}")
        for s in self.replicated_inputs:
            if not isinstance(s, str):
                raise ValueError(f"BoundaryFusionOptions.replicated_inputs: input names are str, got {s!r}")


# ------------------------------------------------------------------------------------ volume
@dataclass(frozen=True)
class OpBytes:
    """One collective of a transition: who runs it and the bytes one of its ranks sends
    (Chimera Table 1's per-rank overhead: ring conventions, P2P/M2MS = bytes sent)."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all | stage_transfer | m2ms
    stage: int  # the stage whose ranks send
    bytes: int


@dataclass(frozen=True)
class RuleVolume:
    before: tuple[OpBytes, ...]
    after: tuple[OpBytes, ...]

    @property
    def bytes_before(self) -> int:
        return sum(o.bytes for o in self.before)

    @property
    def bytes_after(self) -> int:
        return sum(o.bytes for o in self.after)

    def to_json(self) -> dict:
        return {"before": [vars(o) for o in self.before], "after": [vars(o) for o in self.after],
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


def _nbytes(node: fx.Node) -> int:
    v = tensor_meta(node)
    return int(v.numel()) * v.dtype.itemsize


def ring_bytes(kind: str, n: int, in_bytes: int) -> int:
    """Table 1 per-rank bytes of a group collective over n ranks on an input of ``in_bytes``."""
    if kind == "all_gather":
        return (n - 1) * in_bytes  # (n-1)/n of the n*in output
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * in_bytes // n
    if kind == "all_reduce":
        return 2 * (n - 1) * in_bytes // n
    raise ValueError(kind)


# ------------------------------------------------------------------------------------ replication
def replicated_values(gm: fx.GraphModule, group: str, ir: CollectiveIR, bmap: BoundaryMap,
                      replicated_placeholders: set) -> set:
    """Values proven identical on every rank of stage group ``group``: outputs of all_reduce /
    all_gather / broadcast and of commfuse.pipeline's ``reduce_from_group`` / ``copy_to_group``
    (Megatron's g and f: f marks a value every member holds) on that group, declared graph
    inputs, transfers of a value replicated on the sending stage, and deterministic
    functions of those (no random or mutating op, no other collective)."""

    full = (K.ALL_REDUCE, K.ALL_GATHER, K.BROADCAST)
    rep: set = set()
    for c in ir.collectives:
        if c.kind in full and not c.coalesced and c.group.name == group:
            rep.update(c.waits)
            if c.logical_output is not None:
                rep.add(c.logical_output)
    transfers_into: dict[fx.Node, tuple[str, str]] = {}  # transfer -> (sending, receiving stage group)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is STAGE_TRANSFER_AUTOGRAD:
            a = parse_stage_transfer(n)
            bd = bmap.boundaries.get(a.group_name)
            if bd is not None and a.src == bd.a.boundary_ranks and a.dst == bd.b.boundary_ranks:
                transfers_into[n] = (bd.a.group, bd.b.group)
    # a transfer of a value replicated on the sending stage is replicated on the receiving one
    # (positions pair up): the sending stage's own set decides
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n in replicated_placeholders:
                rep.add(n)
            continue
        if n.op == "get_attr":
            rep.add(n)
            continue
        if n.op != "call_function" or n in rep:
            continue
        t = n.target
        if t in (COPY_TO_GROUP, REDUCE_FROM_GROUP):
            if len(n.args) >= 3 and n.args[2] == group:
                rep.add(n)
            continue
        if n in transfers_into:
            src_group, dst_group = transfers_into[n]
            if dst_group == group and src_group != group:
                inner = replicated_values(gm, src_group, ir, bmap, replicated_placeholders)
                if n.args[0] in inner:
                    rep.add(n)
            continue
        if is_wait(t) or collective_spec(t) is not None:
            continue
        tags = getattr(t, "tags", ())
        schema = getattr(t, "_schema", None)
        if torch.Tag.nondeterministic_seeded in tags or (schema is not None and schema.is_mutable):
            continue
        if t is operator.getitem or isinstance(t, torch._ops.OpOverload):
            if all(a in rep for a in n.all_input_nodes):
                rep.add(n)
    return rep


# ------------------------------------------------------------------------------------ splicing
@contextmanager
def pipeline_trace_position(position: Optional[int]) -> Iterator[None]:
    """The tracing context of commfuse.pipeline's whole-model traces: boundary ops trace their
    input as ``src[position]`` and their output as ``dst[position]``."""

    with trace_position(None, position):
        yield


def m2ms_traceable_across_stages() -> Optional[str]:
    """None when an m2ms between two disjoint rank sets traces with sender-side input and
    receiver-side output shapes (what a whole-pipeline graph needs), else the reason."""
    def f(x):
        return M2MS_AUTOGRAD(x, 0, [1, 1, 1, 1], [0, 1], [2, 3], 4, "commfuse.boundary_fusion.probe")

    try:
        with pipeline_trace_position(0):
            gm = make_fx(f, tracing_mode="fake", pre_dispatch=True)(torch.empty(2, 3))
    except (ValueError, RuntimeError) as e:
        return f"commfuse::m2ms cannot be traced across pipeline stages by this build ({type(e).__name__}: {e})"
    out = [n for n in gm.graph.nodes if n.target is M2MS_AUTOGRAD][0].meta["val"]
    if tuple(out.shape) != (2, 3):
        return f"commfuse::m2ms traced across stages gives shape {tuple(out.shape)}, expected (2, 3)"
    return None


def splice_autograd(gm: fx.GraphModule, fn: Callable[..., Any], args: Sequence[fx.Node], *, consts: tuple,
                    before: fx.Node, position: Optional[int], meta_from: Optional[fx.Node] = None) -> Any:
    """Insert ``fn(*args, *consts)`` before ``before``, traced pre-dispatch (autograd-level ops
    stay as they are: the joint graph derives their backward) in the graph's fake mode, as
    the pipeline traces: floating inputs require grad so ``detach`` is recorded."""
    mode = rewrite.fake_mode_of(gm)
    vals = []
    for a in args:
        v = a.meta["val"]
        if v.is_floating_point():
            v = v.detach().requires_grad_(True)
        vals.append(v)

    def body(*t):
        return fn(*t, *consts)

    # Unknown position: every rule's pieces are the same size for every position (the rules that
    # read the position refuse without it), so position 0's shapes are every position's.
    with pipeline_trace_position(position if position is not None else 0):
        if mode is not None:
            with mode:
                vals = [v if isinstance(v, torch._subclasses.FakeTensor) else mode.from_tensor(v) for v in vals]
                tgm = make_fx(body, tracing_mode="real", pre_dispatch=True)(*vals)
        else:
            tgm = make_fx(body, tracing_mode="fake", pre_dispatch=True)(*vals)
    rewrite._drop_shape_asserts(tgm)
    placeholders = [n for n in tgm.graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, args))
    with gm.graph.inserting_before(before):
        out = gm.graph.graph_copy(tgm.graph, val_map)
    for tn in tgm.graph.nodes:
        n = val_map.get(tn)
        if n is None or tn.op == "placeholder":
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.requires_grad:  # graph values carry no autograd state
            n.meta["val"] = v.detach()
        if meta_from is not None:
            rewrite.inherit_meta(meta_from, n)
    return out


# ------------------------------------------------------------------------------------ templates
def _copies(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    return torch.cat([x] * n, d) if n > 1 else x


def fused_gather_transfer(x, d, n_dst, splits, src, dst, gsize, gname):
    """ag_p2p / p2p_ag: every source sends its value to every destination (received in src order)."""
    return M2MS_AUTOGRAD(_copies(x, n_dst, d), d, splits, src, dst, gsize, gname)


def fused_a2a_transfer(x, s, c, n, splits, src, dst, gsize, gname):
    """a2a_p2p: source i's chunk j along s goes to destination j; re-laid along c on B."""
    v = M2MS_AUTOGRAD(x, s, splits, src, dst, gsize, gname)
    return v if c == s else torch.cat(torch.chunk(v, n, s), c)


def fused_allreduce_transfer(h, *residuals, d, n, p, plan, splits, src, dst, gsize, gname, group_a, group_b):
    """ar_p2p: RS on A (+ this position's chunk of each replicated residual), the diagonal m2ms,
    an all_gather on B whose own chunk keeps its gradient (module docstring)."""

    tie = h
    for r in residuals:  # value h, gradient also to r: one all_gather serves both (docstring)
        tie = tie + (r - r.detach())
    s = reduce_scatter(tie, d, group_a)
    y = s
    for r, left in zip(residuals, plan):
        rc = r.detach()
        dd = d - (s.dim() - rc.dim())  # r's dim aligned with d under broadcasting
        if dd >= 0 and rc.shape[dd] == s.shape[d] * n:
            rc = rc.narrow(dd, p * s.shape[d], s.shape[d])
        y = rc + y if left else y + rc
    z = M2MS_AUTOGRAD(y, d, splits, src, dst, gsize, gname)
    w = all_gather(z.detach(), d, group_b)
    pieces = list(torch.chunk(w, n, d))
    pieces[p] = z  # B's own chunk, bit for bit the gathered one, carries the gradient
    return torch.cat(pieces, d)


# ------------------------------------------------------------------------------------ matching
@dataclass
class Site:
    """A forward transfer at a boundary, position-aligned."""

    node: fx.Node
    boundary: Boundary


@dataclass
class Match:
    rule: str
    site: Site
    apply: Callable[[], None]
    volume: RuleVolume
    description: str


class Env:
    """What the rules read: the graph, its IR, the boundary map, options and replication facts."""

    def __init__(self, gm: fx.GraphModule, bmap: BoundaryMap, options: BoundaryFusionOptions,
                 input_names: Optional[Sequence[str]] = None) -> None:
        self.gm, self.bmap, self.options = gm, bmap, options
        self.ir = CollectiveIR(gm)
        self._rep: dict[str, set] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # graph input -> the stage that owns it ("stage<s>.<name>" parameters/buffers, x: the first
        # stage, target: the last), when the program's input names are known
        self.input_stage: Optional[dict[fx.Node, int]] = None
        if input_names is not None:
            last = max((bd.b.stage for bd in bmap.boundaries.values()), default=0)
            self.input_stage = {}
            for n, name in zip(placeholders, input_names):
                head = name.split(".", 1)[0]
                if head.startswith("stage") and head[5:].isdigit():
                    self.input_stage[n] = int(head[5:])
                elif name == "x":
                    self.input_stage[n] = 0
                elif name == "target":
                    self.input_stage[n] = last
        self.replicated_placeholders = set()
        if input_names is not None and options.replicated_inputs:
            for n, name in zip(placeholders, input_names):
                if name in options.replicated_inputs:
                    self.replicated_placeholders.add(n)

    def refresh(self) -> None:
        self.ir = CollectiveIR(self.gm)
        self._rep.clear()

    def collective_producing(self, node: fx.Node) -> Optional[Collective]:
        for c in self.ir.collectives:
            if c.logical_output is node:
                return c
        return None

    def replicated(self, group: str) -> set:
        if group not in self._rep:
            self._rep[group] = replicated_values(self.gm, group, self.ir, self.bmap, self.replicated_placeholders)
        return self._rep[group]


def _view_chain_back(node: fx.Node, stop: Callable[[fx.Node], bool]) -> tuple[fx.Node, list[fx.Node]]:
    """Walk from ``node`` back through single-use view ops until ``stop``; returns the root
    and the views (root's user first)."""
    views: list[fx.Node] = []
    while not stop(node) and node.op == "call_function" and node.target in _VIEWS and len(node.users) == 1 \
            and isinstance(node.args[0], fx.Node):
        views.append(node)
        node = node.args[0]
    views.reverse()
    return node, views


def _replay_views(gm: fx.GraphModule, value: fx.Node, views: list[fx.Node], before: fx.Node) -> fx.Node:
    for v in views:
        with gm.graph.inserting_before(before):
            new = gm.graph.node_copy(v, lambda a, v=v: value if a is v.args[0] else a)
        new.meta.update({k: val for k, val in v.meta.items()})
        value = new
    return value


def _single_use_chain(chain: list[fx.Node], last_user: fx.Node) -> bool:
    for a, b in zip(chain, chain[1:] + [last_user]):
        if set(a.users) != {b}:
            return False
    return True


def _static(node: fx.Node) -> bool:
    s = shape_of(node)
    return s is not None and all(isinstance(v, int) for v in s)


def _collective_ok(c: Collective, group: str, size: int) -> Optional[str]:
    if c.group.name != group:
        return f"{c.name} runs on group {c.group.name!r}, not the stage group {group!r}"
    if c.group.size is not None and c.group.size != size:
        return f"{c.name}: group size {c.group.size} differs from the stage size {size}"
    if c.coalesced or c.inplace:
        return f"{c.name} is coalesced or in place"
    if len(c.waits) != 1:
        return f"{c.name} does not have exactly one wait"
    if c.logical_input is None or c.logical_output is None or c.logical_dim is None:
        return f"{c.name} has no single logical input/output/dim"
    if not (_static(c.logical_input) and _static(c.logical_output)):
        return f"{c.name} has dynamic shapes"
    return None


def _uniform(n_src: int, n_dst: int, size: int) -> list[int]:
    return [size] * (n_src * n_dst)


def _diag(n: int, size: int) -> list[int]:
    return [size if i == j else 0 for i in range(n) for j in range(n)]


def _erase_transfer(gm: fx.GraphModule, t: fx.Node, new_value: fx.Node) -> None:
    t.replace_all_uses_with(new_value)
    rewrite.erase_dead(gm, [t])


def _sent_collective(t: fx.Node, bd, env: Env, kind: K):
    """The collective of ``kind`` on the sending group whose result (through views) transfer ``t``
    sends: ``(collective, root, views)``, or the refusal reason."""
    root, views = _view_chain_back(t.args[0], lambda n: env.collective_producing(n) is not None)
    c = env.collective_producing(root)
    if c is None or c.kind is not kind:
        return f"the transferred value is not an {kind.value}'s result (through views)"
    why = _collective_ok(c, bd.a.group, bd.a.size)
    return why or (c, root, views)


# -- rule: ag_p2p ------------------------------------------------------------------------------
def match_ag_p2p(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    y = t.args[0]
    found = _sent_collective(t, bd, env, K.ALL_GATHER)
    if isinstance(found, str):
        return found
    c, root, views = found
    if not _single_use_chain([root, *views], t):
        return "the gathered value has other users on the sending stage (the all_gather must stay)"
    x, d, n = c.logical_input, c.logical_dim, bd.a.size
    l = shape_of(x)[d]
    splits = _uniform(n, bd.b.size, l)
    vol = RuleVolume(
        (OpBytes("all_gather", bd.a.stage, ring_bytes("all_gather", n, _nbytes(x))),
         OpBytes("stage_transfer", bd.a.stage, _nbytes(y))),
        (OpBytes("m2ms", bd.a.stage, bd.b.size * _nbytes(x)),))

    def apply() -> None:
        out = splice_autograd(env.gm, fused_gather_transfer, [x], before=t, position=env.bmap.position,
                              consts=(d, bd.b.size, splits, list(bd.a.boundary_ranks), list(bd.b.boundary_ranks),
                                      bd.group_size, bd.group), meta_from=t)
        _erase_transfer(env.gm, t, _replay_views(env.gm, out, views, t))

    return Match("ag_p2p", site, apply, vol,
                 f"{c.name} (all_gather dim {d} on {bd.a.group}) + {t.name} -> m2ms dim {d}")


# -- rule: p2p_ag ------------------------------------------------------------------------------
def match_p2p_ag(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    gathers = [c for c in env.ir.collectives if c.kind is K.ALL_GATHER and c.logical_input is t]
    if not gathers:
        return "the transferred value does not feed an all_gather on the receiving stage"
    c = gathers[0]
    why = _collective_ok(c, bd.b.group, bd.b.size)
    if why:
        return why
    own = {c.start, *c.layout_nodes}
    others = [u for u in t.users if u not in own]
    if others and env.bmap.position is None:
        return ("the transferred value has other users on the receiving stage and this rank's position is "
                "unknown (give the pipeline layout)")
    y, d, n = t.args[0], c.logical_dim, bd.b.size
    if shape_of(y) != shape_of(t) or not _static(y):
        return "the transfer's input and output shapes differ or are dynamic"
    l = shape_of(y)[d]
    splits = _uniform(bd.a.size, n, l)
    vol = RuleVolume(
        (OpBytes("stage_transfer", bd.a.stage, _nbytes(y)),
         OpBytes("all_gather", bd.b.stage, ring_bytes("all_gather", n, _nbytes(t)))),
        (OpBytes("m2ms", bd.a.stage, n * _nbytes(y)),))

    def apply() -> None:
        gm = env.gm
        out = splice_autograd(gm, fused_gather_transfer, [y], before=t, position=env.bmap.position,
                              consts=(d, n, splits, list(bd.a.boundary_ranks), list(bd.b.boundary_ranks),
                                      bd.group_size, bd.group), meta_from=t)
        gathered = c.logical_output
        gathered.replace_all_uses_with(out)
        if others:  # the own chunk of the gathered value is this position's transferred value
            p = env.bmap.position
            with gm.graph.inserting_after(out):
                own_chunk = gm.graph.call_function(aten.narrow.default, (out, d, p * l, l))
            own_chunk.meta["val"] = tensor_meta(t)
            for u in others:
                u.replace_input_with(t, own_chunk)
        rewrite.erase_dead(gm, [gathered])
        rewrite.erase_dead(gm, [t])

    extra = f" (other users read chunk {env.bmap.position} of it)" if others else ""
    return Match("p2p_ag", site, apply, vol,
                 f"{t.name} + {c.name} (all_gather dim {d} on {bd.b.group}) -> m2ms dim {d}{extra}")


# -- rule: a2a_p2p -----------------------------------------------------------------------------
def match_a2a_p2p(site: Site, env: Env) -> Match | str:
    t, bd = site.node, site.boundary
    y = t.args[0]
    found = _sent_collective(t, bd, env, K.ALL_TO_ALL)
    if isinstance(found, str):
        return found
    c, root, views = found
    if not c.extra.get("equal_splits", False) or c.logical_concat_dim is None:
        return f"{c.name} has unequal splits or no known concat dim"
    if not _single_use_chain([root, *views], t):
        return "the all_to_all's result has other users on the sending stage"
    if bd.a.size != bd.b.size:
        return f"stages of {bd.a.size} and {bd.b.size} ranks: the all_to_all's chunks do not map onto B's positions"
    x, s, cdim, n = c.logical_input, c.logical_dim, c.logical_concat_dim, bd.a.size
    L = shape_of(x)[s]
    if L % n:
        return f"split dim {s} of size {L} is not divisible by {n}"
    splits = _uniform(n, n, L // n)
    vol = RuleVolume(
        (OpBytes("all_to_all", bd.a.stage, ring_bytes("all_to_all", n, _nbytes(x))),
         OpBytes("stage_transfer", bd.a.stage, _nbytes(y))),
        (OpBytes("m2ms", bd.a.stage, _nbytes(x)),))

    def apply() -> None:
        out = splice_autograd(env.gm, fused_a2a_transfer, [x], before=t, position=env.bmap.position,
                              consts=(s, cdim, n, splits, list(bd.a.boundary_ranks), list(bd.b.boundary_ranks),
                                      bd.group_size, bd.group), meta_from=t)
        _erase_transfer(env.gm, t, _replay_views(env.gm, out, views, t))

    return Match("a2a_p2p", site, apply, vol,
                 f"{c.name} (all_to_all {s}->{cdim} on {bd.a.group}) + {t.name} -> m2ms dim {s}")


# -- rule: ar_p2p ------------------------------------------------------------------------------
def _scatter_dim(shape: Sequence[int], n: int) -> Optional[int]:
    """The lowest dim other than the last with a size n divides (else the last), as split_all_reduce."""
    dims = list(range(len(shape) - 1)) + [len(shape) - 1]
    for d in dims:
        if shape[d] > 0 and shape[d] % n == 0:
            return d
    return None


def match_ar_p2p(site: Site, env: Env) -> Match | str:

    t, bd = site.node, site.boundary
    y = t.args[0]
    # walk back through residual adds to g (reduce_from_group): y = (g + r1) + r2 ... in any operand order
    rep = env.replicated(bd.a.group)

    def walk(node):  # -> every (g, adds outermost first, residuals, residual-is-left flags)
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return []
        if node.target is REDUCE_FROM_GROUP:
            return [(node, [], [], [])]
        if node.target is not aten.add.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
            return []
        out = []
        for k in (0, 1):
            inner, other = node.args[k], node.args[1 - k]
            if isinstance(other, fx.Node) and other in rep:
                out += [(g, [node, *adds], [other, *res], [k == 1, *left]) for g, adds, res, left in walk(inner)]
        return out

    # the candidate whose reduced value feeds only the sum that reaches the transfer (the last g)
    candidates = walk(y)
    found = next((c for c in candidates if _single_use_chain([c[0], *reversed(c[1])], t)),
                 candidates[0] if candidates else None)
    if found is None:
        if isinstance(y, fx.Node) and y.target is aten.add.Tensor:
            return ("the transferred value is not g (reduce_from_group) plus residuals proven replicated over "
                    f"{bd.a.group} (declare TP inputs with replicated_inputs)")
        return "the transferred value is not a reduce_from_group (all_reduce) result"
    node, chain, residuals, plan = found
    g = node
    h, gsize, gname = g.args[0], g.args[1], g.args[2]
    if gname != bd.a.group or gsize != bd.a.size:
        return f"{g.name} reduces over {gname!r} (size {gsize}), not the sending stage {bd.a.group!r}"
    if bd.b.stage not in env.options.tp_stages:
        return (f"stage {bd.b.stage} is not declared tensor-parallel (BoundaryFusionOptions.tp_stages): the "
                "fused form needs every rank of it to hold the same gradient of the received activation")
    if env.bmap.position is None:
        return "this rank's position is unknown (give the pipeline layout)"
    chain.reverse()
    residuals.reverse()
    plan.reverse()
    if not _single_use_chain([g, *chain], t):
        return "the reduced value or a residual sum has other users on the sending stage"
    if bd.a.size != bd.b.size:
        return f"stages of {bd.a.size} and {bd.b.size} ranks (the diagonal m2ms pairs positions)"
    if not _static(y) or shape_of(h) != shape_of(y) or any(shape_of(r) is None for r in residuals):
        return "dynamic shapes, or the reduced value is broadcast by a residual"
    n = bd.a.size
    d = _scatter_dim(shape_of(y), n)
    if d is None:
        return f"no dim of {shape_of(y)} is divisible by the stage size {n}"
    l = shape_of(y)[d] // n
    splits = _diag(n, l)
    yb = _nbytes(y)
    vol = RuleVolume(
        (OpBytes("all_reduce", bd.a.stage, ring_bytes("all_reduce", n, _nbytes(h))),
         OpBytes("stage_transfer", bd.a.stage, yb)),
        (OpBytes("reduce_scatter", bd.a.stage, ring_bytes("reduce_scatter", n, _nbytes(h))),
         OpBytes("m2ms", bd.a.stage, yb // n),
         OpBytes("all_gather", bd.b.stage, ring_bytes("all_gather", n, yb // n))))
    ga = StageGroup(bd.a.group, n, tuple(range(n)))
    gb = StageGroup(bd.b.group, n, tuple(range(n)))

    def fn(h, *res):
        return fused_allreduce_transfer(h, *res, d=d, n=n, p=env.bmap.position, plan=tuple(plan), splits=splits,
                                        src=list(bd.a.boundary_ranks), dst=list(bd.b.boundary_ranks),
                                        gsize=bd.group_size, gname=bd.group, group_a=ga, group_b=gb)

    def apply() -> None:
        out = splice_autograd(env.gm, fn, [h, *residuals], before=t, position=env.bmap.position, consts=(),
                              meta_from=t)
        _erase_transfer(env.gm, t, out)

    res = f" + {len(residuals)} replicated residual(s)" if residuals else ""
    return Match("ar_p2p", site, apply, vol,
                 f"{g.name} (all_reduce on {bd.a.group}){res} + {t.name} -> reduce_scatter dim {d} + diagonal m2ms "
                 f"+ all_gather on {bd.b.group}")


# -- rule: p2p_a2a (PP+EP) ---------------------------------------------------------------------
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
    assert len(order) == len(nodes), "boundary_rules: the graph has a cycle"
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
        return (f"the transferred activation has other users on stage {bd.b.stage} ({users}, e.g. a residual): the "
                "stage transfer must stay, so moving the router cannot pay")
    if env.input_stage is None:
        return "the graph's input names are unknown (needed to tell which values belong to which stage)"
    if any(u not in a2a_nodes for u in c.logical_input.users):
        return f"the all_to_all's input {c.logical_input.name} has other users"
    # what B needs from M after the all_to_all: the cheapest cut (bytes) that lets it recompute them
    sinks = {n for n in movable if n is not c.logical_input and any(u not in mset and u not in a2a_nodes
                                                                     for u in n.users)}
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
        return (f"stage {bd.b.stage} needs the whole transferred activation after the all_to_all: the stage transfer "
                "must stay")
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
        return (f"moving the router sends {', '.join(a.name for a in b_inputs)} from stage {bd.b.stage} to stage "
                f"{bd.a.stage} every micro-batch (and the gradient back): forward and backward messages then share "
                f"the stage {bd.b.stage} -> {bd.a.stage} channel, which commfuse.pipeline's runner orders correctly "
                "under GPipe only (1F1B interleaves them differently on the two ends); allow it with "
                "BoundaryFusionOptions(reverse_transfers=True) when the pipeline runs GPipe")
    if bd.a.size != bd.b.size:
        return f"stages of {bd.a.size} and {bd.b.size} ranks"
    x, s, cdim, n = c.logical_input, c.logical_dim, c.logical_concat_dim, bd.a.size
    if not _static(x) or shape_of(x)[s] % n:
        return f"{c.name}'s input is dynamic or its split dim is not divisible by {n}"
    splits = _uniform(n, n, shape_of(x)[s] // n)
    vol = RuleVolume(
        (OpBytes("stage_transfer", bd.a.stage, _nbytes(y)),
         OpBytes("all_to_all", bd.b.stage, ring_bytes("all_to_all", n, _nbytes(x)))),
        (OpBytes("m2ms", bd.a.stage, _nbytes(x)),
         *[OpBytes("stage_transfer", bd.b.stage, _nbytes(a)) for a in b_inputs],
         *[OpBytes("stage_transfer", bd.a.stage, _nbytes(e)) for e in send]))
    fwd_pairs = (list(bd.a.boundary_ranks), list(bd.b.boundary_ranks), bd.group_size, bd.group)
    back_pairs = (list(bd.b.boundary_ranks), list(bd.a.boundary_ranks), bd.group_size, bd.group)

    def apply() -> None:
        gm, pos = env.gm, env.bmap.position
        order = {nd: k for k, nd in enumerate(gm.graph.nodes)}
        at = min([c.start, *c.layout_nodes], key=order.__getitem__)
        mapping: dict[fx.Node, fx.Node] = {t: y}
        for a in b_inputs:  # B's values the region reads, sent to A (their gradients come back)
            mapping[a] = splice_autograd(gm, _transfer_template, [a], consts=back_pairs, before=at, position=pos,
                                         meta_from=t)
        for nd in on_a:  # the region, on A
            with gm.graph.inserting_before(at):
                new = gm.graph.node_copy(nd, lambda arg: mapping.get(arg, arg))
            new.meta.update(nd.meta)
            mapping[nd] = new
        out = splice_autograd(gm, fused_a2a_transfer, [mapping[x]], before=at, position=pos, meta_from=t,
                              consts=(s, cdim, n, splits, *fwd_pairs))
        c.logical_output.replace_all_uses_with(out)
        for e in send:  # B recomputes what it needs from these
            te = splice_autograd(gm, _transfer_template, [mapping[e]], consts=fwd_pairs, before=at, position=pos,
                                 meta_from=t)
            e.replace_all_uses_with(te, delete_user_cb=lambda u: u is not te)
        rewrite.erase_dead(gm, [c.logical_output])
        rewrite.erase_dead(gm, [nd for nd in reversed(movable) if not nd._erased] + [t])
        _stable_toposort(gm)  # B's recomputation (before the all_to_all in graph order) follows its inputs

    moved = f"; {len(b_inputs)} value(s) sent back, {len(send)} forward" if b_inputs or send else ""
    return Match("p2p_a2a", site, apply, vol,
                 f"{t.name} + {len(on_a)} router/dispatch nodes + {c.name} (all_to_all {s}->{cdim} on "
                 f"{bd.b.group}) -> region on stage {bd.a.stage} + m2ms dim {s}{moved}")


MATCHERS: dict[str, Callable[[Site, Env], "Match | str"]] = {
    "ag_p2p": match_ag_p2p, "p2p_ag": match_p2p_ag, "a2a_p2p": match_a2a_p2p, "ar_p2p": match_ar_p2p,
    "p2p_a2a": match_p2p_a2a,
}


def sites(gm: fx.GraphModule, bmap: BoundaryMap) -> tuple[list[Site], list[str]]:
    """Forward transfers that pair a boundary's positions; notes for the others."""
    out: list[Site] = []
    notes: list[str] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (STAGE_TRANSFER_AUTOGRAD, STAGE_TRANSFER):
            continue
        if n.target is STAGE_TRANSFER:
            notes.append(f"{n.name}: the asynchronous stage_transfer (a joint graph?) is left alone: boundary "
                         "fusion rewrites the forward graph of commfuse.pipeline")
            continue
        a = parse_stage_transfer(n)
        bd = bmap.boundaries.get(a.group_name)
        if bd is None:
            notes.append(f"{n.name}: group {a.group_name!r} is not a boundary of the pipeline")
        elif a.src == bd.b.boundary_ranks and a.dst == bd.a.boundary_ranks:
            notes.append(f"{n.name}: a transfer from stage {bd.b.stage} back to stage {bd.a.stage} is left alone")
        elif a.src != bd.a.boundary_ranks or a.dst != bd.b.boundary_ranks:
            notes.append(f"{n.name}: pairs {list(a.src)} -> {list(a.dst)} do not pair the positions of stages "
                         f"{bd.a.stage} and {bd.b.stage} ({list(bd.a.boundary_ranks)} -> {list(bd.b.boundary_ranks)})")
        else:
            out.append(Site(n, bd))
    return out, notes


__all__ = ["Boundary", "BoundaryFusionOptions", "BoundaryMap", "Env", "MATCHERS", "Match", "OpBytes", "RULES",
           "RuleVolume", "Site", "StageSide", "m2ms_traceable_across_stages",
           "pipeline_trace_position", "replicated_values", "ring_bytes", "sites", "splice_autograd"]
