"""Layer level (Centauri Eq. 1): backward layers, their parts, T1/T2, and the order schedule_overlap keeps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel import AnalyticCostModel, Topology
from commfuse.costmodel.simulator import Simulator
from commfuse.ir.graph_ir import CollectiveIR, IRBuildOptions
from commfuse.schedule.layer_level import LayerCosts, backward_layers, chain_of, layer_name, preferred_order
from commfuse.schedule.list_scheduler import build_problem
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_mesh
from commfuse.testing.graphs import capture_aot_graphs

DGX = Topology.preset("dgx-h100", num_nodes=1)
S, H, F = 8192, 2048, 512  # TP reduction of dx (64 MiB) costs about as much as the weight gradient


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise reference comparisons (see test_schedule_overlap)
    yield
    torch.set_num_threads(n)


def test_eq1_formulas_and_choice():
    c = LayerCosts(w_ag=1, act_ag=2, g_act=10, act_rs=3, g_w=8, g_w_rs=20, others=4)
    assert c.t1 == 1 + max(10, 2) + max(8, 3) + max(20, 4)
    assert c.t2 == 2 + max(8, 1) + max(10, 20) + 3 + 4
    assert c.choice == "weight_first"  # FSDP-like: the weight-gradient reduction dominates
    tp = LayerCosts(act_ag=5, g_act=10, act_rs=5, g_w=10)
    assert tp.t1 < tp.t2 and tp.choice == "activation_first"  # plain TP: Eq. 1 says T1
    assert LayerCosts().choice == "activation_first"  # ties keep the usual order


def _weight_first_backward(dp, tp):
    """One TP+FSDP linear layer's backward written weight-gradient first."""

    def bwd(x_full, w_shard, tangents_1):
        dy = funcol.all_gather_tensor(tangents_1, 0, tp)
        w = funcol.all_gather_tensor(w_shard, 0, dp)
        dw = dy.t() @ x_full
        dw_s = funcol.reduce_scatter_tensor(dw, "sum", 0, dp)
        dx = torch.tanh(dy) @ w
        dx_s = funcol.reduce_scatter_tensor(dx, "sum", 0, tp)
        return dx_s, dw_s

    return make_fx(bwd, tracing_mode="fake")(
        torch.randn(S, H), torch.randn(F // 2, H), torch.randn(S // 4, F)
    )


@pytest.fixture
def tp_fsdp():
    with fake_mesh(8, (2, 4), ("dp", "tp")) as mesh:
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        yield _weight_first_backward(dp, tp), {dp.group_name: "fsdp", tp.group_name: "tp"}


def _reference_groups(roles):
    by_role = {role: name for name, role in roles.items()}
    return {by_role["tp"]: [[0, 1, 2, 3], [4, 5, 6, 7]], by_role["fsdp"]: [[0, 4], [1, 5], [2, 6], [3, 7]]}


def _problem(gm, roles):
    ir = CollectiveIR(gm, IRBuildOptions(group_roles=roles))
    sim = Simulator(gm, AnalyticCostModel(DGX, backend="nccl"), ir=ir)
    return build_problem(gm, sim, ir, chain=()), ir


def test_parts_of_a_tp_fsdp_layer(tp_fsdp):
    gm, roles = tp_fsdp
    free, ir = _problem(gm, roles)
    (layer,) = backward_layers(free, ir)  # make_fx of a function: one layer
    named = {free.nodes[i].name: part for i, part in layer.part.items()}
    assert named["all_gather_into_tensor"] == "act_AG" and named["all_gather_into_tensor_1"] == "W_AG"
    assert named["reduce_scatter_tensor"] == "G_w_RS" and named["reduce_scatter_tensor_1"] == "act_RS"
    assert named["mm"] == "G_w" and named["mm_1"] == "G_act" and named["tanh"] == "G_act"
    assert layer.costs.t1 < layer.costs.t2 and layer.choice == "activation_first"
    order = preferred_order(free, [layer])
    names = [free.nodes[i].name for i in chain_of(free, order)]
    # activation first: the TP reduction of dx is issued before the weight-gradient reduction
    assert names == [
        "all_gather_into_tensor",
        "all_gather_into_tensor_1",
        "reduce_scatter_tensor_1",
        "reduce_scatter_tensor",
    ]
    pos = {i: k for k, i in enumerate(order)}
    assert all(pos[q] < pos[i] for i in range(free.size) for q in free.preds[i])  # topological


@pytest.mark.slow(reason="schedules a backward graph with and without the layer-level order")
def test_schedule_overlap_keeps_the_layer_order_when_it_is_faster(tp_fsdp):
    gm, roles = tp_fsdp
    before = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    # Activation first keeps x_full and dx live together (+80 MiB): allow it here. The same batch
    # on every rank: the layer order's gain is compute it overlaps, which the FSDP group's ranks
    # share only then (by default only what every rank shares is priced, tests/test_same_decision.py)
    commfuse.optimize(
        gm,
        commfuse.Config(
            passes=["schedule_overlap"],
            topology=DGX,
            strict=True,
            group_roles=roles,
            schedule_memory_budget=2.0,
            uniform_batches=True,
        ),
        graph_kind="backward",
    )
    rec = commfuse.last_report(gm).passes[0]
    d = rec.decisions[0]
    assert d["layer_level"]["applied"] and d["layer_level"]["layers"][0]["choice"] == "activation_first"
    assert d["kept"].startswith("layer:"), d["kept"]
    assert d["output"]["makespan_us"] < min(v["makespan_us"] for v in d["greedy"] if ":" not in v["priority"])
    assert rec.counts["collectives_reordered"] == 2
    rs = [n.name for n in gm.graph.nodes if "reduce_scatter" in str(n.target)]
    assert rs == ["reduce_scatter_tensor_1", "reduce_scatter_tensor"]
    check_equivalent(before, gm, 8, exact=True, groups=_reference_groups(roles))


def test_memory_budget_rejects_the_layer_order(tp_fsdp):
    gm, roles = tp_fsdp
    # the same batch on every rank: the budget counts its activations (by default only what every
    # rank shares, tests/test_same_decision.py)
    cfg = commfuse.Config(
        passes=["schedule_overlap"], topology=DGX, strict=True, group_roles=roles, uniform_batches=True
    )
    commfuse.optimize(gm, cfg, graph_kind="backward")
    d = commfuse.last_report(gm).passes[0].decisions[0]
    layer_variants = [v for v in d["greedy"] if v["priority"].startswith("layer:")]
    assert layer_variants and not any(v["within_limits"] for v in layer_variants)
    assert not d["kept"].startswith("layer:")


def test_switched_off_and_forward_graphs_have_no_layer_level(tp_fsdp):
    gm, roles = tp_fsdp
    commfuse.optimize(
        gm,
        commfuse.Config(
            passes=["schedule_overlap"],
            topology=DGX,
            strict=True,
            group_roles=roles,
            schedule_layer_level=False,
        ),
        graph_kind="backward",
    )
    d = commfuse.last_report(gm).passes[0].decisions[0]
    assert "layer_level" not in d and not any(v["priority"].startswith("layer:") for v in d["greedy"])


@pytest.fixture(scope="module")
def model_graphs():
    from commfuse.models import llama, simple_fsdp

    out = {}
    cfg = llama.LlamaConfig(vocab=None, n_layers=2, dim=512, n_heads=8, ffn_dim=2048)
    with fake_mesh(8) as mesh:
        model = simple_fsdp.data_parallel(llama.build_llama(cfg, seed=0), mesh, "fully_shard")
        b = simple_fsdp.make_inputs(cfg, 8, 512, rank=0, world_size=8)
        out["fsdp"] = capture_aot_graphs(model, b.inputs, loss=lambda o: simple_fsdp.loss_fn(o, b))[
            "backward"
        ]
    cfg = llama.LlamaConfig(n_layers=2, dim=512, n_heads=8, ffn_dim=2048)
    with fake_mesh(8) as mesh:
        model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        data = llama.make_inputs(cfg, 2, 512, rank=0, world_size=8, sequence_parallel=True, seed=1)
        out["tp_sp"] = (
            capture_aot_graphs(model, data.inputs, loss=lambda o: llama.loss_fn(o, data))["backward"],
            mesh.get_group().group_name,
        )
    return out


@pytest.mark.slow(reason="traces a multi-layer model (module fixture)")
def test_model_layers_and_their_choices(model_graphs):
    gm = model_graphs["fsdp"]
    free, ir = _problem(gm, {})
    layers = backward_layers(free, ir)
    names = [lay.name for lay in layers]
    assert names[:2] == ["L['self'].layers.1", "L['self'].layers.0"], names  # backward order
    assert all(lay.choice == "weight_first" for lay in layers[:2])  # FSDP: Eq. 1 picks T2
    assert all(lay.costs.g_w_rs > 0 and lay.costs.act_rs == 0 for lay in layers[:2])
    gm_tp, group = model_graphs["tp_sp"]
    free, ir = _problem(gm_tp, {group: "tp"})
    layers = [lay for lay in backward_layers(free, ir) if ".layers." in lay.name]
    assert len(layers) == 2 and all(lay.choice == "activation_first" for lay in layers)  # TP: T1
    assert all(lay.costs.act_ag > 0 and lay.costs.act_rs > 0 and lay.costs.g_w_rs == 0 for lay in layers)


def test_layer_name_from_module_paths():
    n = fx.Graph().placeholder("x")
    n.meta["fwd_nn_module_stack"] = {"a": ("L['self'].layers.12.attention.wq", object)}
    assert layer_name(n) == "L['self'].layers.12"
    n.meta["fwd_nn_module_stack"] = {"a": ("L['self'].output", object)}
    assert layer_name(n) == "L['self'].output"
    n.meta.clear()
    assert layer_name(n) is None
