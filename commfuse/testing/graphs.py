"""Capture the graphs a backend sees, for tests and benchmarks.

`capture_aot_graphs(module, *inputs)` compiles `module` with an AOTAutograd
backend that records the joint graph (before partitioning), the forward and the
backward graph, runs one forward+backward (or forward only when nothing needs a
gradient), and returns copies of the three GraphModules. Works with the `fake`
process group: graphs for any world size without communication.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from commfuse.core.torch_private import aot_autograd, make_boxed_func


@dataclass
class CapturedGraphs:
    joint: Optional[fx.GraphModule] = None
    forward: Optional[fx.GraphModule] = None
    backward: Optional[fx.GraphModule] = None
    inference: Optional[fx.GraphModule] = None
    outputs: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> fx.GraphModule:
        gm = getattr(self, kind)
        if gm is None:
            raise KeyError(f"no {kind} graph was captured")
        return gm


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = dict(gm.meta)
    return new


def capture_aot_graphs(
    module: Callable[..., Any],
    *inputs: Any,
    backward: bool = True,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> CapturedGraphs:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    got = CapturedGraphs()

    def partition(joint, joint_inputs, **kw):
        got.joint = _copy(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kw)

    def recorder(kind: str):
        def compiler(gm, _inputs):
            setattr(got, kind, _copy(gm))
            return make_boxed_func(gm.forward)

        return compiler

    be = aot_autograd(
        fw_compiler=recorder("forward"),
        bw_compiler=recorder("backward"),
        inference_compiler=recorder("inference"),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=be, fullgraph=True)
    out = compiled(*inputs)
    got.outputs = out
    if backward:
        value = loss(out) if loss is not None else _default_loss(out)
        value.backward()
    return got


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        t = out.to_local() if hasattr(out, "to_local") else out
        return t.float().sum()
    if isinstance(out, (tuple, list)):
        return sum(_default_loss(o) for o in out if isinstance(o, torch.Tensor))
    raise TypeError(f"cannot build a default loss from {type(out)}")
