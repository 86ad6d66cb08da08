"""Readers for NCCL kernels in GPU traces: torch.profiler Chrome traces and Nsight Systems SQLite.

Contract
- ``read_torch_trace(path)``: a ``torch.profiler`` / Kineto Chrome trace (``.json`` or
  ``.json.gz``). Kernel events are ``"ph": "X", "cat": "kernel"``; ``ts``/``dur`` are
  microseconds relative to the header's ``baseTimeNanoseconds`` (absent: 0); ``pid`` is the
  device, ``args.stream`` / ``args.correlation`` / ``args.grid`` / ``args.block`` the launch.
  The rank comes from the header's ``distributedInfo.rank``. Recent PyTorch copies the
  ``record_param_comms`` metadata of a collective onto its kernel (``Collective name``,
  ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``dtype``, ``Process Group Name``,
  ``Process Group Ranks``); it is kept in ``KernelRecord.meta`` when present.
- ``read_nsys_sqlite(path)``: ``nsys export --type sqlite``. Kernels come from
  ``CUPTI_ACTIVITY_KIND_KERNEL`` joined with ``StringIds`` on ``demangledName`` (``shortName``
  when the demangled name is missing); times are ns from the session start, made absolute
  with ``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` when that table exists; the process is
  ``globalPid / 0x1000000 % 0x1000000`` (Nsight's own convention).
- Launch calls: each kernel's host-side launch (``cudaLaunchKernel*`` / ``cuLaunchKernel*``)
  is joined by correlation id -- torch.profiler's ``cuda_runtime``/``cuda_driver`` events;
  nsys ``CUPTI_ACTIVITY_KIND_RUNTIME`` (and ``..._DRIVER`` when present) by (process,
  ``correlationId``) -- and kept as ``KernelRecord.launch_ns`` on the trace's clock.
- Only NCCL kernels are kept (names ``nccl(Dev)?Kernel_...`` and the pre-2.8
  ``ncclAllReduceRingLLKernel_sum_f32`` form); `parse_kernel_name` reads the op, datatype,
  algorithm and protocol NCCL encoded in the name. What a name can be trusted for: since
  NCCL 2.19 (``src/device/generate.py``, ``best_kernel``) AllGather/Broadcast kernels are
  always named ``..._RING_LL`` and AllReduce/Reduce/ReduceScatter ``..._Sum_<type>_{RING|
  TREE}_LL`` whatever the reduce op, protocol and (non-tree) algorithm; every Send/Recv (and
  PyTorch's all_to_all) runs in ``ncclDevKernel_SendRecv``; an op without a specialised
  kernel runs in ``ncclDevKernel_Generic`` (op unknown). NVIDIA/nccl#2196 confirms the
  misleading ``RING_LL`` suffix; NCCL 2.13 named kernels after unrelated ops (NVIDIA/nccl#714),
  so names from 2.13 are not trustworthy at all.
- Guarantees: events that are not well-formed (missing or non-numeric ``ts``/``dur``, a
  non-dict event) are skipped and counted in ``KernelTrace.skipped`` with one
  `TraceParseWarning` per file; a file that is not JSON / not SQLite raises `ConfigError`
  naming the path.

Sources: the NCCL-trace thesis §4.2.1 (Listing 4.4, the kernel-name regex); Nsight Systems'
SQLite schema (CUPTI_ACTIVITY_KIND_KERNEL, StringIds, TARGET_INFO_SESSION_START_TIME);
Kineto's Chrome trace format (``baseTimeNanoseconds``, ``distributedInfo``) and
pytorch/pytorch#184637 (NCCL metadata on GPU kernels). See docs/alignment.md, "Formats".
"""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from commfuse.core.errors import ConfigError
from commfuse.trace.nccl_log import TraceParseWarning
from commfuse.trace.vocab import canonical_op, dtype_token, normalize_algo, normalize_proto

_NEW = re.compile(r"^nccl(?:Dev)?Kernel_(?P<op>[A-Za-z]+)(?P<rest>(?:_[A-Za-z0-9]+)*)")
_OLD = re.compile(
    r"^nccl(?P<op>AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv|Send|Recv)"
    r"(?P<algo>Ring|Tree|CollNet)?(?P<proto>LL128|LL|Simple)?Kernel(?:_(?P<redop>[a-z]+)_(?P<ty>\w+))?"
)
_ALGO_TOKENS = ("COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS_TREE", "NVLS", "RING", "TREE", "PAT")
_REDOP_TOKENS = {"Sum", "Prod", "MinMax", "Max", "Min", "PreMulSum", "SumPostDiv", "Avg"}


@dataclass(frozen=True)
class KernelName:
    op: Optional[str]  # NCCL op (SendRecv for p2p); None: Generic kernel, op unknown
    dtype: Optional[str] = None  # generate.py token, reduction kernels only
    algo: Optional[str] = None
    proto: Optional[str] = None


def parse_kernel_name(name: str) -> Optional[KernelName]:
    """``ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)`` ->
    ``KernelName("AllReduce", "f32", "RING", "LL")``; None for a kernel that is not NCCL's."""
    base = name.split("(", 1)[0].strip()
    m = _NEW.match(base)
    if m is not None:
        op_tok = m.group("op")
        if op_tok == "Generic":
            return KernelName(None)
        op = canonical_op(op_tok) or op_tok
        toks = [t for t in m.group("rest").split("_") if t]
        algo = proto = dtype = None
        i = 0
        while i < len(toks):
            two = f"{toks[i]}_{toks[i + 1]}" if i + 1 < len(toks) else None
            if two is not None and two.upper() in _ALGO_TOKENS:
                algo, i = normalize_algo(two), i + 2
                continue
            t = toks[i]
            if t.upper() in _ALGO_TOKENS:
                algo = normalize_algo(t)
            elif t.upper() in ("LL", "LL128", "SIMPLE"):
                proto = normalize_proto(t)
            elif t in _REDOP_TOKENS:
                pass  # kernels are named "Sum" whatever the reduce op (generate.py best_kernel)
            elif dtype_token(t) is not None:
                dtype = dtype_token(t)
            i += 1
        return KernelName(op, dtype, algo, proto)
    m = _OLD.match(base)
    if m is not None:
        return KernelName(
            canonical_op(m.group("op")),
            dtype_token(m.group("ty")) if m.group("ty") else None,
            normalize_algo(m.group("algo")) if m.group("algo") else None,
            normalize_proto(m.group("proto")) if m.group("proto") else None,
        )
    return None


@dataclass
class KernelRecord:
    name: str
    op: Optional[str]
    start_ns: int  # absolute (epoch) when the trace says where its clock starts, else trace-relative
    end_ns: int
    dtype: Optional[str] = None
    algo: Optional[str] = None
    proto: Optional[str] = None
    stream: Optional[int] = None
    device: Optional[int] = None
    pid: Optional[int] = None
    correlation: Optional[int] = None
    grid: Optional[tuple[int, int, int]] = None
    block: Optional[tuple[int, int, int]] = None
    meta: dict[str, Any] = field(default_factory=dict)
    launch_ns: Optional[int] = None  # host time of the CUDA launch call (same clock as start_ns)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def in_nelems(self) -> Optional[int]:
        v = self.meta.get("In msg nelems")
        return int(v) if isinstance(v, (int, float)) else None

    @property
    def out_nelems(self) -> Optional[int]:
        v = self.meta.get("Out msg nelems")
        return int(v) if isinstance(v, (int, float)) else None


@dataclass
class KernelTrace:
    """The NCCL kernels of one process (one GPU), in start order."""

    source: str
    kernels: list[KernelRecord]
    rank: Optional[int] = None
    pid: Optional[int] = None
    device: Optional[int] = None
    host: Optional[str] = None
    absolute: bool = False  # timestamps are epoch ns (the trace gave its clock origin)
    skipped: int = 0
    format: str = ""


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _triple(x: Any) -> Optional[tuple[int, int, int]]:
    if isinstance(x, (list, tuple)) and len(x) == 3 and all(isinstance(v, (int, float)) for v in x):
        return (int(x[0]), int(x[1]), int(x[2]))
    return None


_LAUNCH = re.compile(r"(?:cuda|cu)LaunchKernel|cudaLaunchCooperativeKernel")
_META_KEYS = (
    "Collective name",
    "In msg nelems",
    "Out msg nelems",
    "Group size",
    "dtype",
    "Process Group Name",
    "Process Group Description",
    "Process Group Ranks",
    "Rank",
    "Seq",
)


def read_torch_trace(path: Union[str, Path]) -> list[KernelTrace]:
    """A torch.profiler Chrome trace -> one `KernelTrace` per device with NCCL kernels."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw.decode("utf-8", errors="replace"))
    except (OSError, EOFError, ValueError) as e:
        raise ConfigError(f"kernel trace: {str(p)!r} is not a readable Chrome trace JSON: {e}") from e
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ConfigError(f"kernel trace: {str(p)!r} has no traceEvents list")
    base_ns = doc.get("baseTimeNanoseconds") if isinstance(doc, dict) else None
    absolute = isinstance(base_ns, int) and base_ns > 0
    base = int(base_ns) if absolute else 0
    dist = doc.get("distributedInfo") if isinstance(doc, dict) else None
    rank = dist.get("rank") if isinstance(dist, dict) and isinstance(dist.get("rank"), int) else None
    by_dev: dict[int, list[KernelRecord]] = {}
    skipped = 0
    launch_at: dict[int, int] = {}  # correlation -> host time of the launch call
    for ev in events:
        # older PyTorch spells the categories "Runtime" / "Kernel"
        if (
            isinstance(ev, dict)
            and str(ev.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver", "runtime")
            and _LAUNCH.search(str(ev.get("name", "")))
        ):
            args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
            ts, corr = _num(ev.get("ts")), args.get("correlation")
            if ts is not None and isinstance(corr, (int, float)):
                launch_at[int(corr)] = base + int(round(ts * 1000))
    for ev in events:
        if not isinstance(ev, dict):
            skipped += 1
            continue
        if str(ev.get("cat", "")).lower() != "kernel" or ev.get("ph", "X") != "X":
            continue
        name = ev.get("name")
        kn = parse_kernel_name(name) if isinstance(name, str) else None
        if kn is None:
            continue
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
        if ts is None or dur is None or dur < 0:
            skipped += 1
            continue
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        dev = args.get("device", ev.get("pid"))
        dev = int(dev) if isinstance(dev, (int, float)) else 0
        meta = {k: args[k] for k in _META_KEYS if k in args}
        start = base + int(round(ts * 1000))
        rec = KernelRecord(
            name=name,
            op=kn.op,
            start_ns=start,
            end_ns=start + int(round(dur * 1000)),
            dtype=kn.dtype or dtype_token(meta.get("dtype") if isinstance(meta.get("dtype"), str) else None),
            algo=kn.algo,
            proto=kn.proto,
            stream=int(args["stream"]) if isinstance(args.get("stream"), (int, float)) else None,
            device=dev,
            correlation=int(args["correlation"])
            if isinstance(args.get("correlation"), (int, float))
            else None,
            grid=_triple(args.get("grid")),
            block=_triple(args.get("block")),
            meta=meta,
        )
        if kn.op is None and isinstance(meta.get("Collective name"), str):
            rec.op = canonical_op(meta["Collective name"])
        if rec.correlation is not None:
            rec.launch_ns = launch_at.get(rec.correlation)
        by_dev.setdefault(dev, []).append(rec)
    if skipped:
        warnings.warn(
            TraceParseWarning(f"kernel trace {p}: skipped {skipped} malformed event(s)"), stacklevel=2
        )
    out = []
    for dev, ks in sorted(by_dev.items()):
        ks.sort(key=lambda k: (k.start_ns, k.end_ns))
        out.append(
            KernelTrace(str(p), ks, rank=rank, device=dev, absolute=absolute, skipped=skipped, format="torch")
        )
    if not out:
        out.append(KernelTrace(str(p), [], rank=rank, absolute=absolute, skipped=skipped, format="torch"))
    return out


def read_nsys_sqlite(path: Union[str, Path]) -> list[KernelTrace]:
    """An ``nsys export --type sqlite`` file -> one `KernelTrace` per (process, device)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"kernel trace: {str(p)!r} does not exist")
    try:
        con = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise ConfigError(f"kernel trace: cannot open {str(p)!r} as SQLite: {e}") from e
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables or "StringIds" not in tables:
            raise ConfigError(
                f"kernel trace: {str(p)!r} has no CUPTI_ACTIVITY_KIND_KERNEL/StringIds tables "
                "(export with `nsys export --type sqlite` of a run traced with `-t cuda`)"
            )
        cols = {r[1] for r in con.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
        name_col = "demangledName" if "demangledName" in cols else "shortName"
        want = [
            "start",
            "end",
            "deviceId",
            "streamId",
            "correlationId",
            "globalPid",
            "gridX",
            "gridY",
            "gridZ",
            "blockX",
            "blockY",
            "blockZ",
        ]
        sel = ", ".join(f"k.{c}" if c in cols else "NULL" for c in want)
        rows = con.execute(
            f"SELECT {sel}, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "  # noqa: S608 - fixed names
            f"JOIN StringIds AS s ON k.{name_col} = s.id WHERE s.value LIKE '%nccl%' "
            "ORDER BY k.start"
        ).fetchall()
        launches: dict[tuple[int, int], int] = {}  # (pid, correlation) -> launch call start
        for api in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"):
            acols = {r[1] for r in con.execute(f"PRAGMA table_info({api})")} if api in tables else set()
            if not {"start", "correlationId", "globalTid", "nameId"} <= acols:
                continue
            for start_, corr_, gtid, name_ in con.execute(  # noqa: S608 - fixed table names
                f"SELECT a.start, a.correlationId, a.globalTid, s.value FROM {api} AS a "
                "JOIN StringIds AS s ON a.nameId = s.id"
            ):
                if (
                    isinstance(name_, str)
                    and _LAUNCH.search(name_)
                    and isinstance(gtid, int)
                    and isinstance(corr_, int)
                    and isinstance(start_, int)
                ):
                    launches[(gtid // 0x1000000 % 0x1000000, corr_)] = start_
        origin = 0
        if "TARGET_INFO_SESSION_START_TIME" in tables:
            tcols = {r[1] for r in con.execute("PRAGMA table_info(TARGET_INFO_SESSION_START_TIME)")}
            if "utcEpochNs" in tcols:
                row = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
                origin = int(row[0]) if row and isinstance(row[0], int) else 0
    except sqlite3.Error as e:
        raise ConfigError(f"kernel trace: {str(p)!r}: SQLite error {e}") from e
    finally:
        con.close()
    groups: dict[tuple[Optional[int], Optional[int]], list[KernelRecord]] = {}
    skipped = 0
    for r in rows:
        start, end, dev, stream, corr, gpid, gx, gy, gz, bx, by, bz, name = r
        kn = parse_kernel_name(name) if isinstance(name, str) else None
        if kn is None:
            continue
        if not isinstance(start, int) or not isinstance(end, int) or end < start:
            skipped += 1
            continue
        pid = int(gpid) // 0x1000000 % 0x1000000 if isinstance(gpid, int) else None
        rec = KernelRecord(
            name=name,
            op=kn.op,
            start_ns=origin + start,
            end_ns=origin + end,
            dtype=kn.dtype,
            algo=kn.algo,
            proto=kn.proto,
            stream=stream,
            device=dev,
            pid=pid,
            correlation=corr,
            grid=(gx, gy, gz) if isinstance(gx, int) else None,
            block=(bx, by, bz) if isinstance(bx, int) else None,
        )
        if pid is not None and isinstance(corr, int) and (pid, corr) in launches:
            rec.launch_ns = origin + launches[(pid, corr)]
        groups.setdefault((pid, dev), []).append(rec)
    if skipped:
        warnings.warn(
            TraceParseWarning(f"kernel trace {p}: skipped {skipped} malformed kernel row(s)"), stacklevel=2
        )
    return [
        KernelTrace(str(p), ks, pid=pid, device=dev, absolute=origin > 0, skipped=skipped, format="nsys")
        for (pid, dev), ks in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0))
    ]


def read_kernel_traces(path: Union[str, Path]) -> list[KernelTrace]:
    """A file or a directory of ``*.json``, ``*.json.gz``, ``*.sqlite`` traces."""
    p = Path(path)
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and (f.name.endswith((".json", ".json.gz")) or f.suffix in (".sqlite", ".db"))
        )
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"kernel trace dir: {str(p)!r} is neither a file nor a directory")
    out: list[KernelTrace] = []
    for f in files:
        out.extend(read_nsys_sqlite(f) if f.suffix in (".sqlite", ".db") else read_torch_trace(f))
    return out


__all__ = [
    "KernelName",
    "KernelRecord",
    "KernelTrace",
    "parse_kernel_name",
    "read_kernel_traces",
    "read_nsys_sqlite",
    "read_torch_trace",
]
