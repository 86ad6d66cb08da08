"""Hostile inputs: dynamic shapes, control flow, mutation, checkpointing; nothing stops training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse
from commfuse.testing.fake_pg import fake_process_group
from commfuse.testing.graphs import capture_aot_graphs

from _multirank_jobs import checkpointed_model_matches_eager, inplace_all_reduce_matches_eager


def test_collectives_inside_control_flow_are_reported_and_left_alone():
    def f(x, p):
        def true_fn(x):
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)

        def false_fn(x):
            return x.clone()

        return torch.cond(p, true_fn, false_fn, (x,))

    with fake_process_group(2):
        g = capture_aot_graphs(f, torch.randn(4), torch.tensor(True), backward=False)
        gm = g.inference
        before = gm.code
        commfuse.optimize(gm, commfuse.Config(strict=True))
    report = commfuse.last_report(gm)
    assert report.analysis.hidden_collectives == {"cond": 1}
    assert any("inside control flow" in n for n in report.notes)
    assert gm.code == before


def test_dynamic_shapes_compile_once_without_recompile_loop():
    def f(x):
        return funcol.all_gather_tensor(torch.tanh(x), 0, dist.group.WORLD).sum(0)

    with fake_process_group(2):
        torch._dynamo.reset()
        be = commfuse.backend(inner_compiler="eager", strict=True)
        cf = torch.compile(f, backend=be)
        x = torch.randn(4, 8)
        torch._dynamo.mark_dynamic(x, 0)
        for n in (4, 6, 10):
            y = torch.randn(n, 8)
            torch._dynamo.mark_dynamic(y, 0)
            assert cf(y).shape == (8,)
    graphs = [r.graph for r in be.reports]
    assert graphs == ["inference"], graphs  # one compile for all three sizes
    (c,) = be.reports[0].analysis.collectives
    assert isinstance(c.input_shapes[0][0], str)  # the gathered size stayed symbolic


def test_bad_user_inputs_name_the_field():
    with pytest.raises(ValueError, match="inner_compiler"):
        commfuse.Config(inner_compiler="tvm")
    with pytest.raises(ValueError, match="agreement_timeout_s"):
        commfuse.Config(agreement_timeout_s=0)
    with pytest.raises(ValueError, match="group_roles"):
        commfuse.Config(group_roles={"0": "zp"})
    with pytest.raises(
        commfuse.ConfigError, match="mesh: commfuse.setup needs a DeviceMesh with mesh_dim_names"
    ):
        with fake_process_group(2):
            from torch.distributed.device_mesh import init_device_mesh

            commfuse.setup(mesh=init_device_mesh("cpu", (2,)))


@pytest.mark.multirank
@pytest.mark.parametrize("selective", [False, True])
def test_activation_checkpointing_around_collectives(rank_pool_2, selective):
    assert rank_pool_2.run(checkpointed_model_matches_eager, selective, timeout=240) == [True, True]


@pytest.mark.multirank
def test_inplace_collective_in_user_code(rank_pool_2):
    a, b = rank_pool_2.run(inplace_all_reduce_matches_eager, timeout=120)
    # The all-reduced part is the same on both ranks; x.sum() differs by 12 (x = arange + rank).
    assert all(vb - va == 12.0 for ra, rb in zip(a, b, strict=True) for va, vb in zip(ra, rb, strict=True))
