"""accumulate_gradient_sync: M micro-batches' gradient syncs become one per step.

Graph level (make_fx under a fake group of 4): micro-batch-tagged gradients, each reduce-scattered
and summed, the shape `compile_train_step` gives SimpleFSDP; the refusals. Numerics on 4 gloo
ranks: SimpleFSDP with 4 micro-batches against the plain eager accumulation loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.traceback import annotate, preserve_node_meta

import commfuse
from commfuse.core.meta import MICROBATCH_META_KEY
from commfuse.testing.fake_pg import fake_process_group
from commfuse.transforms.registry import DEFAULT_PIPELINE, DHELIX_PIPELINE

c10d = torch.ops._c10d_functional
RS = c10d.reduce_scatter_tensor.default
AR = c10d.all_reduce.default
WORLD = 4
M = 4
PASS = "accumulate_gradient_sync"


def _rs(g: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(g, op, WORLD, group))


def _trace(fn, *args):
    with preserve_node_meta():
        return make_fx(fn, tracing_mode="fake")(*args)


def _grad_sum(groups: list[str], *, op: str = "sum", extra_user: int | None = None, outer: bool = False):
    """Micro-batch i's gradient g_i (tagged i), reduce-scattered on groups[i]; the results summed
    untagged (autograd's accumulation). ``extra_user``: micro-batch whose result is also returned.
    ``outer``: g_i is an outer product of small inputs (the unsharded gradient dominates memory)."""

    def fn(w, *xs):
        outs = []
        for i, x in enumerate(xs):
            with annotate({MICROBATCH_META_KEY: i}):
                g = x[:, None] * w[None, :] if outer else x * w
                outs.append(_rs(g, op, groups[i]))
        total = outs[0]
        for o in outs[1:]:
            total = total + o
        return (total, outs[extra_user]) if extra_user is not None else (total,)

    shape = (64,) if outer else (64, 64)
    return _trace(fn, torch.randn(shape), *[torch.randn(shape) for _ in groups])


def _run(gm, **cfg):
    # Every rank holds micro-batches of the same shape here: the memory budget may count their
    # activations (by default it counts only what every rank shares, tests/test_same_decision.py).
    cfg.setdefault("uniform_batches", True)
    commfuse.optimize(gm, commfuse.Config(passes=[PASS], strict=True, **cfg))
    rep = commfuse.last_report(gm)
    (rec,) = [p for p in rep.passes if p.name == PASS]
    return rep, rec


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


def test_four_microbatch_reduce_scatters_become_one():
    with fake_process_group(WORLD) as pg:
        gm = _grad_sum([pg.group_name] * M, op="avg")
        assert _count(gm, RS) == M
        rep, rec = _run(gm)
    assert _count(gm, RS) == 1
    assert rec.counts["sums_rewritten"] == 1 and rec.counts["collectives_removed"] == M - 1
    # IR count: gradient-sync bytes per rank divided by M
    assert rep.input_kinds == {"reduce_scatter": M} and rep.output_kinds == {"reduce_scatter": 1}
    (d,) = rec.decisions
    assert d["kept"] and d["logged_bytes_before"] == M * d["logged_bytes_after"] == M * 64 * 64 * 4 // WORLD
    assert d["microbatches"] == [0, 1, 2, 3] and d["reduce_op"] == "avg"
    assert d["extra_live_bytes"] == 64 * 64 * 4 - 16 * 64 * 4
    assert d["peak_bytes_after"] <= d["peak_limit_bytes"] and d["time_after_us"] < d["time_before_us"]
    # one accumulator: each micro-batch's gradient is added as soon as it exists, the collective follows the last
    code = gm.code
    assert code.count("aten.add.Tensor") == M - 1
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    rs = next(n for n in order if n.target is RS)
    last_add = max((n for n in order if n.target is torch.ops.aten.add.Tensor), key=order.index)
    assert order.index(rs) == order.index(last_add) + 1
    assert rs.meta["val"].shape == (16, 64) and all("val" in n.meta for n in order)


def test_all_reduce_sum_becomes_one():
    def fn(w, *xs):
        outs = []
        for i, x in enumerate(xs):
            with annotate({MICROBATCH_META_KEY: i}):
                outs.append(c10d.wait_tensor(c10d.all_reduce(x * w, "sum", group)))
        return (outs[0] + outs[1] + outs[2],)

    with fake_process_group(WORLD) as pg:
        group = pg.group_name
        gm = _trace(fn, *[torch.randn(8, 8) for _ in range(4)])
        rep, rec = _run(gm)
    assert _count(gm, AR) == 1 and rec.counts["sums_rewritten"] == 1
    assert rec.decisions[0]["extra_live_bytes"] == 0  # the running reduced sum is as large anyway


def test_result_with_another_user_keeps_its_own_sync():
    with fake_process_group(WORLD) as pg:
        gm = _grad_sum([pg.group_name] * M, extra_user=1)
        _, rec = _run(gm)
    assert _count(gm, RS) == 2  # micro-batch 1's own reduce_scatter + one for 0, 2, 3
    assert rec.decisions[0]["microbatches"] == [0, 2, 3]
    assert any("other users than the sum" in r for r in rec.refusals), rec.refusals


def test_mixed_groups_are_decided_per_group():
    with fake_process_group(WORLD) as pg:
        other = dist.new_group(list(range(WORLD))).group_name
        gm = _grad_sum([other] + [pg.group_name] * 3)
        _, rec = _run(gm)
    assert _count(gm, RS) == 2  # the lone term on the other group stays; the three on WORLD merge
    assert rec.decisions[0]["group"] == pg.group_name and rec.decisions[0]["microbatches"] == [1, 2, 3]
    assert any("no other term of the same kind, group" in r for r in rec.refusals), rec.refusals


def test_nonlinear_reduce_op_and_untagged_terms_are_refused():
    with fake_process_group(WORLD) as pg:
        gm = _grad_sum([pg.group_name] * 2, op="max")
        _, rec = _run(gm)
        assert _count(gm, RS) == 2 and any("not linear" in r for r in rec.refusals), rec.refusals

        def untagged(a, b):
            return (_rs(a, "sum", pg.group_name) + _rs(b, "sum", pg.group_name),)

        gm = _trace(untagged, torch.randn(8, 8), torch.randn(8, 8))
        _, rec = _run(gm)
    assert _count(gm, RS) == 2 and any("without a micro-batch tag" in r for r in rec.refusals), rec.refusals


def test_over_the_memory_budget_is_refused_with_the_reason():
    with fake_process_group(WORLD) as pg:
        # the unsharded accumulator is the largest buffer of this graph: +3/4 of it breaks a 10% budget
        gm = _grad_sum([pg.group_name] * M, outer=True)
        _, rec = _run(gm)
        assert _count(gm, RS) == M and rec.counts["refused_over_budget"] == 1
        (d,) = rec.decisions
        assert not d["kept"] and d["reason"].startswith("memory budget")
        assert d["peak_bytes_after"] > d["peak_limit_bytes"]
        assert any("schedule_memory_budget=1.1" in r for r in rec.refusals), rec.refusals
        # the same graph with headroom for the accumulator is rewritten
        gm = _grad_sum([pg.group_name] * M, outer=True)
        _, rec = _run(gm, schedule_memory_headroom_bytes=1 << 20)
    assert _count(gm, RS) == 1 and rec.decisions[0]["kept"]


def test_in_the_default_pipelines_before_chimera():
    for pipe in (DEFAULT_PIPELINE, DHELIX_PIPELINE):
        assert pipe.index(PASS) < pipe.index("chimera")


@pytest.mark.slow(reason="compiles SimpleFSDP train steps with 4 micro-batches on 4 gloo ranks")
@pytest.mark.multirank
def test_simple_fsdp_four_microbatches_equal_the_eager_loop_on_4_ranks(rank_pool_4):
    import _jobs_accumulate_gradient_sync as jobs

    results = rank_pool_4.run(jobs.simple_fsdp_matches_loop, timeout=600)
    seen = results[0]
    assert all(r == seen for r in results)  # every rank took the same decisions
    assert seen["passes_failed"] == []
    assert seen["kept"] == [True] * 9, seen  # one sum per parameter, all within the memory budget
    assert all(g.startswith("kept") for g in seen["gate"]), seen
    assert seen["counts"]["collectives_removed"] == 9 * (M - 1)
    assert seen["input_kinds"]["reduce_scatter"] == 9 * M
    assert seen["joint_reduce_scatters"] == 9
