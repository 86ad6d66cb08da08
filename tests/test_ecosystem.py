"""commfuse as torch.compile's other backends are used: ``options=`` / ``mode=`` / ``dynamic=``,
warnings said once for all ranks, and dumps laid out per rank with an index."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse import Config, ConfigError
from commfuse.__main__ import main as cli
from commfuse.backend import inductor_mode_patches
from commfuse.config import config_with_options
from commfuse.core import ranks
from commfuse.core import torch_private as priv
from commfuse.core.dump_layout import rank_dump_dir, read_dump_index, update_dump_index
from commfuse.reference.numerics import assert_bitwise_equal_tree
from commfuse.reports import volume_from_dump_dir
from commfuse.reports.html import render_html
from commfuse.testing.fake_pg import fake_process_group


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _step(model, x):
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach(), {k: p.grad.clone() for k, p in getattr(model, "_orig_mod", model).named_parameters()}


@pytest.fixture
def no_inductor(monkeypatch):
    """Fail the test if commfuse hands anything to Inductor (the eager inner compiler must not)."""

    def refuse(*args, **kwargs):
        raise AssertionError("Inductor was called")

    monkeypatch.setattr(priv, "inductor_compile_fx", refuse)
    monkeypatch.setattr(priv, "inductor_compile_fx_inner", refuse)


# ----------------------------------------------------------------------------- options=
def test_options_configure_a_compile_by_name(tmp_path, no_inductor):
    """``torch.compile(m, backend="commfuse", options={...})``: Config fields for that compile."""
    x = torch.randn(4, 16)
    ref = _step(_model(), x)
    torch._dynamo.reset()
    before = len(commfuse.recent_reports())
    compiled = torch.compile(
        _model(),
        backend="commfuse",
        options={"inner_compiler": "eager", "passes": ["sink_waits"], "dump_dir": str(tmp_path)},
    )
    assert_bitwise_equal_tree(_step(compiled, x), ref)  # eager inner compiler: bitwise eager, no Inductor
    reps = commfuse.recent_reports()[before:]
    assert [r.graph for r in reps] == ["joint", "forward", "backward"]
    assert [[p.name for p in r.passes] for r in reps[1:]] == [["sink_waits"], ["sink_waits"]]
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == [
        "backward_000",
        "forward_000",
        "joint_000",
    ]


def test_options_on_a_backend_object_override_its_config(no_inductor):
    be = commfuse.backend(passes=[], strict=True)
    torch._dynamo.reset()
    _step(torch.compile(_model(), backend=be, options={"inner-compiler": "eager"}), torch.randn(2, 16))
    assert [r.graph for r in be.reports] == ["joint", "forward", "backward"]  # reported on the object given
    assert be.config.inner_compiler == "inductor"  # the object itself is unchanged


def test_an_unknown_option_is_named_with_the_valid_ones():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option 'inner_compilr'") as e:
        torch.compile(_model(), backend="commfuse", options={"inner_compilr": "eager"})(torch.randn(2, 16))
    assert "inner_compiler" in str(e.value) and "dump_dir" in str(e.value)
    with pytest.raises(ConfigError, match="unknown option 'max_autotune'.*mode="):
        config_with_options(Config(), {"max_autotune": True})


def test_a_bad_option_value_fails_config_validation_naming_the_field():
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)options=\.\.\.\).*inner_compiler") as e:
        torch.compile(_model(), backend="commfuse", options={"inner_compiler": "jit"})(torch.randn(2, 16))
    assert "'inductor' or 'eager'" in str(e.value)
    with pytest.raises(ConfigError, match="schedule_memory_budget"):
        config_with_options(Config(), {"schedule_memory_budget": 0.5})
    with pytest.raises(ConfigError, match="dhelix=True needs"):  # cross-field checks too
        config_with_options(Config(), {"dhelix": True})
    assert config_with_options(Config(strict=True), None) == Config(strict=True)


# ----------------------------------------------------------------------------- mode=
def test_mode_presets_commfuse_accepts_and_refuses():
    assert inductor_mode_patches(None, Config()) == {} == inductor_mode_patches("default", Config())
    tuned = inductor_mode_patches("max-autotune-no-cudagraphs", Config())
    assert tuned == priv.inductor_mode_options("max-autotune-no-cudagraphs") and tuned["max_autotune"] is True
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ConfigError, match=f"mode='{mode}'.*CUDA graph"):
            inductor_mode_patches(mode, Config())
    with pytest.raises(ConfigError, match="mode='lite'.*use_joint_graph_passes"):
        inductor_mode_patches("lite", Config())
    with pytest.raises(ConfigError, match="unknown mode; torch.compile's modes are default, lite"):
        inductor_mode_patches("fast", Config())
    with pytest.raises(ConfigError, match="inner_compiler='eager' Inductor compiles nothing"):
        inductor_mode_patches("max-autotune-no-cudagraphs", Config(inner_compiler="eager"))


def test_mode_reaches_inductors_config_next_to_commfuses_hooks(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.update(config_patches)
        return gm.forward

    monkeypatch.setattr(priv, "inductor_compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    torch.compile(_model(), backend="commfuse", mode="max-autotune-no-cudagraphs")(torch.randn(2, 16))
    assert seen["max_autotune"] is True and seen["coordinate_descent_tuning"] is True
    assert "joint_custom_pre_pass" in seen  # commfuse's own patches are still there
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mode='reduce-overhead'.*CUDA graph"):
        torch.compile(_model(), backend="commfuse", mode="reduce-overhead")(torch.randn(2, 16))


# ----------------------------------------------------------------------------- dynamic=
def test_dynamic_shapes_compile_once_and_static_only_rewrites_refuse():
    """``dynamic=True`` is Dynamo's: commfuse gets graphs with symbolic sizes, compiles them once
    for every size, and the passes that price by size refuse them by name."""
    w = torch.randn(16, 16)

    def f(x):
        h = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
        return funcol.all_gather_tensor(h.relu(), 0, dist.group.WORLD).sum()

    be = commfuse.backend(inner_compiler="eager")
    torch._dynamo.reset()
    with fake_process_group(2):
        c = torch.compile(f, backend=be, dynamic=True)
        for n in (3, 5, 9):
            c(torch.randn(n, 16))
    (rep,) = be.reports  # one (inference) graph for every size
    refusals = [r for p in rep.passes for r in p.refusals]
    assert any("not static" in r or "symbolic shapes" in r for r in refusals), refusals


# ----------------------------------------------------------------------------- rank-0 warnings
def test_warn_rank0_warns_on_rank0_and_without_a_process_group_only(monkeypatch, caplog):
    for rank in (None, 0):
        monkeypatch.setattr(ranks, "process_rank", lambda r=rank: r)
        with pytest.warns(RuntimeWarning, match="same everywhere") as rec:
            ranks.warn_rank0("commfuse: same everywhere")
        assert rec[0].filename == __file__  # points at the caller, as warnings.warn would
    monkeypatch.setattr(ranks, "process_rank", lambda: 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.DEBUG, logger="commfuse"):
            ranks.warn_rank0("commfuse: same everywhere")
    assert "(warned on rank 0) commfuse: same everywhere" in caplog.text


@pytest.mark.slow(reason="real gloo ranks")
@pytest.mark.multirank
def test_rank_invariant_warnings_once_rank_local_ones_everywhere_and_dumps_per_rank(rank_pool_2, tmp_path):
    """2 gloo ranks, one dump dir: the pass failure (the same on both) is warned by rank 0 only;
    the dump dir only rank 1 cannot write is warned by rank 1; dumps land in rank<r>/ with an
    index listing both."""
    from _jobs_ecosystem import warnings_and_dumps

    r0, r1 = rank_pool_2.run(warnings_and_dumps, str(tmp_path), timeout=120)
    failed = "pass 'test_always_fails' failed on the graph graph and was skipped"
    assert any(failed in w for w in r0["warnings"]), r0
    assert not any(failed in w for w in r1["warnings"]), r1
    assert any("cannot write graph dump" in w for w in r1["warnings"]), r1
    assert not any("cannot write graph dump" in w for w in r0["warnings"]), r0
    assert r0["graphs"] == r1["graphs"] == ["graph_000"]
    index = read_dump_index(tmp_path / "dumps")
    assert index["world_size"] == 2
    assert [(e["rank"], e["dir"], e["graphs"]) for e in index["ranks"]] == [
        (0, "rank0", ["graph_000"]),
        (1, "rank1", ["graph_000"]),
    ]


# ----------------------------------------------------------------------------- dumps per rank
def test_rank_dump_dir_layout(tmp_path):
    assert rank_dump_dir(tmp_path, None) == (tmp_path, tmp_path / "rank0")
    assert rank_dump_dir(tmp_path, 3) == (tmp_path, tmp_path / "rank3")
    # the older recipe, dump_dir=f"dumps/rank{rank}", is that rank's directory as it is
    assert rank_dump_dir(tmp_path / "rank3", 3) == (tmp_path, tmp_path / "rank3")
    assert rank_dump_dir(tmp_path / "rank3", 0) == (tmp_path / "rank3", tmp_path / "rank3" / "rank0")
    assert read_dump_index(tmp_path) is None
    (tmp_path / "rank1" / "forward_000").mkdir(parents=True)
    (tmp_path / "rank1" / "notes.txt").write_text("x")
    (tmp_path / "other").mkdir()
    update_dump_index(tmp_path, world_size=4)  # no rank: every rank<r>/ read from disk
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["world_size"] == 4 and index["layout"] == "rank<r>/<kind>_<index>/"
    assert index["ranks"] == [{"rank": 1, "dir": "rank1", "graphs": ["forward_000"], "files": ["notes.txt"]}]
    # a rank rewrites its own entry and keeps the others'; a writer without the world size keeps it
    (tmp_path / "rank0" / "joint_000").mkdir(parents=True)
    (tmp_path / "rank1" / "backward_000").mkdir()
    update_dump_index(tmp_path, rank=0)
    index = read_dump_index(tmp_path)
    assert index["world_size"] == 4
    assert [(e["rank"], e["graphs"]) for e in index["ranks"]] == [(0, ["joint_000"]), (1, ["forward_000"])]


def _traced_forward() -> torch.fx.GraphModule:
    def f(x, w):
        a = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0"))
        y = torch.mm(w, w)  # sink_waits moves the wait below it
        return a + 1, y

    return make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))


def test_each_rank_dumps_into_its_own_directory_and_the_readers_follow(tmp_path, capsys):
    """One dump dir for two (fake) ranks: rank<r>/ each, index.json listing both, and the
    volume report, the HTML page and ``commfuse volume --rank`` reading either rank."""
    for rank in (1, 0):
        with fake_process_group(2, rank=rank):
            commfuse.optimize(
                _traced_forward(), Config(passes=["sink_waits"], dump_dir=str(tmp_path)), graph_kind="forward"
            )
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "index.json",
        "rank0",
        "rank1",
    ]
    index = read_dump_index(tmp_path)
    assert index["world_size"] == 2
    assert [(e["rank"], e["graphs"]) for e in index["ranks"]] == [(0, ["forward_000"]), (1, ["forward_000"])]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}" / "forward_000" / "01_after_sink_waits.py.txt").exists()
        assert [g.name for g in volume_from_dump_dir(tmp_path, rank=rank).graphs] == ["forward_000"]
    assert "ranks dumped: 0, 1, this page shows rank 1" in render_html(tmp_path, rank=1)
    assert cli(["volume", str(tmp_path), "--rank", "1"]) == 0
    assert "total" in capsys.readouterr().out
    assert cli(["volume", str(tmp_path), "--rank", "2"]) == 2
    assert "no rank2 sub-directory (have [0, 1])" in capsys.readouterr().err
