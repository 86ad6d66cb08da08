"""Fuzz programs run by the default executor on real process groups.

``check_program`` compares rewritten graphs with the reference interpreter; the lowering
(plan, runtime, Inductor-compiled regions) is outside it. Here a sample of the same programs
runs the way training runs: on every rank of a gloo rank pool whose world size is the
program's, each rank traces the program, runs the default pipeline on its graph, lowers it
with ``lower_runtime`` (commfuse's runtime issuing every collective as an asynchronous c10d
call on the real groups; compute regions compiled by Inductor, or run eagerly) and runs it on
its inputs. The outputs of all ranks are compared with the reference interpreter's run of the
*unoptimised* program, with the tolerance policy of ``check_program``; a difference beyond it
passes when it is rounding alone (``executed_rounding_only``: check.py's rounding-only oracle,
the executed error against the float64 reference within what rounding alone of the unoptimised
program produces).

Oracle: real gloo groups and the runtime's own code paths (``lowering/runtime.py``,
``lowering/c10d_issue.py``, ``lowering/regions.py``), so a wrong plan, a region missing a symbol
or a wrong stride, or a mismatched issue order shows up as a wrong value, an error or a hang
(the pool's timeout).

Used by ``tests/test_fuzz.py`` (a sample of the CI corpus) and ``python -m commfuse.fuzz
--execute N`` (the first N eligible programs of a campaign).
"""

from __future__ import annotations

import json
import traceback
import warnings
from typing import Any, Optional, Sequence

import torch

from commfuse.api import optimize
from commfuse.core.torch_private import (
    inductor_compile_fx_inner,
    inductor_decompositions,
    process_group_names,
)
from commfuse.fuzz.check import Failure, _rounding_only, compare_outputs, default_pipeline, prepare
from commfuse.fuzz.program import Program, make_inputs, trace_rank
from commfuse.lowering import lower_runtime

# world sizes the rank pools provide (tests/conftest.py: rank_pool_2, rank_pool_4)
EXECUTOR_WORLD_SIZES = (2, 4)


def executable(program: Program) -> bool:
    """Whether the executor sample takes ``program``: a pool exists for its world size."""
    return program.world_size in EXECUTOR_WORLD_SIZES


def run_program_on_rank(text: str, compile_regions: bool) -> dict[str, Any]:
    """Rank job: trace ``text`` (a ``Program``) as this rank, optimise with the default pipeline,
    lower with the runtime and run it. Returns this rank's outputs, or the error."""
    import torch.distributed as dist

    program = Program.from_json(json.loads(text))
    rank = dist.get_rank()
    before = set(process_group_names())
    try:
        inputs = make_inputs(program, rank)
        gm, _names = trace_rank(program, rank, inputs)
        roles = {name: "tp" for name in _names} if program.tp_contract else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimize(gm, default_pipeline().config(roles))
        compile_fn = None
        if compile_regions:
            # the graphs Inductor's inner compiler gets in training are AOTAutograd's, decomposed
            gm = _decomposed(gm)
            compile_fn = _inductor_region_compiler()
        example = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = lower_runtime(gm, "forward", compile_regions=compile_fn, example_inputs=example)
            out = run([t.clone() for t in inputs])
        flat = out if isinstance(out, (list, tuple)) else [out]
        # a region that fell back to eager still gives the same values; it is reported, since
        # it means a region commfuse cut could not be compiled
        fallbacks = sorted({str(w.message)[:300] for w in caught if "runs eagerly" in str(w.message)})
        return {
            "outputs": [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in flat],
            "fallbacks": fallbacks,
        }
    except Exception as e:  # noqa: BLE001 - reported as the program's failure
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
    finally:
        for pg in [pg for pg in process_group_names() if pg not in before]:
            dist.destroy_process_group(pg)


def _decomposed(gm):
    """``gm`` as AOTAutograd hands graphs to Inductor: functionalized (``make_fx`` keeps e.g. the
    ``squeeze_`` that ``matmul`` of a vector decomposes into) and decomposed."""
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    example = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn = functionalize(gm, remove="mutations")
            return make_fx(fn, decomposition_table=inductor_decompositions(), tracing_mode="fake")(*example)
        except RuntimeError:
            # in-place collectives (all_reduce_, broadcast_) cannot be functionalized; Dynamo
            # never hands them to AOTAutograd (it traces dist.all_reduce as functional + copy_)
            return make_fx(gm, decomposition_table=inductor_decompositions(), tracing_mode="fake")(*example)


def _inductor_region_compiler():
    def compile_region(sub, inputs):
        return inductor_compile_fx_inner(sub, inputs)

    return compile_region


def check_executed(
    program: Program, pool, *, compile_regions: bool, timeout: float = 300.0
) -> Optional[Failure]:
    """Run ``program`` on ``pool`` (its world size) through the default executor and compare
    every rank's outputs with the reference run of the unoptimised program."""
    prep = prepare(program, [])
    expected = prep.reference.run(prep.traced.inputs)
    results = pool.run(run_program_on_rank, program.dumps(), compile_regions, timeout=timeout)
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    name = "executor+inductor" if compile_regions else "executor"
    if errors:
        return Failure(name, "executor_error", "\n".join(errors))
    actual = [res["outputs"] for res in results]
    diff = compare_outputs(actual, list(expected), exact=False, program=program, scaled=True)
    if diff is not None and executed_rounding_only(prep, list(expected), actual):
        diff = None
    if diff is not None:
        return Failure(name, "mismatch", diff)
    fallbacks = [f"rank {r}: {w}" for r, res in enumerate(results) for w in res["fallbacks"]]
    return Failure(name, "region_fallback", "\n".join(fallbacks)) if fallbacks else None


def executed_rounding_only(prep, expected: list, actual: list) -> bool:
    """Whether the executed outputs ``actual`` differ from the reference's ``expected`` by rounding
    alone: check.py's rounding-only judgement (``_rounding_only``) with the unoptimised program
    as both programs (its float64 self-agreement is trivial), so what it decides is that every
    rank's executed error against the float64 run of the unoptimised program is within 8x the
    reference run's own error plus atol, or within ``_MCA_MARGIN`` x the worst Monte Carlo
    rounding sample of the unoptimised program. Inductor regions compute low-precision ops in
    float32 and fuse reductions in their own order (a bf16 layer norm over 2 elements, the
    reference the noisy one; a float32 MoE gradient 1.5x the reference's error; finding 17)."""
    traced = prep.traced
    return _rounding_only(prep.reference, traced, traced.graphs, expected, actual)


def sample(programs: Sequence[Program], count: int) -> list[Program]:
    """The first ``count`` programs the executor can run (see ``executable``)."""
    return [p for p in programs if executable(p)][:count]
