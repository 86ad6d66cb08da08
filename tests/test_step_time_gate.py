"""The step-time gate: a rewrite is kept only when the cost model predicts the graph is not slower."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel.topology import Topology
from commfuse.passes import GraphPass, PassResult, Stage, register_pass, unregister_pass
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.gate import judge
from commfuse.passmgr.pipeline import restore_graph, snapshot_graph
from commfuse.testing.fake_pg import fake_process_group

c10d = torch.ops._c10d_functional


def _one_all_reduce(group: str):
    def f(x, w):
        return torch.mm(c10d.wait_tensor(c10d.all_reduce(x, "sum", group)), w).relu()

    return f


def _two_half_all_reduces(group: str):
    # the same values with two collectives of half the size: one latency more, no byte less
    def f(x, w):
        a, b = x.chunk(2)
        a = c10d.wait_tensor(c10d.all_reduce(a, "sum", group))
        b = c10d.wait_tensor(c10d.all_reduce(b, "sum", group))
        return torch.mm(torch.cat([a, b]), w).relu()

    return f


def _traced(make):
    group = dist.distributed_c10d._get_default_group().group_name
    return make_fx(make(group), tracing_mode="fake")(torch.randn(64, 32), torch.randn(32, 16))


class _SplitInHalves(GraphPass):
    """Test pass: replaces the graph by the same program with the all_reduce cut in two."""

    name = "test_split_in_halves"
    stage = Stage.JOINT
    slower = None

    def run(self, ctx):
        restore_graph(ctx.gm.graph, snapshot_graph(type(self).slower.graph))
        return PassResult(changed=True, counts={"split": 1})


@pytest.fixture
def split_pass():
    register_pass(_SplitInHalves)
    try:
        with fake_process_group(2):
            _SplitInHalves.slower = _traced(_two_half_all_reduces)
            yield _traced(_one_all_reduce)
    finally:
        unregister_pass(_SplitInHalves.name)


def _collectives(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is c10d.all_reduce.default)


def test_a_rewrite_predicted_slower_is_reverted_and_the_report_says_why(split_pass):
    gm = split_pass
    commfuse.optimize(gm, commfuse.Config(passes=["test_split_in_halves"], step_time_gate=True))
    (record,) = commfuse.last_report(gm).passes
    assert _collectives(gm) == 1 and not record.changed
    assert record.counts == {"split": 1, "reverted_by_gate": 1}
    (verdict,) = [d for d in record.decisions if "gate" in d]
    assert verdict["gate"] == "reverted" and verdict["priced_with"] == "default:cpu-gloo-one-node"
    assert verdict["predicted_after_us"] > verdict["predicted_before_us"] > 0
    assert any(r.startswith("rewrite reverted: predicted") for r in record.refusals), record.refusals


def test_an_explicit_pass_list_is_not_gated_unless_asked(split_pass):
    gm = split_pass
    commfuse.optimize(gm, commfuse.Config(passes=["test_split_in_halves"]))
    (record,) = commfuse.last_report(gm).passes
    assert record.changed and _collectives(gm) == 2
    assert not any("gate" in d for d in record.decisions)
    assert commfuse.Config().gates_by_step_time and not commfuse.Config(passes=[]).gates_by_step_time
    assert commfuse.Config(passes=[], step_time_gate=True).gates_by_step_time


def test_the_gate_prices_with_the_topology_when_there_is_one(split_pass):
    gm = split_pass
    topo = Topology.preset("dgx-h100")
    commfuse.optimize(
        gm, commfuse.Config(passes=["test_split_in_halves"], step_time_gate=True, topology=topo)
    )
    (verdict,) = [d for d in commfuse.last_report(gm).passes[0].decisions if "gate" in d]
    assert verdict["priced_with"] == "dgx-h100" and verdict["gate"] == "reverted"


def test_equal_predictions_keep_the_rewrite(split_pass):
    gm = split_pass
    verdict = judge(PassContext(gm, commfuse.Config()), gm)
    assert verdict.kept and verdict.before_us == verdict.after_us


def test_gate_config_is_part_of_the_compile_cache_key():
    assert commfuse.Config().cache_key() != commfuse.Config(step_time_gate=False).cache_key()
    assert commfuse.Config(step_time_gate=None).cache_key() == commfuse.Config().cache_key()


def _chimera_verdict(family: str, sizes: dict, topology) -> tuple[dict, object]:
    from benchmarks.workloads import get_workload

    torch._dynamo.reset()  # earlier tests in this worker compiled the same model code
    with fake_process_group(2, rank=0):
        torch.manual_seed(0)
        w = get_workload(f"{family}:s")
        built = w.family.builder(2, 0, **{**w.params, **sizes})
        be = commfuse.backend(
            commfuse.Config(inner_compiler="eager", group_roles=built.roles, topology=topology)
        )
        built.loss(torch.compile(built.model, backend=be)(*built.inputs)).backward()
    joint = next(r for r in be.reports if r.graph == "joint")
    chimera = next(p for p in joint.passes if p.name == "chimera")
    (verdict,) = [d for d in chimera.decisions if "gate" in d]
    return verdict, joint


def test_tp_to_sp_motion_on_a_small_plain_tp_llama_is_reverted_as_slower():
    """Fewer bytes (224 -> 200 KiB per rank) but more, smaller collectives: latency-bound, slower."""
    verdict, joint = _chimera_verdict("llama_tp", {}, Topology.preset("dgx-h100"))
    assert verdict["gate"] == "reverted"
    assert verdict["predicted_after_us"] > verdict["predicted_before_us"]
    assert joint.analysis.total.wire_bytes == joint.input_wire_bytes == 229376


@pytest.mark.slow(
    reason="a MoE block wide enough for motion to pay (dim 1024, 4 x 1024 tokens): ~20 s of tracing"
)
def test_motion_around_a_wide_tp_ep_moe_block_is_kept_as_faster():
    verdict, joint = _chimera_verdict(
        "moe_tp_ep", {"dim": 1024, "ffn_dim": 2048, "seq": 1024, "batch": 4}, Topology.preset("dgx-h100")
    )
    assert verdict["gate"] == "kept"
    assert verdict["predicted_after_us"] < verdict["predicted_before_us"]
    assert joint.analysis.total.wire_bytes < joint.input_wire_bytes
