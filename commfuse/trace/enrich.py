"""The enriched Chrome trace: every aligned NCCL kernel with what its log line says.

Contract
- Input: a `RunAlignment` (per-rank alignments, communicator map, clock offsets) and,
  optionally, a commfuse `Topology` (a preset name or JSON, as everywhere in commfuse).
- Output (`enriched_trace`): a Chrome trace (``chrome://tracing`` / Perfetto), one process
  per rank, one thread per logical communicator. Each kernel is an ``X`` event at its
  clock-synchronised time (``offsets_ns`` added) with, when it was aligned with a launch:
  op, ``opCount``, communicator (pointer, logical name, ranks), count, datatype, reduce op,
  root/peer, message bytes, algorithm / protocol / channels (from the tuning line of that
  launch; NCCL prints it on the communicator's rank 0 only, and every rank runs the same
  decision, so the other ranks take it from there by (communicator, opCount)), algbw,
  busbw, bus factor, peak bus bandwidth
  and efficiency, plus the log file and line. Kernels left unaligned keep their timing only
  (thread "unaligned kernels", thesis §4.2.2); launches without a kernel appear as instant
  events at their call time (thread "log only").
- Bandwidths follow the nccl-tests conventions commfuse's cost model uses
  (`commfuse.costmodel.collectives`): the message size is the nccl-tests ``size`` (all_reduce
  / broadcast / reduce: the buffer, ``count x sizeof``; all_gather: the *total output*,
  ``count x sizeof x nranks``; reduce_scatter: the *total input*, likewise; Send/Recv
  groups: the bytes sent); ``algbw = size / duration``, ``busbw = algbw x bus_factor``
  (all_reduce ``2(n-1)/n``, all_gather / reduce_scatter ``(n-1)/n``, broadcast / p2p 1). The
  thesis's Eq. 4.9 takes ``count x sizeof`` for every op, which understates all_gather and
  reduce_scatter by ``n``.
- Efficiency = busbw / peak bus bandwidth. The peak is the topology's: commfuse's
  ``intra_node_bandwidth_GBps`` inside a node, ``min(intra, a x inter_node_bandwidth_GBps)``
  for a group spanning nodes (``a`` its fewest ranks on one node, the cost model's ring
  bottleneck). Without a topology it is the NCCL log's own (thesis Eq. 4.12): the
  slowest GPU NVLink (else PCIe) link of the ``=== System`` block (of the process, else of
  another process on the same host) for single-host groups, the fastest NET link for groups
  spanning hosts. busbw is *defined* to be comparable with
  that link bandwidth (nccl-tests PERFORMANCE.md), so the peak is not multiplied by the bus
  factor as the thesis's Eq. 4.14 does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

from commfuse.core.errors import ConfigError
from commfuse.costmodel.collectives import Placement, bus_factor
from commfuse.costmodel.topology import Topology
from commfuse.trace.align import Launch, LogicalComm, RankAlignment, RunAlignment
from commfuse.trace.kernel_trace import KernelRecord
from commfuse.trace.nccl_log import NcclTopology
from commfuse.trace.vocab import collective_kind


def message_bytes(lau: Launch, nranks: Optional[int]) -> Optional[int]:
    """nccl-tests size of one launch (module docstring); None for mixed groups."""
    sym = lau.symbol
    if sym == "SendRecv":
        return sum(c.bytes or 0 for c in lau.calls if c.op == "Send") or None
    if sym == "Mixed":
        return None
    b = sum(c.bytes or 0 for c in lau.calls)
    if sym in ("AllGather", "ReduceScatter"):
        return b * (nranks or 1)
    return b


def peak_busbw_GBps(
    lc: Optional[LogicalComm],
    nranks: Optional[int],
    topology: Optional[Topology],
    ra: RankAlignment,
    host_topology: Optional[dict[str, NcclTopology]] = None,
) -> tuple[Optional[float], str]:
    """(peak bus bandwidth, where it came from) for the group a launch ran on."""
    n = nranks or (len(lc.members) if lc else None)
    if topology is not None and n:
        ranks = lc.ranks if lc is not None and len(lc.ranks) == n else None
        p = Placement.of(topology, n, ranks)
        if not p.spans:
            return topology.intra_node_bandwidth_GBps, f"topology {topology.name}: intra-node"
        return (
            min(topology.intra_node_bandwidth_GBps, p.a_min * topology.inter_node_bandwidth_GBps),
            f"topology {topology.name}: ring across {p.m} nodes",
        )
    topo = ra.log.topology if ra.log is not None else None
    if topo is None and ra.log is not None and host_topology:
        topo = host_topology.get(ra.log.host)  # another process of the same host printed the block
    if topo is None:
        return None, "unknown (no topology given, no NCCL topology block)"
    hosts = {m[0] for m in lc.members.values()} if lc is not None else {ra.log.host if ra.log else ""}
    if len(hosts) > 1:
        return topo.network_GBps, "NCCL log: NET link"
    return topo.intra_node_GBps, "NCCL log: slowest GPU link"


def _kernel_args(k: KernelRecord) -> dict[str, Any]:
    a: dict[str, Any] = {
        "kernel": k.name,
        "stream": k.stream,
        "correlation": k.correlation,
        "duration_us": round(k.duration_ns / 1e3, 3),
    }
    if k.grid:
        a["grid"] = list(k.grid)
    if k.block:
        a["block"] = list(k.block)
    return a


def launch_args(
    lau: Launch,
    k: KernelRecord,
    lc: Optional[LogicalComm],
    topology: Optional[Topology],
    ra: RankAlignment,
    host_topology: Optional[dict[str, NcclTopology]] = None,
) -> dict[str, Any]:
    c = lau.first
    nranks = lau.nranks or (lc.nranks if lc else None)
    size = message_bytes(lau, nranks)
    args: dict[str, Any] = {
        "op": lau.symbol,
        "opCount": f"{lau.op_count:x}",
        "comm": lau.comm,
        "communicator": lc.name if lc else None,
        "comm_ranks": list(lc.ranks) if lc else None,
        "nranks": nranks,
        "calls": len(lau.calls),
        "count": c.count,
        "datatype": c.dtype,
        "reduce_op": c.reduce_op if lau.symbol in ("AllReduce", "ReduceScatter", "Reduce") else None,
        "root_or_peer": c.root if lau.symbol in ("Broadcast", "Reduce", "SendRecv") else None,
        "message_bytes": size,
        "algorithm": lau.algo,
        "protocol": lau.proto,
        "channels": list(c.channels) if c.channels else None,
        "log": f"{c.source}:{c.line}",
        "kernel_matches_call": None,
    }
    kind = collective_kind(lau.symbol) if lau.symbol != "Mixed" else None
    dur_us = k.duration_ns / 1e3
    if size and kind is not None and nranks and dur_us > 0:
        algbw = size / dur_us / 1e3  # GB/s
        factor = bus_factor(kind, nranks)
        busbw = algbw * factor
        peak, source = peak_busbw_GBps(lc, nranks, topology, ra, host_topology)
        args.update(
            {
                "algbw_GBps": round(algbw, 4),
                "bus_factor": round(factor, 4),
                "busbw_GBps": round(busbw, 4),
                "peak_busbw_GBps": peak,
                "peak_from": source,
                "efficiency_pct": round(100.0 * busbw / peak, 3) if peak else None,
            }
        )
    return args


def enriched_trace(run: RunAlignment, topology: Optional[Topology] = None) -> dict[str, Any]:
    """The enriched Chrome trace of an aligned run (module docstring)."""
    index: dict[tuple[str, int, str], LogicalComm] = run.comm_map.index()
    host_topology = {
        ra.log.host: ra.log.topology for ra in run.ranks if ra.log is not None and ra.log.topology
    }
    # NCCL prints the tuning line on a communicator's rank 0 only, but every rank runs the same
    # algorithm/protocol/channels for a launch: share the decision by (communicator, opCount).
    tuning: dict[tuple[str, int, int], tuple[Any, Any, Any]] = {}
    for ra in run.ranks:
        for lau in ra.launches:
            lc = index.get((ra.log.host, ra.log.pid, lau.comm)) if ra.log else None
            c = next((x for x in lau.calls if x.algo), None)
            if lc is not None and c is not None:
                tuning[(lc.name, lau.epoch, lau.op_count)] = (c.algo, c.proto, c.channels)
    t0 = min(
        (
            k.start_ns + run.offsets_ns.get(ra.rank, 0.0)
            for ra in run.ranks
            if ra.rank is not None
            for k in ra.kernels
        ),
        default=0.0,
    )
    ev: list[dict[str, Any]] = []
    for ra in run.ranks:
        pid = ra.rank if ra.rank is not None else -1
        off = run.offsets_ns.get(ra.rank, 0.0) if ra.rank is not None else 0.0
        us = lambda ns, off=off: (ns + off - t0) / 1e3  # noqa: E731
        where = f"{ra.log.host}:{ra.log.pid}" if ra.log else "?"
        ev.append(
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {ra.rank} ({where})"}}
        )
        threads: dict[str, int] = {}

        def tid(name: str, threads: dict[str, int] = threads, pid: int = pid) -> int:  # bound: this rank's
            if name not in threads:
                threads[name] = len(threads)
                ev.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": threads[name],
                        "args": {"name": name},
                    }
                )
            return threads[name]

        kernel_of = dict(ra.pairs)
        matched = {p: ok for p, ok in zip(ra.pairs, ra.matched, strict=True)}
        paired_k = set(kernel_of.values())
        for li, lau in enumerate(ra.launches):
            lc = index.get((ra.log.host, ra.log.pid, lau.comm)) if ra.log else None
            label = f"{lc.name} ranks {list(lc.ranks)}" if lc else f"comm {lau.comm}"
            if li in kernel_of:
                k = ra.kernels[kernel_of[li]]
                args = {**_kernel_args(k), **launch_args(lau, k, lc, topology, ra, host_topology)}
                args["kernel_matches_call"] = matched[(li, kernel_of[li])]
                shared = tuning.get((lc.name, lau.epoch, lau.op_count)) if lc is not None else None
                if args["algorithm"] is None and shared is not None:
                    args["algorithm"], args["protocol"] = shared[0], shared[1]
                    args["channels"] = list(shared[2]) if shared[2] else None
                    args["tuning_from"] = "the communicator's rank 0"
                args["clock_offset_us"] = round(off / 1e3, 3)
                ev.append(
                    {
                        "name": lau.symbol,
                        "cat": "nccl",
                        "ph": "X",
                        "pid": pid,
                        "tid": tid(label),
                        "ts": us(k.start_ns),
                        "dur": k.duration_ns / 1e3,
                        "args": args,
                    }
                )
            elif lau.time_us is not None and ra.offset_us is not None:
                ev.append(
                    {
                        "name": f"{lau.symbol} (no kernel)",
                        "cat": "nccl,log-only",
                        "ph": "i",
                        "s": "t",
                        "pid": pid,
                        "tid": tid("log only"),
                        "ts": us((lau.time_us + ra.offset_us) * 1e3),
                        "args": {
                            "opCount": f"{lau.op_count:x}",
                            "comm": lau.comm,
                            "count": lau.first.count,
                            "log": f"{lau.first.source}:{lau.first.line}",
                        },
                    }
                )
        for j, k in enumerate(ra.kernels):
            if j in paired_k:
                continue
            ev.append(
                {
                    "name": f"{k.op or 'nccl'} (unaligned)",
                    "cat": "nccl,unaligned",
                    "ph": "X",
                    "pid": pid,
                    "tid": tid("unaligned kernels"),
                    "ts": us(k.start_ns),
                    "dur": k.duration_ns / 1e3,
                    "args": _kernel_args(k),
                }
            )
    meta = {
        "ranks": [ra.summary() for ra in run.ranks],
        "communicators": [
            {"name": lc.name, "nranks": lc.nranks, "ranks": list(lc.ranks), "by": lc.by, "commId": lc.comm_id}
            for lc in run.comm_map.comms
        ],
        "clock_offsets_us": {str(r): round(v / 1e3, 3) for r, v in run.offsets_ns.items()},
        "notes": run.notes,
    }
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"commfuse_alignment": meta}}


def load_topology(spec: Optional[str]) -> Optional[Topology]:
    """``None``, a preset name (``dgx-h100``; ``dgx-h100x2`` for 2 nodes) or a topology JSON file."""
    if not spec:
        return None
    if os.path.isfile(spec):
        return Topology.load(spec)
    m = re.fullmatch(r"(.+?)(?:x(\d+))?", spec)
    assert m is not None
    return Topology.preset(m.group(1), num_nodes=int(m.group(2) or 1))


def write_enriched(path: Union[str, Path], run: RunAlignment, topology: Optional[Topology] = None) -> Path:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(enriched_trace(run, topology)))
    except OSError as e:
        raise ConfigError(f"enriched trace: cannot write {str(p)!r}: {e}") from e
    return p


__all__ = [
    "enriched_trace",
    "launch_args",
    "load_topology",
    "message_bytes",
    "peak_busbw_GBps",
    "write_enriched",
]
