"""`commfuse.Config`: every knob of the compiler, validated on construction."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from commfuse._version import __version__
from commfuse.core.errors import ConfigError
from commfuse.costmodel.profile import CostProfile
from commfuse.costmodel.topology import Topology
from commfuse.dhelix.profile import read_oef_profile
from commfuse.ir.collective import ParallelRole
from commfuse.transforms.registry import DEFAULT_PIPELINE, DHELIX_PIPELINE, available_passes

DUMP_DIR_ENV = "COMMFUSE_DUMP_DIR"
# A Config for every compile not given one: a JSON object of Config fields, or the path of a
# file holding one. Set it for every rank (torchrun passes the environment to all of them).
CONFIG_ENV = "COMMFUSE_CONFIG"


class Config(BaseModel):
    """Configuration of one commfuse backend / `optimize` call.

    passes: ordered pass names; None means the default pipeline. Each pass runs on
        the graph stage it declares (joint graph or scheduled fw/bw graphs).
    inner_compiler: "inductor" (default: Inductor generates code) or "eager"
        (the rewritten graph runs op by op; used by multi-rank numeric tests).
    lowering: who issues the collectives of the compiled graphs. "commfuse" (default): commfuse's
        runtime issues each as an asynchronous c10d call on the process group the plan chose
        (a Lagom communicator-pool group when ``lagom_tune`` picked one), waits where the
        schedule put the wait, and feeds ``commfuse.record``; compute runs eagerly or, with
        ``inner_compiler="inductor"``, in regions Inductor compiles (docs/lowering.md).
        "inductor": Inductor compiles the whole graph and emits the collectives itself
        (requires ``inner_compiler="inductor"``; no pool groups, nothing recorded).
    dump_dir: write graphs before/after each changing pass here; falls back to
        the COMMFUSE_DUMP_DIR environment variable. Give every rank the same directory: each
        rank writes under ``<dump_dir>/rank<r>/`` (rank 0 without a process group) and
        ``<dump_dir>/index.json`` lists them all (docs/reports.md, "Dump layout").
    strict: re-raise pass failures instead of falling back to the unchanged graph.
    verify: run the verifier after every changing pass.
    debug: also re-propagate fake tensors in the verifier (slower, stricter).
    topology: ranks/nodes and links; None means the one given to `commfuse.setup`.
    group_roles: process-group name -> parallel role, overriding inference.
    tp_inputs_replicated: on groups whose role is given as TP or SP (by `group_roles` or a
        DeviceMesh through `commfuse.setup`), take the graph's inputs (parameters, tokens,
        tangents) as identical on every rank of the group -- the tensor-parallel contract.
        Collective motion needs it to run a norm with its weight on shards; without it
        only values the graph proves replicated (collective outputs, constants) qualify.
    uniform_batches: every rank of every group holds a local batch of the same shape (fixed-size
        batches, never an uneven last one, no token-budget packing). Off (default): a decision that
        changes which collectives run or their order prices only the sizes every rank shares --
        parameters, collective operands, the config and topology -- and not the compute and
        activations that follow from a data-parallel, FSDP or expert-parallel rank's local batch,
        so ranks whose batches differ decide alike (docs/architecture.md, "Same decision on every
        rank"). On: that compute is priced too (overlap scheduling and bucketing weigh it); ranks
        whose batch shapes then differ may decide differently.
    moe_capacity_regroup: let collective motion run a capacity-limited MoE layer
        (``commfuse.moe``) on token shards that split its token groups: each shard then
        becomes one token group, which changes which tokens are dropped (the numbers equal
        the unoptimised program with ``token_groups = N``). Off: such layers stay on full tokens.
    check_agreement: the cross-rank safety net (``commfuse/agreement.py``; on by default wherever
        more than one real rank runs). At the first execution of each compiled frame every rank
        compares, through the c10d Store and never through a collective, a hash of the collectives
        it is about to issue on each process group with the group's other members. "fallback"
        (default): on a mismatch or a timeout every rank linked to the mismatching group runs the
        program as written (compiled without commfuse's passes, alongside the optimised one),
        with one warning naming the first differing collective. "raise": raise ``AgreementError``
        instead. "off" (or False): no exchange, no second compile.
    agreement_timeout_s: how long a rank waits for the other members of its groups in that
        exchange before it gives up and falls back (so must cover the difference in compile time
        between ranks); a rank that gives up releases every rank waiting with it.
    svg_max_nodes: larger graphs are drawn condensed (compute runs collapsed; Graphviz is slow).
    moe_recognition: when the ``moe_recognition`` pass rewrites a hand-written MoE layer into
        ``commfuse::moe_layer``. "auto": only when the layer's tokens come from tensor/sequence
        parallel computation (a DTensor or a functional collective upstream), where collective
        motion can then drop the gather in front of it; a pure expert-parallel layer is left
        alone because the op's backward re-sends each token with its gradient (2H+1 values
        per routed token instead of 2H). "always": every proven region. "off": none.
    workload_chunks: how many chunks the Centauri workload partition cuts a collective and
        the compute chained to it into. None (default): Centauri's Algorithm 1 picks per
        collective from the cost model (``analysis/chunking.py``; 2 without a topology).
    max_chunks: upper bound on any chunk count commfuse chooses (MAX_CHUNKS of Centauri's
        Algorithm 1); ``workload_chunks`` must not exceed it.
    partition_search_budget: compile-time budget of the Centauri partition search per graph,
        in scored schemes (leaves simulated); when it runs out the remaining collectives keep
        their current scheme. A count, not seconds: a wall-clock budget would let ranks that
        compile at different speeds choose different collectives and hang.
    schedule_max_inflight_bytes: the ``schedule_overlap`` pass issues a collective early only
        while the collectives issued and not yet waited on its process group's stream hold at
        most this many bytes (the larger of input and output, per rank); None = unlimited.
    schedule_memory_budget: the scheduled graph's simulated peak memory may be at most this
        multiple of the input order's (>= 1.0; early issue allocates a gathered buffer sooner).
        1.10 by default: at 1.05 the FFN weight prefetch of a SimpleFSDP layer (+5.1 %) was
        refused (benchmarks/overlap_vs_inductor.py; Inductor's default allows max(1 GiB, 5 %)).
    schedule_memory_headroom_bytes: or at most this many bytes above the input order's peak,
        whichever allows more (None: the ratio alone; Inductor's overlap scheduler allows
        max(1 GiB, 5%)).
    schedule_cpsat_max_nodes: windows of at most this many nodes of the greedy order are
        re-solved exactly with OR-Tools CP-SAT (0 disables CP-SAT).
    schedule_cpsat_time_limit_s: CP-SAT's budget per graph, spent window by window, in
        *deterministic* seconds (the solver's work counter, single worker, fixed seed): the
        same answer on every rank however fast it compiles.
    schedule_layer_level: in backward graphs, ``schedule_overlap`` also tries Centauri's
        layer-level order (Eq. 1: per layer, activation- or weight-gradient first, with the
        collectives' issue order that goes with it) and keeps it when the simulator prefers it.
    schedule_model_level: in graphs of ``compile_train_step`` with several micro-batches,
        ``schedule_overlap`` also tries Centauri's model-level order (Eq. 2: micro-batches run
        layer by layer in groups of L) and keeps it when the simulator prefers it.
    model_level_memory_bytes: M of Eq. 2, the memory free for the activations of micro-batches
        launched together (None: no limit).
    model_level_brute_force: also schedule and simulate every micro-batch group size and record
        them next to Eq. 2's pick (the check of Eq. 2; costs one scheduling run per size).
    bucket_cap_bytes: largest message (nccl-tests size: all_gather output, reduce_scatter
        input, all_reduce buffer) the ``bucket_collectives`` pass builds; None: from the cost
        model (the size at which latency is 10% of the collective's time, docs/bucketing.md).
    bucket_max_memory_increase: how much ``bucket_collectives`` may raise a graph's simulated
        peak memory, as a fraction of it (0.05 = 5%).
    dhelix: DHelix strand interleaving in ``compile_train_step`` (docs/dhelix.md): the joint graph of
        a step with >= 2 micro-batches is partitioned so that ONE graph runs every forward and
        backward (``dhelix.fused_partition``), and the default pipeline schedules it with
        ``dhelix_interleave`` (one micro-batch's backward beside the next one's forward) instead of
        ``schedule_overlap``, ``bucket_collectives`` and ``sink_waits``. Needs
        ``inner_compiler="eager"`` (Inductor partitions the joint graph itself).
    dhelix_oef_profile: path of an overlap profile (``python -m commfuse profile-overlap``) every rank
        reads for the pairing DP; None: the illustrative default factors. Read and checked here.
    cost_profile: path of a cost profile (``python -m commfuse calibrate``) every rank reads: the
        passes price their candidates with the profile's fitted collective and compute models
        instead of the topology's nominal figures (on the topology in use, or the profile's own
        when there is none). Read and checked here; the compile cache keys on its content.
        ``COMMFUSE_CONFIG='{"cost_profile": "profile.json"}'`` sets it without code.
    step_time_gate: keep a pass's rewrite only when the cost model predicts the graph is not slower
        with it (per pass; Chimera's steps as one decision); the verdict and both predictions are in the
        pass's reported decisions, a reverted rewrite also in its refusals (docs/costmodel.md,
        "The step-time gate"). None (default): on for the default pipeline, off when ``passes``
        lists the passes to run (a list states the rewrites wanted, e.g. to inspect one pass).
        False: every rewrite a pass makes by its own criteria is kept.
    lagom_max_evaluations: budget of the ``lagom_tune`` pass's search per graph, in simulator
        evaluations (>= 2); when it runs out, collectives the search has not reached stay on NCCL's
        defaults. A count, not seconds, so every rank stops at the same point (docs/lagom.md).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    if not TYPE_CHECKING:  # type checkers keep the typed __init__ pydantic's plugin derives from the fields

        def __init__(self, **fields: Any) -> None:
            """A bad value is a :class:`ConfigError` naming the field (``Config.passes: ...``),
            as every invalid option of commfuse is, not pydantic's ValidationError."""
            try:
                super().__init__(**fields)
            except ValidationError as e:
                raise ConfigError(_named_problems(e)) from e

    passes: Optional[list[str]] = None
    inner_compiler: Literal["inductor", "eager"] = "inductor"
    lowering: Literal["commfuse", "inductor"] = "commfuse"
    dump_dir: Optional[str] = None
    strict: bool = False
    verify: bool = True
    debug: bool = False
    topology: Optional[Topology] = None
    group_roles: dict[str, ParallelRole] = Field(default_factory=dict)
    tp_inputs_replicated: bool = True
    uniform_batches: bool = False
    moe_capacity_regroup: bool = False
    moe_recognition: Literal["auto", "always", "off"] = "auto"
    svg_max_nodes: PositiveInt = 250
    check_agreement: Literal["fallback", "raise", "off"] = "fallback"
    step_time_gate: Optional[bool] = None
    agreement_timeout_s: PositiveFloat = 300.0
    workload_chunks: Optional[PositiveInt] = None
    max_chunks: PositiveInt = 8
    partition_search_budget: PositiveInt = 400
    schedule_max_inflight_bytes: Optional[PositiveInt] = None
    schedule_memory_budget: float = Field(default=1.10, ge=1.0)
    schedule_cpsat_max_nodes: int = Field(default=60, ge=0)
    schedule_cpsat_time_limit_s: PositiveFloat = 2.0
    schedule_layer_level: bool = True
    schedule_model_level: bool = True
    model_level_memory_bytes: Optional[PositiveInt] = None
    model_level_brute_force: bool = False
    schedule_memory_headroom_bytes: Optional[NonNegativeInt] = None
    bucket_cap_bytes: Optional[PositiveInt] = None
    bucket_max_memory_increase: float = Field(default=0.05, ge=0.0)
    lagom_max_evaluations: int = Field(default=1000, ge=2)
    dhelix: bool = False
    dhelix_oef_profile: Optional[str] = None
    cost_profile: Optional[str] = None

    @model_validator(mode="after")
    def _dhelix_needs_eager(self) -> "Config":
        if self.dhelix and self.inner_compiler != "eager":
            raise ValueError(
                'dhelix=True needs inner_compiler="eager" (the fused train-step partition replaces '
                f"AOTAutograd's; Inductor partitions on its own) (got inner_compiler={self.inner_compiler!r})"
            )
        return self

    @field_validator("dhelix_oef_profile")
    @classmethod
    def _readable_profile(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            try:
                read_oef_profile(v)
            except ValueError as e:
                raise ValueError(f"dhelix_oef_profile: {e}") from None
        return v

    @field_validator("cost_profile")
    @classmethod
    def _readable_cost_profile(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            try:
                CostProfile.load(v)
            except ValueError as e:
                raise ValueError(f"cost_profile: {e}") from None
        return v

    @model_validator(mode="after")
    def _lowering_needs_inductor(self) -> "Config":
        if self.lowering == "inductor" and self.inner_compiler != "inductor":
            raise ValueError(
                'lowering="inductor" needs inner_compiler="inductor" '
                f"(got inner_compiler={self.inner_compiler!r})"
            )
        return self

    @model_validator(mode="after")
    def _chunks_within_bound(self) -> "Config":
        if self.workload_chunks is not None and self.workload_chunks > self.max_chunks:
            raise ValueError(f"workload_chunks={self.workload_chunks} exceeds max_chunks={self.max_chunks}")
        return self

    @field_validator("check_agreement", mode="before")
    @classmethod
    def _agreement_off(cls, v: Any) -> Any:
        if v is False:  # the natural way to switch it off
            return "off"
        if v is True:
            raise ValueError(
                'check_agreement takes "fallback" (the default: on), "raise" or "off"; True no longer '
                'names one of them (it used to mean "raise")'
            )
        return v

    def agreement_enabled(self) -> bool:
        return self.check_agreement != "off"

    @field_validator("passes")
    @classmethod
    def _known_passes(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is None:
            return v

        known = available_passes()
        unknown = [p for p in v if p not in known]
        if unknown:
            raise ValueError(f"unknown pass name(s) {unknown}; available passes: {sorted(known)}")
        return v

    def pass_names(self) -> list[str]:
        if self.passes is not None:
            return list(self.passes)
        return list(DHELIX_PIPELINE if self.dhelix else DEFAULT_PIPELINE)

    @property
    def gates_by_step_time(self) -> bool:
        """Whether the pipeline judges rewrites by predicted step time (see ``step_time_gate``)."""
        return self.passes is None if self.step_time_gate is None else self.step_time_gate

    def resolved_dump_dir(self) -> Optional[str]:
        return self.dump_dir or os.environ.get(DUMP_DIR_ENV) or None

    def cache_key(self, topology: Optional[Topology] = None) -> str:
        """Everything that can change the produced graph (not dumps, not strictness)."""

        topo = topology or self.topology
        payload = {
            "version": __version__,
            "passes": self.pass_names(),
            "inner": self.inner_compiler,
            "lowering": self.lowering,
            "roles": {k: v.value for k, v in sorted(self.group_roles.items())},
            "tp_inputs_replicated": self.tp_inputs_replicated,
            "moe_capacity_regroup": self.moe_capacity_regroup,
            "moe_recognition": self.moe_recognition,
            "workload_chunks": self.workload_chunks,
            "max_chunks": self.max_chunks,
            "partition_search_budget": self.partition_search_budget,
            "schedule_max_inflight_bytes": self.schedule_max_inflight_bytes,
            "schedule_memory_budget": self.schedule_memory_budget,
            "schedule_cpsat_max_nodes": self.schedule_cpsat_max_nodes,
            "schedule_cpsat_time_limit_s": self.schedule_cpsat_time_limit_s,
            "schedule_layer_level": self.schedule_layer_level,
            "schedule_model_level": self.schedule_model_level,
            "model_level_memory_bytes": self.model_level_memory_bytes,
            "model_level_brute_force": self.model_level_brute_force,
            "schedule_memory_headroom_bytes": self.schedule_memory_headroom_bytes,
            "bucket_cap_bytes": self.bucket_cap_bytes,
            "bucket_max_memory_increase": self.bucket_max_memory_increase,
            "lagom_max_evaluations": self.lagom_max_evaluations,
            "dhelix": self.dhelix,
            "dhelix_oef_profile": _file_digest(self.dhelix_oef_profile),
            "topology": topo.model_dump() if topo else None,
        }
        if self.step_time_gate is not None:
            payload["step_time_gate"] = self.step_time_gate
        if self.uniform_batches:  # keys of configs without it stay as they were
            payload["uniform_batches"] = True
        if self.cost_profile is not None:  # keys of configs without a profile stay as they were
            payload["cost_profile"] = _file_digest(self.cost_profile)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _named_problems(e: ValidationError) -> str:
    """One clause per problem, each naming its field: ``Config.passes: unknown pass name(s) ...``
    (``Config: ...`` for a check across fields)."""
    clauses = []
    for err in e.errors():
        field = ".".join(["Config", *(str(part) for part in err.get("loc", ()))])
        clauses.append(f"{field}: {err.get('msg', 'invalid value').removeprefix('Value error, ')}")
    return "; ".join(clauses)


def _file_digest(path: Optional[str]) -> Optional[str]:
    """What a compile cache must key on for a profile file: its content, not its name."""
    if path is None:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


_process_default: Optional[Config] = None


def set_default_config(config: Optional[Config] = None, **overrides: Any) -> Optional[Config]:
    """Make ``config`` (with ``overrides``) the config of every compile that is not given one:
    ``torch.compile(..., backend="commfuse")`` (e.g. from torchtitan's ``apply_compile``, which
    takes a backend name), ``commfuse.backend()``, ``compile_train_step``, ``optimize``.
    ``set_default_config(None)`` goes back to ``COMMFUSE_CONFIG`` / ``Config()``. Call it with the
    same arguments on every rank. Returns the previous process-wide default (None if unset)."""
    global _process_default
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a commfuse.Config or None, got {type(config).__name__}")
    if overrides:
        config = Config(**{**(config or Config()).model_dump(), **overrides})
    previous, _process_default = _process_default, config
    return previous


def default_config() -> Config:
    """The config of a compile not given one: ``set_default_config``'s, else ``COMMFUSE_CONFIG``'s,
    else ``Config()``."""
    if _process_default is not None:
        return _process_default
    text = os.environ.get(CONFIG_ENV, "").strip()
    return config_from_text(text, CONFIG_ENV) if text else Config()


def config_with_options(
    config: Config,
    options: Optional[dict[str, Any]],
    source: str = "torch.compile(backend='commfuse', options=...)",
) -> Config:
    """``config`` with ``options`` (Config field -> value; ``-`` in a name reads as ``_``, as in
    Inductor's options) laid over it: what ``torch.compile(..., options={...})`` means for
    commfuse. An unknown name is refused with the valid ones listed; a bad value with the
    validation error, which names the field."""
    if not options:
        return config
    if not isinstance(options, dict):
        raise ConfigError(f"{source}: expected a dict of Config fields, got {type(options).__name__}")
    fields = Config.model_fields
    update: dict[str, Any] = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(
                f"{source}: unknown option {key!r}. commfuse's options are the fields of "
                f"commfuse.Config: {', '.join(sorted(fields))} (Inductor's own options are not "
                "taken here: set torch._inductor.config, or pass mode=)"
            )
        update[name] = value
    try:
        return Config(**{**config.model_dump(), **update})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def config_from_text(text: str, source: str = CONFIG_ENV) -> Config:
    """A Config from a JSON object, or from the JSON file ``text`` names. Errors name ``source``,
    the file and the field."""
    where = source
    if not text.startswith("{"):
        where = f"{source} (file {text})"
        try:
            text = Path(text).read_text()
        except OSError as e:
            raise ConfigError(f"{source}: not a JSON object and not a readable file: {text!r} ({e})") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object of Config fields, got {type(doc).__name__}")
    try:
        return Config(**doc)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
