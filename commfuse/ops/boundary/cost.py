"""Time of commfuse's boundary ops (``commfuse::m2ms``, ``commfuse::stage_transfer``) on a Topology.

What it models
    Both ops are sets of point-to-point messages between group ranks, every message's size
    known from the op's arguments (:class:`commfuse.ops.boundary.ir_view.BoundaryTransfers`; the
    m2ms piece matrix is the same on every rank). Messages run concurrently; a rank's
    pieces to itself are local copies and free. For each rank ``g`` of the group::

        t_g = launch + latency x max(send peers, receive peers)
              + max(sent intra / B_intra, sent inter / B_inter, received intra / B_intra,
                    received inter / B_inter)

    with the peers and bytes split by whether the peer sits on ``g``'s node (topology):
    one hop latency per peer (``intra_node_latency_us`` or ``inter_node_latency_us``; the
    larger of the send and receive side), intra-node bytes at the intra-node bus bandwidth,
    inter-node bytes at the rank's NIC share, the two links and the two directions (full
    duplex) concurrent. The op's time is ``max_g t_g``: every rank's wait ends when the
    slowest rank's transfers do, and a value every rank computes alike (decisions made
    from it must be the same on every rank; a rank-local time would not be).

    * m2ms (Chimera's M2MS): Chimera sends rank i's pieces in destination order i%N,
      (i+1)%N, ... so no receiver is hit by all senders at once; with that order the
      per-rank bottleneck above is reachable (hot spots are not modelled).
    * stage_transfer (Chimera's P2P): n disjoint pairs; a rank that is a source of one pair
      and the destination of another sends and receives at once.

    ``wire_bytes`` of the estimate is the largest number of bytes one rank sends (the IR's
    per-rank ``wire_bytes`` is the rank's own): a rank-independent figure for the same reason.

Calibration
    Kind multipliers (``CollectiveParams.bandwidth_multiplier`` / ``latency_multiplier``) of
    ``many_to_many_scatter`` / ``p2p`` apply. A fitted ``alpha + beta x size`` for the kind
    (exact group size, else any size) replaces the analytic time, with ``size`` = the
    bottleneck rank's ``max(sent, received)``; a ``p2p`` without its own fit uses the
    ``send`` fit. ``commfuse calibrate`` measures neither.

Assumptions
    As for every collective model (collectives.py): homogeneous nodes, one device per rank,
    full-duplex links, no contention between concurrent ops. A group whose global ranks are
    unknown is assumed to be ranks ``0..n-1``. Unknown (symbolic) sizes are evaluated with
    every symbol set to ``symbol_hint``.

Source: Chimera §3 (M2MS as ordered asynchronous P2P) and Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from commfuse.costmodel.collectives import concrete, register_cost_rule
from commfuse.costmodel.estimator import CollectiveEstimate
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import CollectiveKind

K = CollectiveKind
_BYTES_PER_US_PER_GBPS = 1e3


@dataclass(frozen=True)
class RankTraffic:
    """What one global rank sends and receives in one boundary op (self-pieces excluded)."""

    rank: int
    sent_intra: int = 0
    sent_inter: int = 0
    recv_intra: int = 0
    recv_inter: int = 0
    send_peers_intra: int = 0
    send_peers_inter: int = 0
    recv_peers_intra: int = 0
    recv_peers_inter: int = 0

    @property
    def sent(self) -> int:
        return self.sent_intra + self.sent_inter

    @property
    def received(self) -> int:
        return self.recv_intra + self.recv_inter


def traffic(pieces: Sequence[tuple[int, int, int]], node_of) -> dict[int, RankTraffic]:
    """Per global rank: bytes and peers, split intra/inter node. ``pieces``: (from, to, bytes)
    in global ranks; ``node_of(rank) -> node``."""
    acc: dict[int, dict[str, int]] = {}

    def a(r: int) -> dict[str, int]:
        return acc.setdefault(r, {})

    def add(d: dict[str, int], key: str, v: int) -> None:
        d[key] = d.get(key, 0) + v

    seen: set[tuple[int, int, str]] = set()
    for s, d, b in pieces:
        if s == d or b <= 0:
            continue
        where = "intra" if node_of(s) == node_of(d) else "inter"
        add(a(s), f"sent_{where}", b)
        add(a(d), f"recv_{where}", b)
        if (s, d, "send") not in seen:
            seen.add((s, d, "send"))
            add(a(s), f"send_peers_{where}", 1)
            add(a(d), f"recv_peers_{where}", 1)
    return {r: RankTraffic(r, **v) for r, v in acc.items()}


def transfer_time_us(
    model, kind: CollectiveKind, pieces: Sequence[tuple[int, int, int]]
) -> tuple[float, int, dict[int, RankTraffic]]:
    """(time, largest bytes one rank sends, per-rank traffic) of concurrent point-to-point
    messages ``pieces`` (global ranks) under ``model`` (a :class:`~commfuse.costmodel.collectives.CollectiveModel`)."""
    t = model.topology
    per = traffic(pieces, t.node_of)
    if not per:
        return 0.0, 0, per
    bwm = model.params.bandwidth_multiplier.get(kind, 1.0)
    latm = model.params.latency_multiplier.get(kind, 1.0)
    b_in = t.intra_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS * bwm
    b_out = t.inter_node_bandwidth_GBps * _BYTES_PER_US_PER_GBPS * bwm
    worst = 0.0
    for r in per.values():
        lat_send = r.send_peers_intra * t.intra_node_latency_us + r.send_peers_inter * t.inter_node_latency_us
        lat_recv = r.recv_peers_intra * t.intra_node_latency_us + r.recv_peers_inter * t.inter_node_latency_us
        bw = max(r.sent_intra / b_in, r.sent_inter / b_out, r.recv_intra / b_in, r.recv_inter / b_out)
        worst = max(worst, t.collective_launch_us + latm * max(lat_send, lat_recv) + bw)
    return worst, max(r.sent for r in per.values()), per


def estimate_boundary(model, c: Collective) -> Optional[CollectiveEstimate]:
    """The estimate of a boundary-op collective (``c.extra["boundary"]``), None if it has no
    transfer description (then the generic M2MS / p2p model answers)."""
    t = c.extra.get("boundary")
    if t is None or t.unit_bytes is None:
        return None
    ranks = c.group.ranks if c.group.ranks is not None and len(c.group.ranks) == t.group_size else None

    def glob(g: int) -> int:
        return ranks[g] if ranks is not None else g

    pieces = []
    for s, d, b in t.pieces():
        nb = concrete(b, model.symbol_hint)
        if nb is None:
            return None
        pieces.append((glob(s), glob(d), nb))
    time, max_sent, per = transfer_time_us(model, c.kind, pieces)
    algorithm = "m2ms" if c.kind is K.M2MS else "p2p"
    if time <= 0:
        return CollectiveEstimate(0.0, 0, "local")
    fit = model.params.fit_for(c.kind, t.group_size)
    if fit is None and c.kind is K.P2P:
        fit = model.params.fit_for(K.SEND, t.group_size)
    if fit is not None:
        size = max(max(r.sent, r.received) for r in per.values())
        return CollectiveEstimate(fit.time_us(size), max_sent, f"fitted:{algorithm}")
    return CollectiveEstimate(time, max_sent, algorithm)


__all__ = ["RankTraffic", "estimate_boundary", "register", "traffic", "transfer_time_us"]


def register() -> None:
    """Price both ops from their messages (called by :func:`commfuse.ops.install`)."""
    register_cost_rule(CollectiveKind.M2MS, estimate_boundary)
    register_cost_rule(CollectiveKind.P2P, estimate_boundary)
