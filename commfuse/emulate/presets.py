"""Emulated-network presets: which cluster each one emulates, and the rates that follow.

A preset keeps the named cluster's compute-to-communication ratio on this machine. The
conventions below were fixed on 2026-11-29, before any A/B ran on an emulated network, and the
presets do not change after that: later work uses them as they are (a new cluster is a new
preset with a new name).

Conventions
- Compute. Achieved throughput on both sides. Here: one core, one thread, ``torch.mm`` of two
  1024 x 1024 fp32 matrices, the median of 40 after 3 warm-ups, on the project's 2-core
  development machine: ``CPU_MATMUL_GFLOPS``. There: the GPU's dense bf16 peak at
  ``GPU_MFU`` (40%, a good large-model training run). ``scale = CPU / GPU``.
- Bytes. A link's rate is the emulated cluster's achievable per-rank bandwidth times ``scale``
  (the per-rank figures of commfuse's own ``dgx-h100`` / ``dgx-a100`` topology presets), so the
  wire bytes of a collective take as long next to a matmul here as there. gloo's ring and NCCL's
  send the same wire bytes per rank for an all_reduce, all_gather or reduce_scatter.
- Burst. Every tbf gets a bucket of one millisecond at its rate, at least 16 KiB
  (``burst_bytes``): a message larger than that is paced from its first bytes.
- Levels. Inside a node every rank has its own link at the intra rate. Between nodes each node
  has one uplink at ``ranks_per_node`` times the per-rank inter rate (a node's NICs taken
  together), shaped both ways.
- Limits. No latency emulation: the kernel has no netem, so a small message costs what TCP on
  this machine costs, not a GPU's few microseconds. Memory-bound ops keep this CPU's speed next
  to its matmuls, not a GPU's; a step's compute is scaled as a whole only in the matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.core.errors import ConfigError

# One core, one thread, 1024 x 1024 fp32 torch.mm (2 * 1024**3 FLOP), median of 40 after 3
# warm-ups, on the project's development machine with nothing else running, 2026-11-29: five runs
# of 40 gave 59.7, 71.9, 61.2, 61.1, 61.4; their median
# (python -m commfuse.emulate.presets measures it again; the presets keep this figure).
CPU_MATMUL_GFLOPS = 61.2
GPU_MFU = 0.40
H100_BF16_TFLOPS = 989.0
A100_BF16_TFLOPS = 312.0


@dataclass(frozen=True)
class NetworkPreset:
    """One emulated cluster. Rates are bits per second on the wire (tbf counts whole frames)."""

    name: str
    emulates: str
    intra_bps: float  # each rank's own link inside a node, each direction
    inter_bps_per_rank: float  # per rank; a node's uplink carries ranks_per_node times this
    gpu_tflops: float  # the emulated device's dense bf16 peak
    gpu_intra_GBps: float  # the emulated cluster's achievable per-rank bandwidths
    gpu_inter_GBps: float

    @property
    def scale(self) -> float:
        return _scale(self.gpu_tflops)

    @property
    def two_level(self) -> bool:
        return self.inter_bps_per_rank > 0

    def uplink_bps(self, ranks_per_node: int) -> float:
        return self.inter_bps_per_rank * ranks_per_node

    def describe(self) -> str:
        inter = (
            f", {self.inter_bps_per_rank / 1e6:.1f} Mbit/s per rank between nodes"
            if self.two_level
            else ", one node"
        )
        return (
            f"{self.name} ({self.emulates}): {self.intra_bps / 1e6:.1f} Mbit/s per rank inside a node{inter}"
        )


def burst_bytes(rate_bps: float) -> int:
    """The tbf bucket for ``rate_bps``: one millisecond at the rate, at least 16 KiB."""
    return max(16 * 1024, int(rate_bps / 8 / 1000))


def _scale(gpu_tflops: float) -> float:
    """This machine's achieved matmul rate over the GPU's (the compute convention)."""
    return CPU_MATMUL_GFLOPS * 1e9 / (gpu_tflops * 1e12 * GPU_MFU)


def _preset(name: str, emulates: str, tflops: float, intra_GBps: float, inter_GBps: float) -> NetworkPreset:
    scale = _scale(tflops)
    return NetworkPreset(
        name=name,
        emulates=emulates,
        intra_bps=intra_GBps * 1e9 * 8 * scale,
        inter_bps_per_rank=inter_GBps * 1e9 * 8 * scale,
        gpu_tflops=tflops,
        gpu_intra_GBps=intra_GBps,
        gpu_inter_GBps=inter_GBps,
    )


PRESETS: dict[str, NetworkPreset] = {
    p.name: p
    for p in (
        # NVLink4/NVSwitch inside one H100 node: ~370 GB/s per rank achievable (dgx-h100).
        _preset("h100-nvlink", "one node of H100 SXM on NVLink 4", H100_BF16_TFLOPS, 370.0, 0.0),
        # Nodes of H100 on NVLink 4, one 400 Gb/s NIC per GPU between them (~45 GB/s achievable).
        _preset(
            "h100-nvlink-ib400",
            "H100 SXM nodes, NVLink 4 inside, 400 Gb/s per GPU between nodes",
            H100_BF16_TFLOPS,
            370.0,
            45.0,
        ),
        # Centauri's faster cluster (§6): A100 nodes on NVLink 3 (~230 GB/s achievable),
        # 100 Gb/s per GPU between nodes (~11.25 GB/s achievable).
        _preset(
            "a100-nvlink-ib100",
            "A100 SXM nodes, NVLink 3 inside, 100 Gb/s per GPU between nodes",
            A100_BF16_TFLOPS,
            230.0,
            11.25,
        ),
    )
}


def preset(name: str) -> NetworkPreset:
    if name not in PRESETS:
        raise ConfigError(f"network preset: unknown name {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def measure_cpu_matmul_gflops(n: int = 1024, warmup: int = 3, repeats: int = 40) -> float:
    """This machine's rate under the compute convention (one thread, n x n fp32 torch.mm)."""
    import statistics
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(warmup):
            torch.mm(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / statistics.median(times) / 1e9


if __name__ == "__main__":
    print(f"{measure_cpu_matmul_gflops():.2f} GFLOP/s (fixed in the presets: {CPU_MATMUL_GFLOPS})")
    for p in PRESETS.values():
        print(p.describe())
