"""Pass registry: passes register by name; pipelines are lists of names."""

from __future__ import annotations

from typing import Type

from commfuse.passes.base import GraphPass

_PASSES: dict[str, Type[GraphPass]] = {}

# The pipeline `backend="commfuse"` runs: MoE recognition on Dynamo's graph, Chimera fusion on
# the joint graph, then the schedule passes (bucketing, the overlap scheduler, waits sunk).
# The Centauri partition search is opt-in (compile time; see docs/centauri.md).
# The scheduler runs before the bucketer: bucket_collectives never issues a bucket earlier than
# its first member, so it keeps the prefetch the scheduler chose (overlap-preserving bucketing);
# bucketing first made bigger messages the memory budget then kept from being prefetched.
# gloo_reduce_scatter runs last: it lowers each (bucketed) gloo reduce_scatter where the schedule
# issued and waited it, so it must see the final order (a no-op on NCCL topologies).
DEFAULT_PIPELINE: tuple[str, ...] = ("moe_recognition", "chimera", "schedule_overlap", "bucket_collectives",
                                     "sink_waits", "gloo_reduce_scatter")

# Config(dhelix=True): the fused train-step graph is ordered by the strand interleaving alone; bucketing
# (it would merge the two strands' collectives) and wait sinking (the plan's barriers place the waits)
# stay out.
DHELIX_PIPELINE: tuple[str, ...] = ("moe_recognition", "chimera", "dhelix_interleave", "gloo_reduce_scatter")


def register_pass(cls: Type[GraphPass]) -> Type[GraphPass]:
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} has no pass name")
    if cls.name in _PASSES and _PASSES[cls.name] is not cls:
        raise ValueError(f"pass name {cls.name!r} is already registered by {_PASSES[cls.name].__name__}")
    _PASSES[cls.name] = cls
    return cls


def unregister_pass(name: str) -> None:
    _PASSES.pop(name, None)


def available_passes() -> dict[str, Type[GraphPass]]:
    _load_builtin()
    return dict(_PASSES)


def get_pass(name: str) -> GraphPass:
    passes = available_passes()
    if name not in passes:
        from commfuse.errors import ConfigError

        raise ConfigError(f"passes: unknown pass {name!r}; available passes: {sorted(passes)}")
    return passes[name]()


def _load_builtin() -> None:
    # Importing the modules registers their passes; kept lazy so that Config
    # validation does not import every pass module at `import commfuse` time twice.
    from commfuse.passes import (  # noqa: F401
        chimera, collective_motion, fuse_collectives, group_partition, moe_recognition, partition_search,
        primitive_substitution, primitive_substitution_forced, schedule_overlap, schedule_overlap_layer_forced,
        sink_waits, split_all_reduce,
        workload_partition,
    )
    from commfuse.passes import bucket_collectives  # noqa: F401
    from commfuse.passes import lagom_tune  # noqa: F401
    from commfuse.passes import gloo_reduce_scatter  # noqa: F401
    from commfuse.passes import boundary_fusion  # noqa: F401  (pipeline forward graphs; opt-in, see docs/boundary-fusion.md)
    from commfuse.passes import dhelix_interleave  # noqa: F401  (fused train-step graphs; Config(dhelix=True))
