"""Errors the reference interpreter raises. Each names the node, op, group and ranks involved."""

from __future__ import annotations

from commfuse.core.errors import CommfuseError


class ReferenceSemanticsError(CommfuseError):
    """Base class: the program cannot be given a meaning on the reference (it would fail or hang)."""


class UnknownCollectiveError(ReferenceSemanticsError):
    """A collective (or a communication op commfuse does not know) has no reference semantics."""


class GroupResolutionError(ReferenceSemanticsError):
    """A group name in the graph has no ranks in the mapping, or a rank is not a member of it."""


class CollectiveMismatchError(ReferenceSemanticsError):
    """The ranks of a group issued collectives that do not match (op, reduce op, shapes, splits, peers).

    On real hardware this corrupts data or hangs.
    """


class DeadlockError(ReferenceSemanticsError):
    """Some ranks can never proceed: a collective some members never reach, a receive with
    no matching send, or a send nobody receives. On real hardware: a hang."""


class InFlightMutationError(ReferenceSemanticsError):
    """A tensor a collective (or send) reads was modified between the collective's issue and
    its wait. Real backends read the input asynchronously until the wait: a data race."""
