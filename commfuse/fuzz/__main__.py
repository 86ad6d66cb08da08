"""Command line: ``python -m commfuse.fuzz --programs 20000 --seed 1 --jobs 2``.

``--corpus tests/fuzz_corpus/ci.json`` checks a frozen set of programs (what CI checks);
``--write-corpus FILE --seed S --programs N`` freezes programs of a seed into such a file.

Exit status 1 when any failure was found (0 otherwise), so a campaign can gate a release.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from commfuse.fuzz import campaign, corpus, regressions
from commfuse.fuzz.check import all_pipelines, check_program, prepare
from commfuse.fuzz.execute import check_executed, sample
from commfuse.fuzz.generator import FAMILIES
from commfuse.testing import get_pool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commfuse.fuzz", description=__doc__)
    ap.add_argument("--programs", "-n", type=int, default=500, help="programs to check (default 500)")
    ap.add_argument(
        "--seed", type=int, default=0, help="campaign seed (program i: random.Random(f'{seed}:{i}'))"
    )
    ap.add_argument("--start", type=int, default=0, help="first program index")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes (the passes a fresh process knows: built-in and forced variants)",
    )
    ap.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    ap.add_argument(
        "--passes", default=None, help="comma-separated pass names (default: every registered pass)"
    )
    ap.add_argument("--no-default", action="store_true", help="do not also check the default pipeline")
    ap.add_argument("--no-shrink", action="store_true", help="report failures without shrinking them")
    ap.add_argument(
        "--save-dir", default=None, help="save shrunk failures here (e.g. tests/fuzz_regressions)"
    )
    ap.add_argument("--report", default=None, help="write the campaign report as JSON to this file")
    ap.add_argument(
        "--show", default=None, metavar="SEED:INDEX", help="print one program and its traced graph"
    )
    ap.add_argument(
        "--replay", nargs="*", default=None, metavar="CASE.json", help="replay saved regression cases"
    )
    ap.add_argument(
        "--feature",
        action="append",
        default=[],
        help="optional generator feature, e.g. inplace_buffer_reads (see commfuse.fuzz.generator.FEATURES)",
    )
    ap.add_argument(
        "--check-ir", action="store_true", help="also check the CollectiveIR against each program"
    )
    ap.add_argument(
        "--family",
        default=None,
        help="generate every program from this family (e.g. moe_layer; see commfuse.fuzz.generator.FAMILIES)",
    )
    ap.add_argument(
        "--corpus",
        default=None,
        metavar="FILE",
        help="check the programs frozen in this corpus "
        "file (e.g. tests/fuzz_corpus/ci.json, what CI checks) instead of generating them",
    )
    ap.add_argument(
        "--write-corpus",
        default=None,
        metavar="FILE",
        help="write programs --start.. of --seed "
        "(--programs of them, --feature as given) to this corpus file, without checking them",
    )
    ap.add_argument(
        "--execute",
        type=int,
        default=0,
        metavar="N",
        help="also run the first N programs of world size 2 or 4 through the default executor "
        "(commfuse's runtime, Inductor-compiled regions) on gloo rank pools against the reference",
    )
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    passes = a.passes.split(",") if a.passes else None
    if a.family is not None:
        if a.family not in FAMILIES:
            ap.error(f"unknown family {a.family!r}; known: {', '.join(sorted(FAMILIES))}")

    if a.show:
        seed, index = (int(x) for x in a.show.split(":"))
        pipes = all_pipelines(passes, include_default=not a.no_default)
        prog = campaign.program_for(seed, index, pipes, a.feature, a.family)
        print(json.dumps(prog.to_json(), indent=1, sort_keys=True))

        prep = prepare(prog)
        for r, gm in enumerate(prep.traced.graphs):
            print(f"# graph (rank {r if prep.traced.per_rank else 'any'}); groups {prep.traced.groups}")
            print(gm.code)
        res = check_program(prog, pipes, check_ir=a.check_ir)
        print("\n".join(f.headline() for f in res.failures) or "passes every pipeline")
        return 1 if res.failures else 0

    if a.replay is not None:
        paths = a.replay or sorted(str(p) for p in Path("tests/fuzz_regressions").glob("*.json"))
        bad = 0
        for p in paths:
            reg = regressions.load_regression(p)
            _, fails = regressions.replay(reg)
            state = "FAILS" if fails else "passes"
            bad += bool(fails)
            print(f"{p}: {state} ({reg.status}) {reg.title}")
            for f in fails:
                print("   ", f.headline())
        return 1 if bad else 0

    if a.write_corpus:
        frozen = corpus.make_corpus(
            a.seed,
            a.programs,
            start=a.start,
            features=a.feature,
            pipelines=all_pipelines(passes, include_default=not a.no_default),
        )
        path = corpus.save_corpus(a.write_corpus, frozen)
        print(f"wrote {len(frozen.programs)} programs of seed {a.seed} to {path}")
        return 0

    if a.corpus:
        try:
            frozen = corpus.load_corpus(a.corpus)
        except corpus.CorpusError as e:
            ap.error(str(e))
        if a.jobs > 1:
            rep = campaign.run_parallel(
                0,
                frozen.seed,
                a.jobs,
                passes=passes,
                include_default=not a.no_default,
                shrink_failures=not a.no_shrink,
                save_dir=a.save_dir,
                time_limit=a.time_limit,
                check_ir=a.check_ir,
                corpus=frozen,
            )
        else:
            rep = campaign.run_campaign(
                pipelines=all_pipelines(passes, include_default=not a.no_default),
                shrink_failures=not a.no_shrink,
                save_dir=a.save_dir,
                progress=log,
                check_ir=a.check_ir,
                corpus=frozen,
                time_limit=a.time_limit,
            )
    elif a.jobs > 1:
        rep = campaign.run_parallel(
            a.programs,
            a.seed,
            a.jobs,
            passes=passes,
            include_default=not a.no_default,
            shrink_failures=not a.no_shrink,
            save_dir=a.save_dir,
            time_limit=a.time_limit,
            start=a.start,
            features=a.feature,
            check_ir=a.check_ir,
            family=a.family,
        )
    else:
        rep = campaign.run_campaign(
            a.programs,
            a.seed,
            start=a.start,
            time_limit=a.time_limit,
            pipelines=all_pipelines(passes, include_default=not a.no_default),
            shrink_failures=not a.no_shrink,
            save_dir=a.save_dir,
            progress=log,
            features=a.feature,
            check_ir=a.check_ir,
            family=a.family,
        )
    print(rep.summary())
    if a.report:
        Path(a.report).write_text(json.dumps(rep.to_json(), indent=1) + "\n")
    executed = 0
    if a.execute:
        executed = _execute(a, passes, frozen if a.corpus else None, log)
    return 1 if rep.failures or executed else 0


def _execute(a, passes, frozen, log) -> int:
    """The executor sample (``--execute N``): returns how many programs failed."""
    import time

    pipelines = all_pipelines(passes, include_default=not a.no_default)
    if frozen is not None:
        programs = [p for _, p in frozen.programs]
    else:
        programs = (
            campaign.program_for(a.seed, i, pipelines, a.feature, a.family)
            for i in range(a.start, a.start + a.programs)
        )
    chosen = sample(list(programs), a.execute)
    t0, failed = time.perf_counter(), 0
    for i, prog in enumerate(chosen):
        f = check_executed(prog, get_pool(prog.world_size), compile_regions=True)
        if f is not None:
            failed += 1
            print(
                f"executor: program {i} of the sample: {f.pipeline} {f.kind}: {f.message[:2000]}\n{prog.dumps()}"
            )
        elif log:
            log(f"executor: {i + 1}/{len(chosen)} ok")
    print(
        f"executor: {len(chosen)} programs (world sizes 2/4) through the default executor with Inductor regions "
        f"in {time.perf_counter() - t0:.1f} s; {failed} failed"
    )
    return failed


if __name__ == "__main__":
    sys.exit(main())
