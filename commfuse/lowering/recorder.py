"""The runtime recorder: what each rank really issued, when it ran, and what ran beside it.

Opt in around the steps to record::

    with commfuse.record("traces/") as rec:      # or COMMFUSE_RECORD_DIR=traces/ for the whole run
        loss = compiled(x); loss.backward()
    rec.summary()                                 # measured overlap ratio, bytes by kind

Per rank it records, from the runtime's own c10d calls (never from the profiler, whose
gloo events show a reduce_scatter as an all_reduce):

* every collective: kind, graph group and the group it was issued on, logged bytes
  (NCCL count semantics, from the plan) and the bytes handed to c10d, the time it was
  *issued* and the time its ``Work`` completed (the work future's callback, which on
  gloo fires on the transport thread when the transfer is done) -- so its in-flight
  interval is measured, not inferred;
* the collectives an op issues inside its kernel (commfuse's MoE layer's all_to_alls,
  announced through :mod:`commfuse.core.kernel_collectives`), under the graph ``"kernel"``;
* every wait: the interval the compute thread was blocked in it;
* compute regions: the intervals between consecutive runtime calls of one graph run
  (the graph's compute ran there). On CUDA these are host-side launch intervals; a
  GPU timeline needs the CUDA profiler next to this.

``write(dir)`` writes ``rank<r>.json`` in the Chrome trace format (open in Perfetto),
one track for compute, one per process group. Times are ``time.perf_counter_ns`` of
the rank's own clock; traces of different ranks are aligned by their first event.

Lining up with a torch.profiler trace of the same run: the clocks differ. Event ``ts`` here is
microseconds since the trace's first event on ``perf_counter`` (CLOCK_MONOTONIC); Kineto's ``ts``
is Unix-epoch microseconds minus the trace's ``baseTimeNanoseconds``. The trace's ``otherData``
records its origin on both clocks (``t0_perf_counter_ns``, ``t0_unix_ns``, the Unix clock read
beside ``perf_counter`` when the recorder started), so
``profiler_ts = ts + (t0_unix_ns - baseTimeNanoseconds) / 1000`` (:func:`profiler_offset_us`),
good to the two clocks' drift over the recording (microseconds over minutes).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from commfuse.core.errors import ConfigError
from commfuse.core.kernel_collectives import set_listener

RECORD_DIR_ENV = "COMMFUSE_RECORD_DIR"
# the graph name of collectives an op issued inside its kernel (no lowering plan issued them)
KERNEL_GRAPH = "kernel"


@dataclass
class CollectiveRecord:
    index: int  # position in the plan's issue order
    name: str  # start node name
    graph: str  # graph kind + id
    kind: str
    group: str
    issue_group: str
    logged_bytes: Optional[int]
    sent_bytes: int
    received_bytes: int
    issued_ns: int
    done_ns: Optional[int] = None  # Work completion (None: not reported (yet); the wait's end stands in)
    waited_ns: Optional[int] = None  # when the wait began
    wait_end_ns: Optional[int] = None

    @property
    def end_ns(self) -> Optional[int]:
        return self.done_ns if self.done_ns is not None else self.wait_end_ns


@dataclass
class RegionRecord:
    graph: str
    begin_ns: int
    end_ns: int
    kind: str = "compute"  # or "wait"


@dataclass
class Recorder:
    """Collects one rank's records; cheap to append to, thread-safe for the completion callbacks."""

    rank: int = 0
    # Unix time minus perf_counter time, read once at the start: maps the trace onto other clocks
    unix_minus_perf_ns: int = field(default_factory=lambda: time.time_ns() - time.perf_counter_ns())
    collectives: list[CollectiveRecord] = field(default_factory=list)
    regions: list[RegionRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _cursor: dict[str, int] = field(default_factory=dict, repr=False)  # graph -> end of last runtime call

    # -- called by the runtime ------------------------------------------------
    def graph_begin(self, graph: str) -> None:
        self._cursor[graph] = time.perf_counter_ns()

    def graph_end(self, graph: str) -> None:
        self._compute_until(graph, time.perf_counter_ns())
        self._cursor.pop(graph, None)

    def _compute_until(self, graph: str, now: int) -> None:
        begin = self._cursor.get(graph)
        if begin is not None and now > begin:
            self.regions.append(RegionRecord(graph, begin, now))

    def call_begin(self, graph: str) -> int:
        now = time.perf_counter_ns()
        self._compute_until(graph, now)
        return now

    def call_end(self, graph: str) -> None:
        if graph in self._cursor:
            self._cursor[graph] = time.perf_counter_ns()

    def collective(self, rec: CollectiveRecord, works: list[Any]) -> None:
        with self._lock:
            self.collectives.append(rec)
        if not works:
            return
        remaining = [len(works)]

        def done(_fut: Any) -> None:
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    now = time.perf_counter_ns()
                    # A callback can run after the wait already returned: the work was done by then.
                    rec.done_ns = now if rec.wait_end_ns is None else min(now, rec.wait_end_ns)

        for w in works:
            try:
                w.get_future().add_done_callback(done)
            except (AttributeError, RuntimeError):
                return  # no future on this backend: the wait's end stands in

    def kernel_collective(
        self, kind: str, group: str, sent_bytes: int, received_bytes: int, work: Any, op: str
    ) -> None:
        """A collective an op issued inside its kernel (:mod:`commfuse.core.kernel_collectives`):
        recorded under the graph :data:`KERNEL_GRAPH`, its logged bytes the buffer it handed to c10d."""
        rec = CollectiveRecord(
            index=-1,
            name=op,
            graph=KERNEL_GRAPH,
            kind=kind,
            group=group,
            issue_group=group,
            logged_bytes=sent_bytes,
            sent_bytes=sent_bytes,
            received_bytes=received_bytes,
            issued_ns=time.perf_counter_ns(),
        )
        self.collective(rec, [work] if work is not None else [])

    def wait(self, rec: Optional[CollectiveRecord], graph: str, begin_ns: int) -> None:
        end = time.perf_counter_ns()
        self.regions.append(RegionRecord(graph, begin_ns, end, kind="wait"))
        if rec is not None and rec.waited_ns is None:
            rec.waited_ns, rec.wait_end_ns = begin_ns, end

    # -- results ----------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Measured overlap: of all the time collectives were in flight, the share during
        which this rank's compute thread was running a compute region."""
        compute = sorted((r.begin_ns, r.end_ns) for r in self.regions if r.kind == "compute")
        inflight = overlapped = 0
        by_kind: dict[str, dict[str, int]] = {}
        for c in self.collectives:
            k = by_kind.setdefault(c.kind, {"count": 0, "logged_bytes": 0, "sent_bytes": 0})
            k["count"] += 1
            k["logged_bytes"] += c.logged_bytes or 0
            k["sent_bytes"] += c.sent_bytes
            end = c.end_ns
            # an op's own collectives run inside a compute region, which waits for them
            if end is None or end <= c.issued_ns or c.graph == KERNEL_GRAPH:
                continue
            inflight += end - c.issued_ns
            overlapped += sum(max(0, min(end, b) - max(c.issued_ns, a)) for a, b in compute)
        blocked = sum(r.end_ns - r.begin_ns for r in self.regions if r.kind == "wait")
        return {
            "rank": self.rank,
            "collectives": len(self.collectives),
            "inflight_us": inflight / 1e3,
            "overlapped_us": overlapped / 1e3,
            "overlap_ratio": overlapped / inflight if inflight else 0.0,
            "blocked_in_wait_us": blocked / 1e3,
            "compute_us": sum(b - a for a, b in compute) / 1e3,
            "by_kind": by_kind,
        }

    def chrome_trace(self) -> dict[str, Any]:
        t0 = min([c.issued_ns for c in self.collectives] + [r.begin_ns for r in self.regions], default=0)
        us = lambda ns: (ns - t0) / 1e3  # noqa: E731
        tracks = {"compute": 0}
        for c in self.collectives:
            tracks.setdefault(f"comm:{c.issue_group}", len(tracks))
        ev: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "tid": 0,
                "args": {"name": f"commfuse rank {self.rank}"},
            }
        ]
        ev += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
            for name, tid in tracks.items()
        ]
        for r in self.regions:
            ev.append(
                {
                    "name": r.kind if r.kind == "compute" else "wait",
                    "cat": r.kind,
                    "ph": "X",
                    "pid": self.rank,
                    "tid": 0,
                    "ts": us(r.begin_ns),
                    "dur": (r.end_ns - r.begin_ns) / 1e3,
                    "args": {"graph": r.graph},
                }
            )
        for c in self.collectives:
            end = c.end_ns if c.end_ns is not None else c.issued_ns
            args = {k: v for k, v in asdict(c).items() if not k.endswith("_ns")}
            args["end_from"] = "work" if c.done_ns is not None else "wait"
            ev.append(
                {
                    "name": f"{c.kind} {c.name}",
                    "cat": f"comm,{c.kind}",
                    "ph": "X",
                    "pid": self.rank,
                    "tid": tracks[f"comm:{c.issue_group}"],
                    "ts": us(c.issued_ns),
                    "dur": (end - c.issued_ns) / 1e3,
                    "args": args,
                }
            )
        other = {
            "source": "commfuse.record",
            "rank": self.rank,
            "clock": "time.perf_counter_ns",
            "t0_perf_counter_ns": t0,
            "t0_unix_ns": t0 + self.unix_minus_perf_ns,
        }
        return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": other}

    def write(self, directory: str | os.PathLike) -> Path:
        d = Path(directory)
        try:
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"rank{self.rank}.json"
            path.write_text(json.dumps(self.chrome_trace()))
        except OSError as e:
            raise ConfigError(f"record dir: cannot write the recorder trace to {str(d)!r}: {e}") from e
        return path


def profiler_offset_us(recorder_trace: dict[str, Any], profiler_trace: dict[str, Any]) -> float:
    """What to add to a recorder trace's ``ts`` to place it on a torch.profiler (Kineto) trace's
    timeline of the same process (see the module docstring). Raises ``ValueError`` when either
    trace lacks its clock origin (a recorder trace written before it was recorded, or a profiler
    trace that is not Kineto's)."""
    t0 = recorder_trace.get("otherData", {}).get("t0_unix_ns")
    base = profiler_trace.get("baseTimeNanoseconds")
    if t0 is None or base is None:
        raise ValueError(
            "need a recorder trace with otherData.t0_unix_ns and a Kineto trace with baseTimeNanoseconds"
        )
    return (int(t0) - int(base)) / 1e3


_ACTIVE: Optional[Recorder] = None


def active() -> Optional[Recorder]:
    return _ACTIVE


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class record:
    """Context manager: record every commfuse-lowered graph run on this rank while active.

    ``directory`` (optional): where ``rank<r>.json`` is written on exit. Nesting is an error
    (one recorder per process, so callbacks from concurrent steps cannot mix)."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = directory
        self.recorder: Optional[Recorder] = None

    def __enter__(self) -> Recorder:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("commfuse.record: a recording is already active in this process")
        if self.directory is not None:
            _check_writable(self.directory)
        self.recorder = _ACTIVE = Recorder(rank=_rank())
        set_listener(self.recorder.kernel_collective)
        return self.recorder

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        _ACTIVE = None
        set_listener(None)
        if self.directory is not None and self.recorder is not None:
            self.recorder.write(self.directory)


def _check_writable(directory: str | os.PathLike) -> None:
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"record dir: cannot create {str(d)!r}: {e}") from e
    if not os.access(d, os.W_OK):
        raise ConfigError(f"record dir: {str(d)!r} is not writable")


def start_from_env() -> None:
    """``COMMFUSE_RECORD_DIR`` set: record the whole run, write the trace at exit."""
    global _ACTIVE
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory or _ACTIVE is not None:
        return
    _check_writable(directory)
    _ACTIVE = Recorder(rank=_rank())
    set_listener(_ACTIVE.kernel_collective)
    import atexit

    rec = _ACTIVE
    atexit.register(lambda: rec.write(directory))
