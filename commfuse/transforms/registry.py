"""The pass table: every built-in pass, the pipelines commfuse runs by default, and user passes.

Adding a pass is its own module in this folder and one line in :data:`BUILTIN_PASSES`; the
``Config.passes`` name check, the fuzzer (:mod:`commfuse.fuzz.targets`) and the benchmark runner
read the table from here. :data:`BUILTIN_PASSES` holds product passes only: a variant that exists
to be tested (the forced variants, :mod:`commfuse.fuzz.forced`) is registered by whatever checks
it, as a pass written outside commfuse joins: with :func:`register_pass`.
"""

from __future__ import annotations

from typing import Type

from commfuse.core.errors import ConfigError
from commfuse.passmgr.base import GraphPass
from commfuse.transforms.accumulate_gradient_sync import AccumulateGradientSync
from commfuse.transforms.boundary_fusion import BoundaryFusion
from commfuse.transforms.bucket_collectives import BucketCollectives
from commfuse.transforms.chimera import Chimera
from commfuse.transforms.collective_motion import CollectiveMotion
from commfuse.transforms.dhelix_interleave import DHelixInterleave
from commfuse.transforms.expert_exchange_partition import ExpertExchangePartition
from commfuse.transforms.fuse_collectives import FuseCollectives
from commfuse.transforms.gloo_reduce_scatter import GlooReduceScatter
from commfuse.transforms.group_partition import GroupPartition
from commfuse.transforms.hidden_exchange_partition import HiddenExchangePartition
from commfuse.transforms.lagom_tune import LagomTune
from commfuse.transforms.moe_recognition import MoERecognition
from commfuse.transforms.partition_search import CentauriPartition
from commfuse.transforms.primitive_substitution import PrimitiveSubstitution
from commfuse.transforms.schedule_overlap import ScheduleOverlap
from commfuse.transforms.sink_waits import SinkWaits
from commfuse.transforms.split_all_reduce import SplitAllReduce
from commfuse.transforms.workload_partition import WorkloadPartition

# Every built-in pass, in the order they appear in the default pipelines (MoE recognition, the gradient
# sync once per step, Chimera's steps and Chimera, boundary fusion, Centauri's partitions and their
# search, the schedulers, bucketing and wait sinking, Lagom, the gloo lowering).
BUILTIN_PASSES: tuple[Type[GraphPass], ...] = (
    MoERecognition,
    AccumulateGradientSync,
    SplitAllReduce,
    CollectiveMotion,
    FuseCollectives,
    Chimera,
    BoundaryFusion,
    WorkloadPartition,
    ExpertExchangePartition,
    HiddenExchangePartition,
    PrimitiveSubstitution,
    GroupPartition,
    CentauriPartition,
    ScheduleOverlap,
    DHelixInterleave,
    BucketCollectives,
    SinkWaits,
    LagomTune,
    GlooReduceScatter,
)

# The pipeline `backend="commfuse"` runs: MoE recognition on Dynamo's graph, the gradient sync once
# per step (before Chimera, which would otherwise split each micro-batch's all_reduce), Chimera fusion on
# the joint graph, then the schedule passes (bucketing, the overlap scheduler, waits sunk).
# The Centauri partition search is opt-in (compile time; see docs/centauri.md).
# The scheduler runs before the bucketer: bucket_collectives never issues a bucket earlier than
# its first member, so it keeps the prefetch the scheduler chose (overlap-preserving bucketing);
# bucketing first would make bigger messages that the memory budget then keeps from being prefetched.
# gloo_reduce_scatter runs last: it lowers each (bucketed) gloo reduce_scatter where the schedule
# issued and waited it, so it must see the final order (a no-op on NCCL topologies).
DEFAULT_PIPELINE: tuple[str, ...] = (
    "moe_recognition",
    "accumulate_gradient_sync",
    "chimera",
    "schedule_overlap",
    "bucket_collectives",
    "sink_waits",
    "gloo_reduce_scatter",
)

# Config(dhelix=True): the fused train-step graph is ordered by the strand interleaving alone; bucketing
# (it would merge the two strands' collectives) and wait sinking (the plan's barriers place the waits)
# stay out.
DHELIX_PIPELINE: tuple[str, ...] = (
    "moe_recognition",
    "accumulate_gradient_sync",
    "chimera",
    "dhelix_interleave",
    "gloo_reduce_scatter",
)


_BUILTIN: dict[str, Type[GraphPass]] = {p.name: p for p in BUILTIN_PASSES}
_USER: dict[str, Type[GraphPass]] = {}


def register_pass(cls: Type[GraphPass]) -> Type[GraphPass]:
    """Make a pass written outside commfuse known by its ``name`` (usable in ``Config.passes``).
    Registering the same class again changes nothing; another class under a taken name is refused."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} has no pass name")
    taken = _BUILTIN.get(cls.name) or _USER.get(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"pass name {cls.name!r} is already registered by {taken.__name__}")
    _USER[cls.name] = cls
    return cls


def unregister_pass(name: str) -> None:
    """Forget a pass :func:`register_pass` added (built-in passes stay)."""
    _USER.pop(name, None)


def available_passes() -> dict[str, Type[GraphPass]]:
    return {**_BUILTIN, **_USER}


def get_pass(name: str) -> GraphPass:
    passes = available_passes()
    if name not in passes:
        raise ConfigError(f"passes: unknown pass {name!r}; available passes: {sorted(passes)}")
    return passes[name]()


__all__ = [
    "BUILTIN_PASSES",
    "DEFAULT_PIPELINE",
    "DHELIX_PIPELINE",
    "available_passes",
    "get_pass",
    "register_pass",
    "unregister_pass",
]
