"""`Topology`: where the ranks sit, how fast the links between them are, and how
fast one device computes.

What it models
    A homogeneous cluster: ``num_nodes`` nodes of ``ranks_per_node`` ranks (one
    device each). Links are described per rank:

    * ``intra_node_bandwidth_GBps``: the *bus bandwidth* NCCL (or gloo) reaches
      between ranks of one node at large messages (nccl-tests "busbw"), not the
      link's signalling rate. Converting to algorithm bandwidth is the collective
      model's job (`collectives.py`, NCCL busbw factors).
    * ``inter_node_bandwidth_GBps``: the per-rank share of the node's NICs
      (a node with one 200 Gb/s NIC and 8 GPUs has 25/8 GB/s per rank; a DGX with
      one 400 Gb/s NIC per GPU has ~50). A group with ``a`` ranks on a node can
      drive ``a`` times this out of the node.
    * ``intra_node_latency_us`` / ``inter_node_latency_us``: latency of one
      algorithm *step* (hop) on that link; ``collective_launch_us`` the fixed
      start-up cost of one collective (kernel launch, proxy wake-up).
    * the device: dense matmul peak per dtype family (``peak_tflops_fp32``,
      ``peak_tflops_bf16`` for bf16/fp16), memory bandwidth, SM count (Lagom's λ;
      0 for CPUs) and, for CPU/gloo, the contention factor κ (`contention.py`).

Sources
    Vendor data sheets for peaks and HBM bandwidth (H100 SXM 989 dense bf16 /
    67 fp32 TFLOP/s, 3.35 TB/s; A100 SXM 312 / 19.5, 2.04 TB/s; A40 149.7 / 37.4,
    696 GB/s; RTX 4080 97.5 (fp32 accumulate) / 48.7, 717 GB/s); achievable NCCL
    bus bandwidths from nccl-tests folklore and NCCL's own topo.h constants
    (SM90 NVLink ≈ 370 GB/s, PCIe ≈ 12-24 GB/s), cross-checked against the
    constants `torch/_inductor/comm_analysis.py` uses (see docs/costmodel.md).
    Chimera's testbed: 8× RTX 4080 on PCIe 4.0, no NVLink (GeForce cards have no
    P2P, NCCL goes through host memory). DHelix's: A40 PCIe nodes.

Assumptions
    Presets are *nominal*: calibration (`commfuse calibrate`) replaces them with
    measured values through the cost profile. Every rank must build the *same*
    Topology (decisions made from it change the collective sequence), so it is
    built only from inputs every rank shares: a preset name, a file, explicit
    values, or `Topology.detect` on (world size, local world size, device name).
    Validation errors name the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from commfuse.core.errors import ConfigError, InputFileError


def _describe_validation_error(e: ValidationError) -> str:
    """One line per problem, each naming the field path (``a.b.0.c``)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "<root>"
        parts.append(f"field {loc!r}: {err.get('msg')}")
    return "; ".join(parts)


def load_json_model(cls, path: str | Path, what: str, noun: str):
    """``cls`` validated from the JSON file ``path``; every failure a ConfigError that names
    the file (and the field, for invalid values). ``what`` prefixes the message, ``noun``
    says what the file is ("topology file", "profile file")."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputFileError(
            path, f"cannot read {noun}: {e}", f"{what}: cannot read {noun} {str(path)!r}: {e}"
        ) from e
    if not isinstance(data, dict):
        got = type(data).__name__
        raise InputFileError(
            path,
            f"a {noun} must hold a JSON object, got {got}",
            f"{what}: {noun} {str(path)!r} must hold a JSON object, got {got}",
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        why = _describe_validation_error(e)
        raise InputFileError(
            path, f"invalid {noun}: {why}", f"{what}: invalid {noun} {str(path)!r}: {why}"
        ) from e


class Topology(BaseModel):
    """Ranks per node, node count, link bandwidth (GB/s) / latency (us), device peaks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    num_nodes: PositiveInt = 1
    ranks_per_node: PositiveInt = 1
    intra_node_bandwidth_GBps: PositiveFloat = Field(
        default=100.0, description="per-rank achievable intra-node bus bandwidth, GB/s"
    )
    inter_node_bandwidth_GBps: PositiveFloat = Field(
        default=25.0, description="per-rank share of the node's NIC bandwidth, GB/s"
    )
    intra_node_latency_us: float = Field(default=5.0, ge=0, description="latency of one intra-node step, us")
    inter_node_latency_us: float = Field(default=10.0, ge=0, description="latency of one inter-node step, us")
    collective_launch_us: float = Field(
        default=5.0, ge=0, description="fixed start-up cost of one collective, us"
    )
    # --- the device (one per rank) ---
    device: str = Field(default="generic", description="device model, informational")
    peak_tflops_fp32: PositiveFloat = Field(default=10.0, description="dense fp32 matmul peak, TFLOP/s")
    peak_tflops_bf16: PositiveFloat = Field(default=100.0, description="dense bf16/fp16 matmul peak, TFLOP/s")
    memory_bandwidth_GBps: PositiveFloat = Field(default=1000.0, description="device memory bandwidth, GB/s")
    num_sms: NonNegativeInt = Field(default=0, description="streaming multiprocessors (Lagom's λ); 0 = CPU")
    nccl_channels: PositiveInt = Field(default=16, description="channels (CTAs) NCCL uses by default")
    contention_kappa: float = Field(
        default=0.0, ge=0, description="CPU/gloo: compute slows by (1+κ) while a collective is in flight"
    )

    @model_validator(mode="after")
    def _check(self) -> "Topology":
        if self.num_nodes > 1 and self.inter_node_bandwidth_GBps > self.intra_node_bandwidth_GBps * 100:
            raise ValueError(
                "inter_node_bandwidth_GBps is over 100x intra_node_bandwidth_GBps; units mixed up?"
            )
        if self.num_sms and self.nccl_channels >= self.num_sms:
            raise ValueError(f"nccl_channels ({self.nccl_channels}) must be below num_sms ({self.num_sms})")
        return self

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def is_gpu(self) -> bool:
        return self.num_sms > 0

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def spans_nodes(self, ranks: tuple[int, ...]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def ranks_per_node_of(self, ranks: tuple[int, ...]) -> dict[int, int]:
        """node -> how many of `ranks` sit on it."""
        out: dict[int, int] = {}
        for r in ranks:
            out[self.node_of(r)] = out.get(self.node_of(r), 0) + 1
        return out

    def peak_tflops(self, family: str) -> float:
        """Peak for a dtype family: "bf16" (bf16/fp16) or "fp32" (everything else)."""
        return self.peak_tflops_bf16 if family == "bf16" else self.peak_tflops_fp32

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ConfigError(
                f"topology: num_nodes*ranks_per_node = {self.num_nodes}*{self.ranks_per_node} = "
                f"{self.world_size}, but the process group has world_size {world_size}"
            )

    def intra_node_groups(self) -> list[tuple[int, ...]]:
        r = self.ranks_per_node
        return [tuple(range(n * r, (n + 1) * r)) for n in range(self.num_nodes)]

    def inter_node_groups(self) -> list[tuple[int, ...]]:
        r = self.ranks_per_node
        return [tuple(n * r + i for n in range(self.num_nodes)) for i in range(r)]

    @classmethod
    def preset(cls, name: str, *, num_nodes: int = 1) -> "Topology":
        if name not in PRESETS:
            raise ConfigError(f"topology: unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        try:
            return cls(**{**PRESETS[name], "num_nodes": num_nodes, "name": name})
        except ValidationError as e:
            raise ConfigError(f"topology: preset {name!r}: {_describe_validation_error(e)}") from e

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        return load_json_model(cls, path, "topology", "topology file")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @staticmethod
    def preset_for_device(device_name: str) -> "str | None":
        """The preset whose pattern (`DEVICE_PRESETS`, case-insensitive) matches ``device_name``."""
        low = device_name.lower()
        return next((p for pat, p in DEVICE_PRESETS if re.search(pat, low)), None)

    @classmethod
    def detect(cls, world_size: int, local_world_size: int, device_name: str) -> "Topology":
        """The topology for this job from inputs identical on every rank.

        `device_name` is e.g. ``torch.cuda.get_device_name()`` ("NVIDIA H100 80GB
        HBM3") or "cpu"; the preset is chosen by pattern (case-insensitive, see
        `DEVICE_PRESETS`), then ``ranks_per_node = local_world_size`` and
        ``num_nodes = world_size / local_world_size``. A pure function: no probing
        of the machine, so every rank gets the same answer.
        """
        for field, v in (("world_size", world_size), ("local_world_size", local_world_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"topology.detect: {field} must be a positive int, got {v!r}")
        if world_size % local_world_size:
            raise ConfigError(
                f"topology.detect: world_size {world_size} is not divisible by local_world_size "
                f"{local_world_size} (nodes must hold the same number of ranks)"
            )
        if not isinstance(device_name, str) or not device_name.strip():
            raise ConfigError(f"topology.detect: device_name must be a non-empty string, got {device_name!r}")
        preset = cls.preset_for_device(device_name)
        if preset is None:
            known = ", ".join(pat for pat, _ in DEVICE_PRESETS)
            raise ConfigError(
                f"topology.detect: device_name {device_name!r} matches no preset (known patterns: {known}); "
                "pass a Topology or a topology file instead"
            )
        try:
            return cls(
                **{
                    **PRESETS[preset],
                    "name": preset,
                    "num_nodes": world_size // local_world_size,
                    "ranks_per_node": local_world_size,
                }
            )
        except ValidationError as e:
            raise ConfigError(f"topology.detect: {_describe_validation_error(e)}") from e


# Nominal per-rank figures. Bandwidths are achievable bus bandwidths (GB/s), latencies
# per algorithm step (us). Calibration replaces them (cost profile); the values and
# their sources are listed in docs/costmodel.md ("Topology").
PRESETS: dict[str, dict] = {
    # 8x H100 SXM, NVLink4/NVSwitch (450 GB/s/dir link, ~370 busbw ring), 8x NDR 400 Gb/s IB.
    "dgx-h100": dict(
        ranks_per_node=8,
        intra_node_bandwidth_GBps=370.0,
        inter_node_bandwidth_GBps=45.0,
        intra_node_latency_us=1.0,
        inter_node_latency_us=5.0,
        collective_launch_us=6.0,
        device="H100-SXM",
        peak_tflops_fp32=67.0,
        peak_tflops_bf16=989.0,
        memory_bandwidth_GBps=3350.0,
        num_sms=132,
        nccl_channels=16,
    ),
    # 8x A100 SXM, NVLink3 (300 GB/s/dir, ~230 busbw), 8x HDR 200 Gb/s IB.
    "dgx-a100": dict(
        ranks_per_node=8,
        intra_node_bandwidth_GBps=230.0,
        inter_node_bandwidth_GBps=22.0,
        intra_node_latency_us=1.2,
        inter_node_latency_us=6.0,
        collective_launch_us=6.0,
        device="A100-SXM",
        peak_tflops_fp32=19.5,
        peak_tflops_bf16=312.0,
        memory_bandwidth_GBps=2039.0,
        num_sms=108,
        nccl_channels=8,
    ),
    # Chimera's testbed: 8x RTX 4080 on PCIe 4.0 x16, no NVLink and no P2P (GeForce):
    # NCCL rings go through host memory, ~12 GB/s busbw. One 100 GbE NIC per node.
    "pcie-8gpu": dict(
        ranks_per_node=8,
        intra_node_bandwidth_GBps=12.0,
        inter_node_bandwidth_GBps=1.4,
        intra_node_latency_us=4.0,
        inter_node_latency_us=8.0,
        collective_launch_us=8.0,
        device="RTX-4080",
        peak_tflops_fp32=48.7,
        peak_tflops_bf16=97.5,
        memory_bandwidth_GBps=717.0,
        num_sms=76,
        nccl_channels=4,
    ),
    # DHelix-like: 8x A40 per node on PCIe 4.0 with P2P (~20 GB/s busbw), one HDR 200 Gb/s NIC per node.
    "a40-pcie": dict(
        ranks_per_node=8,
        intra_node_bandwidth_GBps=20.0,
        inter_node_bandwidth_GBps=2.8,
        intra_node_latency_us=3.0,
        inter_node_latency_us=6.0,
        collective_launch_us=8.0,
        device="A40",
        peak_tflops_fp32=37.4,
        peak_tflops_bf16=149.7,
        memory_bandwidth_GBps=696.0,
        num_sms=84,
        nccl_channels=4,
    ),
    # This CPU machine: gloo over loopback TCP, one compute thread per rank. Placeholders
    # until `commfuse calibrate` writes a profile.
    "cpu-gloo": dict(
        ranks_per_node=2,
        intra_node_bandwidth_GBps=2.0,
        inter_node_bandwidth_GBps=1.0,
        intra_node_latency_us=50.0,
        inter_node_latency_us=100.0,
        collective_launch_us=30.0,
        device="cpu",
        peak_tflops_fp32=0.05,
        peak_tflops_bf16=0.02,
        memory_bandwidth_GBps=8.0,
        num_sms=0,
        nccl_channels=1,
        contention_kappa=0.3,
    ),
}

# regex searched in the lower-cased device name -> preset, first match wins.
DEVICE_PRESETS: tuple[tuple[str, str], ...] = (
    (r"\bg?h(100|200|800)\b", "dgx-h100"),
    (r"\ba(100|800)\b", "dgx-a100"),
    (r"\ba40\b", "a40-pcie"),
    (r"\b(rtx )?40[789]0\b|geforce", "pcie-8gpu"),
    (r"\bcpu\b", "cpu-gloo"),
)
