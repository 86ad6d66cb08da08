"""sink_waits: move every wait_tensor to just before the first use of its result.

Contract
- Matches: every `wait_tensor` of a non-in-place collective in a scheduled
  (forward/backward/inference) graph.
- Does: moves the wait down to immediately before its earliest user (or before
  the graph output). Compute that does not need the collective's result then
  runs while the collective is in flight.
- Guarantees: no collective is added, removed or reordered (per-group sequences
  and the total issue order are unchanged, so the rewrite is rank-agnostic);
  values are unchanged; the wait still precedes every use of its result.
- Never sinks a wait past an op that mutates memory (`copy_`, in-place ops, input
  mutations AOTAutograd appends): the collective may still be reading its input.
- Leaves alone: in-place collectives (`all_reduce_`, `broadcast_`): their input
  buffer is the result, and other readers of that buffer may sit between the
  collective and its wait.

Source: the "issue early, wait late" rule of latency-hiding schedulers (Inductor
`comms.sink_waits`, XLA's latency-hiding scheduler); Centauri §3.2 builds its
operation-level overlap on it.
"""

from __future__ import annotations

import bisect

import torch.fx as fx

from commfuse.ir.kinds import is_wait
from commfuse.ir.rewrite import mutates
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext


class SinkWaits(GraphPass):
    __doc__ = __doc__
    name = "sink_waits"
    stage = Stage.SCHEDULE
    # sink_waits only moves waits: every value bitwise identical and the collective sequence
    # untouched (its contract), on every family.
    fuzz = FuzzSpec(exact=True, keeps_collective_order=True)

    def run(self, ctx: PassContext) -> PassResult:
        graph = ctx.gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        # Positions of memory-mutating nodes, sorted: the barrier search is a bisect, so the
        # pass stays O(n log n) on deep graphs. Positions are those before any move; waits
        # only move down past non-mutating nodes, so the relative order of the rest holds.
        mutations = [order[n] for n in graph.nodes if mutates(n)]
        by_pos = {order[n]: n for n in graph.nodes}
        inplace_waits = {w for c in ctx.ir.collectives if c.inplace for w in c.waits}
        moved = 0
        skipped_inplace = 0
        waits = [n for n in graph.nodes if n.op == "call_function" and is_wait(n.target)]
        for w in waits:
            if w in inplace_waits:
                skipped_inplace += 1
                continue
            if not w.users:
                continue
            target = min(w.users, key=lambda u: order[u])
            barrier = _first_mutation_between(order[w], order[target], mutations, by_pos)
            if barrier is not None:
                target = barrier
            if w.next is target:
                continue
            target.prepend(w)
            moved += 1
        refusals = (
            [f"{skipped_inplace} wait(s) of in-place collectives left in place"] if skipped_inplace else []
        )
        return PassResult(changed=moved > 0, counts={"waits_sunk": moved}, refusals=refusals)


def _first_mutation_between(
    start: int, end: int, mutations: list[int], by_pos: dict[int, fx.Node]
) -> fx.Node | None:
    i = bisect.bisect_right(mutations, start)
    return by_pos[mutations[i]] if i < len(mutations) and mutations[i] < end else None
