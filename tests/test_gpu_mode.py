"""The GPU mode's logic on CPU (benchmarks/gpu/): the carried-wheel bootstrap, the per-family aggregation
of predicted vs measured kernel times, the report, the "no CUDA" refusal and the torch-version shim.
What needs a GPU (NCCL, streams, CUDA events) runs only in ``run.py --gpu`` on the lent machine."""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks.gpu import kernels, mode, wheels
from benchmarks.gpu.kernels import NodeTiming


def _row(graph: str, family: str, predicted: float, measured, error=None) -> NodeTiming:
    return NodeTiming(graph, f"n{predicted}", "aten.x", family, "memory", 0, 0, predicted, measured, error)


ROWS = [
    _row("forward", "matmul", 10.0, 12.0),
    _row("forward", "matmul", 20.0, 30.0),
    _row("backward", "pointwise", 1.0, 4.0),
    _row("backward", "attention_bw", 5.0, None, "RuntimeError: x"),
]


def test_aggregate_sums_and_ratios_per_family_graph_and_overall():
    agg = kernels.aggregate(ROWS)
    mm = agg["families"]["matmul"]
    assert (mm["count"], mm["timed"], mm["predicted_us"], mm["measured_us"]) == (2, 2, 30.0, 42.0)
    assert mm["ratio"] == pytest.approx(1.4) and mm["median_op_ratio"] == pytest.approx((1.2 + 1.5) / 2)
    # an op that could not be timed counts, but adds to neither sum
    bw = agg["families"]["attention_bw"]
    assert (bw["count"], bw["timed"], bw["predicted_us"], bw["ratio"]) == (1, 0, 0, None)
    assert agg["graphs"]["backward"]["measured_us"] == 4.0
    assert agg["overall"]["predicted_us"] == 31.0 and agg["overall"]["ratio"] == pytest.approx(46 / 31)
    assert agg["errors"] == ["backward/n5.0 (aten.x): RuntimeError: x"]


def test_nodes_are_predicted_and_timed_alone_with_the_given_timer():
    from commfuse.costmodel.analytic import AnalyticCostModel
    from commfuse.costmodel.topology import Topology

    gm = make_fx(lambda a, b: (a @ b).relu().t().sum(0), tracing_mode="fake")(
        torch.randn(32, 16), torch.randn(16, 8)
    )
    calls = []

    def timer(fn, reps, repeats):
        calls.append(fn())
        return 7.0

    rows = kernels.time_graph_nodes(
        [("forward", gm)], AnalyticCostModel(Topology.preset("dgx-h100")), "cpu", timer=timer
    )
    assert [r.family for r in rows] == ["matmul", "pointwise", "reduction"]  # the view (t) is not timed
    assert all(r.measured_us == 7.0 and r.predicted_us > 0 and r.error is None for r in rows)
    assert calls[0].shape == (32, 8)  # the op ran on real inputs of the traced shapes
    assert kernels.time_graphs([("forward", gm)], "cpu", timer=timer) == {"forward": 7.0}


def test_materialize_keeps_shape_strides_and_dtype_of_a_fake_value():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 6).t()
        ints = torch.empty(3, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    real = kernels.materialize(fake, "cpu", gen)
    assert real.shape == (6, 4) and real.stride() == (1, 6) and real.dtype == torch.float32
    assert torch.isfinite(real).all() and real.abs().max() > 0
    assert torch.equal(kernels.materialize(ints, "cpu", gen), torch.zeros(3, dtype=torch.int64))
    assert kernels.materialize(3, "cpu", gen) == 3


def _calibration() -> dict:
    return {
        "layer": {**kernels.LAYER_8B, "seq": 4096, "batch": 1, "dtype": "bfloat16", "kv_heads": 32},
        "preset": "dgx-h100",
        "note": None,
        **kernels.aggregate(ROWS),
        "device_model": {"device": "H100-SXM", "peak_tflops_bf16": 989.0, "memory_bandwidth_GBps": 3350.0},
        "whole_graph_measured_us": {"forward": 40.0, "backward": "RuntimeError: y"},
        "top_ops": [
            {
                "graph": "forward",
                "node": "mm",
                "op": "aten.mm",
                "family": "matmul",
                "bound": "compute",
                "predicted_us": 20.0,
                "measured_us": 30.0,
            }
        ],
    }


ENV = {
    "date": "2026-11-27T13:00:00+00:00",
    "device": "NVIDIA H100 80GB HBM3",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "nccl": "2.27.7",
    "python": "3.12.3",
    "commfuse": "0.1.0",
}


def test_report_from_synthetic_parts(tmp_path):
    plans = [{"graph": "forward", "collectives": 6, "streams": 2, "events": 3, "side_stream_nodes": 4}]
    parts = {
        "runtime": {
            "ok": True,
            "wall_s": 3.0,
            "plans": plans,
            "max_abs_diff": 0.0,
            "recorded": {"collectives": 6, "completed_by_work_callback": 6},
            "streams": {"plan": plans[0], "stream_ops": {"record": 1, "wait": 1}, "max_abs_diff": 0.0},
        },
        "inductor_regions": {"ok": True, "wall_s": 40.0, "regions_compiled": 9, "fallbacks": []},
        "dhelix": mode.run_part(lambda: 1 / 0),
        "calibration": {"ok": True, "wall_s": 20.0, **_calibration()},
    }
    assert parts["dhelix"]["ok"] is False and parts["dhelix"]["error"].startswith("ZeroDivisionError")
    assert "1 / 0" in parts["dhelix"]["traceback"]
    doc = mode.assemble(ENV, parts, command="python benchmarks/run.py --gpu", wall_s=70.0)
    assert doc["ok"] is False  # one part failed
    assert mode.assemble(ENV, {"runtime": parts["runtime"]}, command="c")["ok"] is True
    md = mode.markdown(doc)
    assert "| runtime | yes | 3.0 |" in md and "record 1, wait 1" in md
    assert "| dhelix | NO |" in md and "ZeroDivisionError" in md
    assert "| matmul | 2 (2) | 30.0 | 42.0 | 1.40 | 1.35 |" in md
    assert "| overall | 4 (3) | 31.0 | 46.0 | 1.48 |" in md
    assert "1 node(s) could not be timed alone" in md and "forward 40.0, backward RuntimeError: y" in md
    paths = mode.write(doc, tmp_path / "results", tmp_path / "gpu.json")
    assert [p.name for p in paths] == ["gpu-2026-11-27.json", "gpu-2026-11-27.md", "gpu.json"]
    assert json.loads(paths[0].read_text())["parts"]["calibration"]["overall"]["measured_us"] == 46.0
    assert paths[1].read_text() == md


def test_run_gpu_mode_rejects_unknown_parts(tmp_path):
    with pytest.raises(ValueError, match="unknown GPU-mode parts"):
        mode.run_gpu_mode(tmp_path, device="cpu", parts=("nope",))


def test_gpu_flag_refuses_without_cuda(monkeypatch, capsys):
    from benchmarks import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run.main(["--gpu"])
    assert e.value.code == 2 and "--gpu: no CUDA device" in capsys.readouterr().err


def _wheel(directory, module: str, value: int):
    with zipfile.ZipFile(directory / f"{module}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}/__init__.py", f"VALUE = {value}\n")


def test_wheels_are_unpacked_into_a_directory_first_on_sys_path(tmp_path, monkeypatch):
    name = "commfuse_carried_probe"
    _wheel(tmp_path, name, 7)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert wheels.ensure_wheels(tmp_path, names=("json",)) is None  # nothing missing: nothing done
    info = wheels.ensure_wheels(tmp_path, names=(name, "json"), target=tmp_path / "unpacked")
    try:
        assert info == {
            "path": str(tmp_path / "unpacked"),
            "wheels": [f"{name}-1.0-py3-none-any.whl"],
            "missing": [name],
        }
        assert sys.path[0] == info["path"]
        assert __import__(name).VALUE == 7
    finally:
        sys.modules.pop(name, None)
    with pytest.raises(RuntimeError, match="holds no wheels"):
        wheels.ensure_wheels(tmp_path / "unpacked", names=("commfuse_not_there",))


def _lock_pins() -> dict[str, str]:
    """The lock's pins by normalised distribution name (PEP 503: case and ``-_.`` folded)."""
    lock = Path(__file__).resolve().parent.parent / ".ci" / "lock.txt"
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_carried_wheels_are_the_locked_versions():
    # One source of truth: scripts/gpu_wheels.sh downloads the carried wheels at the lock's versions.
    pins = _lock_pins()
    carried = {}
    for whl in wheels.WHEEL_DIR.glob("*.whl"):
        name, version, *tags = whl.stem.split("-")
        carried[re.sub(r"[-_.]+", "-", name).lower()] = (version, tags)
    assert set(carried) == {
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "typing-inspection",
        "typing-extensions",
    }
    assert {n: v for n, (v, _) in carried.items()} == {n: pins[n] for n in carried}, (
        "the carried wheels differ from .ci/lock.txt: run `bash scripts/gpu_wheels.sh`"
    )
    core_tags = "-".join(carried["pydantic-core"][1])
    assert "cp312" in core_tags and "manylinux" in core_tags and "x86_64" in core_tags
    assert sum(p.stat().st_size for p in wheels.WHEEL_DIR.glob("*.whl")) < 10 * 2**20


def test_funcol_autograd_prefers_the_current_name_and_falls_back(monkeypatch):
    import torch.distributed._functional_collectives as funcol

    from commfuse.core.torch_private import funcol_autograd

    assert funcol_autograd("all_gather") is getattr(
        funcol, "all_gather_single_autograd", getattr(funcol, "all_gather_tensor_autograd", None)
    )
    monkeypatch.delattr(funcol, "reduce_scatter_single_autograd", raising=False)
    assert funcol_autograd("reduce_scatter") is funcol.reduce_scatter_tensor_autograd
    with pytest.raises(AttributeError, match="neither"):
        funcol_autograd("broadcast")


def test_extract_fwd_bwd_modules_passes_only_what_this_torch_takes(monkeypatch):
    import torch._functorch.partitioners as partitioners

    from commfuse.core import torch_private as priv

    seen = []

    def old_signature(joint, saved_values, saved_sym_nodes, *, num_fwd_outputs):
        seen.append((saved_values, saved_sym_nodes, num_fwd_outputs))
        return "fw", "bw"

    monkeypatch.setattr(partitioners, "_extract_fwd_bwd_modules", old_signature)
    assert priv.extract_fwd_bwd_modules("joint", ["a"], [], num_fwd_outputs=2) == ("fw", "bw")
    assert seen == [(["a"], [], 2)]
    with pytest.raises(NotImplementedError, match="opaque"):
        priv.extract_fwd_bwd_modules("joint", ["a"], ["mesh"], num_fwd_outputs=2)


def _sized(family: str, flops: int, nbytes: int, measured: float) -> NodeTiming:
    return NodeTiming("forward", f"n{flops}", "aten.x", family, "compute", flops, nbytes, 1.0, measured)


def test_fit_compute_params_fits_a_line_per_family_and_scales_a_single_size():
    rows = [
        _sized("matmul", 1000, 0, 12.0),
        _sized("matmul", 3000, 0, 32.0),  # 2 us + 0.01 us/FLOP
        _sized("pointwise", 0, 400, 8.0),
        _sized("attention", 500, 0, None),
    ]
    fits = kernels.fit_compute_params(rows).fits
    assert fits["matmul"].unit == "flops"
    assert fits["matmul"].a_us == pytest.approx(2.0) and fits["matmul"].b_us_per_unit == pytest.approx(0.01)
    # One size measured: proportional to the bytes, no fixed cost; an op never timed gets no fit.
    assert (fits["pointwise"].unit, fits["pointwise"].a_us) == ("bytes", 0.0)
    assert fits["pointwise"].b_us_per_unit == pytest.approx(0.02)
    assert "attention" not in fits


def test_calibration_writes_a_loadable_profile_and_the_holdout_table(tmp_path):
    from commfuse.costmodel.compute import ComputeParams
    from commfuse.costmodel.profile import CostProfile

    fitted = kernels.fit_compute_params([_sized("matmul", 1000, 0, 12.0), _sized("matmul", 3000, 0, 32.0)])
    holdout = {
        "seq": 2048,
        "nominal": kernels.aggregate(ROWS),
        "fitted": kernels.aggregate(
            [NodeTiming(**{**r.__dict__, "predicted_us": r.measured_us or 1.0}) for r in ROWS]
        ),
    }
    cal = {
        "ok": True,
        "wall_s": 9.0,
        **_calibration(),
        "fitted_compute": fitted.model_dump(mode="json"),
        "holdout": holdout,
    }
    doc = mode.assemble(ENV, {"calibration": cal}, command="python benchmarks/run.py --gpu")
    md = mode.markdown(doc)
    assert "checked on the same layer at 2048 tokens" in md
    assert "| matmul | 42.0 | 30.0 | 1.40 | 42.0 | 1.00 |" in md
    paths = mode.write(doc, tmp_path)
    assert paths[-1].name == "gpu-profile-2026-11-27.json"
    profile = CostProfile.load(paths[-1])
    assert (profile.topology, profile.backend) == ("dgx-h100", "nccl")
    assert profile.compute == ComputeParams.model_validate(cal["fitted_compute"])
    assert "collective model nominal" in profile.provenance.notes
    # No profile from a run whose calibration failed.
    failed = mode.assemble(ENV, {"calibration": mode.run_part(lambda: 1 / 0)}, command="c")
    assert mode.cost_profile(failed) is None
