"""Which passes the fuzzer checks, and with what knowledge.

Every pass in :func:`commfuse.transforms.registry.available_passes` is fuzzed alone (and the
default pipeline as a whole): the product passes and, registered when this module is imported,
the forced variants (:mod:`commfuse.fuzz.forced`), which only the fuzzer and the tests run. A
pass class declares how with its class attribute ``fuzz``
(:class:`commfuse.passmgr.base.FuzzSpec`: families, joint only, topology, exact or tolerance
compare, world sizes, order contract, micro-batches), or why the fuzzer cannot check it
(``FuzzSpec(not_fuzzed=...)``); this module reads the specs from the registry table. A pass
written elsewhere (tests, users) without a spec is registered here with
:func:`register_fuzz_target`. tests/test_fuzz.py fails when a pass has neither, so a new pass
cannot land without its author deciding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

from commfuse.costmodel.topology import Topology
from commfuse.fuzz.forced import register_forced_passes
from commfuse.fuzz.generator import FAMILIES, FAMILY_WEIGHTS, generate_program
from commfuse.fuzz.program import Program
from commfuse.passmgr.base import FuzzSpec
from commfuse.transforms.registry import available_passes

# Every way into the fuzzer imports this module (the CLI, run_campaign, the workers run_parallel
# spawns, replaying a saved regression), so the forced variants are targets wherever it runs.
register_forced_passes()


@dataclass(frozen=True)
class FuzzTarget:
    pass_name: str
    generators: Optional[tuple[str, ...]] = None  # None: every family
    needs_joint: bool = False
    topology: Optional[Topology] = None
    exact: bool = False
    world_sizes: Optional[tuple[int, ...]] = None
    keeps_collective_order: bool = False
    # compare each output normalised by its magnitude (max(1, max|expected|)), and accept a float32
    # difference the float64 re-run shows to be rounding alone (check._rounding_only): for passes
    # that regroup sums over many ranks, whose rounding grows with the summands' magnitude
    scaled_tolerance: bool = False
    registered: bool = True  # False: the defaults used for a pass with no registration
    microbatches: bool = False  # joint programs run as 2-3 tagged micro-batches (a fused train-step graph)

    def accepts(self, program) -> bool:
        """Whether ``program`` (a :class:`~commfuse.fuzz.program.Program`) is one to fuzz this pass on."""
        if self.generators is not None and program.family not in self.generators:
            return False
        if self.needs_joint and not program.joint:
            return False
        if self.microbatches and program.microbatches < 2:
            return False
        sizes = self.world_sizes or ((self.topology.world_size,) if self.topology else None)
        return sizes is None or program.world_size in sizes


_TARGETS: dict[str, FuzzTarget] = {}  # passes registered here (not built in)

# pass name -> why the fuzzer does not (fully) cover it, for passes registered here. Keep each note
# specific: what the fuzzer cannot generate or check, and what covers the pass instead.
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
    scaled_tolerance: bool = False,
    microbatches: bool = False,
) -> FuzzTarget:
    """Tell the fuzzer how to fuzz ``pass_name``, a pass registered outside the built-in table
    (built-in passes declare ``fuzz = FuzzSpec(...)``; see docs/contributing.md)."""
    t = _target(
        pass_name,
        generators=generators,
        needs_joint=needs_joint,
        topology=topology,
        exact=exact,
        world_sizes=world_sizes,
        keeps_collective_order=keeps_collective_order,
        scaled_tolerance=scaled_tolerance,
        microbatches=microbatches,
    )
    _TARGETS[pass_name] = t
    return t


def _target(
    pass_name: str,
    *,
    generators,
    needs_joint,
    topology,
    exact,
    world_sizes,
    keeps_collective_order,
    scaled_tolerance,
    microbatches,
) -> FuzzTarget:
    if generators is not None:
        unknown = [g for g in generators if g not in FAMILIES]
        if unknown:
            raise ValueError(
                f"register_fuzz_target({pass_name!r}): unknown generators {unknown}; "
                f"known: {sorted(FAMILIES)}"
            )
    if topology is not None and world_sizes is not None and topology.world_size not in world_sizes:
        raise ValueError(
            f"register_fuzz_target({pass_name!r}): topology has {topology.world_size} ranks, "
            f"not in world_sizes {list(world_sizes)}"
        )
    t = FuzzTarget(
        pass_name,
        tuple(generators) if generators is not None else None,
        needs_joint or microbatches,
        topology,
        exact,
        tuple(world_sizes) if world_sizes is not None else None,
        keeps_collective_order,
        scaled_tolerance=scaled_tolerance,
        microbatches=microbatches,
    )
    return t


def _declared(pass_name: str) -> Optional[FuzzSpec]:
    cls = available_passes().get(pass_name)
    return getattr(cls, "fuzz", None) if cls is not None else None


def unregister_fuzz_target(pass_name: str) -> None:
    _TARGETS.pop(pass_name, None)


_FROM_SPEC: dict[tuple[str, FuzzSpec], FuzzTarget] = {}


def fuzz_target(pass_name: str) -> FuzzTarget:
    """How to fuzz ``pass_name``: its registration here, its declared :class:`FuzzSpec`, or the
    defaults (every family, tolerance compare)."""
    if pass_name in _TARGETS:
        return _TARGETS[pass_name]
    spec = _declared(pass_name)
    if spec is None or spec.not_fuzzed is not None:
        return FuzzTarget(pass_name, registered=False)
    if (pass_name, spec) not in _FROM_SPEC:
        _FROM_SPEC[pass_name, spec] = _target(
            pass_name,
            generators=spec.generators,
            needs_joint=spec.needs_joint,
            topology=spec.topology,
            exact=spec.exact,
            world_sizes=spec.world_sizes,
            keeps_collective_order=spec.keeps_collective_order,
            scaled_tolerance=spec.scaled_tolerance,
            microbatches=spec.microbatches,
        )
    return _FROM_SPEC[pass_name, spec]


def fuzz_notes() -> dict[str, str]:
    """Pass name -> why the fuzzer does not cover it (declared ``not_fuzzed``, or noted here)."""
    specs = {name: _declared(name) for name in available_passes()}
    notes = {
        name: spec.not_fuzzed
        for name, spec in specs.items()
        if spec is not None and spec.not_fuzzed is not None
    }
    return {**notes, **FUZZ_NOTES}


def registered_targets() -> dict[str, FuzzTarget]:
    """Every pass the fuzzer checks with a declared or registered target."""
    declared = {
        name: fuzz_target(name)
        for name in available_passes()
        if (spec := _declared(name)) is not None and spec.not_fuzzed is None
    }
    return {**declared, **_TARGETS}


def passes_missing_fuzz_entry() -> list[str]:
    """Passes with neither a fuzz spec, a registration here, nor a note."""
    return sorted(
        p for p in available_passes() if p not in _TARGETS and _declared(p) is None and p not in FUZZ_NOTES
    )


# program_for: programs 9, 29, 49, ... of a campaign (index % 20 == 9) are group_pairs programs
GROUP_PAIRS_SLOT = (20, 9)


def program_for(
    seed: int,
    index: int,
    pipelines: Sequence = (),
    features: Sequence[str] = (),
    family: Optional[str] = None,
) -> Program:
    """Program ``index`` of a campaign with ``seed``.

    Every fourth program is generated for a pass registered with constraints (families,
    world sizes, topology, joint only), round-robin, so such passes are exercised too; every
    40th for a pass fuzzed on micro-batched joint programs (``FuzzTarget.microbatches``);
    programs ``20k + 9`` are ``group_pairs`` programs (adjacent collectives on aliased,
    reordered and mesh-dim groups; not in the ordinary family mix).
    ``family``: every program from that family (a campaign aimed at one family)."""
    rng = random.Random(f"{seed}:{index}")
    if family is not None:
        return generate_program(rng, family=family, features=features)
    constrained, batched = [], []
    for pipe in pipelines:
        for name in pipe.passes or ():
            t = fuzz_target(name)
            if t.microbatches:
                batched.append(t)
            elif t.generators or t.needs_joint or t.world_sizes or t.topology:
                constrained.append(t)
    # Micro-batched joint programs (fused train-step graphs) in a slot of their own, so adding
    # such a target leaves every other program of a campaign as it was.
    if batched and index % 40 == 39:
        return _program_for_target(rng, batched[(index // 40) % len(batched)], features)
    if constrained and index % 4 == 3:
        return _program_for_target(rng, constrained[(index // 4) % len(constrained)], features)
    # group_pairs in a slot of its own (1 in 20 programs, none of the slots above), so every other
    # program of a campaign is the same whether or not the family is drawn
    if index % GROUP_PAIRS_SLOT[0] == GROUP_PAIRS_SLOT[1]:
        return generate_program(rng, family="group_pairs", features=features)
    return generate_program(rng, features=features)


def _program_for_target(rng: random.Random, t, features: Sequence[str]) -> Program:
    sizes = t.world_sizes or ((t.topology.world_size,) if t.topology else None)
    # families of the ordinary mix only (group_pairs has its own slot): a target that also names
    # group_pairs draws the same programs as one that does not
    fams = ([g for g in t.generators if g in FAMILY_WEIGHTS] or list(t.generators)) if t.generators else None
    prog = generate_program(
        rng,
        family=rng.choice(fams) if fams else None,
        world_size=rng.choice(sizes) if sizes else None,
        joint=True if t.needs_joint else None,
        features=features,
    )
    if t.microbatches:
        prog.microbatches = 2 + prog.seed % 2  # derived: no extra draw from the stream
    return prog
