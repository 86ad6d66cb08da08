"""commfuse's runtime lowering: plan, rewritten module, stream program, regions, recorder."""

from __future__ import annotations


import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import commfuse
from commfuse.core.errors import ConfigError
from commfuse.lowering import build_plan, lower_graph
from commfuse.core.meta import SETTING_META, STREAM_META
from commfuse.lowering.recorder import CollectiveRecord, Recorder, RegionRecord, record
from commfuse.lowering.regions import is_runtime_call, region_ids
from commfuse.lowering.streams import stream_program
from commfuse.testing.fake_pg import fake_process_group

from _graphs import prefetch_graph
from _jobs_lowering import (
    POOL_ALIAS,
    a_graph_that_fails_to_lower_falls_back,
    coalesced_avg_reduce_scatter_is_divided,
    lowered_matches_functional,
    recorder_sees_overlap,
    regions_fall_back_to_eager,
    synchronous_ops_leave_nothing_pending,
)


@pytest.fixture
def gm():
    with fake_process_group(8):
        yield prefetch_graph(64)


def _starts(g):
    return [n for n in g.graph.nodes if n.op == "call_function" and "all_gather_into_tensor" in str(n.target)]


def test_plan_follows_graph_order(gm):
    plan = build_plan(gm, "forward")
    assert [c.kind for c in plan.collectives] == ["all_gather"] * 3
    assert [c.start for c in plan.collectives] == [n.name for n in _starts(gm)]
    assert [c.index for c in plan.collectives] == [0, 1, 2]
    assert all(len(c.waits) == 1 and c.issue_group == c.group for c in plan.collectives)
    assert plan.collectives[0].logged_bytes == 8 * 64 * 4  # NCCL logs an all_gather by its send count
    assert plan.num_streams == 1 and not plan.events
    assert "3 collectives" in plan.describe()


def test_plan_routes_to_pool_group_only_when_registered(gm):
    _starts(gm)[1].meta[SETTING_META] = {
        "min_ctas": 2,
        "max_ctas": 2,
        "pool_group_alias": "commfuse.cta2-2.x",
    }
    plan = build_plan(gm, "forward", group_available=lambda name: True)
    assert [c.issue_group != c.group for c in plan.collectives] == [False, True, False]
    assert plan.collectives[1].issue_group == "commfuse.cta2-2.x"
    assert plan.collectives[1].setting["min_ctas"] == 2
    missing = build_plan(gm, "forward", group_available=lambda name: False)
    assert all(c.issue_group == c.group for c in missing.collectives)
    assert any("commfuse.cta2-2.x" in n and "not set up" in n for n in missing.notes)


def test_lowered_module_issues_in_plan_order_and_input_is_untouched(gm):
    before = gm.code
    lowered = lower_graph(gm, build_plan(gm, "forward"))
    code = lowered.module.code
    FileCheck().check("commfuse_issue_0").check("commfuse_wait").check("commfuse_issue_1").check(
        "commfuse_wait"
    ).check("commfuse_issue_2").check("commfuse_wait").run(code)
    assert "_c10d_functional" not in code
    assert gm.code == before


def test_stream_program_orders_events_and_keep_alives(gm):
    tanhs = [n for n in gm.graph.nodes if n.op == "call_function" and "tanh" in str(n.target)]
    tanhs[0].meta[STREAM_META] = 1  # the first tanh on a side stream
    plan = build_plan(gm, "forward")
    assert plan.node_streams == {tanhs[0].name: 1} and plan.num_streams == 2
    # the mm feeding it (default) -> tanh (side), and tanh (side) -> its consumer (default)
    assert [(e.src, e.dst) for e in plan.events] == [(0, 1), (1, 0)]
    prog = [p if isinstance(p, tuple) else p.name for p in stream_program(gm, plan)]
    i = prog.index(tanhs[0].name)
    producer = plan.events[0].producer
    assert prog.index(("fork",)) == sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    assert prog.index(("record", 0)) == prog.index(producer) + 1
    assert prog[i - 3 : i] == [("switch", 1), ("wait", 0), prog[i - 1]] and prog[i - 1][0] == "keep"
    assert prog[i + 1 : i + 3] == [("record", 1), ("switch", 0)]
    consumer = prog.index(plan.events[1].consumer)
    w = prog.index(("wait", 1))
    assert w < consumer and all(p[0] == "keep" for p in prog[w + 1 : consumer])
    assert prog[-2:] == [("join",), "output"]


def test_stream_meta_must_be_a_stream_index(gm):
    next(n for n in gm.graph.nodes if "tanh" in str(n.target)).meta[STREAM_META] = -1
    with pytest.raises(ValueError, match=STREAM_META):
        build_plan(gm, "forward")


def test_regions_cut_at_every_runtime_call(gm):
    lowered = lower_graph(gm, build_plan(gm, "forward"))
    ids = region_ids(lowered.module)
    nodes = [n for n in lowered.module.graph.nodes if n.name in ids]
    runtime = [n for n in nodes if is_runtime_call(n)]
    assert len(runtime) == 6  # three issues, three waits
    assert len({ids[n.name] for n in runtime}) == 6
    assert all(sum(1 for m in nodes if ids[m.name] == ids[n.name]) == 1 for n in runtime)
    assert [ids[n.name] for n in nodes] == sorted(ids[n.name] for n in nodes)


def commfuse_wait_stand_in(t):
    """Stands for a runtime call (its name is what cuts regions)."""
    return t


def _graph_with_a_region_sized_4s0():
    """x: (s0, 3) -> [region 1] y = x.repeat(4, 1) -> runtime call -> [region 2] y.view(-1) * 2:
    region 2's only input is sized 4*s0, which binds no symbol."""

    def f(x):
        y = x.repeat(4, 1).clone()
        return (y.view(-1) * 2,)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5, 3))
    clone = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default)
    clone.target = commfuse_wait_stand_in
    gm.recompile()
    return gm


def test_a_region_is_given_the_input_that_binds_its_symbols():
    from torch.fx.passes.split_module import split_module

    from commfuse.lowering.regions import bind_region_symbols, commfuse_bind_symbols

    gm = _graph_with_a_region_sized_4s0()
    ids = region_ids(gm)
    assert bind_region_symbols(gm, ids) == 1
    anchors = [n for n in gm.graph.nodes if n.target is commfuse_bind_symbols]
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert len(anchors) == 1 and anchors[0].args == (x,)
    assert ids[anchors[0].name] == max(ids.values())  # the last region, the one after the wait
    split = split_module(
        gm, gm, lambda n: ids[n.name], keep_original_order=True, keep_original_node_name=True
    )
    last = getattr(split, f"submod_{max(ids.values())}")
    assert [n.name for n in last.graph.nodes if n.op == "placeholder"] == ["x_1", "clone"]


def test_a_graph_returning_a_module_attribute_as_it_is_is_cut_into_regions():
    """AOTAutograd may return an opaque object (a process group) straight from a module
    attribute; split_module cannot, so the cut holds it out and puts it back."""
    from commfuse.lowering.regions import compile_compute_regions
    from commfuse.lowering.runtime import LoweredGraph

    gm = _graph_with_a_region_sized_4s0()
    gm.opaque = torch.nn.Parameter(torch.ones(1), requires_grad=False)  # stands for an opaque object
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        attr = gm.graph.get_attr("opaque")
    out.args = ((*out.args[0], attr),)
    gm.recompile()
    compiled = []

    def compile_region(sub, inputs):
        compiled.append(sub)
        return lambda args: list(sub(*args))

    lowered = compile_compute_regions(LoweredGraph(gm, None, None), compile_region)
    x = torch.randn(5, 3)
    y, opaque = lowered.module(x)
    assert opaque is gm.opaque and len(compiled) == 2
    torch.testing.assert_close(y, x.repeat(4, 1).view(-1) * 2)


def test_a_region_whose_inputs_bind_its_symbols_gets_nothing():
    from commfuse.lowering.regions import bind_region_symbols

    def f(x):
        return (x.clone() * 2,)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5, 3))
    assert bind_region_symbols(gm, region_ids(gm)) == 0


@pytest.mark.multirank
@pytest.mark.slow(reason="2 gloo ranks; the inductor case compiles forward and backward cold")
@pytest.mark.parametrize(
    "inner_compiler, instead",
    [("eager", "runs op by op"), ("inductor", "is compiled by Inductor as a whole")],
)
def test_a_graph_that_fails_to_lower_falls_back_with_one_warning(rank_pool_2, inner_compiler, instead):
    r0, r1 = rank_pool_2.run(a_graph_that_fails_to_lower_falls_back, inner_compiler, timeout=300)
    # decided from the graph both ranks share, so both fall back alike and rank 0 says so for both
    assert sorted(w.split(" graph")[0] for w in r0["warnings"]) == [
        "commfuse: the backward",
        "commfuse: the forward",
    ]
    assert all(instead in w and "planted: lowering failed" in w for w in r0["warnings"]), r0["warnings"]
    assert r1["warnings"] == []


def test_a_region_input_in_another_layout_is_copied_into_the_one_compiled_for():
    from commfuse.lowering.regions import compile_guarded

    def f(a, b):
        return (a + 1, b.add_(1))

    gm = make_fx(f)(torch.zeros(4, 6), torch.zeros(4, 6))
    seen = []

    def strict_compiler(sub, inputs):
        def run(args):
            seen.append([tuple(a.stride()) for a in args])
            assert args[0].stride() == (6, 1), "compiled for (6, 1)"
            return list(sub(*args))

        return run

    region = compile_guarded(strict_compiler, gm, [torch.zeros(4, 6), torch.zeros(4, 6)], "region r")
    a = torch.arange(24.0).reshape(6, 4).t()  # the values of a (4, 6) tensor, strides (1, 4)
    b = torch.zeros(6, 4).t()  # written in place by the region: never copied
    out = region([a, b])
    assert seen == [[(6, 1), (1, 4)]] and region.compiled is not None
    torch.testing.assert_close(out[0], a + 1)
    assert bool((b == 1).all())


def _rec(issued, done):
    return CollectiveRecord(0, "ag", "g#0", "all_gather", "0", "0", 8, 8, 64, issued, done_ns=done)


def test_recorder_overlap_is_measured_against_compute_regions():
    r = Recorder(rank=3)
    r.collectives.append(_rec(1000, 5000))  # in flight 4 us
    r.regions += [
        RegionRecord("g#0", 0, 2000),
        RegionRecord("g#0", 4000, 8000),
        RegionRecord("g#0", 2000, 4000, kind="wait"),
    ]
    s = r.summary()
    assert s["inflight_us"] == 4.0 and s["overlapped_us"] == 2.0 and s["overlap_ratio"] == 0.5
    assert s["blocked_in_wait_us"] == 2.0 and s["by_kind"]["all_gather"]["count"] == 1
    trace = r.chrome_trace()["traceEvents"]
    comm = [e for e in trace if e.get("cat", "").startswith("comm")]
    assert len(comm) == 1 and comm[0]["pid"] == 3 and comm[0]["dur"] == 4.0 and comm[0]["tid"] == 1
    assert comm[0]["args"]["end_from"] == "work"


def test_recorder_region_bookkeeping():
    r = Recorder()
    r.graph_begin("g")
    t = r.call_begin("g")
    r.call_end("g")
    r.wait(None, "g", t)
    r.graph_end("g")
    kinds = [x.kind for x in r.regions]
    assert kinds.count("wait") == 1 and kinds.count("compute") >= 1


def test_record_rejects_nesting_and_unwritable_dirs(tmp_path):
    with record():
        with pytest.raises(RuntimeError, match="already active"):
            with record():
                pass
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="record dir"):
        with record(blocker / "sub"):
            pass


def test_record_writes_one_trace_per_rank(tmp_path):
    with record(tmp_path) as rec:
        rec.collectives.append(_rec(10, 20))
    assert (tmp_path / "rank0.json").exists()


@pytest.mark.multirank
def test_a_region_that_fails_to_compile_or_on_its_first_run_runs_eagerly(rank_pool_2):
    for r in rank_pool_2.run(regions_fall_back_to_eager, timeout=120):
        assert r["regions_compiled"] == 2, r  # the compute before the all_reduce's issue and after its wait
        assert len(r["warnings"]) == 2, r["warnings"]  # one per failing region, not one per call
        did_not_compile, failed_first_run = r["warnings"]
        assert "did not compile" in did_not_compile and "of the forward graph" in did_not_compile
        assert "RuntimeError: planted: this region does not compile" in did_not_compile
        assert "failed on its first run" in failed_first_run and "stride" in failed_first_run
        assert "compute region submod_" in did_not_compile and "compute region submod_" in failed_first_run


def test_a_graph_without_collectives_that_does_not_compile_runs_eagerly():
    from commfuse.lowering import lower_runtime

    gm = make_fx(lambda x: (torch.tanh(x) * 2,))(torch.ones(3))

    def broken(sub, inputs):
        raise RuntimeError("planted")

    with pytest.warns(
        RuntimeWarning, match="the forward graph .one compute region, no collective. did not compile"
    ):
        fn = lower_runtime(gm, "forward", compile_regions=broken, example_inputs=[torch.ones(3)])
    (out,) = fn([torch.ones(3)])
    assert torch.equal(out, torch.tanh(torch.ones(3)) * 2)


def test_lowering_inductor_needs_inductor():
    with pytest.raises(ValueError, match="lowering"):
        commfuse.Config(lowering="inductor", inner_compiler="eager")


@pytest.mark.multirank
def test_every_issuer_matches_functional_collectives(rank_pool_4):
    for r in rank_pool_4.run(lowered_matches_functional, timeout=120):
        assert r["issue_groups"][0] == POOL_ALIAS and len(set(r["issue_groups"][1:])) == 1
        assert r["recorded"][0] == ("all_reduce", POOL_ALIAS)
        assert len(r["recorded"]) == len(r["issue_groups"]) and r["completed"]


@pytest.mark.multirank
def test_every_output_of_a_coalesced_avg_reduce_scatter_is_divided(rank_pool_4):
    """gloo has no AVG: the runtime sums and divides each output after its wait. The wait of
    the second output must not wait the collective's works again (gloo's reduce-scatter work
    re-copies its sum into the output on every wait(), undoing the first output's division).
    Eager compute: the cause is in the runtime, not in the regions (the fuzz corpus's executor
    entry runs the same with Inductor regions)."""
    for r in rank_pool_4.run(coalesced_avg_reduce_scatter_is_divided, False, timeout=300):
        assert r["waits"] == 2
        assert r["ratios"] == [[pytest.approx(1.0, rel=1e-5)] * 2] * 2


@pytest.mark.multirank
def test_synchronous_boundary_op_is_not_kept_pending(rank_pool_2):
    """The autograd variants of commfuse's boundary ops wait inside the op (no wait node):
    the runtime must not keep their outputs in its pending table step after step."""
    for r in rank_pool_2.run(synchronous_ops_leave_nothing_pending, timeout=120):
        assert r["pending"] == 0
        assert r["out"] == r["eager"]


@pytest.mark.multirank
def test_recorder_shows_collective_in_flight_during_compute(rank_pool_2):
    for r in rank_pool_2.run(recorder_sees_overlap, timeout=120):
        assert r["kind"] == "all_gather"
        assert r["compute_regions_during"] >= 1
        assert r["summary"]["overlapped_us"] > 0, r["summary"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA stream path needs a GPU")
def test_cuda_side_stream_runs_with_events(tmp_path):
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    import _graphs

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        args = [torch.randn(64, 64, device="cuda")] + [torch.randn(64, 64, device="cuda") for _ in range(3)]
        gm = make_fx(_graphs.prefetch_fn)(*args)
        for n in gm.graph.nodes:
            if "tanh" in str(n.target):
                n.meta[STREAM_META] = 1
        plan = build_plan(gm, "forward")
        lowered = lower_graph(gm, plan)
        assert "commfuse_stream_switch" in lowered.module.code
        with record(tmp_path) as rec:
            got = lowered(*args)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, gm(*args))
        assert len(rec.collectives) == 3
    finally:
        dist.destroy_process_group()
