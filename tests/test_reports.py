"""Volume report, validator and HTML page in one process (fake process groups).

The volume report must reproduce the byte numbers derived in docs/chimera.md and
docs/chimera-moe.md for the example models; formula checks, pass reasons, CLI exit codes,
escaping and the validator's matching rules are tested on real dumps of compiled graphs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import commfuse
from commfuse.__main__ import main as cli
from commfuse.passmgr.report import AnalysisReport
from commfuse.reports import (
    predict_timelines,
    validate,
    volume_from_dump_dir,
    volume_from_graph,
    volume_from_reports,
)
from commfuse.reports.html import render_html
from commfuse.reports.validate import RecordedCollective, load_plans
from commfuse.reports.volume import collectives_of, resolve_rank_dir
from commfuse.testing.fake_pg import fake_mesh, fake_process_group
from commfuse.testing.graphs import capture_aot_graphs

B, S, H, V, N = 2, 8, 32, 64, 4
HOSTILE = "<script>alert('x')</script>"


def _tp_config(mesh, **kw) -> commfuse.Config:
    return commfuse.Config(group_roles={mesh.get_group().group_name: "tp"}, **kw)


# ----------------------------------------------------------------------------- volume: the docs' numbers
def test_volume_reproduces_the_tp_llama_derivation():
    """docs/chimera.md: plain-TP Llama (L=2) on 4 ranks, fp32: forward 18 432 -> 18 432,
    backward 33 792 -> 25 536, joint 52 224 -> 43 968 wire bytes per rank."""
    from commfuse.models.llama import LlamaConfig, build_llama, parallelize_llama

    with fake_mesh(N) as mesh:
        model = parallelize_llama(
            build_llama(LlamaConfig(n_layers=2, dim=H, n_heads=4, ffn_dim=64, vocab=V)),
            mesh,
            sequence_parallel=False,
        )
        joint = capture_aot_graphs(model, torch.randint(0, V, (B, S))).joint
        code = joint.code
        rep = volume_from_graph(joint, _tp_config(mesh, passes=["chimera"]), graph_kind="joint")
    assert joint.code == code  # the graph given is not modified
    before, after = rep.totals("before", "direction"), rep.totals("after", "direction")
    assert (before["forward"].wire_bytes, before["backward"].wire_bytes) == (18432, 33792)
    assert (after["forward"].wire_bytes, after["backward"].wire_bytes) == (18432, 25536)
    assert (rep.total("before").wire_bytes, rep.total("after").wire_bytes) == (52224, 43968)
    kinds = rep.totals("before", "kind")
    assert (kinds["all_reduce"].count, kinds["all_gather"].count) == (
        16,
        1,
    )  # (1+2L) + (5L+1); the logits gather
    after_kinds = rep.totals("after", "kind")
    assert (
        after_kinds["reduce_scatter"].count == 16 and after_kinds["all_reduce"].count == 5
    )  # norm weight grads
    # every collective has a Table 1 formula here, and the IR agrees with each
    assert all(c.formula is not None for c in rep.collectives())
    assert rep.formula_mismatches() == []
    ar = next(c for c in rep.collectives() if c.kind == "all_reduce" and c.side == "before")
    assert (
        ar.formula.name == "Chimera Table 1, TP all_reduce"
        and ar.formula.wire_bytes == 2 * 3 * B * S * H * 4 // 4
    )
    assert [p.name for p in rep.reasons()] == ["chimera"] and rep.reasons()[0].changed
    assert "total" in rep.table() and "Chimera Table 1" in rep.table(collectives=True)


def _moe_joint(layout: str, mesh):
    from commfuse.models.moe_tp import MoETPConfig, build_moe_tp, parallelize_moe_tp

    cfg = MoETPConfig(
        n_layers=1,
        dim=H,
        n_heads=4,
        num_experts=8,
        ffn_dim=32,
        top_k=2,
        capacity_factor=0.0,
        token_groups=1,
        vocab=V if layout == "tp_ep" else None,
    )
    model = parallelize_moe_tp(build_moe_tp(cfg), mesh, layout)
    x = torch.randint(0, V, (B, S)) if layout == "tp_ep" else torch.randn(B, S // N, H)
    return capture_aot_graphs(model, x, loss=lambda o: o[0].float().mean() + o[1]).joint


@pytest.mark.parametrize(
    "layout,want",
    [
        # docs/chimera-moe.md, wire bytes per rank: (forward before, after), (backward before, after)
        ("sp_ep_sp", ((10800, 4758), (14064, 7008))),
        ("tp_ep", ((15408, 10902), (21744, 13728))),
    ],
)
def test_volume_reproduces_the_moe_derivations(layout, want):
    with fake_mesh(N) as mesh:
        rep = volume_from_graph(
            _moe_joint(layout, mesh), _tp_config(mesh, passes=["chimera"]), graph_kind="joint"
        )
    before, after = rep.totals("before", "direction"), rep.totals("after", "direction")
    assert (before["forward"].wire_bytes, after["forward"].wire_bytes) == want[0]
    assert (before["backward"].wire_bytes, after["backward"].wire_bytes) == want[1]
    # the MoE layer's own all_to_alls are in the totals, marked as issued inside the op
    moe = [c for c in rep.collectives() if c.embedded]
    assert moe and all(c.kind == "all_to_all" and "moe_layer" in c.embedded for c in moe)
    assert rep.totals("after", "role")["ep"].count == len([c for c in moe if c.side == "after"])
    assert rep.formula_mismatches() == []


def test_formula_check_reports_a_count_that_disagrees():
    """A wrong IR byte count (here planted in the analysis) shows as a formula difference."""

    def f(x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_gather_tensor(x * 2, 0, dist.group.WORLD)

    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 8, 16))
        rep = commfuse.analyze(gm)
    ok = collectives_of(rep, graph="g", side="before", direction="graph")
    assert ok[0].formula.wire_bytes == ok[0].wire_bytes == 3 * 2 * 8 * 16 * 4
    bad = AnalysisReport.model_validate(
        {
            **rep.model_dump(),
            "collectives": [
                {**rep.collectives[0].model_dump(), "wire_bytes": rep.collectives[0].wire_bytes + 4}
            ],
        }
    )
    row = collectives_of(bad, graph="g", side="before", direction="graph")[0]
    assert row.formula.wire_diff == 4 and row.formula.logged_diff == 0


def test_reasons_say_why_nothing_was_fused():
    """Data-parallel gradient all_reduces feed outputs directly: chimera restores the graph and says why."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    def g(x, w):
        return funcol.all_reduce(x.t() @ x @ w, "avg", dist.group.WORLD)

    with fake_process_group(4):
        gm = make_fx(g, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
        rep = volume_from_graph(gm, commfuse.Config(passes=["chimera"]), graph_kind="graph")
    (p,) = rep.reasons()
    assert not p.changed and any("graph restored" in r for r in p.refusals)
    assert rep.total("before").wire_bytes == rep.total("after").wire_bytes == 2 * 3 * 64 * 4 // 4
    assert "graph restored" in rep.table()


# ----------------------------------------------------------------------------- a compiled model's dumps
def compile_dumped(out: Path, *, predict: bool = True) -> commfuse.backend:
    """The TP+SP Llama block compiled with commfuse on 4 fake ranks, dumped into `out` (plans,
    pictures, predicted timelines): what a user's run leaves behind, in one process."""
    from commfuse.models import llama

    with fake_mesh(N) as mesh:
        cfg = llama.LlamaConfig(n_layers=1, dim=H, n_heads=4, ffn_dim=64)
        model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        x = llama.make_inputs(cfg, B, S, rank=0, world_size=N).inputs
        be = commfuse.backend(_tp_config(mesh, inner_compiler="eager", dump_dir=str(out), svg_max_nodes=60))
        torch._dynamo.reset()
        with predict_timelines() if predict else _null():
            y = torch.compile(model, backend=be)(x)
            (y.to_local() if hasattr(y, "to_local") else y).float().mean().backward()
    return be


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    out = tmp_path_factory.mktemp("dumps")
    be = compile_dumped(out)
    return out, be


def test_volume_from_dump_dir_and_from_reports_agree(dumped):
    out, be = dumped
    from_dir = volume_from_dump_dir(out)
    from_be = volume_from_reports(be.reports)
    assert [g.name for g in from_dir.graphs] == ["joint_000", "forward_000", "backward_000"]
    for side in ("before", "after"):
        assert from_dir.totals(side, "kind") == from_be.totals(side, "kind")
    # after = what runs: the forward and backward graphs, whose directions are their kinds
    assert set(from_dir.totals("after", "direction")) == {"forward", "backward"}
    assert (
        from_dir.total("before").wire_bytes == from_dir.total("after").wire_bytes
    )  # TP+SP: nothing to remove


def test_volume_from_reports_without_dumps_says_before_is_missing():
    from commfuse.models import llama

    with fake_mesh(N) as mesh:
        cfg = llama.LlamaConfig(n_layers=1, dim=H, n_heads=4, ffn_dim=64)
        model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
        be = commfuse.backend(_tp_config(mesh, inner_compiler="eager"))
        torch._dynamo.reset()
        y = torch.compile(model, backend=be)(llama.make_inputs(cfg, B, S, rank=0, world_size=N).inputs)
        (y.to_local() if hasattr(y, "to_local") else y).float().mean().backward()
    rep = volume_from_reports(be.reports)
    assert rep.program("before") is None and rep.total("after").count > 0
    assert any("dump_dir" in n for n in rep.notes)


def test_cli_volume_report_and_bad_arguments(dumped, tmp_path, capsys):
    out, _ = dumped
    assert cli(["volume", str(out)]) == 0
    assert "total" in capsys.readouterr().out
    page = tmp_path / "page.html"
    assert cli(["report", str(out), "-o", str(page)]) == 0
    assert page.exists() and page.read_text().startswith("<!DOCTYPE html>")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["report", str(empty)]) == 2
    assert "holds no graph dumps" in capsys.readouterr().err
    assert cli(["validate", str(empty), str(out)]) == 2
    assert "no rank<r>.json" in capsys.readouterr().err


def test_html_page_is_self_contained_and_escapes_names(dumped, tmp_path):
    out, _ = dumped
    d = tmp_path / "hostile"
    shutil.copytree(out, d)
    plant_hostile_names(d)
    page = render_html(d)
    assert HOSTILE not in page and "<script" not in page.lower()
    assert "&lt;script&gt;" in page
    for section in ("summary", "volume", "collectives", "passes", "graphs", "timelines"):
        assert f'<h2 id="{section}">' in page
    # forward and backward as run on the first screen, before and as run under Timelines
    assert page.count('class="timeline predicted"') == 2 + 2 * 2
    assert "data:image/svg+xml;base64," in page or "DOT source" in page
    # nothing is fetched: no external URLs in src/href attributes
    assert 'src="http' not in page and 'href="http' not in page and "<link" not in page


def plant_hostile_names(d: Path) -> None:
    """Markup in a refusal, a group name and a trace event name (names come from user code)."""
    d = resolve_rank_dir(d)  # rank 0's dumps
    pj = d / "joint_000" / "pipeline.json"
    rep = json.loads(pj.read_text())
    rep["passes"][0]["refusals"].append(f"not moved: {HOSTILE}")
    rep["notes"].append(HOSTILE)
    pj.write_text(json.dumps(rep))
    first = d / "forward_000" / "00_input.json"
    a = json.loads(first.read_text())
    a["collectives"][0]["group"] = HOSTILE
    first.write_text(json.dumps(a))
    tr = d / "forward_000" / "predicted_trace.json"
    t = json.loads(tr.read_text())
    t["traceEvents"].append(
        {"name": HOSTILE, "cat": "compute", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1.0}
    )
    tr.write_text(json.dumps(t))


# ----------------------------------------------------------------------------- validator rules
def _records_for(plans, *, order=None, runs=2, label_id=7):
    out = []
    for pg in plans:
        pcs = pg.plan["collectives"]
        idx = order or list(range(len(pcs)))
        for _ in range(runs):
            for i in idx:
                p = pcs[i]
                c = next(c for c in pg.analysis.collectives if c.node == p["start"])
                elt = torch.empty((), dtype=getattr(torch, c.dtype)).element_size()
                sent = sum(int(torch.Size(s).numel()) * elt for s in c.input_shapes)
                recv = sum(int(torch.Size(s).numel()) * elt for s in c.output_shapes)
                out.append(
                    RecordedCollective(
                        i,
                        p["start"],
                        f"{pg.kind}#{label_id}",
                        p["kind"],
                        p["group"],
                        p["issue_group"],
                        p["logged_bytes"],
                        sent,
                        recv,
                        100.0,
                    )
                )
    return out


def test_validator_rules_on_synthetic_records(dumped):
    """Exact records pass; reordered, repeated, unplanned and run-count differences are each named."""
    out, _ = dumped
    plans = load_plans(out, [0])[0]
    fwd = [p for p in plans if p.kind == "forward"]
    good = _records_for(fwd)
    assert validate({0: good, 1: good}, {0: plans, 1: plans}).ok
    k = len(fwd[0].plan["collectives"])
    assert k >= 2
    swapped = _records_for(fwd, order=[1, 0, *range(2, k)], runs=1)
    rep = validate({0: swapped}, {0: plans})
    assert [m.what for m in rep.mismatches] == ["order"]
    rep = validate({0: good, 1: good[:k]}, {0: plans, 1: plans})  # rank 1 ran the graph once
    assert [(m.rank, m.what) for m in rep.mismatches] == [(1, "runs")]
    alien = [RecordedCollective(0, "not_a_planned_node", "forward#1", "all_reduce", "0", "0", 4, 4, 4, 1.0)]
    rep = validate({0: alien}, {0: plans})
    assert [m.what for m in rep.mismatches] == ["unplanned"]
    with pytest.raises(ValueError, match="no lowering plans for rank"):
        validate({0: good, 3: good}, {0: plans})


def test_benchmark_volume_report_matches_the_stored_benchmark_run():
    """`benchmarks/run.py --volume-report` on plain-TP Llama at world size 2: 224.0 KiB wire bytes
    per rank, equal to the stored eager row. The default pipeline leaves them: TP->SP motion would
    move 200.0 KiB in more, smaller collectives, which the step-time gate predicts slower."""
    from benchmarks.volume_report import run_volume_report, volume_tables

    doc = run_volume_report(("llama_tp:s",))
    (row,) = doc["workloads"]
    assert (row["before_wire"], row["after_wire"]) == (229376, 229376)
    assert row["formula_differ"] == 0
    if row["stored_before_wire"] is not None:  # a stored world-size-2 run is in benchmarks/results
        assert row["stored_before_wire"] == 229376
    assert "llama_tp:s" in volume_tables(doc)
