"""Proving a MoE region from the template facts, and spotting regions cut by a graph break.

:func:`prove` turns the facts of :class:`~.templates.Matcher` into :class:`Match` es (a
region whose every value is explained and used only inside it, except the combined output
and the statistics ``commfuse::moe_layer`` returns) and one refusal line per router left
alone. :func:`fragments` reports dispatch operations with no router in the same graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from commfuse.moe.patterns import op_name
from commfuse.moe.templates import Fact, Matcher, RegionInfo


# ---------------------------------------------------------------- proving a region
@dataclass
class Match:
    """A proven region and the arguments of the ``commfuse::moe_layer`` call that replaces it."""

    info: RegionInfo
    style: str  # "gshard" | "dropless"
    nodes: set[fx.Node]  # every node the region computes (erased by the rewrite)
    outs: list[fx.Node]  # nodes holding the combined output, used outside the region
    stats: list[tuple[fx.Node, str, float]]  # (node, moe_layer statistic, scale) used outside the region
    weights: tuple[fx.Node, fx.Node, fx.Node]  # w1, w3, w2 as stored
    transposed: tuple[bool, bool, bool]  # stored [E, F, H] / [E, H, F]: the op gets them transposed
    top_k: int
    capacity: int  # 0: dropless
    token_groups: int
    group_name: str  # "" without expert parallelism


_STAT_REASON = {"probs", "top1_idx", "top1_oh", "top1_ohf", "lse", "lse2", "logits", "choice", "counts"}


def _why(n: fx.Node, f: Fact, users: list[fx.Node], info: RegionInfo) -> str:
    names = ", ".join(u.name for u in users)
    if f.kind == "counts":
        return (
            f"unsupported statistic: {names} uses the token counts over all top-{info.top_k} choices "
            f"({n.name}); commfuse::moe_layer returns first-choice counts only"
        )
    if f.kind in _STAT_REASON:
        return (
            f"unsupported statistic: {names} uses {n.name} ({f.kind}); commfuse::moe_layer returns the sums "
            "over all tokens of the call of the probabilities, the first-choice one-hot and the squared "
            "logsumexp"
        )
    return f"{n.name} ({f.kind}) is also used by {names}, which the template does not account for"


def prove(m: Matcher) -> tuple[list[Match], list[str]]:
    """Proven regions of the matcher's graph, and one refusal line per router left alone."""
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for n, f in m.facts.items():
        if f.root is not None:
            by_root.setdefault(f.root, []).append(n)
    matches: list[Match] = []
    refusals: list[str] = []
    for root, nodes in by_root.items():
        info = m.regions[root]
        if not any(m.facts[n].kind == "topk" for n in nodes):
            continue  # a linear layer that is no router
        region = set(nodes)
        reasons = list(info.reasons)
        outs, stats, leaving = [], [], []
        for n in nodes:
            users = [u for u in n.users if u not in region]
            if not users:
                continue
            f = m.facts[n]
            if any(u.op == "output" for u in users) and f.kind not in ("out", "stat"):
                leaving.append(n.name)
            elif f.kind == "out":
                outs.append(n)
            elif f.kind == "stat":
                stats.append((n, f["which"], f["scale"]))
            elif f.kind == "counts" and info.top_k == 1:
                stats.append((n, "top1_count", 1.0))
            else:
                reasons.append(_why(n, f, users, info))
        if leaving:
            reasons.insert(
                0,
                f"region cut by a graph break: intermediate values ({', '.join(leaving)}) leave the "
                "graph before the combine, the rest of the MoE is in another graph (dropless "
                "dispatch needs torch._dynamo.config.capture_scalar_outputs = True)",
            )
        if len(info.groups) > 1:
            reasons.append(f"all_to_alls of one region over different groups {sorted(info.groups)}")
        if not outs and not reasons:
            kinds = sorted({m.facts[n].kind for n in nodes})
            reasons.append(f"no combined output proven (recognised steps: {', '.join(kinds)})")
        name = f"MoE router {root.name}"
        if reasons:
            refusals.append(f"{name}: left unchanged: " + "; ".join(dict.fromkeys(reasons)))
            continue
        fo = [m.facts[n] for n in outs]
        keys = ("w1", "w3", "w2", "t1", "t3", "t2", "group", "C")
        if any(any(f.get(k) is not fo[0].get(k) and f.get(k) != fo[0].get(k) for k in keys) for f in fo):
            refusals.append(f"{name}: left unchanged: several combined outputs with different experts")
            continue
        f = fo[0]
        matches.append(
            Match(
                info=info,
                style="gshard" if f.get("C") else "dropless",
                nodes=region,
                outs=outs,
                stats=stats,
                weights=(f["w1"], f["w3"], f["w2"]),
                transposed=(bool(f.get("t1")), bool(f.get("t3")), bool(f.get("t2"))),
                top_k=info.top_k,
                capacity=f.get("C") or 0,
                token_groups=f.get("G") or 1,
                group_name=f.get("group") or "",
            )
        )
    return matches, refusals


# Operations of a dispatch that, without a router in the same graph, mean a region was cut.
_FRAGMENT_OPS = {"argsort", "histc", "cumsum", "one_hot", "repeat_interleave", "index_copy", "scatter_add"}


def fragments(m: Matcher, exclude: frozenset[fx.Node] | set[fx.Node] = frozenset()) -> list[str]:
    """A refusal line when the graph holds all_to_all + dispatch operations outside any router's region
    (``exclude``: nodes of routers already reported)."""

    in_regions = {n for n, f in m.facts.items() if f.root is not None} | set(exclude)
    a2a, ops = [], []
    for n in m.gm.graph.nodes:
        if n in in_regions:
            continue
        name = op_name(n)
        if name == "c10d.all_to_all_single":
            a2a.append(n.name)
        elif name in _FRAGMENT_OPS:
            ops.append(n.name)
    if not a2a or not ops:
        return []
    return [
        f"all_to_all {', '.join(a2a)} with dispatch operations ({', '.join(ops) or 'none'}) and no router in "
        "this graph: if this is an MoE layer, its region was cut by a graph break (dropless dispatch needs "
        "torch._dynamo.config.capture_scalar_outputs = True); left unchanged"
    ]
