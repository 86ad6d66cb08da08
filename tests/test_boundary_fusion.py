"""boundary_fusion: Chimera's fusions across pipeline stages (rules ag_p2p, p2p_ag, a2a_p2p, ar_p2p).

One process: every rule fires on its workload's forward graph for both positions, the rewritten
graphs carry m2ms and partition, the joint graph's backward is the reverse m2ms, the per-rank
boundary bytes equal docs/boundary-fusion.md's formulas and the IR's totals, every refusal path
(commfuse.models.pipeline_models' boundaries included) says why. 4 gloo ranks (2 stages x 2):
every workload, GPipe and 1F1B, several micro-batches: losses and gradients equal to the
unfused pipeline, state_dict unchanged; random cases per rule (the fuzzer's programs never hold a
pipeline forward graph: see BoundaryFusion.fuzz = FuzzSpec(not_fuzzed=...))."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from benchmarks.boundary_volume import TABLE, WORKLOADS, formula, pp_ep_formula, trace_workload, volume_row
from commfuse.models.pipeline_models import (
    PipelineModelConfig,
    build_stages,
    make_full_data,
    make_loss_fn,
    position_view,
)
from commfuse.ops import M2MS, M2MS_AUTOGRAD, STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, parse_m2ms
from commfuse.analysis import boundary
from commfuse.transforms.boundary_fusion import LAYOUT_META, BoundaryFusion, fuse_boundaries, measured_bytes
from commfuse.analysis.boundary import BoundaryFusionOptions, BoundaryMap, OpBytes, RuleVolume
from commfuse.pipeline import partition, plan_layout, trace_forward, trace_joint
from commfuse.testing import assert_bitwise_equal_tree, assert_close_tree

import _jobs_boundary_fusion as jobs

STAGES = [[0, 1], [2, 3]]


def _calls(gm: fx.GraphModule, op) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def _fuse(name: str, position: int = 0, **kw):
    w = WORKLOADS[name]
    program, inputs = trace_workload(w, position, **kw)
    rep = fuse_boundaries(
        program.forward, program.layout, options=w.options, input_names=[s.name for s in program.inputs]
    )
    return w, program, inputs, rep


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_each_rule_fires_and_the_fused_program_partitions(name, position):
    w, program, inputs, rep = _fuse(name, position)
    assert rep.changed and rep.counts[w.rule] == 1 and sum(rep.counts.values()) == 1, rep.refusals
    fwd = program.forward
    from commfuse.ops import parse_stage_transfer

    transfers = [
        (parse_stage_transfer(n).src, parse_stage_transfer(n).dst)
        for n in _calls(fwd, STAGE_TRANSFER_AUTOGRAD)
    ]
    if w.rule == "p2p_a2a":  # the router weight back to stage 0, the top-k weights and indices forward
        assert sorted(transfers) == [((0, 1), (2, 3))] * 2 + [((2, 3), (0, 1))]
    else:
        assert not transfers
    (m,) = _calls(fwd, M2MS_AUTOGRAD)
    a = parse_m2ms(m)
    assert (a.src, a.dst, a.group_name) == ((0, 1), (2, 3), "commfuse.pp.boundary0")
    if w.rule == "ar_p2p":  # position i sends its chunk to position i only
        assert a.splits[0][1] == a.splits[1][0] == 0 and a.splits[0][0] == a.splits[1][1] > 0
    else:
        assert len({s for row in a.splits for s in row}) == 1
    # the joint graph: forward m2ms A -> B, backward the reverse scatter B -> A (transposed)
    trace_joint(program, inputs)
    fw_m, bw_m = _calls(program.joint, M2MS)
    pf, pb = parse_m2ms(fw_m), parse_m2ms(bw_m)
    assert (pb.src, pb.dst) == (pf.dst, pf.src) and pb.splits == tuple(zip(*pf.splits, strict=True))
    floating = [
        n for n in _calls(program.forward, STAGE_TRANSFER_AUTOGRAD) if n.meta["val"].is_floating_point()
    ]
    # each transfer, and the backward of each floating one (the top-k indices have no gradient)
    assert len(_calls(program.joint, STAGE_TRANSFER)) == len(transfers) + len(floating)
    parted = partition(program)
    assert {k for k in parted.parts} == {(0, "fw"), (0, "bw"), (1, "fw"), (1, "bw")}


def test_ar_p2p_keeps_the_own_chunk_gradient_and_ties_the_residual():
    """The TP+PP replacement: reduce_scatter of h + (x - x.detach()) on A, this position's
    chunk of the detached residual, the diagonal m2ms, a detached all_gather on B with the own
    chunk spliced back in (docs/boundary-fusion.md)."""
    _, program, _, rep = _fuse("tp_pp", position=1)
    code = program.forward.code
    fwd = program.forward
    c10d_ag = torch.ops._c10d_functional_autograd
    assert len(_calls(fwd, c10d_ag.reduce_scatter_tensor.default)) == 1
    (ag,) = _calls(fwd, c10d_ag.all_gather_into_tensor.default)
    assert ag.args[0].target is torch.ops.aten.detach.default  # B's gather carries no gradient ...
    (narrow,) = _calls(fwd, torch.ops.aten.narrow.default)
    assert narrow.args[1:] == (0, 1, 1)  # ... A adds chunk 1 (position 1) of the residual
    assert "aten.sub.Tensor" in code  # the zero-valued tie h + (x - x.detach())
    (m,) = _calls(fwd, M2MS_AUTOGRAD)
    (cat,) = [n for n in _calls(fwd, torch.ops.aten.cat.default) if m in n.args[0]]
    assert cat.args[0].index(m) == 1  # position 1's own chunk is the m2ms result itself
    assert rep.decisions[0].volume.bytes_after < rep.decisions[0].volume.bytes_before


@pytest.mark.parametrize("B,S,H", [(2, 8, 16), (4, 16, 8)])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_boundary_bytes_equal_the_formulas(name, B, S, H):
    """Bytes per rank of the fused pair (from the traced graphs' shapes) equal the closed forms
    of docs/boundary-fusion.md, and the CollectiveIR's totals over the whole forward graph
    change by exactly that difference."""
    w = dataclasses.replace(WORKLOADS[name], dim=H, ffn_dim=2 * H)
    program, _ = trace_workload(w, 0, batch=2 * B, seq=S)  # 2 micro-batches of B
    rep = fuse_boundaries(
        program.forward, program.layout, options=w.options, input_names=[s.name for s in program.inputs]
    )
    (d,) = [d for d in rep.decisions if d.applied]
    if w.rule == "p2p_a2a":
        want = pp_ep_formula(B, S, H, 2, E=4, k=1, capacity_factor=1.0)
    else:
        want = formula(w.rule, B, S, H, 2)
    assert (d.volume.bytes_before, d.volume.bytes_after) == want
    total = {
        k: sum(sum(v.values()) for v in b.values())
        for k, b in (("before", rep.bytes_before), ("after", rep.bytes_after))
    }
    assert total["before"] - total["after"] == d.volume.bytes_before - d.volume.bytes_after
    # and the kinds moved as the rule says
    kinds_before = {k for v in rep.bytes_before.values() for k in v}
    kinds_after = {k for v in rep.bytes_after.values() for k in v}
    assert "m2ms" in kinds_after and "m2ms" not in kinds_before and "stage_transfer" in kinds_before


@pytest.mark.parametrize("N", [2, 4, 8, 64])
def test_ratios_fall_in_chimera_table_ranges(N):
    """The before/after ratio of each formula against Chimera's Table 2 row (N ranks per stage)."""
    r = {rule: formula(rule, 2, 64, 64, N) for rule in TABLE if rule != "p2p_a2a"}
    ratio = {k: a / b for k, (b, a) in r.items()}
    assert 0.5 <= ratio["ag_p2p"] <= 2 / 3 + 1e-12  # SP+PP: 50-66.7%
    assert ratio["ag_p2p"] == pytest.approx(N / (2 * N - 1))
    assert 0.6 <= ratio["ar_p2p"] <= 0.8  # TP+PP: 60-80%
    assert ratio["ar_p2p"] == pytest.approx((2 * N - 1) / (3 * N - 2))
    assert ratio["p2p_ag"] == 1.0 and ratio["a2a_p2p"] == ratio["ag_p2p"]
    # PP+EP: Table 2's 0-66.7% counts the dispatch alone (k = 1, no padding, nothing else sent); the
    # fused form also sends the router weight back and the top-k weights/indices forward, which
    # vanish against the activation as B*S grows: the ratio tends to N/(2N-1) (k = 1, capacity 1)
    before, after = pp_ep_formula(64, 4096, 4096, N, E=8, k=1, capacity_factor=1.0)
    assert N / (2 * N - 1) < after / before < N / (2 * N - 1) + 0.001
    before, after = pp_ep_formula(2, 8, 128, N, E=4, k=1, capacity_factor=1.0)
    assert after / before > N / (2 * N - 1) + 0.01  # small: the weight transfer costs


def test_volume_rows_of_the_benchmark():
    rows = [volume_row(w, batch=4, seq=8) for w in WORKLOADS.values()]
    assert all(r["formula_matches"] and r["graph_difference_matches"] for r in rows), rows


def test_refusals_on_the_pipeline_models_say_why():
    """commfuse.models.pipeline_models: SP stages transfer sequence shards (nothing to fuse: the
    next stage normalises before it gathers), the EP model's boundary feeds a dense block, TP
    needs its contract declared."""

    def fused(kind, options):
        cfg = PipelineModelConfig(kind=kind)
        layout = plan_layout(STAGES, 0)
        stages = build_stages(cfg, layout.stages, 0, 2)
        x, t = make_full_data(cfg, 2, 4, 8)
        prog = trace_forward(
            layout,
            stages,
            make_loss_fn(cfg, 2),
            position_view(cfg, 2, 0, x)[:2],
            position_view(cfg, 2, 0, t)[:2],
        )
        return fuse_boundaries(
            prog.forward, layout, options=options, input_names=[s.name for s in prog.inputs]
        )

    rep = fused("sp", None)
    assert not rep.changed
    (why,) = [d.reasons for d in rep.decisions]
    assert "not an all_gather's result" in why["ag_p2p"] and "does not feed an all_gather" in why["p2p_ag"]
    assert not fused("ep", None).changed
    rep = fused("tp", None)
    assert not rep.changed and "declare TP inputs" in rep.decisions[0].reasons["ar_p2p"]
    rep = fused("tp", BoundaryFusionOptions(replicated_inputs=("x",)))
    assert not rep.changed and "not declared tensor-parallel" in rep.decisions[0].reasons["ar_p2p"]
    rep = fused("tp", BoundaryFusionOptions(tp_stages=(1,)))  # x not declared: the residual is unproven
    assert not rep.changed and "proven replicated" in rep.decisions[0].reasons["ar_p2p"]
    rep = fused("tp", BoundaryFusionOptions(tp_stages=(1,), replicated_inputs=("x",)))
    assert rep.counts["ar_p2p"] == 1


def test_pp_ep_needs_reverse_transfers_and_refuses_a_residual():
    """p2p_a2a: refused unless reverse transfers are allowed (the router weight travels back each
    micro-batch); on the pipeline models' EP model (a dense block with its residual before the
    MoE) moving everything up to the dispatch would send the dense block's weights: refused by
    minimum cut: the dense block's output is as large as the activation (the transfer stays)."""
    program, _ = trace_workload(WORKLOADS["pp_ep"], 0)
    rep = fuse_boundaries(
        program.forward,
        program.layout,
        options=BoundaryFusionOptions(rules=("p2p_a2a",)),
        input_names=[s.name for s in program.inputs],
    )
    assert not rep.changed and "reverse_transfers=True" in rep.decisions[0].reasons["p2p_a2a"]
    rep = fuse_boundaries(
        program.forward,
        program.layout,
        options=BoundaryFusionOptions(rules=("p2p_a2a",), reverse_transfers=True),
    )
    assert not rep.changed and "input names are unknown" in rep.decisions[0].reasons["p2p_a2a"]

    cfg = PipelineModelConfig(kind="ep")
    layout = plan_layout(STAGES, 0)
    stages = build_stages(cfg, layout.stages, 0, 2)
    x, t = make_full_data(cfg, 2, 4, 8)
    prog = trace_forward(
        layout, stages, make_loss_fn(cfg, 2), position_view(cfg, 2, 0, x)[:2], position_view(cfg, 2, 0, t)[:2]
    )
    rep = fuse_boundaries(
        prog.forward,
        layout,
        options=BoundaryFusionOptions(reverse_transfers=True),
        input_names=[s.name for s in prog.inputs],
    )
    assert not rep.changed and "needs the whole transferred activation" in rep.decisions[0].reasons["p2p_a2a"]


def test_refuses_when_the_gathered_value_has_other_users():
    program, _ = trace_workload(WORKLOADS["sp_pp"], 0)
    gm = program.forward
    (t,) = _calls(gm, STAGE_TRANSFER_AUTOGRAD)
    y = t.args[0]
    with gm.graph.inserting_after(t):
        extra = gm.graph.call_function(torch.ops.aten.mul.Tensor, (y, 2.0))
    extra.meta["val"] = y.meta["val"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        s = gm.graph.call_function(torch.ops.aten.sum.default, (extra,))
        loss = gm.graph.call_function(torch.ops.aten.add.Tensor, (out.args[0], s))
    out.args = (loss,)
    gm.recompile()
    rep = fuse_boundaries(gm, program.layout)
    assert not rep.changed
    assert "other users on the sending stage" in rep.decisions[0].reasons["ag_p2p"]


def test_keeps_a_rewrite_only_if_bytes_do_not_grow(monkeypatch):
    program, _ = trace_workload(WORKLOADS["a2a_pp"], 0)
    real = boundary.MATCHERS["a2a_p2p"]

    def growing(site, env):
        m = real(site, env)
        m.volume = RuleVolume((OpBytes("stage_transfer", 0, 10),), (OpBytes("m2ms", 0, 11),))
        return m

    monkeypatch.setitem(boundary.MATCHERS, "a2a_p2p", growing)
    rep = fuse_boundaries(program.forward, program.layout, options=BoundaryFusionOptions(rules=("a2a_p2p",)))
    assert not rep.changed and "would grow 10 -> 11" in rep.decisions[0].reasons["a2a_p2p"]
    assert _calls(program.forward, STAGE_TRANSFER_AUTOGRAD)


def test_registered_pass_reads_the_layout_from_meta_or_the_aliases():
    """The GraphPass: a no-op with a note without boundary ops; on a pipeline graph without a
    layout it infers the boundaries from commfuse.pipeline's aliases (no position: rules that
    need it refuse), with gm.meta[LAYOUT_META] it has the position."""
    from commfuse.config import Config
    from commfuse.passmgr.context import PassContext

    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    res = BoundaryFusion().run(PassContext(gm, Config()))
    assert not res.changed and any("no pipeline boundary op" in r for r in res.refusals)

    program, _ = trace_workload(WORKLOADS["sp_pp"], 0)
    res = BoundaryFusion().run(PassContext(program.forward, Config()))
    assert res.changed and res.counts["ag_p2p"] == 1 and res.decisions

    program, _ = trace_workload(WORKLOADS["sp_pp_b"], 1)  # p2p_ag with another user needs the position
    res = BoundaryFusion().run(PassContext(program.forward, Config()))
    assert not res.changed and any("position is unknown" in r for r in res.refusals)
    program.forward.meta[LAYOUT_META] = program.layout
    res = BoundaryFusion().run(PassContext(program.forward, Config()))
    assert res.changed and res.counts["p2p_ag"] == 1

    # after p2p_a2a the boundary carries transfers both ways: without the layout, left alone
    w = WORKLOADS["pp_ep"]
    program, _ = trace_workload(w, 0)
    fuse_boundaries(
        program.forward, program.layout, options=w.options, input_names=[s.name for s in program.inputs]
    )
    bmap, notes = BoundaryMap.from_graph(program.forward)
    assert not bmap.boundaries and "more than one direction" in notes[0]
    res = BoundaryFusion().run(PassContext(program.forward, Config()))
    assert not res.changed


def test_boundary_map_from_graph_matches_the_layout():
    program, _ = trace_workload(WORKLOADS["tp_pp"], 1)
    from_graph, notes = BoundaryMap.from_graph(program.forward)
    from_layout = BoundaryMap.from_layout(program.layout)
    assert not notes and from_graph.boundaries == from_layout.boundaries
    assert from_layout.position == 1 and from_graph.position is None
    assert measured_bytes(program.forward, from_layout) == measured_bytes(program.forward, from_graph)


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown rules"):
        BoundaryFusionOptions(rules=("nope",))
    with pytest.raises(ValueError, match="tp_stages"):
        BoundaryFusionOptions(tp_stages=(-1,))
    with pytest.raises(ValueError, match="replicated_inputs"):
        BoundaryFusionOptions(replicated_inputs=(0,))
    program, _ = trace_workload(WORKLOADS["sp_pp"], 0)
    with pytest.raises(TypeError, match="options"):
        fuse_boundaries(program.forward, program.layout, options={"rules": ()})


def test_m2ms_traces_across_stages():
    assert boundary.m2ms_traceable_across_stages() is None


# ------------------------------------------------------------------ 4 gloo ranks
def _check(out: list[dict], rule: str, exact: bool) -> None:
    for r, res in enumerate(out):
        for key, run in res["runs"].items():
            plain, fused = run["plain"], run["fused"]
            assert fused["counts"][rule] == 1, (r, key, fused["refusals"])
            want_ops = ["commfuse.m2ms.default"] + (
                ["commfuse.stage_transfer.default"] if rule == "p2p_a2a" else []
            )
            assert fused["joint_ops"] == want_ops, fused["joint_ops"]
            assert fused["state_dict_unchanged"] and plain["state_dict"] == fused["state_dict"]
            assert fused["other_grads_untouched"] and plain["other_grads_untouched"]
            assert set(plain["grads"]) == set(fused["grads"]) and plain["grads"]
            expected = {"loss": plain["loss"], "grads": plain["grads"]}
            actual = {"loss": fused["loss"], "grads": fused["grads"]}
            if res["stage"] == 0:
                assert plain["loss"] is None and fused["loss"] is None
                expected.pop("loss"), actual.pop("loss")
            if exact:
                assert_bitwise_equal_tree(actual, expected, msg=f"on rank {r}, {key}")
            else:
                assert_close_tree(actual, expected, msg=f"on rank {r}, {key}")


@pytest.mark.slow(reason="runs fused and unfused pipelines on 4 gloo ranks")
@pytest.mark.multirank
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_fused_pipeline_matches_unfused_on_four_ranks(rank_pool_4, name):
    """2 stages x 2 gloo ranks, GPipe and 1F1B, 2 and 3 micro-batches: losses and
    every gradient of the fused pipeline equal the unfused pipeline's, state_dict keys and shapes
    unchanged, the joint graph's boundary ops are m2ms in both directions (p2p_a2a: plus the
    router weight's and the top-k values' transfers). p2p_a2a runs GPipe only."""
    w = WORKLOADS[name]
    # p2p_a2a sends the router weight back every micro-batch: GPipe only (docs/boundary-fusion.md)
    schedules = ("gpipe",) if w.rule == "p2p_a2a" else ("gpipe", "1f1b")
    out = rank_pool_4.run(jobs.fused_vs_unfused, name, (2, 3), schedules, timeout=300)
    # bitwise for the pure data movements and the 2-rank sums; p2p_ag adds the received shard's two
    # gradients in another order, p2p_a2a recomputes the combine weights from contiguous copies
    _check(out, w.rule, exact=w.rule in ("ag_p2p", "a2a_p2p", "ar_p2p"))


@pytest.mark.slow(reason="runs random pipeline boundary cases on gloo ranks")
@pytest.mark.multirank
def test_random_boundary_cases_match_unfused(rank_pool_4):
    """Randomised property test (the fuzzer cannot reach pipeline forward graphs): per rule,
    random shapes, gather dims, views after the collective, other users on the receiving
    stage, residual orders, experts / top-k / capacity, micro-batch counts and schedules;
    fused == unfused on 4 ranks (p2p_a2a may refuse when the dispatch buffer outgrows the pair)."""
    seeds = list(range(100, 115))
    out = rank_pool_4.run(jobs.random_cases, seeds, timeout=300)
    applied = {}
    for k in range(len(seeds)):
        case = out[0][k]["case"]
        for r in range(4):
            plain, fused = out[r][k]["plain"], out[r][k]["fused"]
            if case["rule"] == "p2p_a2a" and not fused["counts"]["p2p_a2a"]:
                # top-k 2 or capacity > 1 grows the dispatch buffer past the transfer + all_to_all
                assert any("would grow" in why for why in fused["refusals"]), (case, fused["refusals"])
            else:
                assert fused["counts"][case["rule"]] == 1, (case, fused["refusals"])
                applied[case["rule"]] = applied.get(case["rule"], 0) + 1
            assert (plain["loss"] is None) == (fused["loss"] is None) == (r < 2)
            expected, actual = {"grads": plain["grads"]}, {"grads": fused["grads"]}
            if r >= 2:
                expected["loss"], actual["loss"] = plain["loss"], fused["loss"]
            assert_close_tree(actual, expected, msg=f"rank {r}, case {case}")
    assert set(applied) == set(boundary.RULES)  # every rule was exercised
