"""Cross-rank agreement: every rank must issue the same collectives in the same order.

A pass that decided differently on two ranks (rank-local state, a bug) makes
them issue different collectives on a group: a hang, or silent corruption. The
check compares, across ranks, the collective signatures (kind, group, reduce op,
dtype, input shapes, in issue order) of every graph commfuse compiled for one
Dynamo frame, and raises `AgreementError` naming the first difference.

When: at the first *execution* of the compiled frame, not at compile time. A
rank whose graph came from a compile cache did not run commfuse's passes and
might otherwise skip an exchange the others wait in; every rank executes the
frame, so every rank joins. A cache-hit rank publishes "no record" and is not
compared (its graph was produced by the same passes from the same inputs, which
is what the cache key guarantees).

How: through the default group's c10d Store (set + wait with a timeout), never
through a collective — the point is to find out whether collectives would match
before issuing any. A rank that does not arrive within the timeout is named in
the error instead of hanging the others.

What is compared: per process group, identified by its member ranks (not its name: the TP
group of ranks {0, 1} and that of {2, 3} are different groups that may carry different names
on their members), the sequences of collectives each member issues on that group, graph by
graph. Rules for what legitimately differs between ranks:

* ranks that share no group are never compared (pipeline stages, or the TP groups of
  different data-parallel replicas, run different collectives);
* a graph only one of two members compiled (the other took it from a compile cache) is not
  compared; a member that compiled the graph and issues nothing on the group is a difference;
* point-to-point sends and receives compare as one kind, ``p2p`` (one rank's send pairs with
  its peer's receive of the same dtype and shape);
* a collective whose sizes are data-dependent (unbacked symbols, e.g. the split sizes of a
  dropless MoE's all_to_all) compares by kind, group, reduce op, dtype and position only;
* a group whose ranks the IR cannot resolve is identified by its name and compared among the
  ranks that issue collectives on it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Optional

from commfuse.core.errors import CommfuseError
from commfuse.core.torch_private import default_store
from commfuse.passmgr.report import PipelineReport

_ROUND = itertools.count()
_LOCK = threading.Lock()


class AgreementError(CommfuseError):
    """Ranks disagree on the collectives they are about to issue (or one never arrived)."""


@dataclass
class FrameRecord:
    """The collective sequences of every graph commfuse compiled for one frame, on this rank."""

    graphs: dict[str, list[list]] = field(default_factory=dict)  # graph kind -> signatures in order
    cache_hit: bool = False

    def add(self, report: PipelineReport) -> None:
        if report.analysis is None:
            return
        sigs = [[c.kind, c.group, c.reduce_op, c.dtype, [str(s) for s in c.input_shapes], c.group_ranks]
                for c in report.analysis.collectives]
        self.graphs[report.graph] = sigs


_P2P_KINDS = frozenset({"send", "recv"})
_UNBACKED = re.compile(r"\bu\d+\b")


def _describe(sig: Optional[list]) -> str:
    if sig is None:
        return "no collective"
    kind, group, op, dtype, shapes = sig[:5]
    return f"{kind}(group {group}, {dtype}, in {', '.join(shapes)}{', ' + op if op else ''})"


def _comparable(sig: list) -> tuple:
    """What must agree between two members of a group (see the module docstring's rules)."""
    kind, _group, op, dtype, shapes = sig[:5]
    data_dependent = any(_UNBACKED.search(s) for s in shapes)
    return ("p2p" if kind in _P2P_KINDS else kind, op, dtype, None if data_dependent else tuple(shapes))


def _ranks(sig: list) -> Optional[list[int]]:
    """The member ranks a signature records for its group (None: unknown, e.g. an older record)."""
    return sig[5] if len(sig) > 5 else None


def group_key(sig: list) -> str:
    """The group a signature was issued on: its member ranks, or its name when they are unknown."""
    ranks = _ranks(sig)
    return "ranks " + str(sorted(ranks)) if ranks is not None else f"name {sig[1]!r}"


def first_difference(a: dict[str, list], b: dict[str, list]) -> Optional[str]:
    """A sentence naming the first differing collective between two ranks' records, or None."""
    for graph in sorted(set(a) | set(b)):
        sa, sb = a.get(graph), b.get(graph)
        if sa is None or sb is None:
            continue  # compiled on one rank only: the other took it from a compile cache
        for i in range(max(len(sa), len(sb))):
            x = sa[i] if i < len(sa) else None
            y = sb[i] if i < len(sb) else None
            if x is None or y is None or _comparable(x) != _comparable(y):
                return f"{graph} graph, collective #{i}: {{A}} issues {_describe(x)} but {{B}} issues {_describe(y)}"
    return None


def check_agreement(record: FrameRecord, *, timeout_s: float, store=None, rank: Optional[int] = None,
                    world_size: Optional[int] = None) -> None:
    """Publish this rank's record, wait for every rank's, raise `AgreementError` on any difference."""
    import torch.distributed as dist

    store = store if store is not None else default_store()
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    with _LOCK:
        rnd = next(_ROUND)
    prefix = f"commfuse/agreement/{rnd}/"
    payload = {"cache_hit": record.cache_hit, "graphs": record.graphs}
    store.set(prefix + str(rank), json.dumps(payload))
    keys = [prefix + str(r) for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the Store raises a plain RuntimeError/DistStoreError on timeout
        missing = [r for r in range(world_size) if not store.check([prefix + str(r)])]
        raise AgreementError(
            f"cross-rank agreement check {rnd}: rank(s) {missing} did not arrive within {timeout_s:.0f} s "
            f"(they crashed, hang, or compiled a different program); rank {rank} stops here instead of "
            f"hanging in a collective ({type(e).__name__}: {e})"
        ) from e
    records = {r: json.loads(store.get(prefix + str(r))) for r in range(world_size)}
    problem = first_group_disagreement({r: rec["graphs"] for r, rec in records.items() if not rec["cache_hit"]})
    if problem is not None:
        raise AgreementError("cross-rank collective disagreement (training would hang or corrupt data): " + problem)


def first_group_disagreement(graphs_by_rank: dict[int, dict[str, list]]) -> Optional[str]:
    """The first disagreement between members of a process group, as a sentence naming the
    group's ranks, the graph, the position on the group and both collectives; None if every
    group agrees. ``graphs_by_rank``: rank -> graph kind -> signatures in issue order (the
    ranks to compare: cache-hit ranks left out)."""
    # one pass: per group, its members among the compared ranks and each member's signatures on it
    members: dict[str, set[int]] = {}
    on_group: dict[str, dict[int, dict[str, list]]] = {}
    for r, graphs in graphs_by_rank.items():
        for graph, sigs in graphs.items():
            for sig in sigs:
                key, ranks = group_key(sig), _ranks(sig)
                members.setdefault(key, set()).update(
                    [m for m in ranks if m in graphs_by_rank] if ranks is not None else [r])
                on_group.setdefault(key, {}).setdefault(r, {}).setdefault(graph, []).append(sig)
    for key in sorted(members):
        ranks = sorted(members[key])
        # a member that issued nothing on the group still compiled these graphs: empty sequences
        seqs = {r: {g: on_group[key].get(r, {}).get(g, []) for g in graphs_by_rank[r]} for r in ranks}
        for b in ranks[1:]:
            diff = first_difference(seqs[ranks[0]], seqs[b])
            if diff is not None:
                return f"on the group of {key}: " + diff.format(A=f"rank {ranks[0]}", B=f"rank {b}")
    return None


def wrap_first_call(fn, record: FrameRecord, *, timeout_s: float):
    """`fn` that runs the agreement check once, before its first execution on this rank."""
    import functools

    done = threading.Event()

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if not done.is_set():
            done.set()
            record.cache_hit = not record.graphs
            check_agreement(record, timeout_s=timeout_s)
        return fn(*args, **kwargs)

    return checked
