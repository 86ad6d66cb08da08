"""Random hybrid-parallel programs, reproducible from a seed.

:func:`generate_program` builds a :class:`~commfuse.fuzz.program.Program` from a
``random.Random``: chains of matmuls, element-wise ops, layer norms, softmax, a
router-like top-k, residual branches, views/permutes/transposes, in-place updates,
and collectives of every kind over random groups (the world and sub-group
partitions), with random gather/scatter/split/concat dims and shapes chosen
divisible where the collective needs it, in fp32 or bf16, forward-only or joint
(forward + ``torch.autograd.grad``).

*Families* weight the building blocks towards one style of parallelism (``tp``,
``sp``, ``moe``, ``fsdp``, ``pp``, ``coalesced``, ``moe_layer``) or mix them all
(``mixed``); a pass registered with the fuzzer names the families it wants (see
:mod:`.targets`). commfuse's boundary ops (``commfuse::m2ms``, ``commfuse::stage_transfer``)
appear in ``mixed`` and, next to gathers and scatters they could fuse with, in ``pp``
(:meth:`_Gen.b_m2ms`, :meth:`_Gen.b_stage_transfer`). ``moe_layer`` programs put commfuse's MoE layer op behind token
gathers on the group that is also its expert-parallel group (:meth:`_Gen.b_moe_layer`). ``moe``
programs also build a dropless expert exchange from graph ops: uneven all_to_alls around a row
gather, expert matmuls and a row scatter into a fresh buffer (:meth:`_Gen.b_dropless_exchange`).

``group_pairs`` programs (:meth:`_Gen._pair_groups`, :meth:`_Gen.b_adjacent_pair`) run
adjacent collectives (the second reads only the first's result) on two groups a pass must
either equate or tell apart: the same ranks in the same order under two names (a second
``new_group`` of the same ranks, as torchtitan's EP groups are), the same ranks in another
group-rank order, or the two dims of a 2-D mesh. The family is not in the ordinary mix
(:data:`FAMILY_WEIGHTS`): a campaign draws it in a slot of its own
(:func:`commfuse.fuzz.targets.program_for`), so every other program of a seed stays what it was.

``uneven_batch`` programs are data parallel with a local batch of its own on every rank (token-budget
packing, an uneven last batch): the activations' dim 0 differs between ranks (``rows`` of an
input, :data:`BATCH_VARY`), so the program is one graph per rank whose compute shapes differ while
its collectives -- on parameters, parameter shards, their gradients and batch reductions -- agree
in size. Every rank optimises its own graph, so a pass that decided from a rank's local sizes
shows up as mismatched collectives (the reference) or a hang (the executor). Drawn only when
named, like ``group_pairs``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from commfuse.fuzz.program import OPS, Program, _shape_rule

FAMILIES: dict[str, dict[str, float]] = {
    "mixed": {
        "unary": 3,
        "binary": 2,
        "residual": 2,
        "matmul": 3,
        "linear": 1,
        "scores": 1,
        "layer_norm": 2,
        "softmax": 1,
        "router_topk": 1,
        "reduce": 1,
        "view": 3,
        "cat": 1,
        "mutate": 2,
        "all_reduce": 3,
        "all_gather": 3,
        "reduce_scatter": 3,
        "all_to_all": 2,
        "dispatch": 0.3,
        "combine": 3,
        "broadcast": 1,
        "coalesced": 1,
        "inplace": 1,
        "p2p": 0.2,
        "m2ms": 0.6,
        "stage_transfer": 0.6,
        "tp_mlp": 1,
        "sp_block": 1,
        "fsdp_linear": 1,
        "moe_block": 0.2,
        "update_after_collective": 1,
    },
    "tp": {
        "unary": 2,
        "binary": 1,
        "residual": 2,
        "matmul": 2,
        "linear": 1,
        "layer_norm": 2,
        "all_reduce": 3,
        "tp_mlp": 4,
        "view": 1,
        "mutate": 1,
    },
    "sp": {
        "unary": 1,
        "residual": 1,
        "matmul": 2,
        "layer_norm": 2,
        "softmax": 1,
        "scores": 1,
        "view": 3,
        "all_gather": 4,
        "reduce_scatter": 4,
        "sp_block": 4,
        "all_to_all": 1,
    },
    "moe": {
        "unary": 1,
        "matmul": 2,
        "router_topk": 3,
        "all_to_all": 3,
        "dispatch": 3,
        "combine": 4,
        "moe_block": 4,
        "residual": 1,
        "capacity_exchange": 3,
        "dropless_exchange": 3,
    },
    "fsdp": {
        "unary": 1,
        "matmul": 1,
        "layer_norm": 1,
        "fsdp_linear": 5,
        "reduce_scatter": 2,
        "all_reduce": 1,
        "residual": 1,
        "mutate": 1,
        "update_after_collective": 1,
    },
    "pp": {
        "unary": 2,
        "matmul": 2,
        "layer_norm": 1,
        "p2p": 4,
        "residual": 1,
        "all_reduce": 1,
        "stage_transfer": 3,
        "m2ms": 3,
        "all_gather": 1,
        "reduce_scatter": 1,
    },
    "coalesced": {
        "unary": 1,
        "matmul": 1,
        "coalesced": 4,
        "inplace": 3,
        "broadcast": 2,
        "all_reduce": 1,
        "mutate": 1,
        "update_after_collective": 1,
    },
    # commfuse's MoE layer op (commfuse.moe) behind sequence/tensor-parallel token gathers
    "moe_layer": {
        "moe_layer": 6,
        "unary": 1,
        "residual": 1,
        "layer_norm": 1,
        "matmul": 1,
        "sp_block": 1,
        "view": 1,
    },
    # adjacent collectives on aliased / reordered groups and on the two dims of a 2-D mesh
    # (groups from _Gen._pair_groups; drawn in a slot of its own, see FAMILY_WEIGHTS)
    "group_pairs": {
        "adjacent_pair": 6,
        "unary": 1,
        "residual": 1,
        "matmul": 1,
        "layer_norm": 1,
        "view": 1,
        "all_gather": 1,
        "reduce_scatter": 1,
        "all_reduce": 1,
        "mutate": 0.5,
    },
    # data parallel with a different local batch on every rank (see the module docstring; drawn
    # only when named)
    "uneven_batch": {
        "fsdp_linear": 4,
        "matmul": 2,
        "linear": 1,
        "unary": 2,
        "residual": 1,
        "layer_norm": 1,
        "softmax": 0.5,
        "view": 1,
        "batch_reduce": 2,
        "batch_contract": 2,
        "all_reduce": 2,
        "reduce_scatter": 2,
        "all_gather": 1,
        "coalesced": 1,
        "broadcast": 0.5,
        "moe_layer": 1,
        "mutate": 0.5,
    },
}
# Families a program without a given family is drawn from. A family left out (``group_pairs``,
# ``uneven_batch``) is generated only when named: campaigns give ``group_pairs`` a slot of its own
# (targets.program_for), so adding it changed no program of an existing seed.
FAMILY_WEIGHTS = {
    "mixed": 6,
    "tp": 1,
    "sp": 1,
    "moe": 0.6,
    "fsdp": 1,
    "pp": 0.4,
    "coalesced": 1,
    "moe_layer": 0.6,
}
MAX_NUMEL = 4096
# Val.vary of a data-parallel batch: dim 0 is this rank's local batch (uneven_batch). Not an
# uneven all_to_all's id (those count from 1 and have an entry in _Gen.vary_info).
BATCH_VARY = 0
# local batch sizes an uneven_batch rank draws from (1: the size Dynamo specialises)
BATCH_ROWS = (1, 2, 3, 5, 8, 16)


@dataclass
class Val:
    name: str
    shape: tuple  # rank 0's shape (for varying values only dim 0 differs between ranks)
    # id of the uneven all_to_all it came from, or BATCH_VARY; None: the same shape on all ranks
    vary: Optional[int] = None
    bounded: bool = False  # |x| <= ~1 (products of it across ranks stay small)
    grad: bool = True  # depends differentiably on the inputs (joint programs)
    is_input: bool = False
    coll_input: bool = False  # read by a collective (mutating it later tests the wait placement)
    root: str = ""  # the value whose memory this one views (itself unless made by a view op)
    uses: int = 0
    step: int = 0
    pickable: bool = True  # False: only feeds the outputs (an MoE layer's float32 statistics)


# Optional program features, off by default (see generate_program):
#   inplace_buffer_reads: ops after an in-place collective read its buffer directly (after the
#   wait) instead of the wait's result. The verifier rejects such graphs
#   (docs/reliability.md, finding 1), so CI campaigns leave it off.
FEATURES = ("inplace_buffer_reads",)


class _Gen:
    def __init__(
        self,
        rng: random.Random,
        world_size: int,
        dtype: str,
        joint: bool,
        family: str,
        features: frozenset = frozenset(),
    ) -> None:
        self.rng = rng
        self.features = features
        self.n = world_size
        self.prog = Program(
            world_size=world_size,
            groups={"world": [list(range(world_size))]},
            inputs=[],
            ops=[],
            outputs=[],
            dtype=dtype,
            joint=joint,
            seed=rng.randrange(2**31),
            family=family,
        )
        self.vals: list[Val] = []
        self.counter = 0
        self.step = 0
        self.vary_info: dict[int, tuple[str, list[list[int]]]] = {}
        self.must_output: list[Val] = []  # values the program must return (e.g. an auxiliary loss)
        self.pairs: list[tuple[str, str]] = []  # group_pairs: (first, second) roles of adjacent collectives
        self.per_rank_role: Optional[str] = None  # group_pairs: make the program per rank (take_shard on it)
        if family == "group_pairs":
            self._pair_groups()
        else:
            self._groups()

    # -- setup --------------------------------------------------------------------
    def _groups(self) -> None:
        n, rng = self.n, self.rng
        cands: list[list[list[int]]] = []
        if n >= 4:
            for size in (2, n // 2):
                if 1 < size < n and n % size == 0:
                    cands.append(
                        [list(range(b * size, (b + 1) * size)) for b in range(n // size)]
                    )  # contiguous
                    stride = n // size
                    cands.append([list(range(b, n, stride)) for b in range(stride)])  # strided
        if n >= 2 and rng.random() < 0.1:
            cands.append([[r] for r in range(n)])
        uniq = []
        for c in cands:
            if c not in uniq:
                uniq.append(c)
        rng.shuffle(uniq)
        for i, part in enumerate(uniq[: rng.choice([0, 1, 1, 2])]):
            self.prog.groups[f"p{i + 1}"] = part

    def _pair_groups(self) -> None:
        """``group_pairs``: the world plus groups in pairs (``self.pairs``) a pass must equate or
        tell apart, one kind per program:

        * ``alias``: a partition (the world or a contiguous/strided sub-group partition) and the
          same partition under another role: every block a second ``new_group`` of the same
          ranks in the same order, another group name (torchtitan's EP groups over the TP ranks);
        * ``reorder``: a partition and the same blocks in another group-rank order (reversed or
          rotated; ``sort_ranks=False``). Reordering every block keeps one SPMD graph (rank 0's
          groups differ, as every rank's do); reordering only some blocks makes the program one
          graph per rank (a ``take_shard``), since then ranks differ in whether the groups are
          the same and each rank's passes decide on its own groups;
        * ``mesh`` (4 or 8 ranks): the two dims of a 2-D mesh, 2x2, 2x4 or 4x2 (``m0``: the
          groups along dim 0, ``m1`` along dim 1), sometimes with one dim also under an EP
          alias (``ep``: the same blocks, other names)."""
        n, rng = self.n, self.rng
        groups = self.prog.groups
        subs: list[list[list[int]]] = []  # sub-group partitions with blocks of 2+ ranks
        for size in (2, n // 2):
            if 1 < size < n and n % size == 0:
                stride = n // size
                for part in (
                    [list(range(b * size, (b + 1) * size)) for b in range(n // size)],
                    [list(range(b, n, stride)) for b in range(stride)],
                ):
                    if part not in subs:
                        subs.append(part)
        kind = rng.choice(["alias", "reorder"] + (["mesh", "mesh"] if n in (4, 8) else []))
        if kind == "mesh":
            rows, cols = (2, 2) if n == 4 else rng.choice([(2, 4), (4, 2)])
            mesh = [[r * cols + c for c in range(cols)] for r in range(rows)]
            groups["m0"] = [[mesh[r][c] for r in range(rows)] for c in range(cols)]
            groups["m1"] = [list(row) for row in mesh]
            self.pairs = [("m0", "m1"), ("m1", "m0")]
            if rng.random() < 0.4:
                d = rng.choice(["m0", "m1"])
                other = "m1" if d == "m0" else "m0"
                groups["ep"] = [list(b) for b in groups[d]]
                self.pairs += [(d, "ep"), ("ep", d), (other, "ep"), ("ep", other)]
            return
        base = "world" if not subs or rng.random() < 0.35 else "p1"
        if base == "p1":
            groups["p1"] = [list(b) for b in rng.choice(subs)]
        part = groups[base]
        if kind == "alias":
            twin = f"{base}_alias"
            groups[twin] = [list(b) for b in part]
        else:
            twin = f"{base}_reordered"
            some = len(part) > 1 and rng.random() < 0.5
            which = (
                set(rng.sample(range(len(part)), rng.randint(1, len(part) - 1)))
                if some
                else set(range(len(part)))
            )
            blocks = []
            for i, b in enumerate(part):
                if i in which:
                    k = rng.randrange(1, len(b))
                    b = b[::-1] if rng.random() < 0.5 else b[k:] + b[:k]
                blocks.append(list(b))
            groups[twin] = blocks
            if some:
                self.per_rank_role = twin
        self.pairs = [(base, twin), (twin, base)]

    def unit(self) -> int:
        """A size divisible by every group size (the world size)."""
        return (
            self.n * self.rng.choice([1, 1, 2, 2, 3, 4]) if self.n <= 4 else self.n * self.rng.choice([1, 2])
        )

    def small(self) -> int:
        return self.rng.choice([1, 2, 2, 3])

    def new_name(self, prefix: str = "v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def new_input(
        self, shape: tuple, init: str = "act", replicated: bool = False, rows: Optional[list[int]] = None
    ) -> Val:
        """A program input; ``rows``: every rank's local batch (dim 0), ``shape`` then holds the
        largest, so size bounds hold on every rank."""
        name = self.new_name("x" if init == "act" else "w")
        self.prog.inputs.append(
            {
                "name": name,
                "shape": list(shape),
                "init": init,
                **({"replicated": True} if replicated else {}),
                **({"rows": list(rows)} if rows is not None else {}),
            }
        )
        v = Val(
            name,
            tuple(shape),
            is_input=True,
            step=self.step,
            bounded=init in ("bias",),
            root=name,
            vary=BATCH_VARY if rows is not None else None,
        )
        self.vals.append(v)
        return v

    def batch_rows(self) -> list[int]:
        """Every rank's local batch: one rank far below the others (1 and 16), random sizes,
        or the same on every rank (the control)."""
        rng, n = self.rng, self.n
        kind = rng.choice(["one_small", "one_small", "random", "random", "equal"])
        if kind == "equal":
            return [rng.choice(BATCH_ROWS)] * n
        if kind == "one_small":
            rows = [BATCH_ROWS[-1]] * n
            rows[rng.randrange(n)] = 1
            return rows
        return [rng.choice(BATCH_ROWS) for _ in range(n)]

    # -- helpers -----------------------------------------------------------------------
    def pick(self, pred: Callable[[Val], bool] = lambda v: True, *, recent: bool = True) -> Optional[Val]:
        cands = [v for v in self.vals if v.pickable and pred(v)]
        if not cands:
            return None
        if recent and self.rng.random() < 0.7:
            # prefer unconsumed, recent values: chains rather than fans
            cands.sort(key=lambda v: (v.uses > 0, -v.step))
            return cands[0] if self.rng.random() < 0.6 else self.rng.choice(cands[: max(1, len(cands) // 2)])
        return self.rng.choice(cands)

    def group(self, pred: Callable[[int], bool] = lambda n: True) -> Optional[str]:
        roles = [r for r, p in self.prog.groups.items() if pred(len(p[0]))]
        return self.rng.choice(roles) if roles else None

    def gsize(self, role: str) -> int:
        return len(self.prog.groups[role][0])

    def emit(
        self,
        op: str,
        ins: list[Val],
        n_out: int = 1,
        *,
        bounded: bool = False,
        vary: Optional[int] = None,
        grad: Optional[bool] = None,
        **attrs,
    ) -> Optional[list[Val]]:
        spec = {
            "op": op,
            "in": [v.name for v in ins],
            "out": [self.new_name() for _ in range(n_out)],
            **attrs,
        }
        try:
            shapes = _shape_rule(self.prog, spec, [v.shape for v in ins])
        except Exception:  # noqa: BLE001 - an invalid combination: try something else
            return None
        if any(_numel(s) > MAX_NUMEL or any(d < 1 for d in s) for s in shapes):
            return None
        if len(shapes) != n_out:
            return None
        if vary is None:
            vary = next((v.vary for v in ins if v.vary is not None), None)
        if grad is None:
            grad = any(v.grad for v in ins) and not (self.prog.joint and _detaches(op, attrs))
        self.prog.ops.append(spec)
        for v in ins:
            v.uses += 1
            v.coll_input = v.coll_input or OPS[op].collective
        self.step += 1
        outs = [
            Val(
                name,
                tuple(s),
                vary=vary,
                bounded=bounded,
                grad=grad,
                step=self.step,
                root=ins[0].root if op in _VIEW_OPS else name,
            )
            for name, s in zip(spec["out"], shapes, strict=True)
        ]
        self.vals.extend(outs)
        return outs

    # -- building blocks (return False when not applicable) -------------------------------
    def b_unary(self) -> bool:
        x = self.pick()
        fn = self.rng.choice(["relu", "gelu", "tanh", "sigmoid", "silu", "neg", "abs", "scale"])
        return bool(
            self.emit("unary", [x], bounded=fn in ("tanh", "sigmoid") or (x.bounded and fn != "scale"), fn=fn)
        )

    def b_binary(self, residual: bool = False) -> bool:
        a = self.pick()
        same = lambda v: v is not a and v.shape == a.shape and v.vary == a.vary  # noqa: E731
        b = self.pick(same, recent=not residual)
        if b is None:
            if a.vary is not None:
                return False
            b = self.pick(lambda v: v is not a and v.vary is None and _broadcasts(v.shape, a.shape))
            if b is None:
                return False
        fn = "add" if residual else self.rng.choice(["add", "sub", "mul"])
        return bool(self.emit("binary", [a, b], fn=fn))

    def b_residual(self) -> bool:
        return self.b_binary(residual=True)

    def b_matmul(self, linear: bool = False) -> bool:
        x = self.pick(lambda v: len(v.shape) >= 2 or v.vary is None)
        k = x.shape[-1]
        reuse = self.pick(
            lambda v: v.is_input and v.vary is None and len(v.shape) == 2 and v.shape[0] == k and v is not x,
            recent=False,
        )
        w = (
            reuse
            if reuse is not None and self.rng.random() < 0.3
            else self.new_input((k, self.unit()), "weight")
        )
        if linear:
            b = self.new_input((w.shape[1],), "bias")
            return bool(self.emit("linear", [x, w, b]))
        return bool(self.emit("matmul", [x, w]))

    def b_linear(self) -> bool:
        return self.b_matmul(linear=True)

    def b_scores(self) -> bool:
        q = self.pick(lambda v: len(v.shape) >= 2 and v.vary is None)
        if q is None:
            return False
        k = self.pick(lambda v: v.shape == q.shape and v.vary is None) or q
        return bool(self.emit("scores", [q, k]))

    def b_layer_norm(self) -> bool:
        x = self.pick()
        ins = [x]
        if self.rng.random() < 0.5:
            h = x.shape[-1]
            ins += [self.new_input((h,), "ln_weight"), self.new_input((h,), "bias")]
        return bool(self.emit("layer_norm", ins))

    def b_softmax(self) -> bool:
        x = self.pick()
        dim = -1
        if x.vary is None and self.rng.random() < 0.5:
            dim = self.rng.randrange(len(x.shape))
        log = self.rng.random() < 0.2
        return bool(self.emit("softmax", [x], bounded=not log, dim=dim, log=log))

    def b_router_topk(self) -> bool:
        x = self.pick(lambda v: len(v.shape) >= 2)
        e = self.rng.choice([4, 8])
        wr = self.new_input((x.shape[-1], e), "weight")
        return bool(self.emit("router_topk", [x, wr], 2, k=self.rng.choice([1, 2])))

    def b_reduce(self) -> bool:
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 2)
        if x is None:
            return False
        return bool(
            self.emit(
                "reduce",
                [x],
                fn=self.rng.choice(["sum", "mean", "amax"]),
                dim=self.rng.randrange(len(x.shape)),
            )
        )

    def b_batch_reduce(self) -> bool:
        """A reduction over the local batch (dim 0 of a batch-varying value: a batch statistic, a
        loss term): its size is the same on every rank, so collectives may read it."""
        x = self.pick(lambda v: v.vary == BATCH_VARY)
        if x is None:
            return False
        outs = self.emit("reduce", [x], fn=self.rng.choice(["sum", "mean", "amax"]), dim=0)
        if outs:
            outs[0].vary = None
        return bool(outs)

    def b_batch_contract(self) -> bool:
        """Two batch-varying values contracted over every dim but the last (``a^T b`` over the
        local tokens, as a weight gradient is): a ``[H, K]`` result of the same size on every
        rank, scaled so that sums over 16 rows stay small."""
        a = self.pick(lambda v: v.vary == BATCH_VARY)
        if a is None:
            return False
        b = self.pick(lambda v: v.vary == BATCH_VARY and v.shape[:-1] == a.shape[:-1]) or a
        outs = self.emit("contract_rows", [a, b])
        if outs:
            outs[0].vary = None
        return bool(outs)

    def b_view(self) -> bool:
        x = self.pick(lambda v: len(v.shape) >= 2)
        r = len(x.shape)
        lo = 1 if x.vary is not None else 0  # never touch a varying dim 0
        kind = self.rng.choice(["transpose", "permute", "split_dim", "merge_dims", "contiguous"])
        if kind == "transpose" and r - lo >= 2:
            a, b = self.rng.sample(range(lo, r), 2)
            return bool(self.emit("transpose", [x], dims=[a, b]))
        if kind == "permute" and r - lo >= 2:
            rest = list(range(lo, r))
            self.rng.shuffle(rest)
            return bool(self.emit("permute", [x], perm=list(range(lo)) + rest))
        if kind == "split_dim" and r < 4:
            dims = [(d, f) for d in range(lo, r) for f in (2, 3, 4) if x.shape[d] % f == 0 and x.shape[d] > f]
            if dims:
                d, f = self.rng.choice(dims)
                return bool(self.emit("split_dim", [x], dim=d, factor=f))
        if kind == "merge_dims" and r >= 3 and r - 1 > lo:
            return bool(self.emit("merge_dims", [x], dim=self.rng.randrange(lo, r - 1)))
        return bool(self.emit("contiguous", [x]))

    def b_cat(self) -> bool:
        a = self.pick(lambda v: v.vary is None and len(v.shape) >= 1)
        if a is None:
            return False
        b = self.pick(lambda v: v.shape == a.shape and v.vary is None) or a
        return bool(self.emit("cat", [a, b], dim=self.rng.randrange(len(a.shape))))

    def b_mutate(self) -> bool:
        if self.prog.joint:
            return False
        a = None
        if self.rng.random() < 0.6:  # e.g. an optimizer step on a tensor a collective read
            a = self.pick(lambda v: v.vary is None and v.coll_input)
        a = a or self.pick(lambda v: v.vary is None)
        # b must not share memory with a (torch refuses overlapping in-place updates)
        b = self.pick(lambda v: v.vary is None and _broadcasts(v.shape, a.shape) and v.root != a.root)
        if b is None:
            return False
        fn = self.rng.choice(["add_", "mul_"]) if b.bounded else "add_"
        outs = self.emit("mutate", [a, b], fn=fn)
        return bool(outs)

    # -- collectives -----------------------------------------------------------------
    def b_all_reduce(self) -> bool:
        role = self.group()
        red = self.rng.choice(["sum", "sum", "sum", "avg", "max", "min", "product"])
        x = self.pick(lambda v: v.vary is None)
        if red == "product" and not x.bounded:
            x = self.emit("unary", [x], bounded=True, fn="tanh")
            if not x:
                return False
            x = x[0]
        return bool(
            self.emit(
                "all_reduce",
                [x],
                bounded=x.bounded and red in ("avg", "max", "min", "product"),
                group=role,
                reduce=red,
            )
        )

    def b_all_gather(
        self, x: Optional[Val] = None, dim: Optional[int] = None, role: Optional[str] = None
    ) -> bool:
        x = x or self.pick(lambda v: v.vary is None and len(v.shape) >= 1)
        if x is None:
            return False
        role = role or self.group()
        dim = self.rng.randrange(len(x.shape)) if dim is None else dim
        return bool(self.emit("all_gather", [x], bounded=x.bounded, group=role, dim=dim))

    def b_reduce_scatter(
        self, x: Optional[Val] = None, dim: Optional[int] = None, role: Optional[str] = None
    ) -> bool:
        x = x or self.pick(lambda v: v.vary is None and len(v.shape) >= 1)
        if x is None:
            return False
        role = role or self.group()
        n = self.gsize(role)
        dims = [d for d in range(len(x.shape)) if x.shape[d] % n == 0] if dim is None else [dim]
        if not dims or x.shape[dims[0]] % n:
            return False
        red = self.rng.choice(["sum", "sum", "avg", "max", "min"])
        return bool(self.emit("reduce_scatter", [x], group=role, dim=self.rng.choice(dims), reduce=red))

    def b_all_to_all(self) -> bool:
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 1)
        role = self.group()
        n = self.gsize(role)
        dims = [d for d in range(len(x.shape)) if x.shape[d] % n == 0]
        if not dims:
            return False
        s = self.rng.choice(dims)
        c = self.rng.randrange(len(x.shape))
        return bool(self.emit("all_to_all", [x], bounded=x.bounded, group=role, split_dim=s, concat_dim=c))

    def b_dispatch(self) -> bool:
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 2)
        role = self.group(lambda n: n >= 2)
        if x is None or role is None:
            return False
        n, t = self.gsize(role), x.shape[0]
        splits = [_composition(self.rng, t, n) for _ in range(n)]
        vid = len(self.vary_info) + 1
        outs = self.emit("all_to_all_uneven", [x], vary=vid, bounded=x.bounded, group=role, splits=splits)
        if outs:
            self.vary_info[vid] = (role, splits)
        return bool(outs)

    def b_combine(self) -> bool:
        x = self.pick(lambda v: v.vary in self.vary_info)
        return x is not None and self._combine_of(x)

    def b_broadcast(self) -> bool:
        x = self.pick(lambda v: v.vary is None)
        role = self.group()
        if self.rng.random() < 0.3:
            return bool(
                self.emit(
                    "broadcast_inplace",
                    [x],
                    bounded=x.bounded,
                    group=role,
                    src=self.rng.randrange(self.gsize(role)),
                    **self._buffer_read(),
                )
            )
        src = self.rng.randrange(self.gsize(role))
        return bool(self.emit("broadcast", [x], bounded=x.bounded, group=role, src=src))

    def _buffer_read(self) -> dict:
        if "inplace_buffer_reads" in self.features and self.rng.random() < 0.5:
            return {"read_buffer": True}
        return {}

    def b_coalesced(self) -> bool:
        role = self.group()
        n = self.gsize(role)
        kind = self.rng.choice(["all_reduce_coalesced", "all_gather_coalesced", "reduce_scatter_coalesced"])
        pred = (
            (lambda v: v.vary is None and len(v.shape) >= 1 and v.shape[0] % n == 0)
            if kind == "reduce_scatter_coalesced"
            else (lambda v: v.vary is None and len(v.shape) >= 1)
        )
        xs = []
        for _ in range(self.rng.choice([2, 2, 3])):
            v = self.pick(lambda v: pred(v) and v not in xs, recent=False)
            if v is not None:
                xs.append(v)
        if not xs:
            return False
        attrs = {"group": role}
        if kind != "all_gather_coalesced":
            attrs["reduce"] = self.rng.choice(["sum", "avg"])
        return bool(self.emit(kind, xs, len(xs), **attrs))

    def b_inplace(self) -> bool:
        role = self.group()
        if self.rng.random() < 0.5:
            x = self.pick(lambda v: v.vary is None)
            return bool(
                self.emit(
                    "all_reduce_inplace",
                    [x],
                    group=role,
                    reduce=self.rng.choice(["sum", "max"]),
                    **self._buffer_read(),
                )
            )
        xs = []
        for _ in range(2):
            v = self.pick(lambda v: v.vary is None and v not in xs, recent=False)
            if v is not None:
                xs.append(v)
        return bool(
            self.emit(
                "all_reduce_coalesced_inplace",
                xs,
                len(xs),
                group=role,
                reduce=self.rng.choice(["sum", "avg"]),
                **self._buffer_read(),
            )
        )

    def b_p2p(self) -> bool:
        role = self.group(lambda n: n >= 2)
        x = self.pick(lambda v: v.vary is None)
        if role is None:
            return False
        n = self.gsize(role)
        return bool(
            self.emit(
                "p2p",
                [x],
                bounded=x.bounded,
                group=role,
                shift=self.rng.randrange(1, n),
                batch=self.rng.random() < 0.4,
            )
        )

    def _rank_sets(self, n: int) -> tuple[list[int], list[int]]:
        """Random src / dst lists of group ranks (random order): disjoint (a stage boundary),
        equal, overlapping or arbitrary."""
        rng = self.rng
        ranks = list(range(n))
        kind = rng.choice(["disjoint", "equal", "overlap", "random"]) if n >= 2 else "equal"
        if kind == "disjoint":
            rng.shuffle(ranks)
            cut = rng.randint(1, n - 1)
            return ranks[:cut], ranks[cut:]
        if kind == "equal":
            src = rng.sample(ranks, rng.randint(1, n))
            return src, rng.sample(src, len(src))
        if kind == "overlap":
            src = rng.sample(ranks, rng.randint(1, n))
            rest = [r for r in ranks if r not in src]
            dst = rng.sample(src, rng.randint(1, len(src))) + rng.sample(rest, rng.randint(0, len(rest)))
            rng.shuffle(dst)
            return src, dst
        return rng.sample(ranks, rng.randint(1, n)), rng.sample(ranks, rng.randint(1, n))

    def b_m2ms(self) -> bool:
        """commfuse's many-to-many scatter: a random piece matrix (zeros included) between two
        random rank sets of a group, along a random dim of a value; every source's row fits
        in that dim (it sends the first row-sum slices), outputs are padded to one shape."""
        rng = self.rng
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 1)
        if x is None:
            return False
        role = self.group()
        src, dst = self._rank_sets(self.gsize(role))
        d = rng.randrange(len(x.shape))
        length = x.shape[d]
        splits = [_composition(rng, rng.randint(0, length), len(dst)) for _ in src]
        pad = max(sum(r[j] for r in splits) for j in range(len(dst)))
        if pad == 0:  # nothing moves at all: make one piece non-empty
            splits[0][0] = 1
            pad = 1
        if rng.random() < 0.2:
            pad += rng.randint(1, 2)
        return bool(
            self.emit(
                "m2ms", [x], bounded=x.bounded, group=role, dim=d, splits=splits, src=src, dst=dst, pad=pad
            )
        )

    def b_stage_transfer(self) -> bool:
        """commfuse's stage transfer: pairs src[i] -> dst[i] of a group (a shift, one stage half
        to the other, or random pairs with self pairs)."""
        rng = self.rng
        x = self.pick(lambda v: v.vary is None)
        if x is None:
            return False
        role = self.group(lambda n: n >= 2) or self.group()
        n = self.gsize(role)
        kind = rng.choice(["shift", "halves", "random"]) if n >= 2 else "random"
        if kind == "shift":
            s = rng.randrange(1, n)
            src = list(range(n))
            dst = [(g + s) % n for g in src]
        elif kind == "halves":
            ranks = rng.sample(range(n), n)
            half = rng.randint(1, n // 2)
            src, dst = ranks[:half], ranks[half : 2 * half]
        else:
            m = rng.randint(1, n)
            src, dst = rng.sample(range(n), m), rng.sample(range(n), m)
        return bool(self.emit("stage_transfer", [x], bounded=x.bounded, group=role, src=src, dst=dst))

    # -- macros: the patterns hybrid-parallel models emit ---------------------------------
    def b_update_after_collective(self) -> bool:
        """A collective reads x, then x is updated in place before the result is used (a
        gradient zeroed after its all_reduce, a parameter stepped after its gather): the
        wait must stay above the update."""
        if self.prog.joint:
            return False
        kind = self.rng.choice(
            [
                "all_reduce",
                "all_gather",
                "reduce_scatter",
                "all_to_all",
                "broadcast",
                "p2p",
                "m2ms",
                "stage_transfer",
            ]
        )
        if kind == "p2p" and self.group(lambda n: n >= 2) is None:
            return False
        if not getattr(self, f"b_{kind}")():
            return False
        op = self.prog.ops[-1]
        x = next(v for v in self.vals if v.name == op["in"][-1])
        b = self.pick(lambda v: v.vary is None and _broadcasts(v.shape, x.shape) and v.root != x.root)
        if b is None or x.vary is not None:
            return True
        if not self.emit("mutate", [x, b], fn="add_"):
            return True
        res = next(v for v in self.vals if v.name == op["out"][0])
        self.emit("unary", [res], fn="relu")
        return True

    def b_tp_mlp(self) -> bool:
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 2)
        if x is None:
            return False
        h = x.shape[-1]
        w1 = self.new_input((h, self.unit()), "weight")
        y = self.emit("matmul", [x, w1])
        y = y and self.emit("unary", y, fn="gelu")
        w2 = self.new_input((y[0].shape[-1], h), "weight") if y else None
        y = y and self.emit("matmul", [y[0], w2])
        y = y and self.emit("all_reduce", y, group=self.group(), reduce="sum")
        return bool(y and self.emit("binary", [x, y[0]], fn="add"))

    def b_sp_block(self) -> bool:
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 2)
        if x is None:
            return False
        role = self.group()
        dim = 1 if len(x.shape) >= 3 else 0
        y = self.emit("layer_norm", [x])
        y = y and self.emit("all_gather", y, group=role, dim=dim)
        if not y:
            return False
        w = self.new_input((y[0].shape[-1], y[0].shape[-1]), "weight")
        y = self.emit("matmul", [y[0], w])
        return bool(y) and self.b_reduce_scatter(y[0], dim, role)

    def b_fsdp_linear(self) -> bool:
        x = self.pick(lambda v: len(v.shape) >= 2)
        role = self.group(lambda n: x.shape[-1] % n == 0)
        if role is None:
            return False
        shard = self.new_input((x.shape[-1] // self.gsize(role), self.unit()), "weight")
        w = self.emit("all_gather", [shard], group=role, dim=0)
        return bool(w and self.emit("matmul", [x, w[0]]))

    def b_moe_block(self) -> bool:
        x = self.pick(lambda v: v.vary is None and len(v.shape) == 2)
        if x is None:
            x = self.pick(lambda v: v.vary is None and len(v.shape) == 3)
            if x is None:
                return False
            x = self.emit("merge_dims", [x], dim=0)
            if not x:
                return False
            x = x[0]
        r = self.emit("router_topk", [x, self.new_input((x.shape[-1], 4), "weight")], 2, k=1)
        if not r or not self.b_dispatch_of(r[0]):
            return False
        y = self.vals[-1]
        y = self.emit("matmul", [y, self.new_input((y.shape[-1], y.shape[-1]), "weight")])
        y = y and self.emit("unary", y, fn="gelu")
        if not y:
            return False
        return self.b_combine()

    def b_capacity_exchange(self) -> bool:
        """A capacity-dispatch expert exchange: an equal-split all_to_all, a matmul and an
        activation per rank, the inverse all_to_all on the same group (expert_exchange_partition).
        Split on dim 0 about half the time, else on another divisible dim; concatenated on the
        split dim half the time, else on a random dim (a DTensor-style shuffle) and inverted."""
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 2)
        if x is None:
            return False
        role = self.group(lambda n: n >= 2)
        if role is None:
            return False
        n = self.gsize(role)
        dims = [d for d in range(len(x.shape)) if x.shape[d] % n == 0]
        if not dims:
            return False
        s = c = 0 if 0 in dims and self.rng.random() < 0.5 else self.rng.choice(dims)
        if self.rng.random() < 0.5:
            c = self.rng.randrange(len(x.shape))
        y = self.emit("all_to_all", [x], bounded=x.bounded, group=role, split_dim=s, concat_dim=c)
        if not y:
            return False
        w = self.new_input((y[0].shape[-1], y[0].shape[-1]), "weight")
        y = self.emit("matmul", [y[0], w])
        fn = self.rng.choice(["gelu", "relu", "silu"])
        y = y and self.emit("unary", y, fn=fn)
        if not y or y[0].shape[c] % n:
            return False
        return bool(self.emit("all_to_all", y, group=role, split_dim=c, concat_dim=s))

    def b_dropless_exchange(self) -> bool:
        """A dropless expert exchange as graph ops (torchtitan's token dispatcher): an uneven
        all_to_all of ``[tokens, hidden]`` rows, the received rows regrouped (``gather_rows``),
        an up matmul (contracts the hidden dim), an activation, a down matmul (output columns =
        the hidden dim), sometimes a scale, the rows put back into a fresh buffer
        (``scatter_rows``) and the inverse all_to_all on the same group: the consumer and producer
        chains of hidden_exchange_partition. In 15% each the gather or the scatter is left out
        (a matmul reads the received rows / writes the combined buffer directly)."""
        rng = self.rng
        x = self.pick(lambda v: v.vary is None and len(v.shape) == 2)
        if x is None:
            x = self.pick(lambda v: v.vary is None and len(v.shape) == 3)
            x = x and self.emit("merge_dims", [x], dim=0)
            if not x:
                return False
            x = x[0]
        if not self.b_dispatch_of(x):
            return False
        y = [self.vals[-1]]
        if rng.random() < 0.85:
            y = self.emit("gather_rows", y)
        h = x.shape[-1]
        f = rng.choice([h, 2 * h, self.unit()])
        y = y and self.emit("matmul", [y[0], self.new_input((h, f), "weight")])
        y = y and self.emit("unary", y, fn=rng.choice(["gelu", "relu", "silu"]))
        y = y and self.emit("matmul", [y[0], self.new_input((f, h), "weight")])
        if y and rng.random() < 0.25:
            y = self.emit("unary", y, fn="scale")
        if y and rng.random() < 0.85:
            y = self.emit("scatter_rows", y)
        return bool(y) and self._combine_of(y[0])

    def _combine_of(self, x: Val) -> bool:
        """The inverse of the uneven all_to_all ``x`` came from, on its group."""
        role, splits = self.vary_info[x.vary]
        outs = self.emit("all_to_all_uneven", [x], bounded=x.bounded, group=role, splits=splits, inverse=True)
        if outs:
            outs[0].vary = None
            outs[0].shape = (sum(splits[0]), *x.shape[1:])
        return bool(outs)

    def b_dispatch_of(self, x: Val) -> bool:
        role = self.group(lambda n: n >= 2)
        if role is None:
            return False
        n, t = self.gsize(role), x.shape[0]
        splits = [_composition(self.rng, t, n) for _ in range(n)]
        vid = len(self.vary_info) + 1
        outs = self.emit("all_to_all_uneven", [x], vary=vid, group=role, splits=splits)
        if outs:
            self.vary_info[vid] = (role, splits)
        return bool(outs)

    def b_moe_layer(self) -> bool:
        """commfuse's MoE layer op (``commfuse::moe_layer``) where sequence/tensor-parallel
        models put it: token shards, optionally normalised or activated, all_gathered along a
        token dim on a group that is also the layer's expert-parallel group (sometimes no
        gather, another EP group, or no EP), element-wise ops around the layer, its output
        sometimes split back to this rank's token shard (DTensor's Replicate -> Shard: one
        graph per rank); the router statistics feed an auxiliary loss or the outputs. top_k 1
        or 2; dropless, capacity that cannot bind (``capacity_factor * top_k >= E``) or that
        can; token_groups 1 or the group size. The router is the same on every rank: a
        replicated input, or a shard all_gathered on the EP group (provably replicated)."""
        rng = self.rng
        x = self.pick(
            lambda v: (
                (v.vary is None or (v.vary == BATCH_VARY and self.prog.family == "uneven_batch"))
                and len(v.shape) >= 2
                and not (v.is_input and v.name[0] == "w")
            )
        )
        if x is None:
            return False
        role = self.group(lambda n: n >= 2) or self.group()
        n = self.gsize(role)
        pre = rng.choice(["none", "layer_norm", "layer_norm", "unary"])
        y = [x]
        if pre == "layer_norm":
            ins = [x]
            if rng.random() < 0.5:
                ins += [self.new_input((x.shape[-1],), "ln_weight"), self.new_input((x.shape[-1],), "bias")]
            y = self.emit("layer_norm", ins)
        elif pre == "unary":
            y = self.emit("unary", [x], fn=rng.choice(["gelu", "silu", "tanh", "scale"]))
        if not y:
            return False
        gather_dim = rng.randrange(len(x.shape) - 1) if rng.random() < 0.85 else None  # a token dim
        if x.vary == BATCH_VARY:
            # this rank's own tokens: no gather (its size would differ between ranks), and no
            # capacity below (one from the local token count would differ between ranks too)
            gather_dim = None
        if gather_dim is not None:
            y = self.emit("all_gather", y, group=role, dim=gather_dim)
            if y and rng.random() < 0.3:
                y = self.emit("unary", y, fn=rng.choice(["relu", "silu", "scale"]))
            if not y:
                return False
        tokens_in = y[0]
        ep = rng.random() < 0.9
        ep_role = role if not ep or rng.random() < 0.9 else self.group()
        ep_n = self.gsize(ep_role) if ep else 1
        local = rng.choice([1, 2]) if ep_n > 1 else rng.choice([2, 4])
        e = ep_n * local
        top_k = rng.choice([1, 2]) if e >= 2 else 1
        mode = rng.choice(["dropless", "no_bind", "bind", "bind"])
        if mode == "dropless" or x.vary == BATCH_VARY:
            cf = 0.0
        elif mode == "no_bind":
            cf = e / top_k * rng.choice([1.0, 1.5])  # capacity_factor * top_k >= E: nothing can drop
        else:
            cf = rng.choice([c for c in (0.5, 1.0, 1.25, 2.0) if c * top_k < e])
        tokens = _numel(tokens_in.shape[:-1])
        token_groups = rng.choice([1, n])
        if tokens % token_groups or x.vary == BATCH_VARY:
            token_groups = 1
        h = tokens_in.shape[-1]
        f = rng.choice([h, 2 * h])
        if ep and ep_n > 1 and rng.random() < 0.25:  # the router sharded over the EP group and gathered
            rw = self.emit("all_gather", [self.new_input((local, h), "router")], group=ep_role, dim=0)
            if not rw:
                return False
            rw = rw[0]
        else:
            rw = self.new_input((e, h), "router", replicated=True)
        ws = [
            self.new_input((local, h, f), "expert"),
            self.new_input((local, h, f), "expert"),
            self.new_input((local, f, h), "expert"),
        ]
        outs = self.emit(
            "moe_layer",
            [tokens_in, rw, *ws],
            4,
            group=ep_role,
            top_k=top_k,
            capacity_factor=cf,
            token_groups=token_groups,
            **({} if ep else {"ep": False}),
        )
        if not outs:
            return False
        out, probs_sum, top1, z = outs
        for v in (probs_sum, top1, z):  # float32 whatever the program's dtype: they only feed the outputs
            v.pickable = False
            v.vary = None  # [E] or a scalar on every rank
        post = rng.choice(["residual", "residual", "unary", "none"])
        if post == "residual":
            out = (self.emit("binary", [out, tokens_in], fn="add") or [out])[0]
        elif post == "unary":
            out = (self.emit("unary", [out], fn=rng.choice(["gelu", "tanh", "scale"])) or [out])[0]
        if gather_dim is not None and rng.random() < 0.35:
            self.emit("take_shard", [out], group=role, dim=gather_dim)  # back to this rank's token shard
        if rng.random() < 0.6:
            aux = self.emit("moe_aux_loss", [probs_sum, top1, z])
            if aux:
                aux[0].pickable = False
                self.must_output.append(aux[0])
        else:
            self.must_output += rng.sample([probs_sum, top1, z], rng.choice([1, 2]))
        return True

    # -- group_pairs: adjacent collectives on pairs of groups ------------------------------
    def _collective(self, kind: str, x: Val, role: str) -> Optional[Val]:
        """One collective of ``kind`` on ``role`` reading ``x`` (random dims and reduce op where
        the shapes allow); its result, or None."""
        rng, n = self.rng, self.gsize(role)
        if kind == "all_gather":
            outs = self.emit(
                "all_gather", [x], bounded=x.bounded, group=role, dim=rng.randrange(len(x.shape))
            )
        elif kind == "reduce_scatter":
            dims = [d for d in range(len(x.shape)) if x.shape[d] % n == 0]
            if not dims:
                return None
            outs = self.emit(
                "reduce_scatter",
                [x],
                group=role,
                dim=rng.choice(dims),
                reduce=rng.choice(["sum", "sum", "avg", "max", "min"]),
            )
        elif kind == "all_to_all":
            dims = [d for d in range(len(x.shape)) if x.shape[d] % n == 0]
            if not dims:
                return None
            outs = self.emit(
                "all_to_all",
                [x],
                bounded=x.bounded,
                group=role,
                split_dim=rng.choice(dims),
                concat_dim=rng.randrange(len(x.shape)),
            )
        else:
            red = rng.choice(["sum", "sum", "avg", "max", "min"])
            outs = self.emit("all_reduce", [x], bounded=x.bounded and red != "sum", group=role, reduce=red)
        return outs[0] if outs else None

    def b_adjacent_pair(self) -> bool:
        """Two collectives back to back, the second reading only the first's result (Chimera's
        adjacent pairs), on one of the program's group pairs (``self.pairs``: aliases, reordered
        ranks, mesh dims; 75%), on one group twice (15%) or on any two groups. Kinds: all_gather,
        reduce_scatter, all_to_all (equal splits) and all_reduce, so most pairs are rows of the
        fusion table and some are not (all_reduce, RS + RS). The first result usually feeds
        nothing else (15%: it may feed later ops too, so the pair is refused)."""
        rng = self.rng
        if not self.pairs:
            return False
        u = rng.random()
        if u < 0.75:
            g1, g2 = rng.choice(self.pairs)
        elif u < 0.9:
            g1 = g2 = rng.choice(sorted({r for pair in self.pairs for r in pair}))
        else:
            g1, g2 = self.group(), self.group()
        kinds = [
            "all_gather",
            "all_gather",
            "reduce_scatter",
            "reduce_scatter",
            "all_to_all",
            "all_to_all",
            "all_reduce",
        ]
        k1, k2 = rng.choice(kinds), rng.choice(kinds)
        x = self.pick(lambda v: v.vary is None and len(v.shape) >= 1)
        if x is None:
            return False
        a = self._collective(k1, x, g1)
        if a is None:
            return False
        b = self._collective(k2, a, g2)
        if b is None:
            return True
        a.pickable = rng.random() < 0.15
        if rng.random() < 0.4:
            self.emit("unary", [b], fn=rng.choice(["relu", "gelu", "tanh", "scale"]))
        return True

    # -- driver --------------------------------------------------------------------------
    def run(self, n_blocks: int) -> Program:
        rng = self.rng
        b = self.small()
        s, h = self.unit(), self.unit()
        shape = rng.choice([(s, h), (b, s, h), (b, s, h), (b, 2, s, h)])
        if self.prog.family == "uneven_batch":
            # every rank's local batch of [rows, (seq,) hidden] samples, and a parameter
            rows = self.batch_rows()
            shape = (max(rows), *rng.choice([(h,), (s, h), (s, h)]))
            x0 = self.new_input(shape, rows=rows)
            if rng.random() < 0.4:
                self.new_input(shape, rows=rows)
            self.new_input((h, self.unit()), "weight")
        else:
            x0 = self.new_input(shape)
            if rng.random() < 0.4:
                self.new_input(shape)
        if self.per_rank_role is not None:
            # group_pairs with only some blocks reordered: one graph per rank (each rank's passes
            # see its own groups); this rank's shard of the last dim (a multiple of the world size)
            self.emit("take_shard", [x0], group=self.per_rank_role, dim=len(shape) - 1)
        weights = FAMILIES[self.prog.family]
        names = list(weights)
        tries = 0
        while len(self.prog.ops) < n_blocks and tries < 6 * n_blocks:
            tries += 1
            name = rng.choices(names, [weights[k] for k in names])[0]
            if name == "p2p" and self.n < 2:
                continue
            getattr(self, f"b_{name}")()
        self._outputs()
        return self.prog

    def _outputs(self) -> None:
        made = [v for v in self.vals if not v.is_input]
        if not made:  # nothing was generated: a trivial program
            x = self.vals[0]
            self.emit("unary", [x], fn="relu")
            made = [v for v in self.vals if not v.is_input]
        leaves = [v for v in made if v.uses == 0]
        outs = leaves[-4:]
        if made[-1] not in outs:
            outs.append(made[-1])
        outs += [v for v in self.must_output if v not in outs]
        if self.prog.joint and not any(v.grad for v in outs):
            g = [v for v in made if v.grad]
            if g:
                outs.append(g[-1])
        self.prog.outputs = [v.name for v in outs]


# ops whose result may share memory with their (first) input
_VIEW_OPS = {"transpose", "permute", "split_dim", "merge_dims", "contiguous", "mutate", "take_shard"}


def _detaches(op: str, attrs: dict) -> bool:
    """In joint programs these collectives run on detached values (no autograd formula)."""
    if op in ("all_gather", "all_to_all", "all_to_all_uneven", "m2ms", "stage_transfer"):
        return False
    if op == "all_reduce":
        return attrs.get("reduce") not in ("sum", "avg")
    if op == "reduce_scatter":
        return attrs.get("reduce") != "sum"
    return OPS[op].collective


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _broadcasts(src: tuple, dst: tuple) -> bool:
    if len(src) > len(dst):
        return False
    return all(
        s == d or s == 1 for s, d in zip(src[::-1], dst[::-1], strict=False)
    )  # trailing dims: src may have fewer


def _composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """Random non-negative integers summing to ``total`` (zeros allowed: empty sends)."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


def generate_program(
    rng: random.Random,
    *,
    family: Optional[str] = None,
    world_size: Optional[int] = None,
    dtype: Optional[str] = None,
    joint: Optional[bool] = None,
    max_blocks: int = 10,
    features: Sequence[str] = (),
) -> Program:
    """A random program; every choice not given is drawn from ``rng``. ``features``: optional
    program features (:data:`FEATURES`) to generate too."""
    bad = [f for f in features if f not in FEATURES]
    if bad:
        raise ValueError(f"unknown fuzz features {bad}; known: {list(FEATURES)}")
    family = family or rng.choices(list(FAMILY_WEIGHTS), list(FAMILY_WEIGHTS.values()))[0]
    if family not in FAMILIES:
        raise ValueError(f"unknown fuzz family {family!r}; known: {sorted(FAMILIES)}")
    world_size = world_size or rng.choice([2, 4, 4, 4, 8])
    dtype = dtype or rng.choice(["float32", "float32", "float32", "bfloat16"])
    joint = rng.random() < 0.25 if joint is None else joint
    gen = _Gen(rng, world_size, dtype, joint, family, frozenset(features))
    prog = gen.run(rng.randint(2, max_blocks))
    # Derived from the data seed (no extra draw: campaign streams stay what they were).
    # moe_layer: half the programs, since motion needs a replicated router (an input under the contract).
    prog.tp_contract = (family in ("tp", "sp", "mixed", "group_pairs") and prog.seed % 3 == 0) or (
        family == "moe_layer" and prog.seed % 2 == 0
    )
    return prog
