"""Time and wire bytes of one collective, by algorithm, for NCCL and gloo.

What it models
    ``time = launch + steps x hop latency + bytes on the bottleneck link / bandwidth``
    (the alpha-beta / LogP form NCCL's own tuner uses), per algorithm:

    * **ring** (AR, AG, RS): 2(n-1) steps for AR, n-1 for AG/RS; bandwidth term
      ``size x busbw_factor / busbw``. In one node ``busbw`` is the intra-node bus
      bandwidth. A ring spanning nodes crosses each node boundary once per pass,
      so its bottleneck is the node's NICs: ``busbw = min(B_intra, a x B_inter)``
      with ``a`` the group's ranks on the least-populated node (a flat ring over
      one rank per node gets one NIC). Of the steps, 2(m-1) (AR) / m-1 (AG, RS)
      cross nodes and pay the inter-node latency (NCCL tuning.cc's split).
    * **tree** (AR; NCCL's double binary tree): latency 2((a-1) intra + ceil(log2 m)
      inter) hops, algorithm bandwidth busbw/2 (NCCL's tree ratio). Inside one node
      it is a chain and never beats the ring; across nodes it wins small messages.
    * **hierarchical** (AR, AG, RS over a group spanning m nodes with a ranks each):
      AR = RS inside the node + AR across nodes of size/a + AG inside the node (AG
      and RS: the two matching halves). Each local rank drives its own NIC share.
      This is what commfuse's topology-aware split into intra-/inter-node groups
      executes; it is a candidate only when the group spans nodes.
    * **pairwise** (all_to_all): each rank sends (n-1)/n of its input, the intra-
      and inter-node parts concurrently on their links; one latency per peer.
    * **broadcast**: NCCL pipelined ring (n-1 hops, size/busbw, factor 1); gloo
      binomial tree (ceil(log2 n) rounds of size/bandwidth).
    * **reduce** (commfuse's rooted reduce, ``commfuse::reduce_to_root``): NCCL pipelined
      ring towards the root, the mirror image of broadcast (n-1 hops, size/busbw, factor
      1); gloo's ``reduce`` is a ring reduce-scatter followed by a gather of the reduced
      chunks at the root (gloo/reduce.cc): n-1 ring steps + one gather step, and
      2(n-1)/n x size through the root's link.
    * **p2p** (send, recv, batch_p2p): one hop, bytes sent / link bandwidth; the
      inter-node link when the group spans nodes.
    * **m2ms** (Chimera's many-to-many scatter): each rank sends its pieces as
      point-to-point messages: ``sum(pieces) / bandwidth + latency per peer``. For an IR
      collective of commfuse's boundary ops (``commfuse::m2ms``, ``commfuse::stage_transfer``,
      kinds ``many_to_many_scatter`` / ``p2p``) `estimate` prices every rank's messages,
      intra vs inter node, and takes the slowest rank (`commfuse.ops.boundary.cost`).
    * **gloo-allreduce-emulation**: gloo has no reduce_scatter; ProcessGroupGloo
      runs a full all_reduce of the input and keeps a slice, so reduce_scatter
      costs an all_reduce of its *input* (see pytorch-landscape.md).

    "auto" (the default) picks the fastest candidate, as NCCL's tuner does; gloo
    only has ring (AR, AG), the emulation (RS), pairwise, binomial broadcast, p2p.

Size conventions (nccl-tests, NCCL-trace thesis)
    ``size`` is the nccl-tests message size: AR the buffer; AG the *total output*
    (n x shard); RS the *total input*; A2A the input; broadcast the buffer; p2p
    and M2MS the bytes sent. algbw = size / time; busbw = algbw x factor with
    factor AR 2(n-1)/n, AG/RS/A2A (n-1)/n, broadcast/p2p 1 (`bus_factor`).
    ``wire_bytes`` = bytes one rank sends under the chosen algorithm (ring: the
    same factors times size, matching `commfuse.ir.volume.wire_bytes`).

Calibration
    `CollectiveParams` overrides the analytic numbers: per-kind bandwidth and
    latency multipliers, and fitted ``time = alpha_us + beta_us_per_byte x size``
    per (kind, group size) that take precedence (what `commfuse calibrate` fits
    for gloo). Lookup: exact group size, else a fit with ``group_size=None``,
    else analytic. On gloo a reduce_scatter without its own fit uses the
    all_reduce fit of the same group size (emulation). A reduce without its own
    fit uses the broadcast fit on NCCL (same chain, data flowing the other way)
    and the all_reduce fit on gloo (the same ring reduce-scatter, then a gather
    instead of an all-gather), so ``commfuse calibrate`` need not measure it.

Assumptions
    Homogeneous nodes, one device per rank, full-duplex links, no NVLS/SHARP/
    CollNet, no protocol (LL/LL128/Simple) switch: latencies are effective
    per-hop values. Unknown (symbolic) sizes are evaluated with every symbol set
    to ``symbol_hint``; groups without known ranks are assumed to be ranks
    ``0..n-1``, groups of unknown size the whole world. Pure functions of inputs every rank shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from commfuse.core.errors import ConfigError
from commfuse.costmodel.estimator import CollectiveEstimate
from commfuse.costmodel.symbol_hints import DEFAULT_SYMBOL_HINT, SymbolHints, hinted_size
from commfuse.costmodel.topology import Topology
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind

K = CollectiveKind
Backend = Literal["nccl", "gloo"]
BACKENDS = ("nccl", "gloo")

_BYTES_PER_US_PER_GBPS = 1e3  # 1 GB/s = 1e9 B/s = 1e3 B/us


# --------------------------------------------------------------------------- conventions


def bus_factor(kind: CollectiveKind, n: int) -> float:
    """NCCL bus-bandwidth factor: busbw = algbw x factor (nccl-tests PERFORMANCE.md)."""
    if n <= 1:
        return 0.0
    if kind is K.ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind in (K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, p2p, m2ms


def algbw_GBps(size_bytes: float, time_us: float) -> float:
    return size_bytes / time_us / _BYTES_PER_US_PER_GBPS if time_us > 0 else math.inf


def busbw_GBps(kind: CollectiveKind, size_bytes: float, n: int, time_us: float) -> float:
    return algbw_GBps(size_bytes, time_us) * bus_factor(kind, n)


def concrete(x: Any, symbol_hint: "int | SymbolHints" = DEFAULT_SYMBOL_HINT) -> Optional[int]:
    """An int for a size that may be a sympy expression or a SymInt: its symbols take rank-invariant,
    bounded values (:func:`~commfuse.costmodel.symbol_hints.hinted`: a symbol's own hint from
    ``symbol_hint``, a :class:`~commfuse.costmodel.symbol_hints.SymbolHints`, else the flat value),
    never the example value a SymInt was traced with, which is this rank's own."""
    if x is None:
        return None
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return int(x)
    try:
        return hinted_size(x, symbol_hint)
    except Exception:  # noqa: BLE001 - anything unexpected: no size
        return None


def message_bytes(c: Collective, symbol_hint: "int | SymbolHints" = 4096) -> int:
    """The nccl-tests size of collective `c` (see module docstring), 0 if unknown."""
    n = c.group.size or (len(c.group.ranks) if c.group.ranks else 1)
    inb = concrete(c.input_bytes, symbol_hint)
    outb = concrete(c.output_bytes, symbol_hint)
    if c.kind is K.ALL_GATHER:
        return outb if outb is not None else (inb or 0) * n
    if c.kind is K.BATCH_P2P:
        w = concrete(c.wire_bytes, symbol_hint)
        return w if w is not None else (inb or 0)
    if c.kind is K.M2MS:
        pieces = m2ms_pieces(c, symbol_hint)
        if pieces is not None:
            return sum(pieces)
        w = concrete(c.wire_bytes, symbol_hint)
        return w if w is not None else (inb or 0)
    return inb if inb is not None else (outb or 0)


def m2ms_pieces(c: Collective, symbol_hint: "int | SymbolHints" = 4096) -> Optional[list[int]]:
    """Bytes this rank sends to each peer, from ``c.extra["m2ms_send_bytes"]`` (self excluded)."""
    raw = c.extra.get("m2ms_send_bytes")
    if raw is None:
        return None
    pieces = [concrete(p, symbol_hint) or 0 for p in raw]
    return [p for p in pieces if p > 0]


# --------------------------------------------------------------------------- parameters


class AlphaBeta(BaseModel):
    """A fitted ``time_us = alpha_us + beta_us_per_byte x size`` for one (kind, group size)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: CollectiveKind
    group_size: Optional[PositiveInt] = Field(default=None, description="None: any group size")
    alpha_us: NonNegativeFloat
    beta_us_per_byte: NonNegativeFloat
    min_bytes: Optional[int] = Field(default=None, ge=0, description="smallest size measured (informational)")
    max_bytes: Optional[int] = Field(default=None, ge=0, description="largest size measured (informational)")

    def time_us(self, size: float) -> float:
        return self.alpha_us + self.beta_us_per_byte * size


class CollectiveParams(BaseModel):
    """Calibration of the collective model; every field optional (empty = analytic)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_multiplier: dict[CollectiveKind, PositiveFloat] = Field(
        default_factory=dict, description="effective bandwidth = analytic x multiplier, per kind"
    )
    latency_multiplier: dict[CollectiveKind, NonNegativeFloat] = Field(
        default_factory=dict, description="latency terms x multiplier, per kind"
    )
    fits: list[AlphaBeta] = Field(default_factory=list, description="fitted alpha/beta, take precedence")

    @model_validator(mode="after")
    def _unique(self) -> "CollectiveParams":
        seen = set()
        for i, f in enumerate(self.fits):
            key = (f.kind, f.group_size)
            if key in seen:
                raise ValueError(
                    f"fits.{i}: duplicate fit for kind {f.kind.value!r} and group_size {f.group_size}"
                )
            seen.add(key)
        return self

    def fit_for(self, kind: CollectiveKind, group_size: int) -> Optional[AlphaBeta]:
        anysize = None
        for f in self.fits:
            if f.kind is kind and f.group_size == group_size:
                return f
            if f.kind is kind and f.group_size is None:
                anysize = f
        return anysize


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """How a group's ranks sit on nodes."""

    n: int  # ranks in the group
    m: int  # nodes it touches
    a_min: int  # fewest group ranks on one of those nodes
    a_max: int  # most group ranks on one node

    @property
    def spans(self) -> bool:
        return self.m > 1

    @classmethod
    def of(cls, topology: Topology, n: int, ranks: Optional[Sequence[int]] = None) -> "Placement":
        if ranks is not None and len(ranks) == n and n > 0:
            counts = list(topology.ranks_per_node_of(tuple(ranks)).values())
        else:  # unknown ranks: assume contiguous 0..n-1
            r = topology.ranks_per_node
            counts = [r] * (n // r) + ([n % r] if n % r else [])
        counts = counts or [1]
        return cls(n, len(counts), min(counts), max(counts))


# --------------------------------------------------------------------------- the model


# Cost rules of the ops commfuse defines (commfuse.ops plugs them in with register_cost_rule):
# kind -> fn(model, collective) -> estimate, or None to fall back to the generic model.
_OWN_OP_RULES: dict = {}


def register_cost_rule(kind: "CollectiveKind", rule) -> None:
    """Price collectives of ``kind`` with ``rule(model, collective)`` (None: the generic model)."""
    _OWN_OP_RULES[kind] = rule


class CollectiveModel:
    """Collective time model over a `Topology` for backend "nccl" or "gloo".

    `estimate(c)` answers for an IR `Collective`; `time(kind, size, n, ...)` for a
    raw size (nccl-tests convention); `candidates(...)` lists every algorithm.
    """

    def __init__(
        self,
        topology: Topology,
        backend: str = "nccl",
        params: Optional[CollectiveParams] = None,
        *,
        symbol_hint: "int | SymbolHints" = 4096,
    ) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"collective model: backend must be one of {BACKENDS}, got {backend!r}")
        self.topology = topology
        self.backend = backend
        self.params = params or CollectiveParams()
        self.symbol_hint = symbol_hint

    # ---- public API

    def estimate(self, c: Collective, algorithm: Optional[str] = None) -> CollectiveEstimate:
        rule = _OWN_OP_RULES.get(c.kind) if algorithm is None else None
        if rule is not None:  # an op commfuse defines, priced by its own rule (None: the generic model)
            est = rule(self, c)
            if est is not None:
                return est
        # unknown group size (e.g. a graph loaded without its process groups): assume the whole world
        n = c.group.size or (len(c.group.ranks) if c.group.ranks else self.topology.world_size)
        size = message_bytes(c, self.symbol_hint)
        return self.time(
            c.kind,
            size,
            n,
            ranks=c.group.ranks,
            algorithm=algorithm,
            pieces=m2ms_pieces(c, self.symbol_hint) if c.kind is K.M2MS else None,
        )

    def time(
        self,
        kind: CollectiveKind,
        size: int,
        n: int,
        *,
        ranks: Optional[Sequence[int]] = None,
        algorithm: Optional[str] = None,
        pieces: Optional[Sequence[int]] = None,
    ) -> CollectiveEstimate:
        """Fastest (or the named) algorithm for `size` bytes (nccl-tests convention) over `n` ranks."""
        kind = CollectiveKind(kind)
        if n <= 1 or (size <= 0 and not (pieces and sum(pieces) > 0)):
            return CollectiveEstimate(0.0, 0, "local")
        cands = self.candidates(kind, size, n, ranks=ranks, pieces=pieces)
        if algorithm is not None:
            if algorithm not in cands:
                raise ConfigError(
                    f"collective model: algorithm {algorithm!r} not available for {kind.value} "
                    f"on {self.backend} over {n} ranks; available: {sorted(cands)}"
                )
            best = cands[algorithm]
        else:
            best = min(cands.values(), key=lambda e: (e.time_us, e.algorithm))
        fit = self._fit(kind, n)
        if fit is not None:
            return CollectiveEstimate(fit.time_us(size), best.wire_bytes, f"fitted:{best.algorithm}")
        return best

    def candidates(
        self,
        kind: CollectiveKind,
        size: int,
        n: int,
        *,
        ranks: Optional[Sequence[int]] = None,
        pieces: Optional[Sequence[int]] = None,
    ) -> dict[str, CollectiveEstimate]:
        """Every algorithm this backend has for `kind`, analytic (fits not applied)."""
        kind = CollectiveKind(kind)
        p = Placement.of(self.topology, n, ranks)
        S = float(size)
        out: dict[str, CollectiveEstimate] = {}
        gloo = self.backend == "gloo"
        if kind in (K.ALL_REDUCE, K.ALL_GATHER):
            out["ring"] = self._ring(kind, S, p)
            if not gloo:
                if kind is K.ALL_REDUCE:
                    out["tree"] = self._tree(kind, S, p)
                if p.spans:
                    out["hierarchical"] = self._hierarchical(kind, S, p)
        elif kind is K.REDUCE_SCATTER:
            if gloo:
                ar = self._ring(K.ALL_REDUCE, S, p, charge_as=K.REDUCE_SCATTER)
                out["gloo-allreduce-emulation"] = CollectiveEstimate(
                    ar.time_us, ar.wire_bytes, "gloo-allreduce-emulation"
                )
            else:
                out["ring"] = self._ring(kind, S, p)
                if p.spans:
                    out["hierarchical"] = self._hierarchical(kind, S, p)
        elif kind is K.ALL_TO_ALL:
            out["pairwise"] = self._pairwise(kind, S, p)
        elif kind is K.BROADCAST:
            if gloo:
                out["binomial-tree"] = self._binomial_broadcast(kind, S, p)
            else:
                out["ring"] = self._ring_broadcast(kind, S, p)
        elif kind is K.REDUCE:
            if gloo:
                out["ring-reduce-scatter+gather"] = self._gloo_reduce(kind, S, p)
            else:
                out["ring"] = self._ring_broadcast(kind, S, p)  # the same chain, towards the root
        elif kind in (K.SEND, K.RECV, K.BATCH_P2P, K.P2P):
            out["p2p"] = self._p2p(kind, S, p)
        elif kind is K.M2MS:
            out["m2ms"] = self._m2ms(kind, S, p, pieces)
        else:  # pragma: no cover - every kind is handled above
            raise ConfigError(f"collective model: no model for kind {kind.value!r}")
        return out

    # ---- building blocks

    def _link(self, p: Placement) -> tuple[float, float]:
        """(bytes/us, hop latency us) of the bottleneck link of a flat algorithm."""
        t = self.topology
        if not p.spans:
            return t.intra_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS, t.intra_node_latency_us
        bw = min(t.intra_node_bandwidth_GBps, p.a_min * t.inter_node_bandwidth_GBps)
        return bw * _BYTES_PER_US_PER_GBPS, t.inter_node_latency_us

    def _bwm(self, kind: CollectiveKind) -> float:
        return self.params.bandwidth_multiplier.get(kind, 1.0)

    def _latm(self, kind: CollectiveKind) -> float:
        return self.params.latency_multiplier.get(kind, 1.0)

    def _lat(self, kind: CollectiveKind, intra_steps: float, inter_steps: float) -> float:
        t = self.topology
        return t.collective_launch_us + self._latm(kind) * (
            intra_steps * t.intra_node_latency_us + inter_steps * t.inter_node_latency_us
        )

    def _fit(self, kind: CollectiveKind, n: int) -> Optional[AlphaBeta]:
        fit = self.params.fit_for(kind, n)
        if fit is None and self.backend == "gloo" and kind is K.REDUCE_SCATTER:
            fit = self.params.fit_for(K.ALL_REDUCE, n)  # gloo emulates RS by an AR of the input
        if fit is None and kind is K.REDUCE:  # see "Calibration" in the module docstring
            fit = self.params.fit_for(K.ALL_REDUCE if self.backend == "gloo" else K.BROADCAST, n)
        return fit

    def _ring(
        self, kind: CollectiveKind, S: float, p: Placement, charge_as: Optional[CollectiveKind] = None
    ) -> CollectiveEstimate:
        n = p.n
        f = bus_factor(kind, n)
        steps = 2 * (n - 1) if kind is K.ALL_REDUCE else n - 1
        inter = 0 if not p.spans else (2 * (p.m - 1) if kind is K.ALL_REDUCE else p.m - 1)
        bw, _ = self._link(p)
        ck = charge_as or kind
        time = self._lat(ck, steps - inter, inter) + S * f / (bw * self._bwm(ck))
        return CollectiveEstimate(time, int(round(S * f)), "ring")

    def _tree(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        bw, _ = self._link(p)
        time = self._lat(kind, 2 * (p.a_max - 1), 2 * math.ceil(math.log2(p.m))) + S / (
            0.5 * bw * self._bwm(kind)
        )
        # a tree rank receives from its children and sends the reduction up, then the result down: ~2S
        return CollectiveEstimate(time, int(round(2 * S)), "tree")

    def _hierarchical(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        t = self.topology
        a, m = p.a_max, p.m
        b_in = t.intra_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS * self._bwm(kind)
        b_out = t.inter_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS * self._bwm(kind)
        k = 2 if kind is K.ALL_REDUCE else 1  # AR = RS + AR_inter + AG; AG/RS: one half each
        intra_bytes = k * (a - 1) / a * S
        inter_bytes = k * (m - 1) / m * S / a
        time = self._lat(kind, k * (a - 1), k * (m - 1)) + intra_bytes / b_in + inter_bytes / b_out
        return CollectiveEstimate(time, int(round(intra_bytes + inter_bytes)), "hierarchical")

    def _pairwise(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        t = self.topology
        n, a = p.n, (p.a_max if p.spans else p.n)
        intra = (a - 1) / n * S
        inter = (n - a) / n * S
        b_in = t.intra_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS * self._bwm(kind)
        b_out = t.inter_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS * self._bwm(kind)
        time = self._lat(kind, a - 1, n - a) + max(intra / b_in, inter / b_out)
        return CollectiveEstimate(time, int(round(intra + inter)), "pairwise")

    def _ring_broadcast(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        bw, _ = self._link(p)
        inter = p.m - 1
        time = self._lat(kind, p.n - 1 - inter, inter) + S / (bw * self._bwm(kind))
        return CollectiveEstimate(time, int(S), "ring")

    def _binomial_broadcast(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        bw, _ = self._link(p)
        rounds = math.ceil(math.log2(p.n))
        inter = min(rounds, math.ceil(math.log2(p.m))) if p.spans else 0
        time = self._lat(kind, rounds - inter, inter) + rounds * S / (bw * self._bwm(kind))
        return CollectiveEstimate(time, int(rounds * S), "binomial-tree")  # the root's bytes

    def _gloo_reduce(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        # ring reduce-scatter ((n-1)/n S per rank), then every rank sends its chunk to the root,
        # which receives (n-1)/n S through its one link
        bw, _ = self._link(p)
        inter = 0 if not p.spans else p.m - 1
        f = (p.n - 1) / p.n
        time = self._lat(kind, p.n - inter, inter) + 2 * f * S / (bw * self._bwm(kind))
        return CollectiveEstimate(time, int(round(2 * f * S)), "ring-reduce-scatter+gather")

    def _p2p_link(self, p: Placement) -> tuple[float, int, int]:
        t = self.topology
        if p.spans:  # assume the peer is on another node (pipeline stages usually are)
            return t.inter_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS, 0, 1
        return t.intra_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS, 1, 0

    def _p2p(self, kind: CollectiveKind, S: float, p: Placement) -> CollectiveEstimate:
        bw, intra, inter = self._p2p_link(p)
        time = self._lat(kind, intra, inter) + S / (bw * self._bwm(kind))
        return CollectiveEstimate(time, 0 if kind is K.RECV else int(S), "p2p")

    def _m2ms(
        self, kind: CollectiveKind, S: float, p: Placement, pieces: Optional[Sequence[int]]
    ) -> CollectiveEstimate:
        bw, intra, inter = self._p2p_link(p)
        pieces = None if pieces is None else [x for x in pieces if x > 0]
        peers = len(pieces) if pieces is not None else p.n - 1
        total = float(sum(pieces)) if pieces is not None else S
        if peers == 0 or total <= 0:
            return CollectiveEstimate(0.0, 0, "m2ms")
        time = self._lat(kind, intra * peers, inter * peers) + total / (bw * self._bwm(kind))
        return CollectiveEstimate(time, int(total), "m2ms")
