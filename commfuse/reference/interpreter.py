"""The reference interpreter: N ranks of an FX program in one process, on real tensors.

Every rank has its own environment (node -> value). Ranks run node by node; a
compute node calls its op on that rank's tensors; a collective blocks its rank until
every member of its group has reached a collective on that group, then the
collective's semantic function (:mod:`.semantics`) computes every member's result
from all members' inputs; ``wait_tensor`` is the identity. Group-synchronous ops
(ops that communicate inside their kernel, e.g. ``commfuse::moe_layer``;
:func:`~.semantics.register_sync_op`) meet like collectives and return their results
directly. Point-to-point sends are buffered (a send never blocks); a receive blocks
until the matching send (same group, source, destination and tag, in order) was
posted.

This is the *meaning* of a collective program, independent of how a backend
overlaps or orders it; the pass fuzzer compares optimised graphs with their input
on it. What it checks on the way: every member of a group issues the same op with
matching arguments (else :class:`CollectiveMismatchError`), group sizes agree with
the group mapping, every rank can proceed (else :class:`DeadlockError`: what would
be a hang), every send is received, and nothing modifies a tensor a collective reads
(its input; for in-place collectives its buffer; for sends the sent tensor) between
the collective and its wait (else :class:`InFlightMutationError`: real backends read
it asynchronously until the wait).

Two ways to give the program:

* one ``GraphModule`` for all ranks (an SPMD graph, e.g. traced on rank 0): all
  ranks run the same nodes; sub-groups are given as partitions (see :mod:`.groups`);
* a list of ``N`` GraphModules, one per rank (e.g. traced on every rank of a fake
  world): needed when ranks differ in more than group names, e.g. p2p peers or
  uneven all_to_all splits. The graphs may differ in structure; only their
  collective sequences must match up.

Collective results are contiguous, as the real functional collectives allocate them
(whatever the input's strides). Uninitialised memory (``empty``, ``empty_like``,
``new_empty``, ``empty_strided``) is
filled with NaN (floating dtypes) or 0, so a program that reads it gives the same
answer every run and a rewrite that starts reading it shows up as NaNs. Random ops
(``rand``, ``dropout``, ...) use the global generator and are not reproducible
across a rewrite that reorders them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from commfuse.ir.kinds import CollectiveOpSpec, collective_spec, is_wait
from commfuse.reference.errors import (
    CollectiveMismatchError,
    DeadlockError,
    InFlightMutationError,
    ReferenceSemanticsError,
    UnknownCollectiveError,
)
from commfuse.reference.groups import GroupSpec, GroupTable
from commfuse.reference.semantics import (
    P2PPlan,
    RankCall,
    Semantics,
    SyncOpSpec,
    _op_name,
    semantics_for,
    sync_op_spec,
)

aten = torch.ops.aten

_UNINITIALISED = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.empty_strided.default,
    aten.new_empty_strided.default,
}
# Namespaces whose ops communicate: an op from here that is not in the collective table
# must not be run as if it were local compute.
_COMM_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"}

_PLACEHOLDER, _GET_ATTR, _CALL, _METHOD, _MODULE, _COLLECTIVE, _WAIT, _OUTPUT, _SYNC = range(9)


class _Ref:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _has_ref(a: Any) -> bool:
    if type(a) is _Ref:
        return True
    if isinstance(a, (tuple, list)):
        return any(_has_ref(x) for x in a)
    if isinstance(a, dict):
        return any(_has_ref(x) for x in a.values())
    return False


def _load(a: Any, env: list) -> Any:
    t = type(a)
    if t is _Ref:
        return env[a.i]
    if t is tuple:
        return tuple([_load(x, env) for x in a])
    if t is list:
        return [_load(x, env) for x in a]
    if t is dict:
        return {k: _load(v, env) for k, v in a.items()}
    return a


@dataclass
class _Instr:
    kind: int
    node: fx.Node
    target: Any
    args: Any
    kwargs: Any
    dynamic: bool  # args reference other nodes
    spec: CollectiveOpSpec | None = None
    sem: Semantics | None = None
    fill: bool = False
    sync: SyncOpSpec | None = None


def _template(a: Any, index: dict) -> Any:
    """Node args with nodes replaced by env indices and FX's immutable containers by plain ones."""
    if isinstance(a, fx.Node):
        return _Ref(index[a])
    if isinstance(a, tuple):
        return tuple(_template(x, index) for x in a)
    if isinstance(a, list):
        return [_template(x, index) for x in a]
    if isinstance(a, dict):
        return {k: _template(v, index) for k, v in a.items()}
    return a


def _compile(gm: fx.GraphModule) -> list[_Instr]:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    prog: list[_Instr] = []
    for n in gm.graph.nodes:
        args = _template(n.args, index)
        kwargs = _template(dict(n.kwargs), index)
        dyn = _has_ref(args) or _has_ref(kwargs)
        t = n.target
        if n.op == "placeholder":
            prog.append(_Instr(_PLACEHOLDER, n, t, args, kwargs, dyn))
        elif n.op == "get_attr":
            obj = gm
            for part in str(t).split("."):
                obj = getattr(obj, part)
            prog.append(_Instr(_GET_ATTR, n, obj, args, kwargs, dyn))
        elif n.op == "output":
            prog.append(_Instr(_OUTPUT, n, t, args, kwargs, dyn))
        elif n.op == "call_method":
            prog.append(_Instr(_METHOD, n, t, args, kwargs, dyn))
        elif n.op == "call_module":
            prog.append(_Instr(_MODULE, n, gm.get_submodule(t), args, kwargs, dyn))
        elif is_wait(t):
            prog.append(_Instr(_WAIT, n, t, args, kwargs, dyn))
        elif (sync := sync_op_spec(t)) is not None:
            prog.append(_Instr(_SYNC, n, t, args, kwargs, dyn, sync=sync))
        else:
            spec = collective_spec(t)
            if spec is not None:
                prog.append(
                    _Instr(_COLLECTIVE, n, t, args, kwargs, dyn, spec=spec, sem=semantics_for(t, spec))
                )
                continue
            ns = getattr(t, "namespace", None)
            if ns in _COMM_NAMESPACES:
                raise UnknownCollectiveError(
                    f"node {n.name}: {_op_name(t)} communicates but is not a registered collective; register it with "
                    f"commfuse.ir.register_collective_op and its semantics with commfuse.reference.register_semantics"
                )
            prog.append(_Instr(_CALL, n, t, args, kwargs, dyn, fill=t in _UNINITIALISED))
    return prog


@dataclass
class _Rank:
    rank: int
    prog: list[_Instr]
    env: list
    pc: int = 0
    done: bool = False
    outputs: Any = None
    # blocked state
    wait_key: tuple | None = None  # rendezvous key
    p2p: tuple[P2PPlan, RankCall, list[tuple]] | None = None  # plan, call, mailbox keys of its receives
    # id(result tensor) -> (node, [(tensor read by the collective, its bits at issue)]): checked at the wait
    inflight: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.inflight = {}


class ReferenceInterpreter:
    """Run one SPMD graph (or one graph per rank) for all ranks of a world of ``world_size``.

    ``groups``: group name -> ranks (see :mod:`commfuse.reference.groups`); None = every
    group is the world. ``run(inputs)`` takes one sequence of placeholder values per rank
    and returns one output structure per rank.
    """

    def __init__(
        self,
        graphs: fx.GraphModule | Sequence[fx.GraphModule],
        world_size: int,
        groups: Mapping[str, GroupSpec] | None = None,
        *,
        fill_uninitialised: float = math.nan,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        if isinstance(graphs, fx.GraphModule):
            prog = _compile(graphs)
            self._progs = [prog] * world_size
        else:
            graphs = list(graphs)
            if len(graphs) != world_size:
                raise ValueError(
                    f"got {len(graphs)} graphs for a world of {world_size} ranks "
                    f"(give one graph, or one per rank)"
                )
            cache: dict[int, list[_Instr]] = {}
            for g in graphs:
                if id(g) not in cache:
                    cache[id(g)] = _compile(g)
            self._progs = [cache[id(g)] for g in graphs]
        self.groups = GroupTable(world_size, groups)
        self.fill_uninitialised = fill_uninitialised

    # ------------------------------------------------------------------ running
    def run(self, inputs: Sequence[Sequence[Any]], *, clone_inputs: bool = True) -> list[Any]:
        n = self.world_size
        if len(inputs) != n:
            raise ValueError(f"need one input list per rank ({n}), got {len(inputs)}")
        ranks: list[_Rank] = []
        for r in range(n):
            prog = self._progs[r]
            env: list = [None] * len(prog)
            vals = list(inputs[r])
            phs = [i for i, ins in enumerate(prog) if ins.kind == _PLACEHOLDER]
            if len(vals) != len(phs):
                raise ValueError(
                    f"rank {r}: the graph has {len(phs)} placeholders but {len(vals)} inputs were given"
                )
            for i, v in zip(phs, vals, strict=True):
                env[i] = v.clone() if clone_inputs and isinstance(v, torch.Tensor) else v
            ranks.append(_Rank(r, prog, env))
        self._rv: dict[tuple, dict[int, tuple[_Rank, RankCall]]] = {}
        self._mail: dict[tuple, deque] = {}
        runnable = deque(ranks)
        self._runnable = runnable
        self._ranks = ranks
        while runnable:
            st = runnable.popleft()
            if not st.done:
                self._advance(st)
        stuck = [st for st in ranks if not st.done]
        if stuck:
            raise DeadlockError(self._describe_stuck(stuck))
        left = {k: len(q) for k, q in self._mail.items() if q}
        if left:
            lines = [
                f"rank {src} sent {cnt} message(s) to rank {dst} (group {name!r}, tag {tag}) that were never "
                f"received"
                for (name, _blk, src, dst, tag), cnt in sorted(left.items())
            ]
            raise DeadlockError("unmatched sends (the sender's wait would hang):\n  " + "\n  ".join(lines))
        return [st.outputs for st in ranks]

    def _advance(self, st: _Rank) -> None:
        prog, env = st.prog, st.env
        while True:
            if st.p2p is not None:
                if not self._try_finish_p2p(st):
                    return
                continue
            ins = prog[st.pc]
            k = ins.kind
            if k == _CALL:
                if ins.dynamic:
                    out = ins.target(*_load(ins.args, env), **_load(ins.kwargs, env))
                else:
                    out = ins.target(*ins.args, **ins.kwargs)
                if ins.fill:
                    self._fill(out)
                env[st.pc] = out
                st.pc += 1
            elif k == _WAIT:
                val = _load(ins.args, env)[0]
                if st.inflight:
                    self._check_inflight(st, val, ins.node)
                env[st.pc] = val
                st.pc += 1
            elif k == _COLLECTIVE:
                if not self._collective(st, ins):
                    return
            elif k == _SYNC:
                if not self._sync_op(st, ins):
                    return
            elif k == _PLACEHOLDER:
                st.pc += 1
            elif k == _GET_ATTR:
                env[st.pc] = ins.target
                st.pc += 1
            elif k == _METHOD:
                self_obj, *rest = _load(ins.args, env)
                env[st.pc] = getattr(self_obj, ins.target)(*rest, **_load(ins.kwargs, env))
                st.pc += 1
            elif k == _MODULE:
                env[st.pc] = ins.target(*_load(ins.args, env), **_load(ins.kwargs, env))
                st.pc += 1
            else:  # output
                st.outputs = _load(ins.args, env)[0]
                st.done = True
                return

    def _fill(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            if out.is_floating_point() or out.is_complex():
                out.fill_(self.fill_uninitialised)
            else:
                out.zero_()

    # ------------------------------------------------------------ collectives
    def _call(self, st: _Rank, ins: _Instr) -> RankCall:
        a = _load(ins.args, st.env)
        kw = _load(ins.kwargs, st.env)
        try:
            parsed = ins.spec.parse(tuple(a), dict(kw))
        except (IndexError, KeyError) as e:
            raise CollectiveMismatchError(
                f"rank {st.rank} node {ins.node.name}: cannot read the arguments of "
                f"{_op_name(ins.target)}: {e!r}"
            ) from e
        block = self.groups.resolve(parsed.group_name, st.rank)
        return RankCall(
            rank=st.rank,
            group_rank=block.index(st.rank),
            group=block,
            group_name=parsed.group_name,
            args=parsed,
            raw_args=tuple(a),
            raw_kwargs=dict(kw),
            spec=ins.spec,
            node=ins.node,
            target=ins.target,
        )

    def _collective(self, st: _Rank, ins: _Instr) -> bool:
        call = self._call(st, ins)
        if ins.sem.p2p:
            plan = ins.sem.fn(call)
            self._post_sends(st, call, plan)
            keys = []
            for peer, tag, _buf in plan.recvs:
                src = self._peer(call, peer)
                keys.append((call.group_name, call.group, src, st.rank, int(tag)))
            st.p2p = (plan, call, keys)
            return self._try_finish_p2p(st)
        members = self._meet(st, call)
        if members is None:
            return False
        calls = [c for _, c in members]
        results = self._apply(ins.sem.fn, ins.sem.name, calls)
        for (mst, c), res in zip(members, results, strict=True):
            if c.spec.inplace:
                res = _write_inplace(c, res)
            else:
                res = _dense(res)
            _watch(mst, c, res, c.tensors)
            self._deliver(st, mst, res)
        return True

    def _meet(self, st: _Rank, call: RankCall) -> list[tuple[_Rank, RankCall]] | None:
        """Rendezvous on ``call``'s group: None while members are missing (``st`` blocks), else
        every member's (state, call) in group-rank order, checked to issue the same op."""
        key = (call.group_name, call.group)
        arrived = self._rv.setdefault(key, {})
        arrived[st.rank] = (st, call)
        st.wait_key = key
        if len(arrived) < len(call.group):
            return None
        del self._rv[key]
        members = [arrived[r] for r in call.group]
        calls = [c for _, c in members]
        targets = {c.target for c in calls}
        if len(targets) > 1:
            ops = "; ".join(c.where() for c in calls)
            raise CollectiveMismatchError(
                f"ranks of group {call.group_name!r} {list(call.group)} issue different collectives: {ops}"
            )
        return members

    @staticmethod
    def _apply(fn, name: str, calls: list[RankCall]) -> list[Any]:
        results = fn(calls)
        if len(results) != len(calls):
            raise ReferenceSemanticsError(
                f"semantics {name} returned {len(results)} results for {len(calls)} ranks"
            )
        return results

    def _deliver(self, st: _Rank, mst: _Rank, res: Any) -> None:
        mst.env[mst.pc] = res
        mst.pc += 1
        mst.wait_key = None
        if mst is not st:
            self._runnable.append(mst)

    def _sync_op(self, st: _Rank, ins: _Instr) -> bool:
        """A group-synchronous op (e.g. commfuse::moe_layer): a rendezvous like a collective's;
        the semantics' results are the op's return values (nothing in flight, no wait)."""
        a = _load(ins.args, st.env)
        kw = _load(ins.kwargs, st.env)
        try:
            parsed = ins.sync.parse(tuple(a), dict(kw))
        except (IndexError, KeyError) as e:
            raise CollectiveMismatchError(
                f"rank {st.rank} node {ins.node.name}: cannot read the arguments of "
                f"{_op_name(ins.target)}: {e!r}"
            ) from e
        name = parsed.group_name
        block = (st.rank,) if name in ins.sync.local_names else self.groups.resolve(name, st.rank)
        call = RankCall(
            rank=st.rank,
            group_rank=block.index(st.rank),
            group=block,
            group_name=name,
            args=parsed,
            raw_args=tuple(a),
            raw_kwargs=dict(kw),
            spec=None,
            node=ins.node,
            target=ins.target,
        )
        if name in ins.sync.local_names:
            (res,) = self._apply(ins.sync.fn, ins.sync.name, [call])
            self._deliver(st, st, res)
            return True
        members = self._meet(st, call)
        if members is None:
            return False
        results = self._apply(ins.sync.fn, ins.sync.name, [c for _, c in members])
        for (mst, _c), res in zip(members, results, strict=True):
            self._deliver(st, mst, res)
        return True

    def _peer(self, call: RankCall, peer: int) -> int:
        if not 0 <= peer < len(call.group):
            raise CollectiveMismatchError(
                f"{call.where()}: peer {peer} is not a group rank of group "
                f"{call.group_name!r} {list(call.group)} (peers are group ranks)"
            )
        return call.group[peer]

    def _post_sends(self, st: _Rank, call: RankCall, plan: P2PPlan) -> None:
        for peer, tag, t in plan.sends:
            dst = self._peer(call, peer)
            key = (call.group_name, call.group, st.rank, dst, int(tag))
            self._mail.setdefault(key, deque()).append(t)
            other = self._ranks[dst]
            if other.p2p is not None and other is not st:
                self._runnable.append(other)

    def _try_finish_p2p(self, st: _Rank) -> bool:
        plan, call, keys = st.p2p
        need: dict[tuple, int] = {}
        for key in keys:
            need[key] = need.get(key, 0) + 1
        if any(len(self._mail.get(key, ())) < cnt for key, cnt in need.items()):
            return False
        got = []
        for key, (_peer, _tag, buf) in zip(keys, plan.recvs, strict=True):
            msg = self._mail[key].popleft()
            if msg.shape != buf.shape or msg.dtype != buf.dtype:
                raise CollectiveMismatchError(
                    f"{call.where()} receives {tuple(buf.shape)}/{buf.dtype} from rank {key[2]} (tag {key[4]}) "
                    f"but it sent {tuple(msg.shape)}/{msg.dtype}"
                )
            buf.copy_(msg)
            got.append(buf)
        res = plan.finish(got)
        if plan.sends and not plan.copies_input:
            _watch(st, call, res, _sent_tensors(call))
        st.env[st.pc] = res
        st.pc += 1
        st.p2p = None
        return True

    def _check_inflight(self, st: _Rank, val: Any, wait: fx.Node) -> None:
        entry = st.inflight.pop(id(val), None)
        if entry is None:
            return
        node, watched = entry
        for t, snap in watched:
            if not _same_bits(t, snap):
                raise InFlightMutationError(
                    f"rank {st.rank}: a tensor read by {node.name} ({_op_name(node.target)}) was modified before "
                    f"its wait {wait.name}: the collective may still be reading it (data race)"
                )

    def _describe_stuck(self, stuck: list[_Rank]) -> str:
        lines = []
        for st in stuck:
            ins = st.prog[st.pc]
            where = f"rank {st.rank} is blocked at node {ins.node.name} ({_op_name(ins.target)})"
            if st.wait_key is not None:
                name, block = st.wait_key
                arrived = sorted(self._rv.get(st.wait_key, {}))
                missing = [r for r in block if r not in arrived]
                lines.append(f"{where} on group {name!r} {list(block)}, waiting for ranks {missing}")
            elif st.p2p is not None:
                _plan, _call, keys = st.p2p
                wanted = ", ".join(f"from rank {k[2]} (tag {k[4]})" for k in keys if not self._mail.get(k))
                lines.append(f"{where}, waiting to receive {wanted} on group {keys[0][0]!r}")
            else:
                lines.append(where)
        return "deadlock (on real hardware: a hang):\n  " + "\n  ".join(lines)


def _dense(result: Any) -> Any:
    """Functional collectives return freshly allocated, contiguous tensors (whatever the input's
    strides): so do the reference's results, so that a later ``view`` works exactly when it
    works on real ranks (e.g. ``torch.cat`` of permuted inputs keeps their strides)."""
    if isinstance(result, torch.Tensor):
        return result.contiguous()
    if isinstance(result, (list, tuple)):
        return type(result)(_dense(r) for r in result)
    return result


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _sent_tensors(call: RankCall) -> list[torch.Tensor]:
    if call.spec.coalesced:  # batch_p2p: the isend entries (others: receive buffers, not read)
        a, k = call.raw_args, call.raw_kwargs
        ops = a[0] if len(a) > 0 else k["op_list"]
        tensors = a[3] if len(a) > 3 else k["tensors"]
        return [t if op == "isend" else None for op, t in zip(ops, tensors, strict=True)]
    return [call.tensors[0]]


def _watch(st: _Rank, call: RankCall, result: Any, read: list) -> None:
    """Remember what the collective reads, to check at its wait(s) that nobody modified it."""
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(results) == len(read):  # coalesced: result i is waited separately and covers input i
        pairs = [(r, [t]) for r, t in zip(results, read, strict=True)]
    else:
        pairs = [(r, list(read)) for r in results]
    for r, ts in pairs:
        if isinstance(r, torch.Tensor):
            st.inflight[id(r)] = (call.node, [(t, t.clone()) for t in ts if isinstance(t, torch.Tensor)])


def _write_inplace(call: RankCall, result: Any) -> Any:
    """In-place collectives write their result into the input buffer(s) and return them;
    the `_out` variants (all_gather_into_tensor_out, reduce_scatter_tensor_out) into `out=`."""
    out = call.raw_kwargs.get("out")
    if isinstance(out, torch.Tensor):
        out.copy_(result)
        return out
    bufs = call.tensors
    res = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(res) != len(bufs):
        raise ReferenceSemanticsError(f"{call.where()}: {len(res)} results for {len(bufs)} in-place buffers")
    for b, r in zip(bufs, res, strict=True):
        b.copy_(r)
    return list(bufs) if call.spec.coalesced else bufs[0]


def run_reference(
    graphs: fx.GraphModule | Sequence[fx.GraphModule],
    inputs: Sequence[Sequence[Any]],
    *,
    world_size: int | None = None,
    groups: Mapping[str, GroupSpec] | None = None,
    clone_inputs: bool = True,
) -> list[Any]:
    """Run ``graphs`` for every rank on the reference semantics; returns one output per rank.

    ``inputs[r]`` are rank r's placeholder values; ``world_size`` defaults to ``len(inputs)``.
    """
    n = world_size if world_size is not None else len(inputs)
    return ReferenceInterpreter(graphs, n, groups).run(inputs, clone_inputs=clone_inputs)


__all__ = ["ReferenceInterpreter", "run_reference"]
