"""Tolerant parser for NCCL ``NCCL_DEBUG=INFO`` logs.

Contract
- Reads: one or more log files (``NCCL_DEBUG_FILE=...%h_%p.log`` writes one per process; a
  launcher's combined stdout interleaves several) and splits them by process ``(host, pid)``
  from each line's ``host:pid:tid [cudaDev] NCCL INFO`` prefix. Anything before the prefix
  (a launcher's ``[0] `` / ``1: `` / Ray's ``(RayTrainWorker pid=...)``) is ignored; a leading
  epoch timestamp (``NCCL_DEBUG_TIMESTAMP_FORMAT="%s.%6f"``) or a bracketed
  ``[YYYY-mm-dd HH:MM:SS]`` one is read as the line's time.
- Understands, per process:
  * call lines (``NCCL_COLL``), the same format in every NCCL release since 2.4
    (``enqueue.cc``: ``"%s: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d
    root %d comm %p [nranks=%d] stream %p"``); ``opCount`` is hexadecimal and counts kernel
    launches of the communicator, so calls of one ``ncclGroupStart/End`` share it;
  * tuning lines, two generations: ``"AllReduce: 262144 Bytes -> Algo RING proto LL
    channel{Lo..Hi}={0..7}"`` (optionally ``comm %p`` / ``cgaClusterSize %d`` after it; NCCL
    prints it on the communicator's rank 0 only) and the older ``"262144 Bytes -> Algo 1
    proto 2 time 54.7"`` (numeric codes, optionally prefixed with the op). Each is attached
    to the latest earlier call of that process with the same op and byte size (and comm,
    when the line names one);
  * communicator init lines, ``[ncclCommInitRank|ncclCommInitRankConfig|ncclCommSplit] comm
    %p rank %d nranks %d cudaDev %d [nvmlDev %d] busId %x [commId 0x%llx] - Init
    START|COMPLETE``, and the ring lines that follow an init on its thread
    (``Channel 00/24 :    0   1   2   3``) and its ``N coll channels, ...`` line;
  * the first topology block of the process (``=== System : maxBw X totalBw Y ===`` up to
    the ``=====`` line): CPUs, GPUs by bus id and their links (``+ NVL[370.8] - NVS/0``,
    ``+ PCI[24.0] - GPU/0-1000 (0)``, ``+ NET[50.0] - NET/0-c (...)``, ``+ SYS[16.0] - CPU/1``).
  Every other NCCL line is ignored.
- Guarantees: never raises on content. A line that *looks like* one of the above (e.g.
  ``AllReduce: opCount``) but does not parse -- malformed numbers, a line cut off by a
  crash or a full disk -- is skipped and reported: once per file as a `TraceParseWarning`
  naming the count and the first lines, and in full in ``NcclProcessLog.skipped``.
  Unreadable files raise `ConfigError` naming the path.

Sources: the NCCL-trace thesis §4.2.1 (Listings 4.1-4.3) and real NCCL 2.1x-2.2x lines
quoted in NVIDIA/nccl#584, NVIDIA/nccl#1193, NVIDIA/nccl#1591, NVIDIA/nccl#1814,
NVIDIA/nccl-tests#256 and pytorch/torchtitan#1369 (see docs/alignment.md, "Formats").
"""

from __future__ import annotations

import datetime as _dt
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from commfuse.core.errors import ConfigError
from commfuse.trace.vocab import NCCL_DATATYPES, NCCL_REDOPS, canonical_op, normalize_algo, normalize_proto


class TraceParseWarning(UserWarning):
    """Lines of an NCCL log or kernel trace were skipped (malformed or truncated)."""


_PREFIX = re.compile(
    r"(?:(?P<epoch>\d{9,11}\.\d+)\s+|\[(?P<date>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)\]\s*)?"
    r"(?P<host>[^\s:\[\]()]+):(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\]\s+NCCL\s+(?P<level>INFO|WARN|TRACE)\s?"
    r"(?P<msg>.*)$"
)

_CALL_HINT = re.compile(r"^\s*[A-Za-z]+:\s+opCount\b")
_CALL = re.compile(
    r"^\s*(?P<op>[A-Za-z]+):\s+opCount\s+(?P<opc>[0-9a-fA-F]+)\s+sendbuff\s+(?P<sb>\S+)\s+recvbuff\s+(?P<rb>\S+)"
    r"\s+count\s+(?P<count>\d+)\s+datatype\s+(?P<dt>\d+)\s+op\s+(?P<redop>\d+)\s+root\s+(?P<root>-?\d+)"
    r"\s+comm\s+(?P<comm>0x[0-9a-fA-F]+|\(nil\))(?:\s+\[nranks=(?P<nranks>\d+)\])?\s+stream\s+(?P<stream>\S+)"
)

_ALGO_HINT = re.compile(r"Bytes\s+->\s+Algo\b")
_ALGO = re.compile(
    r"^\s*(?:(?P<op>[A-Za-z]+):\s*)?(?P<bytes>\d+)\s+Bytes\s+->\s+Algo\s+(?P<algo>\w+)\s+proto\s+(?P<proto>\w+)"
    r"(?:\s+channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\})?(?:\s+time\s+(?P<time>[-\d.]+))?"
    r"(?:\s+comm\s+(?P<comm>0x[0-9a-fA-F]+))?(?:\s+cgaClusterSize\s+\d+)?\s*$"
)

_INIT_HINT = re.compile(r"\bcomm\s+0x[0-9a-fA-F]+\s+rank\s+\S+\s+nranks\b")
_INIT = re.compile(
    r"^\s*(?:(?P<fn>ncclComm\w+)\s+)?comm\s+(?P<comm>0x[0-9a-fA-F]+)\s+rank\s+(?P<rank>\d+)\s+nranks\s+(?P<nranks>\d+)"
    r"(?P<rest>.*)$"
)
_INIT_DEV = re.compile(r"\bcudaDev\s+(\d+)")
_INIT_BUS = re.compile(r"\bbusId\s+([0-9a-fA-F]+)")
_INIT_COMMID = re.compile(r"\bcommId\s+(0x[0-9a-fA-F]+)")
_INIT_PHASE = re.compile(r"Init\s+(START|COMPLETE)")

_CHANNELS_LINE = re.compile(r"^\s*(?:comm\s+0x[0-9a-fA-F]+,\s*)?(\d+)\s+coll channels,")
_RING = re.compile(r"^\s*Channel\s+(\d+)/(\d+)\s*:\s+((?:-?\d+\s*)+)$")

_TOPO_HEAD = re.compile(r"^\s*=== System : maxBw\s+(?P<max>[\d.]+)\s+totalBw\s+(?P<total>[\d.]+)\s+===\s*$")
_TOPO_END = re.compile(r"^\s*={10,}\s*$")
_TOPO_ROOT = re.compile(
    r"^(?P<ind>\s*)(?P<node>[A-Z]+/[0-9a-fA-F]+(?:-[0-9a-fA-F]+)?)(?:\s+\((?P<info>[^)]*)\))?\s*$"
)
_TOPO_CHILD = re.compile(
    r"^(?P<ind>\s*)\+\s+(?P<link>[A-Z]+)\[(?P<bw>[\d.]+)\]\s+-\s+(?P<node>[A-Z]+/[0-9a-fA-F]+(?:-[0-9a-fA-F]+)?)"
    r"(?:\s+\((?P<info>[^)]*)\))?\s*$"
)
_VERSION = re.compile(r"NCCL version\s+(\S+)")

MAX_REPORTED_SKIPS = 5


@dataclass
class NcclCall:
    """One call line, with the tuning line NCCL printed for it (if any)."""

    op: str  # NCCL's op name as logged (AllReduce, Send, ...)
    op_count: int
    count: int
    datatype: int
    redop: int
    root: int  # broadcast/reduce root; for Send/Recv the peer
    comm: str
    nranks: Optional[int]
    stream: str
    sendbuff: str
    recvbuff: str
    host: str
    pid: int
    tid: int
    device: int
    time_us: Optional[float]  # epoch microseconds, when the log has timestamps
    line: int  # 1-based line number in its file
    source: str = ""
    algo: Optional[str] = None
    proto: Optional[str] = None
    channels: Optional[tuple[int, int]] = None

    @property
    def dtype(self) -> Optional[str]:
        """generate.py's token (``f32``), None for an unknown code."""
        d = NCCL_DATATYPES.get(self.datatype)
        return d[2] if d else None

    @property
    def type_size(self) -> Optional[int]:
        d = NCCL_DATATYPES.get(self.datatype)
        return d[1] if d else None

    @property
    def bytes(self) -> Optional[int]:
        """``count x sizeof(datatype)`` (thesis Eq. 4.9): the logged buffer bytes."""
        s = self.type_size
        return None if s is None else self.count * s

    @property
    def reduce_op(self) -> str:
        return NCCL_REDOPS.get(self.redop, f"user{self.redop}")


@dataclass
class CommInit:
    comm: str
    rank: int
    nranks: int
    host: str
    pid: int
    cuda_dev: Optional[int] = None
    bus_id: Optional[str] = None
    comm_id: Optional[str] = None
    function: Optional[str] = None
    complete: bool = False
    rings: list[list[int]] = field(default_factory=list)
    coll_channels: Optional[int] = None


@dataclass(frozen=True)
class TopoLink:
    src: str
    dst: str
    kind: str  # NVL, PCI, SYS, NET, ...
    bandwidth_GBps: float


@dataclass
class NcclTopology:
    """The first ``=== System`` block of a process: nodes and measured link bandwidths."""

    max_bw_GBps: float
    total_bw_GBps: float
    gpus: dict[str, Optional[int]] = field(default_factory=dict)  # "GPU/0-1000" -> index in parens
    links: list[TopoLink] = field(default_factory=list)

    def _gpu_links(self, kind: str) -> list[float]:
        return [
            lk.bandwidth_GBps
            for lk in self.links
            if lk.kind == kind and (lk.src in self.gpus or lk.dst in self.gpus)
        ]

    @property
    def intra_node_GBps(self) -> Optional[float]:
        """Bottleneck GPU link inside the node (thesis Eq. 4.12): the slowest NVLink if every
        GPU has one, else the slowest PCIe link of a GPU."""
        nvl = self._gpu_links("NVL")
        with_nvl = {
            lk.src if lk.src in self.gpus else lk.dst
            for lk in self.links
            if lk.kind == "NVL" and (lk.src in self.gpus or lk.dst in self.gpus)
        }
        if nvl and with_nvl >= set(self.gpus):
            return min(nvl)
        pci = self._gpu_links("PCI")
        return min(pci) if pci else None

    @property
    def network_GBps(self) -> Optional[float]:
        net = [lk.bandwidth_GBps for lk in self.links if lk.kind == "NET"]
        return max(net) if net else None


@dataclass(frozen=True)
class SkippedLine:
    source: str
    line: int
    reason: str
    text: str


@dataclass
class NcclProcessLog:
    """Everything one process logged."""

    host: str
    pid: int
    source: str
    devices: set[int] = field(default_factory=set)
    calls: list[NcclCall] = field(default_factory=list)
    inits: dict[str, CommInit] = field(default_factory=dict)  # comm pointer -> init (last one wins)
    topology: Optional[NcclTopology] = None
    version: Optional[str] = None
    skipped: list[SkippedLine] = field(default_factory=list)
    unattached_tuning: int = 0

    @property
    def device(self) -> Optional[int]:
        return min(self.devices) if self.devices else None

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.pid)

    def world_rank(self) -> Optional[int]:
        """The rank in the process's largest communicator (the world, for torch.distributed)."""
        if not self.inits:
            return None
        big = max(self.inits.values(), key=lambda i: (i.nranks, -i.rank))
        return big.rank


class _State:
    """Per-process parse state."""

    def __init__(self, log: NcclProcessLog) -> None:
        self.log = log
        self.init_on_tid: dict[int, CommInit] = {}
        self.topo_active = False
        self.topo_done = False
        self.topo_stack: list[tuple[int, str]] = []


def _epoch_us(m: re.Match) -> Optional[float]:
    if m.group("epoch"):
        return float(m.group("epoch")) * 1e6
    if m.group("date"):
        text = m.group("date").replace("T", " ").replace(",", ".")
        fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in text else "%Y-%m-%d %H:%M:%S"
        try:
            return _dt.datetime.strptime(text, fmt).timestamp() * 1e6
        except ValueError:
            return None
    return None


def _read_lines(source: Union[str, Path]) -> tuple[str, list[str], bool]:
    path = Path(source)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"NCCL log: cannot read {str(path)!r}: {e}") from e
    text = raw.decode("utf-8", errors="replace")
    return str(path), text.splitlines(), bool(text) and not text.endswith(("\n", "\r"))


def parse_nccl_log(
    source: Union[str, Path, Iterable[str]], *, name: Optional[str] = None, warn: bool = True
) -> list[NcclProcessLog]:
    """Parse one log (a path, or an iterable of lines); one `NcclProcessLog` per process in it."""
    if isinstance(source, (str, Path)):
        src, lines, cut = _read_lines(source)
    else:
        lines, cut = [str(x).rstrip("\n") for x in source], False
        src = name or "<lines>"
    src = name or src
    states: dict[tuple[str, int], _State] = {}
    skipped: list[SkippedLine] = []
    file_version: Optional[str] = None
    for no, text in enumerate(lines, start=1):
        if "NCCL" not in text:
            continue
        truncated = cut and no == len(lines)
        m = _PREFIX.search(text)
        if m is None and file_version is None:
            v = _VERSION.search(text)
            if v:  # NCCL prints its version line without the prefix on some launchers
                file_version = v.group(1)
                continue
        if m is None:
            if "opCount" in text or _ALGO_HINT.search(text) or _INIT_HINT.search(text):
                skipped.append(
                    SkippedLine(
                        src, no, "truncated line" if truncated else "no host:pid:tid [dev] prefix", text[:160]
                    )
                )
            continue
        key = (m.group("host"), int(m.group("pid")))
        st = states.get(key)
        if st is None:
            st = states[key] = _State(NcclProcessLog(key[0], key[1], src))
        st.log.devices.add(int(m.group("dev")))
        reason = _parse_message(st, m, no, src)
        if reason is not None:
            sk = SkippedLine(src, no, "truncated line" if truncated else reason, text[:160])
            skipped.append(sk)
            st.log.skipped.append(sk)
    logs = [s.log for s in states.values()]
    for lg in logs:
        lg.version = lg.version or file_version
    orphans = [s for s in skipped if not any(s in lg.skipped for lg in logs)]
    if orphans and logs:
        logs[0].skipped = sorted(logs[0].skipped + orphans, key=lambda s: s.line)
    if skipped and warn:
        first = "; ".join(f"line {s.line}: {s.reason}" for s in skipped[:MAX_REPORTED_SKIPS])
        warnings.warn(
            TraceParseWarning(
                f"NCCL log {src}: skipped {len(skipped)} malformed or truncated line(s) ({first})"
            ),
            stacklevel=2,
        )
    if not logs and skipped:
        # only malformed lines: keep them visible through an empty process record
        lg = NcclProcessLog("?", -1, src, skipped=skipped)
        logs.append(lg)
    return logs


def _parse_message(st: _State, m: re.Match, no: int, src: str) -> Optional[str]:
    """Interpret one prefixed line; returns a skip reason for a line that looks known but is malformed."""
    msg = m.group("msg")
    log = st.log
    host, pid, tid, dev = log.host, log.pid, int(m.group("tid")), int(m.group("dev"))
    if log.version is None:
        v = _VERSION.search(msg)
        if v:
            log.version = v.group(1)
            return None
    # topology block (first one per process)
    if st.topo_active:
        if _TOPO_END.match(msg):
            st.topo_active, st.topo_done = False, True
            return None
        return _parse_topology_line(st, msg)
    h = _TOPO_HEAD.match(msg)
    if h:
        if not st.topo_done and log.topology is None:
            log.topology = NcclTopology(float(h.group("max")), float(h.group("total")))
            st.topo_active = True
        return None
    if _CALL_HINT.match(msg):
        c = _CALL.match(msg)
        if c is None:
            return "malformed call line"
        op = canonical_op(c.group("op")) or c.group("op")
        try:
            call = NcclCall(
                op=op,
                op_count=int(c.group("opc"), 16),
                count=int(c.group("count")),
                datatype=int(c.group("dt")),
                redop=int(c.group("redop")),
                root=int(c.group("root")),
                comm=c.group("comm"),
                nranks=int(c.group("nranks")) if c.group("nranks") else None,
                stream=c.group("stream"),
                sendbuff=c.group("sb"),
                recvbuff=c.group("rb"),
                host=host,
                pid=pid,
                tid=tid,
                device=dev,
                time_us=_epoch_us(m),
                line=no,
                source=src,
            )
        except ValueError:
            return "malformed number in call line"
        if call.datatype not in NCCL_DATATYPES:
            return f"unknown datatype code {call.datatype}"
        log.calls.append(call)
        return None
    if _ALGO_HINT.search(msg):
        a = _ALGO.match(msg)
        if a is None:
            return "malformed tuning line"
        algo, proto = normalize_algo(a.group("algo")), normalize_proto(a.group("proto"))
        if algo is None or proto is None:
            return "unknown algorithm/protocol in tuning line"
        _attach_tuning(
            log,
            canonical_op(a.group("op")) if a.group("op") else None,
            int(a.group("bytes")),
            a.group("comm"),
            algo,
            proto,
            (int(a.group("lo")), int(a.group("hi"))) if a.group("lo") is not None else None,
        )
        return None
    if _INIT_HINT.search(msg):
        i = _INIT.match(msg)
        if i is None:
            return "malformed communicator init line"
        rest = i.group("rest")
        phase = _INIT_PHASE.search(rest)
        d, b, cid = _INIT_DEV.search(rest), _INIT_BUS.search(rest), _INIT_COMMID.search(rest)
        comm = i.group("comm")
        prev = log.inits.get(comm)
        init = prev if prev is not None and not prev.complete else CommInit(comm, 0, 0, host, pid)
        init.rank, init.nranks = int(i.group("rank")), int(i.group("nranks"))
        if init.rank >= init.nranks:
            return f"communicator rank {init.rank} >= nranks {init.nranks}"
        init.function = i.group("fn") or init.function
        init.cuda_dev = int(d.group(1)) if d else init.cuda_dev
        init.bus_id = b.group(1).lower() if b else init.bus_id
        init.comm_id = cid.group(1).lower() if cid else init.comm_id
        init.complete = bool(phase and phase.group(1) == "COMPLETE")
        log.inits[comm] = init
        st.init_on_tid[tid] = init
        return None
    r = _RING.match(msg)
    if r:
        init = st.init_on_tid.get(tid)
        if init is not None and not init.complete:
            init.rings.append([int(x) for x in r.group(3).split()])
        return None
    cl = _CHANNELS_LINE.match(msg)
    if cl:
        init = st.init_on_tid.get(tid)
        if init is not None:
            init.coll_channels = int(cl.group(1))
        return None
    return None


def _parse_topology_line(st: _State, msg: str) -> Optional[str]:
    topo = st.log.topology
    assert topo is not None
    if not msg.strip():
        return None
    child = _TOPO_CHILD.match(msg)
    if child:
        ind = len(child.group("ind"))
        while st.topo_stack and st.topo_stack[-1][0] >= ind:
            st.topo_stack.pop()
        parent = st.topo_stack[-1][1] if st.topo_stack else None
        node = child.group("node")
        if node.startswith("GPU/"):
            info = (child.group("info") or "").strip()
            if info.lstrip("-").isdigit():
                topo.gpus[node] = int(info)
            else:  # a link *to* a GPU listed elsewhere: keep what that listing said
                topo.gpus.setdefault(node, None)
        if parent is not None:
            topo.links.append(TopoLink(parent, node, child.group("link"), float(child.group("bw"))))
        st.topo_stack.append((ind, node))
        return None
    root = _TOPO_ROOT.match(msg)
    if root:
        st.topo_stack = [(-1, root.group("node"))]
        if root.group("node").startswith("GPU/"):
            topo.gpus.setdefault(root.group("node"), None)
        return None
    return "malformed topology line"


def _attach_tuning(
    log: NcclProcessLog,
    op: Optional[str],
    nbytes: int,
    comm: Optional[str],
    algo: str,
    proto: str,
    channels: Optional[tuple[int, int]],
) -> None:
    # NCCL prints tuning lines while it schedules a group's tasks, after their call lines
    # (sorted by size inside a group): attach to the latest matching call still without one.
    for call in reversed(log.calls[-256:]):
        if call.algo is not None or call.op in ("Send", "Recv"):
            continue
        if op is not None and call.op != op:
            continue
        if comm is not None and call.comm != comm:
            continue
        # AllGather/ReduceScatter tuning lines of NCCL <= 2.20 count the whole buffer
        # (e.g. "AllGather: 37756928 Bytes" for count 2359808 float32 over 4 ranks)
        if call.bytes is None or nbytes not in (call.bytes, call.bytes * (call.nranks or 1)):
            continue
        call.algo, call.proto, call.channels = algo, proto, channels
        return
    log.unattached_tuning += 1


def parse_nccl_logs(paths: Iterable[Union[str, Path]]) -> list[NcclProcessLog]:
    """Parse several files; processes that appear in more than one file are merged in file order."""
    merged: dict[tuple[str, int], NcclProcessLog] = {}
    for p in paths:
        for lg in parse_nccl_log(p):
            if lg.pid < 0:
                merged.setdefault(("?", -len(merged) - 1), lg)
                continue
            have = merged.get(lg.key)
            if have is None:
                merged[lg.key] = lg
                continue
            have.calls.extend(lg.calls)
            have.inits.update(lg.inits)
            have.devices |= lg.devices
            have.topology = have.topology or lg.topology
            have.skipped.extend(lg.skipped)
            have.unattached_tuning += lg.unattached_tuning
    return [lg for lg in merged.values() if lg.pid >= 0 or lg.skipped]


def find_log_files(directory: Union[str, Path]) -> list[Path]:
    """Every regular file under ``directory`` whose name suggests an NCCL log (``*.log``, ``*.txt``,
    ``*.out``, ``*.err``), sorted."""
    d = Path(directory)
    if d.is_file():
        return [d]
    if not d.is_dir():
        raise ConfigError(f"NCCL log dir: {str(d)!r} is neither a file nor a directory")
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in (".log", ".txt", ".out", ".err"))


__all__ = [
    "CommInit",
    "NcclCall",
    "NcclProcessLog",
    "NcclTopology",
    "SkippedLine",
    "TopoLink",
    "TraceParseWarning",
    "find_log_files",
    "parse_nccl_log",
    "parse_nccl_logs",
]
