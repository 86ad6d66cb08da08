"""The examples are launched the way users launch training (torchrun), and the README's
quickstart is one of them. CI runs ``torchrun --nproc-per-node 2 examples/quickstart.py`` from a
fresh clone (``.ci/run``); these checks keep the files honest without paying for that run twice."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_the_readme_quickstart_is_the_example_file():
    """Every line of the README's quickstart code appears, in order, in examples/quickstart.py."""
    example = (ROOT / "examples" / "quickstart.py").read_text().splitlines()
    lines = [ln for ln in _readme_quickstart().splitlines() if ln.strip()]
    i = 0
    for ln in lines:
        while i < len(example) and example[i] != ln:
            i += 1
        assert i < len(example), f"README quickstart line not in examples/quickstart.py (in order): {ln!r}"
        i += 1
    assert "torchrun --nproc-per-node 2 examples/quickstart.py" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_run_under_torchrun_without_path_edits(path):
    """No sys.path edits or self-spawned ranks: the package is imported as installed, the process
    group comes from torchrun's environment, and the docstring says how to launch it."""
    source = path.read_text()
    tree = ast.parse(source)
    assert "sys.path" not in source and "spawn" not in source, path.name
    assert "torchrun --nproc-per-node" in ast.get_docstring(tree) and path.name in ast.get_docstring(tree)
    assert "init_process_group" in source or "init_distributed" in source
