"""Check one program: every pass alone and the default pipeline, against the reference.

For a program, :func:`check_program`

1. traces it on a fake world (one SPMD graph traced on rank 0, or one graph per rank
   when ranks run different code) and runs the verifier on the traced graph;
2. runs it on the reference interpreter (the expected per-rank outputs; for joint
   programs the outputs include the gradients);
3. for every pipeline (each registered pass alone, ``Config(passes=[name], strict=True)``,
   and the default pipeline, ``Config(strict=True)``): optimises a copy of every graph
   with :func:`commfuse.optimize` inside the same fake world, requires the verifier to
   accept the result, runs it on the reference and compares every rank's outputs with
   the expected ones (bitwise for passes registered ``exact``, else the tolerance policy).

Failures are classified (:data:`FAILURE_KINDS`); ``generator`` failures are bugs of the
fuzzer itself (a program the reference cannot run before any pass touched it).
"""

from __future__ import annotations

import contextlib
import operator
import re
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx

from commfuse import session
from commfuse.api import optimize
from commfuse.config import Config
from commfuse.core.errors import PassError, VerificationError
from commfuse.core.meta import REPORTS_META
from commfuse.fuzz.program import Program, Traced, create_groups, make_inputs, trace_rank
from commfuse.fuzz.targets import fuzz_target
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import collective_spec, is_wait
from commfuse.passmgr.verifier import verify_graph
from commfuse.reference import ReferenceInterpreter, ReferenceSemanticsError
from commfuse.reference.groups import GroupTable
from commfuse.reference.numerics import assert_bitwise_equal_tree, assert_close_tree, tolerances
from commfuse.testing.fake_pg import fake_process_group
from commfuse.transforms.registry import DEFAULT_PIPELINE, available_passes

FAILURE_KINDS = {
    "input_rejected": "the verifier rejects the traced (unoptimised) graph, so no pass runs on it",
    "pass_error": "a pass raised (strict mode)",
    "verifier": "the verifier rejected a pass's output",
    "reference_error": "the optimised graph cannot run on the reference (deadlock, mismatched collectives, race)",
    "mismatch": "the optimised graph computes different values",
    "contract": "a pass registered keeps_collective_order changed the collective sequence (verifier hashes)",
    "generator": "the fuzzer generated a program it cannot trace or run (a fuzzer bug)",
    "ir": "(with check_ir) the CollectiveIR disagrees with the program about a forward collective "
    "(kind, group, reduce op, logical gather/scatter/split/concat dim)",
}

_IR_KIND = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_inplace": "all_reduce",
    "all_reduce_coalesced_inplace": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_coalesced": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_uneven": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_inplace": "broadcast",
    "m2ms": "many_to_many_scatter",
    "stage_transfer": "p2p",
}


def ir_problems(program: Program, gm: fx.GraphModule) -> list[str]:
    """Compare the IR of rank 0's traced graph with the program's forward collectives (the
    first collectives in graph order, in program order; backward ones follow in joint graphs).
    Must run inside the fake world the graph was traced in (group ranks resolve there)."""

    cs = CollectiveIR(gm).collectives
    expected: list[tuple[dict, Optional[str]]] = []
    for op in program.ops:
        if op["op"] == "p2p":
            expected += [(op, "batch_p2p")] if op.get("batch") else [(op, "send"), (op, "recv")]
        elif op["op"] in _IR_KIND:
            expected.append((op, _IR_KIND[op["op"]]))
    if len(cs) < len(expected):
        return [f"the IR finds {len(cs)} collectives, the program issues at least {len(expected)}"]
    problems = []
    for (op, kind), c in zip(expected, cs, strict=False):  # the IR may find more (checked above)
        part = program.groups[op["group"]]
        n = len(part[0])
        where = f"{c.name} (program op {op['op']} {op['out']})"
        if c.kind.value != kind:
            problems.append(f"{where}: kind {c.kind.value}, expected {kind}")
            continue
        if c.group.size != n or (
            c.group.ranks is not None and list(c.group.ranks) not in [list(b) for b in part]
        ):
            problems.append(
                f"{where}: group size {c.group.size} ranks {c.group.ranks}, expected one of {part}"
            )
        if "reduce" in op and c.reduce_op != op["reduce"]:
            problems.append(f"{where}: reduce op {c.reduce_op}, expected {op['reduce']}")
        if n > 1 and op["op"] in ("all_gather", "reduce_scatter") and c.logical_dim != op["dim"]:
            problems.append(
                f"{where}: logical dim {c.logical_dim}, expected {op['dim']} "
                f"(input {c.input_shapes}, output {c.output_shapes})"
            )
        if (
            op["op"] == "m2ms"
            and c.input_shapes
            and c.input_shapes[0] is not None
            and c.logical_dim != op["dim"] % len(c.input_shapes[0])
        ):
            problems.append(f"{where}: logical dim {c.logical_dim}, expected {op['dim']} (m2ms)")
        if (
            n > 1
            and op["op"] == "all_to_all"
            and (c.logical_dim, c.logical_concat_dim) != (op["split_dim"], op["concat_dim"])
        ):
            problems.append(
                f"{where}: logical dims {c.logical_dim}->{c.logical_concat_dim}, expected "
                f"{op['split_dim']}->{op['concat_dim']}"
            )
    return problems


@dataclass(frozen=True)
class PipelineSpec:
    """A pass list to check: one pass alone (``name`` = the pass) or the default pipeline."""

    name: str
    passes: Optional[tuple[str, ...]]  # None: the default pipeline
    exact: bool = False
    topology: Any = None
    keeps_order: bool = False
    scaled: bool = False  # compare outputs normalised by their magnitude (FuzzTarget.scaled_tolerance)

    def config(self, group_roles: Optional[dict[str, str]] = None) -> Config:
        return Config(
            passes=list(self.passes) if self.passes is not None else None,
            strict=True,
            topology=self.topology,
            group_roles=group_roles or {},
        )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "passes": list(self.passes) if self.passes is not None else None,
            "exact": self.exact,
        }

    @classmethod
    def from_json(cls, d: dict) -> "PipelineSpec":
        passes = d.get("passes")
        if d["name"] == "default":
            return default_pipeline()
        return (
            single_pass_pipeline(passes[0])
            if passes and len(passes) == 1
            else cls(d["name"], tuple(passes) if passes is not None else None, d.get("exact", False))
        )


def single_pass_pipeline(name: str) -> PipelineSpec:
    t = fuzz_target(name)
    return PipelineSpec(
        name,
        (name,),
        exact=t.exact,
        topology=t.topology,
        keeps_order=t.keeps_collective_order,
        scaled=t.scaled_tolerance,
    )


def default_pipeline() -> PipelineSpec:
    targets = [fuzz_target(p) for p in DEFAULT_PIPELINE]
    return PipelineSpec(
        "default",
        None,
        exact=all(t.exact for t in targets),
        keeps_order=all(t.keeps_collective_order for t in targets),
    )


def all_pipelines(
    passes: Optional[Sequence[str]] = None, *, include_default: bool = True
) -> list[PipelineSpec]:
    names = sorted(available_passes()) if passes is None else list(passes)
    out = [single_pass_pipeline(p) for p in names]
    if include_default:
        out.append(default_pipeline())
    return out


def applicable(pipe: PipelineSpec, program: Program) -> bool:
    if pipe.passes is None:
        return True
    return all(fuzz_target(p).accepts(program) for p in pipe.passes)


@dataclass
class Failure:
    pipeline: str
    kind: str
    message: str

    def signature(self) -> tuple[str, str, str]:
        """(pipeline, kind, exception type): what a shrunk program must still reproduce."""
        m = re.search(r"\b([A-Z]\w*(?:Error|Exception))\b", self.message)
        exc = m.group(1) if m and self.kind in ("generator", "pass_error", "reference_error") else ""
        return self.pipeline, self.kind, exc

    def headline(self) -> str:
        lines = [ln.strip() for ln in self.message.strip().splitlines() if ln.strip()]
        first = lines[0] if lines else ""
        if first.endswith(":") and len(lines) > 1:
            first = f"{first} {lines[1]}"
        return f"[{self.pipeline}] {self.kind}: {first[:300]}"


@dataclass
class CheckResult:
    program: Program
    failures: list[Failure] = field(default_factory=list)
    pipelines_run: list[str] = field(default_factory=list)
    pipelines_changed: list[str] = field(default_factory=list)  # a check that changed nothing proves little
    graph_nodes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


def _copy_gm(gm: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    g._codegen = gm.graph._codegen
    new = fx.GraphModule(gm, g)
    new.meta = {k: v for k, v in gm.meta.items() if k != REPORTS_META}
    return new


def _optimize(
    gm: fx.GraphModule, pipe: PipelineSpec, before=None, group_roles: Optional[dict[str, str]] = None
) -> Optional[Failure]:
    """Run the pipeline on ``gm``; ``before``: the input's verifier report (for order contracts);
    ``group_roles``: what the program's user declares (the TP contract)."""

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimize(gm, pipe.config(group_roles))
    except VerificationError as e:
        return Failure(pipe.name, "verifier", str(e))
    except PassError as e:
        return Failure(
            pipe.name, "pass_error", f"{e}\n{''.join(traceback.format_exception(e.cause))[-3000:]}"
        )
    except Exception as e:  # noqa: BLE001 - anything a pipeline raises is a failure of that pipeline
        return Failure(pipe.name, "pass_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
    v = verify_graph(gm)
    if not v.ok:
        return Failure(
            pipe.name, "verifier", "verifier rejects the optimised graph:\n  " + "\n  ".join(v.problems)
        )
    if (
        pipe.keeps_order
        and before is not None
        and (v.sequence_hashes, v.order_hash) != (before.sequence_hashes, before.order_hash)
    ):
        return Failure(
            pipe.name,
            "contract",
            f"collective sequence changed: per-group hashes "
            f"{before.sequence_hashes} -> {v.sequence_hashes}, order {before.order_hash} -> {v.order_hash}",
        )
    return None


@dataclass
class Prepared:
    """A traced program, its reference (compiled before any pass ran) and its optimised graphs."""

    traced: Traced
    reference: ReferenceInterpreter
    optimised: dict[str, list]  # pipeline name -> optimised graphs (one, or one per rank)
    failures: list[Failure]
    graph_nodes: int = 0  # nodes of the traced graphs (before any pass)
    changed: set = field(default_factory=set)  # pipelines that changed at least one graph


def _groups_mapping(program: Program, names: dict[str, list[int]]) -> dict[str, Any]:
    if program.per_rank:
        return dict(names)  # one graph per rank: every name is one block
    out: dict[str, Any] = {}
    for name, ranks in names.items():  # one SPMD graph: a name stands for its whole partition
        out[name] = next(
            (part for part in program.groups.values() if list(ranks) in [list(b) for b in part]), list(ranks)
        )
    return out


@contextlib.contextmanager
def _subgroups_for(pipe: PipelineSpec, program: Program, traced: Traced) -> Iterator[None]:
    """The program's partitions declared as a job declares its mesh (``commfuse.setup(groups=)``),
    so passes whose peers are other ranks' groups (a pair on two mesh dims) know every block;
    under a multi-node topology also the sub-groups ``setup`` creates for the world and those
    partitions (after the program's own groups, so their names stay), whose aliases join the
    reference's group mapping. The session is reset afterwards."""
    topo = pipe.topology
    parts = [part for role, part in sorted(program.groups.items()) if role != "world"]
    if topo is None or topo.num_nodes < 2 or topo.world_size != program.world_size:
        session.setup(groups=parts)
        try:
            yield
        finally:
            session.reset()
        return

    s = session.setup(topology=topo, groups=parts)
    traced.groups.update(s.reference_groups())
    try:
        yield
    finally:
        session.reset()


def prepare(program: Program, pipelines: Sequence[PipelineSpec] = (), *, check_ir: bool = False) -> Prepared:
    """Trace ``program`` (in a fake world per traced rank), compile its reference, and optimise
    a copy of every graph with every pipeline (in the same fake worlds)."""
    n = program.world_size
    inputs = [make_inputs(program, r) for r in range(n)]
    ranks = list(range(n)) if program.per_rank else [0]
    graphs, names_all, pre_reports = [], {}, []
    failures: list[Failure] = []
    rejected = False
    for r in ranks:
        with fake_process_group(n, rank=r):
            gm, names = trace_rank(program, r, inputs[r])
            if check_ir and r == 0:
                probs = ir_problems(program, gm)
                if probs:
                    failures.append(
                        Failure("ir", "ir", "the IR disagrees with the program:\n  " + "\n  ".join(probs))
                    )
        graphs.append(gm)
        names_all.update(names)
        pre = verify_graph(gm)
        pre_reports.append(pre)
        if not pre.ok and not rejected:
            rejected = True
            failures.append(
                Failure(
                    "input",
                    "input_rejected",
                    "verifier rejects the traced graph:\n  " + "\n  ".join(pre.problems),
                )
            )
    traced = Traced(program, graphs, _groups_mapping(program, names_all), inputs)
    reference = ReferenceInterpreter(graphs[0] if len(graphs) == 1 else graphs, n, traced.groups)
    nodes = sum(len(g.graph.nodes) for g in graphs)
    optimised: dict[str, list] = {}
    if rejected:
        return Prepared(traced, reference, optimised, failures, nodes)
    failed: set[str] = set()
    changed: set[str] = set()
    for r, gm, pre in zip(ranks, graphs, pre_reports, strict=True):
        with fake_process_group(n, rank=r):
            create_groups(program, r)  # the same names as at trace time: passes may resolve them
            for p in pipelines:
                if p.name in failed:
                    continue
                # a copy: the traced graph stays the unoptimised program (the rounding-only check
                # runs it again in float64)
                opt = _copy_gm(gm)
                roles = {name: "tp" for name in names_all} if program.tp_contract else None
                with _subgroups_for(p, program, traced):
                    f = _optimize(opt, p, pre, roles)
                if f is not None:
                    failures.append(f)
                    failed.add(p.name)
                    continue
                optimised.setdefault(p.name, []).append(opt)
                reports = opt.meta.get(REPORTS_META, [])
                if any(rec.changed for rep in reports for rec in rep.passes):
                    changed.add(p.name)
    return Prepared(
        traced,
        reference,
        {k: v for k, v in optimised.items() if k not in failed},
        failures,
        nodes,
        changed - failed,
    )


def run_on_reference(traced: Traced, graphs: list) -> list[Any]:
    """Run ``graphs`` (one SPMD graph or one per rank) of ``traced``'s program on the reference."""
    prog = graphs[0] if len(graphs) == 1 else graphs
    return ReferenceInterpreter(prog, traced.program.world_size, traced.groups).run(traced.inputs)


def _flat(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    return [x]


def _bitwise_equal(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point():
                ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
                if not torch.equal(x.contiguous().view(ints), y.contiguous().view(ints)):
                    return False
            elif not torch.equal(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _same_leaves(a: Any, b: Any) -> bool:
    """As many leaves, and tensors where the other has tensors, of the same shapes."""
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        isinstance(x, torch.Tensor) == isinstance(y, torch.Tensor)
        and (not isinstance(x, torch.Tensor) or x.shape == y.shape)
        for x, y in zip(fa, fb, strict=True)
    )


def _normalised(a: Any, e: Any) -> tuple[list, list]:
    """Both outputs' leaves, floating tensors divided by max(1, max|expected leaf|)."""
    fa, fe = _flat(a), _flat(e)
    for i, (x, y) in enumerate(zip(fa, fe, strict=False)):  # leaf counts may differ: reported by the caller
        if (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and y.is_floating_point()
            and y.numel()
        ):
            s = max(1.0, float(y.detach().abs().float().max()))
            fa[i], fe[i] = x / s, y / s
    return fa, fe


# the floating dtypes the fuzzer generates programs in, all narrower than float64
_FUZZ_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _in_float64(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose floating dtype arguments (casts, factory functions) are float64."""
    new = _copy_gm(gm)

    def conv(a):
        return torch.float64 if isinstance(a, torch.dtype) and a in _FUZZ_FLOATS else a

    for n in new.graph.nodes:
        if n.op == "call_function":
            n.args = fx.node.map_aggregate(n.args, conv)
            n.kwargs = fx.node.map_aggregate(n.kwargs, conv)
    new.recompile()
    return new


class _Float64Inside(torch.overrides.TorchFunctionMode):
    """The runtime half of ``_in_float64``: inside ops that fix a dtype in their own code (the MoE
    ops keep router statistics in float32: ``.float()``, ``dtype=torch.float32``), a float64 run
    stays float64 instead of failing on mixed dtypes. Any fuzz float dtype an op asks for becomes
    float64, and ``.float()``/``.half()``/``.bfloat16()`` of a float64 tensor is that tensor."""

    _NARROWING = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            func in self._NARROWING
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].dtype == torch.float64
        ):
            return args[0]

        def conv(a):
            if isinstance(a, torch.dtype) and a in _FUZZ_FLOATS:
                return torch.float64
            if func is torch.Tensor.to and isinstance(a, torch.Tensor) and a.dtype in _FUZZ_FLOATS:
                return a.double()  # .to(other) takes other's dtype
            return a

        args = tuple(conv(a) for a in args)
        kwargs = {k: conv(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _float64_inside() -> Iterator[None]:
    """Float64 runs (``_in_float64`` graphs on float64 inputs) also compute in float64 inside ops
    (``_Float64Inside``; tensors an op creates without a dtype are float64 too)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64Inside():
            yield
    finally:
        torch.set_default_dtype(default)


# -- Monte Carlo arithmetic: how far rounding alone moves the unoptimised program ------------
# Ops whose result is one of their inputs' values, exactly (no rounding): layout, copies,
# selection, sign. Views (OpOverload.is_view) are exact too. Dtype casts are handled apart.
_EXACT_OPS = frozenset(
    {
        "clone",
        "contiguous",
        "copy",
        "copy_",
        "cat",
        "stack",
        "index",
        "index_select",
        "gather",
        "scatter",
        "select_scatter",
        "slice_scatter",
        "where",
        "masked_fill",
        "neg",
        "abs",
        "relu",
        "sign",
        "maximum",
        "minimum",
        "max",
        "min",
        "amax",
        "amin",
        "argmax",
        "argmin",
        "topk",
        "sort",
        "one_hot",
        "repeat",
        "flip",
        "roll",
        "constant_pad_nd",
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "empty",
        "empty_like",
        "empty_strided",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_empty_strided",
        "full",
        "full_like",
        "scalar_tensor",
        "lift_fresh_copy",
    }
)
_CASTS = frozenset({"_to_copy", "to", "convert_element_type", "type_as"})
_SUMMING = ("sum", "avg")  # reduce ops whose every step rounds (max/min are exact; products are not emulated)
_MCA_SAMPLES = 16
_MCA_MARGIN = 2.0  # the optimised program may be this much noisier than the worst sample


def _unit_roundoff(t: Any) -> float:
    """The largest relative error of one round-to-nearest to ``t``'s dtype (0: float64 or not floating)."""
    dt = getattr(t, "dtype", None)
    if not isinstance(t, torch.Tensor) or dt is None or not dt.is_floating_point or dt == torch.float64:
        return 0.0
    return torch.finfo(dt).eps / 2


def _mca_perturb(x: Any, us: tuple, sample: int) -> Any:
    """``x`` (a tensor or a tuple/list of them) with every floating leaf ``i`` multiplied by
    ``1 + us[i]·ξ``, ``ξ`` in [-1, 1] a hash of the element's value and ``sample``: one random
    rounding per element. Keyed by value, not by rank or node, so equal values (a replicated
    router, the same shard on every rank) stay bitwise equal across ranks, as real rounding is
    deterministic. A fresh tensor, never a mutation."""
    leaves = iter(us)

    def one(t):
        u = next(leaves, 0.0)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not u or not t.numel():
            return t
        xi = torch.remainder(torch.sin(t * 12.9898 + (78.233 * (sample + 1))) * 43758.5453, 1.0) * 2 - 1
        return t * (1 + u * torch.nan_to_num(xi))

    if isinstance(x, (tuple, list)):
        return type(x)(one(t) for t in x)
    return one(x)


def _mca_summand(x: torch.Tensor, rank: int, where: tuple, u: float, seed: int) -> torch.Tensor:
    """Rank ``rank``'s contribution ``x`` to a summing collective, times the rounding errors the
    reference's sum ``((x0 + x1) + x2) + …`` (group-rank order, one rounding per step) applies
    to it: group rank ``i`` of ``m`` (``where[rank]``) takes part in steps ``max(i, 1) … m-1``, so
    ``x_i·Π(1 + δ_k)``: the sum's exact backward error, to first order in ``u``. ``δ_k``, up to
    one unit roundoff per element, is drawn from ``seed`` and ``k`` only, so every member of the
    group applies the same step errors, as one reduction does."""
    i, m = where[rank]
    if not x.is_floating_point() or not x.numel() or m < 2:
        return x
    factor = torch.ones(x.shape, dtype=x.dtype)
    for k in range(max(i, 1), m):
        gen = torch.Generator().manual_seed(seed * 1009 + k)
        factor = factor * (1 + u * (torch.rand(x.shape, generator=gen, dtype=x.dtype) * 2 - 1))
    return x * factor


def _rounding_points(n: fx.Node) -> tuple:
    """Per output leaf of compute node ``n``, the unit roundoff of the rounding that produces it
    (from the traced dtype in ``n.meta["val"]``); () when ``n`` does not round."""
    t = n.target
    if n.op != "call_function" or t is operator.getitem or is_wait(t) or collective_spec(t) is not None:
        return ()
    if not isinstance(t, torch._ops.OpOverload):
        return ()
    if (
        t.namespace in ("_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor")
        or t.is_view
        or t._schema.is_mutable
    ):  # in-place results alias a buffer other readers see unperturbed
        return ()
    name = t.overloadpacket.__name__
    val = n.meta.get("val")
    leaves = list(val) if isinstance(val, (tuple, list)) else [val]
    if name in _EXACT_OPS:
        return ()
    if name in _CASTS:  # rounds only when it narrows
        src = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], fx.Node) else None
        if not isinstance(src, torch.Tensor) or _unit_roundoff(leaves[0]) <= _unit_roundoff(src):
            return ()
    us = tuple(_unit_roundoff(v) for v in leaves)
    return us if any(us) else ()


def _with_random_rounding(gm: fx.GraphModule, sample: int, groups: GroupTable) -> fx.GraphModule:
    """A float64 copy of the traced graph ``gm`` that rounds at random where ``gm`` rounds
    (Monte Carlo arithmetic, Parker 1997): every compute node's result is perturbed by up to
    one unit roundoff of the dtype it was traced in (``_mca_perturb``), and every summing
    collective's inputs by the step errors of the reference's reduction (``_mca_summand``).
    Exact ops (views, copies, selections, widening casts), in-place results and in-place
    collectives are left alone (their buffers are read back unperturbed): that can only
    understate the noise. The copy takes one more input after the program's, the global rank
    (the position of a rank in a group decides which reduction steps round its contribution).
    Each sample is one other equally valid rounding of the same program."""
    new = _in_float64(gm)
    g = new.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(phs[-1]) if phs else g.inserting_before(next(iter(g.nodes))):
        rank = g.placeholder("mca_rank")
    ordinal = 0
    for n in list(g.nodes):
        us = _rounding_points(n)
        if us:
            with g.inserting_after(n):
                p = g.call_function(_mca_perturb, (n, us, sample))
            p.meta["val"] = n.meta.get("val")
            n.replace_all_uses_with(p, delete_user_cb=lambda user: user is not p)  # noqa: B023 - called during the replace
            continue
        spec = collective_spec(n.target) if n.op == "call_function" else None
        if spec is None or spec.kind.value not in ("all_reduce", "reduce_scatter"):
            continue
        ordinal += 1
        try:
            args = spec.parse(n.args, n.kwargs)
            blocks = [groups.resolve(args.group_name, r) for r in range(groups.world_size)]
        except Exception:  # noqa: BLE001 - arguments or group not known: no perturbation (understates)
            continue
        if spec.inplace or str(args.reduce_op).lower() not in _SUMMING:
            continue
        where = tuple((b.index(r), len(b)) for r, b in enumerate(blocks))
        inputs = args.inputs[0] if spec.coalesced else args.inputs
        for j, inp in enumerate(dict.fromkeys(i for i in inputs if isinstance(i, fx.Node))):
            u = _unit_roundoff(inp.meta.get("val"))
            if u:
                with g.inserting_before(n):
                    p = g.call_function(
                        _mca_summand, (inp, rank, where, u, (sample * 7919 + ordinal) * 131 + j)
                    )
                n.replace_input_with(inp, p)
    new.recompile()
    return new


def _rounding_only(
    reference: ReferenceInterpreter, traced: Traced, graphs: list, expected: list, actual: list
) -> bool:
    """For floating-point programs of targets not registered exact: whether a difference is
    rounding alone (a program whose loss amplifies rounding, e.g. ``sin`` of an all-reduced sum
    in the hundreds, differs by more than fixed tolerances under any other summation order). Both
    programs run again on float64 inputs: they must agree to 1e-9 of each output's magnitude
    (equal in exact arithmetic: a wrong slice or a missing term changes the result by O(values)),
    and every rank's optimised low-precision outputs must be as close to the float64 result,
    relative to their magnitude, as rounding alone puts the unoptimised program: within 8x its own
    worst relative error on that rank plus the dtype's atol (the canonical run), or else within
    ``_MCA_MARGIN`` x the worst of up to ``_MCA_SAMPLES`` runs that round at random where it rounds
    (Monte Carlo arithmetic, ``_with_random_rounding``). The canonical run is one sample of that
    noise and can understate it: an ill-conditioned op (a layer norm over two nearly equal
    values, whose sign a rounding decides) may happen to be close in the canonical run and O(1)
    off in another equally valid one. A sample is calibrated on the rounding itself, hence the
    small margin: losing precision (a bf16 rounding where the program keeps float32, a
    cancellation the program does not have) costs far more than another summation order. The float64 runs convert the graphs' own dtype
    arguments too (a joint graph casts gradients back to the parameters' low-precision dtype;
    ``_in_float64``), and inside ops too
    (the MoE ops' float32 router statistics; ``_float64_inside``), so they compute in float64 throughout."""
    dtype = traced.program.torch_dtype
    if dtype not in _FUZZ_FLOATS:
        return False
    if not all(_same_leaves(a, e) for a, e in zip(actual, expected, strict=True)):
        return False  # other outputs (a leaf missing, another shape) are never rounding
    ins64 = [
        [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in r]
        for r in traced.inputs
    ]
    n = traced.program.world_size

    def run(gms: list, ins: list = ins64) -> list:
        with _float64_inside():
            return ReferenceInterpreter(gms[0] if len(gms) == 1 else gms, n, traced.groups).run(ins)

    try:
        truth = run([_in_float64(g) for g in traced.graphs])
        opt64 = run([_in_float64(g) for g in graphs])
    except Exception:  # noqa: BLE001 - e.g. an op with a float32 dtype argument: cannot tell, keep the failure
        return False
    atol = tolerances(dtype)[1]

    def errors(outs: list, r: int) -> list[float]:  # per floating leaf: max |out - truth| / magnitude
        return [
            float((o.double() - t.double()).abs().max()) / max(1.0, float(t.abs().max()))
            for t, o in zip(_flat(truth[r]), _flat(outs[r]), strict=True)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
        ]

    suspect = []  # ranks the unoptimised run's own noise does not explain
    for r in range(len(truth)):
        for t, o64 in zip(_flat(truth[r]), _flat(opt64[r]), strict=True):
            if (
                isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.numel()
                and float((o64.double() - t.double()).abs().max()) > 1e-9 * max(1.0, float(t.abs().max()))
            ):
                return False
        canonical = max(errors(expected, r), default=0.0)
        if max(errors(actual, r), default=0.0) > 8 * canonical + atol:
            suspect.append(r)
    if not suspect:
        return True
    table = GroupTable(n, traced.groups)
    ins_rank = [[*ins, r] for r, ins in enumerate(ins64)]
    noise = dict.fromkeys(suspect, 0.0)
    for k in range(_MCA_SAMPLES):
        try:
            gms = [_with_random_rounding(g, k, table) for g in traced.graphs]
            smp = run(gms, ins_rank)
        except Exception:  # noqa: BLE001 - a perturbed run the reference refuses: the other samples stand
            continue
        for r in suspect:
            noise[r] = max(noise[r], *errors(smp, r), 0.0)
        if all(max(errors(actual, r), default=0.0) <= _MCA_MARGIN * noise[r] for r in suspect):
            return True  # explained already: more samples only raise the noise
    return False


def compare_outputs(
    actual: list, expected: list, *, exact: bool, program: Program, scaled: bool = False
) -> Optional[str]:
    """None if every rank's outputs agree, else a description of every difference
    (``scaled``: leaves normalised by their magnitude first)."""

    problems = []
    for r, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if _bitwise_equal(a, e):
            continue
        if scaled and not exact:
            a, e = _normalised(a, e)
        try:
            if exact:
                assert_bitwise_equal_tree(a, e, msg=f"on rank {r}")
            else:
                summands = (
                    program.max_group_size()
                    if program.torch_dtype in (torch.bfloat16, torch.float16)
                    else None
                )
                assert_close_tree(
                    a,
                    e,
                    dtype=program.torch_dtype,
                    msg=f"on rank {r}",
                    rtol=None,
                    atol=None,
                    summands=summands,
                )
        except AssertionError as err:
            problems.append(str(err))
    if not problems:
        return None
    policy = (
        "bitwise (pass registered exact)"
        if exact
        else f"tolerances({program.dtype}) = {tolerances(program.torch_dtype)}"
        + (" on magnitude-normalised outputs" if scaled else "")
    )
    return f"outputs differ from the unoptimised graph ({policy}):\n" + "\n".join(problems)


def check_program(
    program: Program, pipelines: Optional[Sequence[PipelineSpec]] = None, *, check_ir: bool = False
) -> CheckResult:
    """Check ``program`` under ``pipelines`` (default: every pass alone + the default pipeline);
    ``check_ir``: also compare the CollectiveIR of the traced graph with the program."""
    t0 = time.perf_counter()
    pipes = [p for p in (all_pipelines() if pipelines is None else pipelines) if applicable(p, program)]
    res = CheckResult(program, pipelines_run=[p.name for p in pipes])
    try:
        prep = prepare(program, pipes, check_ir=check_ir)
    except Exception as e:  # noqa: BLE001
        res.failures.append(
            Failure("trace", "generator", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        )
        res.seconds = time.perf_counter() - t0
        return res
    traced, optimised = prep.traced, prep.optimised
    res.failures.extend(prep.failures)
    res.graph_nodes = prep.graph_nodes
    res.pipelines_changed = sorted(prep.changed)
    try:
        expected = prep.reference.run(traced.inputs)
    except Exception as e:  # noqa: BLE001
        res.failures.append(
            Failure(
                "reference",
                "generator",
                f"the unoptimised program fails on the reference: "
                f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}",
            )
        )
        res.seconds = time.perf_counter() - t0
        return res
    exact = {p.name: p.exact for p in pipes}
    scaled = {p.name: p.scaled for p in pipes}
    for name, graphs in optimised.items():
        try:
            actual = run_on_reference(traced, graphs)
        except ReferenceSemanticsError as e:
            res.failures.append(Failure(name, "reference_error", f"{type(e).__name__}: {e}"))
            continue
        except Exception as e:  # noqa: BLE001 - e.g. an op called with wrong arguments after a bad rewrite
            res.failures.append(
                Failure(name, "reference_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
            )
            continue
        diff = compare_outputs(actual, expected, exact=exact[name], program=program, scaled=scaled[name])
        if (
            diff is not None
            and not exact[name]
            and _rounding_only(prep.reference, traced, graphs, expected, actual)
        ):
            diff = None
        if diff is not None:
            res.failures.append(Failure(name, "mismatch", diff))
    res.seconds = time.perf_counter() - t0
    return res
