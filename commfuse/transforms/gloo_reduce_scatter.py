"""gloo_reduce_scatter: a reduce_scatter on gloo lowered as all_to_all + local sum.

Contract
- Matches: every functional ``_c10d_functional.reduce_scatter_tensor`` (not coalesced,
  not in-place / ``_out``, not the autograd variant) with one wait, reduce op ``sum`` or
  ``avg``, a real floating or integer dtype (``avg``: floating only), a static input
  shape of at least one dim, an input on the CPU, and a known group of at least two
  ranks, in a scheduled (forward / backward / inference) graph.
- Backend: ProcessGroupGloo has no reduce_scatter of its own; it runs an all_reduce
  of the whole input and keeps this rank's slice (volume 2(N-1)/N of the input per
  rank). An ``all_to_all_single`` with equal splits sends every other rank exactly the
  chunk it owns ((N-1)/N of the input) and a local sum over the N received chunks
  finishes the reduction. The group is treated as gloo when
  ``Config.topology`` / ``commfuse.setup`` gives a CPU topology
  (``ctx.cost.backend``, :class:`commfuse.passmgr.cost.CostPolicy`); a GPU topology means NCCL, which has a native ring
  reduce_scatter at (N-1)/N already, so the collective is left alone. Without a
  topology the pass still decides (CPU users who never call ``commfuse.setup`` are
  the ones gloo's emulation costs most): a CPU input can only run on a CPU backend
  (gloo in stock PyTorch), priced with the ``cpu-gloo`` preset's figures, every rank on
  one node (the cost policy's default for gloo, :data:`commfuse.passmgr.cost.DEFAULT_GLOO_TOPOLOGY`); a CUDA input is refused (a mixed ``cpu:gloo,cuda:nccl``
  group sends it to NCCL), with a topology or without.
- Does: when the cost model predicts ``all_to_all + local sum`` strictly faster than
  gloo's emulated reduce_scatter (collectives priced by the topology's estimator, the
  local sum by the compute model on the traced replacement's own nodes), replaces
  ``wait(reduce_scatter(x))`` by ``c0 + c1 + ... + c(N-1)`` over the N dim-0 chunks of
  ``wait(all_to_all_single(x))`` (``avg``: then ``/ N``). The all_to_all is issued where
  the reduce_scatter was issued and waited where its wait was; the sum follows the wait. Every priced candidate is a
  decision in the report (both predictions, the choice).
- Guarantees: the collective start order is unchanged (the all_to_all takes the
  reduce_scatter's place in the single total issue order, on the same group), so every
  rank issues the same sequence; the decision depends only on the graph, the config
  and the topology, and prices only sizes every rank of the group shares (the collective's
  operand and what is computed from its result: ``model_for``), so ranks whose local batches
  differ lower alike. Values: the local sum adds the received chunks in group-rank order
  in the input dtype, one rounding per add, as a collective rounds per hop; that is the
  reference interpreter's canonical order, so the rewrite is bitwise equal to the
  reduce_scatter there, and differs from gloo's ring only in summation order (under
  Inductor the chain fuses into one kernel that may accumulate bf16 in fp32). Peak
  memory: the all_to_all's output is as large as the input (gloo's emulation all-reduces
  a full-size buffer too, inside the collective).
- Leaves alone (one refusal line each): NCCL (GPU) topologies, CUDA inputs, reduce ops
  other than sum/avg (max/min would take the same form with a local maximum/minimum, but
  only the gradient reductions are lowered; premul_sum carries a scale), avg on integers,
  bool/complex dtypes, coalesced / in-place / autograd-variant reduce_scatters, several
  waits, unknown or one-rank groups, symbolic or 0-d shapes, dim 0 not divisible by the
  group size, and every candidate the cost model predicts no faster.

Source: ProcessGroupGloo (its reduce_scatter shows in the profiler as one ``gloo:all_reduce``
over the whole buffer). The all_to_all + reduce
form is the "pairwise exchange" reduce-scatter of MPI implementations (Thakur,
Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005, §4.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from commfuse.core.torch_private import c10d_functional as _f
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import concrete
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.cost import DEFAULT_GLOO_TOPOLOGY

K = CollectiveKind
REDUCE_OPS = ("sum", "avg")
# Without a topology a CPU input is priced with the cpu-gloo preset's link and device figures
# (gloo over loopback TCP), every rank on one node: nothing says where the ranks sit, and the
# preset's 2 ranks per node is a placeholder for this machine (it would price a 4-rank group's
# all_to_all over a 1 GB/s "NIC" that a single-machine job does not have). A constant every rank
# shares, so the decision stays rank-independent.


@dataclass(frozen=True)
class Prediction:
    """What the cost model says about one candidate (microseconds)."""

    reduce_scatter_us: float  # gloo's emulation: an all_reduce of the whole input
    all_to_all_us: float
    local_sum_us: float  # the replacement's local compute (the chain of adds, avg's division)
    algorithm: str  # the reduce_scatter's algorithm as the model named it

    @property
    def replacement_us(self) -> float:
        return self.all_to_all_us + self.local_sum_us

    @property
    def faster(self) -> bool:
        return self.replacement_us < self.reduce_scatter_us


# --------------------------------------------------------------------------- the rewrite
def replacement(x: torch.Tensor, op: str, n: int, group: str) -> torch.Tensor:
    """``reduce_scatter_tensor(x, op, n, group)`` written as all_to_all + local sum (eager).

    Rank r receives chunk r of every rank's ``x`` in group-rank order; summing the N
    received chunks is rank r's slice of the reduction.
    """
    recv = rewrite.all_to_all(x, 0, 0, n, group)
    chunks = torch.chunk(recv, n, 0)
    # A chain of adds in group-rank order, in the input dtype: one rounding per add, as a
    # collective rounds per hop, and exactly the reference's canonical order (bitwise equal
    # there). torch.sum would round bf16 once but sums in an order that is not specified
    # (8 fp32 rows: not left to right); Inductor fuses the chain into one kernel anyway.
    out = chunks[0]
    for c in chunks[1:]:
        out = out + c
    return out / n if op == "avg" else out


# --------------------------------------------------------------------------- feasibility
def why_not(c: Collective) -> Optional[str]:
    """Why ``c`` cannot be lowered as all_to_all + sum, whatever the cost (None: it can)."""
    if c.start.target is not _f.reduce_scatter_tensor.default:
        if c.coalesced:
            return "coalesced reduce_scatter (one all_to_all per tensor would add launches)"
        if c.inplace:
            return "in-place reduce_scatter (its output buffer belongs to the caller)"
        return f"{c.start.target} is not the functional reduce_scatter_tensor"
    if len(c.waits) != 1:
        return "not exactly one wait"
    if c.reduce_op not in REDUCE_OPS:
        return f"reduce op {c.reduce_op!r}: only {'/'.join(REDUCE_OPS)} are lowered as all_to_all + local sum today"
    if c.dtype is None or c.dtype.is_complex or c.dtype == torch.bool:
        return f"dtype {c.dtype} is not a real number type"
    if c.reduce_op == "avg" and not c.dtype.is_floating_point:
        return f"reduce op 'avg' on integer dtype {c.dtype}"
    n = c.group.size
    if n is None:
        return "group size unknown"
    if n < 2:
        return "group of one rank: nothing is communicated"
    shape = c.input_shapes[0] if c.input_shapes else None
    if shape is None or not all(isinstance(s, int) for s in shape):
        return "input shape not static"
    if not shape:
        return "0-d input"
    if shape[0] % n:
        return f"dim 0 of input shape {list(shape)} is not divisible by the group size {n}"
    val = c.input_value
    if val is None:
        return "input has no tensor metadata"
    if val.device.type != "cpu":
        return (
            f"input on {val.device.type}: not a gloo collective (a CUDA tensor runs on NCCL, "
            "which has a native reduce_scatter)"
        )
    return None


def why_not_backend(ctx: PassContext) -> Optional[str]:
    if ctx.topology is not None and ctx.cost.backend != "gloo":
        return (
            f"topology {ctx.topology.name!r} is priced as {ctx.cost.backend}, which has a native "
            "reduce_scatter ((N-1)/N of the input per rank): nothing to gain"
        )
    return None


# --------------------------------------------------------------------------- cost
def model_for(ctx: PassContext) -> AnalyticCostModel:
    """The topology's estimator (priced as gloo: callers checked the backend), or the cost
    policy's default for gloo when there is no topology.

    Every size it prices is shared by every rank of the collective's group, so it prices them as
    traced (``full``): the decision changes only that group's collective, and prices the
    collective's operand, its all_to_all and the local sum over the result -- sizes every rank of
    the group must pass alike for the collective to run (``passmgr/invariance.py``), whatever
    compute shapes follow from a data-parallel rank's local batch elsewhere in the graph."""
    return ctx.cost.default_model(ctx.ir, backend="gloo")[0].full


def _in_graph(model: AnalyticCostModel, t: float) -> float:
    # the estimator's per-collective in-graph overhead, as model.collective(c) adds it
    extra = model.runtime.collective_in_graph_us or 0.0
    return t + extra if t > 0 else t


def predict(ctx: PassContext, c: Collective) -> Prediction:
    model = model_for(ctx)
    rs = model.collective(c)
    size = concrete(c.input_bytes) or 0
    a2a = model.collectives.time(K.ALL_TO_ALL, size, c.group.size, ranks=c.group.ranks).time_us
    template = rewrite.trace(
        replacement,
        [c.start.args[0]],
        (c.reduce_op, c.group.size, c.group.name),
        rewrite.fake_mode_of(ctx.gm),
    )
    local = sum(
        model.compute_time_us(n)
        for n in template.graph.nodes
        if n.op == "call_function" and collective_spec(n.target) is None and not is_wait(n.target)
    )
    return Prediction(rs.time_us, _in_graph(model, a2a), local, rs.algorithm)


def apply(ctx: PassContext, c: Collective) -> fx.Node:
    """Rewrite ``c`` in place; returns the new all_to_all start. No lint/recompile."""
    (wait,) = c.waits
    x = c.start.args[0]
    anchor = c.start.prev
    out = rewrite.splice(
        ctx.gm,
        replacement,
        [x],
        consts=(c.reduce_op, c.group.size, c.group.name),
        before=c.start,
        meta_from=c.start,
    )
    spliced, n = [], anchor.next
    while n is not c.start:
        spliced.append(n)
        n = n.next
    new_wait = next(m for m in spliced if m.op == "call_function" and is_wait(m.target))
    # Everything from the new wait on reads only the all_to_all's result: it moves to where
    # the reduce_scatter's wait was, so the wait stays where the scheduler put it.
    for m in spliced[spliced.index(new_wait) :]:
        wait.prepend(m)
    wait.replace_all_uses_with(out)
    rewrite.erase_dead(ctx.gm, [wait])
    return next(m for m in spliced if m.op == "call_function" and collective_spec(m.target) is not None)


class GlooReduceScatter(GraphPass):
    __doc__ = __doc__
    name = "gloo_reduce_scatter"
    stage = Stage.SCHEDULE
    # gloo reduce_scatter lowering (all_to_all + local sum): no topology, so CPU inputs are priced
    # with the cpu-gloo preset and every sum/avg reduce_scatter is lowered, in every family and world
    # size. The local sum adds the chunks in group-rank order in the input dtype, the interpreter's
    # canonical order: bitwise equal. The all_to_all replaces the reduce_scatter (hashes change).
    fuzz = FuzzSpec(exact=True)

    def run(self, ctx: PassContext) -> PassResult:
        candidates = [c for c in ctx.ir.collectives if c.kind is K.REDUCE_SCATTER]
        if not candidates:
            return PassResult(changed=False, counts={"lowered": 0, "kept": 0})
        refusals: list[str] = []
        decisions: list[dict] = []
        backend_why = why_not_backend(ctx)
        lowered = 0
        for c in candidates:
            why = backend_why or why_not(c)
            if why is not None:
                refusals.append(f"{c.name}: reduce_scatter kept: {why}")
                continue
            p = predict(ctx, c)
            decisions.append(
                {
                    "collective": c.name,
                    "group": c.group.name,
                    "group_size": c.group.size,
                    "reduce_op": c.reduce_op,
                    "dtype": str(c.dtype),
                    "input_bytes": concrete(c.input_bytes),
                    "topology": ctx.topology.name
                    if ctx.topology is not None
                    else f"default:{DEFAULT_GLOO_TOPOLOGY.name}",
                    "reduce_scatter_us": round(p.reduce_scatter_us, 3),
                    "reduce_scatter_algorithm": p.algorithm,
                    "all_to_all_us": round(p.all_to_all_us, 3),
                    "local_sum_us": round(p.local_sum_us, 3),
                    "replacement_us": round(p.replacement_us, 3),
                    "lowered": p.faster,
                }
            )
            if not p.faster:
                refusals.append(
                    f"{c.name}: reduce_scatter kept: cost model: all_to_all {p.all_to_all_us:.1f} us + "
                    f"local sum {p.local_sum_us:.1f} us, not faster than gloo's reduce_scatter "
                    f"({p.algorithm}) {p.reduce_scatter_us:.1f} us"
                )
                continue
            apply(ctx, c)
            lowered += 1
        if lowered:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(
            changed=lowered > 0,
            counts={"lowered": lowered, "kept": len(candidates) - lowered},
            refusals=refusals,
            decisions=decisions,
        )
