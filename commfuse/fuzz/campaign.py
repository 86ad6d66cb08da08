"""Fuzzing campaigns: many seeded programs, failures shrunk and saved.

Program ``i`` of a campaign with seed ``s`` is generated from ``random.Random(f"{s}:{i}")``,
so any program can be regenerated alone (``python -m commfuse.fuzz --show s:i``).
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from commfuse.fuzz.check import Failure, PipelineSpec, all_pipelines, check_program
from commfuse.fuzz.corpus import Corpus
from commfuse.fuzz.program import Program
from commfuse.fuzz.regressions import make_regression, save_regression
from commfuse.fuzz.shrink import shrink
from commfuse.fuzz.targets import program_for


@dataclass
class FoundBug:
    index: int
    failure: Failure
    program: Program
    shrunk: Optional[Program] = None
    shrink_checks: int = 0
    saved: Optional[Path] = None

    def describe(self) -> str:
        p = self.shrunk or self.program
        where = f" -> {self.saved}" if self.saved else ""
        return (
            f"program {self.index}: {self.failure.headline()}\n    shrunk to {p.summary()} "
            f"({self.shrink_checks} checks){where}"
        )


@dataclass
class CampaignReport:
    seed: int
    programs: int = 0
    seconds: float = 0.0
    per_rank: int = 0
    joint: int = 0
    graph_nodes: int = 0
    families: collections.Counter = field(default_factory=collections.Counter)
    world_sizes: collections.Counter = field(default_factory=collections.Counter)
    dtypes: collections.Counter = field(default_factory=collections.Counter)
    pipeline_checks: collections.Counter = field(default_factory=collections.Counter)
    pipeline_changes: collections.Counter = field(default_factory=collections.Counter)
    failures: collections.Counter = field(default_factory=collections.Counter)  # (pipeline, kind) -> count
    bugs: list[FoundBug] = field(default_factory=list)

    @property
    def programs_per_second(self) -> float:
        return self.programs / self.seconds if self.seconds else 0.0

    @property
    def generator_errors(self) -> int:
        return sum(c for (p, k), c in self.failures.items() if k == "generator")

    def summary(self) -> str:
        lines = [
            f"fuzz: {self.programs} programs (seed {self.seed}) in {self.seconds:.1f} s = "
            f"{self.programs_per_second:.1f} programs/s; {self.per_rank} with one graph per rank, "
            f"{self.joint} joint; {self.graph_nodes} graph nodes",
            "  families "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.families.items()))
            + "; world sizes "
            + ", ".join(f"{k}: {v}" for k, v in sorted(self.world_sizes.items()))
            + "; dtypes "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.dtypes.items())),
            "  pipelines checked " + ", ".join(f"{k} x{v}" for k, v in sorted(self.pipeline_checks.items())),
            "  of which changed the graph "
            + ", ".join(f"{k} x{v}" for k, v in sorted(self.pipeline_changes.items())),
        ]
        if self.failures:
            lines.append(
                "  FAILURES " + ", ".join(f"{p}/{k} x{c}" for (p, k), c in sorted(self.failures.items()))
            )
            lines += ["  " + b.describe() for b in self.bugs]
        else:
            lines.append("  no failures")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "programs": self.programs,
            "seconds": round(self.seconds, 2),
            "programs_per_second": round(self.programs_per_second, 2),
            "per_rank": self.per_rank,
            "joint": self.joint,
            "graph_nodes": self.graph_nodes,
            "families": dict(self.families),
            "world_sizes": {str(k): v for k, v in self.world_sizes.items()},
            "dtypes": dict(self.dtypes),
            "pipeline_checks": dict(self.pipeline_checks),
            "pipeline_changes": dict(self.pipeline_changes),
            "failures": [
                {"pipeline": p, "kind": k, "count": c} for (p, k), c in sorted(self.failures.items())
            ],
            "bugs": [
                {
                    "index": b.index,
                    "pipeline": b.failure.pipeline,
                    "kind": b.failure.kind,
                    "headline": b.failure.headline(),
                    "saved": str(b.saved) if b.saved else None,
                    "shrunk_ops": len((b.shrunk or b.program).ops),
                }
                for b in self.bugs
            ],
        }

    def merge(self, other: "CampaignReport") -> None:
        self.programs += other.programs
        self.per_rank += other.per_rank
        self.joint += other.joint
        self.graph_nodes += other.graph_nodes
        for a in ("families", "world_sizes", "dtypes", "pipeline_checks", "pipeline_changes", "failures"):
            getattr(self, a).update(getattr(other, a))
        self.bugs.extend(other.bugs)


@contextlib.contextmanager
def _threads(n: Optional[int]) -> Iterator[None]:
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _pipeline_for(failure: Failure, pipelines: Sequence[PipelineSpec]) -> Optional[PipelineSpec]:
    return next((p for p in pipelines if p.name == failure.pipeline), None)


def still_fails_fn(failure: Failure, pipe: Optional[PipelineSpec]) -> Callable[[Program], bool]:
    """The shrinking predicate: the candidate fails the same pipeline with the same kind of failure
    (and, for errors, the same exception type), and is a valid program (its unoptimised graph
    runs on the reference)."""
    pipes = [] if pipe is None else [pipe]
    check_ir = failure.kind == "ir"

    def pred(p: Program) -> bool:
        res = check_program(p, pipes, check_ir=check_ir)
        if failure.kind != "generator" and any(f.kind == "generator" for f in res.failures):
            return False  # not a valid program any more (e.g. a pass error that still reproduces on it)
        return any(f.signature() == failure.signature() for f in res.failures)

    return pred


def shrink_failure(
    program: Program,
    failure: Failure,
    pipelines: Sequence[PipelineSpec],
    *,
    max_checks: int = 300,
    time_limit: Optional[float] = 120.0,
    log=None,
) -> tuple[Program, int]:
    pipe = _pipeline_for(failure, pipelines)
    return shrink(
        program, still_fails_fn(failure, pipe), max_checks=max_checks, time_limit=time_limit, log=log
    )


def run_campaign(
    programs: int = 500,
    seed: int = 0,
    *,
    start: int = 0,
    time_limit: Optional[float] = None,
    pipelines: Optional[Sequence[PipelineSpec]] = None,
    shrink_failures: bool = True,
    shrinks_per_signature: int = 1,
    save_dir: Optional[str | Path] = None,
    threads: Optional[int] = 1,
    progress: Optional[Callable[[str], None]] = None,
    indices: Optional[Sequence[int]] = None,
    features: Sequence[str] = (),
    stop_after_failures: Optional[int] = None,
    check_ir: bool = False,
    family: Optional[str] = None,
    corpus: Optional[Corpus] = None,
) -> CampaignReport:
    """Check programs ``start .. start+programs-1`` of ``seed`` (or ``indices``, or every program
    of ``corpus``, a frozen set; then ``programs``, ``seed`` and ``start`` are the corpus's) with
    ``pipelines`` (default: every registered pass alone and the default pipeline).

    A failure is shrunk (the first ``shrinks_per_signature`` of each (pipeline, kind)) and,
    with ``save_dir``, saved as a regression case. ``time_limit`` stops early (the report says
    how many programs ran), ``stop_after_failures`` after that many failing programs.
    ``threads``: torch intra-op threads while fuzzing (1 is fastest for these tiny tensors).
    ``features``: optional generator features (:data:`commfuse.fuzz.generator.FEATURES`).
    ``check_ir``: also check the CollectiveIR against every program (failure kind ``ir``).
    ``family``: generate every program from that family (see :func:`program_for`)."""
    pipes = list(pipelines) if pipelines is not None else all_pipelines()
    if corpus is not None:
        seed, features = corpus.seed, corpus.features
        work: Iterable[tuple[int, Optional[Program]]] = list(corpus.programs)
    else:
        work = ((i, None) for i in (list(indices) if indices is not None else range(start, start + programs)))
    report = CampaignReport(seed=seed)
    t0 = time.perf_counter()
    failing = 0
    with _threads(threads):
        for i, program in work:
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                break
            if program is None:
                program = program_for(seed, i, pipes, features, family)
            res = check_program(program, pipes, check_ir=check_ir)
            report.programs += 1
            report.per_rank += program.per_rank
            report.joint += program.joint
            report.graph_nodes += res.graph_nodes
            report.families[program.family] += 1
            report.world_sizes[program.world_size] += 1
            report.dtypes[program.dtype] += 1
            report.pipeline_checks.update(res.pipelines_run)
            report.pipeline_changes.update(res.pipelines_changed)
            for f in res.failures:
                sig = (f.pipeline, f.kind)
                report.failures[sig] += 1
                bug = FoundBug(i, f, program)
                if progress:
                    progress(f"program {i} ({program.summary()}): {f.headline()}")
                if shrink_failures and report.failures[sig] <= shrinks_per_signature:
                    bug.shrunk, bug.shrink_checks = shrink_failure(program, f, pipes, log=progress)
                    if save_dir is not None:
                        found = {
                            "seed": seed,
                            "index": i,
                            "ops_before_shrink": len(program.ops),
                            **({"family": family} if family else {}),
                        }
                        reg = make_regression(bug.shrunk, f, _pipeline_for(f, pipes), found=found)
                        bug.saved = save_regression(save_dir, reg)
                if report.failures[sig] <= shrinks_per_signature or not shrink_failures:
                    report.bugs.append(bug)
            if res.failures:
                failing += 1
                if stop_after_failures is not None and failing >= stop_after_failures:
                    break
            if progress and report.programs % 500 == 0:
                progress(
                    f"{report.programs} programs, {time.perf_counter() - t0:.0f} s, "
                    f"{sum(report.failures.values())} failures"
                )
    report.seconds = time.perf_counter() - t0
    return report


# -- parallel campaigns (separate processes: built-in passes and the forced variants) -----------------
def _worker(args: tuple) -> dict:
    (
        seed,
        indices,
        pipe_names,
        include_default,
        shrink_failures,
        save_dir,
        time_limit,
        features,
        check_ir,
        family,
        frozen,
    ) = args
    import warnings

    warnings.filterwarnings("ignore")
    pipes = all_pipelines(pipe_names, include_default=include_default)
    rep = run_campaign(
        seed=seed,
        indices=indices,
        pipelines=pipes,
        shrink_failures=shrink_failures,
        save_dir=save_dir,
        time_limit=time_limit,
        features=features,
        check_ir=check_ir,
        family=family,
        corpus=frozen,
    )
    return {"report": rep}


def run_parallel(
    programs: int,
    seed: int,
    jobs: int,
    *,
    passes: Optional[Sequence[str]] = None,
    include_default: bool = True,
    shrink_failures: bool = True,
    save_dir: Optional[str] = None,
    time_limit: Optional[float] = None,
    start: int = 0,
    features: Sequence[str] = (),
    check_ir: bool = False,
    family: Optional[str] = None,
    corpus: Optional[Corpus] = None,
) -> CampaignReport:
    """The same campaign split over ``jobs`` processes (interleaved indices; with ``corpus``, its
    programs dealt out in turn, and ``programs``, ``seed`` and ``start`` are ignored)."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    if corpus is not None:
        seed = corpus.seed
        parts_of = [
            Corpus(corpus.seed, corpus.programs[j::jobs], start=corpus.start, features=corpus.features)
            for j in range(jobs)
        ]
        chunks: list = [None] * jobs
    else:
        parts_of = [None] * jobs
        chunks = [list(range(start + j, start + programs, jobs)) for j in range(jobs)]
    args = [
        (
            seed,
            c,
            list(passes) if passes is not None else None,
            include_default,
            shrink_failures,
            save_dir,
            time_limit,
            tuple(features),
            check_ir,
            family,
            part,
        )
        for c, part in zip(chunks, parts_of, strict=True)
    ]
    with mp.get_context("spawn").Pool(jobs) as pool:
        parts = pool.map(_worker, args)
    report = CampaignReport(seed=seed)
    for part in parts:
        report.merge(part["report"])
    report.bugs.sort(key=lambda b: b.index)
    report.seconds = time.perf_counter() - t0
    return report
