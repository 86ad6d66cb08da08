"""What a pass author needs, in one place: the pass interface and pipeline (:mod:`commfuse.passmgr`),
the verifier, and the pass table (:mod:`commfuse.transforms.registry`). The passes themselves live
in :mod:`commfuse.transforms`."""

from commfuse.passmgr.base import GraphPass, PassResult, Stage
from commfuse.passmgr.context import PassContext
from commfuse.passmgr.pipeline import Pipeline
from commfuse.passmgr.verifier import VerifierReport, verify_graph
from commfuse.transforms.registry import (
    DEFAULT_PIPELINE,
    available_passes,
    get_pass,
    register_pass,
    unregister_pass,
)

__all__ = [
    "DEFAULT_PIPELINE",
    "GraphPass",
    "PassContext",
    "PassResult",
    "Pipeline",
    "Stage",
    "VerifierReport",
    "available_passes",
    "get_pass",
    "register_pass",
    "unregister_pass",
    "verify_graph",
]
