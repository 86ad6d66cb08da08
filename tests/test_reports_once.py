"""One report per compiled graph, one warning per unwritable dump directory.

Under Inductor, an inference graph (compiled without gradients: Hugging Face Mixtral's
all_reduce expert parallelism picks that path at inference) gets its JOINT passes in Inductor's
joint-graph hook and its SCHEDULE passes when Inductor compiles it: two pipeline runs on one
graph, which used to hand ``recent_reports()`` two reports of it. The second run now continues
the first one's report. A dump directory that cannot be written fails every graph alike: it is
warned about once per process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.api import pipeline_for
from commfuse.core.meta import REPORTS_META
from commfuse.passmgr.base import Stage
from commfuse.passmgr.pipeline import ReportTo
from commfuse.passmgr.report import PipelineReport
from commfuse.testing.fake_pg import fake_process_group

JOINT_PASSES = ["accumulate_gradient_sync", "chimera"]
SCHEDULE_PASSES = ["schedule_overlap", "bucket_collectives", "sink_waits", "gloo_reduce_scatter"]


def _two_graphs(x):
    """Two Dynamo graphs (a graph break between them)."""
    y = torch.tanh(x) * 2
    torch._dynamo.graph_break()
    return (y.sum(0) + 1).relu()


def _compiled_reports(fn, *args, grad: bool = False, **cfg):
    """The reports ``recent_reports()`` gained while ``fn`` was compiled and run once."""
    torch._dynamo.reset()
    seen = len(commfuse.recent_reports())
    be = commfuse.backend(commfuse.Config(**cfg))
    with torch.set_grad_enabled(grad):
        out = torch.compile(fn, backend=be)(*args)
        if grad:
            out.sum().backward()
    new = commfuse.recent_reports()[seen:]
    assert [id(r) for r in new] == [id(r) for r in be.reports]
    return new


def _dumped_dirs(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "rank0").iterdir() if p.is_dir())


def _graph(fn, *shapes):
    with fake_process_group(2):
        return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def _scatter(x):
    return funcol.reduce_scatter_single(torch.tanh(x), "sum", 0, dist.group.WORLD) + 1


# ------------------------------------------------------------------ one report per graph
@pytest.mark.slow(reason="torch.compile of two frames, with and without gradients (eager inner compiler)")
def test_eager_compile_reports_every_graph_once(tmp_path):
    """inner_compiler="eager": per Dynamo graph one inference report without gradients, and
    joint, forward, backward with them."""
    reports = _compiled_reports(
        _two_graphs, torch.randn(4, 4), inner_compiler="eager", dump_dir=str(tmp_path)
    )
    assert [r.graph for r in reports] == ["inference", "inference"]
    assert all([p.name for p in r.passes] == JOINT_PASSES + SCHEDULE_PASSES for r in reports)
    x = torch.randn(4, 4, requires_grad=True)
    reports = _compiled_reports(_two_graphs, x, grad=True, inner_compiler="eager")
    # the backward graphs compile when backward first runs: the second graph's first
    assert sorted(r.graph for r in reports) == sorted(["joint", "forward", "backward"] * 2)


def test_a_graph_run_in_two_stages_has_one_report_and_one_dump_directory(tmp_path):
    """What the Inductor path does with an inference graph, on the pipeline: the JOINT stage with
    ``more_stages=True``, later the SCHEDULE stage on the same graph."""
    gm = _graph(_scatter, (8, 4))
    handed = []
    with fake_process_group(2):
        pipeline = pipeline_for(commfuse.Config(dump_dir=str(tmp_path)))
        pipeline.instruments.append(ReportTo(handed.append))
        first = pipeline.run(gm, graph_kind="inference", stages={Stage.JOINT}, more_stages=True)
        second = pipeline.run(gm, graph_kind="inference", stages={Stage.SCHEDULE})
        third = pipeline.run(
            gm, graph_kind="inference", stages={Stage.SCHEDULE}
        )  # nothing open: a new report
    assert first is second and third is not first
    assert [p.name for p in first.passes] == JOINT_PASSES + SCHEDULE_PASSES
    assert first.input_kinds == {"reduce_scatter": 1} and first.output_kinds == {"all_to_all": 1}
    assert gm.meta[REPORTS_META] == [first, third]
    assert [id(r) for r in handed] == [id(first), id(first), id(third)]  # after each stage, the same report
    assert _dumped_dirs(tmp_path) == ["inference_000", "inference_001"]
    names = sorted(p.name for p in (tmp_path / "rank0" / "inference_000").iterdir())
    assert "00_input.py.txt" in names and "01_after_gloo_reduce_scatter.py.txt" in names, names
    dumped = PipelineReport.model_validate_json(
        (tmp_path / "rank0" / "inference_000" / "pipeline.json").read_text()
    )
    assert [p.name for p in dumped.passes] == JOINT_PASSES + SCHEDULE_PASSES


@pytest.fixture
def no_compile_caches():
    """Inductor's FX-graph and AOTAutograd caches skip commfuse's hooks on a hit (by design);
    tests that count what the hooks did must compile for real."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg

    with icfg.patch(fx_graph_cache=False), fcfg.patch(enable_autograd_cache=False):
        yield


@pytest.mark.slow(reason="cold Inductor compiles of two graphs per lowering (caches off)")
@pytest.mark.parametrize("lowering", ["commfuse", "inductor"])
def test_inductor_reports_every_inference_graph_once(tmp_path, no_compile_caches, lowering):
    """The Mixtral duplicate without the model: two inference graphs under Inductor, one report
    each, holding both stages' passes, dumped in one directory each."""
    reports = _compiled_reports(
        _two_graphs, torch.randn(4, 4), inner_compiler="inductor", lowering=lowering, dump_dir=str(tmp_path)
    )
    assert [r.graph for r in reports] == ["inference", "inference"]
    assert all([p.name for p in r.passes] == JOINT_PASSES + SCHEDULE_PASSES for r in reports), [
        [p.name for p in r.passes] for r in reports
    ]
    assert _dumped_dirs(tmp_path) == ["inference_000", "inference_001"]
    assert sorted(r.dump_dir for r in reports) == [
        str(tmp_path / "rank0" / d) for d in _dumped_dirs(tmp_path)
    ]


# ------------------------------------------------------------------ one warning per dump dir
def _dump_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "cannot write graph dump" in str(w.message)]


def test_an_unwritable_dump_dir_warns_once_across_graphs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the dump directory would go")
    graphs = [_graph(_scatter, (8, 4)) for _ in range(3)]

    def optimize_all(dump_dir):
        for gm in graphs:
            with fake_process_group(2):
                commfuse.optimize(gm, commfuse.Config(passes=["sink_waits"], dump_dir=dump_dir))

    first = _dump_warnings(lambda: optimize_all(str(blocker / "dumps")))
    assert len(first) == 1 and str(blocker / "dumps") in first[0], first
    assert _dump_warnings(lambda: optimize_all(str(blocker / "dumps"))) == []  # the same dir: warned already
    assert (
        len(_dump_warnings(lambda: optimize_all(str(blocker / "other")))) == 1
    )  # another dir: its own warning


@pytest.mark.slow(reason="torch.compile of two frames with gradients (eager inner compiler)")
def test_an_unwritable_dump_dir_warns_once_for_all_graphs_of_a_compile(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the dump directory would go")
    x = torch.randn(4, 4, requires_grad=True)
    caught = _dump_warnings(
        lambda: _compiled_reports(
            _two_graphs, x, grad=True, inner_compiler="eager", dump_dir=str(blocker / "dumps")
        )
    )
    assert len(caught) == 1, caught  # six graphs: joint, forward and backward of two frames
