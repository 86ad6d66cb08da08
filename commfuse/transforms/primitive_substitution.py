"""primitive_substitution: Centauri's scalable primitive substitutes, where the cost model says they pay.

Contract
- Matches: every functional ``all_reduce``, ``all_gather`` and ``reduce_scatter`` (not
  coalesced, not in-place, one wait, static shapes, a known group of at least 2 ranks).
- Does: for each, the scalable substitute of Centauri's Table 2 for its kind:

  * ``rs_ag``: ``all_reduce`` -> ``reduce_scatter`` + ``all_gather`` along the dim
    :func:`.split_all_reduce.split_dim` picks (the rewrite is
    :func:`.split_all_reduce.split_one`, not a second copy of it);
  * ``rooted_broadcasts``: ``all_gather`` over N ranks -> N functional broadcasts with
    roots 0..N-1 (group ranks), every rank passing its own shard (root r's is the one
    that lands), concatenated in root order along the gather's logical dim (through
    DTensor's split/cat shuffle: the substitute cats along that dim directly);
  * ``rooted_reduces``: ``reduce_scatter`` over N ranks -> N rooted reduces
    (``commfuse::reduce_to_root``, :mod:`commfuse.ops.reduce_to_root.op`), reduce r reducing
    slice r of the logical scatter dim to root r; the N results are added (non-roots
    receive ``-0.0``, the exact additive identity), so rank r holds exactly slice r's
    reduction; ``avg`` reduces with ``sum`` and divides by N afterwards.

  It prices the original and the substitute with the context's cost policy
  (:class:`commfuse.passmgr.cost.CostPolicy`: the topology's model, or its documented default,
  DGX-H100 nodes priced as NCCL) and applies the substitute only where it is predicted
  strictly faster; both predictions are reported. Standalone this is rare (the same
  bytes in more launches); the search (``centauri_partition``) composes the forms with
  the workload partition through :func:`plan_primitive_substitution` /
  :func:`apply_primitive_substitution`, where rooted pieces pay.
- Never generates Table 2's non-scalable forms (:data:`NON_SCALABLE`): reduce + broadcast
  and reduce + scatter serialise two rooted phases (twice the latency term, the whole
  buffer through the root's link), gather + broadcast funnels every shard through one
  root (root contention grows with N).
- Guarantees: values equal to the original's up to the backend's reduction order (the
  reference interpreter, which reduces in canonical order, gives bitwise-equal results
  for all three forms); same groups; a decision that depends only on the graph, the
  config and the topology, so every rank emits the same collectives in the same order.
  The rooted reduce is pinned as MUST_SAVE for the partitioner (never recomputed).
- Leaves alone (one refusal line each): coalesced / in-place collectives, several waits,
  unknown group size or a group of one, symbolic shapes, 0-d all_gather inputs, reduce
  ops other than sum/avg/max/min (product, bitwise ops, premul_sum), avg on integers,
  complex or bool reduce_scatters, dims the group size does not divide, and every
  collective whose substitute the cost model predicts no faster.

Source: "Centauri: Enabling Efficient Scheduling for Communication-Computation Overlap in Large Model
Training via Communication Partitioning" (Chen et al., ASPLOS '24), §3.1.1
(primitive substitution), Table 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from commfuse.core.torch_private import c10d_functional as _f
from commfuse.costmodel.collectives import concrete
from commfuse.costmodel.topology import Topology
from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind, collective_spec
from commfuse.ir.layout import match_gather_shuffle, match_scatter_shuffle
from commfuse.ops.reduce_to_root.op import REDUCE_TO_ROOT
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms.split_all_reduce import split_dim, split_one, why_not_splittable

K = CollectiveKind

RS_AG = "rs_ag"
ROOTED_BROADCASTS = "rooted_broadcasts"
ROOTED_REDUCES = "rooted_reduces"
# Table 2's scalable column: the one substitute commfuse builds per kind.
SCALABLE_FORM: dict[CollectiveKind, str] = {
    K.ALL_REDUCE: RS_AG,
    K.ALL_GATHER: ROOTED_BROADCASTS,
    K.REDUCE_SCATTER: ROOTED_REDUCES,
}
# Table 2's non-scalable column: never generated; asking for one by name is refused with this reason.
NON_SCALABLE: dict[str, str] = {
    "reduce+broadcast": "all_reduce as reduce + broadcast is not scalable: two rooted phases in series double "
    "the latency term and push the whole buffer through the root's link (Centauri Table 2)",
    "reduce+scatter": "reduce_scatter as reduce + scatter is not scalable: the reduce and the scatter run in "
    "series (twice the latency) and the root handles the whole buffer (Centauri Table 2)",
    "gather+broadcast": "all_gather as gather + broadcast is not scalable: every shard funnels through one root, "
    "whose link carries N shards twice (root contention grows with N; Centauri Table 2)",
}
REDUCE_OPS = ("sum", "avg", "max", "min")
# Without a topology (Config.topology / commfuse.setup) the pass still decides, from this
# fixed stand-in that every rank shares: one DGX-H100 node, priced as NCCL.


@dataclass(frozen=True)
class PrimitivePlan:
    """One substitution, decided but not applied."""

    collective: str  # start node name
    kind: CollectiveKind  # the original kind
    form: str  # RS_AG, ROOTED_BROADCASTS or ROOTED_REDUCES
    dim: int  # split dim (rs_ag), gather dim (broadcasts), scatter dim (reduces), logical
    group_size: int
    original_us: float  # predicted time of the original collective
    substitute_us: float  # predicted time of the substitute's collectives (+ local selection adds)

    def describe(self) -> str:
        return (
            f"{self.collective}: {self.kind.value} -> {self.form} (dim {self.dim}, {self.group_size} ranks; "
            f"predicted {self.substitute_us:.1f} us vs {self.original_us:.1f} us)"
        )


# --------------------------------------------------------------------------- feasibility
def _static_shape(shape: Any) -> Optional[tuple[int, ...]]:
    if shape is None or not all(isinstance(s, int) for s in shape):
        return None
    return tuple(shape)


def _why_not_common(c: Collective) -> Optional[str]:
    if c.coalesced or c.inplace:
        return "coalesced or in-place collective"
    if len(c.waits) != 1:
        return "not exactly one wait"
    if c.group.size is None:
        return "group size unknown"
    if c.group.size < 2:
        return "group of one rank: nothing is communicated"
    if not c.input_shapes or _static_shape(c.input_shapes[0]) is None:
        return "input shape not static"
    return None


def _why_not_broadcasts(c: Collective) -> Optional[str]:
    if not c.input_shapes[0]:
        return "0-d all_gather input (no dim to concatenate the broadcasts along)"
    return None


def _why_not_reduces(c: Collective) -> Optional[str]:
    if c.reduce_op not in REDUCE_OPS:
        return f"reduce op {c.reduce_op!r} is not substituted (only {', '.join(REDUCE_OPS)})"
    if c.dtype is None or c.dtype.is_complex or c.dtype == torch.bool:
        return f"dtype {c.dtype} is not a real number type"
    if c.reduce_op == "avg" and not c.dtype.is_floating_point:
        return f"reduce op 'avg' on integer dtype {c.dtype}"
    shape = c.input_shapes[0]
    if not shape or shape[0] % c.group.size:
        return f"dim 0 of input shape {list(shape)} is not divisible by the group size {c.group.size}"
    return None


def why_not(c: Collective, form: Optional[str] = None) -> Optional[str]:
    """Why ``c`` cannot take ``form`` (default: its kind's scalable form); None if it can."""
    if form in NON_SCALABLE:
        return NON_SCALABLE[form]
    expected = SCALABLE_FORM.get(c.kind)
    if expected is None:
        return f"{c.kind.value} has no scalable substitute in Table 2"
    if form is not None and form != expected:
        return f"form {form!r} does not apply to {c.kind.value} (its scalable substitute is {expected!r})"
    why = _why_not_common(c)
    if why is not None:
        return why
    if c.kind is K.ALL_REDUCE:
        return why_not_splittable(c)
    if c.kind is K.ALL_GATHER:
        return _why_not_broadcasts(c)
    return _why_not_reduces(c)


def substitute_forms(c: Collective) -> list[str]:
    """The scalable substitutes ``c`` can take (at most one per kind; empty if none)."""
    form = SCALABLE_FORM.get(c.kind)
    return [form] if form is not None and why_not(c, form) is None else []


# --------------------------------------------------------------------------- cost
def _model(ctx: PassContext) -> Any:
    return ctx.cost.default_model(ctx.ir)[0]


def _collective_us(model: Any, kind: CollectiveKind, size: int, c: Collective) -> float:
    """One collective of ``size`` bytes (nccl-tests convention) on ``c``'s group, priced as the
    estimator prices collectives in a graph (its in-graph overhead included)."""
    t = model.collectives.time(kind, size, c.group.size, ranks=c.group.ranks).time_us
    runtime = getattr(model, "runtime", None)
    extra = getattr(runtime, "collective_in_graph_us", 0.0) or 0.0
    return t + extra if t > 0 else t


def _elementwise_us(model: Any, nbytes: float) -> float:
    """Memory-bound local work moving ``nbytes`` (the reduces' selection adds)."""
    topo = getattr(model, "topology", None)
    bw = getattr(topo, "memory_bandwidth_GBps", None)
    return nbytes / (bw * 1e3) if bw else 0.0


def predict(ctx: PassContext, c: Collective, form: str) -> tuple[float, float]:
    """(original us, substitute us) under the pass's cost model."""
    model = _model(ctx)
    n = c.group.size
    original = model.collective(c).time_us
    in_bytes = concrete(c.input_bytes) or 0
    if form == RS_AG:  # RS of the buffer (total input), AG back to it (total output)
        sub = _collective_us(model, K.REDUCE_SCATTER, in_bytes, c) + _collective_us(
            model, K.ALL_GATHER, in_bytes, c
        )
    elif form == ROOTED_BROADCASTS:  # N broadcasts of one shard each
        sub = n * _collective_us(model, K.BROADCAST, in_bytes, c)
    else:  # N reduces of one slice each, then N-1 adds (read 2, write 1) of the output
        piece = in_bytes // n
        sub = n * _collective_us(model, K.REDUCE, piece, c) + _elementwise_us(model, 3 * (n - 1) * piece)
    return original, sub


def _form_dim(c: Collective, form: str) -> int:
    if form == RS_AG:
        return split_dim(c.input_shapes[0], c.group.size)  # type: ignore[return-value]
    return c.logical_dim if c.logical_dim is not None else 0


def plan_primitive_substitution(
    ctx: PassContext, c: Collective, form: Optional[str] = None
) -> PrimitivePlan | str:
    """Decide ``c``'s substitution without touching the graph; a str is the refusal reason.

    ``form=None``: the scalable form of ``c``'s kind, only if the cost model predicts it
    strictly faster. A form name: that form whenever it is feasible (the caller, e.g. the
    partition search, judges the cost in context); both predictions are in the plan.
    """
    why = why_not(c, form)
    if why is not None:
        return why
    chosen = SCALABLE_FORM[c.kind]
    original, sub = predict(ctx, c, chosen)
    if form is None and not sub < original:
        return (
            f"cost model: {chosen} predicted {sub:.1f} us, not faster than the {c.kind.value} "
            f"({original:.1f} us)"
        )
    return PrimitivePlan(
        collective=c.name,
        kind=c.kind,
        form=chosen,
        dim=_form_dim(c, chosen),
        group_size=c.group.size,
        original_us=original,
        substitute_us=sub,
    )


# --------------------------------------------------------------------------- rewrites
def _broadcasts_body(x, dim, n, group):
    x = x.contiguous()
    starts = [_f.broadcast(x, r, group) for r in range(n)]  # all in flight before the first wait
    return torch.cat([_f.wait_tensor(s) for s in starts], dim)


def _reduces_body(x, dim, n, op, group):
    pieces = torch.chunk(x, n, dim)  # the op copies its input into a fresh contiguous buffer
    starts = [REDUCE_TO_ROOT(p, r, "sum" if op == "avg" else op, n, group) for r, p in enumerate(pieces)]
    outs = [_f.wait_tensor(s) for s in starts]
    acc = outs[0]
    for o in outs[1:]:  # -0.0 from every reduce but this rank's: exact selection
        acc = acc + o
    return acc / n if op == "avg" else acc


def _spliced_starts(first: fx.Node, stop: fx.Node) -> list[fx.Node]:
    out, n = [], first
    while n is not stop:
        if n.op == "call_function" and collective_spec(n.target) is not None:
            out.append(n)
        n = n.next
    return out


def _pin_saved(nodes: list[fx.Node]) -> None:
    # The partitioner never recomputes _c10d_functional ops (force_save_collectives); our
    # custom op is not in that namespace, so pin it the same way.
    from torch.utils.checkpoint import CheckpointPolicy

    for n in nodes:
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _apply_rs_ag(ctx: PassContext, c: Collective) -> list[fx.Node]:
    (wait,) = c.waits
    old, n = set(), c.start.prev
    while True:
        old.add(n)
        if n is wait:
            break
        n = n.next
    after = wait.next  # split_one erases only the wait and its now-dead inputs
    split_one(ctx, c)
    new, n = [], after.prev
    while n not in old:
        new.append(n)
        n = n.prev
    return [m for m in reversed(new) if m.op == "call_function" and collective_spec(m.target) is not None]


def _apply_broadcasts(ctx: PassContext, c: Collective, plan: PrimitivePlan) -> list[fx.Node]:
    (wait,) = c.waits
    n = plan.group_size
    shuffle = match_gather_shuffle(wait, n)  # from the live graph: an earlier rewrite may have changed it
    dim, target = (shuffle.dim, shuffle.outer) if shuffle is not None else (0, wait)
    anchor = wait.prev
    out = rewrite.splice(
        ctx.gm,
        _broadcasts_body,
        [c.start.args[0]],
        consts=(dim, n, c.group.name),
        before=wait,
        meta_from=c.start,
    )
    starts = _spliced_starts(anchor.next, wait)
    target.replace_all_uses_with(out)
    rewrite.erase_dead(ctx.gm, [target])
    return starts


def _apply_reduces(ctx: PassContext, c: Collective, plan: PrimitivePlan) -> list[fx.Node]:
    (wait,) = c.waits
    n = plan.group_size
    src = c.start.args[0]
    shuffle = match_scatter_shuffle(src, n)
    # Chunk the logical input along the scatter dim directly (no dim-0 copy for the shuffle).
    x, dim = (shuffle.outer, shuffle.dim) if shuffle is not None else (src, 0)
    anchor = wait.prev
    out = rewrite.splice(
        ctx.gm, _reduces_body, [x], consts=(dim, n, c.reduce_op, c.group.name), before=wait, meta_from=c.start
    )
    starts = _spliced_starts(anchor.next, wait)
    _pin_saved(starts)
    wait.replace_all_uses_with(out)
    rewrite.erase_dead(ctx.gm, [wait])
    return starts


def apply_primitive_substitution(ctx: PassContext, c: Collective, plan: PrimitivePlan) -> list[fx.Node]:
    """Rewrite ``c`` as ``plan`` says; returns the start nodes of the replacing collectives in
    graph order. No lint / recompile / IR invalidation: the caller does that."""
    if plan.collective != c.name or plan.kind is not c.kind:
        raise ValueError(
            f"plan for {plan.collective} ({plan.kind.value}) applied to {c.name} ({c.kind.value})"
        )
    if plan.form == RS_AG:
        return _apply_rs_ag(ctx, c)
    if plan.form == ROOTED_BROADCASTS:
        return _apply_broadcasts(ctx, c, plan)
    if plan.form == ROOTED_REDUCES:
        return _apply_reduces(ctx, c, plan)
    raise ValueError(f"unknown primitive substitution form {plan.form!r}")


def substitute_all(ctx: PassContext, *, force: bool) -> PassResult:
    """Plan and apply for every collective (``force``: every feasible form, cost model
    consulted only for the report)."""
    counts = {RS_AG: 0, ROOTED_BROADCASTS: 0, ROOTED_REDUCES: 0}
    refusals: list[str] = []
    decisions: list[dict] = []
    for c in list(ctx.ir.collectives):
        if c.kind not in SCALABLE_FORM:
            continue
        plan = plan_primitive_substitution(ctx, c, SCALABLE_FORM[c.kind] if force else None)
        if isinstance(plan, str):
            refusals.append(f"{c.name}: {c.kind.value} kept: {plan}")
            continue
        apply_primitive_substitution(ctx, c, plan)
        counts[plan.form] += 1
        decisions.append(
            {
                "collective": plan.collective,
                "kind": plan.kind.value,
                "form": plan.form,
                "dim": plan.dim,
                "group_size": plan.group_size,
                "original_us": round(plan.original_us, 3),
                "substitute_us": round(plan.substitute_us, 3),
            }
        )
    changed = any(counts.values())
    if changed:
        ctx.gm.graph.lint()
        ctx.gm.recompile()
    return PassResult(changed=changed, counts=counts, refusals=refusals, decisions=decisions)


class PrimitiveSubstitution(GraphPass):
    __doc__ = __doc__
    name = "primitive_substitution"
    stage = Stage.JOINT
    # Centauri primitive substitution (Table 2). Under the standalone cost model the substitutes
    # are predicted slower (same bytes, more launches), so `primitive_substitution` fuzzes its
    # refusal path on the 2 nodes x 2 ranks CPU topology; `primitive_substitution_forced` (same
    # code, cost model not asked) applies every feasible form (rs_ag, rooted broadcasts, rooted
    # reduces) on every family and world size. The reference reduces in canonical order and the
    # rooted reduces' -0.0 adds are exact, so both must be bitwise equal.
    fuzz = FuzzSpec(topology=Topology.preset("cpu-gloo", num_nodes=2), exact=True)

    def run(self, ctx: PassContext) -> PassResult:
        return substitute_all(ctx, force=False)
