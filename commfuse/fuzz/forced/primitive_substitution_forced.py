"""primitive_substitution_forced: every feasible scalable substitute of Table 2, cost model not asked.

Contract
- Matches: what ``primitive_substitution`` matches (all_reduce, all_gather, reduce_scatter;
  same refusals, one line each).
- Does: applies the scalable substitute of every feasible collective (``rs_ag``,
  ``rooted_broadcasts``, ``rooted_reduces``) whatever the cost model predicts; the
  predictions are still reported in ``decisions``. Standalone the substitutes are
  predicted slower (the same bytes in more launches), so it is test-only: not in the
  product pass table (registered by :func:`commfuse.fuzz.forced.register_forced_passes`).
- Why it exists: ``primitive_substitution`` almost never fires on its own, so neither
  the fuzzer nor a compiled program would exercise the rooted forms through the ordinary
  pipeline. This name does, with the same code (``substitute_all(force=True)``).
- Guarantees: those of ``primitive_substitution`` (values equal up to reduction order;
  bitwise on the reference interpreter; same decision on every rank: it depends on the
  graph only).
- Leaves alone: what ``primitive_substitution`` refuses for feasibility.

Source: Centauri (ASPLOS '24) §3.1, Table 2.
"""

from __future__ import annotations

from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms.primitive_substitution import substitute_all


class PrimitiveSubstitutionForced(GraphPass):
    __doc__ = __doc__
    name = "primitive_substitution_forced"
    gated = False  # forced: applies its rewrite whatever the prediction (what it exists for)
    stage = Stage.JOINT
    fuzz = FuzzSpec(exact=True)

    def run(self, ctx: PassContext) -> PassResult:
        return substitute_all(ctx, force=True)
