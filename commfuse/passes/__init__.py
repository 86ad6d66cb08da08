"""commfuse passes: the pass interface, registry, pipeline, verifier and the passes."""

from commfuse.passes.base import GraphPass, PassResult, Stage
from commfuse.passes.context import PassContext
from commfuse.passes.pipeline import Pipeline
from commfuse.passes.registry import DEFAULT_PIPELINE, available_passes, get_pass, register_pass, unregister_pass
from commfuse.passes.verifier import VerifierReport, verify_graph

__all__ = [
    "DEFAULT_PIPELINE", "GraphPass", "PassContext", "PassResult", "Pipeline", "Stage", "VerifierReport",
    "available_passes", "get_pass", "register_pass", "unregister_pass", "verify_graph",
]
