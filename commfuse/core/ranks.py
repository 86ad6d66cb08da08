"""This process's rank, and warnings in a multi-rank job: one copy of what every rank would say
alike, every copy of what differs.

Every rank of an SPMD job compiles the same graph with the same config and decides the same way
(docs/architecture.md, "Same decision on every rank"), so a warning about such a decision (a pass
that failed and was undone, a lowering that fell back, a mesh dim without a role) would be printed
N times with the same text. :func:`warn_rank0` prints it on rank 0 only and logs it at debug level
on the others. Warnings about something local to a rank (its dump directory, its own compile or
run failing) keep :func:`warnings.warn`, so every rank that hits one says so.

Repeats within one process follow Python's warning filters as usual (by default each message
once per place it is raised from).
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch.distributed as dist

log = logging.getLogger(__name__)


def process_rank() -> Optional[int]:
    """This process's global rank when torch.distributed is initialised, else None."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def process_world_size() -> int:
    """The world size when torch.distributed is initialised, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def warn_rank0(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category)`` on rank 0 (and in a process without a process group);
    a debug log line on the other ranks. For warnings whose text is the same on every rank.
    ``stacklevel`` counts as in ``warnings.warn`` from the caller's frame."""
    rank = process_rank()
    if rank not in (None, 0):
        log.debug("commfuse: (warned on rank 0) %s", message)
        return
    warnings.warn(message, category, stacklevel=stacklevel + 1)
