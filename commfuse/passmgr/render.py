"""Render an FX graph as Graphviz DOT/SVG with collectives standing out.

Collectives are filled boxes coloured by process group, their waits are dashed
boxes of the same colour, compute is plain; labels are escaped (node names and
group names may contain markup characters).
"""

from __future__ import annotations

import html
import shutil
import subprocess

import torch.fx as fx

from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import is_wait
from commfuse.ir.shapes import shape_of

_PALETTE = ["#e6550d", "#3182bd", "#31a354", "#756bb1", "#de2d26", "#636363", "#d6616b", "#8c6d31"]


def _label(text: str) -> str:
    return html.escape(text, quote=True)


def _collective_label(c, sub: str = "") -> str:
    dim = "" if c.logical_dim is None else f" dim {c.logical_dim}"
    return (
        f"<b>{_label(c.kind.value)}{dim}</b> {_label(c.name)}<br/>{_label(c.group.describe())}"
        f"<br/>{_label(f'{c.logged_bytes} B logged, {c.wire_bytes} B wire per rank')}{sub}"
    )


def graph_to_dot(gm: fx.GraphModule, ir: CollectiveIR, *, title: str = "") -> str:
    colors = {g: _PALETTE[i % len(_PALETTE)] for i, g in enumerate(sorted(ir.groups))}
    coll = {c.start: c for c in ir.collectives}
    wait_of = {w: c for c in ir.collectives for w in c.waits}
    lines = [
        "digraph G {",
        "  rankdir=TB; node [shape=box, fontsize=9, fontname=Helvetica];",
        f"  labelloc=t; label=<{_label(title)}>;",
    ]
    legend = " ".join(f'<font color="{col}">&#9632; group {_label(g)}</font>' for g, col in colors.items())
    if legend:
        lines.append(f"  legend [shape=plaintext, label=<{legend}>];")
    for n in gm.graph.nodes:
        shape = shape_of(n)
        sub = "" if shape is None else "<br/>" + _label(str(list(shape)))
        if n in coll:
            c = coll[n]
            col = colors[c.group.name]
            text = _collective_label(c, sub)
            lines.append(
                f'  "{_label(n.name)}" [label=<{text}>, style=filled, fillcolor="{col}", fontcolor=white];'
            )
        elif n in wait_of or (n.op == "call_function" and is_wait(n.target)):
            col = colors.get(wait_of[n].group.name, "black") if n in wait_of else "black"
            lines.append(
                f'  "{_label(n.name)}" [label=<wait {_label(n.name)}{sub}>, style=dashed, color="{col}"];'
            )
        else:
            op = n.target.__name__ if callable(n.target) and hasattr(n.target, "__name__") else str(n.target)
            text = (
                f"{_label(n.name)}<br/><i>{_label(op)}</i>{sub}"
                if n.op == "call_function"
                else f"{_label(n.op)} {_label(n.name)}{sub}"
            )
            lines.append(f'  "{_label(n.name)}" [label=<{text}>];')
        for a in n.all_input_nodes:
            lines.append(f'  "{_label(a.name)}" -> "{_label(n.name)}";')
    lines.append("}")
    return "\n".join(lines)


def condensed_dot(gm: fx.GraphModule, ir: CollectiveIR, *, title: str = "") -> str:
    """A picture of a large graph: collectives and waits kept, each run of compute
    between them (in graph order) collapsed into one box that says how many ops it holds."""
    colors = {g: _PALETTE[i % len(_PALETTE)] for i, g in enumerate(sorted(ir.groups))}
    coll = {c.start: c for c in ir.collectives}
    wait_of = {w: c for c in ir.collectives for w in c.waits}
    box: dict[fx.Node, str] = {}
    runs: list[tuple[str, list[fx.Node]]] = []
    for n in gm.graph.nodes:
        if n in coll or n in wait_of:
            box[n] = n.name
            continue
        if (
            not runs
            or runs[-1][0] == "__closed__"
            or (runs and runs[-1][1] and runs[-1][1][-1].next is not n)
        ):
            runs.append((f"run{len(runs)}", []))
        runs[-1][1].append(n)
        box[n] = runs[-1][0]
    lines = [
        "digraph G {",
        "  rankdir=TB; node [shape=box, fontsize=9, fontname=Helvetica];",
        f"  labelloc=t; label=<{_label(title)} (condensed: {len(gm.graph.nodes)} nodes)>;",
    ]
    for name, nodes in runs:
        ops = sorted(
            {
                getattr(n.target, "__name__", str(n.target)).split(".")[0]
                for n in nodes
                if n.op == "call_function"
            }
        )
        shown = ", ".join(ops[:6]) + (", ..." if len(ops) > 6 else "")
        # Graphviz rejects an empty <i></i> (a run of placeholders/outputs only has no op names).
        body = f"<br/><i>{_label(shown)}</i>" if shown else ""
        lines.append(f'  "{name}" [label=<{len(nodes)} ops{body}>, color=gray];')
    for n, c in coll.items():
        col = colors[c.group.name]
        text = _collective_label(c)
        lines.append(
            f'  "{_label(n.name)}" [label=<{text}>, style=filled, fillcolor="{col}", fontcolor=white];'
        )
    for w, c in wait_of.items():
        lines.append(
            f'  "{_label(w.name)}" [label=<wait {_label(w.name)}>, style=dashed, color="{colors[c.group.name]}"];'
        )
    edges = set()
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            if box[a] != box[n]:
                edges.add((box[a], box[n]))
    lines.extend(f'  "{_label(a)}" -> "{_label(b)}";' for a, b in sorted(edges))
    lines.append("}")
    return "\n".join(lines)


def dot_to_svg(dot: str, *, timeout_s: float = 30.0) -> bytes | None:
    """SVG bytes, or None when Graphviz's `dot` is not installed."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    proc = subprocess.run(
        [exe, "-Tsvg"], input=dot.encode(), capture_output=True, timeout=timeout_s, check=True
    )
    return proc.stdout
