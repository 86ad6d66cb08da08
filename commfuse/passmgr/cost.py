"""The cost policy: how every pass prices a candidate rewrite, one object per pass context.

Partition, scheduling and lowering passes compare candidates by predicted time. The price
must be a deterministic function of what every rank shares, never of local timings, so all
ranks pick the same rewrite. The policy:

* With a cost profile (``Config.cost_profile``, written by ``python -m commfuse calibrate``):
  the profile's fitted model on the topology in use. :attr:`model`.
* With a topology (``Config.topology``, ``commfuse.setup(topology=...)``, or detected under
  torchrun): its analytic model (:class:`~commfuse.costmodel.analytic.AnalyticCostModel`),
  priced as NCCL on GPU topologies and as gloo on CPU ones (``num_sms == 0``). :attr:`model`.
* Without one, passes that must refuse say "no topology" (``model`` is None); passes that
  price anyway ask :meth:`CostPolicy.default_model`, the one documented default: the
  DGX-H100 preset (NCCL) with as many 8-rank nodes as the graph's ranks need, or, for a
  question about gloo itself, the cpu-gloo preset with every rank on one node.

Every model the policy hands out prices only the sizes every rank shares
(:meth:`~commfuse.costmodel.analytic.AnalyticCostModel.pricing_shared_only` with
:class:`~commfuse.passmgr.invariance.SharedSizes`): a compute shape that follows from a
data-parallel rank's local batch is not priced, so no pass can decide from it, and symbols take
rank-invariant, bounded hints. ``model.full`` prices every size as traced, for reports only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch.fx as fx

from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.symbol_hints import SymbolHints, balanced_exchange_hints
from commfuse.costmodel.topology import PRESETS, Topology
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.passmgr.invariance import SharedSizes

DEFAULT_PRESET = "dgx-h100"
# gloo questions without a topology: the cpu-gloo preset's figures, every rank on one node
DEFAULT_GLOO_TOPOLOGY = Topology(
    **{**PRESETS["cpu-gloo"], "name": "cpu-gloo-one-node", "ranks_per_node": 4096}
)


def graph_world(ir: CollectiveIR) -> int:
    """The ranks a graph names: the largest group size or rank any of its groups mentions."""
    world = 1
    for g in ir.groups.values():
        world = max(world, g.size or 1, (max(g.ranks) + 1) if g.ranks else 1)
    return world


class CostPolicy:
    def __init__(
        self,
        topology: Optional[Topology],
        *,
        model: Optional[AnalyticCostModel] = None,
        graph: Optional[fx.GraphModule] = None,
        shared: Optional[SharedSizes] = None,
    ) -> None:
        """``model``: price with this estimator (e.g. one built from a calibrated profile) instead of
        the topology's analytic model. ``graph``: the graph priced; the split sizes of its
        data-dependent token exchanges are priced at balanced routing
        (:func:`~commfuse.costmodel.symbol_hints.balanced_exchange_hints`). ``shared``: which sizes
        every rank shares (default: classified with the IR's inferred roles)."""
        self.topology = topology
        self._graph = graph
        self.shared = shared if shared is not None else SharedSizes()
        self._given = model  # hinted for the graph on first use (most contexts never price)
        self._model: Optional[AnalyticCostModel] = None
        self._defaults: dict[tuple[str, int], AnalyticCostModel] = {}

    def _hinted(self, model: AnalyticCostModel) -> AnalyticCostModel:
        hints = balanced_exchange_hints(self._graph) if self._graph is not None else None
        if hints:
            model = model.with_symbol_hints(SymbolHints(hints, int(model.symbol_hint)))
        return model.pricing_shared_only(self.shared.varies)

    def prices(self, node: fx.Node) -> bool:
        """Whether a decision may price ``node``'s size and time: neither it nor an input varies
        across the ranks of a group that splits the batch (:mod:`commfuse.passmgr.invariance`).
        For passes that count work without a model (FLOPs)."""
        varies = self.shared.varies
        return not (varies(node) or any(varies(a) for a in node.all_input_nodes))

    @property
    def backend(self) -> str:
        """The collective library candidates are priced as ("nccl" or "gloo"): a given model's, else
        NCCL on GPU topologies and gloo on CPU ones."""
        if self._given is not None:
            return self._given.backend
        return "nccl" if self.topology is not None and self.topology.is_gpu else "gloo"

    @property
    def model(self) -> Optional[AnalyticCostModel]:
        """The topology's model (None without a topology: callers refuse with "no topology")."""
        if self._model is None:
            if self._given is not None:
                self._model = self._hinted(self._given)
            elif self.topology is not None:
                self._model = self._hinted(AnalyticCostModel(self.topology, backend=self.backend))
        return self._model

    def default_model(self, ir: CollectiveIR, *, backend: str = "nccl") -> tuple[AnalyticCostModel, str]:
        """The topology's model, or the documented default for ``backend``; and its label."""
        if self.model is not None:
            return self.model, self.topology.name if self.topology is not None else "given model"
        if backend == "gloo":
            key = ("gloo", 0)
            if key not in self._defaults:
                self._defaults[key] = self._hinted(AnalyticCostModel(DEFAULT_GLOO_TOPOLOGY, backend="gloo"))
            return self._defaults[key], f"default:{DEFAULT_GLOO_TOPOLOGY.name}"
        preset = Topology.preset(DEFAULT_PRESET)
        nodes = max(1, math.ceil(graph_world(ir) / preset.ranks_per_node))
        key = ("nccl", nodes)
        if key not in self._defaults:
            self._defaults[key] = self._hinted(
                AnalyticCostModel(Topology.preset(DEFAULT_PRESET, num_nodes=nodes), backend="nccl")
            )
        return self._defaults[key], f"default {DEFAULT_PRESET} x{nodes}"


__all__ = ["DEFAULT_GLOO_TOPOLOGY", "DEFAULT_PRESET", "CostPolicy", "graph_world"]
