"""commfuse.pipeline: layout, schedules, the forward/joint traces, the partition, and the runner
on 2 stages x 2 gloo ranks against (a) the eager stage modules with the differentiable
stage_transfer and (b) the unsharded model in one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.models.pipeline_models import (
    PipelineModelConfig,
    build_stages,
    make_full_data,
    make_loss_fn,
    position_view,
    reference_step,
    shard_dims,
    shard_of,
)
from commfuse.ops import STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD
from commfuse.pipeline import (
    PartitionError,
    PipelineProgram,
    PipelineRunner,
    check_schedule,
    partition,
    plan_layout,
    stage_actions,
    trace_forward,
    trace_joint,
)
from commfuse.pipeline.collectives import COPY_TO_GROUP, REDUCE_FROM_GROUP
from commfuse.pipeline.trace import PARAM, TARGET, X, InputSpec, collect_inputs
from commfuse.testing import assert_bitwise_equal_tree, assert_close_tree, fake_process_group

import _jobs_pipeline_runner as jobs

STAGES = [[0, 1], [2, 3]]
c10d, c10d_ag = torch.ops._c10d_functional, torch.ops._c10d_functional_autograd


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _group_names(gm) -> set[str]:
    return {
        a
        for n in gm.graph.nodes
        if n.op == "call_function"
        for a in n.args
        if isinstance(a, str) and a.startswith("commfuse.pp.")
    }


def _traced(kind: str, rank: int = 0, mb: int = 2):
    """Forward + joint program of a 2x2 pipeline model, traced as ``rank`` (fake tensors)."""
    cfg = PipelineModelConfig(kind=kind)
    with fake_process_group(4, rank=rank):
        layout = plan_layout(STAGES, rank, 4)
        stages = build_stages(cfg, layout.stages, layout.position, 2)
        x, t = make_full_data(cfg, 2, 4, 8)
        xm = position_view(cfg, 2, layout.position, x)[:mb]
        tm = position_view(cfg, 2, layout.position, t)[:mb]
        prog = trace_forward(layout, stages, make_loss_fn(cfg, 2), xm, tm)
        _, tensors = collect_inputs(stages)
        trace_joint(prog, [*tensors, xm, tm])
    return prog, stages


# ------------------------------------------------------------------ layout
def test_plan_layout_groups_positions_and_pairs():
    lay = plan_layout([[5, 4], [0, 1], [3, 2]], rank=2, world_size=6)
    assert lay.stage_ranks == ((4, 5), (0, 1), (2, 3))
    assert (lay.stage, lay.position) == (2, 0)
    assert [g.name for g in lay.stages] == ["commfuse.pp.stage0", "commfuse.pp.stage1", "commfuse.pp.stage2"]
    assert [g.name for g in lay.boundaries] == ["commfuse.pp.boundary0", "commfuse.pp.boundary1"]
    assert lay.boundaries[0].ranks == (0, 1, 4, 5) and lay.boundaries[0].size == 4
    # boundary 0: stage 0 = global (4, 5) = group ranks (2, 3) sends to stage 1 = (0, 1) = (0, 1)
    assert lay.boundary_pairs(0) == ([2, 3], [0, 1])
    assert lay.boundary_pairs(1) == ([0, 1], [2, 3])
    with pytest.raises(ValueError, match="boundary 2 does not exist"):
        lay.boundary_pairs(2)


@pytest.mark.parametrize(
    "stage_ranks, world, match",
    [
        ([[0, 1], [2]], 3, "equal sizes"),
        ([[0, 1], [1, 2]], 3, "stage 0 and stage 1"),
        ([[0, 1], [2, 3]], 6, r"ranks \[4, 5\] are in no stage"),
        ([[0, 1], [2, 7]], 4, "outside the world"),
        ([], 4, "non-empty list"),
        ([[0, 0], [1, 2]], 4, "twice"),
    ],
)
def test_plan_layout_rejects_bad_stage_ranks(stage_ranks, world, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(stage_ranks, 0, world)


# ------------------------------------------------------------------ schedules
def test_schedule_orders():
    assert [str(a) for a in stage_actions("1f1b", 4, 0, 6)] == [
        "F0",
        "F1",
        "F2",
        "F3",
        "B0",
        "F4",
        "B1",
        "F5",
        "B2",
        "B3",
        "B4",
        "B5",
    ]
    assert [str(a) for a in stage_actions("1f1b", 4, 3, 3)] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert [str(a) for a in stage_actions("1f1b", 4, 1, 1)] == [
        "F0",
        "B0",
    ]  # fewer micro-batches than warm-up
    assert [str(a) for a in stage_actions("gpipe", 2, 1, 2)] == ["F0", "F1", "B0", "B1"]
    with pytest.raises(ValueError, match="schedule: expected one of"):
        stage_actions("zb", 2, 0, 2)


def test_schedules_are_deadlock_free_and_in_order():
    for sched in ("gpipe", "1f1b"):
        for num in range(1, 6):
            for m in range(1, 9):
                rounds = check_schedule([stage_actions(sched, num, s, m) for s in range(num)])
                assert sum(len(r) for r in rounds) == 2 * m * num


def test_check_schedule_rejects_deadlock_and_mixed_order():
    from commfuse.pipeline import Action as A

    # last stage waits for a gradient of micro-batch 0 before it ran F0's... its own B0 first
    with pytest.raises(ValueError, match="B0 before F0"):
        check_schedule([[A("F", 0), A("B", 0)], [A("B", 0), A("F", 0)]])
    # stage 0 waits for B0's gradient before sending F1, stage 1 needs F1 before B0: cycle
    with pytest.raises(ValueError, match="deadlocks"):
        check_schedule(
            [[A("F", 0), A("B", 0), A("F", 1), A("B", 1)], [A("F", 0), A("F", 1), A("B", 0), A("B", 1)]]
        )
    # stage 1 consumes forward messages out of order: p2p matching would mix micro-batches
    with pytest.raises(ValueError, match="mix micro-batches"):
        check_schedule(
            [[A("F", 0), A("F", 1), A("B", 0), A("B", 1)], [A("F", 1), A("F", 0), A("B", 0), A("B", 1)]]
        )


# ------------------------------------------------------------------ traces
def test_forward_graph_keeps_autograd_level_ops_and_joint_lowers_them():
    prog, _ = _traced("sp")
    fw = _targets(prog.forward)
    # the forward graph: what boundary fusion rewrites (autograd-capable ops only)
    assert fw.count(STAGE_TRANSFER_AUTOGRAD) == 1
    assert fw.count(c10d_ag.all_gather_into_tensor.default) == 4  # 2 blocks x 2 stages
    assert fw.count(c10d_ag.reduce_scatter_tensor.default) == 4
    assert fw.count(COPY_TO_GROUP) == 4
    assert c10d.all_gather_into_tensor.default not in fw
    # the joint graph: functional collectives + async transfers, each waited
    jt = _targets(prog.joint)
    assert jt.count(STAGE_TRANSFER) == 2 and STAGE_TRANSFER_AUTOGRAD not in jt  # forward + backward
    assert not any(getattr(t, "namespace", "") == "_c10d_functional_autograd" for t in jt)
    assert COPY_TO_GROUP not in jt
    assert jt.count(c10d.all_gather_into_tensor.default) == 8  # forward 4 + backward of the reduce_scatters
    assert jt.count(c10d.all_reduce.default) == 4  # norm weight gradients (copy_to_group's backward)
    issued = sum(
        jt.count(t)
        for t in (
            STAGE_TRANSFER,
            c10d.all_gather_into_tensor.default,
            c10d.reduce_scatter_tensor.default,
            c10d.all_reduce.default,
        )
    )
    assert jt.count(c10d.wait_tensor.default) == issued
    assert prog.grad_names == [s.name for s in prog.inputs if s.kind == PARAM]

    prog_tp, _ = _traced("tp")
    assert _targets(prog_tp.forward).count(REDUCE_FROM_GROUP) == 4
    assert REDUCE_FROM_GROUP not in _targets(prog_tp.joint)


def test_every_rank_traces_the_same_program():
    """Rank 0 (stage 0) and rank 3 (stage 1, position 1) trace the same graphs: SPMD-symmetric shapes."""
    a, _ = _traced("ep", rank=0)
    b, _ = _traced("ep", rank=3)
    assert a.forward.code == b.forward.code
    assert a.joint.code == b.joint.code


# ------------------------------------------------------------------ partition
def test_partition_places_nodes_by_stage_and_phase():
    prog, _ = _traced("sp")
    parted = partition(prog)
    assert set(parted.parts) == {(0, "fw"), (0, "bw"), (1, "fw"), (1, "bw")}
    for (s, ph), part in parted.parts.items():
        # every collective of a part runs on its own stage's group or the boundary
        assert _group_names(part.gm) <= {f"commfuse.pp.stage{s}", "commfuse.pp.boundary0"}, (s, ph)
        assert len(part.transfers) == 1  # both sides execute the transfer of their phase
        kinds = [o.kind for o in part.outputs]
        sender = (s, ph) in ((0, "fw"), (1, "bw"))
        assert kinds.count("pending") == (1 if sender else 0), (s, ph)
        # the receiver feeds the transfer a zeros stand-in and waits it; the sender does not wait
        tr = next(n for n in part.gm.graph.nodes if n.target is STAGE_TRANSFER)
        assert (tr.args[0].target is torch.ops.aten.zeros.default) == (not sender)
        assert any(u.target is c10d.wait_tensor.default for u in tr.users) == (not sender)
    fw1 = [o.kind for o in parted.part(1, "fw").outputs]
    assert fw1[0] == "loss" and "loss" not in [o.kind for o in parted.part(0, "fw").outputs]
    for s in (0, 1):
        grads = [o.key for o in parted.part(s, "bw").outputs if o.kind == "grad"]
        assert grads == [n for n in prog.grad_names if n.startswith(f"stage{s}.")]
        # the backward reads only its own stage's forward values
        saved_in = {i.key for i in parted.part(s, "bw").inputs if i.kind == "saved"}
        assert saved_in == {o.key for o in parted.part(s, "fw").outputs if o.kind == "saved"}
        assert all(parted.stage_of[k] == s and parted.phase_of[k] == "fw" for k in saved_in)
    # every joint node is somewhere
    placed = set()
    for part in parted.parts.values():
        placed |= {n.name for n in part.gm.graph.nodes}
    computing = [n.name for n in prog.joint.graph.nodes if n.op == "call_function"]
    assert set(computing) <= placed


def _hand_program(fn, *, w_shape=(4, 4)):
    """A two-stage whole-model function (w0: stage 0, w1: stage 1) traced as rank 0."""
    specs = [
        InputSpec(PARAM, 0, "stage0.w", True),
        InputSpec(PARAM, 1, "stage1.w", True),
        InputSpec(X, 0, X),
        InputSpec(TARGET, 1, TARGET),
    ]
    tensors = [
        torch.randn(w_shape, requires_grad=True),
        torch.randn(w_shape, requires_grad=True),
        torch.randn(2, 4),
        torch.randn(2, 4),
    ]
    with fake_process_group(4, rank=0):
        layout = plan_layout(STAGES, 0, 4)
        gm = make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*tensors)
        return trace_joint(PipelineProgram(layout, gm, specs), tensors)


def _send(h):
    return STAGE_TRANSFER_AUTOGRAD(h, [0, 1], [2, 3], 4, "commfuse.pp.boundary0")


def test_partition_names_a_value_crossing_stages_without_a_transfer():
    def crossing(w0, w1, x, t):
        h0 = torch.tanh(x @ w0)
        out = _send(h0) @ w1 + h0  # h0, a stage-0 value, read by stage 1 directly
        return ((out - t) ** 2).sum()

    prog = _hand_program(crossing)
    with pytest.raises(
        PartitionError, match=r"reads values of stages \[0, 1\].*stage 0: tanh.*stage_transfer/m2ms"
    ):
        partition(prog)


def test_partition_copies_constants_into_their_users_parts():
    def consts(w0, w1, x, t):
        c = torch.full((4,), 2.0)  # read by both stages
        h = _send((x @ w0) * c)
        out = (h @ w1) * c + torch.arange(4.0)  # arange: stage 1 only
        return ((out - t) ** 2).sum()

    parted = partition(_hand_program(consts))
    full, arange = torch.ops.aten.full.default, torch.ops.aten.arange.default
    t = {k: _targets(p.gm) for k, p in parted.parts.items()}
    assert full in t[(0, "fw")] and full in t[(1, "fw")]
    assert arange in t[(1, "fw")] and arange not in t[(0, "fw")] and arange not in t[(1, "bw")]
    assert full in t[(0, "bw")]  # d(x @ w0 * c)/dw0 needs c: copied, not saved per micro-batch
    assert [n for n, s in parted.stage_of.items() if s is None]  # the constants have no stage


def test_partition_refuses_a_random_constant():
    def rnd(w0, w1, x, t):
        noise = torch.rand(4)
        out = _send(x @ w0 + noise) @ w1 + noise
        return ((out - t) ** 2).sum()

    with pytest.raises(PartitionError, match="random op"):
        partition(_hand_program(rnd))


def test_forward_passes_rewrite_the_forward_before_the_joint_is_derived():
    """The seam for boundary fusion: a pass on the forward graph; the backward follows from autograd."""
    cfg = PipelineModelConfig(kind="tp")
    seen = []

    def silu_to_gelu(program):
        seen.append(_targets(program.forward).count(STAGE_TRANSFER_AUTOGRAD))
        for n in program.forward.graph.nodes:
            if n.target is torch.ops.aten.silu.default:
                n.target = torch.ops.aten.gelu.default

    with fake_process_group(4, rank=2):
        layout = plan_layout(STAGES, 2, 4)
        stages = build_stages(cfg, layout.stages, layout.position, 2)
        runner = PipelineRunner(layout, stages, make_loss_fn(cfg, 2), 2, forward_passes=[silu_to_gelu])
        x, t = make_full_data(cfg, 2, 4, 8)
        parted = runner.build(x[:2], t[:2])
    assert seen == [1]
    jt = _targets(runner.program.joint)
    assert torch.ops.aten.gelu.default in jt and torch.ops.aten.gelu_backward.default in jt
    assert torch.ops.aten.silu.default not in jt
    assert torch.ops.aten.gelu.default in _targets(parted.part(1, "fw").gm)


def test_runner_rejects_bad_arguments():
    cfg = PipelineModelConfig(kind="tp")
    lay = plan_layout(STAGES, 0, 4)
    stages = build_stages(cfg, lay.stages, lay.position, 2)
    loss = make_loss_fn(cfg, 2)
    with pytest.raises(ValueError, match="stages: the layout has 2 stages"):
        PipelineRunner(lay, stages[:1], loss, 2)
    with pytest.raises(ValueError, match="schedule: expected one of"):
        PipelineRunner(lay, stages, loss, 2, schedule="interleaved")
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        PipelineRunner(lay, stages, loss, 0)
    with pytest.raises(ValueError, match="reduction"):
        PipelineRunner(lay, stages, loss, 2, reduction="avg")
    r = PipelineRunner(lay, stages, loss, 3)
    with pytest.raises(ValueError, match="x: dim 0 .* 3 equal micro-batches"):
        r.step(torch.randn(4, 8, 16), torch.randn(3, 8, 16))
    with pytest.raises(ValueError, match="target: expected a tensor on every rank"):
        r.step(torch.randn(3, 8, 16), None)


# ------------------------------------------------------------------ multi-rank numerics
def _check_against_references(results, kind, mbs, num_stages, size):
    cfg = PipelineModelConfig(kind=kind, num_stages=num_stages)
    x_full, t_full = make_full_data(cfg, size, 4, 8)
    full_stages = build_stages(cfg, None, 0, size)
    last = num_stages - 1
    for m in mbs:
        ref_losses, ref_grads = reference_step(cfg, size, x_full, t_full, m)
        for rank, out in enumerate(results):
            s, p = out["stage"], out["position"]
            assert (s, p) == (rank // size, rank % size)
            assert out["aliases"] == {
                **{f"commfuse.pp.stage{k}": size if k == s else None for k in range(num_stages)},
                **{
                    f"commfuse.pp.boundary{b}": 2 * size if s in (b, b + 1) else None
                    for b in range(num_stages - 1)
                },
            }
            dims = shard_dims(full_stages[s])
            expected = {k: shard_of(g, dims[k], size, p) for k, g in ref_grads[s].items()}
            eager = out["eager"][str(m)]
            gp, fb = out["runs"][f"{m}-gpipe"], out["runs"][f"{m}-1f1b"]
            for name, run in (("gpipe", gp), ("1f1b", fb)):
                where = f"{kind} m={m} {name} on rank {rank}"
                assert run["other_grads_untouched"] and run["state_dict_unchanged"], where
                assert run["grads"].keys() == expected.keys()
                assert_close_tree(run["grads"], eager["grads"], msg=f"vs eager stage_transfer, {where}")
                assert_close_tree(run["grads"], expected, msg=f"vs unsharded model, {where}")
                if s == last:
                    assert_close_tree(run["loss"], eager["loss"], msg=where)
                    assert_close_tree(run["loss"], ref_losses[p], msg=where)
                else:
                    assert run["loss"] is None and eager["loss"] is None
            # the two schedules run the same parts on the same data, accumulating in the same order
            assert_bitwise_equal_tree(fb["grads"], gp["grads"], msg=f"{kind} m={m} rank {rank}")


@pytest.mark.slow(reason="runs a pipeline-parallel model on 4 gloo ranks")
@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["sp", "tp", "ep"])
def test_pipeline_matches_eager_and_unsharded(rank_pool_4, kind, tmp_path):
    """2 stages x 2 ranks; SP+PP, TP+PP, PP+EP; 2 and 4 micro-batches; GPipe and 1F1B."""
    mbs = (2, 4)
    dump = str(tmp_path) if kind == "sp" else None
    results = rank_pool_4.run(jobs.pipeline_matches, kind, mbs, ("gpipe", "1f1b"), dump_dir=dump)
    _check_against_references(results, kind, mbs, 2, 2)
    if dump:
        for rank in range(4):
            names = {f.name for f in (tmp_path / f"rank{rank}").iterdir()}
            assert {
                "forward.py.txt",
                "joint.py.txt",
                "stage0_fw.py.txt",
                "stage0_bw.py.txt",
                "stage1_fw.py.txt",
                "stage1_bw.py.txt",
            } <= names
        assert "commfuse.stage_transfer" in (tmp_path / "rank2" / "stage1_fw.py.txt").read_text()
        index = json.loads((tmp_path / "index.json").read_text())  # the layout every commfuse dump has
        assert index["world_size"] == 4 and [e["rank"] for e in index["ranks"]] == [0, 1, 2, 3]
        assert "stage1_fw.py.txt" in index["ranks"][2]["files"]


@pytest.mark.multirank
def test_four_stages_one_rank_each(rank_pool_4):
    """Middle stages receive and send in both phases; 1F1B warm-up of 3, 2, 1, 0 forwards."""
    mbs = (4,)
    results = rank_pool_4.run(
        jobs.pipeline_matches, "tp", mbs, ("gpipe", "1f1b"), stage_ranks=[[0], [1], [2], [3]]
    )
    _check_against_references(results, "tp", mbs, 4, 1)


def test_tuple_stage_outputs_get_one_transfer_each():
    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            h = x @ self.w
            return h, torch.tanh(h)

    class Join(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, a, b):
            return (a * b) @ self.w

    with fake_process_group(4, rank=1):
        lay = plan_layout(STAGES, 1, 4)
        runner = PipelineRunner(lay, [Split(), Join()], lambda out, t: ((out - t) ** 2).sum(), 2)
        parted = runner.build(torch.randn(2, 4), torch.randn(2, 4))
    assert _targets(runner.program.forward).count(STAGE_TRANSFER_AUTOGRAD) == 2
    for part in parted.parts.values():
        assert len(part.transfers) == 2
