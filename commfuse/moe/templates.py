"""The MoE templates: what each value of a recognised MoE region *means*.

A forward pass over the graph gives a node a :class:`Fact` when one rule proves
what it computes from values that already have facts (or from plain inputs):
``linear(x, w)`` in float32 is the router logits of region ``root``,
``softmax(logits, -1)`` its probabilities, ``one_hot(topk(...)[1], E)`` the choice
mask, ``cumsum(choice, token dim) - choice`` the earlier tokens of each choice, and
so on down to the combined output. Every rule checks the operation, its
constants (dims, ``k``, ``E``, the capacity ``C``), the shapes and that its
operands belong to the same region; a node no rule explains gets no fact. The
region is then *proven* (:func:`.regions.prove`) when one output fact exists and no
intermediate value is used outside the region except the router statistics the
op returns. Two formulations are covered (docs/moe-recognition.md lists them op by op):

* GShard capacity dispatch (:func:`commfuse.models.moe.gshard_gating`): one-hot
  choice mask, slots from cumsums (all first choices before any second choice,
  earlier tokens first), kept = slot < C, einsum dispatch into
  ``[G, E, C, D]``, the buffer laid out for batched experts (tracked as a layout of
  named axes through reshape/transpose and the equal-split all_to_alls), SwiGLU
  by ``bmm``, einsum combine;
* dropless sort-based dispatch (torchtitan): ``histc`` counts, ``argsort`` by
  expert, gather, counts exchanged by ``all_to_all_single``, ``.tolist()`` split
  sizes (unbacked SymInts and the runtime asserts Dynamo records for them),
  ``all_to_all_single_autograd`` with those splits, regroup by local expert
  (``repeat_interleave`` + ``argsort``), one SwiGLU per local expert over
  ``split`` chunks, ``index_copy`` back, the reverse all_to_all and a
  ``scatter_add`` combine weighted by the sorted scores.

Facts never depend on the rank or on values, only on the graph: every rank proves
the same regions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from commfuse.moe.patterns import Call, dtype, is_const, norm_dim, norm_dims, shape, static_shape, tensor

Atom = tuple[str, int]
Dims = tuple[tuple[Atom, ...], ...]


@dataclass
class Fact:
    kind: str
    root: Optional[fx.Node]  # the router-logits node of the region; None: a helper outside regions
    a: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, k: str) -> Any:
        return self.a[k]

    def get(self, k: str, default: Any = None) -> Any:
        return self.a.get(k, default)


@dataclass
class RegionInfo:
    root: fx.Node
    x: fx.Node  # the tokens [..., H] in their own dtype (the op's input)
    w: fx.Node  # router weight [E, H]
    num_experts: int
    hidden: int
    tokens: int  # tokens in the call (numel(x) / H)
    reasons: list[str] = field(default_factory=list)  # template variants commfuse::moe_layer cannot express
    top_k: Optional[int] = None
    groups: set[str] = field(default_factory=set)


STAT_OUTPUT = {"probs_sum": 1, "top1_count": 2, "z_sum": 3}  # index in moe_layer's outputs


def _merge(dim: tuple[Atom, ...]) -> tuple[Atom, ...]:
    out: list[Atom] = []
    for a in dim:
        if out and out[-1][0].endswith(".hi") and a[0] == out[-1][0][:-3] + ".lo":
            out[-1] = (a[0][:-3], out[-1][1] * a[1])
        else:
            out.append(a)
    return tuple(out)


def reshape_layout(dims: Dims, new_shape: tuple[int, ...]) -> Optional[Dims]:
    """The named-axis layout after a row-major reshape (None when axes would interleave)."""
    flat = [a for d in dims for a in d if a[1] != 1]
    out = []
    i = 0
    for s in new_shape:
        cur: list[Atom] = []
        prod = 1
        while prod < s:
            if i >= len(flat):
                return None
            name, sz = flat[i]
            if s % (prod * sz) == 0:
                cur.append(flat[i])
                prod *= sz
                i += 1
            else:
                need = s // prod
                if s % prod or sz % need or name != "e":
                    return None
                cur.append(("e.hi", need))
                flat[i] = ("e.lo", sz // need)
                prod *= need
        if prod != s:
            return None
        out.append(_merge(tuple(cur)))
    if i != len(flat):
        return None
    return tuple(out)


def _resolve_shape(sizes: tuple, numel: int) -> Optional[tuple[int, ...]]:
    if not all(isinstance(s, int) for s in sizes):
        return None
    if sizes.count(-1) > 1:
        return None
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if known == 0 or numel % known:
            return None
        sizes = tuple(numel // known if s == -1 else s for s in sizes)
    return sizes if math.prod(sizes) == numel else None


def _einsum_parts(eq: str) -> Optional[tuple[list[str], str]]:
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    return lhs.split(","), out


_SYM_KINDS = {"send", "recv", "per", "cnt", "symsum", "symbool"}
_ASSERT_OPS = {
    "ge",
    "le",
    "eq",
    "lt",
    "gt",
    "_assert_scalar",
    "sym_constrain_range_for_size",
    "sym_constrain_range",
    "_check",
    "_check_is_size",
    "builtins.sum",
}


class Matcher:
    """Facts for every node of ``gm`` (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.facts: dict[fx.Node, Fact] = {}
        self.regions: dict[fx.Node, RegionInfo] = {}

    # ------------------------------------------------------------ driver
    def run(self) -> "Matcher":
        for n in self.gm.graph.nodes:
            c = Call(n)
            if c.name is None:
                continue
            rule = getattr(self, "r_" + c.name.replace(".", "_"), None)
            f = None
            try:
                f = rule(c) if rule is not None else None
                if f is None and c.name in _ASSERT_OPS:
                    f = self._assert(c)
            except Exception:  # noqa: BLE001 - rules only read the graph
                f = None  # a call with arguments (or symbolic sizes) no rule expects explains nothing
            if f is not None:
                self.facts[n] = f
        return self

    def fact(self, x: Any, *kinds: str) -> Optional[Fact]:
        if not isinstance(x, fx.Node):
            return None
        f = self.facts.get(x)
        if f is None or (kinds and f.kind not in kinds):
            return None
        return f

    def region(self, f: Fact) -> RegionInfo:
        return self.regions[f.root]

    def _new(self, kind: str, like: Fact, **a: Any) -> Fact:
        return Fact(kind, like.root, a)

    def _same_root(self, *fs: Optional[Fact]) -> bool:
        return all(f is not None for f in fs) and len({f.root for f in fs}) == 1

    def _free(self, x: Any) -> bool:
        """A tensor that no region computes (an input of a region)."""
        return (
            isinstance(x, fx.Node)
            and tensor(x) is not None
            and (x not in self.facts or self.facts[x].root is None)
        )

    # ------------------------------------------------------------ router
    def _cast(self, c: Call, to: Optional[torch.dtype]) -> Optional[Fact]:
        src = c.input
        if to is None or not isinstance(src, fx.Node):
            return None
        f = self.facts.get(src)
        if f is None or f.root is None:
            if to == torch.float32 and self._free(src):
                return Fact("cast32", None, {"src": src if f is None else f.get("src", src)})
            return None
        if dtype(src) == to:
            return f  # no-op cast: the same value
        conv = {
            ("logits_lowp", torch.float32): "logits",
            ("choice", None): "choice_f",
            ("kept_b", None): "kept",
            ("slot_oh", None): "slot_ohf",
            ("top1_oh", None): "top1_ohf",
            ("experts_flat", torch.float32): "experts_flat_f",
            ("counts", torch.int64): "counts",
            ("counts", torch.int32): "counts",
            ("back", torch.float32): "back",
            ("weighted", None): "weighted",
            ("dispatch", None): "dispatch_f",
            ("combine", None): "combine",
        }
        kind = conv.get((f.kind, to), conv.get((f.kind, None)))
        if kind is None or (not to.is_floating_point and kind != "counts"):
            return None
        if kind in ("dispatch_f", "combine", "weighted"):
            if to != dtype(self.region(f).x):
                return None
        a = dict(f.a)
        if kind == "counts":
            a["int"] = True
        return Fact(kind, f.root, a)

    def r_float(self, c: Call) -> Optional[Fact]:
        return self._cast(c, torch.float32)

    def r_to(self, c: Call) -> Optional[Fact]:
        return self._cast(c, c.dtype_arg())

    r_type = r_to

    def r_long(self, c: Call) -> Optional[Fact]:
        return self._cast(c, torch.int64)

    def _operand(self, x: Any) -> Optional[tuple[fx.Node, bool]]:
        """(tensor, cast to float32?) for a router operand that no region computes."""
        f = self.fact(x, "cast32")
        if f is not None:
            return f["src"], True
        if self._free(x):
            return x, False
        return None

    def r_linear(self, c: Call) -> Optional[Fact]:
        if c.arg(2, "bias", None) is not None:
            return None
        return self._logits(c, c.input, c.arg(1, "weight"), transposed=False)

    def _logits(self, c: Call, a: Any, b: Any, transposed: bool) -> Optional[Fact]:
        xa, wa = self._operand(a), None
        if transposed:
            wt = self.fact(b, "wt")
            if wt is None:
                return None
            wa = (wt["src"], wt["cast"])
        else:
            wa = self._operand(b)
        if xa is None or wa is None:
            return None
        (x, _), (w, _) = xa, wa
        ws, xs = static_shape(w), static_shape(x)
        if ws is None or xs is None or len(ws) != 2 or len(xs) < 2 or xs[-1] != ws[1]:
            return None
        info = RegionInfo(root=c.node, x=x, w=w, num_experts=ws[0], hidden=ws[1], tokens=math.prod(xs[:-1]))
        self.regions[c.node] = info
        if dtype(c.node) == torch.float32:
            return Fact("logits", c.node)
        info.reasons.append(
            f"router logits computed in {dtype(c.node)} (commfuse::moe_layer computes them in "
            "float32; cast the router input and weight to float32 first)"
        )
        return Fact("logits_lowp", c.node)

    def r_matmul(self, c: Call) -> Optional[Fact]:
        other = c.arg(1, "other")
        if self.fact(other, "wt") is not None and not self.fact(c.input):
            return self._logits(c, c.input, other, transposed=True)
        return self._expert_matmul(c)

    def r_t(self, c: Call) -> Optional[Fact]:
        return self._transpose(c, (0, 1))

    def r_transpose(self, c: Call) -> Optional[Fact]:
        return self._transpose(c, (c.arg(1, "dim0"), c.arg(2, "dim1")))

    def r_permute(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "buf")
        s = shape(c.input)
        if f is None or s is None:
            return None
        dims = [norm_dim(d, len(s)) for d in c.sizes()]
        if None in dims or sorted(dims) != list(range(len(s))):
            return None
        return self._new("buf", f, **{**f.a, "dims": tuple(f["dims"][d] for d in dims)})

    def _transpose(self, c: Call, pair: tuple) -> Optional[Fact]:
        x = c.input
        s = shape(x)
        if s is None:
            return None
        d0, d1 = (norm_dim(d, len(s)) for d in pair)
        if d0 is None or d1 is None:
            return None
        f = self.facts.get(x)
        if f is not None and f.kind == "buf":
            dims = list(f["dims"])
            dims[d0], dims[d1] = dims[d1], dims[d0]
            return self._new("buf", f, **{**f.a, "dims": tuple(dims)})
        if f is not None and f.kind == "wslice" and {d0, d1} == {0, 1} and len(s) == 2:
            return Fact("wslice", None, {**f.a, "transposed": not f["transposed"]})
        if len(s) == 2 and {d0, d1} == {0, 1}:
            op = self._operand(x)
            if op is not None:
                return Fact("wt", None, {"src": op[0], "cast": op[1]})
        return None

    def r_softmax(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "logits")
        s = shape(c.input)
        if (
            f is None
            or norm_dim(c.arg(1, "dim"), len(s)) != len(s) - 1
            or c.kwargs.get("dtype") not in (None, torch.float32)
        ):
            return None
        return self._new("probs", f)

    def r_sigmoid(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "logits")
        if f is None:
            return None
        self.region(f).reasons.append("sigmoid router scores (commfuse::moe_layer routes with softmax)")
        return self._new("probs", f)

    def r_topk(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "probs")
        s = shape(c.input)
        if f is None:
            return None
        k = c.arg(1, "k")
        if (
            not isinstance(k, int)
            or norm_dim(c.arg(2, "dim", -1), len(s)) != len(s) - 1
            or c.arg(3, "largest", True) is not True
            or c.arg(4, "sorted", True) is not True
        ):
            return None
        info = self.region(f)
        if info.top_k not in (None, k):
            return None
        info.top_k = k
        return self._new("topk", f, k=k)

    def r_getitem(self, c: Call) -> Optional[Fact]:
        src, idx = c.args[0], c.args[1]
        f = self.facts.get(src) if isinstance(src, fx.Node) else None
        if f is None:
            if isinstance(idx, int) and self._free(src) and len(static_shape(src) or ()) == 3:
                return Fact("wslice", None, {"w": src, "l": idx, "transposed": False})
            t = self.fact(idx, "token_of")
            if t is not None and src is self.region(t).x:
                return self._new("routed", t, order=t["order"])
            return None
        k = f.kind
        if k == "topk" and idx in (0, 1):
            kk = f["k"]
            return self._new("gates", f, normalized=kk == 1) if idx == 0 else self._new("experts", f)
        if k in ("experts", "choice") and isinstance(idx, tuple):
            s = shape(src)
            # the k axis is the last of experts [.., k] and the one before E of choice [.., k, E]
            kdim = len(s) - 1 if k == "experts" else len(s) - 2
            if len(idx) == kdim + 1 and idx[-1] == 0 and all(i == slice(None) for i in idx[:-1]):
                return self._new("top1_idx" if k == "experts" else "top1_oh", f)
            return None
        if k == "gates_flat" and self.fact(idx, "order") and self._same_root(f, self.facts[idx]):
            return self._new("scores_sorted", f, order=self.facts[idx]["order"])
        if k == "received" and self.fact(idx, "perm") and self._same_root(f, self.facts[idx]):
            return self._new("xs", f, **{**f.a, "perm": idx})
        if (
            k == "ys"
            and self.fact(idx, "perm_inv")
            and self._same_root(f, self.facts[idx])
            and self.facts[idx]["perm"] is f.get("perm")
        ):
            return self._new("yr", f, **f.a)
        if k == "split" and isinstance(idx, int):
            return self._new("chunk", f, **{**f.a, "l": idx})
        if k in ("send_t", "recv_t", "per_t", "counts") and isinstance(idx, int):
            return self._new(
                {"send_t": "send_i", "recv_t": "recv_i", "per_t": "per_i", "counts": "cnt_i"}[k],
                f,
                i=idx,
                **{kk: v for kk, v in f.a.items() if kk != "i"},
            )
        if k == "buf" and idx == 0 and not f["dims"][0]:
            return self._new("buf", f, **{**f.a, "dims": f["dims"][1:]})
        return None

    # ------------------------------------------------------------ gates and statistics
    def r_sum(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        s = shape(c.input)
        if f is None or s is None:
            return None
        dims = norm_dims(c.arg(1, "dim", None), len(s))
        keep = c.arg(2, "keepdim", False)
        if dims is None:
            return None
        k = f.kind
        last = frozenset({len(s) - 1})
        if k == "gates" and dims == last and keep:
            return self._new("gsum", f, gates=c.input)
        if k == "choice" and dims == {1} and keep:
            return self._new("load", f)
        if k == "pos_m" and dims == last and not keep:
            return self._new("slot", f)
        if k in ("assign_g", "assign") and dims == {2} and not keep:
            return self._new("combine" if k == "assign_g" else "assign_sum", f, C=f["C"])
        if k in ("counts_nl", "recv_nl") and not keep and dims in ({0}, {1}):
            kind = {("counts_nl", 1): "send_t", ("recv_nl", 1): "recv_t", ("recv_nl", 0): "per_t"}.get(
                (k, min(dims))
            )
            return None if kind is None else self._new(kind, f, **f.a)
        return self._stat(c, f, dims, keep, scale_by_count=False)

    def r_mean(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        s = shape(c.input)
        if f is None or s is None:
            return None
        dims = norm_dims(c.arg(1, "dim", None), len(s))
        return (
            None if dims is None else self._stat(c, f, dims, c.arg(2, "keepdim", False), scale_by_count=True)
        )

    def _stat(self, c: Call, f: Fact, dims: frozenset, keep: bool, scale_by_count: bool) -> Optional[Fact]:
        """A sum/mean over all of the call's tokens of probs / first-choice one-hot / squared lse."""
        which = {"probs": "probs_sum", "top1_ohf": "top1_count", "lse2": "z_sum"}.get(f.kind)
        s = shape(c.input)
        if which is None or not all(isinstance(d, int) for d in s):
            return None
        token_dims = range(len(s) - 1) if which != "z_sum" else range(len(s))
        reduced = math.prod(s[d] for d in dims)
        info = self.region(f)
        if set(dims) - set(token_dims) or reduced != info.tokens:
            return None  # e.g. per token group: not a sum over the call's tokens
        return self._new("stat", f, which=which, scale=1.0 / reduced if scale_by_count else 1.0)

    def r_add(self, c: Call) -> Optional[Fact]:
        a, b = c.args[0], c.args[1]
        fa, fb = self.fact(a), self.fact(b)
        if fa is not None and fa.kind == "gsum" and fb is None and isinstance(b, float) and b >= 0:
            # x + eps rounds back to x for every sum of top-k softmax probabilities (>= 1/E)
            # when eps is below a quarter ulp of 1/E in float32 (margin for sums a rounding below 1/E).
            e = self.region(fa).num_experts
            if b * e * 2.0**26 < 1:
                return fa
            return None
        pair = {fa.kind if fa else None, fb.kind if fb else None}
        if pair == {"earlier_t", "earlier_k"} and self._same_root(fa, fb):
            return self._new("pos", fa)
        return None

    def r_sub(self, c: Call) -> Optional[Fact]:
        fa, fb = self.fact(c.args[0]), self.fact(c.args[1])
        if not self._same_root(fa, fb):
            return None
        if fa.kind == "cum_t" and fb.kind == "choice" and fa["src"] is c.args[1]:
            return self._new("earlier_t", fa)
        if fa.kind == "cum_load" and fb.kind == "load" and fa["src"] is c.args[1]:
            return self._new("earlier_k", fa)
        return None

    def r_truediv(self, c: Call) -> Optional[Fact]:
        fa, fb = self.fact(c.args[0], "gates"), self.fact(c.args[1], "gsum")
        if fa is None or fb is None or fb["gates"] is not c.args[0] or fa["normalized"]:
            return None
        if self.region(fa).top_k == 1:
            self.region(fa).reasons.append(
                "top-1 gate renormalised to 1 (commfuse::moe_layer keeps the probability as the top-1 gate)"
            )
        return self._new("gates", fa, normalized=True)

    def r_mul(self, c: Call) -> Optional[Fact]:
        a, b = c.args[0], c.args[1]
        fa, fb = self.fact(a), self.fact(b)
        if fa is None and fb is not None:
            a, b, fa, fb = b, a, fb, fa
        if fa is None:
            return None
        if fb is None:
            if fa.kind == "gates" and is_const(b, 1.0):
                return fa  # route_scale = 1
            return None
        if not self._same_root(fa, fb):
            return None
        pair = (fa.kind, fb.kind)
        rules = {
            ("pos", "choice"): "pos_m",
            ("choice_f", "kept_u"): "choice_kept",
            ("ck_u", "so_u"): "assign",
            ("assign", "gates_u2"): "assign_g",
            ("lse", "lse"): "lse2",
            ("back", "scores_col"): "weighted",
        }
        for (p, q), kind in rules.items():
            if pair in ((p, q), (q, p)):
                fp = fa if fa.kind == p else fb
                fq = fb if fp is fa else fa
                if kind == "lse2" and a is not b:
                    return None
                if kind == "choice_kept" or kind == "assign":
                    if kind == "assign" and fp.get("C") != fq.get("C"):
                        return None
                    return self._new(kind, fp, C=fq["C"])
                if kind == "assign_g":
                    return self._new(kind, fp, C=fp["C"])
                if kind == "weighted":
                    if fp.get("order") is None or fp["order"] is not fq.get("order"):
                        return None
                    return self._new(kind, fp, **fp.a)
                return self._new(kind, fp)
        if {fa.kind, fb.kind} == {"act", "proj"} or {fa.kind, fb.kind} == {"act_l", "proj_l"}:
            act, proj = (fa, fb) if fa.kind.startswith("act") else (fb, fa)
            if (
                act.get("dims") != proj.get("dims")
                or act.get("l") != proj.get("l")
                or act["src"] is not proj["src"]
            ):
                return None
            return self._new(
                "hid" if fa.kind in ("act", "proj") else "hid_l",
                act,
                **{**act.a, "w1": act["w"], "w3": proj["w"], "t1": act.get("t"), "t3": proj.get("t")},
            )
        return None

    def r_logsumexp(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "logits")
        s = shape(c.input)
        if f is None or norm_dim(c.arg(1, "dim"), len(s)) != len(s) - 1 or c.arg(2, "keepdim", False):
            return None
        return self._new("lse", f)

    def r_pow(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "lse")
        return self._new("lse2", f) if f is not None and is_const(c.arg(1, "exponent"), 2) else None

    def r_square(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "lse")
        return None if f is None else self._new("lse2", f)

    # ------------------------------------------------------------ GShard capacity slots
    def r_one_hot(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        n = c.arg(1, "num_classes", -1)
        if f is None:
            return None
        info = self.region(f)
        if f.kind == "experts" and n == info.num_experts and len(shape(c.input)) == 3:
            return self._new("choice", f)
        if f.kind == "top1_idx" and n == info.num_experts:
            return self._new("top1_oh", f)
        if f.kind == "slot_cl" and n == f["C"]:
            return self._new("slot_oh", f, C=f["C"])
        return None

    def r_cumsum(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "choice", "load")
        if f is None or c.kwargs.get("dtype") is not None:
            return None
        d = norm_dim(c.arg(1, "dim"), len(shape(c.input)))
        if f.kind == "choice" and d == 1:
            return self._new("cum_t", f, src=c.input)
        if f.kind == "load" and d == 2:
            return self._new("cum_load", f, src=c.input)
        return None

    def r_lt(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.args[0], "slot")
        C = c.args[1]
        if f is None or not isinstance(C, int) or isinstance(C, bool) or C < 1:
            return None
        return self._new("kept_b", f, C=C)

    def r_gt(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.args[0], "assign_sum")
        if f is None or not is_const(c.args[1], 0):
            return None
        return self._new("dispatch", f, C=f["C"])

    def r_clamp(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "slot")
        lo, hi = c.arg(1, "min", None), c.arg(2, "max", None)
        if f is None or lo not in (None, 0) or not isinstance(hi, int) or hi < 0:
            return None
        return self._new("slot_cl", f, C=hi + 1)

    def r_unsqueeze(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        s = shape(c.input)
        if f is None:
            return None
        d = c.arg(1, "dim")
        if not isinstance(d, int) or not -len(s) - 1 <= d <= len(s):
            return None
        d = d % (len(s) + 1)
        last, before_last = len(s), len(s) - 1
        table = {
            ("kept", last): "kept_u",
            ("choice_kept", last): "ck_u",
            ("slot_ohf", before_last): "so_u",
            ("gates", last): "gates_u1",
            ("gates_u1", last): "gates_u2",
        }
        kind = table.get((f.kind, d))
        if kind is not None:
            if kind == "gates_u1" and not f["normalized"]:
                return None
            return self._new(kind, f, **{k: v for k, v in f.a.items() if k == "C"})
        if f.kind == "buf":
            dims = list(f["dims"])
            dims.insert(d, ())
            return self._new("buf", f, **{**f.a, "dims": tuple(dims)})
        return None

    # ------------------------------------------------------------ GShard buffer (named-axis layouts)
    def r_einsum(self, c: Call) -> Optional[Fact]:
        eq = c.args[0]
        ops = (
            list(c.args[1]) if len(c.args) == 2 and isinstance(c.args[1], (list, tuple)) else list(c.args[1:])
        )
        parts = _einsum_parts(eq) if isinstance(eq, str) else None
        if parts is None or len(ops) != 2 or len(parts[0]) != 2:
            return None
        (ia, ib), out = parts
        fa, fb = self.fact(ops[0]), self.fact(ops[1])
        # dispatch: mask [G,T,E,C] (letters g,t,e,c) with tokens [G,T,D] -> buffer over {g,e,c,d}
        for mask, ml, tok, tl in ((fa, ia, ops[1], ib), (fb, ib, ops[0], ia)):
            if mask is not None and mask.kind == "dispatch_f" and len(ml) == 4 and len(tl) == 3:
                info = self.region(mask)
                g, t, e, cc = ml
                if (
                    tok is not info.x
                    or tl[:2] != g + t
                    or len(set(ml + tl[2])) != 5
                    or sorted(out) != sorted(g + e + cc + tl[2])
                ):
                    return None
                sizes = dict(zip(ml, shape(ops[0] if mask is fa else ops[1]), strict=True))
                sizes[tl[2]] = info.hidden
                names = {g: "g", e: "e", cc: "c", tl[2]: "d"}
                dims = tuple(((names[ch], sizes[ch]),) if sizes[ch] != 1 else () for ch in out)
                return self._new("buf", mask, dims=dims, stage="dispatched", C=mask["C"], x=tok, G=sizes[g])
        # combine: weights [G,T,E,C] with the returned buffer [G,E,C,D] -> tokens [G,T,D]
        for comb, cl, buf, bl in ((fa, ia, fb, ib), (fb, ib, fa, ia)):
            if (
                comb is not None
                and comb.kind == "combine"
                and buf is not None
                and buf.kind == "buf"
                and (buf["stage"] == "returned" or (buf["stage"] == "y" and buf.get("group") is None))
                and self._same_root(comb, buf)
                and len(cl) == 4
                and len(bl) == 4
            ):
                g, t, e, cc = cl
                if (
                    comb["C"] != buf["C"]
                    or len(set(cl)) != 4
                    or len(set(bl)) != 4
                    or set(bl) - set(cl) == set()
                ):
                    return None
                d = (set(bl) - set(cl)).pop()
                want = {g: "g", e: "e", cc: "c", d: "d"}
                if set(bl) != {g, e, cc, d} or out != g + t + d:
                    return None
                for ch, atoms in zip(bl, buf["dims"], strict=True):
                    if any(name != want[ch] for name, _ in atoms) or len(atoms) > 1:
                        return None
                if self.region(comb).x is not buf["x"]:
                    return None
                return self._new(
                    "out", comb, **{k: v for k, v in buf.a.items() if k not in ("dims", "stage")}
                )
        return None

    def r_reshape(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        s = static_shape(c.input)
        if f is None:
            return None
        k = f.kind
        out = static_shape(c.node)
        if k == "out":
            return f  # the combined tokens in any shape: row-major order is token order
        if k == "buf" and s is not None and out is not None:
            dims = reshape_layout(f["dims"], out)
            return None if dims is None else self._new("buf", f, **{**f.a, "dims": dims})
        sizes = c.sizes()
        info = self.region(f)
        if k == "experts" and out is not None and len(out) == 1 and len(s) == 2:
            return self._new("experts_flat", f)
        if k == "gates" and f["normalized"] and out is not None and len(out) == 1 and len(s) == 2:
            return self._new("gates_flat", f)
        if (
            k in ("counts", "recv_counts")
            and out is not None
            and len(out) == 2
            and s is not None
            and out[0] * out[1] == info.num_experts
        ):
            if k == "counts" and not f.get("int"):
                return None
            return self._new(
                "counts_nl" if k == "counts" else "recv_nl",
                f,
                n=out[0],
                local=out[1],
                **{kk: v for kk, v in f.a.items() if kk not in ("n", "local")},
            )
        if (
            k in ("token_of", "scores_sorted")
            and out is not None
            and len(out) == 2
            and out[1] == 1
            and sizes
            and sizes[-1] == 1
        ):
            return self._new("token_col" if k == "token_of" else "scores_col", f, order=f["order"])
        return None

    r_view = r_reshape

    def r_contiguous(self, c: Call) -> Optional[Fact]:
        return self.fact(c.input)

    r_clone = r_contiguous

    def r_bmm(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        w = c.arg(1, "mat2")
        ws = static_shape(w)
        if f is None or not self._free(w) or ws is None or len(ws) != 3:
            return None
        if f.kind == "buf" and f["stage"] in ("dispatched", "at_expert") and len(f["dims"]) == 3:
            batch, _, last = f["dims"]
            want = (("e.lo", ws[0]),) if f["stage"] == "at_expert" else (("e", ws[0]),)
            if batch != want or last != (("d", ws[1]),):
                return None
            return self._new("proj", f, **{**f.a, "w": w, "src": c.input, "f": ws[2]})
        if f.kind == "hid" and f["dims"][0] == (((f["dims"][0][0][0]), ws[0]),) and ws[1] == f["f"]:
            dims = (f["dims"][0], f["dims"][1], (("d", ws[2]),))
            if ws[2] != self.region(f).hidden:
                return None
            a = {k: v for k, v in f.a.items() if k not in ("w", "src", "f")}
            return self._new("buf", f, **{**a, "dims": dims, "stage": "y", "w2": w, "t2": False})
        return None

    def r_silu(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "proj", "proj_l")
        return None if f is None else self._new("act" if f.kind == "proj" else "act_l", f, **f.a)

    def r_c10d_all_to_all_single(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input)
        if f is None:
            return None
        out_splits, in_splits, group = c.args[1], c.args[2], c.args[3]
        info = self.region(f)
        if f.kind == "buf" and f["stage"] in ("dispatched", "y"):
            s = static_shape(c.input)
            n = len(in_splits)
            if (
                s is None
                or not n
                or list(in_splits) != [s[0] // n] * n
                or list(out_splits) != list(in_splits)
            ):
                return None
            dims = list(f["dims"])
            head = list(dims[0])
            if f["stage"] == "dispatched":
                if head and head[0] == ("e", info.num_experts) and info.num_experts % n == 0 and n > 1:
                    head[0:1] = [("e.hi", n), ("e.lo", info.num_experts // n)]
                if not head or head[0] != ("e.hi", n) or f.get("group") is not None:
                    return None
                head[0] = ("src", n)
                stage = "at_expert"
            else:
                if head and head[0] == ("src", n) and f.get("group") not in (None, group):
                    info.groups.add(group)  # reported: one region over two groups
                if not head or head[0] != ("src", n) or f.get("group") != group:
                    return None
                head[0] = ("e.hi", n)
                stage = "returned"
            dims[0] = _merge(tuple(head))
            info.groups.add(group)
            return self._new(
                "a2a",
                f,
                result=self._new(
                    "buf", f, **{**f.a, "dims": tuple(dims), "stage": stage, "group": group, "n": n}
                ),
            )
        if f.kind == "counts" and f.get("int"):
            e = info.num_experts
            n = len(in_splits)
            if not n or e % n or list(in_splits) != [e // n] * n or list(out_splits) != list(in_splits):
                return None
            info.groups.add(group)
            return self._new("a2a", f, result=self._new("recv_counts", f, group=group, n=n, local=e // n))
        if f.kind == "routed":
            send = [self.fact(x, "send") for x in in_splits]
            recv = [self.fact(x, "recv") for x in out_splits]
            if (
                not send
                or None in send
                or None in recv
                or len(send) != len(recv)
                or [s["i"] for s in send] != list(range(len(send)))
                or [r["i"] for r in recv] != list(range(len(recv)))
                or {r["group"] for r in recv} != {group}
                or not self._same_root(f, *send, *recv)
                or {(s["n"], s["local"]) for s in send + recv} != {(len(send), recv[0]["local"])}
            ):
                return None
            info.groups.add(group)
            return self._new(
                "a2a",
                f,
                result=self._new(
                    "received", f, group=group, n=len(send), local=send[0]["local"], order=f["order"]
                ),
            )
        if f.kind == "yr":
            send = [self.fact(x, "send") for x in out_splits]
            recv = [self.fact(x, "recv") for x in in_splits]
            if (
                not send
                or None in send
                or None in recv
                or [s["i"] for s in send] != list(range(len(send)))
                or [r["i"] for r in recv] != list(range(len(recv)))
                or f.get("group") != group
                or {r["group"] for r in recv} != {group}
                or not self._same_root(f, *send, *recv)
            ):
                return None
            return self._new("a2a", f, result=self._new("back", f, **f.a))
        return None

    def r_c10d_wait_tensor(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "a2a")
        return None if f is None else f["result"]

    # ------------------------------------------------------------ dropless: counts and sort
    def r_histc(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "experts_flat_f")
        if f is None:
            return None
        e = self.region(f).num_experts
        if (
            c.arg(1, "bins", 100) != e
            or not is_const(c.arg(2, "min", 0), 0)
            or not is_const(c.arg(3, "max", 0), e)
        ):
            return None
        return self._new("counts", f, int=False)

    def r_argsort(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "experts_flat", "row_expert", "perm")
        s = shape(c.input)
        if f is None or norm_dim(c.arg(1, "dim", -1), len(s)) != 0 or c.arg(2, "descending", False):
            return None
        kind = {"experts_flat": "order", "row_expert": "perm", "perm": "perm_inv"}[f.kind]
        # The node itself: two sorts of the same keys may order ties differently, so every
        # use of a permutation must be of this one.
        return self._new(kind, f, **{**f.a, kind: c.node})

    def r_floordiv(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.args[0], "order")
        if f is None or c.args[1] != self.region(f).top_k:
            return None
        return self._new("token_of", f, order=f["order"])

    def r_expand(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "token_col")
        out = static_shape(c.node)
        if f is None or out is None or out[1] != self.region(f).hidden:
            return None
        return self._new("token_idx", f, order=f["order"])

    def r_gather(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.arg(2, "index"), "token_idx")
        if (
            f is None
            or c.input is not self.region(f).x
            or norm_dim(c.arg(1, "dim"), 2) != 0
            or len(shape(c.input)) != 2
        ):
            return None
        return self._new("routed", f, order=f["order"])

    def r_index_select(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.arg(2, "index"), "token_of")
        if f is None or c.input is not self.region(f).x or norm_dim(c.arg(1, "dim"), 2) != 0:
            return None
        return self._new("routed", f, order=f["order"])

    def r_item(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "send_i", "recv_i", "per_i", "cnt_i")
        if f is None:
            return None
        return self._new(f.kind[:-2], f, **f.a)

    def _assert(self, c: Call) -> Optional[Fact]:
        inputs = [a for a in c.node.all_input_nodes]
        fs = [self.fact(a) for a in inputs]
        if not fs or any(f is None or f.kind not in _SYM_KINDS for f in fs) or not self._same_root(*fs):
            return None
        return self._new("symbool", fs[0])

    def r_sym_sum(self, c: Call) -> Optional[Fact]:
        items = c.args[0]
        fs = [self.fact(x) for x in items] if isinstance(items, (list, tuple)) else []
        if not fs or any(f is None or f.kind not in _SYM_KINDS for f in fs) or not self._same_root(*fs):
            return None
        return self._new("symsum", fs[0], of=tuple(f.kind for f in fs))

    def r_arange(self, c: Call) -> Optional[Fact]:
        if len(c.args) == 1 and isinstance(c.args[0], int) and not c.node.all_input_nodes:
            return Fact("arange", None, {"n": c.args[0]})
        return None

    def r_repeat(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "arange")
        sizes = c.sizes()
        if f is None or len(sizes) != 1 or not isinstance(sizes[0], int):
            return None
        return Fact("arange_rep", None, {"local": f["n"], "n": sizes[0]})

    def r_repeat_interleave(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "arange_rep")
        r = self.fact(c.arg(1, "repeats"), "recv_counts")
        if (
            f is None
            or r is None
            or (f["local"], f["n"]) != (r["local"], r["n"])
            or c.arg(2, "dim", None) not in (None, 0)
        ):
            return None
        return self._new("row_expert", r, **r.a)

    def r_split(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "xs", "routed")
        sizes = c.arg(1, "split_size_or_sections")
        if f is None or norm_dim(c.arg(2, "dim", 0), 2) != 0 or not isinstance(sizes, (list, tuple)):
            return None
        want = "per" if f.kind == "xs" else "cnt"
        fs = [self.fact(x, want) for x in sizes]
        if None in fs or [g["i"] for g in fs] != list(range(len(fs))) or not self._same_root(f, *fs):
            return None
        if f.kind == "routed" and len(fs) != self.region(f).num_experts:
            return None
        if f.kind == "xs" and len(fs) != f["local"]:
            return None
        return self._new(
            "split",
            f,
            local=len(fs),
            group=f.get("group"),
            n=f.get("n", 1),
            direct=f.kind == "routed",
            order=f["order"],
            perm=f.get("perm"),
        )

    def _expert_matmul(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "chunk", "hid_l")
        wf = self.fact(c.arg(1, "other"), "wslice")
        if f is None or wf is None or wf["l"] != f["l"] or not wf["transposed"]:
            return None
        ws = static_shape(wf["w"])
        if ws[0] != f["local"]:
            return None
        if f.kind == "chunk":
            if ws[2] != self.region(f).hidden:
                return None
            return self._new("proj_l", f, **{**f.a, "w": wf["w"], "t": True, "src": c.input})
        if ws[1] != self.region(f).hidden or ws[2] != static_shape(f["w1"])[1]:
            return None
        a = {k: v for k, v in f.a.items() if k not in ("w", "src", "t")}
        return self._new("y_l", f, **{**a, "w2": wf["w"], "t2": True})

    def r_cat(self, c: Call) -> Optional[Fact]:
        items = c.arg(0, "tensors")
        if not isinstance(items, (list, tuple)) or norm_dim(c.arg(1, "dim", 0), 2) != 0:
            return None
        fs = [self.fact(x, "y_l") for x in items]
        if (
            not fs
            or None in fs
            or [g["l"] for g in fs] != list(range(len(fs)))
            or len(fs) != fs[0]["local"]
            or not self._same_root(*fs)
        ):
            return None
        keys = ("w1", "w3", "w2", "t1", "t3", "t2")
        if any(any(g[k] is not fs[0][k] for k in keys) for g in fs):
            return None
        a = {k: v for k, v in fs[0].a.items() if k != "l"}
        # Without expert parallelism the rows never left: the expert outputs are already
        # the per-assignment outputs in sorted order.
        return self._new("back" if a.get("direct") else "ys", fs[0], **a)

    def r_zeros_like(self, c: Call) -> Optional[Fact]:
        f = self.fact(c.input, "ys")
        if f is not None:
            return self._new("zeros_ys", f)
        for info in self.regions.values():
            if c.input is info.x:
                return Fact("zeros_x", None, {"x": info.x})
        return None

    r_empty_like = r_zeros_like

    def r_index_copy(self, c: Call) -> Optional[Fact]:
        base, perm, src = c.input, c.arg(2, "index"), c.arg(3, "source")
        fz, fp, fs = self.fact(base, "zeros_ys"), self.fact(perm, "perm"), self.fact(src, "ys")
        if None in (fz, fp, fs) or norm_dim(c.arg(1, "dim"), 2) != 0 or not self._same_root(fz, fp, fs):
            return None
        if self.facts[base].root is not fs.root or base.args[0] is not src or perm is not fs.get("perm"):
            return None
        return self._new("yr", fs, **fs.a)

    def _combine(self, c: Call, index_kind: str) -> Optional[Fact]:
        base, idx, src = (
            c.input,
            c.arg(2, "index"),
            c.arg(3, "src" if index_kind == "token_idx" else "source"),
        )
        fz, fi, fw = self.fact(base, "zeros_x"), self.fact(idx, index_kind), self.fact(src, "weighted")
        if (
            None in (fz, fi, fw)
            or norm_dim(c.arg(1, "dim"), 2) != 0
            or not self._same_root(fi, fw)
            or fz["x"] is not self.region(fw).x
            or fi["order"] is not fw.get("order")
        ):
            return None
        return self._new("out", fw, **fw.a)

    def r_scatter_add(self, c: Call) -> Optional[Fact]:
        return self._combine(c, "token_idx")

    def r_index_add(self, c: Call) -> Optional[Fact]:
        if c.kwargs.get("alpha", 1) != 1:
            return None
        return self._combine(c, "token_of")
