"""The process-global state a test can change, as a snapshot that two points in time compare.

``tests/conftest.py``'s autouse fixture takes a :func:`snapshot` before every test and one after
it; a test whose :func:`diff` is not empty fails (its teardown errors, naming what changed), and
:func:`restore` puts the state back so the tests after it in the same process are unaffected.
docs/testing.md ("No leaked global state") lists what is covered and what is left out.

A snapshot maps an area ("os.environ", "torch._inductor.config", "logging", ...) to its keys'
values, compared with ``==``; a key missing from one side is reported as appearing or vanishing.
The torch config modules are read with ``get_config_copy``, which deep-copies mutable values, so
an in-place change to a list or dict setting is seen too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch._logging import _internal as torch_logs

from commfuse import config as cf_config
from commfuse import session as cf_session
from commfuse.core import kernel_collectives
from commfuse.lowering import recorder
from commfuse.transforms import registry

Snapshot = dict[str, dict[str, Any]]

_MISSING = object()

TORCH_CONFIGS = {
    "torch._dynamo.config": torch._dynamo.config,
    "torch._inductor.config": torch._inductor.config,
    "torch._functorch.config": torch._functorch.config,
}

# Environment variables that change around a test without the test changing them.
ENV_NOT_COMPARED = frozenset(
    {
        # pytest's own, rewritten for each phase (setup, call, teardown)
        "PYTEST_CURRENT_TEST",
        # benchmarks/run.py sets it (setdefault) when first imported, for the rank processes it
        # starts: the runner is a script and configures its process on import, as a module that
        # first appears during a test sets up its own logger. It only quiets Kineto's profiler lines.
        "KINETO_LOG_LEVEL",
        # torch writes these itself the first time it uses the feature, for the code it then loads
        # or the workers it starts, and leaves them: Inductor's first compiled C++ module
        # (torch/_inductor/codecache.py), its compile-worker pool (async_compile.py), its first Triton
        # kernel (runtime/triton_heuristics.py, compile_tasks.py), the import of its numeric checks
        # (fx_passes/numeric_utils.py), the profiler with CUDA graphs (profiler/profiler.py).
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        "TORCH_WARM_POOL",
        "TRITON_CACHE_DIR",
        "TRITON_PTXAS_PATH",
        "TRITON_LIBDEVICE_PATH",
        "CUBLAS_WORKSPACE_CONFIG",
        "DISABLE_CUPTI_LAZY_REINIT",
        "TEARDOWN_CUPTI",
    }
)


def pytest_handler(h: logging.Handler) -> bool:
    """A handler of pytest's logging plugin. It attaches them to the root logger and to every
    non-propagating logger for each phase of a test (setup, call, teardown) and detaches them
    after: they come and go around a test without the test's doing."""
    return type(h).__module__.startswith("_pytest.")


def _inert_trace_handler(h: logging.Handler) -> bool:
    """torch's own structured-trace handler without TORCH_TRACE: no directory, nothing opened. It
    removes itself from the trace log at the first event (the first compile in a process), so its
    going is no test's doing, and while attached it writes nothing."""
    return isinstance(h, torch_logs.LazyTraceHandler) and h.root_dir is None and h.stream is None


def _not_compared(h: logging.Handler) -> bool:
    return pytest_handler(h) or _inert_trace_handler(h)


def snapshot() -> Snapshot:
    s: Snapshot = {}
    s["os.environ"] = {k: v for k, v in os.environ.items() if k not in ENV_NOT_COMPARED}
    s["process"] = {"cwd": os.getcwd()}
    for area, module in TORCH_CONFIGS.items():
        s[area] = module.get_config_copy()

    # Every logger's level, switches and handlers (torch's registered logs, commfuse's, the root),
    # as they are: the handlers diff() does not compare are taken out only where a logger differs.
    loggers = {
        name: (lg.level, lg.disabled, lg.propagate, tuple(lg.handlers))
        for name, lg in list(logging.root.manager.loggerDict.items())
        if isinstance(lg, logging.Logger)
    }
    loggers["<root>"] = (
        logging.root.level,
        logging.root.disabled,
        logging.root.propagate,
        tuple(logging.root.handlers),
    )
    s["logging"] = loggers
    s["torch._logging"] = {
        "logging.disable": logging.root.manager.disable,
        "log_state.log_qname_to_level": dict(torch_logs.log_state.log_qname_to_level),
        "log_state.artifact_names": frozenset(torch_logs.log_state.artifact_names),
        # What commfuse's structured_trace_enabled() reads: the trace log's handlers (also under
        # "logging", as a logger's) and the directory of torch's own, which a test could set in place.
        "trace handlers": tuple(
            (type(h).__name__, getattr(h, "root_dir", None))
            for h in torch_logs.trace_log.handlers
            if not _not_compared(h)
        ),
    }
    s["commfuse"] = {
        "config._process_default": cf_config._process_default,
        "session._SESSION": cf_session._SESSION,
        "registry._USER": dict(registry._USER),
        "recorder._ACTIVE": recorder._ACTIVE,
        "kernel_collectives._listener": kernel_collectives._listener,
    }
    s["torch"] = {
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "distributed default group initialised": dist.is_available() and dist.is_initialized(),
    }
    return s


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == raises or is not a bool (a tensor): compared by identity
        return False


def _logger_view(state: Any) -> Any:
    """A logger's (level, disabled, propagate, handlers) as compared: without the handlers that
    come and go by themselves."""
    if state is _MISSING:
        return state
    level, disabled, propagate, handlers = state
    return (level, disabled, propagate, tuple(h for h in handlers if not _not_compared(h)))


Change = tuple[tuple[str, str], Any, Any]


def diff(before: Snapshot, after: Snapshot) -> list[Change]:
    """``((area, key), before, after)`` for every value that changed, appeared or vanished
    (:data:`_MISSING` on the side it is absent from). A logger that appeared is not a change: it
    appears when a module that uses it is first imported, and that module set it up, not a test."""
    out: list[Change] = []
    for area in sorted(before.keys() | after.keys()):
        old, new = before.get(area, {}), after.get(area, {})
        if _same(old, new):  # the common case, one comparison of two dicts
            continue
        for key in sorted(old.keys() | new.keys()):
            a, b = old.get(key, _MISSING), new.get(key, _MISSING)
            if area == "logging":
                if a is _MISSING:
                    continue
                a, b = _logger_view(a), _logger_view(b)
            if not _same(a, b):
                out.append(((area, key), a, b))
    return out


def _short(v: Any, limit: int = 160) -> str:
    text = "(unset)" if v is _MISSING else repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def describe(changes: list[Change]) -> str:
    return "\n".join(f"  {area}: {key}: {_short(a)} -> {_short(b)}" for (area, key), a, b in changes)


def _restore_logger(name: str, state: tuple) -> None:
    lg = logging.root if name == "<root>" else logging.getLogger(name)
    level, disabled, propagate, handlers = state
    lg.setLevel(level)
    lg.disabled, lg.propagate = disabled, propagate
    lg.handlers[:] = [h for h in lg.handlers if _not_compared(h)] + list(handlers)


def restore(changes: list[Change]) -> None:
    """Put back the ``before`` side of every change :func:`diff` found."""
    for (area, key), a, _ in changes:
        if area == "os.environ":
            if a is _MISSING:
                os.environ.pop(key, None)
            else:
                os.environ[key] = a
        elif area == "process":
            os.chdir(a)
        elif area in TORCH_CONFIGS:
            if a is not _MISSING:
                setattr(TORCH_CONFIGS[area], key, a)
        elif area == "logging":
            if a is not _MISSING:
                _restore_logger(key, a)
        elif area == "torch._logging":
            if key == "logging.disable":
                logging.disable(a)
            elif key == "log_state.log_qname_to_level":
                torch_logs.log_state.log_qname_to_level.clear()
                torch_logs.log_state.log_qname_to_level.update(a)
            elif key == "log_state.artifact_names":
                torch_logs.log_state.artifact_names.clear()
                torch_logs.log_state.artifact_names.update(a)
            # the trace handlers are the trace log's handlers, put back with the "logging" area
        elif area == "commfuse":
            module, attr = {
                "config._process_default": (cf_config, "_process_default"),
                "session._SESSION": (cf_session, "_SESSION"),
                "recorder._ACTIVE": (recorder, "_ACTIVE"),
                "kernel_collectives._listener": (kernel_collectives, "_listener"),
            }.get(key, (None, None))
            if module is not None:
                setattr(module, attr, a)
            elif key == "registry._USER":
                registry._USER.clear()
                registry._USER.update(a)
        elif area == "torch":
            if key == "default dtype":
                torch.set_default_dtype(a)
            elif key == "grad enabled":
                torch.set_grad_enabled(a)
            elif key == "deterministic algorithms":
                torch.use_deterministic_algorithms(a)
            elif key == "distributed default group initialised" and not a and dist.is_initialized():
                dist.destroy_process_group()
