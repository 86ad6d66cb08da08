"""The pass fuzzer: every registered pass is fuzzed, a CI-sized campaign passes, deliberately
wrong passes are caught and shrunk, and saved regression cases replay."""

from __future__ import annotations

import json
import os
import random
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

from commfuse.config import Config
from commfuse.core.errors import ConfigError
from commfuse.fuzz.forced import FORCED_PASS_NAMES, FORCED_PASSES, is_registered, register_forced_passes
from commfuse.fuzz.generator import FEATURES
from commfuse.fuzz import (
    FAMILIES,
    fuzz_notes,
    CorpusError,
    Program,
    all_pipelines,
    check_program,
    fuzz_target,
    generate_program,
    load_corpus,
    load_regression,
    make_corpus,
    make_regression,
    passes_missing_fuzz_entry,
    program_for,
    register_fuzz_target,
    registered_targets,
    replay,
    run_campaign,
    run_parallel,
    save_corpus,
    save_regression,
    shrink,
    single_pass_pipeline,
    unregister_fuzz_target,
)
from commfuse.fuzz.program import OPS
from commfuse.ir.kinds import is_wait
from commfuse.passes import GraphPass, PassResult, Stage, available_passes, register_pass, unregister_pass

c10d = torch.ops._c10d_functional
REGRESSIONS = Path(__file__).parent / "fuzz_regressions"
# The CI slice: programs frozen in a file, so every run of a commit checks the same programs and
# a change to the generator or the pass registry cannot bring in a newly found failure. Set
# COMMFUSE_FUZZ_SEED (and COMMFUSE_FUZZ_PROGRAMS, default 500) to check freshly generated
# programs instead; the long campaign is a command (docs/contributing.md).
CI_CORPUS = Path(__file__).parent / "fuzz_corpus" / "ci.json"
FRESH_SEED = os.environ.get("COMMFUSE_FUZZ_SEED")
FRESH_PROGRAMS = int(os.environ.get("COMMFUSE_FUZZ_PROGRAMS", "500"))


def _say(capsys, line: str) -> None:
    """Print to the terminal even under output capture (the CI log shows what was fuzzed)."""
    with capsys.disabled():
        print("\n" + line)


# -- registration ------------------------------------------------------------------------
def test_every_registered_pass_has_a_fuzz_entry_or_a_note():
    """Every pass declares how the fuzzer checks it (``fuzz = FuzzSpec(...)`` on the class) or why it
    cannot (``FuzzSpec(not_fuzzed=...)``); every declared spec is valid (known families, a topology
    inside its world sizes)."""
    missing = passes_missing_fuzz_entry()
    assert not missing, (
        f"passes {missing} declare no fuzz spec (`fuzz = FuzzSpec(...)` on the pass class, or "
        f"`FuzzSpec(not_fuzzed=why)`); see docs/contributing.md"
    )
    for name, note in fuzz_notes().items():
        assert len(note.split()) >= 8, f"the fuzz note of {name!r} must say why ({note!r})"
    for name in available_passes():
        fuzz_target(name)


def test_forced_variants_are_fuzz_targets_not_product_passes():
    """The forced variants (commfuse.fuzz.forced) are not product passes: with their registration
    undone, as in a process that never imported the fuzzer (tests/test_import_graph.py keeps the
    product from importing it), the pass table lists none of them and ``Config`` refuses their
    names with a ConfigError naming the field. The fuzzer's targets include every one of them,
    and registering them again changes nothing."""
    assert FORCED_PASS_NAMES <= set(registered_targets())
    assert all(registered_targets()[name].registered for name in FORCED_PASS_NAMES)
    try:
        for name in FORCED_PASS_NAMES:
            unregister_pass(name)
        assert FORCED_PASS_NAMES.isdisjoint(available_passes())
        with pytest.raises(
            ConfigError, match=r"^Config\.passes: unknown pass name\(s\) \['centauri_partition_forced'\]"
        ):
            Config(passes=["centauri_partition_forced"])
    finally:
        register_forced_passes()
    register_forced_passes()
    assert all(is_registered(cls) for cls in FORCED_PASSES)
    assert Config(passes=sorted(FORCED_PASS_NAMES)).passes == sorted(FORCED_PASS_NAMES)


def test_unregistered_pass_is_reported_missing():
    class _NewPass(GraphPass):
        """Test pass with no fuzz entry."""

        name = "test_fuzz_unregistered"
        stage = Stage.SCHEDULE

        def run(self, ctx):
            return PassResult(changed=False)

    register_pass(_NewPass)
    try:
        assert "test_fuzz_unregistered" in passes_missing_fuzz_entry()
        register_fuzz_target("test_fuzz_unregistered", generators=["tp"], exact=True)
        assert "test_fuzz_unregistered" not in passes_missing_fuzz_entry()
        t = registered_targets()["test_fuzz_unregistered"]
        assert t.accepts(generate_program(random.Random(0), family="tp"))
        assert not t.accepts(generate_program(random.Random(0), family="sp"))
    finally:
        unregister_pass("test_fuzz_unregistered")
        unregister_fuzz_target("test_fuzz_unregistered")
    with pytest.raises(ValueError, match="unknown generators"):
        register_fuzz_target("x", generators=["nope"])


# -- programs ----------------------------------------------------------------------------
def test_programs_are_reproducible_and_json_roundtrip():
    a, b = program_for(7, 3), program_for(7, 3)
    assert a.dumps() == b.dumps() and a.dumps() != program_for(7, 4).dumps()
    assert Program.from_json(json.loads(a.dumps())).dumps() == a.dumps()


def test_generator_covers_every_op_and_family():
    seen, per_rank, joint = set(), 0, 0
    for i in range(400):
        p = generate_program(random.Random(f"cov:{i}"))
        seen |= {o["op"] for o in p.ops}
        per_rank += p.per_rank
        joint += p.joint
    for i in range(20):  # a family drawn only when named brings an op of its own (contract_rows)
        seen |= {o["op"] for o in generate_program(random.Random(f"cov:{i}"), family="uneven_batch").ops}
    assert seen == set(OPS), sorted(set(OPS) - seen)
    assert per_rank and joint
    for fam in FAMILIES:
        assert generate_program(random.Random(1), family=fam).family == fam


def test_shrink_is_greedy_and_keeps_the_failure():
    progs = (
        generate_program(random.Random(i), family="tp", world_size=4, dtype="bfloat16", max_blocks=12)
        for i in range(100)
    )
    prog = next(p for p in progs if len(p.ops) >= 6 and any(o["op"] == "matmul" for o in p.ops))

    def has_matmul(p: Program) -> bool:  # a stand-in failure: "the program contains a matmul"
        return any(o["op"] == "matmul" for o in p.ops)

    small, checks = shrink(prog, has_matmul)
    assert has_matmul(small) and len(small.ops) == 1 and small.dtype == "float32" and checks > 0
    assert all(d <= 2 for i in small.inputs for d in i["shape"])


# -- the CI campaign ---------------------------------------------------------------------
@pytest.mark.slow(
    reason="the CI fuzz slice: the frozen corpus through every registered pass and the default pipeline (~2 min)"
)
def test_fuzz_campaign(capsys):
    """The CI slice (tests/fuzz_corpus/ci.json), every registered pass alone and the default
    pipeline, in two processes (one a core)."""
    if FRESH_SEED is not None:
        # Every generator feature and the IR check are on: the in-place-buffer verifier bug and
        # the view/slice layout gaps they found are fixed (tests/fuzz_regressions/*, status fixed).
        rep = run_parallel(FRESH_PROGRAMS, int(FRESH_SEED), 2, features=FEATURES, check_ir=True)
        expected = FRESH_PROGRAMS
    else:
        corpus = load_corpus(CI_CORPUS)
        rep = run_parallel(0, corpus.seed, 2, check_ir=True, corpus=corpus)
        expected = len(corpus.programs)
    _say(capsys, rep.summary())
    assert rep.programs == expected
    assert rep.generator_errors == 0, rep.summary()
    assert not rep.failures, rep.summary() + "\n\n" + "\n\n".join(b.failure.message[:3000] for b in rep.bugs)
    assert rep.per_rank > 0 and rep.joint > 0
    assert set(rep.pipeline_checks) == set(available_passes()) | {"default"}


# the share of the CI slice that also runs through the default executor (world sizes 2 and 4);
# 16 took 230 s of CI's two workers, and the long executor samples run from the command line
# (python -m commfuse.fuzz --execute N, docs/reliability.md)
EXECUTOR_SAMPLE = 10


@pytest.mark.multirank
@pytest.mark.slow(
    reason="fuzz programs through commfuse's runtime with Inductor-compiled regions on gloo rank pools"
)
def test_ci_corpus_sample_runs_through_the_default_executor(rank_pool_2, rank_pool_4):
    """The first programs of the CI slice the pools can run, optimised by the default pipeline,
    lowered by the runtime with Inductor-compiled regions and run on every rank: the values
    equal the reference's run of the unoptimised program, no region falls back to eager."""
    from commfuse.fuzz.execute import check_executed, sample

    programs = sample([p for _, p in load_corpus(CI_CORPUS).programs], EXECUTOR_SAMPLE)
    assert len(programs) == EXECUTOR_SAMPLE and {p.world_size for p in programs} == {2, 4}
    failures = [
        (p, f)
        for p in programs
        if (f := check_executed(p, rank_pool_2 if p.world_size == 2 else rank_pool_4, compile_regions=True))
        is not None
    ]
    assert not failures, "\n\n".join(
        f"{f.pipeline} {f.kind}: {f.message[:2000]}\n{p.dumps()}" for p, f in failures
    )


# Programs the executor sample of a campaign found failing, frozen as a corpus (one per line, with
# the seed and index that generated it): replayed through the executor on every CI run.
EXECUTOR_CORPUS = Path(__file__).parent / "fuzz_corpus" / "executor.json"


@pytest.mark.multirank
@pytest.mark.slow(
    reason="the executor's regression programs through the runtime with Inductor-compiled regions "
    "(~3 s after the CI sample above warmed the pools' Inductor, ~20 s alone)"
)
def test_executor_regression_corpus_runs_through_the_default_executor():
    """Every program of tests/fuzz_corpus/executor.json (found failing by ``--execute N``), run as
    the executor sample runs it: the values equal the reference's, no region falls back to eager.
    Seed 20261204 program 2: a coalesced ``avg`` reduce_scatter whose first output came out as the
    sum on gloo (the second output's wait re-waited the first one's work)."""
    from commfuse.fuzz.execute import check_executed, executable
    from commfuse.testing import get_pool

    programs = [p for _, p in load_corpus(EXECUTOR_CORPUS).programs]
    assert programs and all(executable(p) for p in programs)
    failures = [
        (p, f)
        for p in programs
        if (f := check_executed(p, get_pool(p.world_size), compile_regions=True)) is not None
    ]
    assert not failures, "\n\n".join(
        f"{f.pipeline} {f.kind}: {f.message[:2000]}\n{p.dumps()}" for p, f in failures
    )


# Seed 20261204 program 76 (executor sample program 56): bf16, softmax → layer_norm over 2
# elements → scores, joint; Inductor (float32 inside its regions) was 0.015 of the magnitude from
# the float64 result where the bf16 reference was 0.35 (finding 17).
_EXECUTOR_BF16_LAYER_NORM = json.loads(
    '{"dtype": "bfloat16", "family": "mixed", "format": 1, "groups": {"world": [[0, 1]]}, "inpu'
    'ts": [{"init": "act", "name": "x1", "shape": [1, 2, 6, 2]}], "joint": true, "microbatches"'
    ': 1, "ops": [{"dim": 2, "in": ["x1"], "log": false, "op": "softmax", "out": ["v2"]}, {"dst'
    '": [1], "group": "world", "in": ["v2"], "op": "stage_transfer", "out": ["v3"], "src": [0]}'
    ', {"in": ["v2"], "op": "layer_norm", "out": ["v4"]}, {"in": ["v4", "v4"], "op": "scores", '
    '"out": ["v5"]}], "outputs": ["v3", "v5"], "seed": 571315247, "tp_contract": false, "world_'
    'size": 2}'
)


@pytest.mark.parametrize("which", ["bf16_layer_norm_76", "float32_moe_34"])
def test_executor_rounding_only_judgement(which):
    """``executed_rounding_only`` (check.py's rounding-only oracle, applied to executed outputs):
    the float64 result rounded once to the program's dtype differs from the reference beyond the
    fixed tolerances (ill-conditioned outputs) but is rounding alone; the same output with one
    value of a well-conditioned leaf changed is not. The float32 MoE program (seed 20261204
    program 34) needs the float64 run inside the MoE ops (router statistics fixed to float32)."""
    from commfuse.fuzz.check import _flat, _float64_inside, _in_float64, compare_outputs, prepare
    from commfuse.fuzz.execute import executed_rounding_only
    from commfuse.reference import ReferenceInterpreter

    if which == "float32_moe_34":
        program = program_for(20261204, 34, all_pipelines(None, include_default=True), (), None)
        assert (program.family, program.dtype) == ("moe_layer", "float32")
    else:
        program = Program.from_json(_EXECUTOR_BF16_LAYER_NORM)
    prep = prepare(program, [])
    traced = prep.traced
    expected = list(prep.reference.run(traced.inputs))
    ins64 = [
        [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in r]
        for r in traced.inputs
    ]
    gms = [_in_float64(g) for g in traced.graphs]
    with _float64_inside():
        truth = ReferenceInterpreter(gms[0] if len(gms) == 1 else gms, program.world_size, traced.groups).run(
            ins64
        )
    rounded = [
        [
            t.to(e.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t, e in zip(_flat(tr), _flat(ex), strict=True)
        ]
        for tr, ex in zip(truth, expected, strict=True)
    ]
    if which == "bf16_layer_norm_76":  # the reference itself is beyond tolerance of the float64 result
        assert compare_outputs(rounded, expected, exact=False, program=program, scaled=True) is not None
    assert executed_rounding_only(prep, expected, rounded)
    if which == "bf16_layer_norm_76":  # (a rejection runs all Monte Carlo samples: slow for the MoE program)
        wrong = [list(r) for r in rounded]
        # rank 1's received stage_transfer: well-conditioned. The noise is per rank (the worst leaf,
        # as in check.py): rank 0's ill-conditioned gradient (0.35) would hide 0.5 there.
        leaf = wrong[1][0].clone()
        leaf.view(-1)[0] += max(1.0, float(leaf.abs().max()))
        wrong[1][0] = leaf
        assert not executed_rounding_only(prep, expected, wrong)
        # a leaf missing is never rounding, however close the others are (zip once truncated it)
        assert not executed_rounding_only(prep, expected, [list(r)[:-1] for r in expected])


def test_ci_corpus_exercises_every_registered_pass():
    """Each pass is checked on some program of the CI slice; a new pass whose fuzz target accepts
    none of them needs the corpus rewritten (the command is in the file, docs/contributing.md)."""
    corpus = load_corpus(CI_CORPUS)
    assert corpus.command.startswith("python -m commfuse.fuzz --write-corpus")
    assert len({i for i, _ in corpus.programs}) == len(corpus.programs) >= 100
    unexercised = [
        name
        for name in available_passes()
        if not any(fuzz_target(name).accepts(p) for _, p in corpus.programs)
    ]
    assert not unexercised, (
        f"no program of {CI_CORPUS} is fuzzed with {unexercised}: rewrite the corpus with "
        f"`{corpus.command.replace('FILE', str(CI_CORPUS))}` (more --programs if needed)"
    )


def test_corpus_roundtrip_and_bad_files_name_the_field(tmp_path):
    frozen = make_corpus(20240, 3, start=6, features=FEATURES)
    assert [i for i, _ in frozen.programs] == [6, 7, 8]
    assert [p.dumps() for _, p in frozen.programs] == [
        program_for(20240, i, all_pipelines(), FEATURES).dumps() for i in (6, 7, 8)
    ]
    again = load_corpus(save_corpus(tmp_path / "c.json", frozen))
    assert (again.seed, again.start, again.features) == (20240, 6, tuple(FEATURES))
    assert [(i, p.dumps()) for i, p in again.programs] == [(i, p.dumps()) for i, p in frozen.programs]
    rep = run_campaign(corpus=again, pipelines=[single_pass_pipeline("sink_waits")])
    assert rep.programs == 3 and rep.seed == 20240
    bad = tmp_path / "bad.json"
    for text, field in (
        ("{", "cannot read"),
        ('{"format": 2}', "'format'"),
        ('{"format": 1, "seed": 1}', "'programs'"),
        ('{"format": 1, "seed": 1, "programs": [{"index": 0}]}', "programs[0]"),
    ):
        bad.write_text(text)
        with pytest.raises(CorpusError, match=re.escape(field)) as e:
            load_corpus(bad)
        assert str(bad) in str(e.value)


# -- deliberately wrong passes are caught ------------------------------------------------
class _WrongReduceOp(GraphPass):
    """Test-only, deliberately wrong: turns the first sum all_reduce into a max all_reduce."""

    name = "test_wrong_reduce_op"
    stage = Stage.JOINT

    def run(self, ctx):
        for n in ctx.gm.graph.nodes:
            if n.target is c10d.all_reduce.default and n.args[1] == "sum":
                n.args = (n.args[0], "max", *n.args[2:])
                return PassResult(changed=True, counts={"broken": 1})
        return PassResult(changed=False)


class _SwapResults(GraphPass):
    """Test-only, deliberately wrong: two collectives with same-shaped results swap their waits' users."""

    name = "test_swap_results"
    stage = Stage.SCHEDULE

    def run(self, ctx):
        order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
        cs = [c for c in ctx.ir.collectives if not c.coalesced and len(c.waits) == 1 and c.waits[0].users]
        for i, a in enumerate(cs):
            for b in cs[i + 1 :]:
                wa, wb = a.waits[0], b.waits[0]
                if (a.output_shapes[0], a.dtype) != (b.output_shapes[0], b.dtype):
                    continue
                if min(order[u] for u in [*wa.users, *wb.users]) < max(order[wa], order[wb]):
                    continue
                ua, ub = list(wa.users), list(wb.users)
                for u in ua:
                    u.replace_input_with(wa, wb)
                for u in ub:
                    u.replace_input_with(wb, wa)
                return PassResult(changed=True, counts={"swapped": 1})
        return PassResult(changed=False)


class _SinkPastMutations(GraphPass):
    """Test-only, deliberately wrong: sink_waits without its mutation barrier."""

    name = "test_sink_past_mutation"
    stage = Stage.SCHEDULE

    def run(self, ctx):
        order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
        moved = 0
        for w in [n for n in ctx.gm.graph.nodes if n.op == "call_function" and is_wait(n.target)]:
            if w.users:
                target = min(w.users, key=lambda u: order[u])
                if w.next is not target:
                    target.prepend(w)
                    moved += 1
        return PassResult(changed=moved > 0)


@pytest.mark.parametrize(
    "cls, kind, max_ops",
    [
        (_WrongReduceOp, "mismatch", 3),
        (_SwapResults, "mismatch", 5),
        (_SinkPastMutations, "reference_error", 5),
    ],
    ids=["wrong_reduce_op", "swapped_results", "wait_sunk_past_mutation"],
)
@pytest.mark.slow(reason="fuzzes until the planted bug is found (up to 400 programs), then shrinks it")
def test_wrong_pass_is_caught_shrunk_saved_and_replayed(capsys, tmp_path, cls, kind, max_ops):
    register_pass(cls)
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = run_campaign(
                400,
                seed=3,
                pipelines=[single_pass_pipeline(cls.name)],
                stop_after_failures=1,
                save_dir=tmp_path,
            )
        assert rep.bugs, f"the fuzzer missed the wrong pass {cls.name} in {rep.programs} programs"
        bug = rep.bugs[0]
        _say(
            capsys,
            f"{cls.name}: caught at program {bug.index} ({bug.failure.kind}), shrunk from "
            f"{len(bug.program.ops)} to {len(bug.shrunk.ops)} ops in {bug.shrink_checks} checks, "
            f"{time.perf_counter() - t0:.1f} s: {bug.shrunk.summary()}",
        )
        assert bug.failure.kind == kind and bug.failure.pipeline == cls.name
        assert len(bug.shrunk.ops) <= min(max_ops, len(bug.program.ops))
        reg = load_regression(bug.saved)
        assert reg.program.dumps() == bug.shrunk.dumps() and reg.failure_kind == kind
        _, fails = replay(reg)
        assert [f.kind for f in fails] == [kind]
    finally:
        unregister_pass(cls.name)
    # without the pass (e.g. after the fix, or the pass renamed) the case no longer applies
    assert cls.name not in available_passes()


def test_regression_roundtrip(tmp_path):
    prog = program_for(0, 1)
    res = check_program(prog)
    assert res.ok, [f.headline() for f in res.failures]
    from commfuse.fuzz.check import Failure

    reg = make_regression(
        prog, Failure("sink_waits", "mismatch", "example"), single_pass_pipeline("sink_waits"), status="fixed"
    )
    path = save_regression(tmp_path, reg)
    again = load_regression(path)
    assert again.status == "fixed" and again.program.dumps() == prog.dumps()
    assert replay(again)[1] == []


# -- saved regression cases --------------------------------------------------------------
def _cases():
    return sorted(REGRESSIONS.glob("*.json")) if REGRESSIONS.is_dir() else []


@pytest.mark.parametrize("path", _cases(), ids=lambda p: p.stem)
def test_saved_regression_case(path):
    reg = load_regression(path)
    names = reg.pipeline["passes"] if reg.pipeline and reg.pipeline.get("passes") else []
    missing = [n for n in names if n not in available_passes()]
    if missing:
        pytest.skip(f"passes {missing} are no longer registered")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, fails = replay(reg)
    if reg.status == "open":
        if fails:
            pytest.xfail(f"open bug: {reg.title}: {fails[0].headline()}")
        pytest.fail(f'{path.name} is marked open but passes now: set "status": "fixed" in the file')
    assert not fails, "\n".join(f.message for f in fails)


# -- the moe_layer family ------------------------------------------------------------------
def test_moe_layer_family_places_the_layer_as_models_do():
    """commfuse::moe_layer after token gathers on its EP group, top_k 1/2, dropless / capacity
    that cannot bind / capacity that can, token_groups 1/N, forward-only and joint, the router
    the same on every rank (a replicated input or gathered on the EP group), the statistics
    reaching the outputs."""
    from commfuse.fuzz.program import make_inputs
    from commfuse.ops.moe_layer.routing import capacity_can_bind

    seen = set()
    for i in range(150):
        p = program_for(11, i, family="moe_layer")
        made = {o: op for op in p.ops for o in op["out"]}
        inputs = {i["name"]: i for i in p.inputs}
        for op in p.ops:
            if op["op"] != "moe_layer":
                continue
            x, rw = made.get(op["in"][0]), op["in"][1]
            n = len(p.groups[op["group"]][0]) if op.get("ep", True) else 1
            e = inputs[op["in"][2]]["shape"][0] * n
            cf = op["capacity_factor"]
            mode = (
                "dropless"
                if cf <= 0
                else "binding"
                if capacity_can_bind(cf, op["top_k"], e)
                else "cannot_bind"
            )
            gathered = x is not None and x["op"] == "all_gather" and x["group"] == op["group"]
            router = "input" if rw in inputs else made[rw]["op"]
            assert router != "input" or inputs[rw].get("replicated") or not op.get("ep", True)
            groups = "N" if op["token_groups"] == len(p.groups[op["group"]][0]) > 1 else op["token_groups"]
            seen |= {
                ("top_k", op["top_k"]),
                ("mode", mode),
                ("token_groups", groups),
                ("gathered", gathered),
                ("router", router),
                ("joint", p.joint),
                ("ep", op.get("ep", True)),
            }
            stats = set(op["out"][1:])
            aux = {o for q in p.ops if q["op"] == "moe_aux_loss" and set(q["in"]) == stats for o in q["out"]}
            assert (stats | aux) & set(p.outputs), p.summary()
        if p.ops and any(i.get("replicated") for i in p.inputs) and i < 20:
            ins = [make_inputs(p, r) for r in range(p.world_size)]
            for k, spec in enumerate(p.inputs):
                if spec.get("replicated"):
                    assert all(torch.equal(ins[r][k], ins[0][k]) for r in range(p.world_size))
    expected = {
        ("top_k", 1),
        ("top_k", 2),
        ("mode", "dropless"),
        ("mode", "binding"),
        ("mode", "cannot_bind"),
        ("token_groups", 1),
        ("token_groups", "N"),
        ("gathered", True),
        ("router", "input"),
        ("router", "all_gather"),
        ("joint", True),
        ("joint", False),
        ("ep", False),
    }
    assert expected <= seen, sorted(expected - seen)


@pytest.mark.parametrize("index", [33, 47])
def test_collective_motion_moves_moe_layer_in_fuzz_programs(index):
    """Programs of the moe_layer family on which motion runs the layer on token shards (capacity
    that can bind, token_groups = N) pass the check: the campaign tests the MoE rules."""
    from commfuse.fuzz.check import prepare
    from commfuse.ir.shapes import shape_of
    from commfuse.moe import MOE_LAYER

    p = program_for(0, index, family="moe_layer")
    pipe = single_pass_pipeline("collective_motion")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prep = prepare(p, [pipe, single_pass_pipeline("sink_waits")])  # motion on a copy
        tokens = [
            [shape_of(n.args[0])[0] for n in gm.graph.nodes if n.target is MOE_LAYER]
            for gm in (prep.traced.graphs[0], prep.optimised["collective_motion"][0])
        ]
        assert tokens[1] != tokens[0], (
            f"motion no longer moves the layer in {p.summary()} (generator changed? pick another index)"
        )
        res = check_program(p, [pipe])
    assert res.ok and res.pipelines_changed == ["collective_motion"], [f.headline() for f in res.failures]


# -- the group_pairs family ----------------------------------------------------------------
def _group_pair_kind(p: Program) -> str:
    if "m0" in p.groups:
        return "mesh"
    return "alias" if any(r.endswith("_alias") for r in p.groups) else "reorder"


def _adjacent_collectives(p: Program) -> list[tuple[dict, dict]]:
    """(first, second) program ops: both collectives, the second reads the first's only result,
    which nothing else reads."""
    made = {o: op for op in p.ops for o in op["out"]}
    readers: dict[str, int] = {}
    for op in p.ops:
        for v in op["in"]:
            readers[v] = readers.get(v, 0) + 1
    out = []
    for op in p.ops:
        if not OPS[op["op"]].collective or len(op["in"]) != 1:
            continue
        first = made.get(op["in"][0])
        if (
            first is not None
            and OPS[first["op"]].collective
            and readers[op["in"][0]] == 1
            and op["in"][0] not in p.outputs
        ):
            out.append((first, op))
    return out


def test_group_pairs_family_puts_adjacent_collectives_on_aliased_reordered_and_mesh_groups():
    """group_pairs programs: a partition and the same blocks under another role (alias), the same
    ranks in another group-rank order (every block: one SPMD graph; some blocks: one graph per
    rank) and the two dims of a 2x2 / 2x4 / 4x2 mesh (sometimes with an EP alias of a dim), with
    adjacent collectives on the two groups of a pair; the programs trace and run on the
    reference (no ``generator`` failure, the IR agrees), and campaigns draw the family in its
    own slot (programs 9, 29, ... of a seed)."""
    seen, valid = set(), set()
    for i in range(80):
        p = program_for(12, i, family="group_pairs")
        kind, n = _group_pair_kind(p), p.world_size
        assert p.family == "group_pairs" and p.groups["world"] == [list(range(n))]
        assert Program.from_json(json.loads(p.dumps())).dumps() == p.dumps()
        for part in p.groups.values():  # every role partitions the world
            assert sorted(r for b in part for r in b) == list(range(n)) and len({len(b) for b in part}) == 1
        if kind == "mesh":
            m0, m1 = p.groups["m0"], p.groups["m1"]
            assert all(len(set(a) & set(b)) == 1 for a in m0 for b in m1)  # the two dims cross
            shape = (len(m0[0]), len(m1[0]))
            assert shape[0] * shape[1] == n and n in (4, 8)
            seen.add(("mesh", shape))
            if "ep" in p.groups:
                assert p.groups["ep"] in (m0, m1)
                seen.add(("mesh", "ep"))
            pairs = {("m0", "m1"), ("m1", "m0"), ("m0", "ep"), ("ep", "m0"), ("m1", "ep"), ("ep", "m1")}
        else:
            base = "p1" if "p1" in p.groups else "world"
            twin = next(r for r in p.groups if r.startswith(base + "_"))
            a, b = p.groups[base], p.groups[twin]
            if kind == "alias":
                assert a == b
            else:
                assert [sorted(x) for x in a] == [sorted(y) for y in b] and a != b
                some = any(x == y for x, y in zip(a, b, strict=True))
                assert p.per_rank == some, "only some blocks reordered: one graph per rank"
                seen.add(("reorder", "some" if some else "all"))
            seen.add((kind, base))
            pairs = {(base, twin), (twin, base)}
        cross = [(f, s) for f, s in _adjacent_collectives(p) if (f["group"], s["group"]) in pairs]
        seen |= {("pair", kind)} if cross else set()
        seen |= {("kinds", f["op"], s["op"]) for f, s in cross}
        if cross and (kind, p.per_rank) not in valid:
            res = check_program(p, [], check_ir=True)
            assert res.ok, [f.headline() for f in res.failures]
            valid.add((kind, p.per_rank))
    expected = {
        ("alias", "world"),
        ("alias", "p1"),
        ("reorder", "world"),
        ("reorder", "p1"),
        ("reorder", "all"),
        ("reorder", "some"),
        ("mesh", (2, 2)),
        ("mesh", (2, 4)),
        ("mesh", (4, 2)),
        ("mesh", "ep"),
        ("pair", "alias"),
        ("pair", "reorder"),
        ("pair", "mesh"),
        ("kinds", "all_gather", "all_gather"),
        ("kinds", "reduce_scatter", "all_gather"),
        ("kinds", "all_to_all", "all_to_all"),
    }
    assert expected <= seen, sorted(expected - seen)
    assert {("alias", False), ("reorder", False), ("reorder", True), ("mesh", False)} <= valid, valid
    # campaigns: a slot of its own; the constrained slots of passes that also name it draw the ordinary mix
    fams = [program_for(5, i, all_pipelines()).family for i in range(60)]
    assert [i for i, f in enumerate(fams) if f == "group_pairs"] == [9, 29, 49]


def test_fuse_collectives_on_group_pairs_programs():
    """fuse_collectives on group_pairs programs, single process on the fake world: an adjacent
    pair on two names of the same ranks in the same order is fusible (and fused: the pass changes
    the graph), the same ranks in another order is refused ("groups differ in members"), a pair on
    two mesh dims is fused into a many-to-many scatter where the table across groups has its kinds
    and dims (the program's partitions declared) and refused otherwise, and fuse_collectives and
    chimera keep every rank's values (the reference)."""
    from commfuse.fuzz.program import make_inputs, trace_rank
    from commfuse.ir.graph_ir import CollectiveIR
    from types import SimpleNamespace

    from commfuse.core.torch_private import process_group_with_members
    from commfuse.testing.fake_pg import fake_process_group
    from commfuse.transforms.fuse_collectives import _check_pair, find_pairs

    pipes = [single_pass_pipeline("fuse_collectives"), single_pass_pipeline("chimera")]
    evidence: dict[str, int] = {}
    for i in range(60):
        p = program_for(3, i, family="group_pairs")
        found = set()
        with warnings.catch_warnings(), fake_process_group(p.world_size, rank=0):
            warnings.simplefilter("ignore")
            gm, _ = trace_rank(p, 0, make_inputs(p, 0))
            declared = SimpleNamespace(
                partitions=[part for role, part in p.groups.items() if role != "world"],
                group_with_members=process_group_with_members,
            )
            for pair in find_pairs(CollectiveIR(gm).collectives):
                a, b = pair.first.group, pair.second.group
                if a.name == b.name:
                    continue
                why, _ = _check_pair(pair, declared)
                if a.ranks == b.ranks:
                    if why is None:
                        found.add("same ranks, other names: fusible")
                    else:
                        assert "groups differ" not in why, why
                elif sorted(a.ranks) == sorted(b.ranks):
                    assert why is not None and "groups differ in members" in why, why
                    found.add("same ranks, other order: refused")
                elif _group_pair_kind(p) == "mesh" and len(set(a.ranks) & set(b.ranks)) == 1:
                    # a group of each dim: they cross in one rank
                    found.add("two mesh dims: refused" if why else "two mesh dims: fused")
                    assert why is None or "groups differ in members" in why, why
                else:
                    assert why is not None and "groups differ in members" in why, why
        if not found - {k for k, c in evidence.items() if c >= 2}:
            continue  # nothing new: check only a handful of programs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = check_program(p, pipes)
        assert res.ok, (p.dumps(), [f.headline() for f in res.failures])
        if found & {"same ranks, other names: fusible", "two mesh dims: fused"}:
            assert "fuse_collectives" in res.pipelines_changed, p.summary()
        for k in found:
            evidence[k] = evidence.get(k, 0) + 1
        if len(evidence) == 4 and min(evidence.values()) >= 2:
            break
    assert (
        set(evidence)
        == {
            "same ranks, other names: fusible",
            "same ranks, other order: refused",
            "two mesh dims: refused",
            "two mesh dims: fused",
        }
        and min(evidence.values()) >= 2
    ), evidence


@pytest.mark.parametrize("wrong, kinds", [("as_sets", {"reorder"}), ("by_size", {"reorder", "mesh"})])
def test_group_pairs_catch_a_wrong_same_members(monkeypatch, wrong, kinds):
    """A planted bug in the group test fuse_collectives relies on is caught on group_pairs
    programs: ``same_members`` comparing rank *sets* (ignoring the group-rank order) fails on a
    reordered pair, one comparing sizes only also on two mesh dims (``mismatch``)."""
    from commfuse.ir.collective import GroupInfo

    def as_sets(self, other):
        return self.name == other.name or (
            self.ranks is not None and other.ranks is not None and sorted(self.ranks) == sorted(other.ranks)
        )

    def by_size(self, other):
        return self.name == other.name or self.size == other.size

    monkeypatch.setattr(GroupInfo, "same_members", {"as_sets": as_sets, "by_size": by_size}[wrong])
    pipe = single_pass_pipeline("fuse_collectives")
    caught = set()
    for i in range(60):
        p = program_for(3, i, family="group_pairs")
        if _group_pair_kind(p) not in kinds - caught:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = check_program(p, [pipe])
        if res.failures:
            assert {f.kind for f in res.failures} == {"mismatch"}, [f.headline() for f in res.failures]
            caught.add(_group_pair_kind(p))
            if caught == kinds:
                break
    assert caught == kinds, (
        f"the wrong same_members ({wrong}) went unnoticed on {sorted(kinds - caught)} programs"
    )


# -- the moe family's dropless exchange ------------------------------------------------------
def test_moe_family_dropless_exchange_gives_hidden_exchange_partition_both_chains():
    """The moe family's dropless exchange (an uneven dispatch, a row gather, up and down matmuls,
    the rows scattered back into a fresh buffer, the inverse exchange) traces to the chains
    hidden_exchange_partition cuts: on every rank's graph the dispatch is cut with its consumer
    chain and the combine with its producer chain (the index_put into new_zeros replayed per
    column block), and the cut program passes the check."""
    from commfuse.fuzz.check import REPORTS_META, prepare

    aten = torch.ops.aten
    p = program_for(0, 1, family="moe")
    ops = [o["op"] for o in p.ops]
    assert {"gather_rows", "scatter_rows"} <= set(ops) and p.per_rank and not p.joint, (
        f"{p.summary()} (generator changed? pick another index)"
    )
    pipe = single_pass_pipeline("hidden_exchange_partition")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prep = prepare(p, [pipe])
        for before, gm in zip(prep.traced.graphs, prep.optimised[pipe.name], strict=True):
            dirs = sorted(
                d["direction"]
                for rep in gm.meta.get(REPORTS_META, [])
                for rec in rep.passes
                for d in rec.decisions
            )
            assert dirs == ["consumer", "producer"], dirs
            puts = [sum(n.target is aten.index_put.default for n in g.graph.nodes) for g in (before, gm)]
            assert puts == [1, 2], puts
        res = check_program(p, [pipe], check_ir=True)
    assert res.ok and res.pipelines_changed == [pipe.name], [f.headline() for f in res.failures]


# -- the uneven_batch family ------------------------------------------------------------------
def test_uneven_batch_family_gives_every_rank_a_local_batch_of_its_own():
    """uneven_batch programs (#40): the activations' dim 0 is each rank's own local batch (one rank
    at 1 and the others at 16, random sizes, or the same on every rank as the control), so every
    program is one graph per rank; the collectives read only values whose size every rank shares
    (parameters, their shards, batch reductions, weight-gradient-like contractions), so the
    programs trace and run on the reference; the family is drawn only when named."""
    from commfuse.fuzz.generator import BATCH_ROWS, FAMILY_WEIGHTS

    assert "uneven_batch" in FAMILIES and "uneven_batch" not in FAMILY_WEIGHTS
    seen_ops, kinds, checked = set(), set(), 0
    for i in range(40):
        p = program_for(40, i, family="uneven_batch")
        rows = p.inputs[0]["rows"]
        assert p.per_rank and len(rows) == p.world_size and set(rows) <= set(BATCH_ROWS), rows
        assert p.inputs[0]["shape"][0] == max(rows)
        assert Program.from_json(json.loads(p.dumps())).dumps() == p.dumps()
        kinds.add("equal" if len(set(rows)) == 1 else "one at 1" if sorted(rows)[:2] == [1, 16] else "uneven")
        seen_ops |= {o["op"] for o in p.ops}
        if checked < 4 and len(set(rows)) > 1:
            res = check_program(p, [])
            assert res.ok, [f.headline() for f in res.failures]
            graphs = prepare_graphs(p)
            assert len({tuple(_placeholder_shapes(g)) for g in graphs}) > 1, "ranks trace their own sizes"
            checked += 1
    assert kinds == {"equal", "one at 1", "uneven"}, kinds
    assert {"all_gather", "reduce_scatter", "all_reduce", "contract_rows", "reduce", "moe_layer"} <= seen_ops


def prepare_graphs(p: Program) -> list:
    from commfuse.fuzz.check import prepare

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare(p, []).traced.graphs


def _placeholder_shapes(gm) -> list:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]


# Programs of seed 40 on which a pipeline that prices every rank's own compute diverges: 14 (ranks
# at 16, 16, 1, 16: collectives of different sizes) and 26 (16, 1, 16, 16: a deadlock).
UNEVEN_BATCH_DIVERGING = (14, 26)


def test_uneven_batch_programs_catch_a_pipeline_that_prices_local_batches(monkeypatch):
    """The family's oracle has teeth: with ``Config.uniform_batches=True`` (every compute shape
    priced, so each rank decides from its own local batch, as commfuse did before #40) the default
    pipeline's collectives no longer match between the ranks of these programs, which the
    reference reports (a size mismatch or a deadlock); with the default config they pass."""
    import commfuse.fuzz.check as check

    programs = [program_for(40, i, family="uneven_batch") for i in UNEVEN_BATCH_DIVERGING]
    pipe = [check.default_pipeline()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in programs:
            res = check_program(p, pipe)
            assert res.ok, [f.headline() for f in res.failures]
        plain = check.PipelineSpec.config
        monkeypatch.setattr(
            check.PipelineSpec,
            "config",
            lambda self, roles=None: plain(self, roles).model_copy(update={"uniform_batches": True}),
        )
        for p in programs:
            res = check_program(p, pipe)
            assert [f.kind for f in res.failures] == ["reference_error"], [f.headline() for f in res.failures]
            assert re.search(r"CollectiveMismatchError|DeadlockError", res.failures[0].message)


@pytest.mark.slow(
    reason="8 uneven_batch programs of 2-8 ranks through the default pipeline, every rank's graph (~20 s)"
)
def test_uneven_batch_programs_pass_the_default_pipeline():
    """A slice of the family through the default pipeline (the one that decides from costs): every
    rank's graph is optimised on its own, and the ranks' values equal the unoptimised program's.
    Every pass alone on the family, and a thousand programs: the campaign in docs/reliability.md."""
    from commfuse.fuzz.check import default_pipeline

    rep = run_campaign(8, 40, family="uneven_batch", pipelines=[default_pipeline()], shrink_failures=False)
    assert rep.programs == 8 and rep.generator_errors == 0, rep.summary()
    assert not rep.failures, rep.summary() + "\n\n" + "\n\n".join(b.failure.message[:3000] for b in rep.bugs)


@pytest.mark.multirank
@pytest.mark.slow(reason="uneven_batch programs through commfuse's runtime on gloo rank pools")
def test_uneven_batch_programs_run_through_the_default_executor(rank_pool_2, rank_pool_4):
    """Every rank traces the program at its own local batch, runs the default pipeline on its own
    graph, lowers it to the runtime and runs it on real gloo groups: no hang, no size error, and
    the values equal the reference's run of the unoptimised program (programs 14 and 26 are those
    on which pricing local batches diverges; 19 and 35 joint, 34 an MoE layer on each rank's own
    tokens)."""
    from commfuse.fuzz.execute import check_executed

    programs = [program_for(40, i, family="uneven_batch") for i in (*UNEVEN_BATCH_DIVERGING, 19, 34, 35)]
    assert {p.world_size for p in programs} == {2, 4}
    failures = [
        (p, f)
        for p in programs
        if (
            f := check_executed(
                p, rank_pool_2 if p.world_size == 2 else rank_pool_4, compile_regions=False, timeout=120
            )
        )
        is not None
    ]
    assert not failures, "\n\n".join(
        f"{f.pipeline} {f.kind}: {f.message[:2000]}\n{p.dumps()}" for p, f in failures
    )
