"""`CostProfile`: the calibration file every rank loads.

What it holds
    The topology (a preset name, optionally the full measured `Topology`), the
    backend, the collective model's parameters (`CollectiveParams`: per-kind
    multipliers, fitted alpha/beta per (kind, group size)), the compute model's
    (`ComputeParams`: per-family multipliers and fits, per-op overhead), the CPU
    contention κ, the runtime terms of a training step (`step.RuntimeParams`:
    in-graph collective latency, per-step and per-parameter runtime), and
    provenance (machine, date, torch and commfuse versions).

Why a file
    Scheduling decisions change the collective sequence, so every rank must
    decide from the same numbers: `commfuse calibrate` measures once, writes
    this JSON, and every rank loads it (`fingerprint()` lets ranks check they
    agree). Errors name the file and the field path.

Format: JSON, `schema_version` 1; see docs/costmodel.md ("Profile file format").
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, model_validator

from commfuse._version import __version__
from commfuse.core.errors import ConfigError
from commfuse.costmodel.analytic import AnalyticCostModel
from commfuse.costmodel.collectives import CollectiveParams
from commfuse.costmodel.compute import ComputeParams
from commfuse.costmodel.step import RuntimeParams
from commfuse.costmodel.topology import PRESETS, Topology, load_json_model


class Provenance(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    machine: str = ""
    date: str = ""  # ISO 8601
    torch_version: str = ""
    commfuse_version: str = ""
    notes: str = ""

    @classmethod
    def here(cls, notes: str = "") -> "Provenance":
        import torch

        return cls(
            machine=platform.node(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            torch_version=torch.__version__,
            commfuse_version=__version__,
            notes=notes,
        )


class CostProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    topology: str = Field(description="preset name (or the name of topology_spec)")
    topology_spec: Optional[Topology] = Field(default=None, description="full topology; overrides the preset")
    num_nodes: PositiveInt = 1
    backend: Literal["nccl", "gloo"]
    collective: CollectiveParams = Field(default_factory=CollectiveParams)
    compute: ComputeParams = Field(default_factory=ComputeParams)
    contention_kappa: Optional[NonNegativeFloat] = None
    runtime: RuntimeParams = Field(default_factory=RuntimeParams)
    provenance: Provenance = Field(default_factory=Provenance)

    @model_validator(mode="after")
    def _check(self) -> "CostProfile":
        if self.topology_spec is None and self.topology not in PRESETS:
            raise ValueError(
                f"topology {self.topology!r} is not a preset ({sorted(PRESETS)}) "
                "and no topology_spec is given"
            )
        return self

    def resolve_topology(self, num_nodes: Optional[int] = None) -> Topology:
        nodes = num_nodes or self.num_nodes
        if self.topology_spec is not None:
            return Topology.model_validate({**self.topology_spec.model_dump(), "num_nodes": nodes})
        return Topology.preset(self.topology, num_nodes=nodes)

    def build_model(self, topology: Optional[Topology] = None):
        return AnalyticCostModel(
            topology or self.resolve_topology(),
            self.backend,
            self.collective,
            self.compute,
            contention_kappa=self.contention_kappa,
            runtime=self.runtime,
        )

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: equal on every rank that loaded the same numbers."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[
            :16
        ]

    def save(self, path: str | Path) -> None:
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(self.model_dump_json(indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cost profile: cannot write {str(path)!r}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        return load_json_model(cls, path, "cost profile", "profile file")
