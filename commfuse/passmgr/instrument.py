"""The pipeline's instrumentation interface (:class:`Instrumentation`), on its own so that
instruments defined beside the pipeline (``report_facts.ReportFacts``) subclass it too;
``commfuse.passmgr.pipeline`` re-exports it with its own instruments."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

if TYPE_CHECKING:
    from commfuse.passmgr.base import GraphPass
    from commfuse.passmgr.context import PassContext
    from commfuse.passmgr.report import PassRecord, PipelineReport


class Instrumentation:
    """Hooks the pipeline calls around its passes; each does nothing unless overridden.

    ``before_pipeline`` sees the input graph (before any pass), ``before_pass`` /
    ``after_pass`` every pass that runs (``after_pass`` also when it failed and the graph was
    restored: ``record.error`` says so), ``after_pipeline`` the final graph and report."""

    def before_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        pass

    def before_pass(self, p: GraphPass, record: PassRecord) -> None:
        pass

    def after_pass(self, p: GraphPass, record: PassRecord, gm: fx.GraphModule, ctx: PassContext) -> None:
        pass

    def after_pipeline(self, gm: fx.GraphModule, ctx: PassContext, report: PipelineReport) -> None:
        pass


__all__ = ["Instrumentation"]
