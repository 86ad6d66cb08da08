"""Partition the joint graph of a pipeline into one GraphModule per (stage, phase).

Contract
- Input: a joint graph from :func:`commfuse.pipeline.trace.trace_joint` (inputs described
  by ``InputSpec``s, outputs ``(loss, *grads)``) and the layout.
- Phase: a node is *forward* iff it comes no later than the loss in graph order (make_fx
  records the whole forward before ``autograd.grad`` starts), else *backward*.
- Stage, propagated in graph order from ownership: a parameter/buffer of stage s -> s,
  ``x`` -> 0, ``target`` and ``grad_seed`` -> last stage. A *transfer* node
  (``commfuse::stage_transfer`` / ``m2ms`` and their autograd forms) on boundary group b
  reads a value of the stage holding its ``src`` ranks and produces a value of the stage
  holding its ``dst`` ranks; its ``wait_tensor`` goes with it. Any other node takes the
  stage of its inputs. Transfers are the only edges that may cross stages: a node reading
  values of two stages raises :class:`PartitionError` naming the node and, per stage, the
  inputs it reads. Nodes with no stage-owned input (constants: ``zeros``, ``arange``,
  ``full``, ...) take their users' stages: they are copied into every part that reads
  them (a constant that is a collective, or a random op, is refused).
- Parts: part ``(s, "fw")`` holds the forward nodes of stage s, ``(s, "bw")`` the backward
  ones. A transfer node is placed in BOTH the sender's and the receiver's part of its
  phase, in graph order, so both ranks make the same op call: the sender's part passes
  the real tensor and returns the un-waited result as a *pending send* (the runner waits
  it at the end of the step; see runner.py for why), the receiver's part passes a
  ``zeros`` tensor of the traced shape (for an m2ms whose receiving stage is not a source:
  size 0 along ``dim``) and waits the result before using it.
- Values the backward part of stage s reads from its forward part are forward outputs
  ("saved", kept per micro-batch by the runner). Other part inputs are graph inputs
  (parameters, buffers, ``x``, ``target``, ``grad_seed``). Each gradient output must be
  computed by the backward part of its parameter's stage (or be a constant).
- Guarantees: every node of the joint graph lands in exactly one part (transfers and
  their waits in two, constants in each reader); the parts' op calls, taken together per
  stage and phase, are the joint graph's; each part's code is readable (``write_dumps``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
import torch.fx as fx

from commfuse.core.errors import CommfuseError
from commfuse.core.torch_private import c10d_functional
from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.ops import (
    M2MS,
    M2MS_AUTOGRAD,
    STAGE_TRANSFER,
    STAGE_TRANSFER_AUTOGRAD,
    parse_m2ms,
    parse_stage_transfer,
)
from commfuse.pipeline.layout import PipelineLayout
from commfuse.pipeline.trace import InputSpec, PipelineProgram

FW, BW = "fw", "bw"
TRANSFER_OPS = (STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, M2MS, M2MS_AUTOGRAD)
_ASYNC_TRANSFERS = (STAGE_TRANSFER, M2MS)


class PartitionError(CommfuseError, ValueError):
    """The joint graph cannot be cut into stages (the message names the nodes)."""


@dataclass(frozen=True)
class Transfer:
    """A transfer node of the joint graph: which stage sends, which receives, in which phase."""

    node: str
    src_stage: int
    dst_stage: int
    phase: str
    wait: Optional[str]  # its wait_tensor (async form), None for the synchronous form


# What a part's placeholder / output is.
@dataclass(frozen=True)
class PartInput:
    kind: str  # "input" (a graph input: spec index) | "saved" (a forward value of this stage)
    key: Union[int, str]  # spec index or joint node name


@dataclass(frozen=True)
class PartOutput:
    kind: str  # "loss" | "saved" | "grad" | "pending"
    key: str  # joint node name (saved/pending), parameter name (grad), "loss"


@dataclass
class StagePart:
    stage: int
    phase: str
    gm: fx.GraphModule
    inputs: list[PartInput]
    outputs: list[PartOutput]
    transfers: list[str] = field(default_factory=list)  # joint transfer nodes executed here, in order

    @property
    def name(self) -> str:
        return f"stage{self.stage}_{self.phase}"


@dataclass
class PartitionedProgram:
    layout: PipelineLayout
    parts: dict[tuple[int, str], StagePart]
    stage_of: dict[str, Optional[int]]  # joint node name -> stage (None: constant)
    phase_of: dict[str, str]
    transfers: list[Transfer]

    def part(self, stage: int, phase: str) -> StagePart:
        return self.parts[(stage, phase)]


# ------------------------------------------------------------------ analysis
def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes]


def transfer_stages(node: fx.Node, layout: PipelineLayout) -> tuple[int, int]:
    """(stage of the src ranks, stage of the dst ranks) of a transfer node."""
    if node.target in (STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD):
        a = parse_stage_transfer(node)
    else:
        a = parse_m2ms(node)
    b = layout.boundary_index(a.group_name)
    if b is None:
        raise PartitionError(
            f"transfer node {node.name} ({node.target}) runs on group {a.group_name!r}, which is "
            f"not a boundary group of the pipeline ({[g.name for g in layout.boundaries]})"
        )
    g = layout.boundaries[b]

    def stage_of(ranks, what):
        stages = {layout.stage_of(g.ranks[r]) for r in ranks}
        if len(stages) != 1:
            raise PartitionError(
                f"transfer node {node.name}: its {what} ranks {list(ranks)} (group ranks of "
                f"{g.name}) span stages {sorted(stages)}; a transfer goes from one stage to another"
            )
        return stages.pop()

    src, dst = stage_of(a.src, "src"), stage_of(a.dst, "dst")
    if src == dst:
        raise PartitionError(
            f"transfer node {node.name}: src and dst are both in stage {src}; a transfer must "
            "cross a stage boundary"
        )
    return src, dst


def _is_random(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def analyze(
    joint: fx.GraphModule, specs: list[InputSpec], layout: PipelineLayout
) -> tuple[dict[str, Optional[int]], dict[str, str], list[Transfer], fx.Node]:
    """Stage and phase of every node, the transfers, and the loss node (module docstring)."""
    nodes = list(joint.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(specs):
        raise PartitionError(
            f"joint graph has {len(placeholders)} inputs, the program describes {len(specs)}"
        )
    out = next(n for n in nodes if n.op == "output")
    outs = out.args[0]
    loss = outs[0] if isinstance(outs, (tuple, list)) else outs
    if not isinstance(loss, fx.Node):
        raise PartitionError("joint graph: the first output (the loss) is not a node")
    index = {n: i for i, n in enumerate(nodes)}
    loss_at = index[loss]

    stage: dict[fx.Node, Optional[int]] = {}
    phase: dict[str, str] = {}
    transfers: list[Transfer] = []
    transfer_of: dict[fx.Node, tuple[int, int]] = {}
    for n, spec in zip(placeholders, specs, strict=True):
        stage[n] = spec.stage
        phase[n.name] = BW if spec.kind == "grad_seed" else FW
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            continue
        ph = FW if index[n] <= loss_at else BW
        phase[n.name] = ph
        if n.target in TRANSFER_OPS:
            src, dst = transfer_stages(n, layout)
            x = n.args[0] if n.args else n.kwargs.get("x")
            xs = stage.get(x) if isinstance(x, fx.Node) else None
            if xs is not None and xs != src:
                raise PartitionError(
                    f"transfer node {node_desc(n)} sends from stage {src}, but its input "
                    f"{node_desc(x)} is a value of stage {xs}"
                )
            stage[n] = dst
            transfer_of[n] = (src, dst)
            continue
        if is_wait(n.target) and n.args and n.args[0] in transfer_of:
            stage[n] = transfer_of[n.args[0]][1]
            transfer_of[n] = transfer_of[n.args[0]]
            continue
        by_stage: dict[int, list[fx.Node]] = {}
        for a in _tensor_args(n):
            s = stage.get(a)
            if s is not None:
                by_stage.setdefault(s, []).append(a)
        if len(by_stage) > 1:
            detail = "; ".join(
                f"stage {s}: {', '.join(a.name for a in v)}" for s, v in sorted(by_stage.items())
            )
            raise PartitionError(
                f"node {node_desc(n)} ({ph}) reads values of stages {sorted(by_stage)} ({detail}); "
                "only a stage_transfer/m2ms may carry a value from one stage to another"
            )
        s = next(iter(by_stage), None)
        if s is None and (collective_spec(n.target) is not None or is_wait(n.target)):
            raise PartitionError(f"node {node_desc(n)} is a collective on constants only: no stage owns it")
        if s is None and _is_random(n):
            raise PartitionError(
                f"node {node_desc(n)} is a random op on constants only: copying it into every "
                "stage that reads it would draw different numbers"
            )
        stage[n] = s
    for n, (src, dst) in transfer_of.items():
        if n.target in TRANSFER_OPS:
            wait = next((u.name for u in n.users if is_wait(u.target)), None)
            if n.target in _ASYNC_TRANSFERS and wait is None:
                raise PartitionError(f"transfer node {node_desc(n)} is never waited")
            transfers.append(Transfer(n.name, src, dst, phase[n.name], wait))
    return {n.name: s for n, s in stage.items()}, phase, transfers, loss


def node_desc(n: fx.Node) -> str:
    t = n.target
    name = getattr(t, "__name__", None) or str(t)
    if isinstance(t, torch._ops.OpOverload):
        name = f"{t.namespace}.{t._opname}"
    return f"{n.name} ({name})" if n.op == "call_function" else n.name


# ------------------------------------------------------------------ building parts
class _PartBuilder:
    def __init__(
        self,
        joint: fx.GraphModule,
        stage: int,
        phase: str,
        specs: list[InputSpec],
        stage_of: dict[str, Optional[int]],
        phase_of: dict[str, str],
        transfers: dict[str, Transfer],
    ):
        self.joint, self.stage, self.phase = joint, stage, phase
        self.specs, self.stage_of, self.phase_of, self.transfers = specs, stage_of, phase_of, transfers
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.inputs: list[PartInput] = []
        self.placeholders = {
            n: i for i, n in enumerate(n for n in joint.graph.nodes if n.op == "placeholder")
        }
        self.saved: list[str] = []  # forward node names this (backward) part reads
        self.pending: list[fx.Node] = []  # joint transfer nodes sent from here (their results, un-waited)
        self.run_transfers: list[str] = []

    def _placeholder(self, name: str, like: fx.Node, inp: PartInput) -> fx.Node:
        p = self.graph.placeholder(name)
        p.meta.update({k: v for k, v in like.meta.items() if k in ("val", "tensor_meta")})
        self.inputs.append(inp)
        return p

    def value(self, a: fx.Node, user: fx.Node) -> fx.Node:
        if a in self.env:
            return self.env[a]
        if a.op == "placeholder":
            r = self.env[a] = self._placeholder(a.name, a, PartInput("input", self.placeholders[a]))
            return r
        s, ph = self.stage_of[a.name], self.phase_of[a.name]
        if s is None:  # a constant: copy its (input-free) subgraph here
            return self.copy(a)
        if s == self.stage and ph == FW and self.phase == BW:
            self.saved.append(a.name)
            r = self.env[a] = self._placeholder(f"saved_{a.name}", a, PartInput("saved", a.name))
            return r
        raise PartitionError(
            f"node {node_desc(user)} of stage {self.stage_of.get(user.name)} ({self.phase}) reads "
            f"{node_desc(a)} of stage {s} ({ph}); only a stage_transfer/m2ms may carry a value "
            "across stages, and only forward values reach the backward"
        )

    def copy(self, n: fx.Node, transfer_input: Optional[fx.Node] = None) -> fx.Node:
        def arg(a):
            if not isinstance(a, fx.Node):
                return a
            if transfer_input is not None and a is n.args[0]:
                return transfer_input
            return self.value(a, n)

        new = self.graph.node_copy(n, arg)
        self.env[n] = new
        return new

    def receiver_input(self, n: fx.Node) -> fx.Node:
        """The stand-in for a transfer's input on the receiving side (module docstring)."""
        x = n.args[0]
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise PartitionError(f"transfer node {node_desc(n)}: its input {x.name} has no traced shape")
        shape = list(val.shape)
        if n.target in (M2MS, M2MS_AUTOGRAD):
            a = parse_m2ms(n)
            shape[a.dim] = 0  # the receiving stage is not a source (disjoint stages)
        z = self.graph.call_function(
            torch.ops.aten.zeros.default, (shape,), {"dtype": val.dtype, "device": val.device}
        )
        z.meta["val"] = val.new_empty(shape)
        return z

    def build(self) -> None:
        for n in self.joint.graph.nodes:
            if n.op in ("placeholder", "output") or self.phase_of.get(n.name) != self.phase:
                continue
            t = self.transfers.get(n.name)
            if n.target in TRANSFER_OPS and t is not None:
                if self.stage == t.src_stage:
                    self.copy(n)
                    self.run_transfers.append(n.name)
                    if t.wait is not None:
                        self.pending.append(n)  # waited by the runner, late (runner.py)
                elif self.stage == t.dst_stage:
                    self.copy(n, transfer_input=self.receiver_input(n))
                    self.run_transfers.append(n.name)
                continue
            if is_wait(n.target) and n.args and n.args[0].name in self.transfers:
                t = self.transfers[n.args[0].name]
                if self.stage == t.dst_stage:
                    self.copy(n)
                continue
            if self.stage_of.get(n.name) == self.stage:
                self.copy(n)

    def finish(self, outputs: list[tuple[PartOutput, fx.Node]]) -> tuple[fx.GraphModule, list[PartOutput]]:
        vals = []
        kinds = []
        for po, node in outputs:
            vals.append(self.env[node] if node in self.env else self.value(node, node))
            kinds.append(po)
        for n in self.pending:
            vals.append(self.env[n])
            kinds.append(PartOutput("pending", n.name))
        self.graph.output(tuple(vals))
        gm = fx.GraphModule(self.joint, self.graph, class_name=f"Stage{self.stage}{self.phase.capitalize()}")
        gm.graph.lint()
        return gm, kinds


def partition(program: PipelineProgram) -> PartitionedProgram:
    """Cut ``program.joint`` into per-(stage, phase) parts (module docstring)."""
    if program.joint is None:
        raise ValueError("partition: the program has no joint graph (call trace_joint first)")
    layout, joint, specs = program.layout, program.joint, program.joint_inputs
    stage_of, phase_of, transfers, loss = analyze(joint, specs, layout)
    last = layout.num_stages - 1
    if stage_of.get(loss.name) != last:
        raise PartitionError(
            f"the loss {node_desc(loss)} is a value of stage {stage_of.get(loss.name)}, not of the "
            f"last stage {last}"
        )
    tmap = {t.node: t for t in transfers}
    out = next(n for n in joint.graph.nodes if n.op == "output")
    grads = list(out.args[0][1:])
    if len(grads) != len(program.grad_names):
        raise PartitionError(
            f"joint graph returns {len(grads)} gradients, the program names {len(program.grad_names)}"
        )
    spec_stage = {s.name: s.stage for s in specs}
    grad_outputs: dict[int, list[tuple[PartOutput, fx.Node]]] = {s: [] for s in range(layout.num_stages)}
    for name, g in zip(program.grad_names, grads, strict=True):
        want = spec_stage[name]
        if not isinstance(g, fx.Node):
            raise PartitionError(f"gradient of {name} is not a graph value ({g!r})")
        got = stage_of.get(g.name) if g.op != "placeholder" else spec_stage.get(g.name)
        if got is not None and got != want:
            raise PartitionError(
                f"gradient of {name} (stage {want}) is computed by {node_desc(g)} of stage {got}"
            )
        grad_outputs[want].append((PartOutput("grad", name), g))

    parts: dict[tuple[int, str], StagePart] = {}
    saved_by_stage: dict[int, list[str]] = {}
    for s in range(layout.num_stages):
        b = _PartBuilder(joint, s, BW, specs, stage_of, phase_of, tmap)
        b.build()
        gm, outs = b.finish(grad_outputs[s])
        parts[(s, BW)] = StagePart(s, BW, gm, b.inputs, outs, b.run_transfers)
        saved_by_stage[s] = b.saved
    nodes = {n.name: n for n in joint.graph.nodes}
    for s in range(layout.num_stages):
        b = _PartBuilder(joint, s, FW, specs, stage_of, phase_of, tmap)
        b.build()
        outputs = [(PartOutput("loss", "loss"), loss)] if s == last else []
        outputs += [(PartOutput("saved", name), nodes[name]) for name in saved_by_stage[s]]
        gm, outs = b.finish(outputs)
        parts[(s, FW)] = StagePart(s, FW, gm, b.inputs, outs, b.run_transfers)
    return PartitionedProgram(layout, parts, stage_of, phase_of, transfers)


def write_dumps(
    dump_dir: Union[str, os.PathLike], program: PipelineProgram, parted: Optional[PartitionedProgram] = None
) -> list[Path]:
    """Readable code of the forward graph, the joint graph and every part (``*.py.txt``)."""
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    files = {"forward.py.txt": program.forward.code}
    if program.joint is not None:
        files["joint.py.txt"] = program.joint.code
    if parted is not None:
        for part in parted.parts.values():
            head = [
                f"# {part.name}: inputs {[f'{i.kind}:{i.key}' for i in part.inputs]}",
                f"# outputs {[f'{o.kind}:{o.key}' for o in part.outputs]}",
                f"# transfers {part.transfers}",
            ]
            files[f"{part.name}.py.txt"] = "\n".join(head) + "\n" + part.gm.code
    written = []
    for name, text in files.items():
        p = d / name
        p.write_text(text)
        written.append(p)
    return written


def wait_pending(t: torch.Tensor) -> torch.Tensor:
    """Wait a pending send returned by a sender's part."""
    return c10d_functional.wait_tensor(t)


__all__ = [
    "BW",
    "FW",
    "PartInput",
    "PartOutput",
    "PartitionError",
    "PartitionedProgram",
    "StagePart",
    "Transfer",
    "analyze",
    "partition",
    "transfer_stages",
    "wait_pending",
    "write_dumps",
]
