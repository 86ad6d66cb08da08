"""Which passes the fuzzer checks, and with what knowledge.

Every pass in :func:`commfuse.passes.available_passes` is fuzzed alone (and the
default pipeline as a whole). A pass that needs more than the defaults says so here
with :func:`register_fuzz_target`:

* ``generators``: the program families that exercise it (see
  :data:`commfuse.fuzz.generator.FAMILIES`); ``None``: all families;
* ``needs_joint``: only joint (forward + backward) graphs make sense for it;
* ``topology``: the ``Config.topology`` to fuzz it under (programs then use its world size);
* ``exact``: the pass never changes a value, so results must be bitwise equal
  (otherwise the tolerance policy of :func:`commfuse.reference.numerics.tolerances`);
* ``keeps_collective_order``: the pass promises not to add, remove or reorder
  collectives: the verifier's per-group sequence hashes and total-order hash must be
  unchanged;
* ``world_sizes``: the world sizes to generate (default: 2, 4, 8);
* ``scaled_tolerance``: compare outputs normalised by their magnitude (see FuzzTarget);
* ``microbatches``: fuzz on joint programs run as 2-3 tagged micro-batches (``Program.microbatches``:
  the fused train-step graph shape ``Config(dhelix=True)`` builds).

A pass that cannot be fuzzed meaningfully (or only partly) gets a reasoned note in
:data:`FUZZ_NOTES` instead. tests/test_fuzz.py fails when a registered pass has
neither, so a new pass cannot land without its author deciding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

from commfuse.costmodel.topology import PRESETS, Topology
from commfuse.fuzz.generator import FAMILIES, generate_program
from commfuse.fuzz.program import Program
from commfuse.transforms.registry import available_passes


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
    scaled_tolerance: bool = False,
    microbatches: bool = False,
) -> FuzzTarget:
    """Tell the fuzzer how to fuzz ``pass_name`` (call at import of this module; see docs/contributing.md)."""
    if generators is not None:

        unknown = [g for g in generators if g not in FAMILIES]
        if unknown:
            raise ValueError(f"register_fuzz_target({pass_name!r}): unknown generators {unknown}; "
                             f"known: {sorted(FAMILIES)}")
    if topology is not None and world_sizes is not None and topology.world_size not in world_sizes:
        raise ValueError(f"register_fuzz_target({pass_name!r}): topology has {topology.world_size} ranks, "
                         f"not in world_sizes {list(world_sizes)}")
    t = FuzzTarget(pass_name, tuple(generators) if generators is not None else None, needs_joint or microbatches,
                   topology, exact, tuple(world_sizes) if world_sizes is not None else None, keeps_collective_order,
                   scaled_tolerance=scaled_tolerance, microbatches=microbatches)
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

    return sorted(p for p in available_passes() if p not in _TARGETS and p not in FUZZ_NOTES)


def program_for(seed: int, index: int, pipelines: Sequence = (), features: Sequence[str] = (),
                family: Optional[str] = None) -> Program:
    """Program ``index`` of a campaign with ``seed``.

    Every fourth program is generated for a pass registered with constraints (families,
    world sizes, topology, joint only), round-robin, so such passes are exercised too; every
    40th for a pass fuzzed on micro-batched joint programs (``FuzzTarget.microbatches``).
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
    return generate_program(rng, features=features)


def _program_for_target(rng: random.Random, t, features: Sequence[str]) -> Program:
    sizes = t.world_sizes or ((t.topology.world_size,) if t.topology else None)
    prog = generate_program(rng, family=rng.choice(t.generators) if t.generators else None,
                            world_size=rng.choice(sizes) if sizes else None,
                            joint=True if t.needs_joint else None, features=features)
    if t.microbatches:
        prog.microbatches = 2 + prog.seed % 2  # derived: no extra draw from the stream
    return prog


# ---------------------------------------------------------------------------
# Registrations of commfuse's passes
# ---------------------------------------------------------------------------

# sink_waits only moves waits: every value bitwise identical and the collective sequence
# untouched (its contract), on every family.
register_fuzz_target("sink_waits", exact=True, keeps_collective_order=True)

# Bucketing merges same-kind collectives into one on a flat buffer: the interpreter reduces
# every element over the same ranks in the same order whatever buffer it sits in, so values
# are bitwise equal; the collective sequence changes (fewer, larger collectives). Every family:
# gathers, scatters and all_reduces appear in all of them, next to the kinds it must leave alone.
register_fuzz_target("bucket_collectives", exact=True)

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

# Centauri primitive substitution (Table 2). Under the standalone cost model the substitutes
# are predicted slower (same bytes, more launches), so `primitive_substitution` fuzzes its
# refusal path on the 2 nodes x 2 ranks CPU topology; `primitive_substitution_forced` (same
# code, cost model not asked) applies every feasible form (rs_ag, rooted broadcasts, rooted
# reduces) on every family and world size. The reference reduces in canonical order and the
# rooted reduces' -0.0 adds are exact, so both must be bitwise equal.
register_fuzz_target("primitive_substitution", topology=Topology.preset("cpu-gloo", num_nodes=2), exact=True)
register_fuzz_target("primitive_substitution_forced", exact=True)

# Centauri group partition: 2 nodes x 4 ranks, the world and the strided groups of 4 (2 ranks
# on each node) get sub-groups (check.py sets them up as `commfuse.setup` does); latency-bound
# links with a cheap launch so the hierarchical sequences pay on the fuzzer's small tensors.
# Sums are regrouped (intra-node first, then across nodes): tolerance compare, scaled by each
# output's magnitude, since the generated programs reach values of 10^2-10^3 where the plain
# policy (O(1) values) flags rounding (seed 20240: 7 of 116 rewritten programs; each one equal
# to the flat program to 1e-14 when run in float64, its own error against that no larger).
# Families with top-k routers are left out: a regrouped bf16 sum before a router flips routing
# decisions (outputs differ by O(1) although equal in float64); the families kept exercise every
# kind the pass rewrites, on the world and on strided groups.
register_fuzz_target("group_partition", generators=("tp", "sp", "fsdp", "pp", "coalesced"), world_sizes=(8,),
                     scaled_tolerance=True, topology=Topology(
    name="fuzz-2x4", num_nodes=2, ranks_per_node=4, intra_node_bandwidth_GBps=100.0, inter_node_bandwidth_GBps=1.0,
    intra_node_latency_us=1.0, inter_node_latency_us=5.0, collective_launch_us=0.1))

# Workload partition chunks a collective together with the matmul / element-wise chain that
# reads its result or computes its input, in the families that put matmul chains after gathers
# (tp_mlp, sp_block, fsdp_linear) and before all_reduces / reduce_scatters. A chain cut along a
# contraction dim adds partial sums, and a matmul on a chunk of rows takes another kernel path
# than on all rows: tolerance compare, scaled by each output's magnitude (seed 1: 1 of 188
# rewritten programs flagged with values ~10^2; equal to the unchunked program to 1e-14 in float64).
register_fuzz_target("workload_partition", generators=("tp", "sp", "fsdp", "mixed"), scaled_tolerance=True)

# The partition search composes the three above (workload -> primitive -> group per leaf) and keeps
# the leaf the simulator prices cheapest, on the group-partition fuzz topology (sub-groups set up
# by check.py): tolerance compare scaled like its building blocks.
register_fuzz_target("centauri_partition", generators=("tp", "sp", "fsdp", "mixed"), world_sizes=(8,),
                     scaled_tolerance=True, topology=fuzz_target("group_partition").topology)

# The overlap scheduler only reorders nodes: values bitwise equal, every family. Its layer level
# (Eq. 1) re-chains collectives inside a backward layer, so the issue order may change where a graph
# has backward nodes (tangent inputs or phase tags); the fuzzer's micro-batched joint programs are
# the first fuzzed graphs with them, so the order contract is not claimed.
register_fuzz_target("schedule_overlap", exact=True)
# Re-chains collectives inside a layer (Eq. 1), so the issue order may change; values may not.
register_fuzz_target("schedule_overlap_layer_forced", exact=True)

# gloo reduce_scatter lowering (all_to_all + local sum): no topology, so CPU inputs are priced
# with the cpu-gloo preset and every sum/avg reduce_scatter is lowered, in every family and world
# size. The local sum adds the chunks in group-rank order in the input dtype, the interpreter's
# canonical order: bitwise equal. The all_to_all replaces the reduce_scatter (hashes change).
register_fuzz_target("gloo_reduce_scatter", exact=True)

# Lagom communicator settings: the pass only writes node.meta (no node added, moved or changed), so
# values must be bitwise equal and the collective sequence untouched. Fuzzed under a GPU topology
# (DGX-H100 figures, 2 nodes x 2 ranks: intra- and inter-node groups) so the search really runs on
# every family's collectives (a CPU topology makes it a no-op).
register_fuzz_target("lagom_tune", exact=True, keeps_collective_order=True, world_sizes=(4,), topology=Topology(
    **{**PRESETS["dgx-h100"], "name": "fuzz-gpu-2x2", "num_nodes": 2, "ranks_per_node": 2}))

# MoE recognition rewrites the Dynamo (torch-level) graph before AOTAutograd (stage
# PRE_AUTOGRAD); the fuzzer generates and checks ATen joint graphs, on which the pass never runs.
FUZZ_NOTES["moe_recognition"] = (
    "runs on the torch-level Dynamo graph before AOTAutograd, and the fuzzer generates ATen joint graphs "
    "where that stage never runs, so a registration would check nothing. Covered instead by "
    "tests/test_moe_recognition.py: randomised layer shapes / top-k / capacity / EP degrees recognised and "
    "compared with eager in one process (test_random_variants_match_eager), both styles on 4 gloo ranks "
    "(outputs and gradients, fp32 and bf16), the TP/SP+EP block after chimera, and every refusal case; "
    "recognition by meaning by randomised independently written layers (GShard einsum, sort-based dropless, "
    "Hugging Face expert loop; test_random_independent_variants_match_eager) and the same three on 4 gloo "
    "ranks. "
    "The op it emits is fuzzed through the moe_layer family (collective_motion, chimera).")

# Boundary fusion rewrites the FORWARD graph of commfuse.pipeline (autograd-level
# commfuse::stage_transfer_autograd between the stage groups of a pipeline layout, every stage traced
# per position), before the joint graph exists; the fuzzer generates ATen graphs of functional
# collectives on its own groups, where the pass finds no pipeline boundary and returns unchanged.
FUZZ_NOTES["boundary_fusion"] = (
    "runs on commfuse.pipeline forward graphs (stage_transfer_autograd between pipeline stage groups, traced per "
    "position), which the fuzzer's ATen programs never contain, so a registration would check nothing. Covered "
    "instead by tests/test_boundary_fusion.py: randomised cases per rule (shapes, gather dims 0-2, views after the "
    "collective, other users of the received shard, residual orders, 1-3 micro-batches, GPipe/1F1B) fused vs "
    "unfused on 4 gloo ranks (test_random_boundary_cases_match_unfused), every workload at 2 and 3 micro-batches "
    "with both schedules, the byte formulas, and every refusal.")

# DHelix interleaving reorders a fused train-step graph (micro-batch and phase tags; the fuzzer's
# micro-batched joint programs): only the order changes, so values are bitwise equal; the two
# strands' collectives interleave, so the issue order changes. tp/sp/fsdp/moe: the families of
# the models it targets.
register_fuzz_target("dhelix_interleave", generators=("tp", "sp", "fsdp", "moe"), exact=True, microbatches=True)
