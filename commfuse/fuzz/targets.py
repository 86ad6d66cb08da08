"""Which passes the fuzzer checks, and with what knowledge.

Every pass in :func:`commfuse.passes.available_passes` is fuzzed alone (and the
default pipeline as a whole). A pass that needs more than the defaults says so here
with :func:`register_fuzz_target`:

* ``generators``: the program families that exercise it (see
  :data:`commfuse.fuzz.generator.FAMILIES`); ``None``: all families;
* ``needs_joint``: only joint (forward + backward) graphs make sense for it;
* ``topology``: the ``Config.topology`` to fuzz it under (programs then use its world size);
* ``exact``: the pass never changes a value, so results must be bitwise equal
  (otherwise the tolerance policy of :func:`commfuse.testing.numerics.tolerances`);
* ``keeps_collective_order``: the pass promises not to add, remove or reorder
  collectives: the verifier's per-group sequence hashes and total-order hash must be
  unchanged;
* ``world_sizes``: the world sizes to generate (default: 2, 4, 8).

A pass that cannot be fuzzed meaningfully (or only partly) gets a reasoned note in
:data:`FUZZ_NOTES` instead. tests/test_fuzz.py fails when a registered pass has
neither, so a new pass cannot land without its author deciding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..costmodel.topology import Topology


@dataclass(frozen=True)
class FuzzTarget:
    pass_name: str
    generators: Optional[tuple[str, ...]] = None  # None: every family
    needs_joint: bool = False
    topology: Optional[Topology] = None
    exact: bool = False
    world_sizes: Optional[tuple[int, ...]] = None
    keeps_collective_order: bool = False
    registered: bool = True  # False: the defaults used for a pass with no registration

    def accepts(self, program) -> bool:
        """Whether ``program`` (a :class:`~commfuse.fuzz.program.Program`) is one to fuzz this pass on."""
        if self.generators is not None and program.family not in self.generators:
            return False
        if self.needs_joint and not program.joint:
            return False
        sizes = self.world_sizes or ((self.topology.world_size,) if self.topology else None)
        return sizes is None or program.world_size in sizes


_TARGETS: dict[str, FuzzTarget] = {}

# pass name -> why the fuzzer does not (fully) cover it. Keep each note specific: what the
# fuzzer cannot generate or check, and what covers the pass instead.
FUZZ_NOTES: dict[str, str] = {}


def register_fuzz_target(
    pass_name: str,
    *,
    generators: Optional[Sequence[str]] = None,
    needs_joint: bool = False,
    topology: Optional[Topology] = None,
    exact: bool = False,
    world_sizes: Optional[Sequence[int]] = None,
    keeps_collective_order: bool = False,
) -> FuzzTarget:
    """Tell the fuzzer how to fuzz ``pass_name`` (call at import of this module; see docs/contributing.md)."""
    if generators is not None:
        from .generator import FAMILIES

        unknown = [g for g in generators if g not in FAMILIES]
        if unknown:
            raise ValueError(f"register_fuzz_target({pass_name!r}): unknown generators {unknown}; "
                             f"known: {sorted(FAMILIES)}")
    if topology is not None and world_sizes is not None and topology.world_size not in world_sizes:
        raise ValueError(f"register_fuzz_target({pass_name!r}): topology has {topology.world_size} ranks, "
                         f"not in world_sizes {list(world_sizes)}")
    t = FuzzTarget(pass_name, tuple(generators) if generators is not None else None, needs_joint, topology, exact,
                   tuple(world_sizes) if world_sizes is not None else None, keeps_collective_order)
    _TARGETS[pass_name] = t
    return t


def unregister_fuzz_target(pass_name: str) -> None:
    _TARGETS.pop(pass_name, None)


def fuzz_target(pass_name: str) -> FuzzTarget:
    """The registration of ``pass_name``, or the defaults (every family, tolerance compare)."""
    return _TARGETS.get(pass_name) or FuzzTarget(pass_name, registered=False)


def registered_targets() -> dict[str, FuzzTarget]:
    return dict(_TARGETS)


def passes_missing_fuzz_entry() -> list[str]:
    """Registered passes with neither a fuzz registration nor a note in FUZZ_NOTES."""
    from ..passes.registry import available_passes

    return sorted(p for p in available_passes() if p not in _TARGETS and p not in FUZZ_NOTES)


# ---------------------------------------------------------------------------
# Registrations of commfuse's passes
# ---------------------------------------------------------------------------

# sink_waits only moves waits: every value bitwise identical and the collective sequence
# untouched (its contract), on every family.
register_fuzz_target("sink_waits", exact=True, keeps_collective_order=True)

# The split reduces exactly the elements the all_reduce did (the interpreter sums ranks
# in the same order), so values are bitwise equal; the collective sequence changes.
register_fuzz_target("split_all_reduce", exact=True)

# Motion changes where sums happen (partial sums reduced across ranks): tolerance compare.
# Fuzzed programs carry no user-given TP role, so only provably replicated operands move
# (the TP-contract path is covered by tests/test_chimera.py on reference and gloo runs).
# moe_layer: gathers in front of commfuse's MoE layer op, which motion moves onto token shards
# (passes/moe_rules.py).
register_fuzz_target("collective_motion", generators=("tp", "sp", "fsdp", "mixed", "moe_layer"))
register_fuzz_target("chimera", generators=("tp", "sp", "moe", "mixed", "moe_layer"))

# Fusion changes where and in which order sums happen (an all_reduce for a reduce_scatter,
# N·x for the sum of N equal copies): tolerance compare. The families that place
# gathers, scatters and all_to_alls next to each other on one group.
register_fuzz_target("fuse_collectives", generators=("sp", "moe", "mixed"))
