"""Overlap profiling: measure DHelix's Overlap Effectiveness Factor (Eq. 1) on this machine.

Contract
- :func:`measure_oef` runs on *every* rank of an initialised process group (gloo or NCCL;
  a profiler run, not compile time, so it may issue collectives). For every size and every
  unordered pair of operator kinds — compute x communication (:data:`COMPUTE_KINDS` x
  :data:`COMM_KINDS`) and communication x communication (including a kind with itself) — it
  times A alone, B alone and A with B concurrently (collectives issued ``async_op=True``,
  compute run on the calling thread, then every handle waited), each the median of
  ``repeats`` trials that start behind a barrier; the three trials of a pair run back to back
  in every repeat, so transient load on a shared machine hits the solo and co-run times alike. Each median is then ``all_reduce(MAX)``-ed
  over the ranks before Eq. 1 is applied, so every rank computes the *same* table.
- The stored factor is the raw Eq. 1 value ``(T_a + T_b - P_ab) / min(T_a, T_b)``: it can
  fall below 0 (co-running was slower than running one after the other: two gloo threads
  and the compute thread fighting over 2 shared cores) or exceed 1 (noise). Consumers clamp
  it into [0, 1] (:func:`oef_for`, :func:`load_oef_profile`): a negative gain is planned as
  "no gain", because Eq. 2 may always run the two units one after the other instead.
- :func:`save_oef_profile` / :func:`read_oef_profile` store/load the JSON profile (schema
  version, machine, date, world size, backend, comm scope, sizes, entries); every problem
  raises :class:`~commfuse.core.errors.ConfigError` naming the path and the field.
- :func:`oef_for` returns the measured factor of an op-kind pair (median over sizes, or the
  nearest measured size) when the profile has it, else the fallback. The fallback is
  :func:`~.overlap.default_oef` (the paper's qualitative shape) on the pair's segment kinds —
  not the contention model of :mod:`commfuse.costmodel.contention`, whose CPU form (compute
  slowed by ``1 + kappa``) says nothing about comm x comm pairs and needs durations, which a
  per-kind factor does not have.
- :func:`load_oef_profile` returns the :class:`~.overlap.OEFTable` for plan search: each
  segment-kind pair gets the median of the clamped measured factors of the op-kind pairs
  that map to it (compute kinds -> ``compute``; collectives -> ``comm_local`` or
  ``comm_cross`` after the profile's ``comm_scope``); pairs with no measurement (always
  compute x compute, and the other comm scope) take the fallback table's factor.

Source: DHelix (Wang et al.), Sec. 3.2 Eq. 1 and Fig. 4 (pairwise overlap profiling).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from commfuse.core.torch_private import c10d_all_gather_single, c10d_reduce_scatter_single
from commfuse.core.errors import ConfigError
from commfuse.dhelix.overlap import OEFTable, default_oef
from commfuse.dhelix.segments import SEGMENT_KINDS

SCHEMA_VERSION = 1
COMPUTE_KINDS = ("matmul", "elementwise")
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
OP_KINDS = COMPUTE_KINDS + COMM_KINDS
COMM_SCOPES = ("local", "cross")
DEFAULT_SIZES = (1 << 16, 1 << 18)  # float32 elements per operand (256 KiB, 1 MiB)


@dataclass(frozen=True)
class OEFEntry:
    """One measured pair at one size: solo and co-run times (us, max over ranks) and raw Eq. 1."""

    a: str
    b: str
    size: int
    t_a_us: float
    t_b_us: float
    t_ab_us: float
    oef: float


@dataclass(frozen=True)
class OEFProfile:
    schema_version: int
    machine: dict
    date: str
    world_size: int
    backend: str
    comm_scope: str
    repeats: int
    sizes: tuple[int, ...]
    entries: tuple[OEFEntry, ...]

    def factor(self, a: str, b: str, size: Optional[int] = None) -> Optional[float]:
        """Measured raw factor of op kinds (a, b), either order; None when not measured."""
        hits = [e for e in self.entries if (e.a, e.b) in ((a, b), (b, a))]
        if not hits:
            return None
        if size is not None:
            best = min(abs(e.size - size) for e in hits)
            hits = [e for e in hits if abs(e.size - size) == best]
        return statistics.median(e.oef for e in hits)


def overlap_effectiveness(t_a: float, t_b: float, t_ab: float) -> float:
    """DHelix Eq. 1, unclamped."""
    m = min(t_a, t_b)
    if m <= 0:
        raise ConfigError(f"oef: solo times must be > 0, got T_a={t_a}, T_b={t_b}")
    return (t_a + t_b - t_ab) / m


def segment_kind(op_kind: str, comm_scope: str = "local") -> str:
    """Map an op kind (or a segment kind, returned as is) to a :data:`SEGMENT_KINDS` entry."""
    if op_kind in SEGMENT_KINDS:
        return op_kind
    if op_kind in COMPUTE_KINDS:
        return "compute"
    if op_kind in COMM_KINDS:
        return "comm_local" if comm_scope == "local" else "comm_cross"
    raise ConfigError(f"oef: unknown kind {op_kind!r}; expected one of {OP_KINDS + SEGMENT_KINDS}")


def _clamp(v: float) -> float:
    return min(1.0, max(0.0, v))


# ---------------------------------------------------------------- measurement (every rank)


def _op(kind: str, size: int, world: int, group) -> Callable[[], list]:
    """A zero-argument launcher: runs compute now or issues a collective async; returns handles."""
    import torch
    import torch.distributed as dist

    if kind == "matmul":
        n = max(1, round(math.sqrt(size)))
        x, y = torch.randn(n, n), torch.randn(n, n)
        return lambda: (torch.mm(x, y), [])[1]
    if kind == "elementwise":
        x, y = torch.randn(size), torch.randn(size)
        return lambda: (torch.tanh(x * y + x), [])[1]
    per = max(1, size // world) * world  # divisible by world for scatter/all_to_all
    if kind == "all_gather":
        inp, out = torch.randn(per // world), torch.empty(per)
        return lambda: [c10d_all_gather_single()(out, inp, group=group, async_op=True)]
    if kind == "reduce_scatter":
        inp, out = torch.randn(per), torch.empty(per // world)
        return lambda: [c10d_reduce_scatter_single()(out, inp, group=group, async_op=True)]
    if kind == "all_reduce":
        buf = torch.randn(per)
        return lambda: [dist.all_reduce(buf, group=group, async_op=True)]
    if kind == "all_to_all":
        inp, out = torch.randn(per), torch.empty(per)
        return lambda: [dist.all_to_all_single(out, inp, group=group, async_op=True)]
    raise ConfigError(f"measure_oef: unknown kind {kind!r}; expected one of {OP_KINDS}")


def _trial(launchers: Sequence[Callable[[], list]], group) -> float:
    """Wall time (us) of launching all (comm first, then compute) and waiting every handle."""
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    handles: list = []
    for launch in launchers:
        handles += launch()
    for h in handles:
        h.wait()
    return (time.perf_counter() - t0) * 1e6


def _time_pair(
    a: Callable[[], list], b: Callable[[], list], a_first: bool, repeats: int, group
) -> tuple[float, float, float]:
    """Medians of A alone, B alone and A with B. The three are timed back to back in every
    repeat (after one warm-up round) so load that comes and goes on a shared machine hits all
    three alike instead of one solo time that is then reused for every pair."""
    ts: list[tuple[float, float, float]] = []
    for _ in range(repeats + 1):
        ts.append((_trial([a], group), _trial([b], group), _trial([a, b] if a_first else [b, a], group)))
    ts = ts[1:]
    return tuple(statistics.median(t[i] for t in ts) for i in range(3))  # type: ignore[return-value]


def _pairs(kinds: Sequence[str]) -> list[tuple[str, str]]:
    comp = [k for k in kinds if k in COMPUTE_KINDS]
    comm = [k for k in kinds if k in COMM_KINDS]
    out = [(c, m) for c in comp for m in comm]
    out += [(comm[i], comm[j]) for i in range(len(comm)) for j in range(i, len(comm))]
    return out


def measure_oef(
    kinds: Sequence[str] = OP_KINDS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    group=None,
    comm_scope: str = "local",
) -> OEFProfile:
    """Measure the profile on every rank of ``group`` (default: world); identical result everywhere."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("measure_oef: torch.distributed is not initialised (run it on every rank)")
    bad = [k for k in kinds if k not in OP_KINDS]
    if bad or len(set(kinds)) != len(kinds):
        raise ConfigError(f"measure_oef: kinds must be distinct entries of {OP_KINDS}, got {list(kinds)}")
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"measure_oef: sizes must be positive ints, got {list(sizes)}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"measure_oef: repeats must be an int >= 1, got {repeats!r}")
    if comm_scope not in COMM_SCOPES:
        raise ConfigError(f"measure_oef: comm_scope must be one of {COMM_SCOPES}, got {comm_scope!r}")
    world = dist.get_world_size(group)
    pairs = _pairs(kinds)
    raw: list[float] = []  # per size and pair: T_a, T_b, T_ab
    for size in sizes:
        for a, b in pairs:
            # a second, independent buffer set when a collective kind meets itself; comm is
            # issued first so it is in flight while the compute runs
            op_a, op_b = _op(a, size, world, group), _op(b, size, world, group)
            raw += _time_pair(op_a, op_b, a not in COMPUTE_KINDS, repeats, group)
    t = torch.tensor(raw, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # same numbers -> same factors on every rank
    vals = t.tolist()
    entries = []
    i = 0
    for size in sizes:
        for a, b in pairs:
            t_a, t_b, t_ab = vals[i : i + 3]
            i += 3
            entries.append(OEFEntry(a, b, int(size), t_a, t_b, t_ab, overlap_effectiveness(t_a, t_b, t_ab)))
    return OEFProfile(
        SCHEMA_VERSION,
        _machine(),
        _today(),
        world,
        dist.get_backend(group),
        comm_scope,
        repeats,
        tuple(int(s) for s in sizes),
        tuple(entries),
    )


def _machine() -> dict:
    import torch

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------- file format


def save_oef_profile(path: str, profile: OEFProfile) -> None:
    d = asdict(profile)
    d["sizes"] = list(profile.sizes)
    d["entries"] = [asdict(e) for e in profile.entries]
    with open(path, "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
        f.write("\n")


def _field(d: dict, name: str, typ, where: str):
    if name not in d:
        raise ConfigError(f"{where}: missing field {name!r}")
    v = d[name]
    if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
        raise ConfigError(f"{where}: field {name!r} must be {getattr(typ, '__name__', typ)}, got {v!r}")
    return v


def read_oef_profile(path: str) -> OEFProfile:
    """Load and validate a profile file; errors name the path and the field."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ConfigError(f"oef profile {path!r}: cannot read file ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"oef profile {path!r}: not valid JSON ({e})") from e
    where = f"oef profile {path!r}"
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: top level must be a JSON object")
    version = _field(d, "schema_version", int, where)
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"{where}: field 'schema_version' is {version}, this commfuse reads {SCHEMA_VERSION}"
        )
    machine = _field(d, "machine", dict, where)
    date = _field(d, "date", str, where)
    world = _field(d, "world_size", int, where)
    if world < 1:
        raise ConfigError(f"{where}: field 'world_size' must be >= 1, got {world}")
    backend = _field(d, "backend", str, where)
    scope = _field(d, "comm_scope", str, where)
    if scope not in COMM_SCOPES:
        raise ConfigError(f"{where}: field 'comm_scope' must be one of {COMM_SCOPES}, got {scope!r}")
    repeats = _field(d, "repeats", int, where)
    sizes = _field(d, "sizes", list, where)
    entries = []
    for i, e in enumerate(_field(d, "entries", list, where)):
        w = f"{where}: entries[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{w} must be an object")
        a, b = _field(e, "a", str, w), _field(e, "b", str, w)
        for name, k in (("a", a), ("b", b)):
            if k not in OP_KINDS:
                raise ConfigError(f"{w}: field {name!r} must be one of {OP_KINDS}, got {k!r}")
        nums = {n: float(_field(e, n, (int, float), w)) for n in ("t_a_us", "t_b_us", "t_ab_us", "oef")}
        if not all(math.isfinite(v) for v in nums.values()) or min(nums["t_a_us"], nums["t_b_us"]) <= 0:
            raise ConfigError(f"{w}: times must be finite and > 0 and 'oef' finite, got {nums}")
        entries.append(OEFEntry(a, b, _field(e, "size", int, w), **nums))
    return OEFProfile(version, machine, date, world, backend, scope, repeats, tuple(sizes), tuple(entries))


# ---------------------------------------------------------------- lookup


def oef_for(
    kind_a: str,
    kind_b: str,
    profile: Optional[OEFProfile] = None,
    fallback: Optional[OEFTable] = None,
    size: Optional[int] = None,
) -> float:
    """Factor in [0, 1] for two op kinds (or segment kinds): measured if present, else fallback."""
    scope = profile.comm_scope if profile is not None else "local"
    sa, sb = segment_kind(kind_a, scope), segment_kind(kind_b, scope)
    if profile is not None:
        if kind_a in OP_KINDS and kind_b in OP_KINDS:
            v = profile.factor(kind_a, kind_b, size)
        else:  # a segment kind: the median over the op pairs that map to this segment pair
            vs = [
                profile.factor(a, b, size)
                for a in OP_KINDS
                for b in OP_KINDS
                if OP_KINDS.index(a) <= OP_KINDS.index(b)
                and {segment_kind(a, scope), segment_kind(b, scope)} == {sa, sb}
                and (kind_a not in OP_KINDS or kind_a in (a, b))
                and (kind_b not in OP_KINDS or kind_b in (a, b))
            ]
            vs = [_clamp(x) for x in vs if x is not None]
            v = statistics.median(vs) if vs else None
        if v is not None:
            return _clamp(v)
    return (fallback or default_oef())(sa, sb)


def oef_table(profile: OEFProfile, fallback: Optional[OEFTable] = None) -> OEFTable:
    """Segment-kind table for plan search (module docstring)."""
    return OEFTable.from_mapping(
        {
            (a, b): oef_for(a, b, profile, fallback)
            for i, a in enumerate(SEGMENT_KINDS)
            for b in SEGMENT_KINDS[i:]
        }
    )


def load_oef_profile(path: str, fallback: Optional[OEFTable] = None) -> OEFTable:
    """Read ``path`` and build the :class:`OEFTable` every rank plans with."""
    return oef_table(read_oef_profile(path), fallback)
