"""The fused train-step partition: one compiled graph runs every micro-batch's forward AND backward.

Why: ``compile_train_step`` sums the micro-batch losses and calls ``.backward()`` once, so
AOTAutograd's usual partition puts every forward in the forward graph and every backward in
the backward graph: micro-batch k's backward can never run beside micro-batch k+1's forward,
which is what DHelix strand interleaving needs. With ``Config(dhelix=True)`` the eager
backend partitions the joint graph with :func:`fused_partition` instead.

Contract
- Matches: a joint graph with exactly one tangent input, a 0-dim one (the step's scalar
  loss), at least two micro-batch tags (``train_step.microbatch_of``).
  Anything else returns a reason string and the caller partitions as usual.
- Produces: a forward graph that computes the forward outputs and every gradient, with the
  tangent replaced by the constant 1, and a backward graph that returns each gradient
  multiplied by the real tangent. ``step.backward()`` passes 1, and ``g * 1 == g`` exactly
  in floating point, so the gradients are bit-for-bit those the joint graph computes; for
  any other tangent t the result is t * g, correct because a scalar output's gradient is
  linear in its tangent (rounding then differs from propagating t through the graph).
- Gradient accumulation is re-associated into micro-batch order: a gradient output that is a
  tree of untagged adds over one contribution per micro-batch becomes ((g0 + g1) + g2) + ...,
  the order the plain loop accumulates ``.grad`` in (AOTAutograd sums in the order its
  backward ran, the last micro-batch first). Then a micro-batch's contribution can be added,
  and freed, as soon as its backward ran, which is what keeps the interleaved step's memory
  at that of the plain step. Anything else is left as it is.
- Every node of the forward graph carries ``node.meta["commfuse_phase"]`` = "forward"
  (needed for a forward output) or "backward" (everything else: gradient computation,
  reads only the backward needs), so later passes and ``CollectiveIR.backward_nodes``
  still tell the two apart after the tangent is gone.
- Memory: what crosses from forward to backward is the gradients (parameter sized), not
  the activations; activations die inside the forward graph once their backward ran.

Source: DHelix (Wang et al.), Sec. 4.1 (the two strands run inside one model replica);
the fused partition is commfuse's way to get both strands into one graph under
AOTAutograd.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.fx as fx

from commfuse.core import torch_private as priv
from commfuse.core.meta import FUSED_GRAPH_META_KEY, PHASE_META_KEY, microbatch_of

__all__ = ["FUSED_GRAPH_META_KEY", "PHASE_META_KEY", "fused_partition", "is_fused_graph", "phase_of"]


def phase_of(node: fx.Node) -> str | None:
    """ "forward" / "backward" for nodes of a fused forward graph; None elsewhere."""
    return node.meta.get(PHASE_META_KEY)


def is_fused_graph(gm: fx.GraphModule) -> bool:
    """A graph that computes forward and backward work (placeholders copied from tagged nodes
    carry the tag too, so only computed nodes count)."""
    phases = {n.meta.get(PHASE_META_KEY) for n in gm.graph.nodes if n.op == "call_function"}
    return {"forward", "backward"} <= phases


def _why_not(joint: fx.GraphModule, num_fwd_outputs: int) -> Union[str, fx.Node]:
    tangents = [n for n in joint.graph.nodes if priv.is_tangent_placeholder(n)]
    if len(tangents) != 1:
        return f"the joint graph has {len(tangents)} tangent inputs (the fused step needs one scalar loss)"
    t = tangents[0]
    val = t.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return "the tangent is not a 0-dim tensor (the step's output is not a scalar loss)"
    mbs = {microbatch_of(n) for n in joint.graph.nodes} - {None}
    if len(mbs) < 2:
        return f"{len(mbs)} micro-batch tag(s) in the joint graph: nothing to interleave"
    out = joint.graph.output_node()
    if len(out.args[0]) <= num_fwd_outputs:
        return "the joint graph has no gradient outputs"
    return t


def fused_partition(
    joint: fx.GraphModule, num_fwd_outputs: int
) -> Union[str, tuple[fx.GraphModule, fx.GraphModule]]:
    """Partition ``joint`` (module docstring); a reason string when it does not match (then
    ``joint`` is unchanged)."""
    found = _why_not(joint, num_fwd_outputs)
    if isinstance(found, str):
        return found
    tangent = found
    g = joint.graph
    out = g.output_node()
    _accumulate_in_microbatch_order(g, out, num_fwd_outputs)
    outs = list(out.args[0])
    fwd_outs = [o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)]
    # forward = what the forward outputs need; everything else is backward work
    forward: set[fx.Node] = set()
    stack = list(fwd_outs)
    while stack:
        n = stack.pop()
        if n in forward:
            continue
        forward.add(n)
        stack.extend(n.all_input_nodes)
    for n in g.nodes:
        if n.op == "call_function":
            n.meta[PHASE_META_KEY] = "forward" if n in forward else "backward"
    val = tangent.meta["val"]
    first = next(n for n in g.nodes if n.op != "placeholder")
    with g.inserting_before(first):
        one = g.call_function(
            torch.ops.aten.full.default,
            ([], 1.0),
            {"dtype": val.dtype, "layout": torch.strided, "device": val.device, "pin_memory": False},
        )
    one.meta["val"] = val
    one.meta[PHASE_META_KEY] = "backward"
    tangent.replace_all_uses_with(one)
    saved: list[fx.Node] = []
    opaque: list[fx.Node] = []  # script-object inputs (a DeviceMesh) AOTAutograd passes through backward
    new_outs = outs[:num_fwd_outputs]
    for o in outs[num_fwd_outputs:]:
        if not isinstance(o, fx.Node):
            new_outs.append(o)
            continue
        if not isinstance(o.meta.get("val"), torch.Tensor):
            if o not in opaque:
                opaque.append(o)
            new_outs.append(o)
            continue
        if o not in saved:
            saved.append(o)
        with g.inserting_before(out):
            scaled = g.call_function(torch.ops.aten.mul.Tensor, (o, tangent))
        scaled.meta["val"] = o.meta.get("val")
        new_outs.append(scaled)
    out.args = (tuple(new_outs),) + tuple(out.args[1:])
    g.lint()
    joint.recompile()
    fw, bw = priv.extract_fwd_bwd_modules(joint, saved, opaque, num_fwd_outputs=num_fwd_outputs)
    fw.meta[FUSED_GRAPH_META_KEY] = True
    return fw, bw


def _contributions(n: fx.Node, root: fx.Node) -> Optional[list[fx.Node]]:
    """The per-micro-batch terms of an untagged add tree at ``root``; None if ``n`` is not one."""
    if (
        n.op == "call_function"
        and n.target is torch.ops.aten.add.Tensor
        and not n.kwargs
        and microbatch_of(n) is None
        and (n is root or len(n.users) == 1)
        and all(isinstance(a, fx.Node) for a in n.args)
    ):
        terms: list[fx.Node] = []
        for a in n.args:
            sub = _contributions(a, root)
            terms.extend(sub if sub is not None else [a])
        return terms
    return None


def _accumulate_in_microbatch_order(g: fx.Graph, out: fx.Node, num_fwd_outputs: int) -> int:
    """Re-associate each gradient's accumulation tree (module docstring); returns how many."""
    pos = {n: k for k, n in enumerate(g.nodes)}
    outs = list(out.args[0])
    done = 0
    for k in range(num_fwd_outputs, len(outs)):
        root = outs[k]
        if not isinstance(root, fx.Node):
            continue
        terms = _contributions(root, root)
        if not terms or len(terms) < 2:
            continue
        tags = [microbatch_of(t) for t in terms]
        if None in tags or len(set(tags)) != len(tags):
            continue
        ordered = [t for _, t in sorted(zip(tags, terms, strict=True), key=lambda x: x[0])]
        if ordered == terms and _is_left_chain(root, len(terms)):
            continue
        acc = ordered[0]
        for t in ordered[1:]:
            after = t if pos[t] > pos[acc] else acc
            with g.inserting_after(after):
                new = g.call_function(torch.ops.aten.add.Tensor, (acc, t))
            new.meta["val"] = root.meta.get("val")
            pos[new] = pos[after] + 0.5  # only compared with nodes it follows
            acc = new
        old = root
        outs[k] = acc
        out.args = (tuple(outs),) + tuple(out.args[1:])
        _erase_tree(old)
        done += 1
    return done


def _is_left_chain(root: fx.Node, n: int) -> bool:
    depth, cur = 0, root
    while (
        cur.op == "call_function" and cur.target is torch.ops.aten.add.Tensor and microbatch_of(cur) is None
    ):
        depth += 1
        cur = cur.args[0]
    return depth == n - 1


def _erase_tree(root: fx.Node) -> None:
    if root.users or root.op != "call_function" or root.target is not torch.ops.aten.add.Tensor:
        return
    args = [a for a in root.args if isinstance(a, fx.Node)]
    root.graph.erase_node(root)
    for a in args:
        if microbatch_of(a) is None:
            _erase_tree(a)
