"""mypy error counts per layer of commfuse, held to a committed baseline that may only go down.

    python scripts/mypy_ratchet.py            # check: fails if a layer has more errors than its baseline
    python scripts/mypy_ratchet.py --update   # lower the baseline to today's counts (never raises one)

Runs mypy as configured in pyproject.toml ([tool.mypy]: the whole package), counts the errors
per layer -- the package folder under commfuse/ (``commfuse/ir``) or the top-level module
(``commfuse/session.py``) -- and compares them with ``.ci/mypy-baseline.json``. It fails when
a layer's count rises above its baseline (a layer missing from the baseline, e.g. a new one,
has baseline 0), and when a clean layer (listed under ``clean`` there) has any error at all;
``--update`` adds every layer at 0 errors to ``clean``, so a layer once clean stays clean.
On a failure it prints the errors of the files whose count rose (the baseline keeps per-file
counts as of its last update for that; only the per-layer counts are enforced). With no baseline file, ``--update``
writes one from today's counts. The counts are mypy's: comparable under the mypy version the
baseline names (a warning says when another one runs; .ci/lock.txt pins it).
Standard library only; docs/contributing.md, "Checks".
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / ".ci" / "mypy-baseline.json"
PACKAGE = "commfuse"
# path:line: error: message  [code]   (mypy's default output, one line per error)
_ERROR = re.compile(r"^(?P<path>[^:\s][^:]*\.pyi?):\d+(?::\d+)?: error: ")
_SHOWN = 200  # error lines printed per failing layer


def layer_of(path: str) -> str:
    """``commfuse/ir/graph_ir.py`` -> ``commfuse/ir``; ``commfuse/session.py`` -> itself."""
    parts = Path(path).as_posix().split("/")
    if len(parts) >= 3 and parts[0] == PACKAGE:
        return f"{parts[0]}/{parts[1]}"
    return "/".join(parts)


def layers_on_disk() -> list[str]:
    """Every layer of the package (so that a clean one is listed with 0)."""
    pkg = ROOT / PACKAGE
    out = [f"{PACKAGE}/{p.name}" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    out += [f"{PACKAGE}/{p.name}" for p in pkg.glob("*.py")]
    return sorted(out)


def run_mypy() -> tuple[dict[str, list[str]], str]:
    """(error lines per file, mypy's version); exits if mypy could not run."""
    version = subprocess.run(
        [sys.executable, "-m", "mypy", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    if version.returncode != 0:
        sys.exit(
            f"mypy_ratchet: cannot run mypy ({(version.stderr or version.stdout).strip()}); "
            f"install it: pip install -e '.[test]' -c .ci/lock.txt"
        )
    cmd = [sys.executable, "-m", "mypy", "--no-color-output", "--no-pretty", "--no-error-summary"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    by_file: dict[str, list[str]] = defaultdict(list)
    for line in proc.stdout.splitlines():
        m = _ERROR.match(line)
        if m:
            by_file[Path(m.group("path")).as_posix()].append(line)
    # exit 0: no error, 1: errors found; anything else (2: a crash, a bad configuration) is no count
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not by_file):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        sys.exit(f"mypy_ratchet: mypy failed (exit {proc.returncode}): {' '.join(cmd)}")
    return by_file, version.stdout.split(" (")[0].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--update",
        action="store_true",
        help="lower the baseline to the current counts (refused if any count rose)",
    )
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    by_file, version = run_mypy()
    wall = time.perf_counter() - t0
    counts: Counter = Counter()
    for path, lines in by_file.items():
        counts[layer_of(path)] += len(lines)
    first = not BASELINE.exists()
    doc = {} if first else json.loads(BASELINE.read_text())
    base: dict[str, int] = doc.get("counts", {})
    base_files: dict[str, int] = doc.get("files", {})
    clean: list[str] = doc.get("clean", [])
    if doc.get("mypy") and doc["mypy"] != version:
        print(f"warning: the baseline was counted with {doc['mypy']}, this is {version}: counts may differ")

    layers = sorted(set(layers_on_disk()) | set(base) | set(counts))
    failing: list[str] = []
    print(f"{'layer':<32} {'baseline':>8} {'now':>6}")
    for layer in layers:
        now, was = counts.get(layer, 0), base.get(layer, 0)
        if first:
            status = ""
        elif layer in clean and now > 0:
            status = "FAIL (a clean layer)"
        elif now > was:
            status = f"FAIL (+{now - was})"
        elif now < was:
            status = f"down {was - now}"
        else:
            status = "clean" if now == 0 else ""
        if status.startswith("FAIL"):
            failing.append(layer)
        print(f"{layer:<32} {was:>8} {now:>6}  {status}".rstrip())
    total_now, total_was = sum(counts.values()), sum(base.values())
    print(f"{'total':<32} {total_was:>8} {total_now:>6}  (mypy: {wall:.0f} s, {version})")

    if failing:
        for layer in failing:
            files = sorted(p for p in by_file if layer_of(p) == layer)
            rose = [p for p in files if len(by_file[p]) > base_files.get(p, 0)] or files
            shown = [x for p in rose for x in by_file[p]]
            print(
                f"\n{layer}: {counts[layer]} error(s), baseline {base.get(layer, 0)}"
                f"{' (a clean layer: none allowed)' if layer in clean else ''}; "
                f"the errors of the file(s) whose count rose:"
            )
            print("\n".join(f"  {x}" for x in shown[:_SHOWN]))
            if len(shown) > _SHOWN:
                print(f"  ... and {len(shown) - _SHOWN} more")
        print(
            "\nmypy_ratchet: FAILED: fix the new errors (the baseline only goes down: --update never raises it)"
        )
        return 1
    if args.update:
        # only down: a layer keeps the lower of its baseline and today's count (the first baseline: today's)
        new = {
            layer: counts.get(layer, 0) if first else min(base.get(layer, 0), counts.get(layer, 0))
            for layer in layers
        }
        files = {p: len(by_file[p]) for p in sorted(by_file)}  # today's: what a failure is diagnosed against
        out = {
            "mypy": version,
            "clean": [layer for layer in layers_on_disk() if new.get(layer, 0) == 0],
            "total": sum(new.values()),
            "counts": {k: v for k, v in new.items() if v > 0},
            "files": files,
        }
        BASELINE.parent.mkdir(parents=True, exist_ok=True)
        BASELINE.write_text(json.dumps(out, indent=1) + "\n")
        print(f"\nbaseline written: {BASELINE.relative_to(ROOT)} (total {out['total']}, was {total_was})")
    elif total_now < total_was:
        print(f"\n{total_was - total_now} error(s) fewer than the baseline: lock them in with --update")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
