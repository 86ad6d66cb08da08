"""The step-time gate: a pass's rewrite is kept only when the cost model predicts the graph is
not slower with it.

Passes decide by their own criteria -- fewer bytes on the wire, fewer collectives, a chosen
order -- and those criteria can disagree with the step time: replacing one all_reduce by a
reduce_scatter and an all_gather moves fewer bytes but pays two latencies, which on a
latency-bound graph makes the step slower. So after every changing pass (a nested pipeline such
as Chimera is one decision: its steps only pay together) the pipeline prices the graph before and after
with one estimator on the simulator's timeline (``Simulator(...).simulate().makespan_us``)
and restores the graph when the prediction got worse. The verdict is recorded with the
pass's decisions (``{"gate": "kept" | "reverted", "predicted_before_us", ...}``), so a
report says, per decision, what the model predicted.

The estimator is the cost policy's (:class:`~commfuse.passmgr.cost.CostPolicy`): a calibrated
profile or the topology's model when there is one; without, the documented default for the
graph's collective library -- gloo's preset when its collectives work on CPU tensors, the
DGX-H100 preset otherwise. Ranks need not hold the same graph: a data-parallel rank's compute
shapes follow from its own local batch (static on one rank, symbolic on another). The policy's
model prices only what every rank of the graph's groups shares (``passmgr/invariance.py``: the
collectives' sizes, the compute on parameters and on collective operands, symbols at
rank-invariant bounded hints; not the compute and activations of the local batch), so every
rank predicts the same two numbers and keeps or reverts the same rewrite.

A rewrite predicted slower is reverted, by any margin: predictions count as equal only within
the float rounding of the simulator's sums (:data:`EQUAL_WITHIN_REL`), never a share of the step
large enough to hide a real slowdown. A graph the model cannot price keeps the rewrite on its
pass's own criteria, and the decision says "kept (not priced)" and why.

Exempt passes, each with its reason in its class: a pass opts out with ``gated = False`` only
when its change is not a trade the step time judges -- the forced variants
(:mod:`commfuse.fuzz.forced`), which exist to apply a rewrite regardless so the fuzzer checks it.
No product pass is exempt. The steps of a nested pipeline (Chimera) are judged together as one
change. ``Config.step_time_gate=False`` turns the gate off (an explicit ``Config.passes`` list
is not gated unless it is set to True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.simulator import Simulator
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.context import PassContext

# Predictions equal up to the rounding of the simulator's float sums count as equal, so a rewrite
# that only changes that rounding is kept: float64 sums of at most ~1e6 terms stay within 1e-9
# relative. Nothing looser: a share of the step (a millionth of a step priced at minutes is
# hundreds of microseconds) would keep rewrites the model predicts slower.
EQUAL_WITHIN_REL = 1e-9
EQUAL_WITHIN_US = 1e-9


@dataclass(frozen=True)
class GateVerdict:
    kept: bool
    before_us: Optional[float]
    after_us: Optional[float]
    priced_with: str
    # set when the graph could not be priced: the rewrite is then kept on its pass's criteria
    unpriced: Optional[str] = None

    def decision(self) -> dict:
        out: dict = {"gate": "kept" if self.kept else "reverted", "priced_with": self.priced_with}
        if self.unpriced is not None:
            out["gate"] = "kept (not priced)"
            out["why"] = self.unpriced
            return out
        assert self.before_us is not None and self.after_us is not None  # priced (unpriced is None)
        out["predicted_before_us"] = round(self.before_us, 3)
        out["predicted_after_us"] = round(self.after_us, 3)
        return out

    def refusal(self) -> str:
        return (
            f"rewrite reverted: predicted {self.after_us:.1f} us with it vs {self.before_us:.1f} us without "
            f"({self.priced_with})"
        )


def _runs_on_cpu(ir: CollectiveIR) -> bool:
    """The graph's collectives run on CPU tensors (gloo): the first one with a known device says."""
    known = (t for t in (c.device_type for c in ir.collectives) if t is not None)
    return next(known, None) == "cpu"


def gate_model(ctx: PassContext) -> tuple[AnalyticCostModel, str]:
    """The estimator the gate prices ``ctx``'s graph with, and its label for reports."""
    backend = "gloo" if ctx.cost.model is None and _runs_on_cpu(ctx.ir) else "nccl"
    return ctx.cost.default_model(ctx.ir, backend=backend)


def predicted_us(gm: fx.GraphModule, model: AnalyticCostModel, ir: Optional[CollectiveIR] = None) -> float:
    return float(Simulator(gm, model, ir=ir).simulate(memory=False, record=False).makespan_us)


def judge(ctx: PassContext, before: fx.GraphModule, before_ir: Optional[CollectiveIR] = None) -> GateVerdict:
    """Compare ``before`` (the graph as it was) with ``ctx.gm`` (the graph the pass left)."""
    model, label = gate_model(ctx)
    try:
        b = predicted_us(before, model, before_ir)
        a = predicted_us(ctx.gm, model, ctx.ir)
    except Exception as e:  # noqa: BLE001 - an unpriceable graph keeps the pass's own decision
        return GateVerdict(True, None, None, label, unpriced=f"{type(e).__name__}: {e}")
    return GateVerdict(a <= b + max(EQUAL_WITHIN_US, EQUAL_WITHIN_REL * abs(b)), b, a, label)


__all__ = ["EQUAL_WITHIN_REL", "EQUAL_WITHIN_US", "GateVerdict", "gate_model", "judge", "predicted_us"]
