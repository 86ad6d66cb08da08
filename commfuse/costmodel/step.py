"""Full training step: the graphs' simulated makespans plus what the runtime adds around them.

What it models
    One training step of a ``torch.compile``-d model (forward graph, eager loss,
    backward graph) on one rank::

        step = step_fixed_us
             + param_us x (plain parameters) + dtensor_param_us x (DTensor parameters)
             + sum over graphs of simulate(graph).makespan_us

    * ``sum of makespans``: the forward and backward graphs run one after the
      other on the rank's one compute stream (the autograd engine starts the
      backward graph after the loss), each simulated by :mod:`.simulator` with the
      estimator the caller passes. On CPU/gloo that estimator should include
      `RuntimeParams.collective_in_graph_us` (`AnalyticCostModel` built from a
      calibrated profile does): a collective issued between compute ops of a
      running graph costs more than one of a back-to-back sweep.
    * ``step_fixed_us``: runtime that does not grow with the model: Dynamo's guard
      evaluation and frame entry, AOTAutograd's runtime wrappers around the two
      graph calls, starting the autograd engine, a small eager loss, the Python of
      the training loop.
    * ``param_us`` / ``dtensor_param_us``: runtime per trainable parameter tensor:
      unwrapping it at the forward boundary (for a DTensor: ``__tensor_flatten__``,
      its spec), creating its gradient at the backward boundary (for a DTensor:
      wrapping the local gradient, the autograd ``AccumulateGrad`` node) and
      dropping it before the next step. Calibration measures both kinds.

    All four numbers come from :class:`RuntimeParams` in the cost profile, which
    ``commfuse calibrate`` measures on synthetic programs (see
    :mod:`commfuse.tools.calibrate`); for GPU presets they default to 0 (not measured: NCCL
    runtimes overlap the host work with the device).

Parameters counted
    ``params`` / ``dtensor_params`` are the model's trainable parameter tensors
    (the caller knows the module). When the caller does not say, every tensor the
    backward graph returns a gradient for counts as one plain parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch.fx as fx
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat

from commfuse.costmodel.estimator import CostEstimator
from commfuse.costmodel.simulator import SimResult, Simulator, SlowdownFn, StreamAssignment

__all__ = ["RuntimeParams", "StepPrediction", "gradient_outputs", "predict_step"]


class RuntimeParams(BaseModel):
    """What the eager runtime adds around and inside the graphs (calibrated; 0 = not modelled)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    collective_in_graph_us: NonNegativeFloat = Field(
        default=0.0,
        description="extra time of a collective issued between compute ops of a running graph, over "
        "the back-to-back price of the collective fits (thread wake-ups, rank skew)",
    )
    step_fixed_us: NonNegativeFloat = Field(
        default=0.0,
        description="per training step outside the graphs: guards, AOTAutograd wrappers, autograd "
        "engine start, eager loss, loop",
    )
    param_us: NonNegativeFloat = Field(
        default=0.0, description="per plain trainable parameter tensor per step (unwrap, gradient, reset)"
    )
    dtensor_param_us: NonNegativeFloat = Field(
        default=0.0,
        description="per DTensor trainable parameter per step (flatten/unflatten, gradient wrap, reset)",
    )

    @property
    def modelled(self) -> bool:
        return any((self.collective_in_graph_us, self.step_fixed_us, self.param_us, self.dtensor_param_us))


@dataclass
class StepPrediction:
    """Predicted time of one training step and its parts (microseconds)."""

    total_us: float
    graphs_us: float  # sum of the graphs' makespans
    runtime_us: float  # step_fixed + per-parameter terms
    params: int
    dtensor_params: int
    graphs: dict[str, SimResult] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "total_us": self.total_us,
            "graphs_us": self.graphs_us,
            "runtime_us": self.runtime_us,
            "params": self.params,
            "dtensor_params": self.dtensor_params,
            "graphs": {k: v.summary() for k, v in self.graphs.items()},
        }


def gradient_outputs(gm: fx.GraphModule) -> int:
    """Tensors a backward graph returns (gradients; ``None`` outputs do not count)."""
    out = gm.graph.output_node().args[0]
    outs = out if isinstance(out, (list, tuple)) else [out]
    return sum(1 for o in outs if isinstance(o, fx.Node))


def predict_step(
    graphs: Union[Mapping[str, fx.GraphModule], Sequence[fx.GraphModule]],
    estimator: CostEstimator,
    runtime: Optional[RuntimeParams] = None,
    *,
    params: Optional[int] = None,
    dtensor_params: int = 0,
    streams: Optional[StreamAssignment] = None,
    slowdown: Optional[SlowdownFn] = None,
) -> StepPrediction:
    """Predict one training step from its graphs (see the module docstring).

    ``graphs``: ``{"forward": gm, "backward": gm}`` (or a list), simulated one after
    the other. ``runtime``: default the estimator's own (``AnalyticCostModel.runtime``),
    else none. ``params``: trainable parameter tensors that are not DTensors;
    ``dtensor_params`` those that are. ``params=None``: the backward graph's
    gradient outputs minus ``dtensor_params``."""
    named = dict(graphs) if isinstance(graphs, Mapping) else {f"graph{i}": g for i, g in enumerate(graphs)}
    if runtime is None:
        runtime = getattr(estimator, "runtime", None) or RuntimeParams()
    if params is None:
        grads = sum(gradient_outputs(g) for k, g in named.items() if k == "backward")
        params = max(0, grads - dtensor_params)
    sims = {k: Simulator(g, estimator, streams, slowdown=slowdown).simulate() for k, g in named.items()}
    graphs_us = sum(s.makespan_us for s in sims.values())
    runtime_us = runtime.step_fixed_us + runtime.param_us * params + runtime.dtensor_param_us * dtensor_params
    return StepPrediction(graphs_us + runtime_us, graphs_us, runtime_us, params, dtensor_params, sims)
