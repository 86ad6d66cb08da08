"""collective_motion: move all_gathers later through computation that works on shards.

Contract
- Matches: every functional all_gather ``G = all_gather_d(x)`` (not coalesced or in
  place, static shapes, its input never mutated) on a group of N ranks, and the
  compute downstream of ``G`` that :mod:`commfuse.analysis.shard_rules` can run on shards:
  element-wise ops (residual adds included), norms and softmax over dims other than
  ``d``, reductions (a ``sum`` over ``d`` leaves a partial sum), and views that keep
  ``d`` contiguous. Inputs without a sharded form must broadcast along the sharded
  dim (weights, per-row statistics), otherwise the op stays full.
- Does: computes that *region* on the local shards instead of the gathered values
  and gathers only where a full value is still needed: before the first op outside
  the region (a matmul, attention, a graph output) one ``all_gather`` of that value,
  and one ``all_reduce`` for a partial sum (e.g. a norm weight's gradient, whose rows
  the region now only sums locally). Gathers whose every user moved into the region
  disappear. On the joint graph this covers forward and backward at once: an
  all_reduce split by ``split_all_reduce`` becomes reduce_scatter -> norm/residual on
  the shard -> all_gather before the next matmul, i.e. plain TP becomes Megatron-style
  sequence parallelism, with the norm weight gradients all-reduced.
- Accepts a connected region only if it does not add bytes: the gathers it inserts
  must not exceed (in wire bytes) the gathers it removes, and its all_reduces of
  partial sums must stay under a quarter of that. Otherwise the region is left alone
  and reported.
- Guarantees: values equal to the unoptimised program up to floating-point summation
  order (partial sums are reduced across ranks instead of summed in one tensor);
  decisions depend only on the graph (same on every rank); no process group is
  created: new collectives use the seed's group.

Source: Chimera §3.2 (reordering computation so collectives become adjacent) and
Centauri §3.1.1 (substituting all_reduce by reduce_scatter + all_gather and running
the element-wise part between them on shards; dimension types, Table 3).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from commfuse.analysis.mesh_grid import find_grid
from commfuse.analysis.shard_layouts import Complete, Layout, LocalOp, RuleEnv, Sharded
from commfuse.analysis.shard_rules import local_rule, value_bytes
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import resolve_group_info
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.invariance import SIZE_FROM_ARGUMENTS, shares_the_batch

PARTIAL_BUDGET = 0.25  # partial-sum all_reduces may cost at most this share of the gathers removed
_VIEWLIKE = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.t.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
    torch.ops.aten.expand.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    operator.getitem,
}


@dataclass
class Seed:
    collective: Collective
    full: fx.Node  # the gathered value (after DTensor's shuffle)
    shard: fx.Node  # what each rank contributed
    dim: int


@dataclass
class RegionPlan:
    group: str
    n: int
    rank: Optional[int] = None  # this process's index in the group, when known
    seeds: dict[fx.Node, Seed] = field(default_factory=dict)
    ops: dict[fx.Node, Optional[LocalOp]] = field(default_factory=dict)  # None: getitem of a region tuple
    layout: dict[fx.Node, Layout] = field(default_factory=dict)
    tuple_layout: dict[fx.Node, tuple] = field(default_factory=dict)
    replicated: set[fx.Node] = field(default_factory=set)

    def state(self, node: fx.Node) -> Optional[Layout]:
        return self.layout.get(node)

    def inside(self, node: fx.Node) -> bool:
        return node in self.ops


def _mutated_roots(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose memory some op writes (followed back through views)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and rewrite.mutates(n):
            for a, arg in zip(
                n.args, n.target._schema.arguments, strict=False
            ):  # args may omit trailing defaults
                if isinstance(a, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write:
                    while True:
                        out.add(a)
                        if (
                            a.op == "call_function"
                            and a.target in _VIEWLIKE
                            and a.args
                            and isinstance(a.args[0], fx.Node)
                        ):
                            a = a.args[0]
                        else:
                            break
    return out


def _seed_refusal(c: Collective, mutated: set[fx.Node]) -> str | None:
    if c.coalesced or c.inplace:
        return "coalesced or in-place all_gather"
    if len(c.waits) != 1 or c.logical_output is None or c.logical_dim is None:
        return "gather output not recognised"
    if c.group.size is None or c.group.size < 2:
        return "group size unknown"
    if c.inputs[0] in mutated:
        return "its input is mutated in place later"
    return None


def replicated_values(
    gm: fx.GraphModule, group: str, collectives: list[Collective], trust_inputs: bool
) -> set[fx.Node]:
    """Values provably identical on every rank of ``group``: outputs of all_reduce /
    all_gather / broadcast on it, constants, deterministic functions of those, and --
    when ``trust_inputs`` (the TP contract, see ``Config.tp_inputs_replicated``) -- the
    graph's inputs."""

    full_kinds = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.BROADCAST)
    rep = {
        w
        for c in collectives
        if c.group.name == group and c.kind in full_kinds and not c.coalesced
        for w in c.waits
    }
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if trust_inputs:
                rep.add(n)
        elif n.op == "get_attr":
            rep.add(n)
        elif n.op == "call_function" and n not in rep:
            t = n.target
            if is_wait(t) or collective_spec(t) is not None:
                continue
            tags = getattr(t, "tags", ())
            schema = getattr(t, "_schema", None)
            if torch.Tag.nondeterministic_seeded in tags or (schema is not None and schema.is_mutable):
                continue
            if all(a in rep for a in n.all_input_nodes):
                rep.add(n)
    return rep


def _crossing(ctx: PassContext, seed: Collective, group: str) -> Optional[str]:
    """None when ``group`` and ``seed``'s group cross as the two dims of a mesh every rank knows
    (``ctx.partitions``: DTensor meshes, ``setup(mesh=)``, ``setup(groups=)``), else why not."""
    other = resolve_group_info(group)
    if seed.group.ranks is None or other.ranks is None:
        return "the groups' ranks are unknown"
    grid = find_grid(seed.group.ranks, other.ranks, ctx.partitions)
    return grid if isinstance(grid, str) else None


def _group_rank(c: Collective, rank: Optional[int]) -> Optional[int]:
    """Global ``rank``'s index in ``c``'s group (rank-specific rules need it; every rank passes its
    own, and the decision it feeds is the same on every rank). None: unknown."""
    ranks = c.group.ranks
    if ranks is None or rank is None:
        return None
    return ranks.index(rank) if rank in ranks else None


def plan_regions(
    gm: fx.GraphModule,
    collectives: list[Collective],
    refusals: list[str],
    trust_inputs: Callable[[str], bool] = lambda group: False,
    only_group: Optional[str] = None,
    moe_capacity_regroup: bool = False,
    rank: Optional[int] = None,
    crossing: Optional[Callable[[Collective, str], Optional[str]]] = None,
    shares_batch: Callable[[str], bool] = lambda group: False,
) -> list[RegionPlan]:
    """The regions of every gathered group (``only_group``: of that one). ``crossing(seed, group)``:
    None when ``group`` crosses the seed collective's group as the dims of a mesh, else why not
    (for ops that communicate on another group, e.g. the MoE op's expert exchange).
    ``shares_batch(group)``: the group is declared tensor / sequence parallel, so its ranks hold
    the same sizes; otherwise no region grows through an op whose size is a call argument
    (``SIZE_FROM_ARGUMENTS``), which may be this rank's own local batch there: the moved gather
    would gather different sizes on different ranks (docs/reliability.md, finding 20)."""
    mutated = _mutated_roots(gm)
    by_group: dict[str, RegionPlan] = {}
    for c in collectives:
        if c.kind is not CollectiveKind.ALL_GATHER or (only_group is not None and c.group.name != only_group):
            continue
        why = _seed_refusal(c, mutated)
        if why:
            refusals.append(f"{c.name}: not moved: {why}")
            continue
        plan = by_group.setdefault(c.group.name, RegionPlan(c.group.name, c.group.size, _group_rank(c, rank)))
        plan.seeds[c.logical_output] = Seed(c, c.logical_output, c.inputs[0], c.logical_dim)
    plans = [by_group[g] for g in sorted(by_group)]
    for plan in plans:
        plan.replicated = replicated_values(gm, plan.group, collectives, trust_inputs(plan.group))
        seed = next(iter(plan.seeds.values())).collective
        env = RuleEnv(
            plan.group,
            plan.n,
            plan.replicated.__contains__,
            plan.rank,
            moe_capacity_regroup,
            **({} if crossing is None else {"crossing": lambda g, seed=seed: crossing(seed, g)}),
        )
        _grow(gm, plan, env, shares_batch(plan.group))
        refusals.extend(
            f"group {plan.group}: {why}" for node, why in env.refusals.items() if node not in plan.ops
        )
        _prune(plan)
    return plans


def _grow(gm: fx.GraphModule, plan: RegionPlan, env: RuleEnv, shares_batch: bool) -> None:
    skip = {n for s in plan.seeds.values() for n in s.collective.layout_nodes}
    for node in gm.graph.nodes:
        if node in plan.seeds:
            plan.layout[node] = Sharded(plan.seeds[node].dim)
            continue
        if node in skip or node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in plan.tuple_layout:
            lay = plan.tuple_layout[node.args[0]][node.args[1]]
            if lay is not None:
                plan.ops[node] = None
                plan.layout[node] = lay
            continue
        if not shares_batch and node.target in SIZE_FROM_ARGUMENTS:
            if any(a in plan.layout for a in node.all_input_nodes):
                env.refusals[node] = (
                    f"{node.name}: its size is a call argument, which may be this rank's local batch "
                    f"(group {plan.group} is not declared tensor or sequence parallel)"
                )
            continue
        rule = local_rule(node, plan.state, env)
        if rule is None:
            continue
        plan.ops[node] = rule
        if isinstance(rule.out, tuple):
            plan.tuple_layout[node] = rule.out
        else:
            plan.layout[node] = rule.out


def _outside_users(plan: RegionPlan, node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if not plan.inside(u)]


def _prune(plan: RegionPlan) -> None:
    """Drop region nodes that only reshape a value for consumers outside the region:
    gathering their input instead costs the same and saves one gather per view."""
    changed = True
    while changed:
        changed = False
        for node in list(plan.ops):
            if node.target is operator.getitem or node.target not in _VIEWLIKE:
                continue
            if node.users and not any(plan.inside(u) for u in node.users):
                del plan.ops[node]
                plan.layout.pop(node, None)
                changed = True


def _components(plan: RegionPlan) -> dict[fx.Node, list[fx.Node]]:
    parent: dict[fx.Node, fx.Node] = {}

    def find(x: fx.Node) -> fx.Node:
        root = x
        while parent.get(root, root) is not root:
            root = parent[root]
        while x is not root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(a: fx.Node, b: fx.Node) -> None:
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[ra] = rb

    for node in plan.ops:
        for a in node.all_input_nodes:
            if a in plan.ops or a in plan.seeds:
                union(node, a)
    comps: dict[fx.Node, list[fx.Node]] = {}
    for node in [*plan.seeds, *plan.ops]:
        comps.setdefault(find(node), []).append(node)
    return comps


@dataclass
class ComponentCost:
    removed: int = 0  # wire bytes of gathers that disappear
    added_gather: int = 0
    added_reduce: int = 0
    boundaries: int = 0

    def acceptable(self) -> bool:
        return (
            self.removed > 0
            and self.added_gather <= self.removed
            and self.added_reduce <= PARTIAL_BUDGET * self.removed
        )


def component_cost(plan: RegionPlan, members: list[fx.Node]) -> ComponentCost:
    n = plan.n
    cost = ComponentCost()
    for node in members:
        if node in plan.seeds:
            if not _outside_users(plan, node) and node.users:
                cost.removed += (n - 1) * value_bytes(plan.seeds[node].shard)
            continue
        rule = plan.ops.get(node)
        if rule is not None:
            cost.removed += rule.wire_saved
        lay = plan.layout.get(node)
        if lay is None or not _outside_users(plan, node):
            continue
        if isinstance(lay, Complete):
            continue  # used as it is
        cost.boundaries += 1
        if isinstance(lay, Sharded):
            cost.added_gather += (n - 1) * value_bytes(node) // n
        else:
            cost.added_reduce += 2 * (n - 1) * value_bytes(node) // n
    return cost


def _fake_value(gm: fx.GraphModule, target, args, kwargs):
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    with rewrite.fake_mode_of(gm):
        return target(*fx.node.map_aggregate(args, val), **fx.node.map_aggregate(kwargs, val))


_STRIDE_BOUND_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _viewable(gm: fx.GraphModule, target, args, kwargs) -> bool:
    try:
        _fake_value(gm, target, args, kwargs)
    except (RuntimeError, ValueError):  # "view size is not compatible with input tensor's size and stride"
        return False
    return True


def apply_region(gm: fx.GraphModule, plan: RegionPlan, members: set[fx.Node]) -> dict[str, int]:
    graph = gm.graph
    local: dict[fx.Node, fx.Node] = {s.full: s.shard for s in plan.seeds.values() if s.full in members}
    region = [n for n in graph.nodes if n in plan.ops and n in members]
    inside = set(region)

    def swap(a):
        return local.get(a, a) if isinstance(a, fx.Node) else a

    for node in region:
        rule = plan.ops[node]
        with graph.inserting_before(node):
            if rule is None:  # getitem of a tuple-valued region node
                parent = plan.ops[node.args[0]]
                index = (parent.index_map or {}).get(node.args[1], node.args[1])
                new = graph.call_function(operator.getitem, (local[node.args[0]], index))
                new.meta["val"] = local[node.args[0]].meta["val"][index]
            else:
                args = fx.node.map_arg(rule.args, swap)
                kwargs = fx.node.map_arg(rule.kwargs, swap)
                if node.target in _STRIDE_BOUND_VIEWS and not _viewable(gm, node.target, args, kwargs):
                    # the shard (e.g. of a permuted tensor) has strides the full value had not:
                    # view a contiguous copy of it, as reshape would
                    src = graph.call_function(
                        torch.ops.aten.clone.default, (args[0],), {"memory_format": torch.contiguous_format}
                    )
                    src.meta["val"] = _fake_value(gm, src.target, src.args, src.kwargs)
                    rewrite.inherit_meta(node, src)
                    args = (src, *args[1:])
                new = graph.call_function(node.target, args, kwargs)
                new.meta["val"] = _fake_value(gm, node.target, args, kwargs)
        rewrite.inherit_meta(node, new)
        local[node] = new
    counts = {"gathers_inserted": 0, "partial_all_reduces": 0}
    # Seeds need no boundary: a seed with users outside the region keeps its own gather.
    for node in region:
        outside = [u for u in node.users if u not in inside]
        lay = plan.layout.get(node)
        if not outside or lay is None:
            continue
        if isinstance(lay, Complete):
            node.replace_all_uses_with(local[node], delete_user_cb=lambda u: u not in inside)
            continue
        if isinstance(lay, Sharded):
            full = rewrite.splice(
                gm,
                rewrite.all_gather,
                [local[node]],
                consts=(lay.dim, plan.n, plan.group),
                before=node,
                meta_from=node,
            )
            counts["gathers_inserted"] += 1
        else:
            full = rewrite.splice(
                gm, rewrite.all_reduce, [local[node]], consts=("sum", plan.group), before=node, meta_from=node
            )
            counts["partial_all_reduces"] += 1
        node.replace_all_uses_with(full, delete_user_cb=lambda u: u not in inside)
    seeds = [s for s in plan.seeds.values() if s.full in members]
    rewrite.erase_dead(gm, list(reversed(region)))
    seeds_gone = [s for s in seeds if getattr(s.full, "_erased", False) or not s.full.users]
    rewrite.erase_dead(gm, [s.full for s in seeds_gone])
    counts["gathers_removed"] = len(seeds_gone)
    counts["ops_on_shards"] = len(region)
    return counts


def _tp_contract(ctx: PassContext, collectives: list[Collective], group: str) -> bool:
    """Whether the user told us ``group`` is a TP/SP group whose inputs are replicated: by
    ``group_roles``, by ``commfuse.setup(mesh=)``, or by the named DeviceMesh of the DTensors
    their parallelisation plan created (HF ``tp_plan``, torchtitan, ``parallelize_module``);
    a role inferred from the graph alone is not enough."""

    if not ctx.config.tp_inputs_replicated:
        return False
    return any(c.group.name == group and shares_the_batch(c) for c in collectives)


class CollectiveMotion(GraphPass):
    __doc__ = __doc__
    name = "collective_motion"
    stage = Stage.JOINT
    # Motion changes where sums happen (partial sums reduced across ranks): tolerance compare.
    # Fuzzed programs carry no user-given TP role, so only provably replicated operands move
    # (the TP-contract path is covered by tests/test_chimera.py on reference and gloo runs).
    # moe_layer: gathers in front of commfuse's MoE layer op, which motion moves onto token shards
    # (analysis/moe_rules.py).
    fuzz = FuzzSpec(generators=("tp", "sp", "fsdp", "mixed", "moe_layer"))

    def run(self, ctx: PassContext) -> PassResult:
        refusals: list[str] = []
        if rewrite.fake_mode_of(ctx.gm) is None:
            return PassResult(
                False, refusals=["graph has no fake tensor metadata (meta['val']): nothing moved"]
            )
        totals: dict[str, int] = {}
        changed = False
        groups = sorted({c.group.name for c in ctx.ir.collectives if c.kind is CollectiveKind.ALL_GATHER})
        # One component at a time, re-planning on the rewritten graph: regions of different
        # groups may meet, and the components of one plan may too (a gather of a value another
        # component computes), so a plan must never outlive a rewrite that erased its nodes.
        # The refusals reported are those of the last planning round, on the final graph.
        for group in groups:
            # each applied component removes a gather; the bound only guards against a cycle
            rounds = 2 * sum(1 for c in ctx.ir.collectives if c.kind is CollectiveKind.ALL_GATHER) + 2
            while rounds > 0:
                rounds -= 1
                colls = ctx.ir.collectives
                round_refusals: list[str] = []
                applied = False
                # plan_regions calls the lambdas before it returns (the plans keep neither)
                for plan in plan_regions(
                    ctx.gm,
                    colls,
                    round_refusals,
                    lambda g: _tp_contract(ctx, colls, g),  # noqa: B023
                    only_group=group,
                    moe_capacity_regroup=ctx.config.moe_capacity_regroup,
                    rank=ctx.rank,
                    crossing=lambda c, g: _crossing(ctx, c, g),
                    shares_batch=lambda g: any(c.group.name == g and shares_the_batch(c) for c in colls),  # noqa: B023
                ):
                    for members in _components(plan).values():
                        if self._apply_component(ctx, plan, members, totals, round_refusals):
                            applied = True
                            break
                    if applied:
                        break
                if not applied:
                    refusals.extend(round_refusals)
                    break
                changed = True
                ctx.gm.graph.lint()
                ctx.gm.recompile()
                ctx.invalidate()
        return PassResult(changed, counts=totals, refusals=refusals)

    @staticmethod
    def _apply_component(
        ctx: PassContext,
        plan: RegionPlan,
        members: list[fx.Node],
        totals: dict[str, int],
        refusals: list[str],
    ) -> bool:
        seeds = [m for m in members if m in plan.seeds]
        ops = [m for m in members if m in plan.ops]
        names = ",".join(plan.seeds[s].collective.name for s in seeds)
        if not ops:
            refusals.append(f"{names}: not moved: no user computes independently along the gathered dim")
            return False
        cost = component_cost(plan, members)
        if not cost.acceptable():
            refusals.append(
                f"{names}: not moved: region of {len(ops)} ops would gather {cost.added_gather} B and "
                f"all-reduce {cost.added_reduce} B to save {cost.removed} B"
            )
            return False
        for k, v in apply_region(ctx.gm, plan, set(members)).items():
            totals[k] = totals.get(k, 0) + v
        return True
