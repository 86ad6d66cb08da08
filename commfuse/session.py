"""`commfuse.setup(...)`: everything commfuse needs from the job, created before compiling.

Process groups are created here and only here, identically and in the same order
on every rank (`dist.new_group` is itself a collective over the default group).
Passes only *choose* among these groups; they never create one, because ranks
that hit a compile cache skip compilation and would not join the creation.

Sub-groups for Centauri's group partition (docs/centauri-group-partition.md)
    A *parent* group whose ranks span ``a >= 2`` nodes with the same ``b >= 2`` ranks on
    each, in ascending (node-major) order, is the mesh ``[a, b]``: group rank
    ``j = i*b + l`` sits on the group's ``i``-th node as its ``l``-th local rank. Its
    sub-groups are Centauri's ``G'_k`` for that mesh: the ``a`` *intra-node* groups
    ``{i*b + l' | l'}`` and the ``b`` *inter-node* groups ``{i'*b + l | i'}``. Parents are
    the world, every dim of the DeviceMesh given to ``setup(mesh=...)`` and every
    partition given as ``setup(groups=...)``; ranks of the process groups that qualify
    get sub-groups, created for every parent block in one fixed order (world, then mesh
    dims in order, then ``groups``; per parent its intra blocks, then its inter blocks;
    a rank tuple already created is reused).

Names in graphs
    Each rank registers *its own* intra / inter sub-group of a parent under an alias
    derived from the parent's ranks (``commfuse.intra.<ranks>`` /
    ``commfuse.inter.<ranks>``, see :func:`subgroup_names`). A rewritten graph names
    these aliases, so for a parent that is the same group on every rank (the world)
    the graph is identical on every rank: the cross-rank agreement check compares
    equal signatures, and the reference interpreter runs one graph for all ranks with
    the alias mapped to the partition of all its blocks (:meth:`Session.reference_groups`).
    For a mesh dim whose group differs per rank, the graph names differ per rank exactly
    as the parent's own (DeviceMesh) name already does.

Calling setup again
    Sub-groups created by an earlier ``setup`` in this process are reused (no group is
    created twice) while every one of them this rank belongs to is still alive and the
    default group is the same; otherwise (``destroy_process_group`` on all ranks, a new
    ``init_process_group``) all are created afresh. The aliases are re-registered to the
    groups in use. Destroying sub-groups on only some ranks makes later ``setup`` calls
    disagree about reuse; destroy on all ranks or none.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from commfuse.core.errors import ConfigError
from commfuse.core.ranks import warn_rank0
from commfuse.core.torch_private import register_process_group_alias, resolve_process_group
from commfuse.costmodel.hierarchy import Ranks, SubGroups, hierarchy_layout, mesh_blocks, subgroup_names
from commfuse.costmodel.lagom import plan_communicator_pool, validate_communicator_ctas
from commfuse.costmodel.topology import Topology
from commfuse.ir.collective import ParallelRole

# Mesh dimension names users give (torchtitan conventions) -> parallel role.
MESH_DIM_ROLES = {
    "tp": ParallelRole.TP,
    "sp": ParallelRole.SP,
    "ep": ParallelRole.EP,
    "pp": ParallelRole.PP,
    "dp": ParallelRole.DP,
    "dp_replicate": ParallelRole.DP,
    "ddp": ParallelRole.DP,
    "batch": ParallelRole.DP,
    "dp_shard": ParallelRole.FSDP,
    "fsdp": ParallelRole.FSDP,
    "efsdp": ParallelRole.FSDP,
}


def mesh_dim_roles(mesh: Any) -> list[tuple[str, Any, Optional[ParallelRole]]]:
    """(dim name, its process group, its role or None) for every named dim of a DeviceMesh."""
    out = []
    for name in getattr(mesh, "mesh_dim_names", None) or ():
        try:
            group = mesh.get_group(name)
        except (RuntimeError, ValueError, KeyError):  # a flattened or unmaterialised dim
            continue
        out.append((name, group, MESH_DIM_ROLES.get(name)))
    return out


_WARNED_DIMS: set[str] = set()


def roles_from_meshes(meshes: Iterable[Any]) -> dict[str, str]:
    """Group name -> role for the named dims of the DeviceMeshes the graph's DTensors live on
    (what HF's ``tp_plan``, torchtitan's ``parallelize_*`` and ``parallelize_module`` already
    declare). A dim whose name has no known role gets inferred roles, with one warning per name."""
    roles: dict[str, str] = {}
    for mesh in meshes:
        for name, group, role in mesh_dim_roles(mesh):
            if role is None:
                if name not in _WARNED_DIMS:
                    _WARNED_DIMS.add(name)
                    warn_rank0(
                        f"commfuse: DTensor mesh dim {name!r} has no known role (known: "
                        f"{', '.join(sorted(MESH_DIM_ROLES))}); its collectives get inferred roles",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                continue
            roles[group.group_name] = role.value
    return roles


@dataclass
class Session:
    topology: Optional[Topology] = None
    group_roles: dict[str, str] = field(default_factory=dict)
    role_sources: dict[str, str] = field(default_factory=dict)
    # ranks -> process group, for the topology's intra-node and inter-node sub-groups of the world
    intra_node_groups: dict[Ranks, Any] = field(default_factory=dict)
    inter_node_groups: dict[Ranks, Any] = field(default_factory=dict)
    # parent group ranks -> this rank's sub-groups of it (only parents this rank belongs to)
    subgroups: dict[Ranks, SubGroups] = field(default_factory=dict)
    # alias name -> every block it stands for across ranks (for one SPMD graph on all ranks)
    alias_blocks: dict[str, list[Ranks]] = field(default_factory=dict)
    # Lagom's communicator pool (``setup(communicator_ctas=...)``, NCCL only, docs/lagom.md): the CTA
    # bounds asked for, every pool group in creation order (``costmodel.lagom.PoolGroupPlan``; empty
    # when none was created) and this rank's pool groups by alias
    communicator_ctas: tuple[tuple[int, int], ...] = ()
    communicator_pool_plan: list[Any] = field(default_factory=list)
    communicator_pool: dict[str, Any] = field(default_factory=dict)
    # every partition of the world the job declared (each mesh dim's blocks, then ``groups``)
    partitions: list[list[Ranks]] = field(default_factory=list)

    def subgroups_of(self, parent: Sequence[int]) -> Optional[SubGroups]:
        return self.subgroups.get(tuple(parent))

    def fingerprint(self, *, rank_invariant: bool = False) -> str:
        """What compiled graphs depend on in this session: the roles it declared, the sub-group
        aliases and the blocks they stand for, the communicator pool plan (not this rank's own
        sub-groups, which differ per rank under one alias). ``rank_invariant``: the roles without
        the process groups' names, which differ between ranks (each rank names only the mesh
        groups it belongs to), for what ranks compare with each other."""
        roles = sorted(self.group_roles.values()) if rank_invariant else sorted(self.group_roles.items())
        payload = {
            "roles": roles,
            "aliases": sorted(
                (name, [list(b) for b in blocks]) for name, blocks in self.alias_blocks.items()
            ),
            "pool": [repr(p) for p in self.communicator_pool_plan],
            "partitions": [[list(b) for b in part] for part in self.partitions],
        }
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    def reference_groups(self) -> dict[str, list[list[int]]]:
        """Alias -> partition, for :class:`commfuse.reference.GroupTable` (add the graph's own names)."""
        return {name: [list(b) for b in blocks] for name, blocks in self.alias_blocks.items()}


_SESSION = Session()

# Sub-groups this process created, by rank tuple (value: the group, or the non-member
# sentinel), and the default group they were created under: what a later setup reuses.
_CREATED: dict[Ranks, Any] = {}
_CREATED_UNDER: list[Any] = [None]
# Communicator-pool groups this process created, by (ranks, min_ctas, max_ctas), and their default group.
_POOL_CREATED: dict[tuple[Ranks, int, int], Any] = {}
_POOL_UNDER: list[Any] = [None]


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


# Registering this rank's sub-group under an alias is what makes one graph valid on every
# rank (module docstring); the registry is private c10d API, wrapped in core/torch_private.py.
def _register_alias(name: str, pg: Any) -> None:
    register_process_group_alias(name, pg)


# --------------------------------------------------------------------------- creation
def mesh_partitions(mesh: Any) -> list[list[Ranks]]:
    """Each dim's blocks of a DeviceMesh (global ranks in group-rank order): what every rank knows."""
    t = mesh.mesh
    return [
        [tuple(int(r) for r in b) for b in t.transpose(d, -1).reshape(-1, t.shape[d]).tolist()]
        for d in range(t.ndim)
    ]


def _partitions(mesh: Any, groups: Any) -> list[list[Ranks]]:
    """Parent partitions besides the world: each mesh dim's blocks, then ``groups``."""
    out: list[list[Ranks]] = []
    if mesh is not None:
        out.extend(mesh_partitions(mesh))
    if groups is not None:
        try:
            parts = [[tuple(int(r) for r in block) for block in part] for part in groups]
        except (TypeError, ValueError) as e:
            raise ConfigError(
                "groups: expected a list of partitions, each a list of rank lists, "
                f"e.g. [[[0, 2], [1, 3]]]; got {groups!r}"
            ) from e
        out.extend(parts)
    return out


def _qualifying_parents(topo: Topology, partitions: list[list[Ranks]]) -> list[tuple[Ranks, int, int, int]]:
    """(parent, a, b, partition index) for every block with a hierarchy, in creation order."""
    seen: set[Ranks] = set()
    out = []
    for k, part in enumerate(partitions):
        for parent in part:
            if parent in seen:
                continue
            seen.add(parent)
            lay = hierarchy_layout(parent, topo)
            if not isinstance(lay, str):
                out.append((parent, lay[0], lay[1], k))
    return out


def _reusable(world: Any) -> bool:
    import torch.distributed as dist

    if _CREATED_UNDER[0] is not world:
        return False
    return all(
        resolve_process_group(pg.group_name) is pg
        for pg in _CREATED.values()
        if isinstance(pg, dist.ProcessGroup)
    )


def _get_or_create(ranks: Ranks) -> Any:
    import torch.distributed as dist

    if ranks not in _CREATED:
        _CREATED[ranks] = dist.new_group(list(ranks))
    return _CREATED[ranks]


def _create_subgroups(session: Session, topo: Topology, partitions: list[list[Ranks]]) -> None:
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _reusable(world):
        _CREATED.clear()
        _CREATED_UNDER[0] = world
    me = dist.get_rank()
    parents = _qualifying_parents(topo, partitions)
    blocks_of: dict[Ranks, tuple[list[Ranks], list[Ranks]]] = {}
    # Every rank creates every block of every parent, in this order: new_group is collective.
    for parent, a, b, _ in parents:
        intra, inter = mesh_blocks(parent, a, b)
        blocks_of[parent] = (intra, inter)
        for ranks in intra + inter:
            _get_or_create(ranks)
    world_ranks = tuple(range(topo.world_size))
    if world_ranks in blocks_of:
        session.intra_node_groups = {r: _CREATED[r] for r in blocks_of[world_ranks][0]}
        session.inter_node_groups = {r: _CREATED[r] for r in blocks_of[world_ranks][1]}
    for parent, a, b, k in parents:
        intra_name, inter_name = subgroup_names(parent)
        # the alias stands for these blocks on every rank running a graph traced on another
        # rank: the sub-groups of every parent of the same partition
        same_part = [p for p, *_, kk in parents if kk == k]
        session.alias_blocks[intra_name] = [r for p in same_part for r in blocks_of[p][0]]
        session.alias_blocks[inter_name] = [r for p in same_part for r in blocks_of[p][1]]
        if me not in parent:
            continue
        intra = next(r for r in blocks_of[parent][0] if me in r)
        inter = next(r for r in blocks_of[parent][1] if me in r)
        sg = SubGroups(parent, a, b, intra, inter, intra_name, inter_name, _CREATED[intra], _CREATED[inter])
        _register_alias(intra_name, sg.intra_pg)
        _register_alias(inter_name, sg.inter_pg)
        session.subgroups[parent] = sg


def communicator_pool_plan(
    world_size: int, communicator_ctas: Any, *, mesh: Any = None, groups: Any = None
) -> list[Any]:
    """The pool groups ``setup(communicator_ctas=...)`` creates on NCCL, in creation order: for the
    world, then every block of each mesh dim, then of ``groups`` (a rank tuple once; single ranks
    skipped), one group per CTA pair in the order given. Pure: nothing is created."""

    ctas = validate_communicator_ctas(communicator_ctas)
    parents = [tuple(range(world_size))] + [b for part in _partitions(mesh, groups) for b in part]
    for block in parents:
        if any(r < 0 or r >= world_size for r in block):
            raise ConfigError(f"groups: block {list(block)} has ranks outside the world of {world_size}")
    return plan_communicator_pool(parents, ctas)


def _create_communicator_pool(session: Session, plan: list[Any]) -> None:
    """Lagom's pool (docs/lagom.md): the planned NCCL groups, created on every rank in the plan's
    order (new_group is collective), each rank registering the aliases of the groups it belongs to."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if "nccl" not in backend or not hasattr(dist, "ProcessGroupNCCL"):
        warn_rank0(
            f"commfuse.setup: communicator_ctas is ignored on backend {backend!r}: CTA bounds are a "
            "per-communicator NCCL setting (gloo has no such knobs); no pool groups were created",
            UserWarning,
        )
        return
    world = dist.group.WORLD
    if _POOL_UNDER[0] is not world or not all(
        resolve_process_group(pg.group_name) is pg
        for pg in _POOL_CREATED.values()
        if isinstance(pg, dist.ProcessGroup)
    ):
        _POOL_CREATED.clear()
        _POOL_UNDER[0] = world
    me = dist.get_rank()
    for p in plan:
        key = (p.ranks, p.min_ctas, p.max_ctas)
        if key not in _POOL_CREATED:
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.min_ctas = p.min_ctas
            opts.config.max_ctas = p.max_ctas
            _POOL_CREATED[key] = dist.new_group(list(p.ranks), backend="nccl", pg_options=opts)
        session.alias_blocks[p.alias] = [p.ranks]
        if me in p.ranks:
            _register_alias(p.alias, _POOL_CREATED[key])
            session.communicator_pool[p.alias] = _POOL_CREATED[key]
    session.communicator_pool_plan = plan


def setup(
    *,
    topology: Union[Topology, str, Path, dict, None] = None,
    mesh: Any = None,
    create_subgroups: bool = True,
    groups: Optional[Sequence[Sequence[Sequence[int]]]] = None,
    communicator_ctas: Optional[Sequence[Sequence[int]]] = None,
) -> Session:
    """Declare the job to commfuse. Call on every rank, after `init_process_group`.

    topology: a `Topology`, a preset name ("dgx-h100"), a JSON file path, or a dict.
        Checked against the world size. For the world and for every group named by
        ``mesh`` or ``groups`` that spans nodes with the same number (>= 2) of ranks on
        each, the intra-node and inter-node sub-groups are created (on every rank, in
        one fixed order; see the module docstring) unless `create_subgroups=False`.
    mesh: a `DeviceMesh` with `mesh_dim_names`; its groups get the roles the names
        say (tp, sp, ep, pp, dp, dp_replicate, dp_shard, fsdp), and each dim's groups
        are parents for sub-groups.
    groups: further partitions of the world into groups collectives run on, each a list
        of rank lists (e.g. ``[[[0, 2, 4, 6], [1, 3, 5, 7]]]``); the same on every rank.
    communicator_ctas: Lagom's communicator pool, ``[(min_ctas, max_ctas), ...]``: on NCCL, for
        the world and every group of ``mesh`` / ``groups``, one extra process group per pair with
        ``ProcessGroupNCCL.Options().config.min_ctas/max_ctas`` set, registered as
        ``commfuse.cta<min>-<max>.<ranks>`` for the ``lagom_tune`` pass to choose from (each
        costs NCCL buffer memory: docs/lagom.md). Ignored with a warning on other backends.
    Returns the session; calling again replaces it (and reuses live sub-groups).
    """
    global _SESSION
    import torch.distributed as dist

    topo = _as_topology(topology)
    session = Session(topology=topo)

    session.communicator_ctas = validate_communicator_ctas(communicator_ctas)
    names = None
    if mesh is not None:
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ConfigError("mesh: commfuse.setup needs a DeviceMesh with mesh_dim_names to assign roles")
    partitions = _partitions(mesh, groups)
    session.partitions = [list(part) for part in partitions]
    if topo is not None and dist.is_available() and dist.is_initialized():
        topo.check_world_size(dist.get_world_size())
        for part in partitions:
            for block in part:
                if any(r < 0 or r >= topo.world_size for r in block):
                    raise ConfigError(
                        f"groups: block {list(block)} has ranks outside the world of {topo.world_size}"
                    )
        if create_subgroups and topo.num_nodes > 1 and topo.ranks_per_node > 1:
            _create_subgroups(session, topo, [[tuple(range(topo.world_size))]] + partitions)
    if session.communicator_ctas:
        if dist.is_available() and dist.is_initialized():
            _create_communicator_pool(
                session,
                communicator_pool_plan(
                    dist.get_world_size(), session.communicator_ctas, mesh=mesh, groups=groups
                ),
            )
        else:
            warnings.warn(
                "commfuse.setup: communicator_ctas is ignored: no process group is initialized "
                "(call init_process_group first); no pool groups were created",
                stacklevel=2,
            )
    if mesh is not None:
        for name, group, role in mesh_dim_roles(mesh):
            if role is None:
                warn_rank0(
                    f"commfuse.setup: mesh dim {name!r} has no known role; its collectives get inferred roles",
                    UserWarning,
                )
                continue
            session.group_roles[group.group_name] = role.value
            session.role_sources[group.group_name] = "mesh"
            sg = session.subgroups.get(tuple(dist.get_process_group_ranks(group)))
            if sg is not None:  # the hierarchical pieces of a dim's collective keep its role
                for alias in (sg.intra_name, sg.inter_name):
                    session.group_roles[alias] = role.value
                    session.role_sources[alias] = "mesh"
    _SESSION = session
    return session


def reset() -> None:
    """Forget the session (tests). Sub-groups stay alive and are reused by the next setup."""
    global _SESSION
    _SESSION = Session()


def resolved_roles(
    config, dtensor_roles: Optional[dict[str, str]] = None
) -> tuple[dict[str, str], dict[str, str]]:
    """Group roles and their sources: those of the graph's DTensor meshes (``dtensor_roles``),
    overridden by the session's (``setup(mesh=)``), overridden by `config.group_roles` (user)."""
    found = dtensor_roles or {}
    roles = {**found, **_SESSION.group_roles, **{k: v.value for k, v in config.group_roles.items()}}
    sources = {
        **{k: "dtensor" for k in found},
        **_SESSION.role_sources,
        **{k: "user" for k in config.group_roles},
    }
    return roles, sources


# Topologies detected in this process, by (world size, local world size, device name).
_DETECTED: dict[Any, Optional[Topology]] = {}
# The topology of the machine the job runs on, given by its launcher (a preset name, a JSON file
# or a JSON object); read before anything is detected.
TOPOLOGY_ENV = "COMMFUSE_TOPOLOGY"


def _env_int(environ: dict, name: str) -> Optional[int]:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 1:
        raise ConfigError(f"environment variable {name}={raw!r} must be at least 1")
    return value


def detected_topology(
    environ: Optional[dict] = None, world_size: Optional[int] = None, device_name: Optional[str] = None
) -> Optional[Topology]:
    """``COMMFUSE_TOPOLOGY``'s topology where the launcher gave one; else `Topology.detect` from
    what torchrun gives every rank alike: ``LOCAL_WORLD_SIZE``, the world
    size (the default process group's, else ``WORLD_SIZE``) and the device name (CUDA device 0's,
    else "cpu"). None outside torchrun (no ``LOCAL_WORLD_SIZE``) or without a world size. A device
    that matches no preset gets the generic default (`Topology` field defaults; docs/costmodel.md)
    with one warning. A malformed variable, or a local world size that does not divide the world,
    raises ConfigError naming it."""
    import os

    import torch
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    given = env.get(TOPOLOGY_ENV, "").strip()
    if given:
        # what the launcher knows of the machine (commfuse emulate sets it): a preset name, a
        # JSON file or a JSON object
        if given not in _DETECTED:
            try:
                _DETECTED[given] = _as_topology(json.loads(given) if given.startswith("{") else given)
            except (ValueError, ConfigError) as e:
                raise ConfigError(f"environment variable {TOPOLOGY_ENV}: {e}") from None
        return _DETECTED[given]
    local = _env_int(env, "LOCAL_WORLD_SIZE")
    if world_size is None:
        world_size = (
            dist.get_world_size()
            if dist.is_available() and dist.is_initialized()
            else _env_int(env, "WORLD_SIZE")
        )
    if local is None or world_size is None:
        return None
    if device_name is None:
        device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    key = (world_size, local, device_name)
    if key in _DETECTED:
        return _DETECTED[key]
    if local > world_size or world_size % local:
        raise ConfigError(
            f"environment variable LOCAL_WORLD_SIZE={local} does not divide the world size "
            f"{world_size} (nodes must hold the same number of ranks)"
        )
    if Topology.preset_for_device(device_name) is not None:
        topo = Topology.detect(world_size, local, device_name)
    else:
        # every rank detects from the same torchrun environment (and, in a job of one kind of
        # node, the same device): one copy
        warn_rank0(
            f"commfuse: no topology preset for device {device_name!r}: using the generic default "
            f"({world_size // local} node(s) of {local} ranks, nominal links; see docs/costmodel.md). "
            "Pass Config(topology=...) or setup(topology=...) for decisions that fit this machine",
            RuntimeWarning,
            stacklevel=2,
        )
        topo = Topology(
            name="generic", num_nodes=world_size // local, ranks_per_node=local, device=device_name
        )
    _DETECTED[key] = topo
    return topo


def resolved_topology(config) -> tuple[Optional[Topology], Optional[str]]:
    """The topology a pipeline uses and where it came from: `Config.topology`, else `setup()`'s,
    else the one detected from the torchrun environment. A topology whose rank count contradicts
    the process group's world size raises ConfigError."""
    import torch.distributed as dist

    if config.topology is not None:
        topo, source = config.topology, "config"
    elif _SESSION.topology is not None:
        topo, source = _SESSION.topology, "setup"
    else:
        topo, source = detected_topology(), "detected"
    if topo is None:
        return None, None
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake":
        topo.check_world_size(dist.get_world_size())
    return topo, source
