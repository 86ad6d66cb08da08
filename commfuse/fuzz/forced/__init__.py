"""The forced pass variants: product passes with their cost-model or simulator guard taken off,
known only where they are checked.

Contract
- Holds: :data:`FORCED_PASSES`, four passes that apply a product pass's rewrite wherever it
  is feasible (``gated = False``, no prediction asked), so the fuzzer and the numeric tests
  exercise rewrites the product passes rarely choose. Each declares its ``fuzz``
  :class:`~commfuse.passmgr.base.FuzzSpec` as a built-in pass does.
- Never in the product table (:mod:`commfuse.transforms.registry`): a user's
  ``commfuse.available_passes()`` does not list them and ``Config(passes=[...])`` refuses
  their names. A forced rewrite can be slower than the graph it replaces; it exists to be
  checked, not run.
- :func:`register_forced_passes` adds them to the pass table (``register_pass``) in this
  process; calling it again changes nothing. Whatever runs them calls it when imported: the
  fuzzer (:mod:`commfuse.fuzz.targets`, so its campaigns and their spawned workers), the
  test session (``tests/conftest.py``) and the rank-pool job modules that name them
  (``tests/_jobs_*.py``, imported by the workers when they unpickle a job).
"""

from __future__ import annotations

from typing import Type

from commfuse.fuzz.forced.expert_exchange_partition_forced import ExpertExchangePartitionForced
from commfuse.fuzz.forced.partition_search_forced import CentauriPartitionForced
from commfuse.fuzz.forced.primitive_substitution_forced import PrimitiveSubstitutionForced
from commfuse.fuzz.forced.schedule_overlap_layer_forced import ScheduleOverlapLayerForced
from commfuse.passmgr.base import GraphPass
from commfuse.transforms.registry import available_passes, register_pass

FORCED_PASSES: tuple[Type[GraphPass], ...] = (
    ExpertExchangePartitionForced,
    PrimitiveSubstitutionForced,
    CentauriPartitionForced,
    ScheduleOverlapLayerForced,
)

FORCED_PASS_NAMES: frozenset[str] = frozenset(p.name for p in FORCED_PASSES)


def is_registered(cls: Type[GraphPass]) -> bool:
    """Whether the pass table resolves ``cls.name`` to ``cls`` in this process."""
    return available_passes().get(cls.name) is cls


def register_forced_passes() -> None:
    """Make the forced variants usable by name in this process (``Config(passes=[...])``, the
    fuzzer's targets); those already registered are left as they are."""
    for cls in FORCED_PASSES:
        if not is_registered(cls):
            register_pass(cls)


__all__ = ["FORCED_PASSES", "FORCED_PASS_NAMES", "is_registered", "register_forced_passes"]
