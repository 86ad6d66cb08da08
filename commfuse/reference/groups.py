"""Group names -> global ranks, for the reference interpreter.

A graph names process groups by string (``'0'`` is normally the world). The
interpreter needs, for every group name and every rank executing a collective on
it, the global ranks of *that rank's* group:

* ``None`` (the default): every group is the world ``[0, ..., N-1]``;
* ``{"1": [0, 2]}``: the group ``'1'`` is ranks 0 and 2; a rank outside it that
  executes a collective on ``'1'`` is an error;
* ``{"1": [[0, 2], [1, 3]]}``: a *partition*: each rank uses the block that contains
  it. This is how one SPMD graph traced on rank 0 (which names its own sub-group)
  runs on all ranks: rank 1 executes the same ``'1'`` collectives on ``[1, 3]``;
* ``"world"`` as a value: the world.

With one graph per rank (graphs traced on every rank), map each name to its one
block; names differ per rank exactly as they do in the real program.
:func:`groups_from_process_groups` builds the mapping from live (e.g. fake) process
groups.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence, Union

from commfuse.reference.errors import GroupResolutionError

GroupSpec = Union[str, Sequence[int], Sequence[Sequence[int]]]


class GroupTable:
    """Resolves (group name, global rank) -> that rank's group (a tuple of global ranks)."""

    def __init__(self, world_size: int, groups: Mapping[str, GroupSpec] | None = None) -> None:
        self.world_size = world_size
        self.world = tuple(range(world_size))
        self._blocks: dict[str, list[tuple[int, ...]]] | None = None
        if groups is not None:
            self._blocks = {str(k): self._normalise(str(k), v) for k, v in groups.items()}
        self._cache: dict[tuple[str, int], tuple[int, ...]] = {}

    def _normalise(self, name: str, spec: GroupSpec) -> list[tuple[int, ...]]:
        if isinstance(spec, str):
            if spec != "world":
                raise GroupResolutionError(
                    f"group {name!r}: unknown group spec {spec!r} (use 'world' or rank lists)"
                )
            return [self.world]
        spec = list(spec)
        if spec and all(isinstance(b, (list, tuple)) for b in spec):
            blocks = [tuple(int(r) for r in b) for b in spec]
        elif all(isinstance(r, int) for r in spec):
            blocks = [tuple(int(r) for r in spec)]
        else:
            raise GroupResolutionError(
                f"group {name!r}: expected a list of ranks or a list of rank lists, got {spec!r}"
            )
        seen: set[int] = set()
        for b in blocks:
            if not b:
                raise GroupResolutionError(f"group {name!r}: empty rank list")
            for r in b:
                if not 0 <= r < self.world_size:
                    raise GroupResolutionError(
                        f"group {name!r}: rank {r} is outside the world of {self.world_size}"
                    )
                if r in seen:
                    raise GroupResolutionError(f"group {name!r}: rank {r} appears in two blocks of {spec!r}")
                seen.add(r)
        return blocks

    def resolve(self, name: str, rank: int) -> tuple[int, ...]:
        key = (name, rank)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self._blocks is None:
            block = self.world
        else:
            blocks = self._blocks.get(name)
            if blocks is None:
                raise GroupResolutionError(
                    f"group {name!r} is not in the group mapping (known: {sorted(self._blocks)}); pass "
                    f"groups={{{name!r}: [ranks...]}} or a partition [[...], [...]] to the reference interpreter"
                )
            found = [b for b in blocks if rank in b]
            if not found:
                raise GroupResolutionError(
                    f"rank {rank} executes a collective on group {name!r} (ranks {[list(b) for b in blocks]}) "
                    f"but is not a member; for one SPMD graph with sub-groups pass the partition, "
                    f"e.g. {{{name!r}: [[0, 2], [1, 3]]}}, or trace one graph per rank"
                )
            block = found[0]
        self._cache[key] = block
        return block


def groups_from_process_groups(
    pgs: Iterable, partitions: Sequence[Sequence[Sequence[int]]] = ()
) -> dict[str, GroupSpec]:
    """Mapping for live process groups (e.g. created with ``dist.new_group`` under a fake
    process group): name -> its ranks, or -> the partition among ``partitions`` that
    contains its ranks (for one SPMD graph run on all ranks)."""
    import torch.distributed as dist

    out: dict[str, GroupSpec] = {}
    parts = [[tuple(b) for b in p] for p in partitions]
    for pg in pgs:
        if not isinstance(pg, dist.ProcessGroup):
            continue  # e.g. GroupMember.NON_GROUP_MEMBER on ranks outside the group
        ranks = tuple(dist.get_process_group_ranks(pg))
        spec: GroupSpec = list(ranks)
        for p in parts:
            if ranks in p:
                spec = [list(b) for b in p]
                break
        out[pg.group_name] = spec
    return out
