"""Synthesise NCCL logs and kernel traces, in the real formats, from recorded collective sequences.

There is no GPU here, so the alignment fixtures are built from what *is* real: the
collective sequences of the example models recorded on gloo ranks by commfuse's runtime
recorder (tests/fixtures/alignment/sequences.json, written by
tests/fixtures/alignment/record_sequences.py) -- kind, group, bytes and the issue times of
every c10d call, per rank. This module turns them into what an NCCL run of the same
program would leave behind, and keeps the ground truth:

* **NCCL's view** (`SynthRun`): one communicator per process group (pointer per rank,
  shared ``commId``, one stream), ``opCount`` per launch; every collective one call line
  (``AllGather`` count = per-rank send count, ``ReduceScatter`` count = per-rank receive
  count: the recorder's logged bytes already follow NCCL's count semantics); an all_to_all
  is PyTorch's ``ncclGroupStart; ncclSend/ncclRecv to every peer; ncclGroupEnd`` (2·n call
  lines, one opCount, one ``ncclDevKernel_SendRecv``); datatype float32 (every example model
  trains in float32; record_sequences.py checks it), reduce op sum (the recorder does not
  record reduce ops).
* **Log text** (`render_log`): NCCL 2.26 INFO lines with ``NCCL_DEBUG_TIMESTAMP_FORMAT=
  "%s.%6f"`` timestamps (and ``NCCL_DEBUG_TIMESTAMP_LEVELS=WARN,INFO``): version/bootstrap
  noise, ``ncclCommInitRank ... Init START``, the topology block of a 4-GPU NVSwitch node,
  ring/tree/channel lines, ``Init COMPLETE``, call lines and -- on each communicator's rank 0
  only, as NCCL does -- tuning lines.
* **Kernels**: names as NCCL >= 2.19 builds them (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``,
  ``ncclDevKernel_AllGather_RING_LL``, ``ncclDevKernel_SendRecv``; tree all_reduces
  ``..._TREE_LL``), grid = the channels of the tuning decision, each with its CUDA launch
  call; written as a torch.profiler Chrome trace (with the ``record_param_comms`` metadata
  recent PyTorch puts on NCCL kernels, ``cuda_runtime`` launch events, and compute kernels in
  between) or an Nsight Systems SQLite export (CUPTI_ACTIVITY_KIND_KERNEL / _RUNTIME /
  StringIds / TARGET_INFO_SESSION_START_TIME).
* **Timing** (a model, stated here because alignment with timing depends on it): the
  recorded issue times are the GPU's compute timeline (op ``k`` is ready at its recorded
  issue time, scaled by ``timeline_scale``); the host enqueues each op ``host_ahead`` of the
  way through its training step (``host_ahead < 1``: the CPU runs ahead of the GPU inside a
  step and meets it at the step end, as ``loss.item()`` makes it), never before its
  previous launch call returned (one host thread); NCCL's launch call follows the op's last
  call line by ``enqueue_us`` (lognormal jitter); a kernel starts at ``max(launch call +
  launch latency, ready, end of the stream's previous kernel)``; a collective ends on every
  rank together, ``max over ranks of start + duration`` (duration: commfuse's NCCL cost model
  on the topology, with jitter), which is what makes kernel *ends* the better clock-sync
  point. Each rank's host clock is offset (``clock_offsets_us``) in both its log and its trace.

Deterministic for a given ``seed``.
"""

from __future__ import annotations

import json
import math
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from commfuse.core.errors import ConfigError
from commfuse.costmodel.collectives import CollectiveModel
from commfuse.costmodel.topology import Topology
from commfuse.ir.kinds import CollectiveKind

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "alignment"
SEQUENCES = FIXTURE_DIR / "sequences.json"

# A 4-GPU H100 NVSwitch node as commfuse's cost model sees it (DGX-H100 numbers, 4 ranks).
H100_NODE4 = Topology(
    name="h100-nvswitch-4",
    num_nodes=1,
    ranks_per_node=4,
    intra_node_bandwidth_GBps=370.0,
    inter_node_bandwidth_GBps=45.0,
    intra_node_latency_us=2.0,
    inter_node_latency_us=6.0,
    collective_launch_us=5.0,
    device="H100",
    peak_tflops_fp32=67.0,
    peak_tflops_bf16=990.0,
    memory_bandwidth_GBps=3350.0,
    num_sms=132,
    nccl_channels=16,
)

_KIND_OP = {
    "all_reduce": "AllReduce",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "broadcast": "Broadcast",
    "all_to_all": "SendRecv",
    "send": "SendRecv",
    "recv": "SendRecv",
}
_TORCH_COLL_NAME = {
    "AllReduce": "allreduce",
    "AllGather": "all_gather_into_tensor",
    "ReduceScatter": "reduce_scatter_tensor",
    "Broadcast": "broadcast",
    "SendRecv": "all_to_all",
}


@dataclass(frozen=True)
class SynthConfig:
    seed: int = 0
    host: str = "gpu-node-07"
    base_epoch_s: float = 1_766_081_276.0  # the thesis's Listing 4.1 era
    nccl_version: str = "2.26.2+cuda12.8"
    topology: Topology = H100_NODE4
    launch_latency_us: float = 6.0  # launch call -> earliest kernel start
    enqueue_us: float = 4.0  # NCCL's work between the (last) call line and the CUDA launch call
    latency_sigma: float = 0.35  # lognormal jitter of both
    duration_sigma: float = 0.10
    host_ahead: float = 0.6  # host reaches op k this far into the step (1: never ahead of the GPU)
    timeline_scale: float = 1.0  # compresses the recorded (CPU, gloo) timeline; < 1 packs the calls closer
    clock_offsets_us: tuple[float, ...] = (0.0, 50_000.0, -30_000.0, 12_000.0)  # per rank (thesis §4.3.3)
    timestamps: bool = True


@dataclass
class SynthCall:
    op: str  # AllReduce, AllGather, ReduceScatter, Broadcast, Send, Recv
    count: int
    datatype: int = 7
    redop: int = 0
    root: int = 0
    sendbuff: str = "(nil)"
    recvbuff: str = "(nil)"


@dataclass
class SynthKernel:
    name: str
    start_ns: int  # epoch ns on the rank's (offset) host clock
    end_ns: int
    stream: int
    correlation: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    meta: dict[str, Any] = field(default_factory=dict)
    launch_ns: Optional[int] = None  # host time of the CUDA launch call


@dataclass
class SynthLaunch:
    uid: int  # unique within the run
    rank: int
    group: int
    op_count: int
    kind: str
    calls: list[SynthCall]
    t_log_us: float  # epoch us on the rank's host clock
    algo: Optional[str]
    proto: Optional[str]
    channels: Optional[tuple[int, int]]
    kernel: SynthKernel


@dataclass
class SynthRank:
    rank: int
    host: str
    pid: int
    tid: int
    device: int
    bus_id: str
    comm_ptrs: dict[int, str]
    stream_ptrs: dict[int, str]
    stream_ids: dict[int, int]
    launches: list[SynthLaunch] = field(default_factory=list)


@dataclass
class SynthRun:
    model: str
    world: int
    groups: list[list[int]]
    comm_ids: list[str]
    ranks: list[SynthRank]
    config: SynthConfig
    steps: int

    def true_offsets_ns(self) -> dict[int, float]:
        """What clock sync should recover: the offset to add to rank r's times to land on rank 0's clock."""
        off = self.config.clock_offsets_us
        o = [off[r % len(off)] for r in range(self.world)]
        return {r: -(o[r] - o[0]) * 1e3 for r in range(self.world)}


def load_sequences(path: Union[str, Path] = SEQUENCES) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"sequences fixture {str(p)!r} is not readable JSON: {e}") from e
    if doc.get("schema") != 1 or "models" not in doc:
        raise ConfigError(f"sequences fixture {str(p)!r}: expected schema 1 with a 'models' object")
    return doc


def _ptr(rng: random.Random) -> str:
    return f"0x{0x550000000000 + rng.getrandbits(36) * 16:x}"


def _tuning(op: str, nbytes: int, nranks: int) -> tuple[str, str, tuple[int, int]]:
    """A plausible NCCL decision for one node: tree for tiny all_reduces, LL/LL128/SIMPLE by size,
    channels growing with the size (NCCL's own tuner is not reproduced; only the line format is)."""
    algo = "TREE" if op == "AllReduce" and nbytes <= 4096 else "RING"
    proto = "LL" if nbytes <= 64 * 1024 else ("LL128" if nbytes <= 4 * 1024 * 1024 else "SIMPLE")
    nch = max(1, min(16, 2 ** int(math.log2(max(1, nbytes // 8192))) if nbytes >= 8192 else 1))
    return algo, proto, (0, nch - 1)


def _kernel_name(op: str, algo: str) -> str:
    if op == "SendRecv":
        base = "ncclDevKernel_SendRecv"
    elif op in ("AllGather", "Broadcast"):
        base = f"ncclDevKernel_{op}_RING_LL"
    else:
        base = f"ncclDevKernel_{op}_Sum_f32_{'TREE' if algo == 'TREE' else 'RING'}_LL"
    return base + "(ncclDevKernelArgsStorage<4096ul>)"


def _size_for_model(op: str, logged: int, sent: int, n: int) -> int:
    """nccl-tests size (costmodel convention) of one collective from the recorder's bytes."""
    if op == "AllGather":
        return logged * n
    if op == "ReduceScatter":
        return logged * n
    if op == "SendRecv":
        return sent
    return logged


def synthesize(
    model: str, doc: Optional[dict[str, Any]] = None, cfg: Optional[SynthConfig] = None
) -> SynthRun:
    """One `SynthRun` for ``model`` (a key of sequences.json's ``models``)."""
    doc = doc if doc is not None else load_sequences()
    cfg = cfg or SynthConfig()
    if model not in doc["models"]:
        raise ConfigError(f"synthesize: unknown model {model!r}; recorded: {sorted(doc['models'])}")
    rec = doc["models"][model]
    world = int(doc["world_size"])
    groups: list[list[int]] = [list(g) for g in rec["groups"]]
    rng = random.Random(f"{cfg.seed}:{model}:synth")
    comm_ids = [f"0x{rng.getrandbits(64):016x}" for _ in groups]
    cm = CollectiveModel(cfg.topology)
    ranks: list[SynthRank] = []
    for r in range(world):
        pid = 41000 + 131 * r
        ranks.append(
            SynthRank(
                r,
                cfg.host,
                pid,
                pid + 612,
                r % cfg.topology.ranks_per_node,
                f"{0x18000 + 0x11000 * r:x}",
                {g: _ptr(rng) for g in range(len(groups))},
                {g: _ptr(rng) for g in range(len(groups))},
                {g: 13 + 4 * g for g in range(len(groups))},
            )
        )
    seqs = rec["ranks"]
    nops = len(seqs[0])
    if any(len(s) != nops for s in seqs):
        raise ConfigError(f"synthesize: model {model!r} has different sequence lengths per rank")
    steps = max(1, int(rec.get("steps", 1)))
    per_step = max(1, nops // steps)
    off_us = [cfg.clock_offsets_us[r % len(cfg.clock_offsets_us)] for r in range(world)]
    base_us = cfg.base_epoch_s * 1e6
    stream_free = [dict.fromkeys(range(len(groups)), 0.0) for _ in range(world)]
    host_free = [0.0] * world
    op_count = [[0] * len(groups) for _ in range(world)]
    corr = [9000 + 1000 * r for r in range(world)]
    uid = 0
    for k in range(nops):
        kind, gidx = seqs[0][k][0], seqs[0][k][1]
        op = _KIND_OP.get(kind)
        if op is None:
            raise ConfigError(f"synthesize: model {model!r} op {k}: kind {kind!r} has no NCCL counterpart")
        members = groups[gidx]
        n = len(members)
        starts: dict[int, float] = {}
        enq: dict[int, float] = {}
        launch_call: dict[int, float] = {}
        ncalls = 2 * len(members) if _KIND_OP.get(kind) == "SendRecv" else 1
        for r in members:
            o = seqs[r][k]
            if (o[0], o[1]) != (kind, gidx):
                raise ConfigError(
                    f"synthesize: model {model!r} op {k}: ranks disagree ({seqs[0][k][:2]} vs {o[:2]})"
                )
            ready = base_us + 2000.0 + cfg.timeline_scale * o[5] / 1e3  # the GPU's compute timeline
            step0 = cfg.timeline_scale * seqs[r][(k // per_step) * per_step][5] / 1e3 + base_us + 2000.0
            host = step0 + cfg.host_ahead * (ready - step0)
            # one host thread: an op is called after the previous op's launch call returned
            host = max(host, host_free[r])
            launch_call[r] = (
                host + 0.4 * (ncalls - 1) + cfg.enqueue_us * math.exp(rng.gauss(0.0, cfg.latency_sigma))
            )
            host_free[r] = launch_call[r] + 1.0
            lat = cfg.launch_latency_us * math.exp(rng.gauss(0.0, cfg.latency_sigma))
            starts[r] = max(launch_call[r] + lat, ready, stream_free[r][gidx])
            enq[r] = host
        logged, sent = seqs[members[0]][k][2] or 0, seqs[members[0]][k][3] or 0
        size = _size_for_model(op, logged, sent, n)
        ckind = CollectiveKind.ALL_TO_ALL if op == "SendRecv" else CollectiveKind(kind)
        dur = cm.time(ckind, max(size, 1), n).time_us * math.exp(rng.gauss(0.0, cfg.duration_sigma))
        end = max(starts.values()) + dur
        algo, proto, chans = _tuning(op, logged, n)
        for r in members:
            rk = ranks[r]
            my_end = end + abs(rng.gauss(0.0, 0.01 * dur))
            stream_free[r][gidx] = my_end
            gr = members.index(r)
            elem = 4
            if op == "SendRecv":
                per_peer = max(1, (seqs[r][k][3] or 0) // elem // n)
                calls = []
                for p in range(n):
                    calls.append(SynthCall("Send", per_peer, root=p, sendbuff=_ptr(rng)))
                    calls.append(SynthCall("Recv", per_peer, root=p, recvbuff=_ptr(rng)))
                grid = (min(n, 16) * 2, 1, 1)
            else:
                cnt = max(1, (seqs[r][k][2] or 0) // elem)
                buf = _ptr(rng)
                calls = [SynthCall(op, cnt, sendbuff=buf, recvbuff=buf if op == "AllReduce" else _ptr(rng))]
                grid = (chans[1] - chans[0] + 1, 1, 1)
            corr[r] += 7
            meta = {
                "Collective name": _TORCH_COLL_NAME[op],
                "dtype": "Float",
                "Group size": n,
                "Process Group Name": str(gidx),
                "Process Group Description": "default_pg" if n == world else f"group{gidx}",
                "Process Group Ranks": str(members),
                "Rank": gr,
            }
            if op == "SendRecv":
                total = sum(c.count for c in calls if c.op == "Send")
                meta.update({"In msg nelems": total, "Out msg nelems": total})
            else:
                c0 = calls[0].count
                meta.update(
                    {
                        "In msg nelems": c0 * (n if op == "ReduceScatter" else 1),
                        "Out msg nelems": c0 * (n if op == "AllGather" else 1),
                    }
                )
            shift = off_us[r]
            kern = SynthKernel(
                _kernel_name(op, algo),
                int(round((starts[r] + shift) * 1e3)),
                int(round((my_end + shift) * 1e3)),
                rk.stream_ids[gidx],
                corr[r],
                grid,
                (640 if proto == "SIMPLE" else 512, 1, 1),
                meta,
                int(round((launch_call[r] + shift) * 1e3)),
            )
            rk.launches.append(
                SynthLaunch(
                    uid,
                    r,
                    gidx,
                    op_count[r][gidx],
                    kind,
                    calls,
                    enq[r] + shift,
                    algo if op != "SendRecv" else None,
                    proto if op != "SendRecv" else None,
                    chans if op != "SendRecv" else None,
                    kern,
                )
            )
            op_count[r][gidx] += 1
            uid += 1
    return SynthRun(model, world, groups, comm_ids, ranks, cfg, steps)


# ------------------------------------------------------------------------------- rendering

_TOPO_BLOCK = (
    "=== System : maxBw 370.8 totalBw 370.8 ===",
    "CPU/0-0 (1/2/-1)",
    "+ PCI[48.0] - PCI/0-16000 (1000c03010000000)",
    "              + PCI[48.0] - GPU/0-18000 (0)",
    "                            + NVL[370.8] - NVS/0-0",
    "+ PCI[48.0] - PCI/0-27000 (1000c03010000000)",
    "              + PCI[48.0] - GPU/0-29000 (1)",
    "                            + NVL[370.8] - NVS/0-0",
    "              + PCI[48.0] - NIC/0-2a000",
    "                            + NET[50.0] - NET/0-0 (0/9a1b2c0003ae6d94/1/50.000000)",
    "+ SYS[16.0] - CPU/0-1",
    "CPU/0-1 (1/2/-1)",
    "+ PCI[48.0] - PCI/0-38000 (1000c03010000000)",
    "              + PCI[48.0] - GPU/0-3a000 (2)",
    "                            + NVL[370.8] - NVS/0-0",
    "+ PCI[48.0] - PCI/0-49000 (1000c03010000000)",
    "              + PCI[48.0] - GPU/0-4b000 (3)",
    "                            + NVL[370.8] - NVS/0-0",
    "+ SYS[16.0] - CPU/0-0",
    "==========================================",
)


def _prefix(rk: SynthRank, t_us: Optional[float], cfg: SynthConfig, tid: Optional[int] = None) -> str:
    head = f"{rk.host}:{rk.pid}:{tid or rk.tid} [{rk.device}] NCCL INFO "
    if cfg.timestamps and t_us is not None:
        return f"{t_us / 1e6:.6f} {head}"
    return head


@dataclass(frozen=True)
class LogItem:
    """One call line to render: launch ``uid``, call index (ground truth for the evaluation)."""

    uid: int
    call: int


def render_log(run: SynthRun, rank: int, items: list[LogItem], *, extra_lines: tuple[str, ...] = ()) -> str:
    """The NCCL_DEBUG=INFO text of ``rank`` with the given call lines (in order)."""
    cfg = run.config
    rk = run.ranks[rank]
    by_uid = {lau.uid: lau for lau in rk.launches}
    t0 = min((lau.t_log_us for lau in rk.launches), default=cfg.base_epoch_s * 1e6) - 1500.0
    init_tid = rk.pid
    lines = [
        f"{rk.host}:{rk.pid}:{rk.pid} [{rk.device}] NCCL INFO Bootstrap : Using eth0:10.0.0.{rank + 10}<0>",
        f"{rk.host}:{rk.pid}:{rk.pid} [{rk.device}] NCCL INFO cudaDriverVersion 12040",
        f"NCCL version {cfg.nccl_version}",
    ]
    for g, members in enumerate(run.groups):
        if rank not in members:
            continue
        gr, n = members.index(rank), len(members)
        p = _prefix(rk, t0, cfg, init_tid)
        lines.append(
            f"{p}ncclCommInitRank comm {rk.comm_ptrs[g]} rank {gr} nranks {n} cudaDev {rk.device} "
            f"nvmlDev {rk.device} busId {rk.bus_id} commId {run.comm_ids[g]} - Init START"
        )
        if g == 0:
            lines.extend(p + t for t in _TOPO_BLOCK)
        lines.append(
            f"{p}comm {rk.comm_ptrs[g]} rank {gr} nRanks {n} nNodes 1 localRanks {n} localRank {gr} MNNVL 0"
        )
        for ch in range(4):
            order = "".join(f"{(gr0 + ch) % n:4d}" for gr0 in range(n))
            lines.append(f"{p}Channel {ch:02d}/24 : {order}")
        lines.append(
            f"{p}Trees [0] {(gr + 1) % n}/-1/-1->{gr}->{(gr - 1) % n} [1] {(gr + 1) % n}/-1/-1->{gr}->-1"
        )
        lines.append(
            f"{p}24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels, "
            "32 p2p channels per peer"
        )
        lines.append(
            f"{p}ncclCommInitRank comm {rk.comm_ptrs[g]} rank {gr} nranks {n} cudaDev {rk.device} "
            f"nvmlDev {rk.device} busId {rk.bus_id} commId {run.comm_ids[g]} - Init COMPLETE"
        )
        lines.append(
            f"{p}Init timings - ncclCommInitRank: rank {gr} nranks {n} total 0.66 (kernels 0.42, "
            "alloc 0.02, bootstrap 0.07, allgathers 0.03, topo 0.06, graphs 0.01, connections 0.04, "
            "rest 0.01)"
        )
    lines.extend(extra_lines)
    pending_tuning: list[str] = []
    last_uid = None
    for it in items:
        lau = by_uid[it.uid]
        if last_uid is not None and last_uid != it.uid and pending_tuning:
            lines.extend(pending_tuning)
            pending_tuning = []
        c = lau.calls[it.call]
        members = run.groups[lau.group]
        t = lau.t_log_us + 0.4 * it.call
        p = _prefix(rk, t, cfg)
        lines.append(
            f"{p}{c.op}: opCount {lau.op_count:x} sendbuff {c.sendbuff} recvbuff {c.recvbuff} count "
            f"{c.count} datatype {c.datatype} op {c.redop} root {c.root} comm {rk.comm_ptrs[lau.group]} "
            f"[nranks={len(members)}] stream {rk.stream_ptrs[lau.group]}"
        )
        if members.index(rank) == 0 and lau.algo is not None and it.call == len(lau.calls) - 1:
            lo, hi = lau.channels or (0, 0)
            pending_tuning.append(
                f"{_prefix(rk, t + 1.1, cfg)}{c.op}: {c.count * 4} Bytes -> Algo {lau.algo} proto "
                f"{lau.proto} channel{{Lo..Hi}}={{{lo}..{hi}}}"
            )
        last_uid = it.uid
    lines.extend(pending_tuning)
    return "\n".join(lines) + "\n"


def _compute_kernels(kernels: list[SynthKernel], rng: random.Random) -> list[tuple[str, int, int]]:
    """A few non-NCCL kernels between the collectives (the readers must ignore them)."""
    out = []
    names = (
        "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add"
        "<float>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)",
    )
    for k in kernels[::3]:
        s = k.start_ns - 20_000 - rng.randrange(5_000)
        out.append((names[rng.randrange(2)], s, s + 8_000 + rng.randrange(4_000)))
    return out


def render_torch_trace(
    run: SynthRun, rank: int, kernels: list[SynthKernel], *, metadata: bool = True
) -> dict[str, Any]:
    """A torch.profiler (Kineto) Chrome trace of ``rank`` with these NCCL kernels."""
    rng = random.Random(f"{run.config.seed}:{run.model}:torch:{rank}")
    allk = [(k.name, k.start_ns, k.end_ns, k) for k in kernels] + [
        (n, s, e, None) for n, s, e in _compute_kernels(kernels, rng)
    ]
    base = (
        min((x[1] for x in allk), default=int(run.config.base_epoch_s * 1e9)) // 1_000_000_000
    ) * 1_000_000_000
    rk = run.ranks[rank]
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rk.device, "tid": 0, "args": {"name": "python3"}}
    ]
    for name, s, e, k in sorted(allk, key=lambda x: x[1]):
        args: dict[str, Any] = {
            "External id": rng.randrange(1, 1 << 20),
            "device": run.ranks[rank].device,
            "context": 1,
        }
        if k is not None:
            args.update(
                {
                    "stream": k.stream,
                    "correlation": k.correlation,
                    "registers per thread": 96,
                    "shared memory": 7104,
                    "blocks per SM": round(k.grid[0] / 132, 6),
                    "warps per SM": 0.0,
                    "grid": list(k.grid),
                    "block": list(k.block),
                    "est. achieved occupancy %": 0,
                }
            )
            if metadata:
                args.update(k.meta)
        else:
            args.update(
                {
                    "stream": 7,
                    "correlation": rng.randrange(1 << 21, 1 << 22),
                    "grid": [132, 1, 1],
                    "block": [256, 1, 1],
                }
            )
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "pid": rk.device,
                "tid": args["stream"],
                "ts": (s - base) / 1e3,
                "dur": (e - s) / 1e3,
                "args": args,
            }
        )
        launch = k.launch_ns if k is not None and k.launch_ns is not None else s - 15_000
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernelExC" if k is not None else "cudaLaunchKernel",
                "pid": rk.pid,
                "tid": rk.pid,
                "ts": (launch - base) / 1e3,
                "dur": 4.2,
                "args": {
                    "External id": args["External id"],
                    "cbid": 430 if k is not None else 211,
                    "correlation": args["correlation"],
                },
            }
        )
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}],
        "distributedInfo": {
            "backend": "nccl",
            "rank": rank,
            "world_size": run.world,
            "nccl_version": run.config.nccl_version.split("+")[0],
        },
        "cupti_version": 24,
        "cuda_runtime_version": 12040,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "traceEvents": ev,
    }


_NSYS_KERNEL_COLUMNS = (
    "start INTEGER NOT NULL",
    "end INTEGER NOT NULL",
    "deviceId INTEGER NOT NULL",
    "contextId INTEGER NOT NULL",
    "greenContextId INTEGER",
    "streamId INTEGER NOT NULL",
    "correlationId INTEGER",
    "globalPid INTEGER",
    "demangledName INTEGER NOT NULL",
    "shortName INTEGER NOT NULL",
    "mangledName INTEGER",
    "launchType INTEGER",
    "cacheConfig INTEGER",
    "registersPerThread INTEGER NOT NULL",
    "gridX INTEGER NOT NULL",
    "gridY INTEGER NOT NULL",
    "gridZ INTEGER NOT NULL",
    "blockX INTEGER NOT NULL",
    "blockY INTEGER NOT NULL",
    "blockZ INTEGER NOT NULL",
    "staticSharedMemory INTEGER NOT NULL",
    "dynamicSharedMemory INTEGER NOT NULL",
    "localMemoryPerThread INTEGER NOT NULL",
    "localMemoryTotal INTEGER NOT NULL",
    "gridId INTEGER NOT NULL",
    "sharedMemoryExecuted INTEGER",
    "graphNodeId INTEGER",
    "sharedMemoryLimitConfig INTEGER",
)


def write_nsys_sqlite(path: Union[str, Path], run: SynthRun, rank: int, kernels: list[SynthKernel]) -> Path:
    """An ``nsys export --type sqlite`` of ``rank``'s process with these NCCL kernels."""
    p = Path(path)
    if p.exists():
        p.unlink()
    rng = random.Random(f"{run.config.seed}:{run.model}:nsys:{rank}")
    rk = run.ranks[rank]
    allk = [(k.name, k.start_ns, k.end_ns, k) for k in kernels] + [
        (n, s, e, None) for n, s, e in _compute_kernels(kernels, rng)
    ]
    origin = min((x[1] for x in allk), default=int(run.config.base_epoch_s * 1e9)) - 3_000_000
    gpid = (rk.pid << 24) | (1 << 56)
    con = sqlite3.connect(p)
    try:
        con.execute("CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)")
        con.execute(f"CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL ({', '.join(_NSYS_KERNEL_COLUMNS)})")
        con.execute(
            "CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT, localTime TEXT)"
        )
        con.execute(
            "CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, "
            "eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, "
            "returnValue INTEGER NOT NULL, callchainId INTEGER)"
        )
        con.execute(
            "INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, ?, ?)",
            (origin, "2025-12-18T18:07:56.000Z", "2025-12-18T19:07:56.000+01:00"),
        )
        ids: dict[str, int] = {}

        def sid(s: str) -> int:
            if s not in ids:
                ids[s] = len(ids) + 1
                con.execute("INSERT INTO StringIds VALUES (?, ?)", (ids[s], s))
            return ids[s]

        for name, s, e, k in sorted(allk, key=lambda x: x[1]):
            short = name.split("(", 1)[0].replace("void ", "").split("<", 1)[0]
            grid = k.grid if k else (132, 1, 1)
            block = k.block if k else (256, 1, 1)
            corr = k.correlation if k else rng.randrange(1 << 21, 1 << 22)
            con.execute(
                f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({', '.join('?' * 28)})",
                (
                    s - origin,
                    e - origin,
                    rk.device,
                    1,
                    None,
                    k.stream if k else 7,
                    corr,
                    gpid,
                    sid(name),
                    sid(short),
                    None,
                    0,
                    0,
                    96,
                    *grid,
                    *block,
                    7104 if k else 0,
                    82240 if k else 0,
                    0,
                    0,
                    rng.randrange(1 << 20),
                    None,
                    None,
                    None,
                ),
            )
            launch = k.launch_ns if k is not None and k.launch_ns is not None else s - 15_000
            con.execute(
                "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    launch - origin,
                    launch - origin + 4_200,
                    1,
                    gpid | rk.pid,
                    corr,
                    sid("cudaLaunchKernelExC_v11060" if k is not None else "cudaLaunchKernel_v7000"),
                    0,
                    None,
                ),
            )
        con.commit()
    finally:
        con.close()
    return p


__all__ = [
    "FIXTURE_DIR",
    "H100_NODE4",
    "LogItem",
    "SEQUENCES",
    "SynthCall",
    "SynthConfig",
    "SynthKernel",
    "SynthLaunch",
    "SynthRank",
    "SynthRun",
    "load_sequences",
    "render_log",
    "render_torch_trace",
    "synthesize",
    "write_nsys_sqlite",
]
