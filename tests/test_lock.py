"""The lock (.ci/lock.txt) and its check (scripts/check_lock.py): what CI compares pip freeze with."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_lock", _ROOT / "scripts" / "check_lock.py")
check_lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lock)


def test_freeze_lines_are_read_with_names_normalised_and_commfuse_left_out():
    freeze = [
        "# Editable Git install with no remote (commfuse==0.1.0)",
        "-e /work/main",
        "Typing_Extensions==4.16.0",
        "torch==2.13.0+cpu",
        "commfuse==0.1.0",
        "ruamel.yaml==0.18.1",
        "",
    ]
    assert check_lock.parse_pins(freeze) == {
        "typing-extensions": "4.16.0",
        "torch": "2.13.0",
        "ruamel-yaml": "0.18.1",
    }


def test_every_kind_of_difference_is_named():
    diff = check_lock.differences({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "3", "d": "4"})
    assert diff == ["  b: installed 2, locked 3", "  c: installed 3, locked -", "  d: installed -, locked 4"]
    assert check_lock.differences({"a": "1"}, {"a": "1"}) == []


def test_the_lock_states_its_platform_and_pins_torch_as_the_readme_installs_it():
    text = (_ROOT / ".ci" / "lock.txt").read_text()
    assert "Platform: Linux x86_64, CPython 3.11" in text
    pins = check_lock.parse_pins(text.splitlines())
    assert "torch==2.13.0\n" in text and pins["torch"] == "2.13.0"
    # Every line that is not a comment is an exact pin: a range would not be a lock.
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(body) == len(pins) and all(line.count("==") == 1 for line in body)
    # What the README's install resolves includes the test, bench and conformance extras.
    for name in (
        "pytest",
        "pytest-xdist",
        "matplotlib",
        "transformers",
        "torchtitan",
        "pydantic",
        "ruff",
        "mypy",
    ):
        assert name in pins, name
