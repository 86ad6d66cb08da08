"""centauri_partition: per collective, search the partition tree and keep the cheapest leaf.

Contract
- Matches: every all_gather, reduce_scatter, all_reduce and equal-split all_to_all of a scheduled
  (forward / backward / inference) graph, in graph order, when a topology is
  known (``Config.topology`` or ``commfuse.setup``); without one nothing is
  searched and the report says so.
- Does: for each collective, enumerates the leaves of Centauri's partition tree
  (Fig. 4): a primitive form (the collective as is, or a scalable substitute of
  Table 2 from ``primitive_substitution``), a group scheme (flat, or the
  inter-first / intra-first hierarchical sequence of ``group_partition``) and a
  workload chunk count (1, a count from {2, 4, 8, ...} up to ``Config.max_chunks``,
  or the count of Centauri's Algorithm 1 (``analysis/chunking.py``), those
  ``workload_partition`` can cut the collective and its compute chain into). Where the
  group can be split, Algorithm 1 is also run for the group-partitioned collective
  (``group_granularity``: the inter-/intra-node levels' predicted times): its leaf, the
  level it launches first and chunks in its granularity, uneven where it says so, joins
  the leaves (chunk sizes rounded to what the chain's shapes divide, see
  ``workload_partition``). Each leaf is applied to a copy of the graph, its waits are
  sunk as the ``sink_waits`` pass would, and the copy is simulated with the
  topology's cost estimator (``costmodel.simulator``: makespan, exposed
  communication, peak memory). The cheapest leaf by makespan is applied to the
  graph when it beats the current graph; ties keep the simpler scheme. To bound
  compile time the primitive level is searched as a beam: every group x workload
  leaf of the collective as written, then each substitute form flat and at the best
  of those leaves (the substitutes are priced slower alone on every preset, so
  their full subtree rarely holds the minimum). Decisions
  are greedy in graph order: each collective is searched on the graph that
  already holds the earlier collectives' choices.
- Order inside a leaf: the workload partition is applied first (it needs the
  collective and its chain as the program wrote them), then the primitive
  substitution and the group partition on each chunk collective. The three
  rewrites are value-preserving and independent per chunk, so this yields the same
  program as the paper's primitive -> group -> workload order for every leaf
  commfuse can build.
- Guarantees: values equal up to reduction order (each building pass's contract);
  every decision is a deterministic function of the graph, config and topology
  (the budget counts simulated leaves, not seconds), so every rank that holds the
  same graph emits the same collectives in the same order. One ``decisions``
  entry per searched collective records the chosen scheme (uneven chunks as
  ``chunks:3(2:1:1)``), the chunk sizes along the cut dim, Algorithm 1's reasoning for an
  uneven leaf, the number of leaves scored and the predicted makespan / exposed
  communication before and after.
- Leaves alone: collectives of other kinds; collectives whose every leaf is no
  cheaper (reported with the best alternative's prediction); collectives left
  when ``Config.partition_search_budget`` leaves have been scored (reported);
  the whole graph when its ranks may not see the same graph or sizes
  (point-to-point and pipeline boundary ops, an all_to_all with split sizes given
  per rank, symbolic shapes): the leaves are priced on the whole graph, so each
  rank would choose from its own costs and ranks of one group could split the
  same collective differently (reported).

Source: Centauri §3.1 (partition space, Fig. 4: "each collective yields a tree of
feasible schemes; pick the leaf with minimal scheduling cost"), scored with the
simulator of commfuse's cost model.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from commfuse.analysis import chunking
from commfuse.analysis.rank_local import rank_local_reason
from commfuse.core.torch_private import copy_graph
from commfuse.costmodel.simulator import SimResult, Simulator
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms import group_partition, primitive_substitution, workload_partition
from commfuse.transforms.group_partition import GroupPartition
from commfuse.transforms.sink_waits import SinkWaits

log = logging.getLogger(__name__)

# An all_to_all's tree has the group level only (no substitute form, no workload chain yet).
SEARCHED_KINDS = (
    CollectiveKind.ALL_GATHER,
    CollectiveKind.REDUCE_SCATTER,
    CollectiveKind.ALL_REDUCE,
    CollectiveKind.ALL_TO_ALL,
)
GROUP_SCHEMES = ("flat", "inter_first", "intra_first")
# A leaf must beat the current graph by this fraction of its makespan to be applied:
# below it the simulator's rounding, not the schedule, decides.
MIN_GAIN = 1e-3


@dataclass(frozen=True)
class Scheme:
    primitive: str = "keep"
    group: str = "flat"
    chunks: int = 1
    sizes: Optional[tuple[int, ...]] = None  # uneven chunks (Algorithm 1's granularity, in units); None: even

    @property
    def is_identity(self) -> bool:
        return self == Scheme()

    def complexity(self) -> tuple[int, int, int, int]:
        return (
            self.chunks,
            int(self.sizes is not None),
            int(self.group != "flat"),
            int(self.primitive != "keep"),
        )

    def describe(self) -> str:
        parts = [] if self.primitive == "keep" else [self.primitive]
        if self.group != "flat":
            parts.append(f"group:{self.group}")
        if self.chunks > 1:
            sizes = f"({':'.join(map(str, self.sizes))})" if self.sizes else ""
            parts.append(f"chunks:{self.chunks}{sizes}")
        return "+".join(parts) or "unchanged"


@dataclass(frozen=True)
class Score:
    makespan_us: float
    exposed_comm_us: float
    peak_memory_bytes: int

    @classmethod
    def of(cls, r: SimResult) -> "Score":
        return cls(r.makespan_us, r.exposed_comm_us, r.peak_memory_bytes)


class InfeasibleLeaf(Exception):
    """A building pass refused one step of the leaf (its plan returned a reason)."""


def _building_blocks():
    # Imported on use: the three passes import the registry, which imports this module.

    return primitive_substitution, group_partition, workload_partition


def graph_refusal(ctx: PassContext, decided: str) -> Optional[str]:
    """Why no collective of ``ctx``'s graph can be partitioned by cost: no cost model, or ranks
    that may hold different graphs (``decided`` names what would then differ between them)."""
    if ctx.cost.model is None:
        return "no topology (Config.topology or commfuse.setup): no cost model to decide with"
    local = rank_local_reason(ctx.ir.collectives, ctx.gm)
    if local is not None:
        return f"{local}, so {decided} could differ between ranks; graph left unchanged"
    return None


def chunk_candidates(max_chunks: int) -> list[int]:
    out, k = [1], 2
    while k <= max_chunks:
        out.append(k)
        k *= 2
    return out


def group_granularity(ctx: PassContext, c: Collective) -> tuple[Optional[Scheme], str]:
    """Centauri's Algorithm 1 for ``c`` group-partitioned: the leaf it picks (which node level
    goes first, the chunks in its granularity, uneven where it says so, as rounded by
    ``plan_workload_partition``), or None, and why.

    Its inputs: ``comp_cost`` / ``comm_cost`` / ``in_cost`` as for the flat count
    (``workload_partition.operation_level_chunks``), ``cost_inter`` / ``cost_intra`` the
    predicted times of the inter- and intra-node collectives of the cheaper hierarchical
    sequence (``group_partition.plan_group_partition``), its sub-group sizes."""
    _, group, work = _building_blocks()
    est = ctx.cost.model
    gplan = group.plan_group_partition(ctx, c)
    if est is None or isinstance(gplan, str):
        return None, f"not group-partitioned ({gplan if isinstance(gplan, str) else 'no topology'})"
    probe = work.plan_workload_partition(ctx, c, chunks=work.DEFAULT_CHUNKS)
    comp = probe.compute_us if not isinstance(probe, str) and probe.compute_us is not None else 0.0
    costs = chunking.GroupCosts(
        cost_inter=sum(lv.predicted_us for lv in gplan.levels if lv.group == gplan.inter_group),
        cost_intra=sum(lv.predicted_us for lv in gplan.levels if lv.group == gplan.intra_group),
        inter_size=gplan.nodes,
        intra_size=gplan.local,
    )
    op = chunking.operation_level_plan(
        comp,
        est.collective(c).time_us,
        chunking.independent_compute_us(ctx.gm, ctx.ir, c, est),
        ctx.config.max_chunks,
        group=costs,
    )
    why = f"Algorithm 1: {op.why}, granularity {', '.join(f'{g:.3g}' for g in op.granularity)}"
    if op.first is None or op.num_chunks < 2:
        return None, why
    order = f"{op.first}_first"
    if isinstance(group.plan_group_partition(ctx, c, order=order), str):
        return None, f"{why}; {order} not feasible"
    plan = work.plan_workload_partition(ctx, c, granularity=op.granularity)
    if isinstance(plan, str):
        return None, f"{why}; {plan}"
    if plan.note:
        why += f"; {plan.note}"
    return Scheme("keep", order, plan.chunks, plan.sizes), why


def leaves_for(ctx: PassContext, c: Collective) -> list[Scheme]:
    """The leaves of ``c``'s partition tree whose first step is feasible, simplest first."""
    prim, group, work = _building_blocks()
    forms = ["keep"] + list(prim.substitute_forms(c))
    groups = ["flat"] + [
        g for g in GROUP_SCHEMES[1:] if not isinstance(group.plan_group_partition(ctx, c, order=g), str)
    ]
    counts = chunk_candidates(ctx.config.max_chunks)
    suggested, _ = work.operation_level_chunks(ctx, c)  # Centauri Algorithm 1's count joins the candidates
    if suggested is not None and suggested not in counts:
        counts = sorted(counts + [suggested])
    chunks = [
        k for k in counts if k == 1 or not isinstance(work.plan_workload_partition(ctx, c, chunks=k), str)
    ]
    leaves = [Scheme(f, g, k) for k in chunks for g in groups for f in forms]
    # Algorithm 1 on the group-partitioned collective: its level order and (uneven) granularity
    picked, _ = group_granularity(ctx, c) if len(groups) > 1 else (None, "")
    if picked is not None and picked.sizes is not None:
        leaves += [Scheme(f, picked.group, picked.chunks, picked.sizes) for f in forms]
    return sorted(leaves, key=Scheme.complexity)


def work_plan(ctx: PassContext, c: Collective, scheme: Scheme):
    """The workload plan ``scheme`` cuts ``c`` with (a str: why none)."""
    work = _building_blocks()[2]
    return work.plan_workload_partition(ctx, c, chunks=scheme.chunks, granularity=scheme.sizes)


def _collectives_at(ctx: PassContext, starts: list[fx.Node]) -> list[Collective]:
    ctx.invalidate()
    by_start = {c.start: c for c in ctx.ir.collectives}
    return [by_start[s] for s in starts if s in by_start]


def _step(ctx: PassContext, c: Collective, plan_fn: Callable, apply_fn: Callable, **choice) -> list[fx.Node]:
    plan = plan_fn(ctx, c, **choice)
    if isinstance(plan, str):
        raise InfeasibleLeaf(f"{c.name}: {plan}")
    return apply_fn(ctx, c, plan)


def apply_scheme(ctx: PassContext, c: Collective, scheme: Scheme) -> None:
    """Rewrite ``ctx.gm``'s graph with ``scheme`` for ``c`` (raises InfeasibleLeaf; caller restores).

    The module is not recompiled: trial copies are only simulated, and the pipeline
    recompiles the real graph after the pass."""
    prim, group, work = _building_blocks()
    starts = [c.start]
    if scheme.chunks > 1:
        starts = _step(
            ctx,
            c,
            work.plan_workload_partition,
            work.apply_workload_partition,
            chunks=scheme.chunks,
            granularity=scheme.sizes,
        )
    if scheme.primitive != "keep":
        new: list[fx.Node] = []
        for cc in _collectives_at(ctx, starts):
            new += _step(
                ctx,
                cc,
                prim.plan_primitive_substitution,
                prim.apply_primitive_substitution,
                form=scheme.primitive,
            )
        starts = new
    if scheme.group != "flat":
        for cc in _collectives_at(ctx, starts):
            if cc.kind in SEARCHED_KINDS:
                _step(ctx, cc, group.plan_group_partition, group.apply_group_partition, order=scheme.group)
    ctx.gm.graph.lint()
    ctx.invalidate()


def _copy_context(ctx: PassContext) -> PassContext:
    gm = fx.GraphModule(ctx.gm, copy_graph(ctx.gm.graph))
    return ctx.derive(gm)


def _sig(a) -> object:
    """Hashable summary of what a cost depends on: tensors by shape, dtype and strides."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
    if isinstance(a, torch.Tensor):
        return (tuple(map(str, a.shape)), a.dtype, tuple(map(str, a.stride())))
    if isinstance(a, (list, tuple)):
        return tuple(_sig(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _sig(v)) for k, v in a.items())
    return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else str(a)


class _MemoEstimator:
    """The topology's estimator with answers memoised by what they depend on.

    Every leaf is a fresh copy of the graph, so the simulator's per-node cache starts
    empty each time; most nodes are unchanged copies. A compute node's cost is a function
    of its target, its arguments' shapes/dtypes and its constants; a collective's of its
    kind, group, reduce op, dtype and shapes (its signature) -- and of whether the cost policy
    prices it at all (a node whose size varies across ranks is not priced, whatever its shapes)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._compute: dict = {}
        self._coll: dict = {}

    def compute_time_us(self, node: fx.Node) -> float:
        key = (node.op, str(node.target), _sig(node.args), _sig(node.kwargs), _sig(node), self._prices(node))
        hit = self._compute.get(key)
        if hit is None:
            hit = self._compute[key] = self.inner.compute_time_us(node)
        return hit

    def collective(self, c: Collective):
        key = (c.signature(), c.group.ranks, tuple(str(s) for s in c.output_shapes), self._prices(c.start))
        hit = self._coll.get(key)
        if hit is None:
            hit = self._coll[key] = self.inner.collective(c)
        return hit

    def _prices(self, node: fx.Node) -> bool:
        prices = getattr(self.inner, "prices", None)
        return True if prices is None else bool(prices(node))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def score_graph(ctx: PassContext, estimator=None) -> Score:
    """The graph's predicted cost once its waits are sunk (as the pipeline's ``sink_waits`` will)."""

    if SinkWaits().run(ctx).changed:
        ctx.invalidate()
    return Score.of(Simulator(ctx.gm, estimator or ctx.cost.model, ir=ctx.ir).simulate())


def score_leaf(ctx: PassContext, collective: str, scheme: Scheme, estimator=None) -> Score:
    trial = _copy_context(ctx)
    if not scheme.is_identity:
        c = next((x for x in trial.ir.collectives if x.name == collective), None)
        if c is None:
            raise InfeasibleLeaf(f"{collective}: not found in the copy")
        apply_scheme(trial, c, scheme)
    return score_graph(trial, estimator)


@dataclass
class Decision:
    collective: str
    kind: str
    group: str
    scheme: str
    leaves_scored: int
    makespan_before_us: float
    makespan_after_us: float
    exposed_before_us: float
    exposed_after_us: float
    peak_memory_before: int
    peak_memory_after: int
    chunk_sizes: list = field(default_factory=list)  # elements of each chunk along the cut dim ([]: not cut)
    granularity: str = ""  # uneven chunks: Algorithm 1's choice and how it was rounded


class CentauriPartition(GraphPass):
    __doc__ = __doc__
    name = "centauri_partition"
    stage = Stage.SCHEDULE
    # The partition search composes the three above (workload -> primitive -> group per leaf) and keeps
    # the leaf the simulator prices cheapest, on the group-partition fuzz topology (sub-groups set up
    # by check.py): tolerance compare scaled like its building blocks.
    fuzz = FuzzSpec(
        generators=("tp", "sp", "fsdp", "mixed"),
        world_sizes=(8,),
        scaled_tolerance=True,
        topology=GroupPartition.fuzz.topology,
    )

    def run(self, ctx: PassContext) -> PassResult:
        why = graph_refusal(ctx, "the simulated costs, and the scheme chosen for a collective,")
        if why is not None:
            return PassResult(changed=False, refusals=[why])
        budget = ctx.config.partition_search_budget
        names = [c.name for c in ctx.ir.collectives if c.kind in SEARCHED_KINDS]
        refusals: list[str] = []
        decisions: list[dict] = []
        changed = 0
        memo = _MemoEstimator(ctx.cost.model)  # one per run: shared by every leaf's copy
        current = score_graph(_copy_context(ctx), memo)
        for i, name in enumerate(names):
            c = next((x for x in ctx.ir.collectives if x.name == name), None)
            if c is None:
                continue
            if budget <= 0:
                refusals.append(
                    f"search budget ({ctx.config.partition_search_budget} leaves) spent: "
                    f"{len(names) - i} collective(s) from {name} on kept as they are"
                )
                break
            best, best_score, scored, infeasible = None, current, 0, []
            leaves = leaves_for(ctx, c)
            # Beam over the primitive level: group x workload leaves of the collective as it
            # is first; a substitute form is then tried flat and at the best of those leaves.
            kept = [s for s in leaves if s.primitive == "keep"]
            for phase in (kept, None):
                if phase is None:
                    anchor = best or Scheme()
                    forms = {s.primitive for s in leaves} - {"keep"}
                    phase = [
                        s
                        for s in leaves
                        if s.primitive in forms
                        and (s.group, s.chunks, s.sizes)
                        in {("flat", 1, None), (anchor.group, anchor.chunks, anchor.sizes)}
                    ]
                for scheme in phase:
                    if scheme.is_identity:
                        continue
                    if budget <= 0:
                        break
                    try:
                        s = score_leaf(ctx, name, scheme, memo)
                    except InfeasibleLeaf as e:
                        infeasible.append(f"{scheme.describe()} ({e})")
                        continue
                    budget -= 1
                    scored += 1
                    if s.makespan_us < best_score.makespan_us - MIN_GAIN * max(current.makespan_us, 1e-9):
                        best, best_score = scheme, s
            if best is None:
                refusals.append(
                    f"{name}: kept ({scored} scheme(s) scored, none predicted faster than "
                    f"{current.makespan_us:.1f} us"
                    + (f"; infeasible: {'; '.join(infeasible)}" if infeasible else "")
                    + ")"
                )
                continue
            sizes, granularity = [], ""
            if best.chunks > 1:
                wplan = work_plan(ctx, c, best)
                sizes = list(wplan.extents) if not isinstance(wplan, str) else []
                if best.sizes is not None:
                    granularity = group_granularity(ctx, c)[1]
            apply_scheme(ctx, c, best)
            changed += 1
            decisions.append(
                asdict(
                    Decision(
                        collective=name,
                        kind=c.kind.value,
                        group=c.group.name,
                        scheme=best.describe(),
                        leaves_scored=scored,
                        makespan_before_us=current.makespan_us,
                        makespan_after_us=best_score.makespan_us,
                        exposed_before_us=current.exposed_comm_us,
                        exposed_after_us=best_score.exposed_comm_us,
                        peak_memory_before=current.peak_memory_bytes,
                        peak_memory_after=best_score.peak_memory_bytes,
                        chunk_sizes=sizes,
                        granularity=granularity,
                    )
                )
            )
            current = best_score
        counts = {
            "collectives_searched": len(names),
            "collectives_partitioned": changed,
            "leaves_scored": ctx.config.partition_search_budget - budget,
        }
        return PassResult(changed=changed > 0, counts=counts, refusals=refusals, decisions=decisions)


def predicted(ctx: PassContext) -> Optional[Score]:
    """The graph's predicted cost under the search's judge (None without a topology)."""
    if ctx.cost.model is None:
        return None
    return score_graph(_copy_context(ctx))
