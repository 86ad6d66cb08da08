"""`MoeOperands`: the named operands of a `commfuse::moe_layer` / `moe_layer_backward` node."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from commfuse.moe import MoELayer
from commfuse.ops.moe_layer.comm_volume import chunks_of
from commfuse.ops.moe_layer.op import (
    CHUNKS_ARG,
    MOE_LAYER,
    MOE_LAYER_BACKWARD,
    MOE_OPS,
    MoeOperands,
    arg_names,
)
from commfuse.testing.graphs import capture_aot_graphs

H, E, F, TOP_K, CAPACITY, GROUPS = 8, 4, 16, 2, 1.5, 2


@pytest.fixture(scope="module")
def joint() -> fx.GraphModule:
    layer = MoELayer(H, E, F, top_k=TOP_K, capacity_factor=CAPACITY, token_groups=GROUPS)
    return capture_aot_graphs(
        layer, torch.randn(2, 6, H), loss=lambda o: o[0].float().mean() + o[1].z_sum
    ).joint


def _only(gm: fx.GraphModule, target) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if n.target is target]
    return node


def test_every_schema_argument_is_a_field():
    fields = {f.name for f in dataclasses.fields(MoeOperands)}
    for op in MOE_OPS:
        assert set(arg_names(op)) <= fields
        assert arg_names(op)[CHUNKS_ARG[op]] == "chunks"


def test_forward_node_fields(joint):
    node = _only(joint, MOE_LAYER)
    ops = MoeOperands.of(node)
    x, router_w, w1, w3, w2 = node.args[:5]
    assert not ops.backward and ops.op is MOE_LAYER
    assert (ops.x, ops.router_w, ops.w1, ops.w3, ops.w2) == (x, router_w, w1, w3, w2)
    assert tuple(ops.x.meta["val"].shape) == (2, 6, H)  # the tokens, not a weight
    assert tuple(ops.router_w.meta["val"].shape) == (E, H)
    assert tuple(ops.w2.meta["val"].shape) == (E, F, H)
    assert (ops.top_k, ops.capacity_factor, ops.token_groups, ops.group_name) == (TOP_K, CAPACITY, GROUPS, "")
    assert ops.chunks == 1  # traced without it: the schema default
    assert (ops.grad_out, ops.grad_probs_sum, ops.grad_z_sum, ops.expert_grad_scale) == (None,) * 4
    assert ops.args() == node.args


def test_backward_node_fields(joint):
    node = _only(joint, MOE_LAYER_BACKWARD)
    fwd = MoeOperands.of(_only(joint, MOE_LAYER))
    ops = MoeOperands.of(node)
    assert ops.backward and ops.op is MOE_LAYER_BACKWARD
    # the backward takes the forward's own inputs
    assert (ops.x, ops.router_w, ops.w1, ops.w3, ops.w2) == (fwd.x, fwd.router_w, fwd.w1, fwd.w3, fwd.w2)
    assert (ops.top_k, ops.capacity_factor, ops.token_groups, ops.group_name) == (TOP_K, CAPACITY, GROUPS, "")
    assert tuple(ops.grad_out.meta["val"].shape) == (2, 6, H)
    assert tuple(ops.grad_probs_sum.meta["val"].shape) == (E,)
    assert tuple(ops.grad_z_sum.meta["val"].shape) == ()
    assert ops.expert_grad_scale == 1.0 and ops.chunks == 1
    assert ops.args() == node.args


def test_keyword_arguments_and_replaced_operands():
    g = fx.Graph()
    x, rw, w1, w3, w2 = (g.placeholder(n) for n in ("x", "rw", "w1", "w3", "w2"))
    node = g.call_function(
        MOE_LAYER,
        (x, rw, w1, w3, w2, 1),
        {"capacity_factor": 0.0, "token_groups": 1, "group_name": "ep", "chunks": 3},
    )
    ops = MoeOperands.of(node)
    assert (ops.top_k, ops.capacity_factor, ops.token_groups, ops.group_name, ops.chunks) == (
        1,
        0.0,
        1,
        "ep",
        3,
    )
    assert chunks_of(node) == 3
    # rebuilt positionally, keyword arguments included; a trailing default left out as tracing does
    assert ops.args() == (x, rw, w1, w3, w2, 1, 0.0, 1, "ep", 3)
    assert dataclasses.replace(ops, token_groups=2, chunks=1).args() == (x, rw, w1, w3, w2, 1, 0.0, 2, "ep")


def test_a_node_of_another_op_is_refused_by_name(joint):
    other = next(n for n in joint.graph.nodes if n.op == "call_function" and n.target not in MOE_OPS)
    with pytest.raises(TypeError, match=rf"{other.name} .* is not a call of commfuse::moe_layer"):
        MoeOperands.of(other)
    placeholder = next(iter(joint.graph.nodes))
    with pytest.raises(TypeError, match="is not a call of commfuse::moe_layer"):
        MoeOperands.of(placeholder)


def test_a_call_missing_an_argument_is_refused():
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(MOE_LAYER, (x, x, x, x, x, 1, 0.0, 1))
    with pytest.raises(TypeError, match="'group_name'"):
        MoeOperands.of(node)
