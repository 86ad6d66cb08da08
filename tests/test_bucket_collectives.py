"""bucket_collectives: the bucketed forms (FileCheck + bitwise on the reference interpreter),
the cap, overlap and memory refusals, SimpleFSDP graphs, and 4 gloo ranks against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import commfuse
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.ir.kinds import CollectiveKind
from commfuse.transforms.bucket_collectives import DEFAULT_CAP_BYTES, LATENCY_SHARE, latency_bound_cap
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_process_group

AG_OP = "_c10d_functional.all_gather_into_tensor.default"
RS_OP = "_c10d_functional.reduce_scatter_tensor.default"
AR_OP = "_c10d_functional.all_reduce.default"


def _ag(x, g, dim=0):
    return funcol.all_gather_tensor(x, dim, g)


def _rs(x, g, op="sum", dim=0):
    return funcol.reduce_scatter_tensor(x, op, dim, g)


def _trace(fn, shapes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(shapes)
    return make_fx(fn, tracing_mode="fake")(
        *[torch.randn(s).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    )


def _run(gm, **cfg):
    cfg.setdefault("bucket_max_memory_increase", 1.0)  # tiny graphs: the copies alone are > 5%
    commfuse.optimize(gm, commfuse.Config(passes=["bucket_collectives"], strict=True, **cfg))
    (rec,) = commfuse.last_report(gm).passes
    return rec


def _kinds(gm):
    out: dict[str, int] = {}
    for c in CollectiveIR(gm).collectives:
        out[c.kind.value] = out.get(c.kind.value, 0) + 1
    return out


def _bucketed(fn, shapes, world=4, dtypes=None, **cfg):
    """Trace, bucket, check bitwise equality on the reference; returns (gm, record)."""
    gm = _trace(fn, shapes, dtypes)
    before = copy.deepcopy(gm)
    rec = _run(gm, **cfg)
    check_equivalent(before, gm, world, exact=True)
    return gm, rec


# ---------------------------------------------------------------- the three forms
def test_all_gathers_become_one_with_rank_major_restacking():
    def f(a, b, c):
        g = dist.group.WORLD
        x, y, z = _ag(a, g), _ag(b, g, dim=1), _ag(c, g)  # y: dim-1 gather (DTensor's split/cat shuffle)
        return x * 2, y + 1, z.sum()

    with fake_process_group(4):
        gm, rec = _bucketed(f, [(2, 3), (3, 2), (5,)])
    assert _kinds(gm) == {"all_gather": 1}
    assert rec.counts["buckets"] == 1 and rec.counts["collectives_removed"] == 2
    # flat shards in, one gather, rows per rank split per member and re-stacked
    FileCheck().check("aten.cat").check_count(AG_OP, 1, exactly=True).check("wait_tensor").check(
        "view.default"
    ).check("split_with_sizes").run(gm.code)


def test_reduce_scatters_become_one_on_rank_major_chunks():
    def f(a, b, c):
        g = dist.group.WORLD
        x, y, z = _rs(a, g), _rs(b, g, dim=1), _rs(c, g)
        return x * 2, y, z.sum()

    with fake_process_group(4):
        gm, rec = _bucketed(f, [(8, 3), (2, 8), (4,)])
    assert _kinds(gm) == {"reduce_scatter": 1} and rec.counts["collectives_bucketed"] == 3
    FileCheck().check("aten.cat").check_count(RS_OP, 1, exactly=True).check("wait_tensor").check(
        "split_with_sizes"
    ).run(gm.code)


def test_all_reduces_become_one_flat():
    def f(a, b):
        g = dist.group.WORLD
        x, y = funcol.all_reduce(a, "avg", g), funcol.all_reduce(b, "avg", g)
        return x * 3, y

    with fake_process_group(4):
        gm, rec = _bucketed(f, [(3, 4), (7,)])
    assert _kinds(gm) == {"all_reduce": 1}
    FileCheck().check("aten.cat").check_count(AR_OP, 1, exactly=True).check("split_with_sizes").run(gm.code)
    (d, summary) = rec.decisions
    assert (
        d["kind"] == "all_reduce"
        and d["message_bytes"] == (12 + 7) * 4
        and d["cap_bytes"] == DEFAULT_CAP_BYTES
    )
    assert summary["simulated_makespan_us"][1] < summary["simulated_makespan_us"][0]


def test_a_bucket_reading_one_value_twice_does_not_leak_into_the_next():
    """Two members of one input, then two of different inputs with the same shapes: the
    spliced template (cached by shape) must read each member's own input in both buckets."""

    def f(a):
        g = dist.group.WORLD
        b = funcol.all_reduce(a, "sum", g) + funcol.all_reduce(a, "sum", g)
        return funcol.all_reduce(b * 2, "sum", g), funcol.all_reduce(b * 3, "sum", g)

    with fake_process_group(4):
        gm, rec = _bucketed(f, [(3, 4)])
    assert _kinds(gm) == {"all_reduce": 2} and rec.counts["buckets"] == 2


def test_bf16_and_different_kinds_interleaved():
    """Interleaved kinds form one bucket per kind; bf16 reductions stay bitwise on the reference."""

    def f(a, b, c, d):
        g = dist.group.WORLD
        return _ag(a, g), _rs(b, g), _ag(c, g), _rs(d, g)

    with fake_process_group(2):
        gm, rec = _bucketed(f, [(2, 4), (4, 4), (3, 4), (2, 2)], world=2, dtypes=[torch.bfloat16] * 4)
    assert _kinds(gm) == {"all_gather": 1, "reduce_scatter": 1} and rec.counts["buckets"] == 2


# ---------------------------------------------------------------- refusals
def _refused(fn, shapes, needle, dtypes=None, world=4, **cfg):
    with fake_process_group(world):
        gm = _trace(fn, shapes, dtypes)
        code = gm.code
        rec = _run(gm, **cfg)
    assert any(needle in r for r in rec.refusals), rec.refusals
    return gm, rec, code


def test_refuses_different_dtype_and_reduce_op():
    def f(a, b):
        g = dist.group.WORLD
        return _ag(a, g), _ag(b, g)

    gm, rec, code = _refused(f, [(2, 2), (2, 2)], "different dtype", dtypes=[torch.float32, torch.bfloat16])
    assert gm.code == code and not rec.changed

    def h(a, b):
        g = dist.group.WORLD
        return _rs(a, g, "sum"), _rs(b, g, "avg")

    _refused(h, [(4, 2), (4, 2)], "different reduce op")


def test_refuses_different_groups():
    with fake_process_group(4):
        g1, g2 = dist.new_group([0, 1, 2, 3]), dist.new_group([0, 1, 2, 3])
        gm = _trace(
            lambda a, b: (funcol.all_reduce(a, "sum", g1), funcol.all_reduce(b, "sum", g2)), [(4,), (4,)]
        )
        rec = _run(gm)
    assert not rec.changed and any("different group" in r for r in rec.refusals), rec.refusals


def test_refuses_in_place_all_reduce():
    def f(a, b):
        ops = torch.ops._c10d_functional
        a = ops.wait_tensor(ops.all_reduce_(a, "sum", dist.group.WORLD.group_name))
        return a * 2, funcol.all_reduce(b, "sum", dist.group.WORLD)

    _refused(f, [(4,), (4,)], "in place or coalesced")


def test_refuses_a_member_that_depends_on_another():
    def f(a):
        g = dist.group.WORLD
        x = _ag(a, g)
        return _ag(x * 2, g)

    gm, rec, _ = _refused(
        f, [(2, 2)], "dependency: its input depends on the result of all_gather_into_tensor"
    )
    assert _kinds(gm) == {"all_gather": 2}


def test_result_needed_early_is_not_merged_into_a_late_bucket():
    """x's result is needed by the matmul before z's input exists: issuing both where z is
    ready would make the matmul wait for data computed later."""

    def f(a, b, w):
        g = dist.group.WORLD
        y = _ag(a, g) @ w
        z = torch.relu(b)  # computed after the matmul, independent of it
        return y, _ag(z, g)

    gm, rec, _ = _refused(f, [(2, 8), (2, 8), (8, 8)], "is needed at")
    assert _kinds(gm) == {"all_gather": 2}


def test_refuses_a_bucket_that_exposes_hidden_communication():
    """A large gather hidden under matmuls is not delayed into the bucket of a gather whose
    input only exists after them: the simulator prices the merged one exposed."""

    def f(a, b, m):
        g = dist.group.WORLD
        x = _ag(a, g)
        c = m
        for _ in range(4):
            c = c @ m
        r = _ag(torch.relu(c[:8]) + b, g)
        return x.sum() + r.sum()

    topo = commfuse.Topology.preset("dgx-h100")
    _, rec, _ = _refused(
        f,
        [(1 << 20,), (8, 1024), (1024, 1024)],
        "would expose overlapped communication",
        world=8,
        topology=topo,
        bucket_cap_bytes=1 << 30,
    )
    assert not rec.changed


def test_memory_budget():
    def f(a, b, c):
        g = dist.group.WORLD
        return _ag(a, g) * 2, _ag(b, g) + 1, _ag(c, g).sum()

    gm, rec, _ = _refused(f, [(64,), (64,), (64,)], "memory budget", bucket_max_memory_increase=0.0)
    assert _kinds(gm) == {"all_gather": 3}


def test_graph_with_point_to_point_ops_is_left_alone():
    from _graphs import trace_all_kinds

    with fake_process_group(2):
        gm = trace_all_kinds()
        code = gm.code
        rec = _run(gm)
    assert gm.code == code and rec.refusals and "point-to-point" in rec.refusals[0]


# ---------------------------------------------------------------- the cap
def test_cap_is_respected():
    def f(a, b, c, d, e):
        g = dist.group.WORLD
        outs = [funcol.all_reduce(t, "sum", g) for t in (a, b, c, d, e)]
        return tuple(o * 2 for o in outs)

    with fake_process_group(4):
        gm, rec = _bucketed(f, [(64,)] * 5, bucket_cap_bytes=600)  # 256 B each: two fit, three do not
    buckets = [d for d in rec.decisions if "bucket" in d]
    assert [len(d["bucket"]) for d in buckets] == [2, 2] and _kinds(gm) == {"all_reduce": 3}
    assert all(d["message_bytes"] <= 600 and d["cap_bytes"] == 600 for d in buckets)
    assert all(d["closed_by_cap"] for d in buckets)


def test_cap_from_the_cost_model():
    """The cap is the message size at which latency is LATENCY_SHARE of the collective's time."""
    topo = commfuse.Topology.preset("dgx-h100", num_nodes=2)
    est = AnalyticCostModel(topo, backend="nccl")
    for kind, n in (
        (CollectiveKind.ALL_GATHER, 8),
        (CollectiveKind.REDUCE_SCATTER, 16),
        (CollectiveKind.ALL_REDUCE, 16),
    ):
        cap = latency_bound_cap(est, kind, n)
        t = lambda s, kind=kind, n=n: est.collectives.time(kind, s, n).time_us  # noqa: E731
        assert t(cap) >= t(1) / LATENCY_SHARE > t(int(cap * 0.99)), (kind, n, cap)
        assert 1 << 20 < cap < 1 << 30

    # the pass uses it when a topology is given
    def f(a, b):
        g = dist.group.WORLD
        return _ag(a, g), _ag(b, g)

    with fake_process_group(8):
        gm, rec = _bucketed(f, [(4, 4), (4, 4)], world=8, topology=commfuse.Topology.preset("dgx-h100"))
    est1 = AnalyticCostModel(commfuse.Topology.preset("dgx-h100"), backend="nccl")
    assert rec.decisions[0]["cap_bytes"] == latency_bound_cap(
        est1, CollectiveKind.ALL_GATHER, 8, tuple(range(8))
    )


# ---------------------------------------------------------------- SimpleFSDP graphs
@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
def test_simple_fsdp_graphs_have_fewer_collectives(mode):
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse.models import llama, simple_fsdp
    from commfuse.testing.graphs import capture_aot_graphs

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)
        m = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, mode)
        graphs = capture_aot_graphs(m, simple_fsdp.make_inputs(cfg, 8, 8, world_size=4).inputs)
        for kind in ("forward", "backward"):
            gm = graphs[kind]
            before = copy.deepcopy(gm)
            n0 = len(CollectiveIR(gm).collectives)
            # the same batch on every rank: the memory budget may count its activations (by default
            # it counts only what every rank shares, tests/test_same_decision.py)
            cfg = commfuse.Config(passes=["bucket_collectives"], strict=True, uniform_batches=True)
            commfuse.optimize(gm, cfg, graph_kind=kind)
            n1 = len(CollectiveIR(gm).collectives)
            if n0:
                assert n1 < n0, (mode, kind, n0, n1, commfuse.last_report(gm).passes[0].refusals)
                (*_, summary) = commfuse.last_report(gm).passes[0].decisions
                ms, peak = summary["simulated_makespan_us"], summary["simulated_peak_memory_bytes"]
                assert ms[1] <= ms[0] and peak[1] <= peak[0] * 1.05
            check_equivalent(before, gm, 4, exact=True)


# ---------------------------------------------------------------- 4 gloo ranks
@pytest.mark.slow(reason="trains on real gloo ranks against eager, forward and backward compiled per rank")
@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
def test_simple_fsdp_and_dp_match_eager_on_4_ranks(rank_pool_4, mode):
    import _jobs_bucket_collectives as jobs

    results = rank_pool_4.run(jobs.simple_fsdp_matches_eager, mode, timeout=300)
    got = results[0]
    assert all(r == got for r in results)  # every rank decided the same
    removed = {g: v["counts"].get("collectives_removed", 0) for g, v in got.items()}
    assert removed["backward"] > 0, got
    if mode == "fully_shard":
        assert removed["forward"] > 0 and got["forward"]["kinds"]["all_gather"] < 9, got
