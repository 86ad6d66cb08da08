"""Tolerance policy and tree comparisons for optimised-vs-reference numerics.

A commfuse pass may legally change *where* and *in which order* floating-point
sums happen: splitting an ``all_reduce`` into ``reduce_scatter`` +
``all_gather``, bucketing several collectives into one buffer (which moves
each element to a different ring chunk, hence a different starting rank),
or reordering compute around collectives. Floating-point addition is not
associative, so the optimised program may differ from the reference by
rounding error; it must not differ by more. :func:`tolerances` encodes how
much rounding error is acceptable and :func:`assert_close_tree` applies it to
nested results.

Where a pass only moves collectives (no change to any reduction order), use
:func:`assert_bitwise_equal_tree` instead: "close" would hide real bugs.

Elementwise criterion (``torch.testing.assert_close``)::

    |actual - expected| <= atol + rtol * |expected|

Policy (``rtol``, ``atol``) and why:

=========  ========  ========  ==============================================
dtype      rtol      atol      unit roundoff u (= eps / 2)
=========  ========  ========  ==============================================
float64    1e-12     1e-13     1.1e-16
float32    1e-4      1e-5      6.0e-8
float16    2e-3      1e-3      4.9e-4   (11 significant bits)
bfloat16   2e-2      1e-2      3.9e-3   (8 significant bits)
=========  ========  ========  ==============================================

* fp32/fp64 programs accumulate in their own precision, so a reordered
  K-term reduction differs by about sqrt(K)·u·sum|x_i| (worst case K·u), and
  forward + backward chain several of them (hidden sizes ~1e3): rtol ≈
  1.7e3·u for fp32. An all_reduce reordered as ring reduce-scatter +
  all-gather uses at most 2% of the fp32 tolerance at 4 ranks and 40% at 64
  (measured), while real bugs (a wrong shard, a missing scale factor, a
  dropped collective) are off by O(1).
* fp16/bf16 kernels accumulate in fp32 and round once at the output, so a
  reordered *kernel* differs by one or two output roundings: rtol ≈ 4-5 u
  (2-2.5 ulp), i.e. 2e-2 for bf16 and 2e-3 for fp16.
* atol covers results that cancel to ~0 (common in gradients), where rtol
  alone would demand impossible precision; it assumes values of magnitude
  O(1) (unit-variance init and inputs, mean-reduced losses). Tests with larger
  magnitudes should pass explicit tolerances.
* Collectives on fp16/bf16 tensors are different: gloo and NCCL add in the
  tensor's dtype, one rounding per hop. Reordering an n-rank reduction then
  differs by up to ~5·u·sum|x_i| (measured), i.e. up to ~0.06 for bf16 at
  n=4 on unit-scale inputs, which breaks the base atol where results cancel. Pass
  ``summands=<ranks in the reduction>`` to widen atol to ``8·u·summands``
  (measured worst case at n = 3..64 uses <= 0.5 of that). With 2 summands
  the sum is exact under reordering (fp addition is commutative).
"""

from __future__ import annotations

import functools
import inspect
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "assert_bitwise_equal_tree",
    "assert_close_tree",
    "tolerances",
    "train_step_outputs",
]

_BASE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-13),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}
# atol per summand (in units of u) for reductions accumulated in low precision.
_SUMMAND_ATOL_UNITS = 8.0


def tolerances(dtype: torch.dtype, *, summands: int | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing an optimised result with the reference.

    ``dtype`` is the dtype the values were computed in. Complex dtypes use
    their real component's policy; integer and bool dtypes must match exactly
    (``(0.0, 0.0)``). ``summands``: when the compared values come out of a
    reduction over that many terms that is *accumulated in ``dtype`` itself*
    (e.g. a bf16 all_reduce over 4 ranks) and may have been reordered, atol is
    widened to ``8 * u * summands``; see the module docstring.
    """
    if dtype.is_complex:
        dtype = torch.empty((), dtype=dtype).real.dtype
    if not dtype.is_floating_point:
        return (0.0, 0.0)
    try:
        rtol, atol = _BASE_TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance policy for dtype {dtype}") from None
    if summands is not None:
        if summands < 1:
            raise ValueError(f"summands must be >= 1, got {summands}")
        unit_roundoff = torch.finfo(dtype).eps / 2
        atol = max(atol, _SUMMAND_ATOL_UNITS * unit_roundoff * summands)
    return (rtol, atol)


# --------------------------------------------------------------------------
# Tree walking
# --------------------------------------------------------------------------


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _is_dtensor(x: object) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def _local(x: Any) -> Any:
    """A DTensor's local shard; anything else unchanged."""
    return x.to_local() if _is_dtensor(x) else x


def _child_path(path: str, key: object) -> str:
    # Top-level string keys read like variable names: grads['w1.weight'].
    if path == "" and isinstance(key, str) and key.isidentifier():
        return key
    return f"{path}[{key!r}]"


def _walk(actual: Any, expected: Any, path: str) -> Iterator[tuple[str, Any, Any, str | None]]:
    """Yield ``(path, actual_leaf, expected_leaf, structure_error)`` pairs.

    Dicts must have equal key sets; lists and tuples are interchangeable but
    must have equal lengths; DTensors are compared by their local tensors.
    """
    actual, expected = _local(actual), _local(expected)
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            yield path, actual, expected, f"expected a mapping, got {type(actual).__name__}"
            return
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            yield path, actual, expected, f"keys differ: missing {missing}, unexpected {extra}"
        for key in expected:
            if key in actual:
                yield from _walk(actual[key], expected[key], _child_path(path, key))
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            yield path, actual, expected, f"expected a sequence, got {type(actual).__name__}"
            return
        if len(actual) != len(expected):
            yield path, actual, expected, f"length {len(actual)} != expected {len(expected)}"
            return
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            yield from _walk(a, e, _child_path(path, i))
    else:
        yield path, actual, expected, None


def _raise_mismatches(kind: str, problems: list[str], msg: str) -> None:
    if problems:
        head = f"{kind}: {len(problems)} mismatching leaves" + (f" {msg}" if msg else "")
        raise AssertionError(head + "\n\n" + "\n\n".join(problems))


def _where(path: str, msg: str) -> str:
    where = path or "<root>"
    return f"{where} {msg}" if msg else where


# --------------------------------------------------------------------------
# Close comparison
# --------------------------------------------------------------------------


def assert_close_tree(
    actual: Any,
    expected: Any,
    *,
    dtype: torch.dtype | None = None,
    msg: str = "",
    rtol: float | None = None,
    atol: float | None = None,
    summands: int | None = None,
) -> None:
    """Assert two nested structures of tensors are close under the policy.

    Structures are dicts / lists / tuples of tensors, DTensors (compared by
    ``.to_local()``), Python numbers and other ``==``-comparable leaves.
    Tolerances come from :func:`tolerances` of ``dtype`` if given, else of
    each expected tensor's dtype (Python floats: float32 policy, since they
    usually come from ``.item()`` of a float32 loss); ``rtol`` / ``atol``
    override one or both. NaNs at the same positions compare equal. Tensor
    dtypes and shapes must match.

    Every mismatching leaf is reported, each with its path, e.g.
    ``grads['w1.weight'] on rank 2`` for ``msg="on rank 2"``.
    """
    problems: list[str] = []
    for path, a, e, structure_error in _walk(actual, expected, ""):
        where = _where(path, msg)
        if structure_error is not None:
            problems.append(f"{where}: {structure_error}")
            continue
        leaf_dtype = dtype
        if leaf_dtype is None:
            leaf_dtype = e.dtype if isinstance(e, torch.Tensor) else torch.float32
        leaf_rtol, leaf_atol = tolerances(leaf_dtype, summands=summands)
        leaf_rtol = leaf_rtol if rtol is None else rtol
        leaf_atol = leaf_atol if atol is None else atol
        error = _close_leaf(a, e, leaf_rtol, leaf_atol)
        if error is not None:
            problems.append(
                f"{where} (policy dtype={leaf_dtype}, rtol={leaf_rtol:g}, atol={leaf_atol:g}):\n{error}"
            )
    _raise_mismatches("assert_close_tree", problems, msg)


def _close_leaf(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None if the leaves are close, else a description of the difference."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return f"type {type(actual).__name__} != expected {type(expected).__name__}"
        try:
            torch.testing.assert_close(
                actual.detach(), expected.detach(), rtol=rtol, atol=atol, equal_nan=True
            )
        except AssertionError as err:
            return str(err)
        return None
    if _is_float_pair(actual, expected):
        a, e = float(actual), float(expected)
        if (math.isnan(a) and math.isnan(e)) or abs(a - e) <= atol + rtol * abs(e):
            return None
        return f"{a!r} != expected {e!r} (abs diff {abs(a - e):g})"
    if type(actual) is not type(expected) or actual != expected:
        return f"{actual!r} != expected {expected!r}"
    return None


def _is_float_pair(a: object, b: object) -> bool:
    numbers = (int, float)
    return (
        isinstance(a, numbers)
        and isinstance(b, numbers)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and (isinstance(a, float) or isinstance(b, float))
    )


# --------------------------------------------------------------------------
# Bitwise comparison
# --------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t``, one row per element."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    if size in _INT_OF_SIZE:
        return flat.view(_INT_OF_SIZE[size]).reshape(-1, 1)
    return flat.view(torch.uint8).reshape(flat.numel(), size)  # e.g. complex128


def assert_bitwise_equal_tree(actual: Any, expected: Any, *, msg: str = "") -> None:
    """Assert two nested structures are bit-for-bit identical.

    Same walk as :func:`assert_close_tree`. Tensors must have equal dtype,
    shape and bits (so ``-0.0 != 0.0`` and identical NaNs are equal); Python
    floats are compared by their IEEE bits; other leaves with ``==``.
    """
    problems: list[str] = []
    for path, a, e, structure_error in _walk(actual, expected, ""):
        error = structure_error if structure_error is not None else _bitwise_leaf(a, e)
        if error is not None:
            problems.append(f"{_where(path, msg)}: {error}")
    _raise_mismatches("assert_bitwise_equal_tree", problems, msg)


def _bitwise_leaf(actual: Any, expected: Any) -> str | None:
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return f"type {type(actual).__name__} != expected {type(expected).__name__}"
        return _bitwise_tensor(actual, expected)
    if isinstance(actual, float) and isinstance(expected, float):
        if struct.pack("<d", actual) == struct.pack("<d", expected):
            return None
        return f"{actual!r} != expected {expected!r} (bitwise)"
    if type(actual) is not type(expected) or actual != expected:
        return f"{actual!r} != expected {expected!r}"
    return None


def _bitwise_tensor(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    differ = (_bits(actual.cpu()) != _bits(expected.cpu())).any(dim=1)
    count = int(differ.sum())
    if count == 0:
        return None
    first = int(differ.nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), expected.shape))
    a_val = actual.detach().reshape(-1)[first].item()
    e_val = expected.detach().reshape(-1)[first].item()
    detail = f"{count} of {expected.numel()} elements differ bitwise; first at index {index}: {a_val!r} != expected {e_val!r}"
    if expected.is_floating_point():
        diff = (actual.detach().double() - expected.detach().double()).abs()
        detail += f"; max abs diff {diff.nan_to_num(nan=math.inf).max().item():g}"
    return detail


# --------------------------------------------------------------------------
# Training-step helper (runs inside a rank)
# --------------------------------------------------------------------------


def _to_cpu(x: Any) -> Any:
    """Detached CPU copy of a (D)Tensor; other values unchanged."""
    x = _local(x)
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").clone()
    return x


def _to_cpu_tree(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _to_cpu_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_cpu_tree(v) for v in x]
    if isinstance(x, tuple):  # namedtuples become plain tuples (always picklable)
        return tuple(_to_cpu_tree(v) for v in x)
    return _to_cpu(x)


def _tensor_leaves(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, Mapping):
        for v in x.values():
            yield from _tensor_leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensor_leaves(v)
    elif isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        yield x


def _default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating tensor in the output (DTensors stay DTensors)."""
    leaves = list(_tensor_leaves(output))
    if not leaves:
        raise ValueError("model output has no floating-point tensors; pass loss_fn")
    loss = leaves[0].sum()
    for leaf in leaves[1:]:
        loss = loss + leaf.sum()
    return loss


def _loss_value(loss: torch.Tensor) -> torch.Tensor:
    # A DTensor loss is usually Partial: its local value is one rank's share.
    # full_tensor() (a collective every rank runs) gives the real loss.
    if _is_dtensor(loss):
        loss = loss.full_tensor()
    return loss.detach().to("cpu").clone()


def _make_inputs(input_factory: Callable[..., Any], step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Call the factory (with ``step`` if it takes a positional argument)."""
    try:
        params = inspect.signature(input_factory).parameters.values()
        takes_step = any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
        )
    except (TypeError, ValueError):  # builtins without a signature
        takes_step = True
    inputs = input_factory(step) if takes_step else input_factory()
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (inputs,), {}


def train_step_outputs(
    model_factory: Callable[[], torch.nn.Module],
    input_factory: Callable[..., Any],
    *,
    backend: str | Callable[..., Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    steps: int = 1,
    lr: float | None = None,
) -> dict[str, Any]:
    """Run ``steps`` training steps and return everything worth comparing.

    Meant to run inside a rank (or a single process): run it once eagerly and
    once compiled in the same job, then compare with :func:`assert_close_tree`
    or :func:`assert_bitwise_equal_tree`.

    Args:
        model_factory: builds the model; must seed itself so two calls build
            identical models.
        input_factory: ``input_factory(step)`` (or ``input_factory()`` if it
            takes no positional argument) returns the model inputs: a tensor
            (one argument), a tuple (positional arguments) or a mapping
            (keyword arguments). Must be deterministic for the comparison to
            mean anything.
        backend: ``None`` runs eagerly; otherwise the model is wrapped in
            ``torch.compile(model, backend=backend)``.
        loss_fn: maps the model output to a scalar loss; default: the sum of
            every floating tensor in the output.
        steps: number of forward + backward steps; grads are cleared before
            each step.
        lr: if given, ``torch.optim.SGD(lr=lr)`` steps after each backward.

    Returns:
        ``{"outputs": [output per step], "loss": [loss per step],
        "grads": {name: grad after the last backward or None},
        "params": {name: value after the last step}}``, with DTensors
        replaced by their local tensors (a DTensor loss by its
        ``full_tensor()``) and everything detached, cloned and on CPU.
    """
    model = model_factory()
    runner: Callable[..., Any] = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if lr is not None else None
    compute_loss = loss_fn if loss_fn is not None else _default_loss
    outputs: list[Any] = []
    losses: list[torch.Tensor] = []
    for step in range(steps):
        for param in model.parameters():
            param.grad = None
        args, kwargs = _make_inputs(input_factory, step)
        output = runner(*args, **kwargs)
        loss = compute_loss(output)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        outputs.append(_to_cpu_tree(output))
        losses.append(_loss_value(loss))
    named = list(model.named_parameters())
    return {
        "outputs": outputs,
        "loss": losses,
        "grads": {name: None if p.grad is None else _to_cpu(p.grad) for name, p in named},
        "params": {name: _to_cpu(p) for name, p in named},
    }
