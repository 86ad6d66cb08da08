"""Greedy shrinking of a failing program to a small one that still fails the same way.

Delta debugging over the program description: repeatedly try simpler candidates and
keep the first that still fails (same pipeline, same failure kind), until none does or
the budget is spent. Candidates, in order:

1. fewer outputs (each output alone, then each one dropped);
2. dead-op elimination (ops whose results no output needs);
3. one op removed: its results replaced by a same-shaped input of the op (so a
   chain closes around it) or, when there is none, its dependents removed too;
4. simpler attributes: a collective on the world group, ``sum`` reductions, dim 0,
   non-batched p2p, shift 1; fp32 instead of bf16; forward-only instead of joint;
5. smaller shapes: every occurrence of one input dimension size halved;
6. a world of 2 ranks when every collective is on the world group.

Candidates the fuzzer cannot trace or run count as "does not fail".
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

from commfuse.fuzz.program import Program, value_shapes


def _prune(p: Program) -> Optional[Program]:
    """Drop outputs/ops that reference missing values, then unused inputs and groups."""
    known = {i["name"] for i in p.inputs}
    ops = []
    for op in p.ops:
        if all(v in known for v in op["in"]):
            ops.append(op)
            known.update(op["out"])
    outputs = [o for o in p.outputs if o in known]
    if not outputs:
        return None
    p.ops, p.outputs = ops, list(dict.fromkeys(outputs))
    used = {v for op in ops for v in op["in"]} | set(p.outputs)
    p.inputs = [i for i in p.inputs if i["name"] in used]
    roles = {op["group"] for op in ops if "group" in op} | {"world"}
    p.groups = {r: g for r, g in p.groups.items() if r in roles}
    return p


def _dce(p: Program) -> Program:
    needed = set(p.outputs)
    keep = []
    for op in reversed(p.ops):
        if any(o in needed for o in op["out"]):
            keep.append(op)
            needed.update(op["in"])
    p.ops = list(reversed(keep))
    return p


def _remove_op(p: Program, i: int, shapes: dict) -> Optional[Program]:
    q = p.copy()
    op = q.ops.pop(i)
    repl = {}
    for out in op["out"]:
        same = [v for v in op["in"] if shapes.get(v) is not None and shapes.get(v) == shapes.get(out)]
        if same:
            repl[out] = same[0]
    for later in q.ops[i:]:
        later["in"] = [repl.get(v, v) for v in later["in"]]
    q.outputs = [repl.get(v, v) for v in q.outputs]
    return _prune(q)


def _attribute_candidates(p: Program) -> Iterator[Program]:
    if p.dtype != "float32":
        q = p.copy()
        q.dtype = "float32"
        yield q
    if p.joint:
        q = p.copy()
        q.joint = False
        yield q
    simpler = {
        "group": "world",
        "reduce": "sum",
        "dim": 0,
        "split_dim": 0,
        "concat_dim": 0,
        "batch": False,
        "shift": 1,
        "src": 0,
        "log": False,
    }
    for i, op in enumerate(p.ops):
        for key, val in simpler.items():
            if key in op and op[key] != val:
                q = p.copy()
                q.ops[i][key] = val
                if key == "group":
                    _prune(q)
                yield q


def _shape_candidates(p: Program) -> Iterator[Program]:
    sizes = sorted({d for i in p.inputs for d in i["shape"] if d > 1}, reverse=True)
    for s in sizes:
        q = p.copy()
        for i in q.inputs:
            i["shape"] = [d // 2 if d == s else d for d in i["shape"]]
        yield q


def _world_candidates(p: Program) -> Iterator[Program]:
    if (
        p.world_size > 2
        and all(op.get("group", "world") == "world" for op in p.ops)
        and not any("splits" in op for op in p.ops)
    ):
        q = p.copy()
        q.world_size = 2
        q.groups = {"world": [[0, 1]]}
        for op in q.ops:
            if "shift" in op:
                op["shift"] = 1
            if "src" in op:
                op["src"] = min(op["src"], 1)
        yield q


def shrink(
    program: Program,
    still_fails: Callable[[Program], bool],
    *,
    max_checks: int = 300,
    time_limit: Optional[float] = 120.0,
    log: Optional[Callable[[str], None]] = None,
) -> tuple[Program, int]:
    """Shrink ``program`` while ``still_fails`` holds; returns (smallest program, checks made)."""
    deadline = None if time_limit is None else time.monotonic() + time_limit
    best = program.copy()
    checks = 0

    def budget() -> bool:
        return checks < max_checks and (deadline is None or time.monotonic() < deadline)

    def attempt(cand: Optional[Program]) -> bool:
        nonlocal checks, best
        if cand is None or not budget() or cand.dumps() == best.dumps():
            return False
        checks += 1
        try:
            ok = still_fails(cand)
        except Exception:  # noqa: BLE001 - an invalid candidate does not reproduce the failure
            ok = False
        if ok:
            best = cand
            if log:
                log(f"shrink: {len(best.ops)} ops, {len(best.inputs)} inputs ({checks} checks)")
        return ok

    changed = True
    while changed and budget():
        changed = False
        # 1. outputs
        if len(best.outputs) > 1:
            for o in list(best.outputs):
                q = best.copy()
                q.outputs = [o]
                if attempt(_prune(_dce(q))):
                    changed = True
                    break
            else:
                for o in list(best.outputs):
                    q = best.copy()
                    q.outputs = [x for x in q.outputs if x != o]
                    if q.outputs and attempt(_prune(q)):
                        changed = True
                        break
            if changed:
                continue
        # 2. dead ops
        q = _prune(_dce(best.copy()))
        if q is not None and len(q.ops) < len(best.ops) and attempt(q):
            changed = True
            continue
        # 3. single ops, last first
        shapes = value_shapes(best)
        for i in reversed(range(len(best.ops))):
            if attempt(_remove_op(best, i, shapes)):
                changed = True
                break
        if changed:
            continue
        # 4-6. attributes, shapes, world size
        for gen in (_attribute_candidates, _shape_candidates, _world_candidates):
            for cand in gen(best):
                if attempt(cand):
                    changed = True
                    break
            if changed:
                break
    return best, checks
