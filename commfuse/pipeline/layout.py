"""`setup_pipeline`: the process groups of a pipeline, created once, before any tracing.

    layout = commfuse.pipeline.setup_pipeline([[0, 1], [2, 3]])   # 2 stages x 2 ranks

Contract
- Call on every rank of the default group, after ``init_process_group``, with the same
  ``stage_ranks`` (a partition of the world into equal-size stages). Stage ``s``'s ranks
  are sorted ascending; a rank's *position* in its stage is its index there, which is
  also its group rank in the stage group (``dist.new_group`` orders ranks ascending).
- Creates, on every rank and in one fixed order (``new_group`` is itself collective over
  the default group): one group per stage (stages 0..S-1), then one *boundary* group per
  adjacent pair, the union of stages b and b+1 (b = 0..S-2). Each call creates new groups
  (call it once per job; the aliases then name the newest ones).
- Registers this rank's groups under deterministic aliases, ``commfuse.pp.stage<s>`` and
  ``commfuse.pp.boundary<b>``, so a graph names the same string on every rank and the
  name resolves (at run time, in the ops' kernels) to the member's own group. A rank
  never registers a group it is not a member of: the graph of a stage that this rank
  traces but does not run names an alias that only the stage's members can resolve.
- Returns a :class:`PipelineLayout` (plain data: the same on every rank except ``rank``,
  ``stage`` and ``position``). Tracing and partitioning read only the layout; they never
  create or resolve a group.

Transfers across boundary ``b`` pair positions: the rank at position ``p`` of stage ``b``
sends to the rank at position ``p`` of stage ``b+1`` (``boundary_pairs``), in group ranks
of the boundary group.

Source: session.py (aliases for sub-groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from commfuse.core.torch_private import register_process_group_alias

STAGE_PREFIX = "commfuse.pp.stage"
BOUNDARY_PREFIX = "commfuse.pp.boundary"

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class StageGroup:
    """A process group of the pipeline by alias: what graphs name, never resolved while tracing."""

    name: str  # alias registered on the members (``commfuse.pp.stage0``)
    size: int
    ranks: Ranks  # global ranks in group-rank order (ascending)

    def group_rank(self, global_rank: int) -> int:
        """Group rank of ``global_rank`` in this group (ValueError if not a member)."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(
                f"rank {global_rank} is not a member of {self.name} (ranks {list(self.ranks)})"
            ) from None

    def group_ranks(self, global_ranks: Sequence[int]) -> list[int]:
        return [self.group_rank(r) for r in global_ranks]


@dataclass(frozen=True)
class PipelineLayout:
    """Stages, their groups and this rank's place; see the module docstring."""

    stage_ranks: tuple[Ranks, ...]  # per stage, global ranks ascending
    stages: tuple[StageGroup, ...]
    boundaries: tuple[StageGroup, ...]  # boundary b: union of stages b and b+1
    rank: int  # this process's global rank
    stage: int  # this rank's stage
    position: int  # this rank's index in its stage (= its group rank in the stage group)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def stage_size(self) -> int:
        return len(self.stage_ranks[0])

    @property
    def world_size(self) -> int:
        return self.num_stages * self.stage_size

    def stage_of(self, global_rank: int) -> int:
        for s, ranks in enumerate(self.stage_ranks):
            if global_rank in ranks:
                return s
        raise ValueError(f"rank {global_rank} is in no stage of {[list(r) for r in self.stage_ranks]}")

    def boundary_pairs(self, b: int) -> tuple[list[int], list[int]]:
        """``(src, dst)`` of boundary ``b`` in group ranks of its boundary group: position ``p``
        of stage ``b`` (``src[p]``) sends to position ``p`` of stage ``b+1`` (``dst[p]``)."""
        if not 0 <= b < self.num_stages - 1:
            raise ValueError(
                f"boundary {b} does not exist: a pipeline of {self.num_stages} stages has "
                f"boundaries 0..{self.num_stages - 2}"
            )
        g = self.boundaries[b]
        return g.group_ranks(self.stage_ranks[b]), g.group_ranks(self.stage_ranks[b + 1])

    def stage_of_group_ranks(self, b: int, group_ranks: Sequence[int]) -> Optional[int]:
        """The stage (b or b+1) whose ranks are exactly ``group_ranks`` of boundary ``b`` in some
        order, else None."""
        g = self.boundaries[b]
        glob = {g.ranks[r] for r in group_ranks if 0 <= r < g.size}
        if len(glob) != len(group_ranks):
            return None
        for s in (b, b + 1):
            if glob == set(self.stage_ranks[s]):
                return s
        return None

    def boundary_index(self, group_name: str) -> Optional[int]:
        for b, g in enumerate(self.boundaries):
            if g.name == group_name:
                return b
        return None


def stage_alias(s: int) -> str:
    return f"{STAGE_PREFIX}{s}"


def boundary_alias(b: int) -> str:
    return f"{BOUNDARY_PREFIX}{b}"


def validate_stage_ranks(stage_ranks: Any, world_size: Optional[int]) -> tuple[Ranks, ...]:
    """``stage_ranks`` as sorted tuples, or a ValueError naming what is wrong."""
    if not isinstance(stage_ranks, (list, tuple)) or not stage_ranks:
        raise ValueError(
            f"stage_ranks: expected a non-empty list of rank lists, e.g. [[0, 1], [2, 3]]; "
            f"got {stage_ranks!r}"
        )
    out: list[Ranks] = []
    for s, ranks in enumerate(stage_ranks):
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"stage_ranks[{s}]: expected a non-empty list of ranks, got {ranks!r}")
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"stage_ranks[{s}]: ranks must be ints, got {list(ranks)!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"stage_ranks[{s}]: rank listed twice in {list(ranks)}")
        out.append(tuple(sorted(int(r) for r in ranks)))
    sizes = {len(r) for r in out}
    if len(sizes) != 1:
        raise ValueError(f"stage_ranks: stages must have equal sizes, got sizes {[len(r) for r in out]}")
    seen: dict[int, int] = {}
    for s, ranks in enumerate(out):
        for r in ranks:
            if r in seen:
                raise ValueError(
                    f"stage_ranks: rank {r} is in stage {seen[r]} and stage {s}; stages must be disjoint"
                )
            seen[r] = s
    if world_size is not None:
        bad = [r for r in seen if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"stage_ranks: ranks {sorted(bad)} are outside the world of {world_size} ranks")
        if len(seen) != world_size:
            missing = sorted(set(range(world_size)) - set(seen))
            raise ValueError(
                f"stage_ranks: ranks {missing} are in no stage; the stages must cover the world "
                f"of {world_size} ranks (one pipeline per job)"
            )
    return tuple(out)


def plan_layout(stage_ranks: Any, rank: int, world_size: Optional[int] = None) -> PipelineLayout:
    """The layout for ``rank`` without creating any group (pure; used by setup and tests)."""
    sr = validate_stage_ranks(stage_ranks, world_size)
    stages = tuple(StageGroup(stage_alias(s), len(r), r) for s, r in enumerate(sr))
    boundaries = tuple(
        StageGroup(boundary_alias(b), 2 * len(sr[b]), tuple(sorted(sr[b] + sr[b + 1])))
        for b in range(len(sr) - 1)
    )
    me = next((s for s, r in enumerate(sr) if rank in r), None)
    if me is None:
        raise ValueError(f"stage_ranks: this rank ({rank}) is in no stage")
    return PipelineLayout(sr, stages, boundaries, rank, me, sr[me].index(rank))


def setup_pipeline(stage_ranks: Sequence[Sequence[int]]) -> PipelineLayout:
    """Create the pipeline's groups (every rank, same arguments) and return the layout."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("setup_pipeline: call torch.distributed.init_process_group first (on every rank)")
    layout = plan_layout(stage_ranks, dist.get_rank(), dist.get_world_size())
    # One fixed order on every rank: stages, then boundaries (new_group is collective over the
    # default group). Always fresh groups: reusing "live" ones would need every rank to agree on
    # liveness, which a non-member cannot observe (it holds only c10d's non-member sentinel).
    for g in layout.stages + layout.boundaries:
        pg = dist.new_group(list(g.ranks))
        if layout.rank in g.ranks:
            register_process_group_alias(g.name, pg)
    return layout


__all__ = [
    "BOUNDARY_PREFIX",
    "PipelineLayout",
    "STAGE_PREFIX",
    "StageGroup",
    "boundary_alias",
    "plan_layout",
    "setup_pipeline",
    "stage_alias",
    "validate_stage_ranks",
]
