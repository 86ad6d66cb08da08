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
"""

from __future__ import annotations

import datetime
import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Optional

from .errors import CommfuseError
from .report import PipelineReport

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
        sigs = [[c.kind, c.group, c.reduce_op, c.dtype, [str(s) for s in c.input_shapes]]
                for c in report.analysis.collectives]
        self.graphs[report.graph] = sigs


def _describe(sig: Optional[list]) -> str:
    if sig is None:
        return "no collective"
    kind, group, op, dtype, shapes = sig
    return f"{kind}(group {group}, {dtype}, in {', '.join(shapes)}{', ' + op if op else ''})"


def first_difference(a: dict[str, list], b: dict[str, list]) -> Optional[str]:
    """A sentence naming the first differing collective between two ranks' records, or None."""
    for graph in sorted(set(a) | set(b)):
        sa, sb = a.get(graph), b.get(graph)
        if sa is None or sb is None:
            continue  # compiled on one rank only: the other took it from a compile cache
        for i in range(max(len(sa), len(sb))):
            x = sa[i] if i < len(sa) else None
            y = sb[i] if i < len(sb) else None
            if x != y:
                return f"{graph} graph, collective #{i}: {{A}} issues {_describe(x)} but {{B}} issues {_describe(y)}"
    return None


def check_agreement(record: FrameRecord, *, timeout_s: float, store=None, rank: Optional[int] = None,
                    world_size: Optional[int] = None) -> None:
    """Publish this rank's record, wait for every rank's, raise `AgreementError` on any difference."""
    import torch.distributed as dist

    from ._torch_private import default_store

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
    compared = [r for r in range(world_size) if not records[r]["cache_hit"]]
    for a, b in zip(compared, compared[1:]):
        diff = first_difference(records[a]["graphs"], records[b]["graphs"])
        if diff is not None:
            raise AgreementError(
                "cross-rank collective disagreement (training would hang or corrupt data): "
                + diff.format(A=f"rank {a}", B=f"rank {b}")
            )


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
