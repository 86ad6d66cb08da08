"""What a pass sees: the graph, the config, the topology and cached analyses."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, TypeVar

import torch.fx as fx

from commfuse.config import Config
from commfuse.costmodel.topology import Topology
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions

T = TypeVar("T")
log = logging.getLogger("commfuse")


class PassContext:
    """Analyses are computed on first use and dropped when a pass changes the graph."""

    def __init__(
        self,
        gm: fx.GraphModule,
        config: Config,
        *,
        graph_kind: str = "graph",
        topology: Optional[Topology] = None,
        group_roles: Optional[dict[str, str]] = None,
        role_sources: Optional[dict[str, str]] = None,
    ) -> None:
        self.gm = gm
        self.config = config
        self.graph_kind = graph_kind
        self.topology = topology
        self._ir_options = IRBuildOptions(group_roles=group_roles or {}, role_sources=role_sources or {})
        self._analyses: dict[str, Any] = {}

    @property
    def ir(self) -> CollectiveIR:
        return self.analysis("collective_ir", lambda gm: CollectiveIR(gm, self._ir_options))

    def analysis(self, key: str, build: Callable[[fx.GraphModule], T]) -> T:
        if key not in self._analyses:
            self._analyses[key] = build(self.gm)
        return self._analyses[key]

    def invalidate(self) -> None:
        self._analyses.clear()

    @property
    def ir_options(self) -> IRBuildOptions:
        return self._ir_options
