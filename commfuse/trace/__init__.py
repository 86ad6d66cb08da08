"""NCCL log and kernel-trace alignment.

Parse NCCL ``NCCL_DEBUG=INFO`` logs (`nccl_log`) and GPU kernel traces (`kernel_trace`:
torch.profiler Chrome traces, Nsight Systems SQLite), merge calls into launches by
(communicator, opCount) (`launches`), align each rank's launches with its kernels by the
NCCL-trace thesis's weighted Needleman–Wunsch (`align`, exact DP in `nw`), map
communicators across processes and synchronise clocks (`comms`), and write an enriched Chrome trace
with bytes, algorithm, protocol, algbw/busbw and efficiency (`enrich`). `synth` and
`perturb` build the alignment fixtures (real NCCL formats, op sequences recorded from the
example models on gloo) and the thesis's four perturbation scenarios.

    python -m commfuse align LOGDIR TRACEDIR -o enriched.json

See docs/alignment.md.
"""

from __future__ import annotations

from commfuse.trace.align import (
    AlignConfig,
    CommMap,
    GapRule,
    Launch,
    LogicalComm,
    RankAlignment,
    RunAlignment,
    align_rank,
    align_run,
    launches,
    map_communicators,
    synchronize_clocks,
)
from commfuse.trace.kernel_trace import (
    KernelRecord,
    KernelTrace,
    parse_kernel_name,
    read_kernel_traces,
    read_nsys_sqlite,
    read_torch_trace,
)
from commfuse.trace.nccl_log import (
    NcclCall,
    NcclProcessLog,
    TraceParseWarning,
    parse_nccl_log,
    parse_nccl_logs,
)

__all__ = [
    "AlignConfig",
    "CommMap",
    "GapRule",
    "KernelRecord",
    "KernelTrace",
    "Launch",
    "LogicalComm",
    "NcclCall",
    "NcclProcessLog",
    "RankAlignment",
    "RunAlignment",
    "TraceParseWarning",
    "align_rank",
    "align_run",
    "launches",
    "map_communicators",
    "parse_kernel_name",
    "parse_nccl_log",
    "parse_nccl_logs",
    "read_kernel_traces",
    "read_nsys_sqlite",
    "read_torch_trace",
    "synchronize_clocks",
]
