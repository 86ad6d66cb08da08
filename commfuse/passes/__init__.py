"""commfuse passes: the pass interface, registry, pipeline, verifier and the passes."""

from .base import GraphPass, PassResult, Stage
from .context import PassContext
from .pipeline import Pipeline
from .registry import DEFAULT_PIPELINE, available_passes, get_pass, register_pass, unregister_pass
from .verifier import VerifierReport, verify_graph

__all__ = [
    "DEFAULT_PIPELINE", "GraphPass", "PassContext", "PassResult", "Pipeline", "Stage", "VerifierReport",
    "available_passes", "get_pass", "register_pass", "unregister_pass", "verify_graph",
]
