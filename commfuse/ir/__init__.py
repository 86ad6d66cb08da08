"""commfuse's collective IR: a typed, read-only view over FX graphs."""

from commfuse.ir.collective import Collective, GroupInfo, ParallelRole
from commfuse.ir.dims import DimType, DimTypeAnalysis, NodeDims, OpCategory
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.ir.kinds import (
    CollectiveKind,
    CollectiveOpSpec,
    collective_spec,
    is_wait,
    register_collective_op,
)

__all__ = [
    "Collective",
    "CollectiveIR",
    "CollectiveKind",
    "CollectiveOpSpec",
    "DimType",
    "DimTypeAnalysis",
    "GroupInfo",
    "IRBuildOptions",
    "NodeDims",
    "OpCategory",
    "ParallelRole",
    "collective_spec",
    "is_wait",
    "register_collective_op",
]
