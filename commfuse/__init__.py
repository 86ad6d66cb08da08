"""commfuse: a torch.compile backend that removes and hides the communication of hybrid-parallel training.

import commfuse
model = torch.compile(model, backend="commfuse")           # default pipeline
model = torch.compile(model, backend="commfuse", options={"dump_dir": "dumps"})   # Config fields
model = torch.compile(model, backend=commfuse.backend(commfuse.Config(dump_dir="dumps")))
commfuse.optimize(gm)                                        # any FX graph
print(commfuse.analyze(gm).table())                          # what the compiler sees
with commfuse.record("traces/") as rec: step()               # what each rank really issued
"""

from __future__ import annotations

import logging

from commfuse import pipeline  # noqa: F401  (commfuse.pipeline: setup_pipeline, PipelineRunner)
from commfuse import ops
from commfuse._version import __version__
from commfuse.api import analyze, last_report, optimize
from commfuse.backend import CommfuseBackend, backend, commfuse_backend, recent_reports
from commfuse.config import CONFIG_ENV, DUMP_DIR_ENV, Config, default_config, set_default_config
from commfuse.core.errors import CommfuseError, ConfigError, PassError, VerificationError
from commfuse.core import torch_private as _torch_private
from commfuse.costmodel.topology import Topology
from commfuse.lowering.recorder import Recorder, record
from commfuse.passmgr.report import AnalysisReport, PipelineReport
from commfuse.session import setup
from commfuse.train_step import TrainStep, compile_train_step

# The package logger. Every module logs on its own child of it (``logging.getLogger(__name__)``),
# so one setting covers them all: TORCH_LOGS=commfuse (INFO: pass summaries), TORCH_LOGS=+commfuse
# (DEBUG: every refusal and decision), or torch._logging.set_logs(modules={"commfuse": level}).
log = logging.getLogger(__name__)
_torch_private.register_torch_logs(__name__)

ops.install()  # commfuse's own ops into the IR, the cost model and the reference interpreter


def _register_dynamo_backend() -> None:
    # When installed, the `torch_dynamo_backends` entry point makes "commfuse" known
    # without an import, and Dynamo registers it itself on first lookup (registering
    # here too would make that lookup fail with "duplicate name"). A source checkout
    # that was not pip-installed has no entry point: register on import instead.
    from importlib.metadata import entry_points

    if any(e.name == "commfuse" for e in entry_points(group="torch_dynamo_backends")):
        return
    reg = _torch_private.dynamo_backend_registry()
    if "commfuse" not in reg._COMPILER_FNS:
        reg.register_backend(name="commfuse", compiler_fn=commfuse_backend)


_register_dynamo_backend()

__all__ = [
    "AnalysisReport",
    "CONFIG_ENV",
    "CommfuseBackend",
    "CommfuseError",
    "Config",
    "ConfigError",
    "DUMP_DIR_ENV",
    "PassError",
    "PipelineReport",
    "Recorder",
    "Topology",
    "TrainStep",
    "VerificationError",
    "__version__",
    "analyze",
    "backend",
    "commfuse_backend",
    "compile_train_step",
    "default_config",
    "last_report",
    "ops",
    "optimize",
    "recent_reports",
    "record",
    "set_default_config",
    "setup",
]
