"""``commfuse.optimize`` on any FX graph: make_fx traces in every tracing mode, AOTAutograd graphs,
graphs without values.

A real-mode ``make_fx`` trace records each value as a fake tensor of a fake mode of its own;
the passes that splice new nodes then mixed modes and were undone. ``optimize`` propagates the
values again in one mode first (``commfuse.ir.fake_values``), so a real-mode trace is rewritten
as its fake-mode trace is: here a DTensor TP+SP training step (tests/_jobs_optimize_any_graph.py)
on a fake process group, and on 2 gloo ranks against eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.core.torch_private import fake_tensor_mode_of_value
from commfuse.ir.fake_values import FakeValuesError, ensure_fake_values, why_propagate
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import capture_aot_graphs

import _jobs_optimize_any_graph as jobs
from _graphs import SPBlock, parallelize_sp

WORLD = 2


def _modes(gm) -> set[int]:
    return {
        id(fake_tensor_mode_of_value(v))
        for n in gm.graph.nodes
        for v in torch.utils._pytree.tree_leaves(n.meta.get("val"))
        if isinstance(v, torch.Tensor)
    }


def _optimized(gm, **cfg):
    """``gm`` through the default pipeline, strict (a pass error raises); the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commfuse.optimize(gm, commfuse.Config(strict=True, **cfg))
    return [str(w.message) for w in caught if "commfuse" in str(w.message)]


@pytest.fixture(scope="module")
def sp_traces():
    """The TP+SP step traced in each make_fx mode, before and after the default pipeline."""
    out = {}
    with fake_process_group(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        step, weights = jobs.sp_step(mesh)
        args = [jobs.local_input(0, WORLD), *weights]
        for mode in ("real", "fake", "symbolic"):
            gm = jobs.trace(step, args, mode)
            why, modes = why_propagate(gm), len(_modes(gm))
            warned = _optimized(gm)
            out[mode] = {
                "gm": gm,
                "why": why,
                "modes_before": modes,
                "warnings": warned,
                "after": jobs.collectives(gm),
                "passes": jobs.passes(gm),
            }
    return out


@pytest.mark.slow(
    reason="traces a DTensor training step in three make_fx modes and runs the default pipeline on each"
)
def test_real_mode_trace_holds_values_of_many_fake_modes_and_optimize_puts_them_in_one(sp_traces):
    real = sp_traces["real"]
    assert real["modes_before"] > 1 and "fake modes" in real["why"], real["why"]
    assert len(_modes(real["gm"])) == 1
    assert any("propagated" in n for n in commfuse.last_report(real["gm"]).notes)
    for mode in ("fake", "symbolic"):  # one mode already: left alone
        assert sp_traces[mode]["why"] is None and sp_traces[mode]["modes_before"] == 1
        assert commfuse.last_report(sp_traces[mode]["gm"]).notes == []


@pytest.mark.slow(
    reason="traces a DTensor training step in three make_fx modes and runs the default pipeline on each"
)
def test_real_mode_trace_is_rewritten_as_the_fake_mode_trace(sp_traces):
    real, fake = sp_traces["real"], sp_traces["fake"]
    assert real["warnings"] == [] and fake["warnings"] == []
    assert real["passes"] == fake["passes"]
    assert real["after"] == fake["after"]
    changed = {name for name, did, _, _ in fake["passes"] if did}
    # the passes that splice new nodes (and failed on the real-mode trace) rewrite it
    assert {"bucket_collectives", "gloo_reduce_scatter"} <= changed, fake["passes"]
    kinds = [k for k, _, _ in real["after"]]
    assert "reduce_scatter" not in kinds and kinds.count("all_to_all") == 2, kinds


@pytest.mark.slow(
    reason="traces a DTensor training step in three make_fx modes and runs the default pipeline on each"
)
def test_symbolic_trace_is_optimized_without_errors(sp_traces):
    sym, fake = sp_traces["symbolic"], sp_traces["fake"]
    assert sym["warnings"] == [] and all(err is None for *_, err in sym["passes"]), sym["passes"]
    assert [p[0] for p in sym["passes"]] == [p[0] for p in fake["passes"]]
    # what does not price or size collectives decides as on static shapes. schedule_overlap prices:
    # the mesh has no dim names, so its group's SP role is only inferred and its ranks may hold
    # different batches (docs/architecture.md "The rule"); what it may price then comes out
    # differently on the symbolic trace (rank-invariant size hints) than on the static one, and so
    # may its order (1 collective raised on the static trace, 0 on the symbolic one, 2026-11-29;
    # ranks that mix static and symbolic graphs are what the agreement net is for).
    by_name = {p[0]: p for p in sym["passes"]}
    fake_by_name = {p[0]: p for p in fake["passes"]}
    assert by_name["chimera"] == fake_by_name["chimera"]
    refusals = {p.name: p.refusals for p in commfuse.last_report(sym["gm"]).passes}
    assert any("symbolic" in r for r in refusals["bucket_collectives"]), refusals
    assert any("not static" in r for r in refusals["gloo_reduce_scatter"]), refusals


@pytest.mark.slow(reason="captures AOTAutograd graphs through torch.compile")
def test_aot_autograd_graphs_are_optimized_in_their_own_fake_mode():
    with fake_process_group(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        graphs = capture_aot_graphs(
            parallelize_sp(SPBlock(), mesh), torch.randn(2, 4, 16, requires_grad=True)
        )
        for kind in ("joint", "forward", "backward"):
            gm = graphs[kind]
            assert why_propagate(gm) is None
            mode = _modes(gm)
            assert _optimized(gm) == [], kind
            assert commfuse.last_report(gm).notes == [] and _modes(gm) == mode, kind
            assert all(p.error is None for p in commfuse.last_report(gm).passes), kind


def _two_scatters(x, y):
    a = funcol.reduce_scatter_single(torch.tanh(x), "sum", 0, dist.group.WORLD)
    b = funcol.reduce_scatter_single(y * 2, "sum", 0, dist.group.WORLD)
    return a + 1, b - 1


def test_real_mode_trace_of_collectives_is_rewritten_as_its_fake_mode_trace():
    """The inner loop's case: independent scatters that bucket_collectives merges and
    gloo_reduce_scatter lowers, both splicing traced templates into the graph."""
    got = {}
    with fake_process_group(WORLD):
        for mode in ("real", "fake"):
            gm = make_fx(_two_scatters, tracing_mode=mode)(torch.randn(8, 4), torch.randn(8, 4))
            # tiny graphs: the bucket's copies alone are more than the default 5% of peak memory
            assert (
                _optimized(
                    gm, passes=["bucket_collectives", "gloo_reduce_scatter"], bucket_max_memory_increase=1.0
                )
                == []
            )
            got[mode] = (jobs.passes(gm), jobs.collectives(gm))
    assert got["real"] == got["fake"]
    assert all(changed for _, changed, _, _ in got["real"][0]), got["real"]


def _data_dependent(x, y):
    return x[x > 0].sum() + y.nonzero().shape[0], torch.tensor([1.0, 2.0]) * y[:2]


def test_real_mode_values_with_data_dependent_sizes_and_constants_go_into_one_mode():
    """Sizes read from data become unbacked symbols of the new mode's shape environment; a
    tensor constant (``get_attr``, a real tensor) enters it as a fake tensor."""
    gm = make_fx(_data_dependent, tracing_mode="real")(torch.randn(6), torch.randn(6))
    assert "fake modes" in ensure_fake_values(gm)
    assert len(_modes(gm)) == 1 and why_propagate(gm) is None
    index = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor)
    assert not isinstance(index.meta["val"].shape[0], int)  # unbacked
    assert ensure_fake_values(gm) is None  # nothing left to do


def test_a_node_without_a_value_in_a_fake_mode_graph_is_filled_in_that_mode():
    gm = make_fx(_data_dependent, tracing_mode="fake")(torch.randn(6), torch.randn(6))
    (mode,) = _modes(gm)
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    del mul.meta["val"]
    assert ensure_fake_values(gm) == "1 node(s) without a value"
    assert _modes(gm) == {mode} and tuple(mul.meta["val"].shape) == (2,)


def _all_reduce_twice(x):
    y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    return funcol.all_reduce(y + 1, "sum", dist.group.WORLD)


def test_graph_without_values_is_propagated_from_example_inputs():
    with fake_process_group(WORLD):
        gm = make_fx(_all_reduce_twice, tracing_mode="fake")(torch.randn(4, 8))
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
            n.meta.pop("tensor_meta", None)
        assert "without a value" in why_propagate(gm)
        with pytest.raises(FakeValuesError, match="has no value"):
            ensure_fake_values(gm)
        assert all("val" not in n.meta for n in gm.graph.nodes)  # left as it was
        with pytest.raises(ValueError, match="has no value"):  # strict: raised
            commfuse.optimize(gm, commfuse.Config(passes=["bucket_collectives"], strict=True))
        commfuse.optimize(
            gm,
            commfuse.Config(passes=["bucket_collectives"], strict=True),
            example_inputs=[torch.randn(4, 8)],
        )
        assert len(_modes(gm)) == 1
        assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


def test_graph_whose_values_cannot_be_propagated_is_optimized_as_it_is_with_a_warning():
    with fake_process_group(WORLD):
        gm = make_fx(_all_reduce_twice, tracing_mode="fake")(torch.randn(4, 8))
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
            n.meta.pop("tensor_meta", None)
        with pytest.warns(RuntimeWarning, match="has no value"):
            commfuse.optimize(gm, commfuse.Config(passes=["sink_waits"]))
        assert any("not propagated" in n for n in commfuse.last_report(gm).notes)


@pytest.mark.slow(reason="real gloo ranks")
@pytest.mark.multirank
def test_real_mode_trace_of_a_tp_sp_step_optimizes_like_fake_and_equals_eager_on_gloo(rank_pool_2):
    """2 gloo ranks: the step's real-mode and fake-mode make_fx traces through the default
    pipeline (strict), run, equal eager (outputs and gradients, asserted in the job); both
    traces are rewritten alike, every rank alike."""
    results = rank_pool_2.run(jobs.real_trace_optimizes_like_fake_and_matches_eager, timeout=300)
    for rank, r in enumerate(results):
        assert r["real"]["before"] == r["fake"]["before"], rank
        assert r["real"]["passes"] == r["fake"]["passes"], (rank, r["real"]["passes"], r["fake"]["passes"])
        assert r["real"]["after"] == r["fake"]["after"], rank
        assert r["real"]["after"] != r["real"]["before"]
        assert any("propagated" in n for n in r["real"]["notes"]) and r["fake"]["notes"] == []
    assert results[0]["real"]["after"] == results[1]["real"]["after"]
