"""Logical communicators across processes, global ranks, and clock synchronisation.

Contract
- `map_communicators`: pointers differ per process; one logical communicator is the set of
  pointers with the same NCCL ``commId`` (init lines of NCCL >= 2.18), else with the same
  op-sequence signature (thesis Eqs. 4.4-4.5: op names, counts and datatypes of the
  collective calls) and ``nranks``, split in rank order when more pointers share a signature
  than ``nranks`` (reported as ambiguous); pointers left over (a log with dropped lines
  changes the signature) join the most similar group with room (``difflib`` ratio >= 0.8).
- `assign_global_ranks`: the rank in each process's largest communicator (init lines), else
  thesis Eq. 4.6 (node index from the sorted host names x GPUs per node + local device).
- `synchronize_clocks`: instances of one collective on several ranks are found by (logical
  communicator, opCount) (thesis §4.2.4); for each pair of ranks sharing instances (each
  member of an instance against its lowest rank), the median of their kernel-time
  differences is the pair's offset (robust to a few misaligned kernels); the offsets are
  solved per connected group of ranks in least squares, anchored at the reference rank
  (Eqs. 4.7-4.8). The thesis's per-rank median of differences to each instance's median is
  the same on one communicator, but stalls when ranks share no communicator with the
  reference rank and are linked only through others (a rank's median follows its majority
  communicator). commfuse syncs on kernel *ends* by default: a collective completes on all
  ranks together, while starts differ by each rank's arrival (``sync_point="start"`` is the
  thesis's choice). p2p launches are not synchronisation points.
- Deterministic: the same inputs give the same groups and offsets.

Source: the NCCL-trace thesis §4.2.3-4.2.4.
"""

from __future__ import annotations

import difflib
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from commfuse.core.errors import ConfigError
from commfuse.trace.kernel_trace import KernelRecord
from commfuse.trace.launches import Launch, launches
from commfuse.trace.nccl_log import NcclCall, NcclProcessLog

if TYPE_CHECKING:
    from commfuse.trace.align import RankAlignment


def assign_global_ranks(logs: Sequence[NcclProcessLog]) -> dict[tuple[str, int], int]:
    """(host, pid) -> global rank: from init lines when they give every process a distinct rank,
    else thesis Eq. 4.6 (sorted hosts × GPUs per node + local device)."""
    from_init = {lg.key: lg.world_rank() for lg in logs}
    vals = [v for v in from_init.values() if v is not None]
    if len(vals) == len(logs) and len(set(vals)) == len(vals):
        return {k: int(v) for k, v in from_init.items()}  # type: ignore[arg-type]
    hosts = sorted({lg.host for lg in logs})
    per_node = max([1 + (lg.device or 0) for lg in logs] + [1])
    return {lg.key: hosts.index(lg.host) * per_node + (lg.device or 0) for lg in logs}


@dataclass
class LogicalComm:
    """One communicator across processes."""

    name: str
    nranks: Optional[int]
    members: dict[int, tuple[str, int, str]]  # global rank -> (host, pid, comm pointer)
    comm_id: Optional[str] = None
    by: str = "signature"  # how it was identified: commId, signature, similarity, alone

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.members))


@dataclass
class CommMap:
    comms: list[LogicalComm]
    rank_of: dict[tuple[str, int], int]
    notes: list[str] = field(default_factory=list)

    def of(self, host: str, pid: int, comm: str) -> Optional[LogicalComm]:
        for lc in self.comms:
            for h, p, c in lc.members.values():
                if (h, p, c) == (host, pid, comm):
                    return lc
        return None

    def index(self) -> dict[tuple[str, int, str], LogicalComm]:
        return {m: lc for lc in self.comms for m in lc.members.values()}


def _signature(lau: Sequence[Launch]) -> tuple:
    # collectives: op, count, datatype (identical on every member); p2p differs per peer: op only
    return tuple(
        (a.symbol,) if a.symbol == "SendRecv" else (a.symbol, a.first.count, a.first.datatype) for a in lau
    )


def map_communicators(
    logs: Sequence[NcclProcessLog], *, min_similarity: float = 0.8, dedup: bool = True
) -> CommMap:
    """Group communicator pointers of all processes into logical communicators (module docstring)."""
    rank_of = assign_global_ranks(logs)
    entries = []  # (rank, host, pid, comm, nranks, comm_id, signature)
    for lg in logs:
        per_comm: dict[str, list[NcclCall]] = defaultdict(list)
        for c in lg.calls:
            per_comm[c.comm].append(c)
        comms = list(dict.fromkeys(list(lg.inits) + list(per_comm)))
        for comm in comms:
            init = lg.inits.get(comm)
            calls = per_comm.get(comm, [])
            nranks = init.nranks if init else next((c.nranks for c in calls if c.nranks), None)
            entries.append(
                (
                    rank_of[lg.key],
                    lg.host,
                    lg.pid,
                    comm,
                    nranks,
                    init.comm_id if init else None,
                    _signature(launches(calls, dedup=dedup)),
                )
            )
    entries.sort(key=lambda e: (e[0], e[3]))
    notes: list[str] = []
    groups: list[LogicalComm] = []
    done: set[int] = set()
    # 1. NCCL's commId: exact
    by_id: dict[str, list[int]] = defaultdict(list)
    for idx, e in enumerate(entries):
        if e[5]:
            by_id[e[5]].append(idx)
    for cid, idxs in by_id.items():
        groups.append(
            LogicalComm(
                "", entries[idxs[0]][4], {entries[i][0]: entries[i][1:4] for i in idxs}, cid, "commId"
            )
        )
        done.update(idxs)
    # 2. identical signatures (and nranks), split into groups of nranks in rank order
    by_sig: dict[tuple, list[int]] = defaultdict(list)
    for idx, e in enumerate(entries):
        if idx not in done and e[6]:
            by_sig[(e[4], e[6])].append(idx)
    for (nranks, _sig), idxs in by_sig.items():
        size = nranks or len(idxs)
        if len(idxs) > size:
            notes.append(
                f"{len(idxs)} communicators share one op sequence but have nranks={size}: "
                "grouped in rank order (ambiguous without commId)"
            )
        for s in range(0, len(idxs), size):
            chunk = idxs[s : s + size]
            if len(chunk) < 2 and size > 1:
                continue  # alone with its sequence: let the similarity step place it
            groups.append(
                LogicalComm("", nranks, {entries[i][0]: entries[i][1:4] for i in chunk}, None, "signature")
            )
            done.update(chunk)
    # 3. leftovers: most similar group with room
    sigs = {
        id(g): [entries[i][6] for i in range(len(entries)) if entries[i][1:4] in g.members.values()]
        for g in groups
    }
    for idx, e in enumerate(entries):
        if idx in done:
            continue
        best, best_r = None, min_similarity
        for g in groups:
            if g.by == "commId" or (g.nranks and len(g.members) >= g.nranks) or e[0] in g.members:
                continue
            if g.nranks is not None and e[4] is not None and g.nranks != e[4]:
                continue
            ref = sigs[id(g)][0] if sigs[id(g)] else ()
            r = difflib.SequenceMatcher(None, e[6], ref, autojunk=False).ratio() if ref or e[6] else 0.0
            if r > best_r:
                best, best_r = g, r
        if best is not None:
            best.members[e[0]] = e[1:4]
            best.by = "similarity" if best.by != "commId" else best.by
        else:
            groups.append(LogicalComm("", e[4], {e[0]: e[1:4]}, None, "alone"))
    groups.sort(key=lambda g: (-(g.nranks or len(g.members)), g.ranks))
    for k, g in enumerate(groups):
        g.name = f"comm{k}"
    return CommMap(groups, rank_of, notes)


SYNC_POINTS = ("start", "end", "mid")


def _time(k: KernelRecord, point: str) -> float:
    if point == "start":
        return float(k.start_ns)
    if point == "end":
        return float(k.end_ns)
    return (k.start_ns + k.end_ns) / 2.0


def synchronize_clocks(
    alignments: Sequence["RankAlignment"],
    comm_map: CommMap,
    *,
    sync_point: str = "end",
    reference_rank: Optional[int] = None,
) -> dict[int, float]:
    """Per-rank offsets (ns) to add to that rank's kernel times (module docstring)."""
    if sync_point not in SYNC_POINTS:
        raise ConfigError(f"sync_point must be one of {SYNC_POINTS}, got {sync_point!r}")
    index = comm_map.index()
    inst: dict[tuple[str, int, int], dict[int, float]] = defaultdict(dict)
    for ra in alignments:
        if ra.rank is None or ra.log is None:
            continue
        for li, kj in ra.matches:
            lau = ra.launches[li]
            if lau.symbol == "SendRecv":
                continue  # p2p is not a synchronisation point
            lc = index.get((ra.log.host, ra.log.pid, lau.comm))
            if lc is None or len(lc.members) < 2:
                continue
            inst[(lc.name, lau.epoch, lau.op_count)][ra.rank] = _time(ra.kernels[kj], sync_point)
    ranks = sorted({ra.rank for ra in alignments if ra.rank is not None})
    if not ranks:
        return {}
    # Per instance, each member against the instance's median (thesis Eq. 4.7's raw offsets),
    # collected per pair (member, lowest member): the pair's offset is the median over shared
    # instances -- robust to a few misaligned kernels.
    diffs: dict[tuple[int, int], list[float]] = defaultdict(list)
    for times in inst.values():
        if len(times) < 2:
            continue
        rs = sorted(times)
        for r in rs[1:]:
            diffs[(rs[0], r)].append(times[rs[0]] - times[r])  # add to r's clock to meet rs[0]'s
    # Ranks that share no communicator with the reference rank are linked through those that
    # do: solve off[s] - off[r] = median over shared instances, in least squares, per connected
    # component, anchored at the reference rank (else the component's lowest rank).
    pos = {r: i for i, r in enumerate(ranks)}
    adj: dict[int, set[int]] = defaultdict(set)
    for r, s_ in diffs:
        adj[r].add(s_)
        adj[s_].add(r)
    ref_rank = reference_rank if reference_rank is not None else ranks[0]
    off = {r: 0.0 for r in ranks}
    seen: set[int] = set()
    for start in ([ref_rank] if ref_rank in pos else []) + ranks:
        if start in seen:
            continue
        comp, stack = [], [start]
        seen.add(start)
        while stack:
            r = stack.pop()
            comp.append(r)
            for s_ in adj[r]:
                if s_ not in seen:
                    seen.add(s_)
                    stack.append(s_)
        if len(comp) < 2:
            continue
        cpos = {r: i for i, r in enumerate(sorted(comp))}
        rows, rhs, wts = [], [], []
        for (r, s_), ds in diffs.items():
            if r in cpos:
                row = np.zeros(len(cpos))
                row[cpos[s_]], row[cpos[r]] = 1.0, -1.0
                rows.append(row)
                rhs.append(statistics.median(ds))
                wts.append(math.sqrt(len(ds)))
        anchor = np.zeros(len(cpos))
        anchor[cpos[start]] = 1.0
        A = np.vstack([np.array(rows) * np.array(wts)[:, None], anchor * 1e3])
        b = np.concatenate([np.array(rhs) * np.array(wts), [0.0]])
        sol = np.linalg.lstsq(A, b, rcond=None)[0]
        for r, i in cpos.items():
            off[r] = float(sol[i])
    return off


__all__ = [
    "CommMap",
    "LogicalComm",
    "SYNC_POINTS",
    "assign_global_ranks",
    "map_communicators",
    "synchronize_clocks",
]
