"""Argument checks and group handling shared by commfuse's boundary ops.

Every check raises ``ValueError`` naming the argument at fault; a group that this
process does not know raises ``RuntimeError`` (an environment problem, not an argument).
The checks depend only on the op's arguments, which are the same on every rank, so every
rank accepts or rejects a call alike -- except the per-rank input size check of m2ms,
which is about data the op defines per rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from commfuse.core.torch_private import resolve_process_group


def as_rank_list(value: Any, arg: str, op: str) -> list[int]:
    """A list/tuple of ints (an int alone is one rank)."""
    if isinstance(value, bool):
        raise ValueError(f"{op}: {arg} must be a list of group ranks, got {value!r}")
    if isinstance(value, int):
        return [int(value)]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{op}: {arg} must be a list of group ranks, got {type(value).__name__}")
    out = []
    for r in value:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"{op}: {arg} must hold ints (group ranks), got {r!r}")
        out.append(int(r))
    return out


def check_ranks(ranks: Sequence[int], arg: str, group_size: int, op: str) -> None:
    if len(ranks) == 0:
        raise ValueError(f"{op}: {arg} is empty; it must name at least one group rank")
    seen = set()
    for r in ranks:
        if not 0 <= r < group_size:
            raise ValueError(
                f"{op}: {arg} holds rank {r}, outside the group of {group_size} ranks "
                f"(ranks are group ranks 0..{group_size - 1})"
            )
        if r in seen:
            raise ValueError(f"{op}: {arg} holds rank {r} twice; each rank may appear once")
        seen.add(r)


def check_group_size(group_size: Any, op: str) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{op}: group_size must be a positive int, got {group_size!r}")


def norm_dim(dim: Any, ndim: int, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{op}: dim must be an int, got {dim!r}")
    if ndim < 1:
        raise ValueError(f"{op}: x must have at least one dimension (dim {dim} names the split dimension)")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} is out of range for x with {ndim} dimensions")
    return dim % ndim


def resolve_group(group_name: str, group_size: int, op: str):
    """The live ProcessGroup a graph names (never created here), checked against ``group_size``."""
    pg = resolve_process_group(group_name)
    if pg is None:
        raise RuntimeError(f"{op}: no process group named {group_name!r} in this process")
    if pg.size() != group_size:
        raise RuntimeError(
            f"{op}: group {group_name!r} has {pg.size()} ranks, the graph says group_size {group_size}"
        )
    import torch.distributed as dist

    if dist.get_rank(pg) < 0:
        raise RuntimeError(
            f"{op}: this process is not a member of group {group_name!r}; only its members call the op"
        )
    return pg


def own_group_rank(group_name: str) -> Optional[int]:
    """This process's rank in the group, or None when the group is not resolvable here."""
    import torch.distributed as dist

    pg = resolve_process_group(group_name)
    if pg is None:
        return None
    r = dist.get_rank(pg)
    return None if r < 0 else int(r)


def group_name_and_size(group: Any, op: str) -> tuple[str, int]:
    """Accept a ProcessGroup or a group name (str) as the ``group`` argument of a wrapper."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    if isinstance(group, ProcessGroup):
        return str(group.group_name), int(group.size())
    if isinstance(group, str):
        # _get_group_size_by_name, not resolve_process_group: Dynamo folds it to a constant
        # (it cannot trace the C++ resolver), so a wrapper called with a name compiles.
        try:
            return group, int(_get_group_size_by_name(group))
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"{op}: group {group!r} names no process group in this process") from e
    raise ValueError(f"{op}: group must be a ProcessGroup or a group name (str), got {type(group).__name__}")


def want_autograd(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


__all__ = [
    "as_rank_list",
    "check_group_size",
    "check_ranks",
    "group_name_and_size",
    "norm_dim",
    "own_group_rank",
    "resolve_group",
    "want_autograd",
]
