"""Carried wheels: commfuse's pure-Python dependencies for a machine whose image lacks them.

The lent GPU machine runs its own image (Python 3.12, a CUDA torch) with nothing installable
and no network, and commfuse needs pydantic. Its wheels travel with the working tree in
``benchmarks/gpu/wheels/`` (cp312 manylinux x86_64 for pydantic-core). A wheel is a zip
file, but pydantic-core's compiled extension cannot be imported from inside a zip, so
:func:`ensure_wheels` unpacks every wheel into one temporary directory and puts that
directory first on ``sys.path``. It does nothing when the modules already import, so the
development machine keeps its installed versions.

Standard library only: it runs before anything that imports commfuse.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

WHEEL_DIR = Path(__file__).resolve().parent / "wheels"
# The top-level modules the carried wheels provide and commfuse imports.
REQUIRED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")


def missing_modules(names: Sequence[str] = REQUIRED) -> list[str]:
    """The modules of ``names`` this interpreter cannot find (without importing any of them)."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def unpack_wheels(wheel_dir: Path, target: Path) -> list[str]:
    """Extract every ``*.whl`` of ``wheel_dir`` into ``target``; returns the wheel file names."""
    names = []
    for whl in sorted(wheel_dir.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(target)
        names.append(whl.name)
    return names


def ensure_wheels(
    wheel_dir: Path = WHEEL_DIR, names: Sequence[str] = REQUIRED, target: Optional[Path] = None
) -> Optional[dict]:
    """Make ``names`` importable from the carried wheels when some are missing.

    Returns None when nothing was missing, else what was done: the directory put on
    ``sys.path``, the wheels unpacked and the modules that were missing. A wheel built for
    another Python (pydantic-core is compiled) fails only when imported, with Python's error."""
    missing = missing_modules(names)
    if not missing:
        return None
    if not any(wheel_dir.glob("*.whl")):
        raise RuntimeError(
            f"modules {missing} are not installed and {wheel_dir} holds no wheels to supply them"
        )
    target = Path(tempfile.mkdtemp(prefix="commfuse-wheels-")) if target is None else target
    wheels = unpack_wheels(wheel_dir, target)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    return {"path": str(target), "wheels": wheels, "missing": missing}


__all__ = ["REQUIRED", "WHEEL_DIR", "ensure_wheels", "missing_modules", "unpack_wheels"]
