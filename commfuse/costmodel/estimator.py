"""The interface between the cost models and their users (simulator, passes).

The simulator and the scheduling/partitioning passes only ask two questions, so any
model (analytic, calibrated, or a test double) that answers them can drive them:

* how long does this compute node take (microseconds, on one rank)?
* how long does this collective take, and how many bytes does each rank send?

Implementations must be deterministic functions of the graph, the topology and the
profile file: every rank must get the same answers (decisions made from them change
the collective order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.fx as fx

from commfuse.ir.collective import Collective


@dataclass(frozen=True)
class CollectiveEstimate:
    time_us: float
    wire_bytes: int  # bytes each rank sends (ring/tree conventions of the chosen algorithm)
    algorithm: str  # e.g. "ring", "tree", "hierarchical", "gloo-allreduce-emulation"


class CostEstimator(Protocol):
    def compute_time_us(self, node: fx.Node) -> float:
        """Time of one compute node on one rank (0 for views and other free ops)."""
        ...

    def collective(self, c: Collective) -> CollectiveEstimate:
        """Time and wire bytes of one collective on its group."""
        ...
