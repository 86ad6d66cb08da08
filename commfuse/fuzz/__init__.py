"""The pass fuzzer: random hybrid-parallel programs, every pass checked against the reference.

    python -m commfuse.fuzz --programs 20000 --seed 1 --jobs 2      # a long campaign
    from commfuse.fuzz import run_campaign, check_program, generate_program, register_fuzz_target

See docs/reliability.md (what it checks, how failures shrink and are saved) and
docs/contributing.md (registering a pass with the fuzzer, adding a regression case).
Importing the fuzzer registers the test-only forced pass variants (:mod:`commfuse.fuzz.forced`)
with the pass table, so it fuzzes them with the product passes.
"""

from commfuse.fuzz.campaign import (
    CampaignReport,
    FoundBug,
    program_for,
    run_campaign,
    run_parallel,
    shrink_failure,
)
from commfuse.fuzz.check import (
    FAILURE_KINDS,
    CheckResult,
    Failure,
    PipelineSpec,
    all_pipelines,
    check_program,
    default_pipeline,
    single_pass_pipeline,
)
from commfuse.fuzz.corpus import Corpus, CorpusError, load_corpus, make_corpus, save_corpus
from commfuse.fuzz.generator import FAMILIES, generate_program
from commfuse.fuzz.program import OPS, Program
from commfuse.fuzz.regressions import (
    Regression,
    load_regression,
    load_regressions,
    make_regression,
    replay,
    save_regression,
)
from commfuse.fuzz.shrink import shrink
from commfuse.fuzz.targets import (
    FUZZ_NOTES,
    FuzzTarget,
    fuzz_notes,
    fuzz_target,
    passes_missing_fuzz_entry,
    register_fuzz_target,
    registered_targets,
    unregister_fuzz_target,
)

__all__ = [
    "FAILURE_KINDS",
    "FAMILIES",
    "FUZZ_NOTES",
    "fuzz_notes",
    "OPS",
    "CampaignReport",
    "CheckResult",
    "Corpus",
    "CorpusError",
    "Failure",
    "FoundBug",
    "FuzzTarget",
    "PipelineSpec",
    "Program",
    "Regression",
    "all_pipelines",
    "check_program",
    "default_pipeline",
    "fuzz_target",
    "generate_program",
    "load_corpus",
    "load_regression",
    "load_regressions",
    "make_corpus",
    "make_regression",
    "passes_missing_fuzz_entry",
    "program_for",
    "register_fuzz_target",
    "registered_targets",
    "replay",
    "run_campaign",
    "run_parallel",
    "save_corpus",
    "save_regression",
    "shrink",
    "shrink_failure",
    "single_pass_pipeline",
    "unregister_fuzz_target",
]
