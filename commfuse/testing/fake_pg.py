"""Single-process fake process groups for tracing at large world sizes.

The "fake" backend hallucinates collectives without communicating, so one
process can pretend to be rank ``r`` of 64 ranks: enough to trace a program
(e.g. with ``make_fx(..., tracing_mode="fake")``) and inspect the collectives
a pass emits. Numbers it produces are meaningless; use :mod:`rank_pool` for
numerics.

Nesting policy: the default process group is process-global, so these
context managers REFUSE to start when one is already initialised (including
inside a gloo rank-pool job) instead of silently shadowing it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["fake_mesh", "fake_process_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Initialise a fake default process group; yield it; destroy it on exit.

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``.
        RuntimeError: a default process group is already initialised.

    Re-entrant sequentially: each ``with`` block creates a fresh group.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_process_group: a default process group is already initialised "
            f"(backend={dist.get_backend()!r}, world_size={dist.get_world_size()}); "
            "nesting is not supported because the default group is process-global. "
            "Destroy it first or run outside the rank pool."
        )
    # Importing registers the "fake" backend with c10d.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        # The body may already have torn it down; don't mask its exception.
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_mesh(
    world_size: int,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    *,
    rank: int = 0,
) -> Iterator[DeviceMesh]:
    """Yield a CPU ``DeviceMesh`` over a fake process group of ``world_size`` ranks.

    ``mesh_shape`` defaults to ``(world_size,)`` and must multiply to
    ``world_size``. The group (and the mesh's subgroups) are destroyed on exit.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh_shape {shape} does not multiply to world_size {world_size}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    with fake_process_group(world_size, rank):
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
