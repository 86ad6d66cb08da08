"""Chimera in one graph: all_reduce split, collective motion, the chimera pipeline.

Graph-level tests trace under the fake process group and check every rewrite on the
N-rank reference interpreter (`check_equivalent`); the 4-rank gloo runs compare
training with the unoptimised program (tests/test_multirank_backend.py covers the
default pipeline on every example; here the TP-only Llama gets its byte accounting).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.testing.equivalence import check_equivalent
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.testing.graphs import _copy, capture_aot_graphs


def _optimize(gm, passes, **cfg):
    commfuse.optimize(gm, commfuse.Config(passes=passes, strict=True, **cfg))
    return {p.name: p for p in commfuse.last_report(gm).passes}


def _kinds(gm) -> list[str]:
    return [c.kind.value for c in CollectiveIR(gm).collectives]


def _rms(h, w):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


# ---------------------------------------------------------------- split_all_reduce
@pytest.mark.parametrize(
    "shape,n,dim", [((6, 8, 16), 4, 1), ((8, 16), 2, 0), ((3, 5, 8), 4, 2), ((3, 5), 4, None)]
)
def test_split_dim_choice_and_values(shape, n, dim):
    def f(x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD) * 2

    with fake_process_group(n):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(shape))
        before = _copy(gm)
        rec = _optimize(gm, ["split_all_reduce"])["split_all_reduce"]
        if dim is None:
            assert not rec.changed and "divisible" in rec.refusals[0]
            return
        colls = CollectiveIR(gm).collectives
        assert [c.kind.value for c in colls] == ["reduce_scatter", "all_gather"]
        assert {c.logical_dim for c in colls} == {dim}
        check_equivalent(before, gm, n, exact=True)


def test_split_chain_of_all_reduces():
    def f(x):
        g = dist.group.WORLD
        return funcol.all_reduce(funcol.all_reduce(x, "avg", g), "max", g)

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 4))
        before = _copy(gm)
        _optimize(gm, ["split_all_reduce"])
        assert _kinds(gm) == ["reduce_scatter", "all_gather"] * 2
        check_equivalent(before, gm, 4)


# ---------------------------------------------------------------- collective_motion
def _norm_after_all_reduce(x, w, bias):
    """TP-style: all_reduce -> residual + norm -> matmul; the norm weight is itself the
    output of a collective, so the graph proves it is replicated."""
    g = dist.group.WORLD
    h = funcol.all_reduce(x, "sum", g) + funcol.all_reduce(bias, "avg", g)
    wn = funcol.all_reduce(w[0], "avg", g)
    return _rms(h, wn) @ w


@pytest.mark.parametrize("n,dtype", [(2, torch.float32), (4, torch.float32), (4, torch.bfloat16)])
def test_motion_runs_norm_on_shards(n, dtype):
    with fake_process_group(n):
        gm = make_fx(_norm_after_all_reduce, tracing_mode="fake")(
            torch.randn(2, 8, 16, dtype=dtype),
            torch.randn(16, 16, dtype=dtype),
            torch.randn(2, 8, 16, dtype=dtype),
        )
        before = _copy(gm)
        recs = _optimize(gm, ["split_all_reduce", "collective_motion"])
        counts = recs["collective_motion"].counts
        assert counts["gathers_removed"] == 2 and counts["gathers_inserted"] == 1, recs["collective_motion"]
        # reduce_scatter -> norm on the shard -> one all_gather before the matmul
        code = gm.code
        assert (
            code.index("reduce_scatter_tensor") < code.index("rsqrt") < code.rindex("all_gather_into_tensor")
        )
        check_equivalent(before, gm, n)


def test_motion_refuses_inputs_not_known_to_be_replicated():
    """A norm weight that is a plain graph input may differ per rank: without a TP role
    given by the user the norm must not move (rank j would normalise shard j with its own copy)."""

    def f(x, w):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD)
        return _rms(h, w[0]) @ w

    with fake_process_group(4) as pg:
        args = (torch.randn(2, 8, 16), torch.randn(16, 16))
        gm = make_fx(f, tracing_mode="fake")(*args)
        before = _copy(gm)
        recs = _optimize(gm, ["split_all_reduce", "collective_motion"])
        moved = recs["collective_motion"].counts.get("ops_on_shards", 0)
        # pow/mean/add/rsqrt/mul by rsqrt move; the multiply by the weight does not
        assert moved == 5
        check_equivalent(before, gm, 4)  # per-rank different inputs: still equal
        gm2 = make_fx(f, tracing_mode="fake")(*args)
        before2 = _copy(gm2)
        recs = _optimize(gm2, ["split_all_reduce", "collective_motion"], group_roles={pg.group_name: "tp"})
        assert recs["collective_motion"].counts["ops_on_shards"] == 6
        check_equivalent(before2, gm2, 4, replicated_inputs=True)


def test_motion_partial_sum_over_the_sharded_dim_is_all_reduced():
    def f(x, y):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD)
        return (h * h).sum(dim=[0, 1]), (h + 1) @ y

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 8, 16), torch.randn(16, 4))
        before = _copy(gm)
        recs = _optimize(gm, ["split_all_reduce", "collective_motion"])
        assert recs["collective_motion"].counts["partial_all_reduces"] == 1
        check_equivalent(before, gm, 4)


def test_motion_leaves_gather_feeding_a_matmul():
    def f(x, w):
        return funcol.all_gather_tensor(x, 0, dist.group.WORLD) @ w

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
        code = gm.code
        rec = _optimize(gm, ["collective_motion"])["collective_motion"]
        assert not rec.changed and gm.code == code
        assert "no user computes independently" in rec.refusals[0]


def test_motion_refuses_when_it_would_add_bytes():
    """Two views of the gathered value feed matmuls after an elementwise op: moving would
    need one gather per consumer branch -- refused with the byte count."""

    def f(x, w):
        g = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        a, b = g.exp(), g.cos()
        return a @ w, b @ w

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
        rec = _optimize(gm, ["collective_motion"])["collective_motion"]
        assert not rec.changed and "would gather" in rec.refusals[0], rec.refusals


# ---------------------------------------------------------------- TP Llama: automatic SP
B, S, H, V, LAYERS = 2, 8, 32, 64, 2


def _tp_llama_joint(mesh):
    from commfuse.models.llama import LlamaConfig, build_llama, parallelize_llama

    cfg = LlamaConfig(n_layers=LAYERS, dim=H, n_heads=4, ffn_dim=64, vocab=V)
    model = parallelize_llama(build_llama(cfg), mesh, sequence_parallel=False)
    graphs = capture_aot_graphs(model, torch.randint(0, V, (B, S)))
    return graphs.joint, mesh.get_group().group_name


def _wire_by_direction(gm) -> dict[str, int]:
    ir = CollectiveIR(gm)
    out = {"forward": 0, "backward": 0}
    for c in ir.collectives:
        out[
            "backward" if c.start in ir.backward_nodes or c.inputs[0] in ir.backward_nodes else "forward"
        ] += c.wire_bytes
    return out


def expected_tp_llama_wire(n: int, elt: int = 4) -> dict[str, dict[str, float]]:
    """docs/chimera.md's derivation (ring conventions, per rank): M = B*S*H*elt bytes of one
    activation; an all_reduce sends 2(N-1)M/N, a reduce_scatter or all_gather (N-1)M/N."""
    m, ar, half = B * S * H * elt, 2 * (n - 1) / n, (n - 1) / n
    logits = (n - 1) * B * S * (V // n) * elt  # the head's output gather, untouched
    return {
        "before": {"forward": (1 + 2 * LAYERS) * ar * m + logits, "backward": (5 * LAYERS + 1) * ar * m},
        "after": {
            "forward": (1 + 2 * LAYERS) * ar * m + logits,
            "backward": (5 * LAYERS + 1) * half * m
            + (2 * LAYERS + 1) * half * m
            + (2 * LAYERS + 1) * ar * H * elt,
        },
    }


@pytest.mark.parametrize("n", [2, 4])
def test_tp_llama_becomes_sequence_parallel(n):
    with fake_mesh(n) as mesh:
        _check_tp_llama(n, *_tp_llama_joint(mesh))


def _check_tp_llama(n, gm, group):
    before = _copy(gm)
    assert set(_kinds(gm)) == {"all_reduce", "all_gather"}
    want = expected_tp_llama_wire(n)
    assert _wire_by_direction(gm) == pytest.approx(want["before"])
    recs = _optimize(gm, ["chimera"], group_roles={group: "tp"})
    assert recs["chimera"].changed
    kinds = _kinds(gm)
    # every activation all_reduce became reduce_scatter (+ all_gather where a matmul needs the
    # full value); the only all_reduces left are the norm weights' gradients ([H] each)
    assert kinds.count("reduce_scatter") == (1 + 2 * LAYERS) + (
        5 * LAYERS + 1
    )  # forward + backward all_reduces
    ar = [c for c in CollectiveIR(gm).collectives if c.kind.value == "all_reduce"]
    assert len(ar) == 2 * LAYERS + 1 and all(math.prod(c.input_shapes[0]) == H for c in ar)
    assert _wire_by_direction(gm) == pytest.approx(want["after"])
    check_equivalent(before, gm, n, replicated_inputs=True)


def test_chimera_leaves_graph_without_fusible_pattern_unchanged():
    """Data-parallel gradient all_reduces feed the graph outputs directly: nothing to move
    or fuse; the graph is restored exactly and the report says why."""

    def g(x, w):
        return funcol.all_reduce(x.t() @ x @ w, "avg", dist.group.WORLD)

    with fake_process_group(4):
        gm = make_fx(g, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
        code = gm.code
        rec = _optimize(gm, ["chimera"])["chimera"]
        assert not rec.changed and gm.code == code
        assert any("graph restored" in r for r in rec.refusals)
        assert any("collective_motion" in r for r in rec.refusals)
