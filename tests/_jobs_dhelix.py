"""Rank-pool jobs for tests/test_dhelix_step.py (module level: the pool pickles them by reference).

Each job builds a DTensor-parallelised model of ``n_layers`` layers on the gloo ranks (4 by
default, as benchmarks/dhelix_report.py measures; tests/test_dhelix_step.py uses 2, since the
compile, which is where the time goes, grows with layers x micro-batches) and, for each
micro-batch count, runs two SGD steps of

* the plain eager gradient-accumulation loop (the definition of the semantics), and
* `commfuse.compile_train_step` with `Config(dhelix=True)` (fused partition + strand
  interleaving, strict, eager inner compiler, commfuse lowering: async gloo handles),

asserts loss, gradients and parameters close under the tolerance policy, and returns what
the interleaving pass decided (plan digest, units, pairs, simulated peaks) per count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.models import llama, moe_tp
from commfuse.reference.numerics import assert_close_tree
from commfuse.train_step import compile_train_step

from _jobs_train_step import _local, _train  # noqa: E402  (same 2 SGD steps, lr 0.05)

LLAMA = llama.LlamaConfig(n_layers=4, dim=32, n_heads=4, ffn_dim=64)


def _llama(n_layers: int) -> llama.LlamaConfig:
    return (
        LLAMA
        if n_layers == LLAMA.n_layers
        else llama.LlamaConfig(n_layers=n_layers, dim=32, n_heads=4, ffn_dim=64)
    )


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def _moe_loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[0].float().mean() + 0.01 * out[1]


def _setup(
    layout: str, n_layers: int = 4
) -> tuple[Callable[[], torch.nn.Module], Callable[[int], tuple], Callable, dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    roles = {mesh.get_group().group_name: "tp"}
    if layout == "tp_sp":
        lcfg = _llama(n_layers)

        def model() -> torch.nn.Module:
            return llama.parallelize_llama(llama.build_llama(lcfg, seed=0), mesh, sequence_parallel=True)

        def batch(step: int) -> tuple:
            b = llama.make_inputs(lcfg, 4, 8, rank=rank, world_size=world, seed=step)
            return b.inputs, b.target

        return model, batch, _mse, roles
    if layout == "moe":
        # TP attention + EP experts over the same ranks, vocab-parallel head (Chimera's TP+EP model).
        cfg = moe_tp.MoETPConfig(
            n_layers=n_layers, dim=32, n_heads=4, num_experts=2 * world, ffn_dim=32, vocab=64
        )

        def model() -> torch.nn.Module:
            return moe_tp.parallelize_moe_tp(moe_tp.build_moe_tp(cfg, seed=0), mesh, "tp_ep")

        def batch(step: int) -> tuple:
            return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step)), None

        return model, batch, _moe_loss, {}
    raise ValueError(layout)


def plain_loop(model: torch.nn.Module, loss_fn, x: torch.Tensor, y, m: int) -> torch.Tensor:
    """The reference: gradient accumulation written the ordinary way, eagerly."""
    total = None
    ys = y.tensor_split(m) if y is not None else [None] * m
    for xi, yi in zip(x.tensor_split(m), ys, strict=True):
        loss = (loss_fn(model(xi), yi) if yi is not None else loss_fn(model(xi))) / m
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def dhelix_step_matches_loop(layout: str, microbatches: list[int], n_layers: int = 4) -> dict[int, Any]:
    make_model, batch, loss_fn, roles = _setup(layout, n_layers)
    cfg = commfuse.Config(inner_compiler="eager", strict=True, dhelix=True, group_roles=roles)
    where = f"on rank {dist.get_rank()}"
    seen: dict[int, Any] = {}
    for m in microbatches:
        torch._dynamo.reset()
        ref_model = make_model()
        ref = _train(ref_model, batch, lambda x, y, mod=ref_model, m=m: plain_loop(mod, loss_fn, x, y, m))
        model = make_model()
        step = compile_train_step(model, loss_fn, microbatches=m, config=cfg)
        got = _train(model, batch, lambda x, y: step(x, targets=y))  # noqa: B023 - _train runs it now
        assert_close_tree(got, ref, dtype=torch.float32, msg=f"{where}, {layout}, dhelix, microbatches={m}")
        ran = [(r.graph, p) for r in step.reports for p in r.passes if p.name == "dhelix_interleave"]
        fused = [p for g, p in ran if g == "forward"]
        d = fused[0].decisions[0] if fused and fused[0].decisions else {}
        seen[m] = {
            "partitions": list(step.backend.partitions),
            "passes_failed": [p.name for r in step.reports for p in r.passes if p.error],
            "changed": bool(fused and fused[0].changed),
            "refusals": fused[0].refusals if fused else ["pass did not run"],
            "kept": d.get("kept"),
            "digest": d.get("plan", {}).get("digest"),
            "units": d.get("plan", {}).get("units"),
            "pairs": d.get("plan", {}).get("pairs", 0),
            "peak_sequential": d.get("sequential", {}).get("peak_memory_bytes"),
            "peak_interleaved": d.get("interleaved", {}).get("peak_memory_bytes"),
            "activation_peak": d.get("activation_peak_bytes"),
            "collectives_issued_async": sum(
                1 for pl in step.backend.plans for _ in getattr(pl, "collectives", ())
            ),
        }
    return seen


def step_times(layout: str, microbatches: int, steps: int, n_layers: int = 4) -> dict[str, Any]:
    """Measured step time on these gloo ranks of three compiled steps, alternated every step (the
    first, compiling step of each not timed): "plain" (default pipeline), "fused" (the dhelix
    partition and pipeline without the interleaving pass: every forward, then every backward) and
    "interleaved" (``Config(dhelix=True)``). Returns per kind the per-step seconds, the final loss
    and gradients, and the interleaving pass's decision."""
    import time

    make_model, batch, loss_fn, roles = _setup(layout, n_layers)
    torch._dynamo.reset()
    runs: dict[str, Any] = {}
    from commfuse.transforms.registry import DHELIX_PIPELINE

    no_interleave = [p for p in DHELIX_PIPELINE if p != "dhelix_interleave"]
    for kind, dhelix, passes in (
        ("plain", False, None),
        ("fused", True, no_interleave),
        ("interleaved", True, None),
    ):
        model = make_model()
        cfg = commfuse.Config(inner_compiler="eager", dhelix=dhelix, passes=passes, group_roles=roles)
        runs[kind] = {
            "model": model,
            "step": compile_train_step(model, loss_fn, microbatches=microbatches, config=cfg),
            "times": [],
        }
    x, y = batch(0)
    for k in range(steps + 1):
        for r in runs.values():
            for p in r["model"].parameters():
                p.grad = None
            dist.barrier()
            t = time.perf_counter()
            r["loss"] = r["step"](x, targets=y)
            dist.barrier()
            if k:
                r["times"].append(time.perf_counter() - t)
    out: dict[str, Any] = {}
    for kind, r in runs.items():
        found = [
            p
            for rep in r["step"].reports
            if rep.graph == "forward"
            for p in rep.passes
            if p.name == "dhelix_interleave"
        ]
        out[kind] = {
            "times": r["times"],
            "loss": r["loss"],
            "grads": {n: _local(p.grad) for n, p in r["model"].named_parameters()},
            "decision": found[0].decisions[0] if found and found[0].decisions else None,
        }
    return out
