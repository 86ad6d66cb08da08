"""Tests of the test harness itself (commfuse.testing).

Jobs sent to rank pools must be module-level functions (they are pickled by
reference), hence the ``_job_*`` functions below.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from commfuse.testing import (
    RankFailure,
    RankPool,
    RankTimeout,
    assert_bitwise_equal_tree,
    assert_close_tree,
    fake_mesh,
    fake_process_group,
    tolerances,
    train_step_outputs,
)

# --------------------------------------------------------------------------
# Rank jobs
# --------------------------------------------------------------------------


def _job_agreement_settings() -> tuple[bool, str, str, str]:
    """What the suite's worker initializer (tests/_jobs_suite.py) left in this rank process."""
    import commfuse

    installed = getattr(type(commfuse.backend()).__init__, "_suite_net_off", False)
    unset = commfuse.backend(commfuse.Config(inner_compiler="eager")).config.check_agreement
    asked = commfuse.backend(commfuse.Config(check_agreement="raise")).config.check_agreement
    default = commfuse.backend().config.check_agreement
    return installed, unset, asked, default


def _job_rank_info() -> tuple[int, int, int]:
    # Rank 0 answers last, so rank order cannot come from arrival order.
    if dist.get_rank() == 0:
        time.sleep(0.2)
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def _job_all_reduce() -> torch.Tensor:
    t = torch.tensor([float(dist.get_rank() + 1), 1.0])
    dist.all_reduce(t)
    return t


def _job_raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"planted failure on rank {bad_rank}")
    return dist.get_rank()


def _job_skip_all_reduce_on_rank(skip_rank: int) -> int:
    if dist.get_rank() != skip_rank:
        dist.all_reduce(torch.ones(1))  # never matched: hangs
    return dist.get_rank()


def _job_raise_before_all_reduce(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise KeyError("planted failure before the collective")
    dist.all_reduce(torch.ones(1))  # the peer never joins: stuck
    return dist.get_rank()


def _job_exit_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(7)  # simulates a crash (e.g. a segfault in a kernel)
    return dist.get_rank()


def _job_make_subgroup() -> tuple[int, int]:
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    group = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == dist.get_world_size()
    return before, len(c10d._world.pg_map)


class _AllReduceMLP(nn.Module):
    """Data-parallel-ish toy: the hidden activation is summed over ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = funcol.all_reduce(self.w1(x), "sum", dist.group.WORLD)
        return self.w2(torch.relu(h))


def _make_all_reduce_mlp() -> nn.Module:
    torch.manual_seed(0)
    return _AllReduceMLP()


def _rank_inputs(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(3, 8, generator=gen)


def _job_eager_vs_aot_eager() -> dict[str, dict]:
    eager = train_step_outputs(_make_all_reduce_mlp, _rank_inputs, steps=2, lr=0.1)
    compiled = train_step_outputs(_make_all_reduce_mlp, _rank_inputs, backend="aot_eager", steps=2, lr=0.1)
    return {"eager": eager, "compiled": compiled}


# --------------------------------------------------------------------------
# Rank pool
# --------------------------------------------------------------------------


@pytest.mark.multirank
def test_results_are_returned_in_rank_order(rank_pool_2: RankPool) -> None:
    results = rank_pool_2.run(_job_rank_info)
    assert [r[0] for r in results] == [0, 1]
    assert [r[1] for r in results] == [2, 2]
    assert [r[2] for r in results] == rank_pool_2.pids


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_ranks(world_size: int, request: pytest.FixtureRequest) -> None:
    pool: RankPool = request.getfixturevalue(f"rank_pool_{world_size}")
    results = pool.run(_job_all_reduce)
    expected = torch.tensor([world_size * (world_size + 1) / 2, float(world_size)])
    assert len(results) == world_size
    for rank, value in enumerate(results):
        assert torch.equal(value, expected), f"rank {rank}: {value}"


@pytest.mark.multirank
def test_raising_rank_reports_rank_and_remote_traceback(rank_pool_2: RankPool) -> None:
    generation = rank_pool_2.generation
    with pytest.raises(RankFailure) as info:
        rank_pool_2.run(_job_raise_on_rank, 1)
    text = str(info.value)
    assert "rank 1" in text
    assert "ValueError: planted failure on rank 1" in text
    assert "_job_raise_on_rank" in text  # the remote frame, not just the message
    assert "Traceback (most recent call last)" in text
    assert list(info.value.failures) == [1]
    assert info.value.failures[1].exc_type == "ValueError"
    # Every rank answered and the group is in sync: no restart needed.
    assert not info.value.restarted
    assert rank_pool_2.generation == generation
    assert rank_pool_2.run(_job_all_reduce)[1][0].item() == 3.0


@pytest.mark.slow(reason="waits out a planted hang, then restarts the rank pool")
@pytest.mark.multirank
def test_planted_hang_times_out_and_pool_recovers(rank_pool_2: RankPool) -> None:
    generation = rank_pool_2.generation
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        rank_pool_2.run(_job_skip_all_reduce_on_rank, 1, timeout=3.0)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 15.0
    assert info.value.missing_ranks == [0]
    assert info.value.finished_ranks == [1]
    assert "ranks [0] did not answer" in str(info.value)
    assert rank_pool_2.generation == generation + 1
    results = rank_pool_2.run(_job_all_reduce)
    assert [r[0].item() for r in results] == [3.0, 3.0]
    # the restarted ranks ran the suite's worker initializer again
    assert rank_pool_2.run(_job_agreement_settings) == [(True, "off", "raise", "off")] * 2


@pytest.mark.slow(reason="replaces the pool's workers once")
@pytest.mark.multirank
def test_workers_whose_threads_piled_up_are_replaced_before_the_next_job(
    rank_pool_2: RankPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import commfuse.tools.rank_pool as rank_pool

    generation, recycled, pids = rank_pool_2.generation, rank_pool_2.recycled, rank_pool_2.pids
    monkeypatch.setattr(rank_pool, "MAX_WORKER_THREADS", 1)  # every worker holds more
    results = rank_pool_2.run(_job_all_reduce)
    assert [r[0].item() for r in results] == [3.0, 3.0]
    assert rank_pool_2.recycled == recycled + 1 and rank_pool_2.generation == generation
    assert not set(rank_pool_2.pids) & set(pids)
    monkeypatch.setattr(rank_pool, "MAX_WORKER_THREADS", 10_000)
    rank_pool_2.run(_job_all_reduce)
    assert rank_pool_2.recycled == recycled + 1


@pytest.mark.multirank
def test_suite_ranks_run_the_net_only_where_a_config_asks(rank_pool_2: RankPool) -> None:
    """tests/conftest.py's worker initializer: a Config that leaves check_agreement unset compiles
    without the agreement net in the suite's rank processes; one that says it keeps it. This
    process (no initializer) keeps the product's default."""
    import commfuse

    assert rank_pool_2.run(_job_agreement_settings) == [(True, "off", "raise", "off")] * 2
    assert commfuse.backend(commfuse.Config()).config.check_agreement == "fallback"


@pytest.mark.slow(reason="waits out a rank stuck in a collective, then restarts the rank pool")
@pytest.mark.multirank
def test_failure_with_peer_stuck_in_collective_recovers(rank_pool_2: RankPool) -> None:
    grace = rank_pool_2.failure_grace_s
    rank_pool_2.failure_grace_s = 1.0  # keep the test fast
    try:
        with pytest.raises(RankFailure) as info:
            rank_pool_2.run(_job_raise_before_all_reduce, 1, timeout=30.0)
    finally:
        rank_pool_2.failure_grace_s = grace
    assert list(info.value.failures) == [1]
    assert "KeyError" in str(info.value) and "_job_raise_before_all_reduce" in str(info.value)
    assert info.value.stuck_ranks == [0]
    assert info.value.restarted
    assert [r[0].item() for r in rank_pool_2.run(_job_all_reduce)] == [3.0, 3.0]


@pytest.mark.slow(reason="restarts the rank pool after a planted crash")
@pytest.mark.multirank
def test_crashed_rank_is_reported_and_pool_recovers(rank_pool_2: RankPool) -> None:
    with pytest.raises(RankFailure, match="exited with code 7") as info:
        rank_pool_2.run(_job_exit_on_rank, 1, timeout=30.0)
    assert list(info.value.failures) == [1]
    assert info.value.restarted
    assert [r[0].item() for r in rank_pool_2.run(_job_all_reduce)] == [3.0, 3.0]


@pytest.mark.multirank
def test_unpicklable_job_fails_in_parent(rank_pool_2: RankPool) -> None:
    generation = rank_pool_2.generation
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        rank_pool_2.run(lambda: 0)
    assert rank_pool_2.generation == generation


@pytest.mark.multirank
def test_subgroups_do_not_leak_between_jobs(rank_pool_2: RankPool) -> None:
    first = rank_pool_2.run(_job_make_subgroup)
    second = rank_pool_2.run(_job_make_subgroup)
    # Only the default group exists when a job starts.
    assert [before for before, _ in first + second] == [1, 1, 1, 1]
    assert [after for _, after in second] == [2, 2]


@pytest.mark.slow(reason="compiles a train step on gloo ranks")
@pytest.mark.multirank
def test_train_step_eager_vs_aot_eager_is_bitwise_equal(rank_pool_2: RankPool) -> None:
    results = rank_pool_2.run(_job_eager_vs_aot_eager)
    for rank, res in enumerate(results):
        eager = res["eager"]
        assert set(eager) == {"outputs", "loss", "grads", "params"}
        assert len(eager["outputs"]) == len(eager["loss"]) == 2
        assert set(eager["grads"]) == {"w1.weight", "w1.bias", "w2.weight", "w2.bias"}
        assert all(g is not None and g.abs().sum() > 0 for g in eager["grads"].values())
        assert_bitwise_equal_tree(res["compiled"], eager, msg=f"on rank {rank}")
    # The all_reduce makes outputs agree across ranks; w1's grads see each
    # rank's own inputs, so they must not (else ranks got the same data).
    assert_close_tree(results[1]["eager"]["outputs"], results[0]["eager"]["outputs"])
    with pytest.raises(AssertionError):
        assert_close_tree(results[1]["eager"]["grads"], results[0]["eager"]["grads"])


# --------------------------------------------------------------------------
# Fake process groups
# --------------------------------------------------------------------------


def _traced_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def _call_targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_fake_process_group_traces_collectives_at_world_size_64() -> None:
    for _ in range(2):  # usable repeatedly in one process
        with fake_process_group(64, rank=5):
            assert dist.get_world_size() == 64
            assert dist.get_rank() == 5
            gm = make_fx(_traced_all_reduce, tracing_mode="fake")(torch.randn(4))
        assert not dist.is_initialized()
        targets = _call_targets(gm)
        assert torch.ops._c10d_functional.all_reduce.default in targets
        assert torch.ops._c10d_functional.wait_tensor.default in targets


def test_fake_process_group_refuses_to_nest() -> None:
    with fake_process_group(8):
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_process_group(4):
                pass
        assert dist.get_world_size() == 8  # the outer group is untouched
    assert not dist.is_initialized()


def test_fake_mesh_builds_named_2d_mesh() -> None:
    with fake_mesh(64, (8, 8), ("dp", "tp")) as mesh:
        assert tuple(mesh.shape) == (8, 8)
        assert mesh["tp"].size() == 8
        assert mesh.get_group("dp").size() == 8
        gm = make_fx(lambda x: funcol.all_reduce(x, "sum", (mesh, 1)), tracing_mode="fake")(torch.randn(4))
        assert torch.ops._c10d_functional.all_reduce.default in _call_targets(gm)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="does not multiply"):
        with fake_mesh(64, (8, 4)):
            pass


# --------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------

_FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=str)
def test_tolerance_boundary(dtype: torch.dtype) -> None:
    """A perturbation just inside the policy passes, just outside fails."""
    rtol, atol = tolerances(dtype)
    base = 4.0
    allowed = atol + rtol * base
    expected = torch.full((16,), base, dtype=dtype)
    inside = (expected.double() + 0.8 * allowed).to(dtype)
    outside = (expected.double() + 1.25 * allowed).to(dtype)
    # Rounding to `dtype` must preserve the premise of the test.
    assert (inside.double() - base).abs().max() <= allowed
    assert (outside.double() - base).abs().min() > allowed
    assert_close_tree({"x": inside}, {"x": expected})
    with pytest.raises(AssertionError, match=r"x \(policy dtype"):
        assert_close_tree({"x": outside}, {"x": expected})


def test_tolerances_table_and_summands() -> None:
    assert tolerances(torch.float32) == (1e-4, 1e-5)
    assert tolerances(torch.bfloat16) == (2e-2, 1e-2)
    assert tolerances(torch.int64) == (0.0, 0.0)
    assert tolerances(torch.complex64) == tolerances(torch.float32)
    # Widening only applies when it exceeds the base atol.
    assert tolerances(torch.float32, summands=4) == (1e-4, 1e-5)
    assert tolerances(torch.bfloat16, summands=4)[1] == pytest.approx(8 * 2**-8 * 4)


def _sum_in_order(parts: list[torch.Tensor], order: list[int], dtype: torch.dtype) -> torch.Tensor:
    acc = parts[order[0]].to(dtype)
    for r in order[1:]:
        acc = acc + parts[r].to(dtype)
    return acc


def _ring_reduce_scatter_order_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Sum as a ring reduce-scatter would: chunk c starts at rank c+1."""
    n = len(parts)
    chunks = [p.chunk(n) for p in parts]
    out = [
        _sum_in_order([c[i] for c in chunks], [(i + 1 + k) % n for k in range(n)], dtype) for i in range(n)
    ]
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_policy_covers_reordered_collective_sums(dtype: torch.dtype) -> None:
    """all_reduce (rank order) vs reduce_scatter+all_gather (ring order) over 4
    ranks: fp32 passes the base policy; a reduction accumulated in bf16 needs
    ``summands`` (and visibly breaks the base atol where results cancel)."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(1 << 14, generator=gen) for _ in range(4)]
    reference = _sum_in_order(parts, [0, 1, 2, 3], dtype)
    reordered = _ring_reduce_scatter_order_sum(parts, dtype)
    assert not torch.equal(reordered, reference)  # the reorder is real
    assert_close_tree(reordered, reference, summands=4)
    if dtype == torch.float32:
        assert_close_tree(reordered, reference)
    else:
        with pytest.raises(AssertionError):
            assert_close_tree(reordered, reference)


def test_close_tree_reports_paths_of_all_mismatches() -> None:
    w = torch.ones(3, 3)
    expected = {"grads": {"w1.weight": w, "w2.weight": w}, "loss": [1.0, 2.0]}
    actual = {"grads": {"w1.weight": w + 1, "w2.weight": w}, "loss": [1.0, 2.5]}
    with pytest.raises(AssertionError) as info:
        assert_close_tree(actual, expected, msg="on rank 2")
    text = str(info.value)
    assert "grads['w1.weight'] on rank 2" in text
    assert "loss[1] on rank 2" in text
    assert "w2.weight" not in text
    assert "2 mismatching leaves" in text


def test_close_tree_reports_structure_mismatches() -> None:
    with pytest.raises(AssertionError, match=r"missing \['b'\], unexpected \['c'\]"):
        assert_close_tree({"a": 1, "c": 2}, {"a": 1, "b": 2})
    with pytest.raises(AssertionError, match=r"outputs: length 1 != expected 2"):
        assert_close_tree({"outputs": [torch.ones(1)]}, {"outputs": [torch.ones(1)] * 2})
    with pytest.raises(AssertionError, match="dtype"):
        assert_close_tree(torch.ones(2, dtype=torch.float64), torch.ones(2))
    with pytest.raises(AssertionError):  # integer tensors must match exactly
        assert_close_tree(torch.tensor([3]), torch.tensor([2]))
    assert_close_tree((torch.ones(2), None, "x"), [torch.ones(2), None, "x"])


def test_bitwise_tree_is_stricter_than_close() -> None:
    x = torch.linspace(-1, 1, 17)
    one_ulp = torch.nextafter(x, torch.full_like(x, 2.0))
    assert_close_tree(one_ulp, x)
    with pytest.raises(AssertionError, match="17 of 17 elements differ bitwise"):
        assert_bitwise_equal_tree({"g": one_ulp}, {"g": x})
    zeros = torch.zeros(2)
    assert_close_tree(-zeros, zeros)
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise_equal_tree(-zeros, zeros)
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    assert_bitwise_equal_tree([nan, 0.5, 3], [nan.clone(), 0.5, 3])
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal_tree(x.double(), x)
    with pytest.raises(AssertionError, match=r"\[1\] on rank 3"):
        assert_bitwise_equal_tree([0.5, 0.0], [0.5, -0.0], msg="on rank 3")


def test_train_step_outputs_in_process() -> None:
    """Single process, no collectives: eager twice is deterministic, SGD moves
    params, and grads are those of the last step."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

    def inputs(step: int) -> torch.Tensor:
        return torch.full((2, 4), float(step + 1))

    first = train_step_outputs(make, inputs, steps=3, lr=0.5)
    second = train_step_outputs(make, inputs, steps=3, lr=0.5)
    assert_bitwise_equal_tree(first, second)
    fresh = make()
    with pytest.raises(AssertionError):
        assert_close_tree(first["params"], dict(fresh.named_parameters()))
    no_step = train_step_outputs(make, lambda: torch.ones(2, 4), loss_fn=lambda y: y.mean())
    assert no_step["loss"][0].shape == ()
    assert_bitwise_equal_tree(no_step["params"], {k: v.detach() for k, v in fresh.named_parameters()})
