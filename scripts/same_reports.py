"""Fingerprint what the pipeline decides, to show a refactoring changed no decision.

For every program of the CI fuzz slice (``tests/fuzz_corpus/ci.json``), through every
registered pass alone and the default pipeline (those that apply to the program), and for
the example workloads (forward, backward and joint graphs captured under a fake 4-rank
process group, through the default pipeline): the pipeline reports (per pass: changed,
counts, refusals, decisions, error), the collectives after the pipeline (kind, group,
bytes), the per-group sequence hashes and the optimised graph's code.

Usage::

    python scripts/same_reports.py --write before.json     # on the old tree
    python scripts/same_reports.py --compare before.json   # on the new tree: prints differences

Exit status 1 when ``--compare`` finds a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from commfuse.fuzz.check import all_pipelines, applicable, prepare  # noqa: E402
from commfuse.fuzz.corpus import load_corpus  # noqa: E402

CI_CORPUS = ROOT / "tests" / "fuzz_corpus" / "ci.json"
WORKLOADS = (
    "llama_tp_sp:s",
    "llama_tp:s",
    "moe_ep:s",
    "simple_fsdp:s",
    "dp:s",
    "moe_tp_ep:s",
    "moe_sp_ep_sp:s",
    "moe_style_sp_ep_sp:s",
)
WORLD = 4


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _report_fingerprint(gm) -> dict:
    out = []
    for rep in gm.meta.get("commfuse_reports", []):
        passes = [
            {
                "name": p.name,
                "changed": p.changed,
                "counts": p.counts,
                "refusals": p.refusals,
                "decisions": p.decisions,
                "error": p.error,
            }
            for p in rep.passes
        ]
        collectives = [c.model_dump(mode="json") for c in (rep.analysis.collectives if rep.analysis else [])]
        out.append(
            {
                "graph": rep.graph,
                "passes": passes,
                "notes": rep.notes,
                "skipped": rep.skipped_reason,
                "input_problems": rep.input_problems,
                "sequence_hashes": rep.sequence_hashes,
                "order_hash": rep.order_hash,
                "collectives": collectives,
                "topology": rep.topology,
            }
        )
    return {"reports": json.loads(json.dumps(out, default=str)), "code": _digest(gm.code)}


def corpus_fingerprints(limit: int | None = None) -> dict:
    corpus = load_corpus(CI_CORPUS)
    pipes = all_pipelines()
    out = {}
    for i, program in corpus.programs[:limit]:
        prepared = prepare(program, [p for p in pipes if applicable(p, program)])
        entry = {
            name: [_report_fingerprint(gm) for gm in graphs]
            for name, graphs in sorted(prepared.optimised.items())
        }
        entry["failures"] = [f"{f.pipeline} {f.kind}" for f in prepared.failures]
        out[f"program {i}"] = entry
    return out


def workload_fingerprints() -> dict:
    import commfuse
    from benchmarks.workloads import get_workload
    from commfuse.testing.fake_pg import fake_process_group
    from commfuse.testing.graphs import capture_aot_graphs

    out = {}
    for name in WORKLOADS:
        wl = get_workload(name)
        with fake_process_group(WORLD, rank=0):
            built = wl.family.builder(WORLD, 0, **wl.family.sizes[wl.size])
            got = capture_aot_graphs(built.model, *built.inputs, loss=built.loss)
            entry = {}
            for kind in ("joint", "forward", "backward"):
                gm = getattr(got, kind)
                if gm is None:
                    continue
                gm.meta.pop("commfuse_reports", None)
                commfuse.optimize(gm, commfuse.Config(group_roles=built.roles), graph_kind=kind)
                entry[kind] = _report_fingerprint(gm)
        out[name] = entry
    return out


def _differences(a, b, where: str = "") -> list[str]:
    if type(a) is not type(b):
        return [f"{where}: {a!r} -> {b!r}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{where}/{k}: {'added' if k not in a else 'removed'}")
            else:
                out += _differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    return (
        []
        if a == b
        else [f"{where}: {json.dumps(a, default=str)[:300]} -> {json.dumps(b, default=str)[:300]}"]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--compare", type=Path)
    ap.add_argument("--limit", type=int, default=None, help="only the first N programs of the CI slice")
    ap.add_argument("--no-workloads", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    now = {"corpus": corpus_fingerprints(args.limit)}
    if not args.no_workloads:
        now["workloads"] = workload_fingerprints()
    if args.write:
        args.write.write_text(json.dumps(now, indent=1, sort_keys=True, default=str))
        print(f"wrote {args.write}: {len(now['corpus'])} programs, {len(now.get('workloads', {}))} workloads")
        return 0
    before = json.loads(args.compare.read_text())
    now = json.loads(json.dumps(now, default=str))
    diffs = _differences(before, now)
    for d in diffs:
        print(d)
    print(
        f"{len(diffs)} differences over {len(now['corpus'])} programs and {len(now.get('workloads', {}))} workloads"
    )
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
