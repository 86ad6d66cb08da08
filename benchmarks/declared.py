"""Declared benchmark workloads: the third-party models users train, parallelised by their libraries.

Registered into ``benchmarks.workloads`` when that module is imported. Each family is built with
the library's own model code and parallelised by its own function (``benchmarks.thirdparty``):

* ``titan_llama3_tp_sp``: torchtitan llama3, the model's ``parallelize`` (the TP step of
  ``parallelize_llama``: TP 2 + sequence parallel, vocab-parallel loss);
* ``titan_deepseek_v3_tp_ep``: torchtitan deepseek_v3 (MLA + dropless MoE), the model's
  ``parallelize`` (that of ``parallelize_deepseekv3``: TP 2, EP 2 over the same ranks);
* ``hf_llama_tp``: transformers ``LlamaForCausalLM`` with its ``tp_plan`` (plain TP);
* ``simple_fsdp_tp``: SimpleFSDP x TP+SP on a 2x2 mesh (4 ranks): torchtitan llama3, TP by
  its ``parallelize`` then graph_trainer's SimpleFSDP (torchtitan's FSDP2 needs PREMUL_SUM, which
  gloo lacks; ``commfuse.models.simple_fsdp`` is 1-D only).

Sizes: ``s`` is test sized (one eager step well under a second); ``d`` is the declared size of
docs/benchmarks.md ("Declared workloads"), where the sizes and the reasons for them are written.
The families need the ``conformance`` extra (torchtitan, transformers); the libraries are only
imported when a workload is built.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Runnable as a script from a checkout (the rank pool copies sys.path into its workers).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.thirdparty import hf_llama, titan_loss, titan_parallel, titan_parallelize  # noqa: E402
from benchmarks.workloads import Built, Family, get_workload, register_family  # noqa: E402

__all__ = ["DECLARED_FAMILIES", "eager_step_seconds"]


def _roles(model: torch.nn.Module) -> dict[str, str]:
    """Group name -> role for the named mesh dims the model's DTensor parameters live on, as
    commfuse reads them from the meshes (torchtitan's and transformers' dim names)."""
    from commfuse.session import roles_from_meshes

    meshes = {p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
    return roles_from_meshes(meshes)


def _token_ids(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """(batch, seq + 1) token ids: inputs are ``[:, :-1]``, next-token labels ``[:, 1:]``."""
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _titan(family: str, degrees: dict[str, int], *, batch: int, seq: int, **sizes: int) -> Built:
    par = titan_parallel(degrees)
    # the model's own parallelize: parallelize_* would add FSDP2 wrappers (no-ops at shard degree 1)
    # whose hooks split the whole-model compile every baseline does into graphs per block
    model = titan_parallelize(family, par, n_layers=sizes.pop("n_layers"), parallelize_fn=False, **sizes)
    # TP/EP ranks see the same tokens; sharded data parallel ranks each their own batch
    dp_rank = par.dims.get_mesh("fsdp").get_local_rank() if par.dims.dp_shard_enabled else 0
    ids = _token_ids(sizes["vocab"], batch, seq, seed=1 + dp_rank)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return Built(model, (inputs,), lambda logits: titan_loss(logits, labels), roles=_roles(model))


def _build_titan_llama3_tp_sp(world: int, rank: int, **sizes: int) -> Built:
    return _titan("llama3", {"tp": world}, **sizes)


def _build_titan_deepseek_v3_tp_ep(world: int, rank: int, **sizes: int) -> Built:
    return _titan("deepseek_v3", {"tp": world, "ep": world}, **sizes)


def _build_simple_fsdp_tp(world: int, rank: int, **sizes: int) -> Built:
    return _titan("llama3", {"dp_shard": world // 2, "tp": 2}, **sizes)


def _build_hf_llama_tp(world: int, rank: int, *, batch: int, seq: int, vocab: int, **sizes: int) -> Built:
    model = hf_llama(world, vocab=vocab, seq=seq, **sizes)
    ids = _token_ids(vocab, batch, seq, seed=1)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def loss(out: Any) -> torch.Tensor:
        logits = out.logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return Built(model, (inputs,), loss, roles=_roles(model))


# "s": test sized. "d": the declared size (docs/benchmarks.md, "Declared workloads"): dim 512,
# vocab 2048 so that the embedding and the LM head do not dominate, fp32.
_TOKENS_S = {"batch": 2, "seq": 32}
_TOKENS_D = {"batch": 2, "seq": 1024}
_LLAMA_S = {"n_layers": 1, "dim": 64, "n_heads": 4, "ffn_dim": 128, "vocab": 256, **_TOKENS_S}
_LLAMA_D = {"n_layers": 2, "dim": 512, "n_heads": 16, "ffn_dim": 1536, "vocab": 2048, **_TOKENS_D}
_DSV3_S = {"n_layers": 1, "dim": 64, "n_heads": 4, "ffn_dim": 64, "num_experts": 4, "vocab": 256, **_TOKENS_S}
_DSV3_D = {
    "n_layers": 2,
    "dim": 512,
    "n_heads": 8,
    "ffn_dim": 512,
    "num_experts": 8,
    "vocab": 2048,
    **_TOKENS_D,
}

DECLARED_FAMILIES: tuple[Family, ...] = (
    Family(
        "titan_llama3_tp_sp",
        "torchtitan llama3, its Llama3Model.parallelize: TP + sequence parallel, vocab-parallel loss",
        _build_titan_llama3_tp_sp,
        {"s": _LLAMA_S, "d": _LLAMA_D},
    ),
    Family(
        "titan_deepseek_v3_tp_ep",
        "torchtitan deepseek_v3 (MLA, dropless MoE), its DeepSeekV3Model.parallelize: "
        "TP + SP, EP over the same ranks",
        _build_titan_deepseek_v3_tp_ep,
        {"s": _DSV3_S, "d": _DSV3_D},
    ),
    Family(
        "hf_llama_tp",
        "transformers LlamaForCausalLM, its tp_plan (DistributedConfig(tp_size)): plain TP",
        _build_hf_llama_tp,
        {"s": _LLAMA_S, "d": _LLAMA_D},
    ),
    Family(
        "simple_fsdp_tp",
        "SimpleFSDP x TP+SP on a 2x2 mesh: torchtitan llama3, TP by its parallelize, "
        "then graph_trainer's SimpleFSDP",
        _build_simple_fsdp_tp,
        {"s": _LLAMA_S, "d": _LLAMA_D},
        world=4,
    ),
)

# Registered by the module benchmarks.workloads imports, not by a copy of this file run as a script
# (__main__, and __mp_main__ in the processes multiprocessing spawns).
if __name__ == "benchmarks.declared":
    for _family in DECLARED_FAMILIES:
        register_family(_family)


# ------------------------------------------------------------- sizing a workload


def eager_step_seconds(workload: str, steps: int) -> list[tuple[float, float]]:
    """Rank job: ``workload`` built, one untimed eager step, then ``steps`` timed ones after a
    barrier each; per step (wall s, this rank's CPU s). With one thread per rank the CPU time is
    what the step costs without other processes competing for the cores."""
    import torch.distributed as dist

    built = get_workload(workload).build(dist.get_world_size(), dist.get_rank())

    def step() -> None:
        built.loss(built.model(*built.inputs)).backward()
        built.model.zero_grad(set_to_none=True)

    step()
    out = []
    for _ in range(steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        out.append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/declared.py [--steps N] WORKLOAD...``: eager step times, to size a workload."""
    from commfuse.tools.rank_pool import RankPool

    ap = argparse.ArgumentParser(description="eager step time of declared workloads (wall and per-rank CPU)")
    ap.add_argument("workloads", nargs="+", metavar="FAMILY:SIZE")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    for name in args.workloads:
        world = get_workload(name).family.world or 2
        with RankPool(world, timeout_s=1800) as pool:
            ranks = pool.run(eager_step_seconds, name, args.steps, timeout=1800)
        wall = [max(r[i][0] for r in ranks) for i in range(args.steps)]
        cpu = [max(r[i][1] for r in ranks) for i in range(args.steps)]
        print(
            f"{name}: {world} ranks, wall s/step {' '.join(f'{x:.2f}' for x in wall)}, CPU s/step (slowest "
            f"rank) {' '.join(f'{x:.2f}' for x in cpu)}, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    # the imported module's main: the ranks import its job function by name
    from benchmarks.declared import main as _main

    sys.exit(_main())
