"""Suites: which workloads x baselines, how many steps, and which scaling points a run measures.

``smoke`` is what the test suite runs (every workload family, cheap
baselines); ``quick`` is the everyday comparison (< 5 min on 2 cores);
``full`` adds sizes, the Inductor-based baselines and the 4..32-layer
compile-time scaling with Inductor alongside (about 25 min on 2 cores:
a cold Inductor compile of a small model costs 20-70 s there).

Baseline lists are built from the registries, so a newly registered pass
gets its single-pass baseline in every suite without editing this file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from benchmarks.baselines import baseline_names, get_baseline
from benchmarks.declared import DECLARED_FAMILIES
from benchmarks.workloads import workload_names

__all__ = ["SUITES", "Suite", "get_suite"]


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    workloads: tuple[str, ...]
    baselines: tuple[str, ...]
    # Inductor-based baselines only on these workloads (None: on all). A cold
    # Inductor compile is the expensive part of a run.
    inductor_workloads: tuple[str, ...] | None = None
    world_size: int = 2
    warmup: int = 3
    steps: int = 15
    # Compile-time scaling: (mode, layer counts) pairs; modes in benchmarks.scaling.MODES.
    scaling: tuple[tuple[str, tuple[int, ...]], ...] = (("commfuse-eager", (4, 8)),)
    scaling_world: int = 8
    job_timeout_s: float = 900.0

    def matrix(self) -> list[tuple[str, str]]:
        """(workload, baseline) pairs in run order: per workload, every baseline."""
        pairs = []
        for w in self.workloads:
            for b in self.baselines:
                if (
                    get_baseline(b).uses_inductor
                    and self.inductor_workloads is not None
                    and w not in self.inductor_workloads
                ):
                    continue
                pairs.append((w, b))
        return pairs

    def only(self, workloads: Sequence[str]) -> "Suite":
        """This suite restricted to ``workloads`` (each must be one of its own)."""
        unknown = [w for w in workloads if w not in self.workloads]
        if unknown:
            raise KeyError(
                f"workloads {unknown} are not in suite {self.name!r}; its workloads: "
                f"{', '.join(self.workloads)}"
            )
        return dataclasses.replace(self, workloads=tuple(workloads))

    @property
    def uses_inductor(self) -> bool:
        return any(get_baseline(b).uses_inductor for _, b in self.matrix())


def _families(size: str) -> tuple[str, ...]:
    """Every example-model family at ``size``; the declared third-party families only run in the
    ``declared`` suite (they need the conformance extra, and their size is not CI sized)."""
    declared = {f.name for f in DECLARED_FAMILIES}
    return tuple(
        n for n in workload_names() if n.endswith(f":{size}") and n.partition(":")[0] not in declared
    )


def _single_pass(prefix: str) -> tuple[str, ...]:
    """``prefix:<pass>`` for every registered pass (``:none`` excluded)."""
    return tuple(n for n in baseline_names() if n.startswith(prefix + ":") and n != prefix + ":none")


def _default_pipeline_passes() -> tuple[str, ...]:
    """The default pipeline's passes and the steps of the nested pipelines among them (chimera's)."""
    from commfuse.passmgr.pipeline import PassPipeline
    from commfuse.transforms.registry import DEFAULT_PIPELINE, available_passes

    names = list(DEFAULT_PIPELINE)
    for name in DEFAULT_PIPELINE:
        cls = available_passes()[name]
        if issubclass(cls, PassPipeline):
            names += [step.name for step in cls.steps if step.name not in names]
    return tuple(names)


# Eager-inner commfuse variants are cheap (no codegen) and attribute gains per
# pass against `commfuse-eager:none` (= aot_eager: same partitioner, no passes).
# The quick suite attributes the default pipeline's passes (one row per pass per
# workload: all registered passes would take it past CI's budget); the full suite
# has every registered pass.
_EAGER_INNER_ALL = ("commfuse-eager:none", "commfuse-eager", *_single_pass("commfuse-eager"))
_EAGER_INNER = (
    "commfuse-eager:none",
    "commfuse-eager",
    *(f"commfuse-eager:{p}" for p in _default_pipeline_passes()),
)

SUITES: dict[str, Suite] = {}


def _register(suite: Suite) -> None:
    SUITES[suite.name] = suite


_register(
    Suite(
        "smoke",
        "every workload family at size s, eager vs commfuse (eager inner); 2-layer scaling point",
        workloads=_families("s"),
        baselines=("eager", "commfuse-eager"),
        warmup=1,
        steps=5,
        scaling=(("commfuse-eager", (2,)),),
    )
)
_register(
    Suite(
        "quick",
        "every workload family at size s; eager and eager-inner commfuse variants (no Inductor: a cold "
        "Inductor compile costs 20-70 s per run on 2 cores); scaling at 4 and 8 layers (commfuse pipeline only)",
        workloads=_families("s"),
        baselines=("eager", *_EAGER_INNER),
        warmup=3,
        steps=30,
        scaling=(("commfuse-eager", (4, 8)),),
    )
)
# Shrunk to finish in about 25 minutes on 2 cores: the Inductor-based
# baselines (a cold compile is ~1 min per run there) run at size s only, and
# Inductor's own scaling points at 4 and 32 layers; the commfuse pipeline is
# timed at every depth (eager inner: exact stage split) and inside Inductor at
# the deepest point, where the project goal is stated.
_register(
    Suite(
        "full",
        "every workload family at sizes s and m with eager and the eager-inner commfuse variants; at "
        "size s also Inductor, Inductor+comm passes and commfuse (Inductor inner); scaling of the pipeline at "
        "4, 8, 16, 32 layers, Inductor's compile at 4 and 32",
        workloads=_families("s") + _families("m"),
        baselines=("eager", "inductor", "inductor+comm", "commfuse", *_EAGER_INNER_ALL),
        inductor_workloads=_families("s"),
        warmup=5,
        steps=50,
        scaling=(("commfuse-eager", (4, 8, 16, 32)), ("inductor", (4, 32)), ("commfuse", (32,))),
        job_timeout_s=1800.0,
    )
)


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; known: {sorted(SUITES)}")
    return SUITES[name]


# Chimera on MoE layers (docs/chimera-moe.md): the TP+EP and SP+EP+SP workloads with every
# baseline, Inductor ones included (2 ranks: cold Inductor compiles dominate).
_register(
    Suite(
        "chimera-moe",
        "moe_tp_ep and moe_sp_ep_sp at size s: eager, Inductor, Inductor+comm passes, commfuse "
        "(Inductor and eager inner), commfuse with no passes",
        workloads=("moe_tp_ep:s", "moe_sp_ep_sp:s"),
        baselines=("eager", "inductor", "inductor+comm", "commfuse", "commfuse-eager:none", "commfuse-eager"),
        warmup=3,
        steps=20,
        scaling=(),
    )
)
# MoE recognition (docs/moe-recognition.md): a hand-written GShard MoE in an SP block; the
# commfuse rows show the gather gone once the layer is recognised as one region.
_register(
    Suite(
        "moe-recognition",
        "moe_style_sp_ep_sp at size s: eager, Inductor, Inductor+comm passes, commfuse "
        "(Inductor and eager inner), commfuse with no passes",
        workloads=("moe_style_sp_ep_sp:s",),
        baselines=("eager", "inductor", "inductor+comm", "commfuse", "commfuse-eager:none", "commfuse-eager"),
        warmup=3,
        steps=20,
        scaling=(),
    )
)
# The declared workloads (docs/benchmarks.md, "Declared workloads"): third-party models parallelised by
# their libraries, at the declared size d; each at its family's world size (simple_fsdp_tp: 4 ranks).
_register(
    Suite(
        "declared",
        "the declared third-party workloads at size d (torchtitan llama3 TP+SP, deepseek_v3 TP+EP, "
        "transformers Llama TP, SimpleFSDP x TP on 2x2): eager, Inductor, commfuse (Inductor and eager inner)",
        workloads=tuple(f"{f.name}:d" for f in DECLARED_FAMILIES),
        baselines=("eager", "inductor", "commfuse", "commfuse-eager"),
        warmup=3,
        steps=20,
        scaling=(),
        job_timeout_s=1800.0,
    )
)
