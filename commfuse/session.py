"""`commfuse.setup(...)`: everything commfuse needs from the job, created before compiling.

Process groups are created here and only here, identically and in the same order
on every rank (`dist.new_group` is itself a collective over the default group).
Passes only *choose* among these groups; they never create one, because ranks
that hit a compile cache skip compilation and would not join the creation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .costmodel.topology import Topology
from .errors import ConfigError
from .ir.collective import ParallelRole

# Mesh dimension names users give (torchtitan conventions) -> parallel role.
MESH_DIM_ROLES = {
    "tp": ParallelRole.TP, "sp": ParallelRole.SP, "ep": ParallelRole.EP, "pp": ParallelRole.PP,
    "dp": ParallelRole.DP, "dp_replicate": ParallelRole.DP, "ddp": ParallelRole.DP,
    "dp_shard": ParallelRole.FSDP, "fsdp": ParallelRole.FSDP,
}


@dataclass
class Session:
    topology: Optional[Topology] = None
    group_roles: dict[str, str] = field(default_factory=dict)
    role_sources: dict[str, str] = field(default_factory=dict)
    # ranks -> process group, for the topology's intra-node and inter-node sub-groups
    intra_node_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)
    inter_node_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)


_SESSION = Session()


def current_session() -> Session:
    return _SESSION


def _as_topology(topology: Union[Topology, str, Path, dict, None]) -> Optional[Topology]:
    if topology is None or isinstance(topology, Topology):
        return topology
    if isinstance(topology, dict):
        return Topology.model_validate(topology)
    s = str(topology)
    if s.endswith(".json") or Path(s).is_file():
        return Topology.load(s)
    return Topology.preset(s)


def setup(
    *,
    topology: Union[Topology, str, Path, dict, None] = None,
    mesh: Any = None,
    create_subgroups: bool = True,
) -> Session:
    """Declare the job to commfuse. Call on every rank, after `init_process_group`.

    topology: a `Topology`, a preset name ("dgx-h100"), a JSON file path, or a dict.
        Checked against the world size. With more than one node and more than one
        rank per node, the intra-node and inter-node sub-groups are created (on
        every rank, in one fixed order) unless `create_subgroups=False`.
    mesh: a `DeviceMesh` with `mesh_dim_names`; its groups get the roles the names
        say (tp, sp, ep, pp, dp, dp_replicate, dp_shard, fsdp).
    Returns the session; calling again replaces it.
    """
    global _SESSION
    import torch.distributed as dist

    topo = _as_topology(topology)
    session = Session(topology=topo)
    if topo is not None and dist.is_available() and dist.is_initialized():
        topo.check_world_size(dist.get_world_size())
        if create_subgroups and topo.num_nodes > 1 and topo.ranks_per_node > 1:
            # Every rank creates every group, in this order: new_group is collective.
            for ranks in topo.intra_node_groups():
                session.intra_node_groups[ranks] = dist.new_group(list(ranks))
            for ranks in topo.inter_node_groups():
                session.inter_node_groups[ranks] = dist.new_group(list(ranks))
    if mesh is not None:
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ConfigError("mesh: commfuse.setup needs a DeviceMesh with mesh_dim_names to assign roles")
        for name in names:
            role = MESH_DIM_ROLES.get(name)
            if role is None:
                warnings.warn(f"commfuse.setup: mesh dim {name!r} has no known role; its collectives get inferred roles")
                continue
            group = mesh.get_group(name)
            session.group_roles[group.group_name] = role.value
            session.role_sources[group.group_name] = "mesh"
    _SESSION = session
    return session


def reset() -> None:
    """Forget the session (tests)."""
    global _SESSION
    _SESSION = Session()


def resolved_roles(config) -> tuple[dict[str, str], dict[str, str]]:
    """Group roles and their sources: the session's (mesh), overridden by `config.group_roles` (user)."""
    roles = {**_SESSION.group_roles, **{k: v.value for k, v in config.group_roles.items()}}
    sources = {**_SESSION.role_sources, **{k: "user" for k in config.group_roles}}
    return roles, sources
