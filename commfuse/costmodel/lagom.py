"""Lagom: per-collective communicator settings chosen against computation contention.

What it searches
    Each collective j of a scheduled graph gets a setting ``s_j = (NC, C, NT)``: channels
    (CTAs, one SM each), chunk bytes, threads. Algorithm, protocol and transport are left to
    NCCL (Lagom tunes inside AutoCCL's A/P/T subspace too). The objective is Lagom's
    ``Z`` (Eq. 1) measured by the timeline simulator instead of ``max(X, Y)``: the makespan
    of the graph in its scheduled order when

    * collective j runs for ``x_j^{s_j}`` (below), and
    * every compute node is stretched by the contention model (``contention.py``,
      Eqs. 4-6) with the settings of the collectives *actually in flight* at each moment
      (a ``SlowdownFn`` that looks up each in-flight collective's ``CommResources``).

Time of one collective under a setting (x_j^s)
    The estimator's time at NCCL's default resources, split into a latency part (the same
    collective at one byte) and a bandwidth part. The bandwidth part is scaled by
    ``R(default) / R(s)`` with the per-channel rate of ``GpuContentionParams``:

        R(NC, C) = min(NC · b_ch · C / (C + C_half), B_j)

    ``b_ch`` the per-channel bandwidth (link / default channels), ``C_half`` the chunk at
    which a channel pipelines at half speed, ``B_j`` the collective's bottleneck link
    (intra-node bus bandwidth, or for a group spanning nodes the ring's
    ``min(B_intra, a_min · B_inter)``). Fewer channels or smaller chunks: less bandwidth,
    a slower collective, and (through ``V(NC, C)`` and the SMs left to compute) a smaller
    compute slowdown. Default resources: ``NC0 = topology.nccl_channels``, ``C0 = 2 MiB``.

The search (Lagom Algorithms 1 and 2), with the step rule written down
    The paper's Algorithm 2 raises NC, NT and C by a "learning rate" ``lr`` that is negative
    as printed, and gives no NC_min / C_min. commfuse uses a ladder instead:

    * Each collective has an ordered list of settings, fewest resources first (its
      *ladder*). Without a communicator pool: NC doubles from ``NC_min = 1`` up to
      ``min(2 · NC0, 32, λ - 1)`` (NC0 itself always on it), and C is tied to NC,
      ``C(NC) = clamp(C0 · NC / NC0, 64 KiB, C0)``, so the default communicator
      (NC0, C0) is one rung and the largest chunk is NCCL's default. Why: per-channel
      bandwidth adds up linearly until the link saturates, so doubling reaches saturation in
      log2 steps (the paper's ``lr`` is proportional to the relative gain; doubling is its
      fixed-rate form); and Lagom's reported choices keep C/NC about constant
      (NC 2 / 684 KB, NC 4 / 1366 KB, §4.3), raising both contention terms together.
      With a pool (``commfuse.setup(communicator_ctas=...)``): the rungs are the default
      communicator and each pool entry whose group exists, at the channel count NCCL runs it
      with (``clamp(NC0, min_ctas, max_ctas)``), all at C0 -- stock NCCL's chunk is
      process-wide (``NCCL_BUFFSIZE``), so only NC differs per communicator.
    * Algorithm 1: every collective starts on its first rung (minimal resources); all
      priorities ``H = 0.01``. Repeatedly the unfinished collective with the smallest H
      (ties: graph order) is raised one rung and the graph re-simulated (one *evaluation*).
    * Algorithm 2's stop rules, as decisions on that step: the step is **kept** only if the
      makespan got strictly better; then ``H_j = (Y' - Y) / (x_j^s - x_j^{s'})`` (Eq. 7,
      compute added per communication time saved). The collective is **finished** when the
      step made the makespan worse or equal (the step is undone: equal makespan with fewer
      resources is Lagom's goal), when its communication did not get faster (denominator
      <= 0: "already optimal"), or on its last rung.
    * Not taken over: Lagom's other stop rule, "total communication time fell below
      computation" (``X' < Y'``), its proxy for "more resources cannot help any more". With
      the simulator as judge the step itself is measured, and the proxy stopped too early:
      with it (as "no communication exposed after the step") the raise phase alone missed the
      brute-force optimum on 19 of 150 random 2-collective graphs, 11 without it -- once
      communication is hidden, one more rung can still shorten the window in which compute
      is slowed.
    * Give back (commfuse's addition): a collective raised while the others were still on
      their minimal rung was judged against slow neighbours and may now hold more than it
      needs. After Algorithm 1 finishes, each collective in graph order is lowered one rung at
      a time while that strictly improves the makespan; if anything was given back,
      Algorithm 1 runs again from the current settings (H reset), at most ``MAX_ROUNDS``
      rounds. With it 22 of 300 random 2-collective graphs (five GPU presets) miss the
      brute-force optimum: half by < 0.05 %, the worst by 4 %, where the optimum lies several
      rungs away behind a worse neighbouring rung (``tests/test_lagom.py`` checks a sample).
    * Cost: per round each collective takes at most ``len(ladder)`` evaluations raising (the
      kept steps and one undone) and as many giving back, so the search costs at most
      ``2 + 2 · MAX_ROUNDS · Σ_j len(ladder_j)`` evaluations -- linear in the number of
      collectives (brute force: ``Π_j len(ladder_j)``); in practice about one per rung.
    * The result is never predicted worse than NCCL's defaults: if the search ends above
      the all-default makespan, the defaults are kept (``kept_default``).

    ``max_evaluations`` (a count, never wall-clock: every rank must stop at the same point)
    bounds the search; when it runs out, collectives the search has not reached yet go back to
    NCCL's default setting (not their minimal starting rung), the others keep their current one.

Mapping to stock NCCL / PyTorch
    NC is the only knob settable per communicator (``ncclConfig_t.minCTAs/maxCTAs`` via
    ``ProcessGroupNCCL.Options().config``): per-collective settings become a pool of
    process groups, one per CTA configuration, created by ``commfuse.setup`` (never while
    compiling). NT (``NCCL_NTHREADS``), C (``NCCL_BUFFSIZE``), algorithm and protocol are
    process-wide environment variables: recorded in the settings, not applied.

Memory of extra communicators (an estimate)
    Each NCCL communicator allocates, per channel and per peer connection, one buffer per
    protocol: ``M ≈ NC · P · (BUFFSIZE_Simple + BUFFSIZE_LL128 + BUFFSIZE_LL)`` with NCCL's
    defaults 4 MiB + 4 800 KiB (120·640·8·8 B) + 512 KiB (8·512·8·16 B) ≈ 9.2 MiB, and
    ``P = 2`` (a ring's receive and send side). Tree / NVLS / CollNet buffers, proxy and
    work-FIFO memory are not counted; NCCL >= 2.22 connects lazily (NCCL_RUNTIME_CONNECT),
    so a pool communicator that never runs costs less. An estimate, not a measurement.

CPU / gloo
    gloo has none of these knobs: on a topology with ``num_sms == 0`` the search returns an
    empty result with a note.

Determinism
    Only the graph, the estimator (topology, profile) and the pool from ``commfuse.setup``
    enter; ties break by graph order and rung. Same answer on every rank.

Source: "Lagom: Unleashing the Power of Communication and Computation Overlapping for
Distributed LLM Training" (Xu et al.): Eqs. 1, 4-7 (§3.1-3.3), Algorithms 1-2 (§3.4).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch.fx as fx

from commfuse.core.errors import ConfigError
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import Placement
from commfuse.costmodel.contention import CommResources
from commfuse.costmodel.hierarchy import ranks_label
from commfuse.costmodel.simulator import NODE_COLLECTIVE, Simulator
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR

__all__ = [
    "CommSetting",
    "CommunicatorPool",
    "Evaluation",
    "LagomResult",
    "LagomStep",
    "PoolGroupPlan",
    "brute_force",
    "communicator_memory_bytes",
    "ladder_for",
    "lagom_search",
    "plan_communicator_pool",
    "pool_alias",
    "validate_communicator_ctas",
]

Ranks = tuple[int, ...]

NCCL_DEFAULT_CHUNK = 2 << 20  # Simple protocol chunk at NCCL_BUFFSIZE 4 MiB (BUFFSIZE / NCCL_STEPS * 4)
NCCL_DEFAULT_NTHREADS = (
    512  # NCCL Simple-protocol threads on sm80+; recorded only (Lagom §3.2: NT barely matters)
)
NCCL_MAX_CHANNELS = 32  # largest advisory NC (NCCL's MAXCHANNELS was 32 for years; pools may ask for more)
CHUNK_FLOOR = 64 << 10
# NCCL's default per-protocol buffer sizes (init.cc DEFAULT_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_LL_BUFFSIZE)
NCCL_BUFFSIZE_SIMPLE = 1 << 22
NCCL_BUFFSIZE_LL128 = 120 * 640 * 8 * 8
NCCL_BUFFSIZE_LL = 8 * 512 * 8 * 16
CONNECTIONS_PER_CHANNEL = 2
MAX_ROUNDS = 3  # raise + give-back rounds of the search (module docstring)
POOL_PREFIX = "commfuse.cta"
# relative tolerance of "strictly better" makespans (float noise of the sweep)
_REL_EPS = 1e-9


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class CommSetting:
    """Lagom's s_j minus A/P/T: NC channels, C chunk bytes, NT threads (recorded only).

    ``source``: "default" (the graph's own communicator, NCCL's defaults), "pool" (a
    communicator of the pool ``commfuse.setup`` created; ``pool_group_alias`` names it) or
    "advisory" (no pool: what a patched NCCL would run; the lowering keeps the graph's group)."""

    channels: int
    chunk_bytes: int
    nthreads: int = NCCL_DEFAULT_NTHREADS
    min_ctas: Optional[int] = None
    max_ctas: Optional[int] = None
    pool_group_alias: Optional[str] = None
    source: str = "default"

    def resources(self) -> CommResources:
        return CommResources(self.channels, self.chunk_bytes)

    def label(self) -> str:
        where = f" @{self.pool_group_alias}" if self.pool_group_alias else ""
        return f"NC={self.channels} C={_kib(self.chunk_bytes)}{where}"

    def to_meta(self) -> dict[str, Any]:
        """The plain dict passes write to ``start_node.meta["commfuse_comm_setting"]``."""
        return {
            "min_ctas": self.min_ctas,
            "max_ctas": self.max_ctas,
            "chunk_bytes": self.chunk_bytes,
            "nthreads": self.nthreads,
            "pool_group_alias": self.pool_group_alias,
            "channels": self.channels,
            "source": self.source,
        }


def _kib(b: int) -> str:
    return f"{b // 1024}K" if b % (1 << 20) else f"{b >> 20}M"


def default_setting(nc0: int) -> CommSetting:
    return CommSetting(nc0, NCCL_DEFAULT_CHUNK)


def tied_chunk(nc: int, nc0: int) -> int:
    """C(NC) = clamp(C0 · NC / NC0, 64 KiB, C0) (module docstring, "step rule")."""
    return max(CHUNK_FLOOR, min(NCCL_DEFAULT_CHUNK, NCCL_DEFAULT_CHUNK * nc // nc0))


# --------------------------------------------------------------------------- the pool
def validate_communicator_ctas(
    value: Any, field_name: str = "communicator_ctas"
) -> tuple[tuple[int, int], ...]:
    """``[(min_ctas, max_ctas), ...]`` checked: positive ints, min <= max; duplicates dropped (first kept)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{field_name}: expected a list of (min_ctas, max_ctas) pairs, got {value!r}")
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigError(f"{field_name}[{i}]: expected a (min_ctas, max_ctas) pair, got {pair!r}")
        mn, mx = pair
        for what, v in (("min_ctas", mn), ("max_ctas", mx)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{field_name}[{i}].{what}: expected an int, got {v!r}")
            if v <= 0:
                raise ConfigError(f"{field_name}[{i}].{what}: must be >= 1, got {v}")
        if mn > mx:
            raise ConfigError(f"{field_name}[{i}]: min_ctas {mn} > max_ctas {mx}")
        if (mn, mx) not in out:
            out.append((mn, mx))
    return tuple(out)


def pool_alias(min_ctas: int, max_ctas: int, ranks: Sequence[int]) -> str:
    """``commfuse.cta<min>-<max>.<ranks label>`` (the label of :func:`commfuse.costmodel.hierarchy.ranks_label`)."""
    return f"{POOL_PREFIX}{min_ctas}-{max_ctas}.{ranks_label(ranks)}"


@dataclass(frozen=True)
class PoolGroupPlan:
    """One process group of the communicator pool: a parent group's ranks with CTA bounds."""

    ranks: Ranks
    min_ctas: int
    max_ctas: int
    alias: str


def plan_communicator_pool(
    parents: Sequence[Sequence[int]], ctas: Sequence[tuple[int, int]]
) -> list[PoolGroupPlan]:
    """Which pool groups ``commfuse.setup`` creates, in creation order (the same on every rank).

    For each parent group (in the order given: world, mesh dims, ``groups``; a rank tuple
    seen before is skipped, groups of one rank have nothing to communicate) one group per CTA
    configuration, in the order ``ctas`` lists them."""
    ctas = validate_communicator_ctas(list(ctas))
    seen: set[Ranks] = set()
    out: list[PoolGroupPlan] = []
    for p in parents:
        ranks = tuple(int(r) for r in p)
        if len(ranks) < 2 or ranks in seen:
            continue
        seen.add(ranks)
        for mn, mx in ctas:
            out.append(PoolGroupPlan(ranks, mn, mx, pool_alias(mn, mx, ranks)))
    return out


def effective_channels(min_ctas: int, max_ctas: int, nc0: int) -> int:
    """The channel count NCCL runs a communicator with CTA bounds [min, max] at (its default clamped)."""
    return min(max_ctas, max(min_ctas, nc0))


def communicator_memory_bytes(channels: int, *, connections: int = CONNECTIONS_PER_CHANNEL) -> int:
    """Estimated buffer memory of one NCCL communicator running ``channels`` channels (module docstring)."""
    return channels * connections * (NCCL_BUFFSIZE_SIMPLE + NCCL_BUFFSIZE_LL128 + NCCL_BUFFSIZE_LL)


MEMORY_FORMULA = (
    "NC x 2 connections x (Simple 4 MiB + LL128 4800 KiB + LL 512 KiB) per communicator "
    "(NCCL default buffer sizes; tree/NVLS/proxy memory not counted; an estimate)"
)


@dataclass(frozen=True)
class CommunicatorPool:
    """The CTA configurations a search may use and the groups that have them.

    ``parents``: rank tuples of the groups ``commfuse.setup`` created pool communicators for
    (None: every group whose ranks are known, for what-if studies)."""

    ctas: tuple[tuple[int, int], ...]
    parents: Optional[frozenset[Ranks]] = None

    @classmethod
    def from_plan(cls, plan: Sequence[PoolGroupPlan]) -> Optional["CommunicatorPool"]:
        if not plan:
            return None
        ctas: list[tuple[int, int]] = []
        for p in plan:
            if (p.min_ctas, p.max_ctas) not in ctas:
                ctas.append((p.min_ctas, p.max_ctas))
        return cls(tuple(ctas), frozenset(p.ranks for p in plan))

    def covers(self, ranks: Optional[Sequence[int]]) -> bool:
        if ranks is None:
            return False
        return self.parents is None or tuple(ranks) in self.parents


# --------------------------------------------------------------------------- ladders
def ladder_for(c: Collective, nc0: int, num_sms: int, pool: Optional[CommunicatorPool]) -> list[CommSetting]:
    """The settings Algorithm 2 walks through for ``c``, fewest resources first (module docstring)."""
    default = default_setting(nc0)
    if pool is None:
        cap = max(1, min(NCCL_MAX_CHANNELS, 2 * nc0, num_sms - 1))
        ncs = sorted({1 << k for k in range(cap.bit_length()) if (1 << k) <= cap} | {nc0})
        return [
            default
            if nc == nc0
            else CommSetting(nc, tied_chunk(nc, nc0), min_ctas=nc, max_ctas=nc, source="advisory")
            for nc in ncs
        ]
    ranks = c.group.ranks
    if ranks is None or not pool.covers(ranks):
        return [default]
    by_nc: dict[int, CommSetting] = {nc0: default}  # equal channels: the graph's own communicator wins
    for mn, mx in pool.ctas:
        nc = min(effective_channels(mn, mx, nc0), num_sms - 1)
        if nc not in by_nc:
            by_nc[nc] = CommSetting(
                nc,
                NCCL_DEFAULT_CHUNK,
                min_ctas=mn,
                max_ctas=mx,
                pool_group_alias=pool_alias(mn, mx, ranks),
                source="pool",
            )
    return [by_nc[nc] for nc in sorted(by_nc)]


# --------------------------------------------------------------------------- the time model
class SettingTimeModel:
    """x_j^s (module docstring) and the contention of in-flight settings, memoised."""

    def __init__(self, estimator: AnalyticCostModel) -> None:
        topo = estimator.topology
        gpu = estimator.contention.gpu
        if gpu is None:
            raise ConfigError(f"lagom: topology {topo.name!r} is not a GPU/NCCL topology (num_sms == 0)")
        self.estimator = estimator
        self.topology = topo
        self.gpu = gpu
        self.nc0 = topo.nccl_channels
        self._split: dict[fx.Node, tuple[float, float, float]] = {}
        self._compute: dict[fx.Node, Any] = {}
        self._slow: dict[tuple[fx.Node, tuple[tuple[int, int], ...]], float] = {}

    def rate(self, channels: int, chunk: int, bottleneck_GBps: float) -> float:
        g = self.gpu
        return min(channels * g.per_channel_bw_GBps * chunk / (chunk + g.chunk_half_bytes), bottleneck_GBps)

    def _bottleneck(self, c: Collective) -> float:
        t = self.topology
        n = c.group.size or (len(c.group.ranks) if c.group.ranks else t.world_size)
        p = Placement.of(t, n, c.group.ranks)
        return (
            t.intra_node_bandwidth_GBps
            if not p.spans
            else min(t.intra_node_bandwidth_GBps, p.a_min * t.inter_node_bandwidth_GBps)
        )

    def split(self, c: Collective) -> tuple[float, float, float]:
        """(time at default resources, latency part, bottleneck link GB/s)."""
        hit = self._split.get(c.start)
        if hit is None:
            est = self.estimator
            base = est.collective(c).time_us
            n = c.group.size or (len(c.group.ranks) if c.group.ranks else self.topology.world_size)
            lat = est.collectives.time(c.kind, 1, n, ranks=c.group.ranks).time_us
            if base > 0:
                lat += est.runtime.collective_in_graph_us
            hit = self._split[c.start] = (base, min(base, lat), self._bottleneck(c))
        return hit

    def comm_time_us(self, c: Collective, s: CommSetting) -> float:
        base, lat, bott = self.split(c)
        bw = base - lat
        if bw <= 0:
            return base
        r0 = self.rate(self.nc0, NCCL_DEFAULT_CHUNK, bott)
        return lat + bw * r0 / self.rate(s.channels, s.chunk_bytes, bott)

    def slowdown(self, node: fx.Node, resources: tuple[tuple[int, int], ...]) -> float:
        key = (node, resources)
        f = self._slow.get(key)
        if f is None:
            est = self._compute.get(node)
            if est is None:
                est = self._compute[node] = self.estimator.compute_estimate(node)
            f = self._slow[key] = self.estimator.contention.slowdown(
                est, [CommResources(nc, ch) for nc, ch in resources]
            )
        return f


class _SettingSimulator(Simulator):
    """The simulator with collective durations set per evaluation.

    ``Simulator`` estimates and caches every node's cost when it is built; a setting changes
    only collective durations, so the search builds one simulator and overwrites the cached
    durations of the collectives before each sweep (rebuilding it per evaluation cost about
    60 % of the search on a 1400-node backward graph)."""

    def set_collective_time(self, start: fx.Node, time_us: float) -> None:
        cost = self._lookup(start)
        if cost.code != NODE_COLLECTIVE:
            raise ValueError(f"lagom: {start.name} is not a collective start in the simulator's table")
        cost.time_us = time_us


@dataclass(frozen=True)
class Evaluation:
    """One simulation of the graph under a full assignment of settings."""

    makespan_us: float  # Z
    compute_us: float  # Y: compute stream busy time, stretched by contention
    comm_us: float  # X: sum of collective durations
    exposed_comm_us: float


class _Judge:
    """Simulates the graph under settings (collectives not named: NCCL's defaults); counts evaluations."""

    def __init__(
        self, gm: fx.GraphModule, model: SettingTimeModel, ir: CollectiveIR, collectives: Sequence[Collective]
    ) -> None:
        self.model = model
        self.collectives = list(collectives)
        self.evaluations = 0
        self._current: dict[fx.Node, tuple[int, int]] = {}
        self._sim = _SettingSimulator(gm, model.estimator, slowdown=self._slowdown, ir=ir)
        self._base = {c.start: self._sim.cost_of(c.start) for c in self.collectives}
        self._set: dict[fx.Node, float] = dict(self._base)

    def _slowdown(self, node: fx.Node, concurrent: Sequence[Collective]) -> float:
        default = (self.model.nc0, NCCL_DEFAULT_CHUNK)
        res = tuple(sorted(self._current.get(c.start, default) for c in concurrent))
        return self.model.slowdown(node, res)

    def evaluate(self, settings: dict[str, CommSetting]) -> Evaluation:
        self.evaluations += 1
        self._current = {}
        for c in self.collectives:
            s = settings.get(c.name)
            if s is None:
                t = self._base[c.start]
            else:
                t = self.model.comm_time_us(c, s)
                self._current[c.start] = (s.channels, s.chunk_bytes)
            if self._set.get(c.start) != t:
                self._sim.set_collective_time(c.start, t)
                self._set[c.start] = t
        r = self._sim.simulate(memory=False, record=False)
        return Evaluation(
            float(r.makespan_us), float(r.compute_us), float(r.comm_us), float(r.exposed_comm_us)
        )


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class LagomStep:
    """One evaluation of the search (one rung raised on one collective) and what it decided."""

    step: int
    collective: str
    from_setting: str
    to_setting: str
    makespan_us: float
    compute_us: float
    comm_us: float
    comm_time_before_us: float  # x_j^{s}
    comm_time_after_us: float  # x_j^{s'}
    priority: Optional[float]  # H_j after the step (Eq. 7), None when the step was undone
    outcome: str


@dataclass
class LagomResult:
    """The search's answer for one graph (settings keyed by collective start node name)."""

    settings: dict[str, CommSetting] = field(default_factory=dict)
    makespan_default_us: float = 0.0  # every collective at NCCL's defaults ("before")
    makespan_us: float = 0.0  # the chosen settings ("after")
    default: Optional[Evaluation] = None
    chosen: Optional[Evaluation] = None
    evaluations: int = 0
    brute_force_combinations: int = 0  # Π_j len(ladder_j): what exhaustive search would evaluate
    ladders: dict[str, list[CommSetting]] = field(default_factory=dict)
    comm_time_us: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (default, chosen)
    trace: list[LagomStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kept_default: bool = False
    budget_exhausted: bool = False
    pool: Optional[CommunicatorPool] = None
    # extra communicators the chosen settings use (pool aliases, or for advisory settings one per
    # distinct (group, NC)) and their estimated buffer memory per rank
    extra_communicators: dict[str, int] = field(default_factory=dict)  # name -> estimated bytes

    @property
    def tuned(self) -> bool:
        return bool(self.settings)

    @property
    def speedup(self) -> float:
        return self.makespan_default_us / self.makespan_us if self.makespan_us > 0 else 1.0

    @property
    def extra_memory_bytes(self) -> int:
        return sum(self.extra_communicators.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": {k: v.to_meta() for k, v in self.settings.items()},
            "makespan_default_us": self.makespan_default_us,
            "makespan_us": self.makespan_us,
            "default": asdict(self.default) if self.default else None,
            "chosen": asdict(self.chosen) if self.chosen else None,
            "evaluations": self.evaluations,
            "brute_force_combinations": self.brute_force_combinations,
            "comm_time_us": {k: list(v) for k, v in self.comm_time_us.items()},
            "trace": [asdict(s) for s in self.trace],
            "notes": list(self.notes),
            "kept_default": self.kept_default,
            "budget_exhausted": self.budget_exhausted,
            "pool": None if self.pool is None else [list(p) for p in self.pool.ctas],
            "extra_communicators": dict(self.extra_communicators),
            "extra_memory_bytes": self.extra_memory_bytes,
            "memory_formula": MEMORY_FORMULA,
        }


# --------------------------------------------------------------------------- search
@dataclass
class _Problem:
    judge: _Judge
    model: SettingTimeModel
    collectives: list[Collective]  # the ones with something to choose (ladder of 2+ rungs)
    ladders: dict[str, list[CommSetting]]
    fixed: dict[str, CommSetting]  # one-rung collectives (their default)
    result: LagomResult


def _prepare(
    gm: fx.GraphModule,
    estimator: AnalyticCostModel,
    pool: Optional[CommunicatorPool],
    ir: Optional[CollectiveIR],
) -> _Problem | LagomResult:
    topo = estimator.topology
    if not topo.is_gpu or estimator.backend != "nccl" or estimator.contention.gpu is None:
        return LagomResult(
            notes=[
                f"topology {topo.name!r} is not a GPU/NCCL topology (num_sms == 0 or backend "
                f"{estimator.backend!r}): gloo has no per-collective communicator knobs "
                "(channels, chunk, threads); nothing to tune"
            ]
        )
    ir = ir if ir is not None else CollectiveIR(gm)
    model = SettingTimeModel(estimator)
    result = LagomResult(pool=pool)
    colls: list[Collective] = []
    ladders: dict[str, list[CommSetting]] = {}
    fixed: dict[str, CommSetting] = {}
    skipped_local: list[str] = []
    no_pool: list[str] = []
    for c in ir.collectives:
        if model.split(c)[0] <= 0:
            skipped_local.append(c.name)
            continue
        lad = ladder_for(c, model.nc0, topo.num_sms, pool)
        if len(lad) < 2:
            fixed[c.name] = lad[0]
            no_pool.append(c.name)
            continue
        colls.append(c)
        ladders[c.name] = lad
    if skipped_local:
        result.notes.append(
            f"no communication to tune (group of one rank or empty): {', '.join(skipped_local)}"
        )
    if no_pool:
        result.notes.append(
            "no pool communicator for the group (kept on its own communicator): " + ", ".join(no_pool)
        )
    if pool is None:
        result.notes.append(
            "no communicator pool (commfuse.setup(communicator_ctas=...)): settings are advisory, "
            "collectives stay on their graph's group"
        )
    result.ladders = {k: list(v) for k, v in ladders.items()}
    result.brute_force_combinations = math.prod(len(v) for v in ladders.values()) if ladders else 0
    judge = _Judge(gm, model, ir, [*colls, *(c for c in ir.collectives if c.name in fixed)])
    return _Problem(judge, model, colls, ladders, fixed, result)


def _better(a: float, b: float) -> bool:
    """``a`` strictly below ``b`` beyond float noise."""
    return a < b - _REL_EPS * max(1.0, abs(b))


def _finish(
    p: _Problem, settings: dict[str, CommSetting], default_eval: Evaluation, chosen_eval: Evaluation
) -> LagomResult:
    r = p.result
    nc0 = p.model.nc0
    default = {c.name: default_setting(nc0) for c in p.collectives}
    if _better(default_eval.makespan_us, chosen_eval.makespan_us):
        settings, chosen_eval = dict(default), default_eval
        r.kept_default = True
        r.notes.append("the search ended above NCCL's default makespan: defaults kept")
    r.settings = {**{k: v for k, v in p.fixed.items()}, **settings}
    r.default, r.chosen = default_eval, chosen_eval
    r.makespan_default_us, r.makespan_us = default_eval.makespan_us, chosen_eval.makespan_us
    r.evaluations = p.judge.evaluations
    r.comm_time_us = {
        c.name: (p.model.comm_time_us(c, default_setting(nc0)), p.model.comm_time_us(c, settings[c.name]))
        for c in p.collectives
    }
    extra: dict[str, int] = {}
    for c in p.collectives:
        s = settings[c.name]
        if s.source == "pool" and s.pool_group_alias:
            extra[s.pool_group_alias] = communicator_memory_bytes(s.channels)
        elif s.source == "advisory":
            extra[f"{c.group.name}@NC{s.channels}"] = communicator_memory_bytes(s.channels)
    r.extra_communicators = dict(sorted(extra.items()))
    return r


def lagom_search(
    gm: fx.GraphModule,
    estimator: AnalyticCostModel,
    *,
    pool: Optional[CommunicatorPool] = None,
    max_evaluations: int = 1000,
    ir: Optional[CollectiveIR] = None,
) -> LagomResult:
    """Lagom's Algorithms 1-2 on the scheduled graph ``gm`` (its node order is the schedule).

    ``estimator``: the topology's ``AnalyticCostModel`` (backend "nccl" on a GPU topology);
    ``pool``: the communicator pool to choose from (None: advisory ladder, module docstring);
    ``max_evaluations``: simulations allowed (>= 2: the default and the starting point)."""
    if isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int) or max_evaluations < 2:
        raise ConfigError(f"lagom: max_evaluations must be an int >= 2, got {max_evaluations!r}")
    p = _prepare(gm, estimator, pool, ir)
    if isinstance(p, LagomResult):
        return p
    r, judge, model = p.result, p.judge, p.model
    if not p.collectives:
        r.settings = dict(p.fixed)
        r.notes.append("no collective with more than one setting: nothing to search")
        if p.fixed:
            ev = judge.evaluate(r.settings)
            r.default = r.chosen = ev
            r.makespan_default_us = r.makespan_us = ev.makespan_us
        r.evaluations = judge.evaluations
        return r
    nc0 = model.nc0
    default_eval = judge.evaluate({**p.fixed, **{c.name: default_setting(nc0) for c in p.collectives}})
    rung = {c.name: 0 for c in p.collectives}

    def current() -> dict[str, CommSetting]:
        return {**p.fixed, **{c.name: p.ladders[c.name][rung[c.name]] for c in p.collectives}}

    cur = judge.evaluate(current())
    order = {c.name: i for i, c in enumerate(p.collectives)}
    by_name = {c.name: c for c in p.collectives}
    step = 0

    touched: set[str] = set()

    def out_of_budget() -> bool:
        return judge.evaluations >= max_evaluations - 1  # one evaluation kept for give_up

    def give_up() -> LagomResult:
        """Budget spent: collectives the search has not reached go back to NCCL's default (not the
        minimal rung they started on); the others keep their current setting."""
        nonlocal cur
        r.budget_exhausted = True
        untouched = [c.name for c in p.collectives if c.name not in touched]
        for j in untouched:
            rung[j] = p.ladders[j].index(default_setting(nc0))
        if len(untouched) == len(p.collectives):
            cur = default_eval
        elif untouched:
            cur = judge.evaluate(current())
        r.notes.append(
            f"evaluation budget ({max_evaluations}) exhausted: {len(untouched)} collective(s) the search "
            "had not reached stay on NCCL's default setting, the others keep their current one"
        )
        return _finish(p, current(), default_eval, cur)

    def try_rung(j: str, to: int, phase: str) -> tuple[Evaluation, float, float]:
        """Evaluate ``j`` moved to rung ``to`` (left there); record the step."""
        nonlocal step
        c, lad = by_name[j], p.ladders[j]
        s, s2 = lad[rung[j]], lad[to]
        x_old, x_new = model.comm_time_us(c, s), model.comm_time_us(c, s2)
        rung[j] = to
        touched.add(j)
        ev = judge.evaluate(current())
        step += 1
        r.trace.append(
            LagomStep(
                step,
                j,
                s.label(),
                s2.label(),
                ev.makespan_us,
                ev.compute_us,
                ev.comm_us,
                x_old,
                x_new,
                None,
                phase,
            )
        )
        return ev, x_old, x_new

    def outcome(text: str, h: Optional[float] = None) -> None:
        last = r.trace[-1]
        r.trace[-1] = LagomStep(
            last.step,
            last.collective,
            last.from_setting,
            last.to_setting,
            last.makespan_us,
            last.compute_us,
            last.comm_us,
            last.comm_time_before_us,
            last.comm_time_after_us,
            h,
            f"{last.outcome}: {text}",
        )

    for rnd in range(1, MAX_ROUNDS + 1):
        # Algorithms 1-2: raise the unfinished collective with the smallest H by one rung
        H = {c.name: 0.01 for c in p.collectives}  # Algorithm 1, line 2
        done: set[str] = set()
        while len(done) < len(p.collectives):
            j = min((n for n in order if n not in done), key=lambda n: (H[n], order[n]))
            if rung[j] + 1 >= len(p.ladders[j]):
                done.add(j)
                continue
            if out_of_budget():
                return give_up()
            ev, x_old, x_new = try_rung(j, rung[j] + 1, f"round {rnd} raise")
            dx = x_old - x_new
            if not _better(ev.makespan_us, cur.makespan_us):
                rung[j] -= 1
                done.add(j)
                outcome("not better, undone, finished")
            elif dx <= 0:
                rung[j] -= 1
                done.add(j)
                outcome("communication not faster, undone, finished")
            else:
                H[j] = (ev.compute_us - cur.compute_us) / dx  # Eq. 7
                cur = ev
                outcome("kept", H[j])
        # give back: a collective raised while the others were still slow may now hold more than it needs
        gave_back = False
        for j in order:
            while rung[j] > 0:
                if out_of_budget():
                    return give_up()
                ev, _, _ = try_rung(j, rung[j] - 1, f"round {rnd} give back")
                if _better(ev.makespan_us, cur.makespan_us):
                    cur = ev
                    gave_back = True
                    outcome("kept")
                else:
                    rung[j] += 1
                    outcome("not better, undone")
                    break
        if not gave_back:
            break
    return _finish(p, current(), default_eval, cur)


def brute_force(
    gm: fx.GraphModule,
    estimator: AnalyticCostModel,
    *,
    pool: Optional[CommunicatorPool] = None,
    max_combinations: int = 4096,
    ir: Optional[CollectiveIR] = None,
) -> LagomResult:
    """Every combination of the same ladders (tests and small cases): the exact optimum of Z.

    Ties: fewest channels in total, then the first combination in ladder order."""
    p = _prepare(gm, estimator, pool, ir)
    if isinstance(p, LagomResult):
        return p
    r, judge = p.result, p.judge
    if not p.collectives:
        r.settings = dict(p.fixed)
        return r
    if r.brute_force_combinations > max_combinations:
        raise ConfigError(
            f"lagom brute_force: {r.brute_force_combinations} combinations exceed "
            f"max_combinations={max_combinations}"
        )
    nc0 = p.model.nc0
    default_eval = judge.evaluate({**p.fixed, **{c.name: default_setting(nc0) for c in p.collectives}})
    best: Optional[tuple[Evaluation, int, dict[str, CommSetting]]] = None
    names = [c.name for c in p.collectives]
    for combo in itertools.product(*(p.ladders[n] for n in names)):
        settings = dict(zip(names, combo, strict=True))
        ev = judge.evaluate({**p.fixed, **settings})
        channels = sum(s.channels for s in combo)
        if (
            best is None
            or _better(ev.makespan_us, best[0].makespan_us)
            or (not _better(best[0].makespan_us, ev.makespan_us) and channels < best[1])
        ):
            best = (ev, channels, settings)
    assert best is not None
    return _finish(p, best[2], default_eval, best[0])


def evaluate_settings(
    gm: fx.GraphModule,
    estimator: AnalyticCostModel,
    settings: dict[str, CommSetting],
    ir: Optional[CollectiveIR] = None,
) -> Evaluation:
    """Z, Y, X of ``gm`` with the given settings (collectives not named run at NCCL's defaults)."""
    ir = ir if ir is not None else CollectiveIR(gm)
    judge = _Judge(gm, SettingTimeModel(estimator), ir, ir.collectives)
    return judge.evaluate(settings)
