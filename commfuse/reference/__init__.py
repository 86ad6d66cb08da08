"""Reference semantics of collective programs: all ranks of an FX graph in one process.

    from commfuse.reference import run_reference
    outs = run_reference(gm, [inputs_rank0, inputs_rank1, ...], groups={"1": [[0, 2], [1, 3]]})

See :mod:`.interpreter` (execution model), :mod:`.semantics` (what each collective
computes; :func:`register_semantics` for new kinds, :func:`register_sync_op` for ops that
communicate inside their kernel), :mod:`commfuse.ops.moe_layer.semantics` (``commfuse::moe_layer``),
:mod:`commfuse.ops.boundary.semantics` (commfuse's boundary ops ``m2ms`` / ``stage_transfer``) and
:mod:`.groups` (group names -> ranks). docs/reliability.md describes how the pass fuzzer uses it.
"""

from commfuse.reference.errors import (
    CollectiveMismatchError,
    DeadlockError,
    GroupResolutionError,
    InFlightMutationError,
    ReferenceSemanticsError,
    UnknownCollectiveError,
)
from commfuse.reference.groups import GroupSpec, GroupTable, groups_from_process_groups
from commfuse.reference.interpreter import ReferenceInterpreter, run_reference
from commfuse.reference.semantics import (
    P2PPlan,
    RankCall,
    SyncOpSpec,
    reduce_tensors,
    register_semantics,
    register_sync_op,
    registered_kinds,
    unregister_semantics,
    unregister_sync_op,
)

__all__ = [
    "CollectiveMismatchError",
    "DeadlockError",
    "GroupResolutionError",
    "GroupSpec",
    "GroupTable",
    "InFlightMutationError",
    "P2PPlan",
    "RankCall",
    "ReferenceInterpreter",
    "ReferenceSemanticsError",
    "SyncOpSpec",
    "UnknownCollectiveError",
    "groups_from_process_groups",
    "reduce_tensors",
    "register_semantics",
    "register_sync_op",
    "registered_kinds",
    "run_reference",
    "unregister_semantics",
    "unregister_sync_op",
]
