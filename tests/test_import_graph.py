"""The house's import rules, checked on the source (no module is imported).

* Every module of ``commfuse`` belongs to one layer (:data:`LAYERS`, bottom first; the same
  table is drawn in docs/architecture.md). A module imports only from its own layer or the
  layers below it.
* The module import graph has no cycle.
* No function-local import of a commfuse module: an import inside a function hides a cycle
  or an upward dependency. Optional heavy third-party dependencies may be imported inside
  functions (they are not commfuse modules, so this test does not look at them).
* Only commfuse.fuzz imports commfuse.fuzz: importing the fuzzer registers the test-only forced
  passes, which the product's pass table never holds.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "commfuse"

# (layer, module prefixes), bottom first. A module belongs to the layer of its longest prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("commfuse.core", "commfuse._version")),
    ("ir", ("commfuse.ir",)),
    ("costmodel", ("commfuse.costmodel",)),
    ("reference", ("commfuse.reference",)),
    ("ops", ("commfuse.ops",)),
    ("building blocks", ("commfuse.pipeline", "commfuse.moe")),
    ("analysis", ("commfuse.analysis",)),
    ("schedule", ("commfuse.schedule", "commfuse.dhelix")),
    ("passmgr", ("commfuse.passmgr",)),
    ("transforms", ("commfuse.transforms",)),
    ("lowering", ("commfuse.lowering",)),
    (
        "front end",
        (
            "commfuse.config",
            "commfuse.session",
            "commfuse.agreement",
            "commfuse.api",
            "commfuse.train_step",
            "commfuse.train_step_split",
            "commfuse.backend",
            "commfuse.passes",
        ),
    ),
    (
        "tools",
        ("commfuse.tools", "commfuse.reports", "commfuse.trace", "commfuse.models", "commfuse.emulate"),
    ),
    ("harness", ("commfuse.testing", "commfuse.fuzz")),
    ("package", ("commfuse", "commfuse.__main__")),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise KeyError(module)
    return rank


def _targets(module: str, node: ast.AST, is_pkg: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "commfuse"]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "commfuse":
        return []
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def imports() -> tuple[dict[str, set[str]], list[str]]:
    """Module-level imports of commfuse modules per module, and every function-local one."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    local: list[str] = []
    for module, path in known.items():
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, in_function: bool, module: str = module, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for t in _targets(module, child, path.name == "__init__.py", known):
                        if in_function:
                            local.append(f"{module}:{child.lineno} imports {t}")
                        elif t != module:
                            graph[module].add(t)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, True)
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # annotations only: never executed
                else:
                    visit(child, in_function)

        visit(tree, False)
        graph.setdefault(module, set())
    return graph, local


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for m, ts in sorted(graph.items())
        for t in sorted(ts)
        if layer_of(t) > layer_of(m)
    ]


def test_every_module_has_a_layer():
    missing = [
        m for m in modules() if not any(m == p or m.startswith(p + ".") for _, ps in LAYERS for p in ps)
    ]
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_no_import_cycle():
    graph, _ = imports()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layers_import_only_downward():
    graph, _ = imports()
    bad = upward(graph)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_function_local_import_of_a_commfuse_module():
    _, local = imports()
    assert not local, "function-local imports of commfuse modules:\n" + "\n".join(local)


def test_only_the_fuzzer_imports_the_fuzzer():
    """Importing the fuzzer registers the test-only forced passes (commfuse.fuzz.forced), so no
    module outside commfuse.fuzz imports it: ``import commfuse`` (or commfuse.testing) leaves
    them out of the product's pass table."""
    graph, _ = imports()
    bad = [
        f"{m} imports {t}"
        for m, ts in sorted(graph.items())
        for t in sorted(ts)
        if _in_fuzzer(t) and not _in_fuzzer(m)
    ]
    assert not bad, "modules outside the fuzzer import it:\n" + "\n".join(bad)


def _in_fuzzer(module: str) -> bool:
    return module == "commfuse.fuzz" or module.startswith("commfuse.fuzz.")


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from commfuse.ir import kinds\n", {"commfuse.ir.kinds"}),
        ("def f():\n    from commfuse.ir import kinds\n", set()),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from commfuse.backend import x\n", set()),
    ],
)
def test_the_checker_reads_imports_as_python_does(tmp_path, monkeypatch, source, expected):
    """The checker itself: module-level imports count, function-local ones are reported apart,
    TYPE_CHECKING blocks are ignored."""
    pkg = tmp_path / "commfuse"
    (pkg / "ir").mkdir(parents=True)
    for f in ("__init__.py", "ir/__init__.py", "ir/kinds.py", "backend.py"):
        (pkg / f).write_text("")
    (pkg / "probe.py").write_text(source)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    graph, local = imports()
    assert graph["commfuse.probe"] == expected
    assert bool(local) == ("def f" in source)


if __name__ == "__main__":  # the full list of what is wrong, for whoever restructures
    g, loc = imports()
    for c in cycles(g):
        print("CYCLE", " <-> ".join(c))
    for u in upward(g):
        print("UPWARD", u)
    for item in loc:
        print("LOCAL", item)
