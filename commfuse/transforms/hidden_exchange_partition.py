"""hidden_exchange_partition: cut a token exchange (all_to_all of ``[tokens, hidden]`` rows)
along its hidden dim, together with the expert matmuls that read or write it, so one column
block's exchange runs under another block's matmul.

A dropless MoE dispatch written as graph all_to_alls (torchtitan's token dispatcher) has split
sizes that depend on the routing (unbacked symbols): its rows cannot be cut without new symbols
for every chunk, and the expert compute regroups the rows by expert, so no row chunk is
independent. Its columns can be cut: every chunk exchange has the same split sizes (the same
rows, fewer columns), and the matmuls that write the exchanged buffer (or read it as their
output dim) are exact per column block.

Contract
- Matches an all_to_all (``all_to_all_single``, split and concatenated along dim 0, any split
  sizes, unbacked included) of a 2-D ``[rows, H]`` tensor on a group of >= 2 ranks, one wait, not
  coalesced or in place, ``H`` static and divisible by k, and one of:
  * *producer* (the combine): the exchanged buffer is computed, column for column, by a chain
    whose every value is used only inside it: ``index_put`` of rows into a fresh
    ``new_zeros`` / ``new_empty`` / ``zeros`` / ``empty`` / ``full`` buffer, dtype casts, element-wise
    ``add`` / ``sub`` / ``mul`` of such values, down to matmuls whose output columns are the
    hidden dim (``_grouped_mm(a, b[E, F, H], offs)``, ``mm(a, b[F, H])``): each column block is
    that matmul with the weight's columns sliced;
  * *consumer* (the dispatch): the received rows are read by a chain of row gathers
    (``index`` on dim 0), dtype casts and transposes into matmuls for which the hidden dim is an
    output dim (``_grouped_mm(x.T[H, rows], b[rows, F], offs) -> [E, H, F]``, the weight
    gradient of the combine's matmul) or, in float32 / float64 only, the contraction dim
    (partial sums over the column blocks added). Other readers of a chain value get it put
    back together (concatenated).
  The chain must contain at least one matmul, else there is nothing to overlap.
- Does: producer: for each column block i in turn, the chain on the block's columns, then
  block i's exchange issued; the blocks are waited where the exchange was and concatenated
  along the hidden dim. Consumer: every block's exchange issued where the exchange was (the
  input's column blocks), then, once the chain's other inputs are ready, for each block its
  wait and its chain; results concatenated (output dims) or added (contractions). So block i's
  exchange is on the wire while block i - 1 / i + 1 is multiplied. k = ``Config.workload_chunks``
  if set; else, with a cost model, the count of 2, 4, .. ``Config.max_chunks`` whose rewritten
  graph (a copy) the simulator predicts fastest, kept only if faster than the whole exchange
  (the split sizes priced at balanced routing, :mod:`commfuse.costmodel.symbol_hints`); without
  one, 2 (torchtitan graph_trainer's split count).
- Guarantees: the same rows cross the wire in the same order with the same split sizes, on the
  same group; the chunk exchanges together move exactly the exchange's bytes. Column blocks of
  a matmul's output are exact (the same dot products); contractions are cut only in float32 /
  float64 (partial sums added: equal up to summation order), never in a low-precision dtype,
  whose partial sums would each be rounded. Decided from the graph and the config alone: every
  rank cuts the same exchanges into the same blocks. No process group is created.
- Leaves alone, one refusal line per all_to_all: exchanges of other ranks or dims, hidden sizes
  k does not divide, cuts the simulator does not predict faster, producer values also read
  outside the chain (e.g. saved for backward), chains with no matmul (e.g. a dispatch whose only
  matmuls contract over the hidden dim in bfloat16), and matmul operands computed from the
  exchanged rows or by ops that cannot move before the chain.

Stage: SCHEDULE (the partitioned forward and backward graphs).

Source: Centauri (ASPLOS '24) §3.1, workload partition: a collective cut with the compute
chain that produces or consumes it, along a dim both preserve; the hidden dim is the
partition dim of the model-parallel matmuls there. The two-chunk default follows torchtitan's
graph_trainer experiment (ep_chunk_pass), which cuts rows and so needs the token dim marked
dynamic before tracing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from commfuse.ir import rewrite
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind, collective_spec, is_wait
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.transforms.partition_search import _copy_context, score_graph
from commfuse.transforms.workload_partition import DEFAULT_CHUNKS, _Builder, cuttable_reason

aten = torch.ops.aten
_A2A = torch.ops._c10d_functional.all_to_all_single.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_CASTS = {
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.contiguous.default,
    torch.ops.prims.convert_element_type.default,
}
_ELEMENTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor}
_FRESH = {
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.zeros.default,
    aten.empty.memory_format,
    aten.full.default,
}
_EXACT_CONTRACTION = {torch.float32, torch.float64}
_GROUPED_MM = aten._grouped_mm.default
_MM = aten.mm.default
_TRANSPOSES = {aten.transpose.int, aten.t.default}
# A chain longer than this holds far more compute than one exchange needs to hide behind.
MAX_CHAIN_OPS = 32


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _dtype(n: Any) -> Optional[torch.dtype]:
    v = _val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _static(x: Any) -> Optional[int]:
    return x if isinstance(x, int) else None


def _reads_rows(n: fx.Node) -> bool:
    """``n`` reads only the row count (dim 0), which every column block has too."""
    return n.op == "call_function" and n.target is aten.sym_size.int and n.args[1] == 0


def _cut_dim(v: torch.Tensor, dim: int, k: int) -> Optional[str]:
    size = _static(v.shape[dim]) if -v.dim() <= dim < v.dim() else None
    if size is None:
        return f"dim {dim} of {list(v.shape)} is not static"
    if size % k:
        return f"dim {dim} ({size}) is not divisible by {k}"
    return None


# ---------------------------------------------------------------------------- chains
@dataclass
class Step:
    """One chain node: ``dim`` is the cut dim of its result; ``kind`` says how it is emitted."""

    node: fx.Node
    dim: int
    kind: str  # "same" | "transpose" | "matmul_out" | "matmul_contract" | "index_put"
    weight: Optional[fx.Node] = None  # the side operand sliced per block (matmuls)
    weight_dim: int = 0


@dataclass
class Plan:
    collective: Collective
    direction: str  # "producer" | "consumer"
    chunks: int
    steps: list[Step]
    # consumer: chain values read outside the chain, with the dim they are cut along
    outside: dict[fx.Node, int] = field(default_factory=dict)
    # consumer: pure nodes computing the chain's other inputs after the exchange's wait, moved to
    # just after it (in graph order) so that every block's chain can follow its wait
    hoist: list[fx.Node] = field(default_factory=list)
    why: str = ""  # how the block count was chosen

    def describe(self) -> str:
        mats = sum(s.kind.startswith("matmul") for s in self.steps)
        return (
            f"{self.collective.name}: {self.chunks} column blocks of the hidden dim with a {self.direction} "
            f"chain of {len(self.steps)} ops ({mats} matmuls)"
        )


def _matmul_out(node: fx.Node, carrier: fx.Node, dim: int) -> Optional[Step]:
    """``node`` a matmul reading ``carrier`` cut along ``dim``, the cut an output dim: the step."""
    a, b = node.args[0], node.args[1]
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dim() != 2 or vb.dim() != 2:
        return None
    # a [H, rows] cut on dim 0 -> out [E, H, F] (grouped) / [H, F] (mm), dim 1 / 0
    if carrier is a and b is not carrier and dim == 0:
        return Step(node, 1 if node.target is _GROUPED_MM else 0, "matmul_out")
    # b [rows, H] cut on dim 1 -> out [E, F, H] / [F, H], last dim
    if carrier is b and a is not carrier and dim == 1:
        return Step(node, 2 if node.target is _GROUPED_MM else 1, "matmul_out")
    return None


def _matmul_contract(node: fx.Node, carrier: fx.Node, dim: int) -> Optional[Step]:
    """``node`` a matmul contracting ``carrier`` [rows, H] over its cut dim 1 with a weight that
    is not in the chain: a partial sum per block (exact in float32 / float64 only)."""
    a, b = node.args[0], node.args[1]
    va, vb = _val(a), _val(b)
    if carrier is not a or b is carrier or dim != 1 or not isinstance(vb, torch.Tensor) or va.dim() != 2:
        return None
    if va.dtype not in _EXACT_CONTRACTION:
        return None
    wdim = 1 if (node.target is _GROUPED_MM and vb.dim() == 3) else 0 if node.target is _MM else None
    if wdim is None:
        return None
    return Step(node, -1, "matmul_contract", weight=b, weight_dim=wdim)


def _consumer_step(node: fx.Node, carrier: fx.Node, dim: int) -> Optional[Step]:
    t = node.target
    if node.op != "call_function" or rewrite.mutates(node):
        return None
    if t in _CASTS and node.args[0] is carrier and not any(isinstance(a, fx.Node) for a in node.args[1:]):
        return Step(node, dim, "same")
    if t is aten.index.Tensor and node.args[0] is carrier:
        idx = node.args[1]
        if (
            dim != 0
            and len(idx) == 1
            and isinstance(idx[0], fx.Node)
            and _val(idx[0]) is not None
            and _val(idx[0]).dim() == 1
        ):
            return Step(node, dim, "same")
        return None
    if t in _TRANSPOSES and node.args[0] is carrier and _val(carrier).dim() == 2:
        return Step(node, 1 - dim, "transpose")
    if t is aten.permute.default and node.args[0] is carrier and list(node.args[1]) == [1, 0]:
        return Step(node, 1 - dim, "transpose")
    if t in (_GROUPED_MM, _MM) and len(node.args) >= 2:
        return _matmul_out(node, carrier, dim) or _matmul_contract(node, carrier, dim)
    return None


def consumer_plan(c: Collective, k: int) -> Plan | str:
    root = c.waits[0]
    steps: list[Step] = []
    dims: dict[fx.Node, int] = {root: 1}
    outside: dict[fx.Node, int] = {}
    frontier = [root]
    while frontier:
        v = frontier.pop(0)
        for u in v.users:
            if _reads_rows(u):
                continue
            step = _consumer_step(u, v, dims[v])
            if step is None or len(steps) >= MAX_CHAIN_OPS:
                outside[v] = dims[v]
                continue
            if u in dims:
                continue
            steps.append(step)
            dims[u] = step.dim
            if step.kind in ("same", "transpose"):
                frontier.append(u)
    if not any(s.kind.startswith("matmul") for s in steps):
        low = [
            u.name
            for s in [Step(root, 1, "same"), *steps]
            for u in s.node.users
            if u.target in (_GROUPED_MM, _MM) and _dtype(s.node) not in _EXACT_CONTRACTION
        ]
        why = (
            (
                f" (the matmuls {', '.join(low)} contract over the hidden dim in a low-precision dtype, whose partial "
                "sums would each be rounded)"
            )
            if low
            else ""
        )
        return f"consumer: no matmul reads the exchanged rows column block by column block{why}"
    # matmul results are put back together by the steps themselves; views/casts read outside
    # the chain are concatenated
    steps = _prune(steps, outside)
    chain_nodes = {s.node for s in steps}
    if any(u not in chain_nodes and not _reads_rows(u) for u in root.users):
        outside[root] = 1
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    side = [a for s in steps for a in s.node.all_input_nodes if a not in chain_nodes and a is not root]
    hoist = _late_inputs(side, root, chain_nodes, order)
    if isinstance(hoist, str):
        return f"consumer: {hoist}"
    return Plan(c, "consumer", k, steps, outside=outside, hoist=hoist)


def _late_inputs(
    side: list[fx.Node], root: fx.Node, chain_nodes: set[fx.Node], order: dict[fx.Node, int]
) -> list[fx.Node] | str:
    """The nodes after ``root`` that the chain's side inputs need, in graph order, or why they
    cannot all be computed before the chain (they read the chain, or are not pure)."""
    late: set[fx.Node] = set()
    todo = [a for a in side if order[a] > order[root]]
    while todo:
        n = todo.pop()
        if n in late:
            continue
        if n in chain_nodes or n is root:
            return f"a matmul's other operand ({n.name}) is computed from the exchanged rows"
        if (
            n.op != "call_function"
            or rewrite.mutates(n)
            or collective_spec(n.target) is not None
            or is_wait(n.target)
        ):
            return f"a matmul's other operand needs {n.name}, which cannot move before the chain"
        late.add(n)
        # the wait itself too: an operand read from the exchanged rows cannot move before the chain
        todo.extend(
            a
            for a in n.all_input_nodes
            if (a is root or order[a] > order[root]) and not (a is root and _reads_rows(n))
        )
    return sorted(late, key=order.__getitem__)


def _prune(steps: list[Step], outside: dict[fx.Node, int]) -> list[Step]:
    """Drop views/casts that lead to no matmul (their values are read outside only)."""
    keep: set[fx.Node] = {s.node for s in steps if s.kind.startswith("matmul")}
    changed = True
    while changed:
        changed = False
        for s in steps:
            if s.node not in keep and any(u in keep for u in s.node.users):
                keep.add(s.node)
                changed = True
    for s in steps:
        if s.node not in keep:
            outside.pop(s.node, None)
    # a kept view whose value is also read by a dropped one is read outside the chain
    for s in steps:
        if s.node in keep and s.kind in ("same", "transpose") and any(u not in keep for u in s.node.users):
            outside[s.node] = s.dim
    return [s for s in steps if s.node in keep]


def _producer_step(node: fx.Node, dim: int) -> Step | str:
    t = node.target
    if node.op != "call_function":
        return f"{node.name} is a graph input"
    if rewrite.mutates(node):
        return f"{node.name} writes in place"
    v = _val(node)
    if t in (_GROUPED_MM, _MM) and len(node.args) >= 2:
        b = node.args[1]
        vb = _val(b)
        if isinstance(vb, torch.Tensor) and vb.dim() in (2, 3) and v.dim() == 2 and dim == 1:
            return Step(node, dim, "matmul_out", weight=b, weight_dim=vb.dim() - 1)
        return f"{node.name}: a matmul whose output columns are not its weight's last dim"
    if t in _CASTS and not any(isinstance(a, fx.Node) for a in node.args[1:]):
        return Step(node, dim, "same")
    if t in _ELEMENTWISE:
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if all(isinstance(_val(a), torch.Tensor) and tuple(_val(a).shape) == tuple(v.shape) for a in tensors):
            return Step(node, dim, "same")
        return f"{node.name}: an element-wise op with a broadcast operand"
    if t is aten.index_put.default:
        base, idx = node.args[0], node.args[1]
        if (
            isinstance(base, fx.Node)
            and base.target in _FRESH
            and len(base.users) == 1
            and dim != 0
            and len(idx) == 1
            and isinstance(idx[0], fx.Node)
        ):
            return Step(node, dim, "index_put")
        return f"{node.name}: index_put into a buffer that is not fresh or is indexed on the cut dim"
    return f"{node.name} ({getattr(t, '__name__', t)}) is not cut column by column"


def producer_plan(c: Collective, k: int) -> Plan | str:
    top = c.start.args[0]
    steps: list[Step] = []
    dims: dict[fx.Node, int] = {}
    todo = [(top, 1)]
    fresh: set[fx.Node] = set()  # new_* buffers: they read their operand's dtype and device only
    while todo:
        v, dim = todo.pop()
        if v in dims:
            continue
        owners = {c.start, *dims, *fresh}
        if any(u not in owners for u in v.users):
            return f"producer: {v.name} is also read outside the chain"
        step = _producer_step(v, dim)
        if isinstance(step, str):
            return f"producer: {step}"
        if len(steps) >= MAX_CHAIN_OPS:
            return "producer: chain longer than the exchange needs"
        steps.append(step)
        dims[v] = dim
        if step.kind == "matmul_out":
            continue
        if step.kind == "index_put":
            fresh.add(v.args[0])
            todo.append((v.args[2], dim))
        else:
            todo.extend((a, dim) for a in v.args[:2] if isinstance(a, fx.Node))
    if not any(s.kind == "matmul_out" for s in steps):
        return "producer: no matmul computes the exchanged buffer's columns"
    order = {n: i for i, n in enumerate(c.start.graph.nodes)}
    return Plan(c, "producer", k, sorted(steps, key=lambda s: order[s.node]))


def why_not(c: Collective, k: int) -> Optional[str]:
    if c.kind is not CollectiveKind.ALL_TO_ALL or c.start.target is not _A2A:
        return "not an all_to_all_single"
    why = cuttable_reason(c)
    if why is not None:
        return why
    v = _val(c.start.args[0])
    if not isinstance(v, torch.Tensor) or v.dim() != 2:
        return "the exchanged tensor is not 2-D [rows, hidden]"
    return _cut_dim(v, 1, k)


def plan_hidden_partition(ctx: PassContext, c: Collective, chunks: Optional[int] = None) -> Plan | str:
    """The column-block partition of ``c`` (producer chain first, else consumer), or why not."""
    k = chunks or ctx.config.workload_chunks or DEFAULT_CHUNKS
    k = min(int(k), ctx.config.max_chunks)
    if k < 2:
        return f"{k} chunk(s)"
    why = why_not(c, k)
    if why is not None:
        return why
    reasons = []
    for plan_fn in (producer_plan, consumer_plan):
        p = plan_fn(c, k)
        if not isinstance(p, str):
            return p
        reasons.append(p)
    return "; ".join(reasons)


# ---------------------------------------------------------------------------- emitting
class _Emit(_Builder):
    """``workload_partition``'s builder (nodes inserted before ``before``, each with its fake
    value), every node taking ``meta_from``'s metadata."""

    def __init__(self, gm: fx.GraphModule, before: fx.Node, meta_from: fx.Node) -> None:
        super().__init__(gm, rewrite.fake_mode_of(gm), before)
        self.meta_from = meta_from

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.call(target, args, self.meta_from, kwargs)

    def block(self, x: fx.Node, dim: int, k: int, i: int) -> fx.Node:
        size = _val(x).shape[dim]
        w = size // k
        return self(aten.slice.Tensor, x, dim, i * w, (i + 1) * w)


def _replay(em: _Emit, step: Step, env: dict[fx.Node, fx.Node], k: int, i: int) -> fx.Node:
    n = step.node
    sub = lambda a: env.get(a, a) if isinstance(a, fx.Node) else a  # noqa: E731
    # views, casts and a consumer's output-dim matmul: the cut operand is in env
    if step.kind in ("same", "transpose") or (step.kind == "matmul_out" and step.weight is None):
        return em(n.target, *fx.node.map_arg(n.args, sub), **n.kwargs)
    if step.kind in ("matmul_out", "matmul_contract"):
        w = _matmul_ready(em, em.block(step.weight, step.weight_dim, k, i), n)
        if step.kind == "matmul_out":  # producer: the weight's output columns
            return em(n.target, n.args[0], w, *n.args[2:], **n.kwargs)
        args = list(fx.node.map_arg(n.args, sub))
        args[1] = w
        return em(n.target, *args, **n.kwargs)
    if step.kind == "index_put":
        base = n.args[0]
        # new_* take (self, size, ...), reading self for dtype and device only: the block's value
        # serves; zeros / empty / full take (size, ...)
        lead = [sub(base.args[0])] if base.target in (aten.new_zeros.default, aten.new_empty.default) else []
        size_args = list(base.args[len(lead)])
        size_args[step.dim] = _val(base).shape[step.dim] // k
        fresh = em(base.target, *lead, size_args, *base.args[len(lead) + 1 :], **base.kwargs)
        return em(n.target, fresh, n.args[1], env[n.args[2]], *n.args[3:], **n.kwargs)
    raise AssertionError(step.kind)


def _matmul_ready(em: _Emit, w: fx.Node, mm: fx.Node) -> fx.Node:
    """A weight block as ``_grouped_mm`` takes it: one of its last two dims of stride 1 (a column
    block of a row-major weight is still row-major, of a column-major one column-major); else a
    copy."""
    v = _val(w)
    if mm.target is not _GROUPED_MM or 1 in tuple(v.stride())[-2:]:
        return w
    return em(aten.clone.default, w, memory_format=torch.contiguous_format)


def _issue(em: _Emit, c: Collective, x: fx.Node) -> fx.Node:
    return em(_A2A, x, *c.start.args[1:], **c.start.kwargs)


def emit_producer(gm: fx.GraphModule, plan: Plan) -> list[fx.Node]:
    c, k = plan.collective, plan.chunks
    em = _Emit(gm, c.start, c.start)
    top = c.start.args[0]
    starts = []
    for i in range(k):
        env: dict[fx.Node, fx.Node] = {}
        for step in plan.steps:  # graph order: operands first
            env[step.node] = _replay(em, step, env, k, i)
        starts.append(_issue(em, c, env[top]))
    wait = c.waits[0]
    tail = _Emit(gm, wait, wait)
    parts = [tail(_WAIT, s) for s in starts]
    whole = tail(aten.cat.default, parts, 1)
    _row_readers_to(c, starts[0])
    wait.replace_all_uses_with(whole)
    _erase(gm, [wait, c.start, *reversed([s.node for s in plan.steps])])
    return starts


def emit_consumer(gm: fx.GraphModule, plan: Plan) -> list[fx.Node]:
    c, k = plan.collective, plan.chunks
    head = _Emit(gm, c.start, c.start)
    x = c.start.args[0]
    starts = [_issue(head, c, head.contiguous(head.block(x, 1, k, i), c.start, force=True)) for i in range(k)]
    root = c.waits[0]
    at = root
    for n in plan.hoist:
        at.append(n)
        at = n
    em = _Emit(gm, at.next, root)
    envs = []
    for i in range(k):
        env = {root: em(_WAIT, starts[i])}
        for step in plan.steps:
            env[step.node] = _replay(em, step, env, k, i)
        envs.append(env)
    for step in plan.steps:
        n = step.node
        if step.kind == "matmul_contract":
            acc = envs[0][n]
            for env in envs[1:]:
                acc = em(aten.add.Tensor, acc, env[n])
            n.replace_all_uses_with(acc)
        elif step.kind == "matmul_out":
            n.replace_all_uses_with(em(aten.cat.default, [env[n] for env in envs], step.dim))
    chain_nodes = {s.node for s in plan.steps}
    for v, dim in plan.outside.items():
        whole = em(aten.cat.default, [env[v] for env in envs], dim)
        v.replace_all_uses_with(whole, delete_user_cb=lambda u: u not in chain_nodes and not _reads_rows(u))
    _row_readers_to(c, starts[0])
    _erase(gm, [*reversed([s.node for s in plan.steps]), root, c.start])
    return starts


def _row_readers_to(c: Collective, start: fx.Node) -> None:
    """Point the exchange's row-count readers at a block's exchange (the same rows)."""
    for old in (c.start, *c.waits):
        for u in [u for u in old.users if _reads_rows(u)]:
            u.replace_input_with(old, start)


def _erase(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    for n in nodes:
        if not getattr(n, "_erased", False) and not n.users:
            rewrite.erase_dead(gm, [n])
    left = [n.name for n in nodes if not getattr(n, "_erased", False) and n.users]
    if left:
        raise RuntimeError(f"hidden_exchange_partition: {', '.join(left)} still have users after the rewrite")


def apply_hidden_partition(gm: fx.GraphModule, plan: Plan) -> list[fx.Node]:
    return (emit_producer if plan.direction == "producer" else emit_consumer)(gm, plan)


class HiddenExchangePartition(GraphPass):
    __doc__ = __doc__
    name = "hidden_exchange_partition"
    stage = Stage.SCHEDULE
    # The moe family's dropless_exchange block builds both chains (uneven all_to_all rows, a
    # row gather, matmuls over the hidden dim, an index_put into a fresh buffer, the inverse
    # all_to_all). Contractions cut in float32 add partial sums: tolerance compare.
    fuzz = FuzzSpec(generators=("moe",), scaled_tolerance=True)

    def run(self, ctx: PassContext) -> PassResult:
        counts = {"exchanges_partitioned": 0, "chunk_collectives": 0, "chain_ops": 0}
        refusals: list[str] = []
        decisions: list[dict] = []
        names = [c.name for c in ctx.ir.collectives if c.kind is CollectiveKind.ALL_TO_ALL]
        changed = False
        whole: list[float] = []  # the current graph's predicted makespan, once priced
        for name in names:
            c = next((x for x in ctx.ir.collectives if x.name == name), None)
            if c is None:
                continue
            plan = self._choose(ctx, c, whole)
            if isinstance(plan, str):
                refusals.append(f"{name}: not partitioned: {plan}")
                continue
            starts = apply_hidden_partition(ctx.gm, plan)
            changed = True
            whole.clear()
            ctx.invalidate()
            counts["exchanges_partitioned"] += 1
            counts["chunk_collectives"] += len(starts)
            counts["chain_ops"] += len(plan.steps)
            decisions.append(
                {
                    "collective": name,
                    "direction": plan.direction,
                    "chunks": plan.chunks,
                    "dim": 1,
                    "decision": plan.describe() + (f" ({plan.why})" if plan.why else ""),
                }
            )
        if changed:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return PassResult(changed=changed, counts=counts, refusals=refusals, decisions=decisions)

    @staticmethod
    def _choose(ctx: PassContext, c: Collective, priced: list[float]) -> Plan | str:
        """``Config.workload_chunks`` (or 2 without a cost model) as planned; with a cost model, the
        block count whose graph the simulator predicts fastest, if faster than the whole
        exchange (each candidate applied to a copy of the graph and scored). ``priced``: the
        current graph's makespan when already priced (filled here)."""
        if ctx.config.workload_chunks is not None or ctx.cost.model is None:
            return plan_hidden_partition(ctx, c)
        if not priced:
            priced.append(score_graph(_copy_context(ctx)).makespan_us)
        whole = priced[0]
        best: Optional[tuple[float, Plan]] = None
        reasons = []
        k = 2
        while k <= ctx.config.max_chunks:
            plan = plan_hidden_partition(ctx, c, chunks=k)
            if isinstance(plan, str):
                reasons.append(plan)
            else:
                trial = _copy_context(ctx)
                twin = next(x for x in trial.ir.collectives if x.name == c.name)
                apply_hidden_partition(trial.gm, plan_hidden_partition(trial, twin, chunks=k))
                trial.gm.recompile()
                trial.invalidate()
                t = score_graph(trial).makespan_us
                if best is None or t < best[0]:
                    best = (t, plan)
            k *= 2
        if best is None:
            return "; ".join(dict.fromkeys(reasons))
        t, plan = best
        if t >= whole:
            return (
                f"predicted slower than the whole exchange: {plan.chunks} blocks {t:.1f} us, whole "
                f"{whole:.1f} us (the fastest count of 2..{ctx.config.max_chunks})"
            )
        plan.why = (
            f"predicted {t:.1f} us, whole {whole:.1f} us, the fastest count of 2..{ctx.config.max_chunks}"
        )
        return plan
