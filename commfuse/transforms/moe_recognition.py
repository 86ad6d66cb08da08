"""moe_recognition: hand-written MoE layers become one ``commfuse::moe_layer`` op.

Contract
- Matches, on the graph Dynamo hands the backend (before AOTAutograd; stage
  ``PRE_AUTOGRAD``): a router (float32 ``linear`` of the tokens and an ``[E, H]``
  weight, ``softmax``, ``topk``, gates renormalised when ``k > 1``) followed by either
  GShard capacity dispatch (one-hot + cumsum slots, einsum dispatch, equal-split
  all_to_alls, batched SwiGLU experts, einsum combine) or torchtitan's dropless
  sort-based dispatch (``histc`` counts, ``argsort``, counts exchanged with
  ``all_to_all_single``, ``.tolist()`` split sizes, ``all_to_all_single_autograd``,
  per-expert SwiGLU over ``split`` chunks, ``scatter_add`` combine). Every value
  of the region must be explained by the templates in :mod:`commfuse.moe.templates`
  (ops, dims, constants, shapes, one process group) and be used only inside the region,
  except the combined output and the router statistics ``commfuse::moe_layer`` returns
  (sums or means over the call's tokens of the probabilities, of the first-choice
  one-hot and of the squared logsumexp; per-expert counts when ``k = 1``).
- Does: replaces the region by one ``commfuse::moe_layer`` call (the user's expert
  weights, transposed where they are stored ``[E, F, H]``; ``capacity_factor`` chosen
  so the op's capacity equals the user's ``C`` for the same token count; one token
  group per call as the user's code has) and feeds the statistics' users from the
  op's statistic outputs (scaled for means). AOTAutograd then differentiates the op
  (``moe_layer_backward``) and the joint-graph passes treat it as a token-wise region
  (:mod:`commfuse.analysis.moe_rules`).
- Guarantees: the same function as the user's code (same routing, same capacity drops,
  same statistics); values equal up to floating-point summation order. Decided from the
  graph alone: every rank rewrites the same regions. No collective is issued while
  compiling; the op's all_to_alls run over the user's group, named in the graph.
- Leaves alone (one refusal line per router, with the reason): sigmoid scores, a
  router computed in low precision, a renormalised top-1 gate or a route scale other
  than 1, statistics the op does not return (per token group, counts over all top-k
  choices), any other use of an intermediate value (e.g. the dispatch mask), all_to_alls
  of one region over different groups, and a region cut by a graph break (its
  intermediate values leave the graph; the dropless style needs
  ``torch._dynamo.config.capture_scalar_outputs = True`` to be one graph).

Source: Chimera (ISCA '25) §3.2 treats the MoE dispatch as one region with known
semantics; GShard (Lepikhin et al. 2020, §2.2) and torchtitan's token-choice MoE are the
two implementations recognised.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from commfuse.ir.walk import descendants
from commfuse.moe.by_meaning import MeaningMatch, NotMoE, recognise, routers
from commfuse.moe.patterns import op_name, static_shape, value
from commfuse.moe.regions import Match, fragments, prove
from commfuse.moe.templates import STAT_OUTPUT, Matcher
from commfuse.ops.moe_layer.op import MOE_LAYER
from commfuse.ops.moe_layer.routing import capacity_factor_for
from commfuse.passmgr.base import FuzzSpec, GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext

_VALUE_KEYS = ("example_value", "val", "tensor_meta", "grapharg", "unbacked_bindings")


def _fake_mode(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    vals = [value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


class _Emitter:
    """Appends nodes after ``anchor`` one by one, each with its example value."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node, meta_from: fx.Node) -> None:
        self.graph, self.last, self.meta_from = gm.graph, anchor, meta_from
        self.mode = _fake_mode(gm)
        self.key = (
            "example_value" if "example_value" in meta_from.meta or "val" not in meta_from.meta else "val"
        )

    def __call__(self, target: Callable[..., Any], *args: Any) -> fx.Node:
        with self.graph.inserting_after(self.last):
            node = self.graph.call_function(target, args)
        for k, v in self.meta_from.meta.items():
            if k not in _VALUE_KEYS:
                node.meta.setdefault(k, v)
        vals = fx.node.map_arg(args, lambda n: value(n))
        # The mode of the operands' own fake tensors (the tracing context may hold another).
        modes = [v.fake_mode for v in torch.utils._pytree.tree_leaves(vals) if hasattr(v, "fake_mode")]
        mode = modes[0] if modes else self.mode
        if mode is not None:
            with mode:
                node.meta[self.key] = target(*vals)
        self.last = node
        return node


def _rewrite(gm: fx.GraphModule, m: Match) -> Optional[str]:
    """Splice the op in for ``m``; returns why not when the graph order forbids it."""
    g = gm.graph
    info = m.info
    order = {n: i for i, n in enumerate(g.nodes)}
    x = _unflattened(info.x, info.hidden)
    inputs = [x, info.w, *m.weights]
    anchor = max(inputs, key=order.__getitem__)
    exits = [*m.outs, *(n for n, _, _ in m.stats)]
    first_use = min(order[u] for n in exits for u in n.users if u not in m.nodes)
    if order[anchor] >= first_use:
        return "an operand of the op is computed after a use of the region's results"
    cap_factor = 0.0
    if m.capacity:
        tokens_per_group = info.tokens // m.token_groups
        cap_factor = capacity_factor_for(m.capacity, m.top_k, tokens_per_group, info.num_experts)
        if cap_factor is None:
            return f"no capacity_factor gives capacity {m.capacity} for {tokens_per_group} tokens"
    emit = _Emitter(gm, anchor, m.outs[0])
    weights = [
        emit(torch.transpose, w, -2, -1) if t else w for w, t in zip(m.weights, m.transposed, strict=True)
    ]
    op = emit(MOE_LAYER, x, info.w, *weights, m.top_k, cap_factor, m.token_groups, m.group_name)
    out = emit(operator.getitem, op, 0)

    def feed(node: fx.Node, new: fx.Node) -> None:
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u not in m.nodes)

    for n in m.outs:
        feed(n, out if static_shape(n) == static_shape(x) else emit(torch.reshape, out, static_shape(n)))
    for n, which, scale in m.stats:
        v = emit(operator.getitem, op, STAT_OUTPUT[which])
        if scale != 1.0:
            v = emit(operator.mul, v, scale)
        if static_shape(n) != static_shape(v):
            v = emit(torch.reshape, v, static_shape(n))
        want = value(n).dtype
        if want != torch.float32:
            v = emit(torch.Tensor.to, v, want)
        feed(n, v)
    for n in reversed(list(g.nodes)):
        if n in m.nodes:
            g.erase_node(n)
    _erase_unused_helpers(g, inputs)
    return None


_MOVABLE = ("all_gather", "all_reduce", "reduce_scatter")
_FUNCOL = "torch.distributed._functional_collectives"


def _from_parallel_compute(x: fx.Node, limit: int = 10_000) -> bool:
    """Whether the tokens ``x`` come out of tensor- or sequence-parallel compute: somewhere on
    their path (values of at least two dims whose last dim is the hidden size, so weights and
    norm scales are not followed) a gather, all_reduce or reduce_scatter, or a DTensor sharded
    or partial over its placements. That is what collective motion can move past the op once the
    layer is one region. A replicated DTensor (a data-parallel norm weight), an all_to_all (an
    earlier expert-parallel layer) or a sharded parameter feeding a weight is not."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial, Shard

    hidden = (static_shape(x) or [None])[-1]

    def on_token_path(n: fx.Node) -> bool:
        v = value(n)
        vals = v if isinstance(v, (tuple, list)) else (v,)  # chunk / split results too
        return any(len(getattr(t, "shape", ())) >= 2 and t.shape[-1] == hidden for t in vals)

    seen, todo = set(), [x]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        v = value(n)
        if isinstance(v, DTensor) and any(isinstance(p, (Shard, Partial)) for p in v.placements):
            return True
        name = op_name(n) or ""
        funcol = name.startswith("c10d.") or getattr(n.target, "__module__", "") == _FUNCOL
        if funcol and any(k in name for k in _MOVABLE):
            return True
        todo.extend(a for a in n.all_input_nodes if on_token_path(a))
    return False


def _unflattened(x: fx.Node, hidden: int) -> fx.Node:
    """The tensor ``x`` was reshaped from, while that only regroups the token dims.

    The op flattens the leading dims itself in row-major order, as the reshape did, so
    it may take the unflattened tokens; keeping e.g. the sequence dim is what lets
    collective motion run the op on sequence shards."""
    while op_name(x) in ("reshape", "view") and isinstance(x.args[0], fx.Node):
        src = static_shape(x.args[0])
        if not src or src[-1] != hidden or static_shape(x)[-1] != hidden:
            break
        x = x.args[0]
    return x


def _erase_unused_helpers(g: fx.Graph, keep: list[fx.Node]) -> None:
    """Helpers the region used (weight slices and casts, aranges) that nothing uses now."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(g.nodes)):
            if n.users or n in keep or n.op not in ("call_function", "call_method"):
                continue
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            pure = (
                n.op == "call_method"
                and n.target in ("float", "to", "transpose", "t", "repeat", "view", "reshape")
                or n.op == "call_function"
                and (n.target in (operator.getitem, torch.arange, torch.transpose) or name in ("arange",))
            )
            if pure:
                g.erase_node(n)
                changed = True


class MoERecognition(GraphPass):
    __doc__ = __doc__
    name = "moe_recognition"
    stage = Stage.PRE_AUTOGRAD
    # MoE recognition rewrites the Dynamo (torch-level) graph before AOTAutograd (stage
    # PRE_AUTOGRAD); the fuzzer generates and checks ATen joint graphs, on which the pass never runs.
    fuzz = FuzzSpec(
        not_fuzzed="runs on the torch-level Dynamo graph before AOTAutograd, and the fuzzer generates ATen joint graphs "
        "where that stage never runs, so a registration would check nothing. Covered instead by "
        "tests/test_moe_recognition.py: randomised layer shapes / top-k / capacity / EP degrees recognised and "
        "compared with eager in one process (test_random_variants_match_eager), both styles on 4 gloo ranks "
        "(outputs and gradients, fp32 and bf16), the TP/SP+EP block after chimera, and every refusal case; "
        "recognition by meaning by randomised independently written layers (GShard einsum, sort-based dropless, "
        "Hugging Face expert loop; test_random_independent_variants_match_eager) and the same three on 4 gloo "
        "ranks. "
        "The op it emits is fuzzed through the moe_layer family (collective_motion, chimera)."
    )

    def run(self, ctx: PassContext) -> PassResult:
        gm = ctx.gm
        matcher = Matcher(gm).run()
        matches, refusals = prove(matcher)
        counts: dict[str, int] = {}
        mode = ctx.config.moe_recognition
        by_template = {m.info.root for m in matches}
        for m in matches:
            where = f"MoE router {m.info.root.name}"
            why = _mode_refusal(mode, m.info.x)
            if why is None:
                why = _rewrite(gm, m)
            if why is not None:
                refusals.append(f"{where}: left unchanged: {why}")
                continue
            counts[f"{m.style}_rewritten"] = counts.get(f"{m.style}_rewritten", 0) + 1
        reported: set[fx.Node] = set()
        for topk, logits, router in list(routers(gm)):
            reported |= descendants(topk)  # this router's report covers its dispatch
            info = matcher.regions.get(logits) if logits is not None else None
            if logits in by_template or (info is not None and info.reasons):
                continue  # the template decided, with its reason
            if isinstance(router, str):
                _refuse(refusals, (logits or topk).name, router)
                continue
            where = f"MoE router {router.logits.name}"
            try:
                meaning = recognise(gm, router)
            except NotMoE as e:
                _refuse(refusals, router.logits.name, f"by meaning: {e}")
                continue
            why = _mode_refusal(mode, meaning.tokens) or _rewrite_by_meaning(gm, meaning)
            refusals[:] = [line for line in refusals if not line.startswith(where + ":")]
            if why is not None:
                refusals.append(f"{where}: left unchanged: {why}")
                continue
            counts["by_meaning_rewritten"] = counts.get("by_meaning_rewritten", 0) + 1
        refusals += fragments(matcher, exclude=reported)
        if counts:
            gm.graph.lint()
        return PassResult(changed=bool(counts), counts=counts, refusals=refusals)


def _mode_refusal(mode: str, tokens: fx.Node) -> Optional[str]:
    if mode == "off":
        return "Config.moe_recognition='off'"
    if mode == "auto" and not _from_parallel_compute(tokens):
        return (
            "its tokens do not come from tensor/sequence-parallel compute, so motion has nothing to move "
            "and the op's backward would send more bytes than the layer's own "
            "(Config.moe_recognition='always' rewrites anyway)"
        )
    return None


def _refuse(refusals: list[str], router: str, why: str) -> None:
    """One line per router: a reason found by meaning joins the template's."""
    where = f"MoE router {router}:"
    for i, line in enumerate(refusals):
        if line.startswith(where):
            refusals[i] = f"{line}; {why}"
            return
    refusals.append(f"{where} left unchanged: {why}")


def _rewrite_by_meaning(gm: fx.GraphModule, m: MeaningMatch) -> Optional[str]:
    """Splice the op in for the region ``m`` proved; returns why not when the graph order forbids it."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    r = m.router
    leaves = [r.weight, *(leaf for w in m.weights for leaf in w.leaves)]
    anchor = max([m.tokens, *leaves], key=order.__getitem__)
    outside = [u for u in m.out.users if u not in m.region]
    if outside and order[anchor] >= min(order[u] for u in outside):
        return "an operand of the op is computed after a use of the region's result"
    emit = _Emitter(gm, anchor, m.out)
    weights = [w.build(lambda n: n, emit) for w in m.weights]
    router_w = emit(torch.transpose, r.weight, 0, 1) if r.weight_transposed else r.weight
    op = emit(
        MOE_LAYER, m.tokens, router_w, *weights, r.top_k, m.capacity_factor, m.token_groups, m.group_name
    )
    out = emit(operator.getitem, op, 0)
    if static_shape(m.out) != static_shape(m.tokens):
        out = emit(torch.reshape, out, static_shape(m.out))
    m.out.replace_all_uses_with(out, delete_user_cb=lambda u: u not in m.region)
    for n in reversed(m.dead):
        g.erase_node(n)
    return None
