"""Reports over a compiled program: communication volume before/after commfuse,
the runtime's measured collectives against the plan, and one static HTML page.

* :mod:`.volume` -- :class:`VolumeReport` from a graph, a compiled model's reports or a dump dir;
* :mod:`.validate` -- recorder records vs lowering plans per rank (count, bytes exact, time vs the cost model);
* :mod:`.timeline` -- predicted timelines (the simulator's Chrome trace) next to each graph's dump;
* :mod:`.html` -- ``commfuse report DUMP_DIR``: graphs, volume, pass decisions, timelines.
"""

from commfuse.reports.timeline import predict_timelines, simulate_trace, write_predicted_trace
from commfuse.reports.validate import ValidationReport, validate, validate_dirs, validate_run
from commfuse.reports.volume import (
    CollectiveVolume,
    FormulaCheck,
    GraphVolume,
    PassReasons,
    Totals,
    VolumeReport,
    volume_from_dump_dir,
    volume_from_graph,
    volume_from_reports,
    volume_report,
)

__all__ = [
    "ValidationReport",
    "predict_timelines",
    "simulate_trace",
    "validate",
    "validate_dirs",
    "validate_run",
    "write_predicted_trace",
    "CollectiveVolume",
    "FormulaCheck",
    "GraphVolume",
    "PassReasons",
    "Totals",
    "VolumeReport",
    "volume_from_dump_dir",
    "volume_from_graph",
    "volume_from_reports",
    "volume_report",
]
