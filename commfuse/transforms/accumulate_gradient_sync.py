"""accumulate_gradient_sync: sync a gradient once per step instead of once per micro-batch.

Contract
- Matches: in a joint (or backward) graph, a sum (a tree of ``aten.add.Tensor`` nodes without a
  micro-batch tag, as autograd accumulates across micro-batches, every intermediate add used only
  by the next one, no ``alpha``, no broadcasting or type promotion)
  whose terms include >= 2 waited collectives (or a waited collective times a Python number, the
  chain rule's scale, since rs(g) * s == rs(g * s)) of one kind: ``reduce_scatter_tensor`` or
  ``all_reduce`` with reduce op ``sum`` or ``avg``, on the same group, with equal input shape,
  dtype and arguments, each reducing an input traced for a different micro-batch
  (``microbatch_of``), the collective used only by its wait and the wait only by the sum. This is
  what ``compile_train_step`` gives for SimpleFSDP (``fully_shard``: reduce_scatter, ``replicate``:
  all_reduce) with M >= 2 micro-batches: grad = wait(rs(g_1)) + ... + wait(rs(g_M)).
- Does: rewrites the terms to ONE collective of the local sum: acc = g_a + g_b + ... (scaled first
  where the term was scaled; added in the order the graph produces the inputs, each add right
  after its input, so one accumulator buffer lives and each micro-batch gradient is freed as
  soon as it is added), then the collective and its wait right after the last add, so the
  scheduler can overlap it with the rest of the last backward; the sum's other terms are added
  to its result. Gradient-sync bytes of the matched collectives drop by M.
- Memory decision, per match: the accumulator is unsharded (reduce_scatter: group size x the
  result; all_reduce: the size the running reduced sum has anyway) and lives from the first
  input's collective to the last input: ``full - result`` more bytes there, and at each add the
  new sum besides the previous one. The pass adds that to the input graph's live-memory profile
  (the simulator's accounting) and keeps the match only while the profile's peak stays within
  ``Config.schedule_memory_budget`` x the input's peak (or ``Config.schedule_memory_headroom_bytes``
  above it, whichever allows more: the budget the schedulers use); matches are decided in the
  order their collective would issue. It also prices M collectives against one plus the M - 1
  local adds with the cost policy's model (the topology's, or the documented default) and keeps
  a match only if that is faster. Each decision (bytes before/after, extra live bytes, peaks,
  predicted times, kept or why not) is in ``PassResult.decisions``.
- Guarantees: values equal up to float re-association (``sum_i rs(g_i) == rs(sum_i g_i)``:
  reduce_scatter and all_reduce with sum are linear; avg is the sum divided by the group size,
  the same for every term, so it is linear too); every rank takes the same decisions (they depend
  on the graph, the config and the cost model only); the new collective has the same kind, group,
  reduce op, shape and dtype as the ones it replaces, on every rank.
- Leaves alone (each reported): reduce ops other than sum/avg (max, min, premul_sum are not
  linear over micro-batches), in-place or coalesced collectives, collectives whose result or wait
  has other users (the per-micro-batch value is needed), terms of mixed groups / shapes / dtypes
  (each set of equal ones is decided alone), terms without a micro-batch tag or from the same
  micro-batch (merging within one micro-batch is bucketing's job), dynamic shapes, and matches
  over the memory budget or not faster under the cost model.

Source: Centauri §3.2, model level (Eq. 2's backward term: micro-batch gradients summed before
one reduction, which is what makes grouping micro-batches pay off; docs/scheduler.md), and DDP's
``no_sync()`` / FSDP2's ``set_requires_gradient_sync(False)``, which give eager users the same
by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.fx as fx

from commfuse.core.meta import microbatch_of
from commfuse.core.torch_private import c10d_functional
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.simulator import alias_source, buffer_lifetimes, tensor_bytes
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind as K
from commfuse.ir.rewrite import erase_dead, splice
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext

_ADD = torch.ops.aten.add.Tensor
_LINEAR_OPS = ("sum", "avg")
_f = c10d_functional


# ----------------------------------------------------------------- templates (traced by splice)
def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _reduce_scatter(x: torch.Tensor, op: str, n: int, group: str) -> torch.Tensor:
    return _f.wait_tensor(_f.reduce_scatter_tensor(x, op, n, group))


def _all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _f.wait_tensor(_f.all_reduce(x, op, group))


_TEMPLATE = {K.REDUCE_SCATTER: _reduce_scatter, K.ALL_REDUCE: _all_reduce}


# ----------------------------------------------------------------- matching
@dataclass
class _Sum:
    """One add tree: its root and its terms (leaves) in graph order."""

    root: fx.Node
    adds: list[fx.Node]
    leaves: list[fx.Node]


@dataclass
class _Term:
    collective: Collective
    scale: Optional[float]  # the term is the waited result times this number (None: the result itself)


@dataclass
class _Match:
    sum: _Sum
    members: list[Collective]  # sorted by the position of their input
    key: tuple
    terms: list[fx.Node]  # the sum's leaves the members give, in members' order
    scales: list[Optional[float]]
    decision: dict = field(default_factory=dict)


def _is_plain_add(n: Any) -> bool:
    """An add of two tensors outside every micro-batch (autograd's accumulation across micro-batches is
    untagged): only those form the sum, so no add of a micro-batch's own computation is re-associated
    or moved."""
    return (
        isinstance(n, fx.Node)
        and n.op == "call_function"
        and n.target is _ADD
        and not n.kwargs
        and len(n.args) == 2
        and all(isinstance(a, fx.Node) for a in n.args)
        and microbatch_of(n) is None
    )


_MULS = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar)


def _scale_of(n: fx.Node) -> Optional[float]:
    """``s`` if ``n`` is ``x * s`` for a Python number ``s`` (else None)."""
    if (
        n.op == "call_function"
        and n.target in _MULS
        and not n.kwargs
        and len(n.args) == 2
        and isinstance(n.args[0], fx.Node)
        and isinstance(n.args[1], (int, float))
        and not isinstance(n.args[1], bool)
    ):
        return float(n.args[1])
    return None


def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


def _sum_of(add: fx.Node) -> _Sum:
    """The maximal add tree containing ``add``: climb while an add's only user is an add, then collect
    the terms under the root (descending into adds used only by their parent)."""
    root = add
    while len(root.users) == 1:
        (u,) = root.users
        if not _is_plain_add(u):
            break
        root = u
    adds: list[fx.Node] = []
    leaves: list[fx.Node] = []
    stack = [root]
    while stack:
        n = stack.pop()
        adds.append(n)
        for a in n.args:
            if _is_plain_add(a) and len(a.users) == 1:
                stack.append(a)
            else:
                leaves.append(a)
    return _Sum(root, adds, leaves)


def _static_int(v: Any) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _candidate_reason(c: Collective) -> Optional[str]:
    """Why collective ``c`` cannot be a term of a once-per-step sync (None: it can)."""
    if c.kind not in _TEMPLATE:
        return "not a reduce_scatter / all_reduce"
    if c.inplace or c.coalesced or c.synchronous:
        return "in-place, coalesced or synchronous collective"
    if c.reduce_op not in _LINEAR_OPS:
        return f"reduce op {c.reduce_op!r} is not linear over micro-batches (only sum / avg are)"
    if len(c.inputs) != 1 or len(c.waits) != 1 or c.start.kwargs:
        return "not one input and one wait"
    if set(c.start.users) != {c.waits[0]}:
        return "the collective's result is read other than by its wait"
    if _static_int(c.logged_bytes) is None or _static_int(tensor_bytes(c.input_value)) is None:
        return "dynamic shapes"
    return None


def _key(c: Collective) -> tuple:
    val = c.input_value
    return (
        c.kind.value,
        c.group.name,
        c.reduce_op,
        str(c.dtype),
        tuple(getattr(val, "shape", ())),
        tuple(repr(a) for a in c.start.args[1:]),
    )


def _describe(key: tuple) -> str:
    kind, group, op, dtype, shape, _ = key
    return f"{kind}({op}) on group {group}, input {list(shape)} {dtype.replace('torch.', '')}"


# ----------------------------------------------------------------- memory
def _live_profile(
    gm: fx.GraphModule, est: AnalyticCostModel
) -> tuple[np.ndarray, np.ndarray, dict[fx.Node, int]]:
    """Live bytes at each node of the graph's order (the simulator's accounting: allocated when run,
    freed after the last use, views / waits alias their source, outputs stay live), and the bytes
    freed right after each node. Bytes as ``est`` sizes them: only what every rank shares (the
    activations of a data-parallel rank's local batch are not counted, passmgr/invariance.py)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    never = len(nodes) - 1
    owner, last = buffer_lifetimes(nodes, alias_source, never)
    alloc = [est.value_bytes(n) if alias_source(n) is None and n.op != "output" else 0 for n in nodes]
    frees = np.zeros(len(nodes) + 1)
    for o, i in last.items():
        if i < never and o in pos:
            frees[i + 1] += alloc[pos[o]]
    live = np.cumsum(np.array(alloc, dtype=float)) - np.cumsum(frees[: len(nodes)])
    return live, frees[1:], pos


def _accumulator_bytes(c: Collective, est: AnalyticCostModel) -> tuple[int, int]:
    """Bytes of the unsharded accumulator (the collective's input) and of the per-micro-batch result
    it replaces, as ``est`` sizes them (see :func:`_live_profile`)."""
    return est.value_bytes(c.inputs[0]), est.value_bytes(c.waits[0])


def _memory_delta(
    m: "_Match", live: np.ndarray, freed_after: np.ndarray, pos: dict[fx.Node, int], est: AnalyticCostModel
) -> np.ndarray:
    """How the rewrite changes the live bytes at each position of the input order. The first
    input stays live as the accumulator past its own collective, to the last input: ``full -
    result`` (the running sharded sum it replaces) on that interval. At each later input the
    new sum is allocated while the previous sum and the input are still live: ``full`` more
    there, on top of the bytes live once the input's own operands are freed."""
    c0 = m.members[0]
    full, result = _accumulator_bytes(c0, est)
    delta = np.zeros_like(live)
    lo, hi = pos[c0.start] + 1, pos[m.members[-1].inputs[0]]
    delta[lo : hi + 1] += full - result
    for c in m.members[1:]:
        p = pos[c.inputs[0]]
        # the add's moment: what is live after the input's operands are freed, plus the new sum
        at_add = live[p] - freed_after[p] + delta[p] + full
        delta[p] = max(delta[p], at_add - live[p])
    return delta


class AccumulateGradientSync(GraphPass):
    __doc__ = __doc__
    name = "accumulate_gradient_sync"
    # It changes what is communicated (M collectives become one), so it runs on the joint graph.
    stage = Stage.JOINT
    # The fsdp family's parameter gathers have reduce_scatter gradients; micro-batched joint programs
    # sum them across 2-3 tagged micro-batches, the pattern this pass matches. Re-associated sums.
    fuzz = FuzzSpec(generators=("fsdp",), microbatches=True)

    def run(self, ctx: PassContext) -> PassResult:
        ir = ctx.ir
        refusals: list[str] = []
        # A term of the sum: the waited result, or that result times a number (a chain-rule scale,
        # rs(g) * s == rs(g * s)), each only read by the sum.
        by_term: dict[fx.Node, _Term] = {}
        for c in ir.collectives:
            if c.kind not in _TEMPLATE or not c.waits:
                continue
            why = _candidate_reason(c)
            users = list(c.waits[0].users)
            term, scale = c.waits[0], None
            if len(users) == 1 and _scale_of(users[0]) is not None and users[0].args[0] is term:
                term, scale = users[0], _scale_of(users[0])
            term_users = list(term.users)
            in_sum = any(_is_plain_add(u) for u in term_users)
            if why is None and in_sum and len(term_users) != 1:
                why = (
                    "its waited result has other users than the sum ("
                    + ", ".join(u.name for u in term_users)
                    + ")"
                )
            if why is None and in_sum:
                by_term[term] = _Term(c, scale)
            elif in_sum:
                refusals.append(f"{c.name}: {why}")
        if not by_term:
            return PassResult(
                changed=False,
                counts={"sums_rewritten": 0},
                refusals=refusals or ["no sum of waited reduce_scatter / all_reduce results"],
            )

        matches = self._matches(by_term, refusals)
        if not matches:
            return PassResult(changed=False, counts={"sums_rewritten": 0}, refusals=refusals)

        est, est_name = ctx.cost.default_model(ir)
        profile, freed_after, pos = _live_profile(ctx.gm, est)
        peak = float(profile.max()) if len(profile) else 0.0
        cfg = ctx.config
        limit = max(cfg.schedule_memory_budget * peak, peak + (cfg.schedule_memory_headroom_bytes or 0))
        added = np.zeros_like(profile)
        bw_bytes_per_us = est.topology.memory_bandwidth_GBps * 1e3
        kept: list[_Match] = []
        # Decided in the order the merged collectives would issue (after their last input).
        for m in sorted(matches, key=lambda m: pos[m.members[-1].inputs[0]]):
            c0 = m.members[0]
            n_terms = len(m.members)
            full, result = _accumulator_bytes(c0, est)
            extra = max(0, full - result)
            trial = added + _memory_delta(m, profile, freed_after, pos, est)
            peak_after = float((profile + trial).max())
            one = est.collective(c0)
            before_us = sum(float(est.collective(c).time_us) for c in m.members)
            adds_us = (n_terms - 1) * 3 * full / bw_bytes_per_us  # read two, write one per local add
            after_us = float(one.time_us) + adds_us
            d = {
                "collectives": [c.name for c in m.members],
                "kind": c0.kind.value,
                "reduce_op": c0.reduce_op,
                "group": c0.group.name,
                "microbatches": [microbatch_of(c.inputs[0]) for c in m.members],
                "input_shape": list(_key(c0)[4]),
                "dtype": str(c0.dtype),
                "logged_bytes_before": sum(_static_int(c.logged_bytes) for c in m.members),
                "logged_bytes_after": _static_int(c0.logged_bytes),
                "wire_bytes_before": sum(int(est.collective(c).wire_bytes) for c in m.members),
                "wire_bytes_after": int(one.wire_bytes),
                "extra_live_bytes": extra,
                "peak_bytes_before": int(peak),
                "peak_bytes_after": int(peak_after),
                "peak_limit_bytes": int(limit),
                "time_before_us": round(before_us, 3),
                "time_after_us": round(after_us, 3),
                "cost_model": est_name,
            }
            reason = None
            if peak_after > limit and peak_after > float((profile + added).max()):
                reason = (
                    f"memory budget: the unsharded accumulator (+{extra} B from the first micro-batch's "
                    f"gradient to the last) raises the peak to {int(peak_after)} B, above the limit "
                    f"{int(limit)} B (schedule_memory_budget={cfg.schedule_memory_budget} x {int(peak)} B"
                    + (
                        f", headroom {cfg.schedule_memory_headroom_bytes} B"
                        if cfg.schedule_memory_headroom_bytes
                        else ""
                    )
                    + ")"
                )
            elif after_us >= before_us:
                reason = (
                    f"not faster: {n_terms} collectives {before_us:.1f} us vs one + {n_terms - 1} local adds "
                    f"{after_us:.1f} us ({est_name})"
                )
            d["kept"] = reason is None
            if reason is None:
                added = trial
                kept.append(m)
            else:
                d["reason"] = reason
                refusals.append(f"{', '.join(d['collectives'])}: {reason}")
            m.decision = d

        for root in {id(m.sum.root): m.sum for m in kept}.values():
            self._rewrite(ctx.gm, root, [m for m in kept if m.sum is root])
        decisions = [m.decision for m in sorted(matches, key=lambda m: pos[m.members[-1].inputs[0]])]
        counts = {
            "sums_rewritten": len(kept),
            "collectives_removed": sum(len(m.members) - 1 for m in kept),
            "logged_bytes_saved": sum(
                m.decision["logged_bytes_before"] - m.decision["logged_bytes_after"] for m in kept
            ),
            "refused_over_budget": sum(
                1 for m in matches if m.decision.get("reason", "").startswith("memory")
            ),
        }
        return PassResult(changed=bool(kept), counts=counts, refusals=refusals, decisions=decisions)

    # -- matching
    def _matches(self, by_term: dict[fx.Node, _Term], refusals: list[str]) -> list[_Match]:
        sums: dict[fx.Node, _Sum] = {}
        for t in by_term:
            (add,) = t.users
            s = _sum_of(add)
            sums.setdefault(s.root, s)
        matches: list[_Match] = []
        for s in sums.values():
            out_val = s.root.meta.get("val")
            if not all(
                isinstance(a.meta.get("val"), torch.Tensor)
                and a.meta["val"].shape == out_val.shape
                and a.meta["val"].dtype == out_val.dtype
                for a in s.adds + s.leaves
                if isinstance(a, fx.Node)
            ):
                refusals.append(f"sum {s.root.name}: its adds broadcast or promote types")
                continue
            groups: dict[tuple, list[fx.Node]] = {}
            for leaf in s.leaves:
                t = by_term.get(leaf)
                if t is None:
                    continue
                if s.leaves.count(leaf) > 1:  # a term added twice (x + x) stays as it is
                    refusals.append(
                        f"{t.collective.name}: its result is a term of sum {s.root.name} more than once"
                    )
                    continue
                groups.setdefault(_key(t.collective), []).append(leaf)
            order = {n: i for i, n in enumerate(s.root.graph.nodes)}
            for key, terms in groups.items():
                members = [by_term[t].collective for t in terms]
                names = ", ".join(c.name for c in members)
                if len(members) < 2:
                    refusals.append(
                        f"{names} (sum {s.root.name}): no other term of the same kind, group, reduce "
                        f"op, shape and dtype ({_describe(key)})"
                    )
                    continue
                tags = [microbatch_of(c.inputs[0]) for c in members]
                if any(t is None for t in tags):
                    refusals.append(
                        f"{names} (sum {s.root.name}): an input without a micro-batch tag; not gradient "
                        f"accumulation across micro-batches"
                    )
                    continue
                if len(set(tags)) != len(tags):
                    refusals.append(
                        f"{names} (sum {s.root.name}): inputs from the same micro-batch ({tags}); "
                        f"merging within a micro-batch is bucketing's job"
                    )
                    continue
                terms.sort(key=lambda t: order[by_term[t].collective.inputs[0]])
                matches.append(
                    _Match(
                        s,
                        [by_term[t].collective for t in terms],
                        key,
                        terms,
                        [by_term[t].scale for t in terms],
                    )
                )
        return matches

    # -- rewrite
    @staticmethod
    def _rewrite(gm: fx.GraphModule, s: _Sum, matches: list[_Match]) -> None:
        replaced: set[fx.Node] = set()  # the sum's leaves the merged collectives stand for
        outs: list[fx.Node] = []
        for m in matches:
            acc = None
            for c, scale in zip(m.members, m.scales, strict=True):
                x = c.inputs[0]
                if scale is not None:
                    x = splice(gm, _scale, [x], consts=(scale,), before=x.next, meta_from=s.root)
                acc = x if acc is None else splice(gm, _add, [acc, x], before=x.next, meta_from=s.root)
            c0 = m.members[0]
            out = splice(
                gm,
                _TEMPLATE[c0.kind],
                [acc],
                consts=tuple(c0.start.args[1:]),
                before=acc.next,
                meta_from=s.root,
            )
            outs.append(out)
            replaced.update(m.terms)
        terms = [leaf for leaf in s.leaves if leaf not in replaced] + outs
        new_root = terms[0]
        for t in terms[1:]:
            new_root = splice(gm, _add, [new_root, t], before=s.root, meta_from=s.root)
        s.root.replace_all_uses_with(new_root)
        erase_dead(gm, [s.root])
