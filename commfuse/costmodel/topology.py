"""`Topology`: where the ranks sit and how fast the links between them are.

Every rank must build the *same* Topology (decisions made from it change the
collective sequence), so it is built only from inputs every rank shares: a
preset name, a file, or explicit values. Validation errors name the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from ..errors import ConfigError


class Topology(BaseModel):
    """Ranks per node, node count, and link bandwidth (GB/s) / latency (us)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    num_nodes: PositiveInt = 1
    ranks_per_node: PositiveInt = 1
    intra_node_bandwidth_GBps: PositiveFloat = Field(default=100.0, description="per-rank intra-node bandwidth, GB/s")
    inter_node_bandwidth_GBps: PositiveFloat = Field(default=25.0, description="per-rank inter-node bandwidth, GB/s")
    intra_node_latency_us: float = Field(default=5.0, ge=0)
    inter_node_latency_us: float = Field(default=10.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "Topology":
        if self.num_nodes > 1 and self.inter_node_bandwidth_GBps > self.intra_node_bandwidth_GBps * 100:
            raise ValueError("inter_node_bandwidth_GBps is over 100x intra_node_bandwidth_GBps; units mixed up?")
        return self

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def spans_nodes(self, ranks: tuple[int, ...]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

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
        return cls(**{**PRESETS[name], "num_nodes": num_nodes, "name": name})

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"topology: cannot read topology file {str(path)!r}: {e}") from e
        return cls.model_validate(data)


# Nominal per-GPU figures (bus bandwidth achievable by NCCL, GB/s). The cost-model
# issue calibrates and extends these; they are inputs every rank shares.
PRESETS: dict[str, dict] = {
    "dgx-h100": dict(ranks_per_node=8, intra_node_bandwidth_GBps=450.0, inter_node_bandwidth_GBps=50.0,
                     intra_node_latency_us=3.0, inter_node_latency_us=8.0),
    "dgx-a100": dict(ranks_per_node=8, intra_node_bandwidth_GBps=240.0, inter_node_bandwidth_GBps=25.0,
                     intra_node_latency_us=4.0, inter_node_latency_us=10.0),
    "cpu-gloo": dict(ranks_per_node=2, intra_node_bandwidth_GBps=2.0, inter_node_bandwidth_GBps=1.0,
                     intra_node_latency_us=50.0, inter_node_latency_us=100.0),
}
