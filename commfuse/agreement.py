"""Cross-rank agreement: a safety net that cannot hang, on by default.

Passes decide the same on every rank by construction (docs/architecture.md, "Same decision on
every rank"). This module is the net under that rule: if two ranks compiled a frame into
programs whose collectives differ on a process group they share, they fall back to the program
as written, whose collectives match because the user's program does, instead of hanging or
corrupting data.

What is compared, per process group (identified by its member ranks in group-rank order, not by
its name, which another group may carry on other ranks): the hash of the sequence of collectives
this rank issues on the group, over the frame's forward, backward and inference graphs in that
order, after the pipeline; each collective as kind, reduce op, dtype, input shapes and the
communicator setting a pass chose (`SETTING_META`). The hash is salted with a digest of the
config, topology, cost profile, session and mesh layout, so ranks that compiled under different
settings do not agree either. What may legitimately differ between ranks is left out of the hash:

* point-to-point transfers (send, recv, batch_p2p, ``commfuse::stage_transfer``) and an m2ms
  between disjoint rank sets: pipeline-boundary transfers pair ranks of different stages, which
  run different frames, and their shapes differ by stage;
* the split dim of an all_to_all whose split sizes are this rank's own (uneven or
  data-dependent), and the sizes of the exchanges an op issues from its kernel (MoE layer);
* a dim that is symbolic (Dynamo specialises sizes 0 and 1 and may keep others symbolic, so the
  same collective reads ``[1, 16]`` on one rank and ``[s0, 16]`` on another); it reads ``?``;
* ranks that share no group: nothing is compared between them;
* a group whose member ranks are unknown (not a live process group): not compared.

When: at the first execution of each compiled frame, never while compiling (a rank that hit a
compile cache would not take part) and never as a collective (it would hang on the very
mismatch it looks for). Only the c10d Store of the default group is used.

How (:class:`Exchange`), with keys per compiled frame (the Dynamo code object and the graph's
position in that compile), not a process-global counter:

1. **Settled.** A group on which the members already agreed for this frame, config and program as
   written (the hash of the unchanged program's collectives on the group) is *settled*: the key
   holds what its members run (the compiled sequence's hash, or "fallback"). A rank that
   recompiles alone (its batch shape changed, its peers run cached graphs) reads it and compares,
   one Store read per group, without waiting for anyone.
2. **Round.** The groups not settled join the frame's open round. Per group the first member to
   arrive publishes its hash and its full record; every other member compares hashes only and
   fetches the record only on a mismatch, to name the first differing collective. Counters
   (``Store.add``) tell when every group discovered in the round has all its members: the
   *component* of ranks linked through shared groups is then complete, its verdict is sealed in
   one key, and every waiting rank reads it. Store operations per rank: a constant plus a few per
   group, whatever the world size.
3. **Verdict.** Any mismatch in the round, or a rank a settled group forces to the program as
   written, seals "fallback": every rank of the round (so every rank linked to the mismatching
   group through any shared group) runs the program as written. A rank that does not see the
   seal within ``Config.agreement_timeout_s`` seals "abort", which releases every waiting rank at
   once and means fallback too; a rank arriving after that reads the settled fallback.
4. **Conflict.** A rank whose settled groups require a program it does not have (it recompiled
   alone and its compiled sequence differs from what its peers settled on, and so does its
   program as written) cannot match its peers: it raises :class:`AgreementError` naming the
   difference rather than issuing a collective (docs/limitations.md says what remains).

There is one warning naming the first differing collective, from the rank that found it (or from
the rank that timed out); the others log the verdict on the ``commfuse`` logger.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from commfuse.core.errors import CommfuseError
from commfuse.core.meta import SETTING_META
from commfuse.ir.collective import Collective
from commfuse.ir.graph_ir import CollectiveIR, resolve_group_info
from commfuse.ir.kinds import CollectiveKind

log = logging.getLogger(__name__)

# Config.check_agreement: fall back to the program as written, raise, or no check at all
MODES = ("fallback", "raise", "off")
STORE_PREFIX = "commfuse/agreement/v2/"
# The graphs of one frame in the order they run; "joint" and "dynamo" are not executed.
GRAPH_ORDER = ("inference", "forward", "backward")

_PAIRWISE = frozenset(
    {CollectiveKind.SEND, CollectiveKind.RECV, CollectiveKind.BATCH_P2P, CollectiveKind.P2P}
)
# a symbolic size as sympy prints Dynamo's symbols: s0 (backed), u0 (unbacked), ...
_SYMBOL = re.compile(r"\b[a-z]{1,2}\d+\b")


class AgreementError(CommfuseError):
    """Ranks would issue different collectives and this rank cannot run a program that matches
    its peers' (or ``Config(check_agreement="raise")`` asked for an error instead of a fallback)."""


# --------------------------------------------------------------------------- what is compared
def _norm(x: Any) -> Any:
    """Sizes as strings, a symbolic size as ``?`` (its value is known only when the graph runs)."""
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if x is None or isinstance(x, bool):
        return x
    s = str(x)
    return "?" if _SYMBOL.search(s) else s


def _shapes(c: Collective) -> list:
    stand_in = c.extra.get("signature_shapes")
    if stand_in is not None:  # boundary ops: a rank-independent stand-in (ops/boundary/ir_view.py)
        return _norm(stand_in)
    out: list[Any] = []
    for shape in c.input_shapes:
        if shape is None:
            out.append(None)
            continue
        dims = _norm(shape)
        if c.kind is CollectiveKind.ALL_TO_ALL and c.extra.get("rank_local_sizes") and dims:
            dims[0] = "*"  # this rank's split sizes: another rank sends and receives other amounts
        out.append(dims)
    return out


def collective_signature(c: Collective) -> Optional[list]:
    """What must agree between the members of ``c``'s group; None: not compared (a pairwise
    transfer, see the module docstring)."""
    if c.kind in _PAIRWISE:
        return None
    boundary = c.extra.get("boundary")
    if c.kind is CollectiveKind.M2MS and boundary is not None and set(boundary.src) != set(boundary.dst):
        return None  # a stage boundary: the two sides run different frames
    setting = c.start.meta.get(SETTING_META)
    return [
        c.kind.value,
        c.reduce_op,
        str(c.dtype).replace("torch.", "") if c.dtype is not None else None,
        _shapes(c),
        bool(c.coalesced),
        json.dumps(setting, sort_keys=True, default=str) if setting else None,
    ]


GroupKey = tuple  # member ranks in group-rank order


def graph_sequences(ir: CollectiveIR) -> tuple[dict[GroupKey, list[list]], int]:
    """Per group (member ranks), the signatures of ``ir``'s collectives on it in graph (= issue)
    order, the exchanges ops issue from their kernels included; and how many collectives were
    left out because their group's ranks are unknown."""
    order = {n: i for i, n in enumerate(ir.gm.graph.nodes)}
    items: list[tuple[int, Optional[tuple], list]] = []
    for c in ir.collectives:
        sig = collective_signature(c)
        if sig is not None:
            items.append((order[c.start], c.group.ranks, sig))
    for e in ir.embedded:
        for t in e.transfers:
            ranks = resolve_group_info(t.group).ranks
            # sizes follow the routing, which is this rank's: kind and purpose only
            items.append(
                (order[e.node], ranks, [t.kind.value, None, None, [["*"]], False, f"embedded:{t.what}"])
            )
    seqs: dict[GroupKey, list[list]] = {}
    unknown = 0
    for _pos, ranks, sig in sorted(items, key=lambda it: it[0]):
        if ranks is None:
            unknown += 1
            continue
        seqs.setdefault(tuple(ranks), []).append(sig)
    return seqs, unknown


@dataclass
class FrameRecord:
    """The collectives of the graphs compiled for one frame on this rank, per group."""

    graphs: dict[str, dict[GroupKey, list[list]]] = field(default_factory=dict)
    unknown_groups: int = 0

    def add(self, graph: str, ir: CollectiveIR) -> None:
        """Record (or replace: a later stage of the same graph) ``graph``'s collectives."""
        if graph not in GRAPH_ORDER:
            return
        self.graphs[graph], unknown = graph_sequences(ir)
        self.unknown_groups += unknown

    def sequences(self) -> dict[GroupKey, list[list]]:
        """Per group, ``[graph, *signature]`` in the order the frame's graphs run."""
        out: dict[GroupKey, list[list]] = {}
        for graph in GRAPH_ORDER:
            for ranks, sigs in self.graphs.get(graph, {}).items():
                out.setdefault(ranks, []).extend([graph, *s] for s in sigs)
        return out


def sequence_hash(seq: list, salt: str = "") -> str:
    return hashlib.sha256(json.dumps([salt, seq], sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class GroupEntry:
    """One group of a frame on this rank: what runs on it compiled and as written."""

    ranks: GroupKey
    compiled: str  # hash of the compiled program's sequence on the group
    fallback: str  # hash of the program as written's sequence on the group
    compiled_sigs: tuple = ()
    fallback_sigs: tuple = ()

    @property
    def gid(self) -> str:
        return hashlib.sha256(",".join(map(str, self.ranks)).encode()).hexdigest()[:12]

    def describe(self) -> str:
        return f"ranks {list(self.ranks)}"


# The compiled sequence of a graph commfuse's hooks did not see (a compile-cache hit): unknown.
CACHED = "*"


def group_entries(compiled: FrameRecord, fallback: FrameRecord) -> list[GroupEntry]:
    """The groups either program issues collectives on (a group one of them leaves silent gets
    an empty sequence there), with both hashes. Where the compiled record misses a graph the
    program as written has, the graph came from a compile cache and commfuse's passes did not
    run on it here: its compiled hash is ``CACHED``, which takes part in the exchange without
    being compared (the cache key covers everything the passes decide from)."""
    a, b = compiled.sequences(), fallback.sequences()
    cached = not set(fallback.graphs) <= set(compiled.graphs)
    return [
        GroupEntry(
            ranks,
            CACHED if cached else sequence_hash(a.get(ranks, [])),
            sequence_hash(b.get(ranks, [])),
            tuple(map(tuple, a.get(ranks, []))),
            tuple(map(tuple, b.get(ranks, []))),
        )
        for ranks in sorted(set(a) | set(b))
    ]


def _describe_sig(sig: Optional[list]) -> str:
    if sig is None:
        return "no collective"
    graph, kind, op, dtype, shapes, _coalesced, setting = list(sig) + [None] * (7 - len(sig))
    ins = ", ".join(
        "[" + ", ".join(map(str, s)) + "]" if isinstance(s, (list, tuple)) else str(s) for s in (shapes or [])
    )
    extra = "".join(f", {x}" for x in (op, setting) if x)
    return f"{kind}({dtype}, in {ins}{extra}) in the {graph} graph"


def first_difference(
    mine: list, theirs: list, *, me: str = "this rank", them: str = "the peer"
) -> Optional[str]:
    """A sentence naming the first collective at which two sequences differ, or None."""
    mine, theirs = [list(s) for s in mine], [list(s) for s in theirs]
    for i in range(max(len(mine), len(theirs))):
        x = mine[i] if i < len(mine) else None
        y = theirs[i] if i < len(theirs) else None
        if x != y:
            return f"collective #{i}: {them} issues {_describe_sig(y)} but {me} issues {_describe_sig(x)}"
    return None


def _config_difference(mine: dict, theirs: dict, *, me: str, them: str) -> str:
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if not keys:
        return "the same collectives, compiled under settings that differ"
    shown = "; ".join(f"{k}: {them} {theirs.get(k)!r}, {me} {mine.get(k)!r}" for k in keys[:4])
    return (
        f"the same collectives, compiled under different settings ({shown}{'; ...' if len(keys) > 4 else ''})"
    )


# --------------------------------------------------------------------------- the exchange
@dataclass
class Verdict:
    """What this rank runs: ``"compiled"``, ``"fallback"`` (the program as written) or
    ``"conflict"`` (neither matches what its peers settled on)."""

    action: str
    reason: Optional[str] = None
    warn: bool = False  # this rank found the difference (or timed out): it prints the warning
    rounds: int = 0  # rounds of the Store exchange this rank took part in (0: all groups settled)
    timed_out: bool = False
    frame: str = ""
    # what the exchange cost this rank: wall time, Store requests, bytes of their keys and values
    seconds: float = 0.0
    store_ops: int = 0
    store_bytes: int = 0
    groups: tuple = ()  # the groups compared (GroupEntry), as this rank saw them
    # what the net cost at compile time (the backend fills them): seconds to compile the program
    # as written, and to compile the frame itself
    compile_as_written_s: float = 0.0
    compile_s: float = 0.0


_VOID = object()


class _CountedStore:
    """The Store calls the exchange makes, counted: requests and the bytes of their keys and values
    both ways (what the agreement costs; TCP framing not included)."""

    def __init__(self, store) -> None:
        self._s = store
        self.ops = 0
        self.bytes = 0

    def _count(self, *parts: Any) -> None:
        self.ops += 1
        self.bytes += sum(len(p) if isinstance(p, (str, bytes)) else 8 for p in parts)

    def add(self, key: str, n: int) -> int:
        v = self._s.add(key, n)
        self._count(STORE_PREFIX + key, n, v)
        return v

    def set(self, key: str, value: str) -> None:
        self._s.set(key, value)
        self._count(STORE_PREFIX + key, value)

    def get(self, key: str) -> bytes:
        v = self._s.get(key)
        self._count(STORE_PREFIX + key, v)
        return v

    def check(self, keys: list[str]) -> bool:
        v = self._s.check(keys)
        self._count(*(STORE_PREFIX + k for k in keys), 1)
        return v

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        v = self._s.compare_set(key, expected, desired)
        self._count(STORE_PREFIX + key, expected, desired, v)
        return v

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._count(*(STORE_PREFIX + k for k in keys), 8)
        self._s.wait(keys, timeout)


class Exchange:
    """One rank's side of the agreement exchange for one compiled frame (see the module
    docstring). ``store``: a c10d Store every rank reaches (keys go under ``STORE_PREFIX``);
    ``frame``: the frame's identity, the same on every rank; ``config_digest``: the settings the
    frame was compiled under; ``config_summary``: those settings in words, published with the
    record so a difference can be named."""

    def __init__(
        self,
        store,
        *,
        frame: str,
        config_digest: str,
        rank: int,
        timeout_s: float,
        config_summary: Optional[dict] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import torch.distributed as dist

        self.store = _CountedStore(dist.PrefixStore(STORE_PREFIX, store))
        self.frame = hashlib.sha256(frame.encode()).hexdigest()[:16]
        self.frame_name = frame
        self.config_digest = config_digest
        self.config_summary = config_summary or {}
        self.rank = rank
        self.timeout_s = timeout_s
        self.clock = clock
        self._deadline = 0.0

    # -- store helpers -------------------------------------------------------------------------
    def _remaining(self) -> float:
        return self._deadline - self.clock()

    def _get(self, key: str) -> Optional[str]:
        """The value of ``key``, waiting for it until the deadline; None if it never came."""
        if not self.store.check([key]):
            left = self._remaining()
            if left <= 0:
                return None
            try:
                self.store.wait([key], datetime.timedelta(seconds=left))
            except Exception:  # noqa: BLE001 - the Store's timeout is a RuntimeError / DistStoreError
                return None
        return self.store.get(key).decode()

    def _peek(self, key: str) -> Optional[str]:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _settled_key(self, e: GroupEntry) -> str:
        return f"s/{self.frame}/{self.config_digest}/{e.gid}/{e.fallback}"

    def _open_key(self) -> str:
        return f"r/{self.frame}/open"

    def _round_key(self, r: int, name: str) -> str:
        return f"r/{self.frame}/{r}/{name}"

    def _group_key(self, r: int, e: GroupEntry, name: str) -> str:
        return f"r/{self.frame}/{r}/g/{e.gid}/{name}"

    def _value(self, e: GroupEntry) -> str:
        # what two members must share: the program as written and the compiled program with its settings
        return f"{e.fallback}:{sequence_hash([e.compiled], self.config_digest)}"

    # -- the protocol ----------------------------------------------------------------------------
    def run(self, entries: Iterable[GroupEntry]) -> Verdict:
        start = self.clock()
        entries = list(entries)
        verdict = self._run(entries)
        verdict.seconds = self.clock() - start
        verdict.store_ops, verdict.store_bytes = self.store.ops, self.store.bytes
        verdict.groups = tuple(entries)
        return verdict

    def _run(self, entries: list[GroupEntry]) -> Verdict:
        self._deadline = self.clock() + self.timeout_s
        if not entries:
            return Verdict("compiled")
        settled: dict[GroupEntry, str] = {}
        for e in entries:
            v = self._peek(self._settled_key(e))
            if v is not None:
                settled[e] = v
        compiled_ok = all(
            v == f"compiled:{e.compiled}" or (e.compiled == CACHED and v.startswith("compiled:"))
            for e, v in settled.items()
        )
        fallback_ok = all(v == "fallback" or v == f"compiled:{e.fallback}" for e, v in settled.items())
        new = [e for e in entries if e not in settled]
        if not new:
            if compiled_ok:
                return Verdict("compiled")
            if fallback_ok:
                return Verdict("fallback", reason=self._settled_reason(settled, compiled=True))
            return Verdict("conflict", reason=self._settled_reason(settled, compiled=True))
        forced = None if compiled_ok else self._settled_reason(settled, compiled=True)
        verdict = self._round(new, forced)
        if verdict.action == "compiled" and not compiled_ok:
            verdict = Verdict("conflict", self._settled_reason(settled, compiled=True), rounds=verdict.rounds)
        elif verdict.action == "fallback" and not fallback_ok:
            verdict = Verdict(
                "conflict",
                f"{verdict.reason}; and {self._settled_reason(settled, compiled=False)}",
                rounds=verdict.rounds,
                timed_out=verdict.timed_out,
            )
        return verdict

    def _settled_reason(self, settled: dict[GroupEntry, str], *, compiled: bool) -> str:
        """Why the settled groups do not allow this rank's compiled (or as-written) program."""
        for e, v in settled.items():
            mine = e.compiled if compiled else e.fallback
            if v == "fallback" and compiled:
                return (
                    f"the group of {e.describe()} settled on the program as written in an earlier exchange "
                    f"for this frame (frame {self.frame_name})"
                )
            if v.startswith("compiled:") and v != f"compiled:{mine}":
                what = "compiled program" if compiled else "program as written"
                return (
                    f"on the group of {e.describe()} the peers run a compiled sequence settled in an earlier "
                    f"exchange for this frame (hash {v.split(':', 1)[1]}), and this rank's {what} issues "
                    f"another (hash {mine}) (frame {self.frame_name})"
                )
        return "the groups' settled verdicts differ"

    def _open_round(self) -> int:
        key = self._open_key()
        r = int(self.store.compare_set(key, "", "0").decode())
        while self.store.check([self._round_key(r, "seal")]):
            r = int(self.store.compare_set(key, str(r), str(r + 1)).decode())
        return r

    def _round(self, new: list[GroupEntry], forced: Optional[str]) -> Verdict:
        r = self._open_round()
        rounds = 0
        while True:
            rounds += 1
            out = self._join(r, new, forced)
            if out is not _VOID:
                assert isinstance(out, Verdict)
                out.rounds = rounds
                self._settle(new, out.action)
                return out
            # this rank's groups arrived after the round was sealed for the ranks before them
            r = int(self.store.compare_set(self._open_key(), str(r), str(r + 1)).decode())

    def _join(self, r: int, new: list[GroupEntry], forced: Optional[str]):
        s = self.store
        my_idx: Optional[int] = None
        problem = forced
        # 1. every group: the first member counts it in the round; the first to publish a hash
        #    sets the reference, every other member compares with it (hashes only)
        for e in new:
            if s.add(self._group_key(r, e, "touch"), 1) == 1:
                idx = s.add(self._round_key(r, "disc"), 1)
                my_idx = idx if my_idx is None else my_idx
                s.set(self._group_key(r, e, "idx"), str(idx))
            if e.compiled == CACHED:
                continue  # nothing to compare: it runs what the cache holds, or the fallback
            mine = self._value(e)
            won = s.compare_set(self._group_key(r, e, "ref"), "", f"{mine}|{self.rank}").decode()
            ref, _, writer = won.rpartition("|")
            if writer == str(self.rank):
                s.set(
                    self._group_key(r, e, "rec"),
                    json.dumps(
                        {
                            "rank": self.rank,
                            "compiled": e.compiled_sigs,
                            "fallback": e.fallback_sigs,
                            "config": self.config_summary,
                        }
                    ),
                )
            elif ref != mine and problem is None:
                problem = self._describe_mismatch(e, self._get(self._group_key(r, e, "rec")))
        if problem is not None:
            s.add(self._round_key(r, "bad"), 1)
            s.compare_set(self._round_key(r, "why"), "", f"{self.rank}|{problem}")
        # 2. every group: arrive; the last member of the last group of the component seals
        for e in new:
            if s.add(self._group_key(r, e, "arr"), 1) == len(e.ranks):
                done = s.add(self._round_key(r, "comp"), 1)
                if done == int(s.get(self._round_key(r, "disc")).decode()):
                    bad = self._peek(self._round_key(r, "bad"))
                    s.compare_set(
                        self._round_key(r, "seal"), "", f"{done}:{'fallback' if bad else 'compiled'}"
                    )
        # 3. the verdict: the seal, or this rank's own "abort" when none came in time
        seal = self._get(self._round_key(r, "seal"))
        if seal is None:
            seal = self._abort(r, new)
        if seal.startswith("abort:"):
            rank, _, why = seal[len("abort:") :].partition("|")
            return Verdict("fallback", why, warn=rank == str(self.rank), timed_out=True)
        level, _, action = seal.partition(":")
        if my_idx is None:
            my_idx = int(self._get(self._group_key(r, new[0], "idx")) or 0)
        if my_idx > int(level):
            if self._remaining() > 0:
                return _VOID
            return Verdict(
                "fallback",
                f"no verdict within {self.timeout_s:g} s (Config.agreement_timeout_s) "
                f"(frame {self.frame_name})",
                timed_out=True,
            )
        if action == "compiled":
            return Verdict("compiled")
        why = self._peek(self._round_key(r, "why")) or "|a rank of the round fell back"
        rank, _, reason = why.partition("|")
        return Verdict("fallback", reason, warn=rank == str(self.rank))

    def _abort(self, r: int, new: list[GroupEntry]) -> str:
        """Seal the round as timed out, which releases every rank waiting in it (they all fall
        back); the seal that holds (a normal one may have come first)."""
        missing = []
        for e in new:
            arrived = int(self._peek(self._group_key(r, e, "arr")) or 0)
            if arrived < len(e.ranks):
                missing.append(f"{arrived} of {len(e.ranks)} members of the group of {e.describe()} arrived")
        why = (
            f"no verdict within {self.timeout_s:g} s (Config.agreement_timeout_s): "
            f"{'; '.join(missing) or 'ranks linked through other groups did not arrive'} (frame {self.frame_name})"
        )
        return self.store.compare_set(self._round_key(r, "seal"), "", f"abort:{self.rank}|{why}").decode()

    def _settle(self, new: list[GroupEntry], action: str) -> None:
        for e in new:
            if action == "fallback":
                self.store.compare_set(self._settled_key(e), "", "fallback")
            elif e.compiled != CACHED:  # the members that compiled say what runs
                self.store.compare_set(self._settled_key(e), "", f"compiled:{e.compiled}")

    def _describe_mismatch(self, e: GroupEntry, rec_text: Optional[str]) -> str:
        where = f"on the group of {e.describe()} (frame {self.frame_name})"
        if rec_text is None:
            return f"{where}: the collective sequences differ"
        rec = json.loads(rec_text)
        them, me = f"rank {rec['rank']}", f"rank {self.rank}"
        diff = first_difference(list(e.fallback_sigs), rec["fallback"], me=me, them=them)
        if diff is not None:
            return f"{where}: the program as written differs between ranks: {diff}"
        diff = first_difference(list(e.compiled_sigs), rec["compiled"], me=me, them=them)
        if diff is not None:
            return f"{where}: {diff}"
        return f"{where}: " + _config_difference(self.config_summary, rec.get("config", {}), me=me, them=them)


# --------------------------------------------------------------------------- first execution
class FirstRunChoice:
    """The compiled frame Dynamo calls: at its first call, the exchange decides whether this
    rank runs ``compiled`` or ``fallback`` (the program as written, compiled at the same time);
    every later call goes straight to the one chosen. ``decide() -> Verdict``."""

    def __init__(
        self,
        compiled: Callable,
        fallback: Callable,
        decide: Callable[[], Verdict],
        *,
        mode: str,
        on_verdict: Optional[Callable[[Verdict], None]] = None,
    ) -> None:
        self.__wrapped__ = compiled
        for k, v in getattr(compiled, "__dict__", {}).items():
            self.__dict__.setdefault(k, v)
        self._compiled: Optional[Callable] = compiled
        self._fallback: Optional[Callable] = fallback
        self._decide = decide
        self._mode = mode
        self._on_verdict = on_verdict
        self._chosen: Optional[Callable] = None
        self._lock = threading.Lock()
        self.verdict: Optional[Verdict] = None

    def __call__(self, *args: Any) -> Any:
        fn = self._chosen
        if fn is None:
            with self._lock:
                if self._chosen is None:
                    self._chosen = self._choose()
            fn = self._chosen
        return fn(*args)

    def _choose(self) -> Callable:
        verdict = self.verdict = self._decide()
        if self._on_verdict is not None:
            self._on_verdict(verdict)
        compiled, fallback = self._compiled, self._fallback
        self._compiled = self._fallback = None  # keep only what runs
        assert compiled is not None and fallback is not None
        if verdict.action == "compiled":
            return compiled
        if verdict.action == "conflict":
            raise AgreementError(
                "cross-rank collective disagreement that a fallback cannot resolve "
                f"(this rank stops instead of issuing a collective that would hang): {verdict.reason}"
            )
        if self._mode == "raise":
            raise AgreementError(
                f"cross-rank collective disagreement (training would hang or corrupt data): {verdict.reason}"
            )
        return fallback


def report_verdict(verdict: Verdict, frame: str) -> None:
    """One warning for the rank that found the difference (or timed out); a log line elsewhere."""
    import warnings

    if verdict.action != "fallback":
        if verdict.action == "compiled":
            log.debug(
                "commfuse: agreement on frame %s: compiled program (%d round(s))", frame, verdict.rounds
            )
        return
    msg = (
        f"commfuse: the ranks' compiled programs differ, so every rank linked to the difference through a "
        f"shared process group runs the program as written (the graph without commfuse's passes) for this "
        f"frame: {verdict.reason}"
    )
    if verdict.warn:
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
    else:
        log.info("%s", msg)
