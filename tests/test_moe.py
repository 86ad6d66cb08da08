"""commfuse.moe: the MoE layer op, its shard rules, and Chimera on TP+EP / SP+EP+SP.

Numerics: the op against a plain autograd formulation (one process) and against the
unsharded op (4 gloo ranks); the workloads compiled with commfuse against eager on 4
gloo ranks. Graphs: what collective motion does to the MoE region and the exact bytes
of docs/chimera-moe.md's derivation; refusals with their reasons.
"""

from __future__ import annotations

import pytest
import torch

import commfuse
from commfuse.ir.graph_ir import CollectiveIR
from commfuse.moe import MoELayer
from commfuse.ops.moe_layer.op import swiglu
from commfuse.ops.moe_layer.routing import assign, capacity, capacity_can_bind, router_probs, top_k_gates
from commfuse.testing.fake_pg import fake_mesh
from commfuse.testing.graphs import capture_aot_graphs

from _multirank_jobs import (
    compiled_matches_eager,
    moe_op_matches_unsharded,
    moe_regroup_matches_grouped_reference,
)


# ------------------------------------------------------------------ the op, one process
def _autograd_reference(x, layer):
    logits, probs = router_probs(x, layer.router)
    gates, experts = top_k_gates(probs, layer.top_k)
    a = assign(experts, layer.num_experts, layer.capacity_factor, layer.token_groups)
    out = torch.zeros_like(x)
    for t, e, j in zip(a.token.tolist(), a.expert.tolist(), a.choice.tolist(), strict=True):
        y = gates[t, j] * swiglu(x[t : t + 1], layer.w1[e], layer.w3[e], layer.w2[e])
        out = out.index_add(0, torch.tensor([t]), y)
    return out, probs.sum(0), torch.logsumexp(logits, -1).pow(2).sum()


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("top_k", [1, 2])
def test_op_forward_and_backward_match_autograd(capacity_factor, top_k):
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 16, top_k=top_k, capacity_factor=capacity_factor, token_groups=2).double()
    x = torch.randn(12, 8, dtype=torch.double, requires_grad=True)
    up = torch.randn(12, 8, dtype=torch.double)
    out, stats = layer(x)
    loss = (out * up).sum() + stats.probs_sum.pow(2).sum() + 0.1 * stats.z_sum
    grads = torch.autograd.grad(loss, [x, *layer.parameters()])
    ref_out, ref_probs, ref_z = _autograd_reference(x, layer)
    ref_grads = torch.autograd.grad(
        (ref_out * up).sum() + ref_probs.pow(2).sum() + 0.1 * ref_z, [x, *layer.parameters()]
    )
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # router math runs in float32


def test_capacity_rule():
    # GShard order: first choices of all tokens before any second choice, earlier tokens first
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    a = assign(experts, 4, capacity_factor=0.5, token_groups=1)  # C = ceil(0.5*2*4/4) = 1
    assert capacity(0.5, 2, 4, 4) == 1
    kept = sorted(zip(a.token.tolist(), a.choice.tolist(), strict=True))
    # first choices: t0 takes e0's slot, t3 e1's; second choices come after: only t2 -> e2 fits
    assert kept == [(0, 0), (2, 1), (3, 0)]
    assert not capacity_can_bind(4.0, 2, 8) and capacity_can_bind(1.0, 2, 8)


# ------------------------------------------------------------------ multi-rank numerics
@pytest.mark.multirank
@pytest.mark.parametrize("capacity_factor,top_k", [(0.0, 2), (1.0, 2), (0.5, 1)])
def test_expert_parallel_op_matches_unsharded(rank_pool_4, capacity_factor, top_k):
    worst = rank_pool_4.run(moe_op_matches_unsharded, capacity_factor, top_k, timeout=120)
    assert len(worst) == 4


WORKLOADS = {
    # name: (collective kinds after chimera, MoE layers run on shards)
    "moe_tp_ep": {"reduce_scatter", "all_gather", "all_to_all", "all_reduce"},
    "moe_tp_ep_capacity": {"reduce_scatter", "all_gather", "all_to_all", "all_reduce"},
    "moe_sp_ep_sp": {"all_to_all", "all_reduce"},
}


@pytest.mark.slow(reason="trains on real gloo ranks against eager, forward and backward compiled per rank")
@pytest.mark.multirank
# bf16 on one workload: the others' bf16 runs took 155 s of CI's two workers and check the same
# rewrite at another rounding (docs/testing.md, "The agreement net in the suite")
@pytest.mark.parametrize(
    "name,dtype", [(name, "float32") for name in sorted(WORKLOADS)] + [("moe_tp_ep", "bfloat16")]
)
def test_moe_workloads_match_eager(rank_pool_4, name, dtype):
    # bf16: one step. A routing choice that is a near-tie flips under bf16 rounding of a
    # reordered sum, after which a token's output differs by O(1) (docs/chimera-moe.md).
    steps = 2 if dtype == "float32" else 1
    results = rank_pool_4.run(compiled_matches_eager, name, dtype, "eager", steps, timeout=300)
    for r in results:
        assert WORKLOADS[name] <= set(r["kinds"]), r["kinds"]
        counts = {k: v for p in r["passes"] for k, v in p["counts"].items()}
        assert counts.get("collective_motion.ops_on_shards", 0) > 0
        for graph, before, after in r["wire_before_after"]:  # never more bytes on the wire
            assert after <= before, f"{name} {graph} graph: {before} -> {after} wire bytes per rank"


@pytest.mark.slow(reason="trains on real gloo ranks against eager, forward and backward compiled per rank")
@pytest.mark.multirank
def test_capacity_regroup_flag(rank_pool_4):
    results = rank_pool_4.run(moe_regroup_matches_grouped_reference, timeout=300)
    for r in results:
        off, on = r[False], r[True]
        assert any("moe_capacity_regroup" in x for x in off["refusals"]), off["refusals"]
        # with the flag the layers dispatch a quarter of the slots (their token shard)
        assert [b * 4 for b in on["dispatch_bytes"]] == off["dispatch_bytes"]


# ------------------------------------------------------------------ graphs and bytes
B, S, H, E, K, N = 2, 8, 32, 8, 2, 4


def _joint(layout: str, mesh, capacity_factor: float = 0.0, batch: int = B, token_groups: int = 1):
    from commfuse.models.moe_tp import MoETPConfig, build_moe_tp, parallelize_moe_tp

    cfg = MoETPConfig(
        n_layers=1,
        dim=H,
        n_heads=4,
        num_experts=E,
        ffn_dim=32,
        top_k=K,
        capacity_factor=capacity_factor,
        token_groups=token_groups,
        vocab=64 if layout == "tp_ep" else None,
    )
    model = parallelize_moe_tp(build_moe_tp(cfg), mesh, layout)
    if layout == "tp_ep":
        x = torch.randint(0, 64, (batch, S))
    else:
        x = torch.randn(batch, S // N, H)
    return capture_aot_graphs(model, x, loss=lambda o: o[0].float().mean() + o[1]).joint


def _chimera(gm, **cfg):
    group = next(iter(CollectiveIR(gm).groups))
    commfuse.optimize(
        gm,
        commfuse.Config(passes=["chimera"], group_roles={group: "tp"}, strict=True, **cfg),
        graph_kind="joint",
    )
    return commfuse.last_report(gm).passes[0]


def _bytes(gm) -> dict[str, dict[str, int]]:
    """Wire bytes per rank by (direction, kind); the MoE op's all_to_alls under "moe"."""
    rep = commfuse.analyze(gm)
    ir = CollectiveIR(gm)
    out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for c in ir.collectives:
        d = "backward" if c.start in ir.backward_nodes or c.inputs[0] in ir.backward_nodes else "forward"
        out[d][c.kind.value] = out[d].get(c.kind.value, 0) + c.wire_bytes
    for e in rep.embedded:
        d = "backward" if e.backward else "forward"
        out[d]["moe"] = out[d].get("moe", 0) + e.wire_bytes
    return out


class _Ring:
    """docs/chimera-moe.md's per-rank wire bytes on n ranks (ring conventions, dtype size elt)."""

    def __init__(self, n: int, elt: int) -> None:
        self.n, self.elt = n, elt
        self.counts = (n - 1) * E * 8 // n  # the dropless per-expert counts exchange

    def a2a(self, rows: int, width: int) -> int:
        return (self.n - 1) * rows * width * self.elt // self.n

    def ar(self, nbytes: int) -> int:
        return 2 * (self.n - 1) * nbytes // self.n

    def half(self, nbytes: int) -> int:  # all_gather / reduce_scatter
        return (self.n - 1) * nbytes // self.n

    def moe_forward(self, tokens: int) -> int:  # dispatch + combine, H values per row
        return self.counts + 2 * self.a2a(tokens * K, H)

    def moe_backward(self, tokens: int) -> int:  # (token, grad, gate) out, (grad, gate grad) back
        return self.counts + self.a2a(tokens * K, 2 * H + 1) + self.a2a(tokens * K, H + 1)


def expected_sp_ep_sp(n: int = N, elt: int = 4) -> dict[str, dict[str, dict[str, int]]]:
    """docs/chimera-moe.md, SP+EP+SP (dropless, balanced routing, one block). M = B*S*H*elt;
    T = B*S tokens; an all_to_all of R rows of width W sends (n-1)/n * R*W*elt."""
    m, t = B * S * H * elt, B * S
    r = _Ring(n, elt)
    ag, ar, fwd_moe, bwd_moe = r.half(m), r.ar, r.moe_forward, r.moe_backward
    return {
        "before": {
            "forward": {"all_gather": 2 * ag, "reduce_scatter": ag, "moe": fwd_moe(t)},
            "backward": {"all_gather": 2 * ag, "reduce_scatter": ag, "moe": bwd_moe(t)},
        },
        # the MoE gather and its backward mirror are gone; the layer runs on T/n tokens; the
        # router statistics (2 x [E] + scalar) and the router-weight gradient [E, H] are all-reduced
        "after": {
            "forward": {
                "all_gather": ag,
                "reduce_scatter": ag,
                "moe": fwd_moe(t // n),
                "all_reduce": ar(2 * E * 4) + ar(4),
            },
            "backward": {
                "all_gather": ag,
                "reduce_scatter": ag,
                "moe": bwd_moe(t // n),
                "all_reduce": ar(E * H * 4),
            },
        },
    }


def test_sp_ep_sp_gather_disappears_and_bytes_match_derivation():
    with fake_mesh(N) as mesh:
        gm = _joint("sp_ep_sp", mesh)
        want = expected_sp_ep_sp()
        assert _bytes(gm) == want["before"]
        rec = _chimera(gm)
        assert rec.changed
        assert _bytes(gm) == want["after"]
        moe = [n for n in gm.graph.nodes if n.target is torch.ops.commfuse.moe_layer.default]
        assert [tuple(n.args[0].meta["val"].shape) for n in moe] == [(B, S // N, H)]
        bwd = [n for n in gm.graph.nodes if n.target is torch.ops.commfuse.moe_layer_backward.default]
        assert bwd[0].args[-1] == float(N)  # each expert saw N copies of every token before


V = 64


def expected_tp_ep(n: int = N, elt: int = 4) -> dict[str, dict[str, dict[str, int]]]:
    """docs/chimera-moe.md, TP+EP (dropless, one block, vocab-parallel embedding and head)."""
    m, t = B * S * H * elt, B * S
    r = _Ring(n, elt)
    half, ar, fwd_moe, bwd_moe = r.half(m), r.ar, r.moe_forward, r.moe_backward
    logits = (n - 1) * B * S * (V // n) * elt
    return {
        "before": {
            "forward": {"all_reduce": 2 * ar(m), "all_gather": logits, "moe": fwd_moe(t)},
            "backward": {"all_reduce": 4 * ar(m), "moe": bwd_moe(t)},
        },
        "after": {
            "forward": {
                "reduce_scatter": 2 * half,
                "all_gather": 2 * half + logits,
                "moe": fwd_moe(t // n),
                "all_reduce": ar(2 * E * 4) + ar(4),
            },
            "backward": {
                "reduce_scatter": 4 * half,
                "all_gather": 2 * half,
                "moe": bwd_moe(t // n),
                "all_reduce": 3 * ar(H * 4) + ar(E * H * 4),
            },
        },
    }


def test_tp_ep_all_reduce_becomes_reduce_scatter_and_bytes_match_derivation():
    with fake_mesh(N) as mesh:
        gm = _joint("tp_ep", mesh)
        want = expected_tp_ep()
        assert _bytes(gm) == want["before"]
        assert _chimera(gm).changed
        assert _bytes(gm) == want["after"]


def test_capacity_that_can_drop_is_refused_with_reason():
    with fake_mesh(N) as mesh:
        gm = _joint("sp_ep_sp", mesh, capacity_factor=1.0)
        code = gm.code
        rec = _chimera(gm)
        assert not rec.changed and gm.code == code
        assert any("capacity can drop tokens" in r for r in rec.refusals), rec.refusals


def test_capacity_that_cannot_bind_moves():
    with fake_mesh(N) as mesh:
        gm = _joint("sp_ep_sp", mesh, capacity_factor=float(E // K))  # C >= tokens per group
        assert _chimera(gm).changed


def test_other_expert_parallel_group_is_refused():
    """Tokens gathered over one group, experts exchanged over another: not moved."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.ops.moe_layer.op import moe_layer
    from commfuse.testing.fake_pg import fake_process_group

    with fake_process_group(4):
        a = dist.new_group([0, 1])
        b = dist.new_group([0, 2])

        def f(x, router, w1, w3, w2):
            full = funcol.all_gather_tensor(x, 0, a)
            out, *_ = moe_layer(full, router, w1, w3, w2, 1, 0.0, 1, b.group_name)
            return out.relu()

        gm = make_fx(f, tracing_mode="fake")(
            torch.randn(4, 8),
            torch.randn(4, 8),
            torch.randn(2, 8, 16),
            torch.randn(2, 8, 16),
            torch.randn(2, 16, 8),
        )
        cfg = commfuse.Config(passes=["collective_motion"], group_roles={a.group_name: "tp"}, strict=True)
        commfuse.optimize(gm, cfg)
        rec = commfuse.last_report(gm).passes[0]
        assert not rec.changed
        assert any("expert-parallel group" in r for r in rec.refusals), rec.refusals


def test_op_moves_onto_sequence_shards_when_its_expert_group_is_the_other_mesh_dim():
    """SP+EP+SP with TP and EP on the two dims of a 2 x 2 mesh (TP = {0, 1}, EP = {0, 2}): each
    rank's EP peers hold the shard with its own TP position, so the op runs on the shard with
    its EP group unchanged. The expert-weight gradients become partial over TP (each TP position
    saw its shards of every EP peer's tokens: all-reduced), the expert gradient scale stays 1
    (with EP over the TP group itself it would be N). Refused without the mesh: the groups are
    then not known to cross."""
    from commfuse import session
    from commfuse.models.moe_tp import MoETPConfig, build_moe_tp, parallelize_moe_tp

    seq = 128  # enough tokens that the shard's smaller exchange outweighs the gradients' all-reduce
    with fake_mesh(4, (2, 2), ("ep", "tp")) as mesh:
        cfg = MoETPConfig(n_layers=1, dim=H, n_heads=4, num_experts=4, ffn_dim=32, top_k=K)
        model = parallelize_moe_tp(build_moe_tp(cfg), mesh["tp"], "sp_ep_sp", ep_mesh=mesh["ep"])
        joint = capture_aot_graphs(
            model, torch.randn(B, seq // 2, H), loss=lambda o: o[0].float().mean() + o[1]
        ).joint

        def moe_nodes(gm):
            return [
                n
                for n in gm.graph.nodes
                if n.target
                in (torch.ops.commfuse.moe_layer.default, torch.ops.commfuse.moe_layer_backward.default)
            ]

        tp = mesh["tp"].get_group().group_name
        session.reset()
        gm = capture_aot_graphs(
            model, torch.randn(B, seq // 2, H), loss=lambda o: o[0].float().mean() + o[1]
        ).joint
        rec = _chimera(gm, step_time_gate=False)
        assert any(f"is not the gathered group {tp} and does not cross it" in r for r in rec.refusals), (
            rec.refusals
        )
        assert [tuple(n.args[0].meta["val"].shape) for n in moe_nodes(gm)[:1]] == [(B, seq, H)]
        try:
            commfuse.setup(mesh=mesh)
            rec = _chimera(joint, step_time_gate=False)
        finally:
            session.reset()
        assert rec.changed and rec.counts["collective_motion.ops_on_shards"] > 0, "\n".join(rec.refusals)
        fwd, bwd = moe_nodes(joint)
        assert tuple(fwd.args[0].meta["val"].shape) == (B, seq // 2, H)  # the op on this rank's shard
        assert fwd.args[8] == bwd.args[11] == mesh["ep"].get_group().group_name  # its EP group unchanged
        assert bwd.args[12] == 1.0
        # the expert-weight gradients (w1, w3 [2 local, H, ffn], w2 [2, ffn, H]; H = ffn = 32)
        # all-reduced over TP
        reduced = [
            tuple(c.input_shapes[0])
            for c in CollectiveIR(joint).collectives
            if c.kind.value == "all_reduce" and c.group.name == tp
        ]
        assert reduced.count((2, 32, 32)) == 3, reduced


def test_across_mesh_dims_the_expert_weights_must_be_known_identical_over_the_gathered_group():
    """Across mesh dims a shard's tokens meet another TP rank's copy of each expert: without the
    weights known identical over TP (here: no input trusted), the op stays on full tokens and
    says why; with them it runs on the shard."""
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.ops.moe_layer.op import MOE_LAYER
    from commfuse.transforms.collective_motion import plan_regions

    with fake_mesh(4, (2, 2), ("ep", "tp")) as mesh:
        tp, ep = mesh["tp"].get_group(), mesh["ep"].get_group()

        def f(x, rw, w1, w3, w2):
            full = funcol.all_gather_tensor(x, 0, tp)
            return list(MOE_LAYER(full, rw, w1, w3, w2, 2, 0.0, 1, ep.group_name))

        gm = make_fx(f, tracing_mode="fake")(
            torch.randn(8, H),
            torch.randn(4, H),
            torch.randn(2, H, 16),
            torch.randn(2, H, 16),
            torch.randn(2, 16, H),
        )
        for trusted in (False, True):
            refusals: list[str] = []
            plans = plan_regions(
                gm,
                CollectiveIR(gm).collectives,
                refusals,
                lambda g, trusted=trusted: trusted,
                crossing=lambda seed, group: None,
            )
            moved = [n for p in plans for n in p.ops if n.target is MOE_LAYER]
            if trusted:
                assert moved, refusals
            else:
                assert not moved and any(
                    "expert weights are not known to be identical" in r for r in refusals
                ), refusals
