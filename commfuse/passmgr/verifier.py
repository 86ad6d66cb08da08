"""The verifier that runs before the pipeline and after every changing pass.

Checks (each a line in `VerifierReport.problems`):
* FX graph lint (topological order, well-formed args);
* every collective's result is waited exactly once, and nothing reads a
  collective's result except through its wait ("use before wait");
* shapes and dtypes consistent: collectives' output metadata agrees with their
  input and group size, waits keep their input's metadata, every computing node
  carries tensor metadata when the graph has it;
* with `deep=True`: fake tensors re-propagated through the graph agree with the
  recorded metadata.
It also records the per-process-group collective sequence hash and the hash of
the total issue order, which cross-rank agreement checks compare.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from commfuse.core.torch_private import fake_tensor_mode_of
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.ir.kinds import CollectiveKind, is_wait
from commfuse.ir.shapes import shape_of, tensor_meta


@dataclass
class VerifierReport:
    problems: list[str] = field(default_factory=list)
    sequence_hashes: dict[str, str] = field(default_factory=dict)
    order_hash: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_graph(
    gm: fx.GraphModule, *, ir: CollectiveIR | None = None, deep: bool = False, check_meta: bool = True
) -> VerifierReport:
    """`check_meta=False` for graphs straight from PyTorch (the input graph): their metadata is
    PyTorch's business; after a pass, missing metadata means the pass forgot to propagate it."""
    report = VerifierReport()
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError/AssertionError with a description
        report.problems.append(f"graph lint: {e}")
        return report
    ir = ir or CollectiveIR(gm, IRBuildOptions())
    for c in ir.collectives:
        _check_waits(c, report.problems)
        _check_collective_meta(c, report.problems)
    _check_waits_meta(gm, report.problems)
    if check_meta:
        _check_meta_present(gm, report.problems)
    if deep and not report.problems:
        _check_fake_propagation(gm, report.problems)
    report.sequence_hashes = ir.sequence_hashes()
    report.order_hash = ir.order_hash()
    return report


_METADATA_OPS = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset")


def _reads_metadata_only(n) -> bool:
    """An op that reads a tensor's sizes, strides or offset, never its values."""
    return n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in _METADATA_OPS


def _check_waits(c, problems: list[str]) -> None:
    if c.synchronous:  # completes inside the op (e.g. commfuse::m2ms_autograd): must not be waited
        waits = [u for u in c.start.users if u.op == "call_function" and is_wait(u.target)]
        if waits:
            problems.append(
                f"{c.name}: synchronous {c.kind.value} op is waited by {waits[0].name} "
                f"(it has no work to wait for)"
            )
        return
    outputs = [g for g in c.start.users] if c.coalesced else [c.start]
    order = {n: i for i, n in enumerate(c.start.graph.nodes)} if c.inplace else {}
    for out in outputs:
        if c.coalesced and not (out.op == "call_function" and out.target is operator.getitem):
            problems.append(f"{c.name}: coalesced result used by {out.name} without getitem/wait")
            continue
        waits = [u for u in out.users if u.op == "call_function" and is_wait(u.target)]
        # reading the result's sizes before the wait is safe: the buffer exists once issued
        # (dropless MoE reads the all_to_all output's data-dependent length this way)
        others = [u for u in out.users if u not in waits and not _reads_metadata_only(u)]
        if c.inplace and len(waits) == 1:
            # An in-place collective's result *is* its input buffer: tracing records later
            # reads of that buffer as uses of the collective node. Only reads before the wait race.
            others = [u for u in others if order[u] < order[waits[0]]]
        if not waits:
            problems.append(
                f"{c.name}: {c.kind.value} result {out.name} is never waited (missing wait_tensor)"
            )
        elif len(waits) > 1:
            problems.append(f"{c.name}: {c.kind.value} result {out.name} is waited {len(waits)} times")
        if others:
            names = ", ".join(u.name for u in others)
            problems.append(f"{c.name}: {c.kind.value} result {out.name} used before its wait by {names}")


def _check_collective_meta(c, problems: list[str]) -> None:
    if c.coalesced or len(c.inputs) != 1:
        return
    ins, out = shape_of(c.inputs[0]), shape_of(c.start)
    tin, tout = tensor_meta(c.inputs[0]), tensor_meta(c.start)
    if ins is None or out is None or tin is None or tout is None:
        return
    n = c.group.size
    if tin.dtype != tout.dtype:
        problems.append(f"{c.name}: dtype changes across {c.kind.value} ({tin.dtype} -> {tout.dtype})")
    expected = None
    if c.kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.BROADCAST):
        expected = ins
    elif c.kind is CollectiveKind.ALL_GATHER and n and ins:
        expected = (ins[0] * n, *ins[1:])
    elif c.kind is CollectiveKind.REDUCE_SCATTER and n and ins:
        expected = (ins[0] // n, *ins[1:]) if isinstance(ins[0], int) else None
    if expected is not None and tuple(expected) != tuple(out):
        problems.append(
            f"{c.name}: {c.kind.value} over {n if n else '?'} ranks maps {list(ins)} to {list(out)}, expected {list(expected)}"
        )


def _check_waits_meta(gm: fx.GraphModule, problems: list[str]) -> None:
    for n in gm.graph.nodes:
        if n.op == "call_function" and is_wait(n.target):
            a, b = tensor_meta(n.args[0]), tensor_meta(n)
            if a is not None and b is not None and (a.shape != b.shape or a.dtype != b.dtype):
                problems.append(
                    f"{n.name}: wait changes metadata {tuple(a.shape)}/{a.dtype} -> {tuple(b.shape)}/{b.dtype}"
                )


def _check_meta_present(gm: fx.GraphModule, problems: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders or not all("val" in n.meta for n in placeholders):
        return  # graph traced without metadata: nothing to hold passes to
    for n in gm.graph.nodes:
        # ATen/c10d ops only: higher-order ops and Python operators legitimately lack it.
        if (
            n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and "val" not in n.meta
            and n.target._schema.returns
        ):  # ops returning nothing (e.g. _assert_async) have no value
            problems.append(
                f"{n.name}: no 'val' metadata (a pass created it without fake-tensor propagation)"
            )


def _check_fake_propagation(gm: fx.GraphModule, problems: list[str]) -> None:
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = fake_tensor_mode_of(gm)
    if mode is None:
        return
    recorded = {n: n.meta.get("val") for n in gm.graph.nodes}
    args = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    scratch = fx.GraphModule(gm, gm.graph)  # FakeTensorProp overwrites meta: work on a shallow twin
    try:
        interp = FakeTensorProp(scratch, mode)
        env_vals = {}
        orig_run_node = interp.run_node

        def _run_node(n):
            out = orig_run_node(n)
            env_vals[n] = out
            return out

        interp.run_node = _run_node  # type: ignore[method-assign]
        interp.propagate_dont_convert_inputs(*args)
    except Exception as e:
        problems.append(f"fake-tensor propagation failed: {type(e).__name__}: {e}")
        return
    finally:
        for n, v in recorded.items():
            if v is not None:
                n.meta["val"] = v
    for n, new in env_vals.items():
        old = recorded.get(n)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            if tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
                problems.append(
                    f"{n.name}: recorded {tuple(old.shape)}/{old.dtype} but computes {tuple(new.shape)}/{new.dtype}"
                )
