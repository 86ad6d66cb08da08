"""Which sizes of a graph every rank of a group shares: what a cost-based decision may price.

The rule (docs/architecture.md, "Same decision on every rank"). A decision that changes which
collectives run or their order -- the step-time gate, bucketing, the gloo lowering, the
scheduler's issue order, partitioning, motion -- must come out the same on every rank of every
group whose collectives it changes. Every rank runs the same program, so two ranks' graphs differ
only in the sizes that follow from their inputs; a data-parallel rank's local batch is such an
input, and it may differ between the ranks of the group (token-budget packing, an uneven last
batch), static on one rank and symbolic on another. So:

* a decision may use compute shapes and times only where those shapes follow from inputs
  replicated across the groups whose collectives it changes;
* everything else is priced from facts every rank of those groups shares: collective sizes, the
  graph's structure, the config, the topology, the profile, rank-invariant size hints
  (:mod:`commfuse.costmodel.symbol_hints`).

How a graph's sizes are classified (:func:`varying_nodes`):

* **Groups that split the batch.** A group whose ranks share the batch -- every collective on it
  has the TP or SP role, declared (``Config.group_roles``, ``commfuse.setup(mesh=)``, a DTensor
  mesh's dim name) -- holds the same sizes on every rank: nothing of the graph varies across it.
  Any other group (DP, FSDP, EP, PP, a role nobody knows, or a TP/SP role inferred from the graph
  alone) may hold a different local batch on each rank. An inferred role is not enough: the
  pattern it reads (a gather along a non-batch dim, an all_reduce of a matmul's output) is also
  what a data-parallel program with a batch of its own on each rank computes (the fuzzer's
  ``uneven_batch`` family found such a program, docs/reliability.md finding 19).
* **Shared across a splitting group G**, in graph order:
  * the operands and results of G's collectives whose sizes must agree on every rank of G for
    the program to run at all (all_gather, reduce_scatter, all_reduce, broadcast, reduce, an
    all_to_all with even splits of its own dim 0, a many-to-many scatter every rank reads
    alike), with the layout shuffles of a dim-d gather or scatter, and what those operands'
    sizes are a function of: the input of a view, cast or unary elementwise op, of a wait, of
    another equal-size collective (a parameter shard behind its bf16 cast; an activation
    gathered on the tensor-parallel group and then exchanged on the expert group);
  * graph constants (``get_attr``), and the placeholders AOTAutograd marks as parameters or
    buffers;
  * a node whose inputs are all shared and whose size is not read from data (no unbacked
    symbol) nor an argument of the call (``SIZE_FROM_ARGUMENTS``: ``expand``, ``repeat``,
    ``new_zeros``...); a node without inputs only when its value is 0-d (a factory such as
    ``full([64, 16])`` may bake a batch size into a static graph, and so may an expand).
  Every other node -- the data, tangents and saved activations a graph takes as inputs and
  all compute that reads them -- may have different sizes on the ranks of G.
* A graph's **varying nodes** are those that vary across any of its splitting groups: one
  decision orders and prices every group's collectives on one timeline, so it uses only what
  all of them share.

``Config.uniform_batches=True`` states that every rank holds a batch of the same shape: nothing
varies then, and every compute shape is priced.

Rank-invariant by construction: the classification reads the graph's structure and the
collectives' roles only, never a size, so a rank that traced batch 1, one that traced batch 64
and one that traced a symbolic batch classify alike.

Pricing (:meth:`commfuse.costmodel.analytic.AnalyticCostModel.pricing_shared_only`): a varying
node's value has no bytes and a node that reads or makes a varying value takes no time (its size
is unknown to the decision); a collective on another group whose sizes follow the local batch
(a TP all_reduce of activations, seen from the data-parallel group) likewise. The cost policy
(:class:`commfuse.passmgr.cost.CostPolicy`) hands every pass the model restricted so, which is
how the rule is checked in every pass that prices: none holds a model that could price a
varying size.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
import torch.fx as fx

from commfuse.core.torch_private import aot_input_is_parameter
from commfuse.ir.collective import Collective, ParallelRole
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.ir.kinds import CollectiveKind as K
from commfuse.ir.kinds import is_wait
from commfuse.ops.boundary import parse_m2ms

# Roles whose groups share the batch: tensor / sequence parallel ranks compute on the same tokens.
BATCH_SHARING_ROLES = frozenset({ParallelRole.TP, ParallelRole.SP})
# Ops whose output size is an argument of the call rather than a function of their inputs' sizes:
# a static trace bakes this rank's sizes in (the backward of a mean over the local batch expands its
# gradient back to [16, ...] on one rank and [1, ...] on another), so their results never count as
# shared, whatever their inputs (docs/reliability.md, finding 20).
SIZE_FROM_ARGUMENTS = frozenset(
    {
        torch.ops.aten.expand.default,
        torch.ops.aten.repeat.default,
        torch.ops.aten.new_zeros.default,
        torch.ops.aten.new_ones.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_full.default,
    }
)
# Where a role comes from when the user or their parallelisation plan declared it (IRBuildOptions.role_sources)
DECLARED_ROLE_SOURCES = frozenset({"user", "mesh", "dtensor"})
# Collectives whose operand sizes must be equal on every rank of their group.
_EQUAL_SIZE_KINDS = frozenset({K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_REDUCE, K.BROADCAST, K.REDUCE})
# Ops whose output is a view, copy or cast of their one tensor input (same number of elements).
_SAME_NUMEL = frozenset(
    {
        "view",
        "reshape",
        "_unsafe_view",
        "t",
        "transpose",
        "permute",
        "clone",
        "contiguous",
        "detach",
        "alias",
        "squeeze",
        "unsqueeze",
        "_to_copy",
        "convert_element_type",
        "expand_copy",
        "view_copy",
        "as_strided",
        "flatten",
    }
)


def shares_the_batch(c: Collective) -> bool:
    """Whether ``c``'s group is declared tensor or sequence parallel (its ranks compute on the same
    tokens); a role inferred from the graph alone does not say so."""
    return c.role in BATCH_SHARING_ROLES and c.role_source.split("+")[0] in DECLARED_ROLE_SOURCES


def batch_splitting_groups(ir: CollectiveIR) -> dict[str, str]:
    """Group name -> why its ranks may hold different local batches (the role that says so)."""
    out: dict[str, str] = {}
    for c in ir.collectives:
        if not shares_the_batch(c) and c.group.name not in out:
            out[c.group.name] = f"{c.name} has role {c.role.value} ({c.role_source})"
    return out


def sizes_agree(c: Collective) -> bool:
    """Whether the program can only run when every rank of ``c``'s group passes it equal sizes."""
    if c.kind in _EQUAL_SIZE_KINDS:
        return True
    if c.kind is K.ALL_TO_ALL:
        return bool(c.extra.get("equal_splits", True)) and not c.extra.get("rank_local_sizes")
    if c.kind is K.M2MS:
        try:
            m = parse_m2ms(c.start)
        except (ValueError, TypeError, IndexError, KeyError):
            return False
        everyone = list(range(m.group_size))
        pieces = {s for row in m.splits for s in row}
        return sorted(m.src) == everyone and sorted(m.dst) == everyone and len(pieces) == 1
    return False


def _op_name(n: fx.Node) -> str:
    return getattr(n.target, "__name__", "").split(".")[0] if n.op == "call_function" else ""


def _unbacked(v) -> bool:
    """The value's size is read from data (an unbacked symbol: nonzero, data-dependent splits)."""
    vals = v if isinstance(v, (list, tuple)) else [v]
    for t in vals:
        sizes = list(t.shape) if isinstance(t, torch.Tensor) else [t] if isinstance(t, torch.SymInt) else []
        for s in sizes:
            expr = getattr(getattr(s, "node", None), "expr", None)
            if expr is not None and any(str(x).startswith("u") for x in getattr(expr, "free_symbols", ())):
                return True
    return False


def _zero_dim(v) -> bool:
    return (isinstance(v, torch.Tensor) and v.dim() == 0) or isinstance(v, (int, float, bool)) or v is None


def _size_determines_input(
    n: fx.Node, by_start: dict[fx.Node, Collective], by_logical: dict[fx.Node, Collective]
) -> list[fx.Node]:
    """The inputs whose sizes ``n``'s output size determines on every rank: the one input of a
    view, cast or unary elementwise op, a wait's collective, the operands of an equal-size
    collective (its output is a fixed multiple of its input for the group's size), the
    collective whose logical output ``n`` is (DTensor's shuffle after a dim-d gather)."""
    ins = n.all_input_nodes
    if n.op != "call_function":
        return []
    if is_wait(n.target):
        return list(ins[:1])
    c = by_start.get(n)
    if c is not None:
        return [a for a in c.inputs if isinstance(a, fx.Node)] if sizes_agree(c) else []
    c = by_logical.get(n)
    if c is not None and sizes_agree(c):
        return [c.start]
    if len(ins) == 1 and (_op_name(n) in _SAME_NUMEL or torch.Tag.pointwise in getattr(n.target, "tags", ())):
        return list(ins)
    return []


def _anchors(ir: CollectiveIR, group: str) -> set[fx.Node]:
    """The nodes whose sizes ``group``'s collectives fix on every rank of it."""
    out: set[fx.Node] = set()
    by_start = {c.start: c for c in ir.collectives}
    by_logical = {
        c.logical_output: c
        for c in ir.collectives
        if isinstance(c.logical_output, fx.Node) and c.logical_output not in c.waits
    }
    for c in ir.collectives:
        if c.group.name != group or not sizes_agree(c):
            continue
        out.add(c.start)
        out.update(c.waits)
        # as the program means it: DTensor's split/cat shuffles around a dim-d gather or scatter
        out.update(n for n in (c.logical_output, *c.layout_nodes) if isinstance(n, fx.Node))
        stack = [a for a in (*c.inputs, c.logical_input) if isinstance(a, fx.Node)]
        while stack:  # an operand and what its size is a function of
            a = stack.pop()
            if a in out:
                continue
            out.add(a)
            stack.extend(_size_determines_input(a, by_start, by_logical))
    return out


def _shared_across(gm: fx.GraphModule, ir: CollectiveIR, group: str) -> set[fx.Node]:
    shared = _anchors(ir, group)
    for n in gm.graph.nodes:
        if n in shared or n.op == "output":
            continue
        if n.op == "get_attr" or (n.op == "placeholder" and aot_input_is_parameter(n)):
            shared.add(n)
        elif n.op == "call_function" or n.op == "call_method" or n.op == "call_module":
            v = n.meta.get("val")
            ins = n.all_input_nodes
            if (
                (all(i in shared for i in ins) if ins else _zero_dim(v))
                and not _unbacked(v)
                and n.target not in SIZE_FROM_ARGUMENTS
            ):
                shared.add(n)
    return shared


def varying_nodes(
    gm: fx.GraphModule, ir: CollectiveIR, groups: Optional[Iterable[str]] = None
) -> frozenset[fx.Node]:
    """The nodes of ``gm`` whose sizes may differ between two ranks of a group that splits the
    batch (``groups``: only these groups; default every group of the graph). Empty when every
    group shares the batch."""
    splitting = batch_splitting_groups(ir)
    names = [g for g in splitting if groups is None or g in set(groups)]
    if not names:
        return frozenset()
    nodes = list(gm.graph.nodes)
    shared = set(nodes)
    for g in names:
        shared &= _shared_across(gm, ir, g)
    return frozenset(n for n in nodes if n not in shared)


class SharedSizes:
    """``varies(node)``: whether ``node``'s size may differ across the ranks of a splitting group of
    its graph (see the module docstring). Classifies each graph once, when first asked about one
    of its nodes, and again when asked about a node it has not seen (the graph was rewritten).
    ``options``: the IR's group roles (the user's, the mesh's), as the pass context builds its IR."""

    def __init__(self, options: Optional[IRBuildOptions] = None, *, uniform_batches: bool = False) -> None:
        """``uniform_batches``: the user states every rank holds a batch of the same shape
        (``Config.uniform_batches``): nothing varies."""
        self.options = options or IRBuildOptions()
        self.uniform_batches = uniform_batches
        self._graphs: "weakref.WeakKeyDictionary[fx.Graph, tuple[frozenset[fx.Node], frozenset[fx.Node]]]" = (
            weakref.WeakKeyDictionary()
        )

    def classify(self, gm: fx.GraphModule, ir: Optional[CollectiveIR] = None) -> frozenset[fx.Node]:
        """Classify ``gm`` now (``ir``: its IR, when the caller has one built with the same options)."""
        varying = varying_nodes(gm, ir if ir is not None else CollectiveIR(gm, self.options))
        self._graphs[gm.graph] = (frozenset(gm.graph.nodes), varying)
        return varying

    def varies(self, node: fx.Node) -> bool:
        if self.uniform_batches:
            return False
        graph = node.graph
        entry = self._graphs.get(graph)
        if entry is None or node not in entry[0]:
            gm = graph.owning_module
            if not isinstance(gm, fx.GraphModule):
                return False  # a node of no module: nothing to classify it by (never a traced graph's)
            self.classify(gm)
            entry = self._graphs[graph]
        return node in entry[1]


__all__ = [
    "BATCH_SHARING_ROLES",
    "DECLARED_ROLE_SOURCES",
    "SIZE_FROM_ARGUMENTS",
    "SharedSizes",
    "batch_splitting_groups",
    "shares_the_batch",
    "sizes_agree",
    "varying_nodes",
]
