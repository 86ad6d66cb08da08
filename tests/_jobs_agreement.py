"""Rank-pool jobs for tests/test_agreement.py (module level: the pool pickles them).

The planted divergences are deliberately wrong programs: the net must catch them at the first
execution and fall back on every rank, without a hang, and train equal to eager."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.passes import GraphPass, PassResult, Stage, register_pass, unregister_pass
from commfuse.reference.numerics import assert_close_tree, train_step_outputs


class Rank1SwapsGathers(GraphPass):
    """Test-only, deliberately WRONG: on rank 1 the forward graph issues its second all_gather
    before its first (a decision that depends on the rank)."""

    name = "test_rank1_swaps_gathers"
    stage = Stage.SCHEDULE

    def run(self, ctx):
        if dist.get_rank() != 1 or ctx.graph_kind != "forward":
            return PassResult(changed=False)
        gathers = [c.start for c in ctx.ir.collectives if c.kind.value == "all_gather"]
        order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
        for first, second in zip(gathers, gathers[1:], strict=False):
            # the second gather and whatever it reads that sits after the first, moved before it
            need, stack, seen = [], [second], set()
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if order[n] > order[first]:
                    need.append(n)
                    stack.extend(n.all_input_nodes)
            if first in seen:
                continue  # the second reads the first: not swappable
            for n in sorted(need, key=order.__getitem__):
                first.prepend(n)
            return PassResult(changed=True, counts={"swapped": 1})
        return PassResult(changed=False)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def planted_divergence_falls_back(plant: Optional[str], batches: tuple[int, ...] = (4,)) -> dict[str, Any]:
    """SimpleFSDP data parallel (the README's style), two SGD steps, compiled with the default
    net and ``plant``: None (every rank compiles alike), "pass" (rank 1's forward issues two
    all_gathers in the other order: gloo would fail with a size mismatch, equal sizes would mix
    up data) or "config" (rank 1 compiles under another setting, same collectives). Loss and
    gradients must equal eager. ``batches``: this rank's local batch, per rank (uneven ones too)."""
    from commfuse.models import simple_fsdp

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    batch = batches[rank % len(batches)]

    def model() -> nn.Module:
        torch.manual_seed(0)
        return simple_fsdp.data_parallel(_MLP(), mesh, "fully_shard")

    def inputs(step: int) -> torch.Tensor:
        return torch.randn(batch, 8, generator=torch.Generator().manual_seed(100 * step + rank))

    register_pass(Rank1SwapsGathers)
    try:
        torch._dynamo.reset()
        ref = train_step_outputs(model, inputs, steps=2, lr=0.05, loss_fn=_loss)
        passes = ["sink_waits", "test_rank1_swaps_gathers"] if plant == "pass" else ["sink_waits"]
        overrides = {"schedule_memory_budget": 1.5} if plant == "config" and rank == 1 else {}
        # settings of its own per job: the pool's Store keeps what the groups of earlier jobs
        # settled on for this frame, and rank 0 would read that instead of meeting rank 1
        budget = 400 + [None, "pass", "config"].index(plant)
        be = commfuse.backend(
            commfuse.Config(
                check_agreement="fallback",
                passes=passes,
                inner_compiler="eager",
                agreement_timeout_s=60,
                partition_search_budget=budget,
                **overrides,
            )
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train_step_outputs(model, inputs, backend=be, steps=2, lr=0.05, loss_fn=_loss)
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"plant={plant} rank {rank}")
    finally:
        unregister_pass("test_rank1_swaps_gathers")
        torch._dynamo.reset()
    swapped = [
        p.counts.get("swapped", 0)
        for r in be.reports
        for p in r.passes
        if p.name == "test_rank1_swaps_gathers"
    ]
    return {
        "verdicts": [(v.action, v.reason, v.timed_out) for v in be.agreements],
        "warnings": [str(w.message) for w in caught if "compiled programs differ" in str(w.message)],
        "swapped": sum(swapped),
        "loss": [float(x) for x in got["loss"]],
    }


def _two_collectives(x, y):
    import torch.distributed._functional_collectives as funcol

    a = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    b = funcol.all_gather_tensor(y * 3, 0, dist.group.WORLD)
    return a.sum() + b.sum()


def inductor_cache_hit_on_rank0_only(cache_dir: str) -> dict:
    """Real caches: rank 0 has Inductor's FX-graph and AOTAutograd caches on, rank 1 off.

    Round 1 compiles on both ranks (and fills rank 0's cache). Round 2 recompiles after a
    Dynamo reset: rank 0 now hits its cache (commfuse's hooks do not run there: its compiled
    sequence is unknown), rank 1 compiles afresh. The exchange at the first execution must
    complete on both, and run the compiled program (a cache hit is not a difference).

    Uses ``lowering="inductor"``: only the whole-graph Inductor path has the AOTAutograd cache
    that skips commfuse's hooks; ``lowering="commfuse"`` passes its own inner compiler, which
    AOTAutograd does not cache, so every rank runs the passes (docs/lowering.md).
    """
    import os

    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg

    rank = dist.get_rank()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{cache_dir}/rank{rank}"
    cfg = commfuse.Config(check_agreement="fallback", agreement_timeout_s=240, lowering="inductor")
    results = {}
    with icfg.patch(fx_graph_cache=rank == 0), fcfg.patch(enable_autograd_cache=rank == 0):
        for rnd in (1, 2):
            torch._dynamo.reset()
            be = commfuse.backend(cfg)
            out = torch.compile(_two_collectives, backend=be)(torch.ones(4), torch.ones(2))
            results[rnd] = {
                "out": float(out),
                "hooks_ran": len(be.reports),
                "verdicts": [v.action for v in be.agreements],
            }
    return results


def _run_once(fn, *args, **config: Any) -> dict:
    """Compile ``fn`` with the default net and run it once: its result and the verdicts."""
    torch._dynamo.reset()
    config = {"check_agreement": "fallback", **config}
    be = commfuse.backend(commfuse.Config(inner_compiler="eager", agreement_timeout_s=60, **config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend=be)(*args)
    torch._dynamo.reset()
    return {
        "out": float(out),
        "verdicts": [(v.action, v.reason) for v in be.agreements],
        "warnings": [str(w.message) for w in caught if "compiled programs differ" in str(w.message)],
    }


class Rank3SplitsAllReduce(GraphPass):
    """Test-only, deliberately WRONG: ``split_all_reduce`` on rank 3 only (an all_reduce it
    splits becomes reduce_scatter + all_gather; the group's other member keeps the all_reduce)."""

    name = "test_rank3_splits_all_reduce"
    stage = Stage.JOINT

    def run(self, ctx):
        from commfuse.transforms.registry import get_pass

        if dist.get_rank() != 3:
            return PassResult(changed=False)
        return get_pass("split_all_reduce").run(ctx)


def agreement_on_a_2x2_mesh(plant: bool) -> dict:
    """TP x DP on a 2 x 2 mesh: an all_reduce on the TP group, then one on the DP group. Each TP
    group has its own name on its members. ``plant``: rank 3's compiled program issues a
    reduce_scatter where its partner on a group issues the all_reduce; ranks that share no group
    with rank 3 are linked to it through their other groups: all four fall back."""
    import torch.distributed._functional_collectives as funcol

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()

    def step(x):
        a = funcol.all_reduce(x * 2, "sum", tp)
        return funcol.all_reduce(a + 1, "sum", dp).sum()

    register_pass(Rank3SplitsAllReduce)
    try:
        res = _run_once(
            step,
            torch.full((2,), float(dist.get_rank())),
            passes=["test_rank3_splits_all_reduce"] if plant else [],
        )
    finally:
        unregister_pass("test_rank3_splits_all_reduce")
    res["tp_group"] = tp.group_name
    return res


def agreement_on_two_pipeline_stages() -> dict:
    """Stage 0 (ranks 0, 1) reduces on its TP group and sends to stage 1 (ranks 2, 3), which
    receives and gathers on its own TP group: different frames on the two stages, no group
    compared between them (the transfer is pairwise)."""
    import torch.distributed._functional_collectives as funcol

    from commfuse.ops.boundary import stage_transfer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp = mesh["tp"].get_group()
    world = dist.group.WORLD

    def stage0(x):
        y = funcol.all_reduce(x * 2, "sum", tp)
        return stage_transfer(y, [0, 1], [2, 3], world).sum() + y.sum()

    def stage1(x):
        y = stage_transfer(x, [0, 1], [2, 3], world)
        return funcol.all_gather_tensor(y + 1, 0, tp).sum()

    return _run_once(stage0 if dist.get_rank() < 2 else stage1, torch.full((4,), float(dist.get_rank())))


def agreement_on_a_dropless_moe() -> dict:
    """torchtitan-style dropless MoE with expert parallelism over 4 ranks: the all_to_all split
    sizes are data-dependent (unbacked) and differ per rank; two training steps, no fallback."""
    from commfuse.models import moe_styles as ms

    world, rank = dist.get_world_size(), dist.get_rank()
    group = init_device_mesh("cpu", (world,)).get_group()
    cfg = ms.MoEStyleConfig(style="dropless", dim=16, num_experts=2 * world, ffn_dim=32, top_k=2)

    def model():
        return ms.build_moe_style(cfg).expert_parallel(group)

    def inputs(step):
        return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1000 * step + rank))

    be = commfuse.backend(
        commfuse.Config(check_agreement="fallback", inner_compiler="eager", agreement_timeout_s=60)
    )
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        got = train_step_outputs(
            model,
            inputs,
            backend=be,
            steps=2,
            lr=0.05,
            loss_fn=lambda out: (out[0] if isinstance(out, tuple) else out).float().pow(2).mean(),
        )
        torch._dynamo.reset()
    shapes = [
        s
        for r in be.reports
        if r.analysis
        for c in r.analysis.collectives
        if c.kind == "all_to_all"
        for s in c.input_shapes
    ]
    return {
        "losses": [float(v) for v in got["loss"]],
        "a2a_shapes": [str(s) for s in shapes],
        "verdicts": [v.action for v in be.agreements],
    }
