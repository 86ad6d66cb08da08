"""Checks that the running environment is exactly the lock: ``pip freeze`` equals .ci/lock.txt.

CI installs into a brand-new virtualenv with the README's lines and then runs this, so a package
the lock misses, or one the resolver took at another version, fails the run instead of hiding
behind whatever an earlier install left on the machine. commfuse itself (editable) is left out,
and torch's local build tag (``+cpu``) is dropped, as the lock pins torch the way the README
installs it.

Usage: python scripts/check_lock.py [LOCK]     (default: .ci/lock.txt)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DEFAULT_LOCK = Path(__file__).resolve().parent.parent / ".ci" / "lock.txt"


def normalised(name: str) -> str:
    """PEP 503: names compare with case and runs of ``-_.`` folded."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines: list[str]) -> dict[str, str]:
    """``name==version`` lines to {normalised name: version}; comments, blanks and editables skipped."""
    pins = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "-e ")) or "==" not in line:
            continue
        name, version = line.split("==", 1)
        if normalised(name) == "commfuse":
            continue
        pins[normalised(name)] = version.split("+", 1)[0] if normalised(name) == "torch" else version
    return pins


def differences(installed: dict[str, str], locked: dict[str, str]) -> list[str]:
    """One line per package that is missing, extra or at another version."""
    out = []
    for name in sorted(set(installed) | set(locked)):
        have, want = installed.get(name), locked.get(name)
        if have != want:
            out.append(f"  {name}: installed {have or '-'}, locked {want or '-'}")
    return out


def main(argv: list[str]) -> int:
    lock = Path(argv[0]) if argv else DEFAULT_LOCK
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    diff = differences(parse_pins(freeze.splitlines()), parse_pins(lock.read_text().splitlines()))
    if diff:
        print(f"the environment differs from {lock} (refresh it with `bash scripts/lock.sh`):")
        print("\n".join(diff))
        return 1
    print(f"environment equals {lock.name}: {len(parse_pins(lock.read_text().splitlines()))} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
