"""How much slower a compute kernel runs while a collective runs next to it.

What it models
    *GPUs / NCCL* — Lagom's Eqs. 4-6 (§3.2 of "Lagom: Unleashing the Power of
    Communication and Computation Overlapping for Distributed LLM Training", Xu et al.).
    A collective j running with ``NC`` channels (one CTA, i.e. one SM, each) and chunk size
    ``C`` leaves ``λ - NC`` SMs to compute kernel i and takes ``V(NC, C)`` of the
    memory bandwidth ``B̄``:

        g = ceil(μ / ((λ - NC) · TB))                     (5) waves
        f = θ + ((λ - NC) · TB · D) / (B̄ - V(NC, C))      (6) time per wave
        y = g · f                                          (4)

    and the slowdown factor is ``y(NC, C) / y(0, -)`` (the kernel alone: all λ
    SMs, ``V = 0``). One deliberate change: the memory term counts the bytes the
    kernel really moves, ``μ · D / (B̄ - V)``, instead of ``g · (λ-NC)·TB·D``
    (which charges a partly filled last wave as a full one). The two agree when
    μ is a multiple of the wave size; ours is monotone in NC, Lagom's literal
    form is not (a wave boundary can make one more channel look cheaper).

    *CPU / gloo* — gloo's threads copy and reduce on the same cores as compute:
    compute is slowed by ``(1 + κ)`` while a gloo collective is in flight, κ
    fitted by calibration (default: the topology's ``contention_kappa``). Used
    whenever the backend is gloo or the device has no SMs.

Assumptions (no published values; calibrate on a GPU before trusting them)
    * Kernel shape from the compute estimate: matmul/attention/conv kernels are
      128x128 output tiles, one CTA per SM (``TB = 1``); all other kernels use
      blocks of 1024 elements, 8 resident per SM. ``D = bytes / μ``;
      ``θ = (flops / peak) · λ·TB / μ`` (one block's compute time at its SM's share
      of the peak).
    * ``V(NC, C) = k_mem · min(NC · b_ch · C / (C + C_half), B_link)``: each channel
      moves up to ``b_ch = B_link / nccl_channels`` (the default channel count
      saturates the link), small chunks pipeline worse (half speed at
      ``C_half`` = 128 KiB), and every byte on the wire costs ``k_mem = 2`` bytes
      of device memory traffic (read the source, write the destination; a
      reduction's extra read is folded in by calibration). V is capped at 90% of B̄.
    * Defaults: ``NC = topology.nccl_channels``, ``C = 2 MiB`` (NCCL Simple
      protocol, NCCL_BUFFSIZE 4 MiB / 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt

from commfuse.core.errors import ConfigError
from commfuse.costmodel.compute import ComputeEstimate
from commfuse.costmodel.topology import Topology

_GBPS = 1e3  # bytes/us per GB/s
_TFLOPS = 1e6  # flop/us per TFLOP/s
_TILE_FAMILIES = ("matmul", "attention", "attention_bw", "conv")


@dataclass(frozen=True)
class CommResources:
    """The device resources a concurrent collective takes (Lagom's s_j, minus A/P/T)."""

    channels: int  # NC: CTAs (SMs) the collective's kernel occupies
    chunk_bytes: int = 2 << 20  # C


@dataclass(frozen=True)
class KernelShape:
    """Lagom's per-kernel parameters."""

    blocks: int  # μ
    blocks_per_sm: int  # TB
    bytes_per_block: float  # D
    wave_compute_us: float  # θ


class GpuContentionParams(BaseModel):
    """Lagom parameters of one device (see module docstring for the assumptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_sms: PositiveInt  # λ
    mem_bw_GBps: PositiveFloat  # B̄
    link_bw_GBps: PositiveFloat  # the collective's link (intra-node bus bandwidth)
    per_channel_bw_GBps: PositiveFloat  # b_ch
    chunk_half_bytes: PositiveInt = 128 << 10
    mem_bytes_per_wire_byte: NonNegativeFloat = 2.0
    max_comm_mem_fraction: float = Field(default=0.9, gt=0, lt=1)
    tile_elems: PositiveInt = 128 * 128
    block_elems: PositiveInt = 1024
    blocks_per_sm: PositiveInt = 8

    @classmethod
    def from_topology(cls, t: Topology) -> "GpuContentionParams":
        if not t.is_gpu:
            raise ConfigError(f"contention: topology {t.name!r} has num_sms=0 (not a GPU); use the CPU model")
        return cls(
            num_sms=t.num_sms,
            mem_bw_GBps=t.memory_bandwidth_GBps,
            link_bw_GBps=t.intra_node_bandwidth_GBps,
            per_channel_bw_GBps=t.intra_node_bandwidth_GBps / t.nccl_channels,
        )

    def comm_mem_bw_GBps(self, r: CommResources) -> float:
        """V(NC, C)."""
        if r.channels <= 0:
            return 0.0
        sent = min(
            r.channels * self.per_channel_bw_GBps * r.chunk_bytes / (r.chunk_bytes + self.chunk_half_bytes),
            self.link_bw_GBps,
        )
        return min(self.mem_bytes_per_wire_byte * sent, self.max_comm_mem_fraction * self.mem_bw_GBps)


class ContentionModel:
    """``slowdown(compute_estimate, concurrent_collective) -> factor >= 1``."""

    def __init__(
        self,
        topology: Topology,
        backend: str = "nccl",
        *,
        kappa: Optional[float] = None,
        gpu_params: Optional[GpuContentionParams] = None,
    ) -> None:
        if backend not in ("nccl", "gloo"):
            raise ConfigError(f"contention: backend must be 'nccl' or 'gloo', got {backend!r}")
        if kappa is not None and kappa < 0:
            raise ConfigError(f"contention: kappa must be >= 0, got {kappa}")
        self.topology = topology
        self.backend = backend
        self.kappa = topology.contention_kappa if kappa is None else float(kappa)
        self.lagom = backend == "nccl" and topology.is_gpu
        self.gpu = (gpu_params or GpuContentionParams.from_topology(topology)) if self.lagom else None

    def default_resources(self) -> CommResources:
        return CommResources(channels=self.topology.nccl_channels)

    def kernel_shape(self, est: ComputeEstimate) -> KernelShape:
        g = self.gpu
        assert g is not None
        if est.family in _TILE_FAMILIES:
            blocks, tb = max(1, math.ceil(est.out_numel / g.tile_elems)), 1
        else:
            blocks, tb = max(1, math.ceil(est.out_numel / g.block_elems)), g.blocks_per_sm
        peak = self.topology.peak_tflops(est.dtype_family) * _TFLOPS
        theta = (est.flops / peak) * g.num_sms * tb / blocks
        return KernelShape(blocks, tb, est.bytes / blocks, theta)

    def kernel_time_us(self, k: KernelShape, r: Optional[CommResources]) -> float:
        """Lagom's y (Eqs. 4-6, exact-bytes memory term) with `r` running alongside (None: alone)."""
        g = self.gpu
        assert g is not None
        nc = 0 if r is None else r.channels
        if nc >= g.num_sms:
            raise ConfigError(
                f"contention: collective takes {nc} channels but the device has {g.num_sms} SMs"
            )
        v = 0.0 if r is None else g.comm_mem_bw_GBps(r)
        waves = math.ceil(k.blocks / ((g.num_sms - nc) * k.blocks_per_sm))
        return waves * k.wave_compute_us + k.blocks * k.bytes_per_block / ((g.mem_bw_GBps - v) * _GBPS)

    def slowdown(self, compute: ComputeEstimate, concurrent: Any = None) -> float:
        """Factor (>= 1) by which `compute` slows while `concurrent` runs.

        `concurrent`: None (nothing in flight: 1.0), a `CommResources`, anything
        else standing for "a collective with default resources" (a Collective, a
        CollectiveEstimate), or a list/tuple of those (several collectives in
        flight: their channels add up, capped at λ-1; the largest chunk counts).
        On CPU/gloo any number of collectives in flight gives ``1 + κ``.
        """
        if isinstance(concurrent, (list, tuple)):
            if not concurrent:
                return 1.0
            rs = [c if isinstance(c, CommResources) else self.default_resources() for c in concurrent]
            cap = self.gpu.num_sms - 1 if self.gpu is not None else sum(r.channels for r in rs)
            concurrent = CommResources(min(sum(r.channels for r in rs), cap), max(r.chunk_bytes for r in rs))
        if concurrent is None or compute.family == "free" or compute.time_us <= 0:
            return 1.0
        if not self.lagom:
            return 1.0 + self.kappa
        r = concurrent if isinstance(concurrent, CommResources) else self.default_resources()
        k = self.kernel_shape(compute)
        alone = self.kernel_time_us(k, None)
        if alone <= 0:
            return 1.0
        return max(1.0, self.kernel_time_us(k, r) / alone)
