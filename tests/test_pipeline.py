"""Pass pipeline: verifier, fallback, dumps, config validation and `optimize`."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import FileCheck

import commfuse
from commfuse.core.errors import ConfigError, PassError, VerificationError
from commfuse.passes import GraphPass, PassResult, Stage, register_pass, unregister_pass, verify_graph
from commfuse.passmgr.context import Analysis, PassContext
from commfuse.passmgr.pipeline import Instrumentation, PassPipeline, Pipeline, run_step
from commfuse.transforms.sink_waits import SinkWaits
from commfuse.testing.fake_pg import fake_process_group

from _graphs import trace_all_kinds

c10d = torch.ops._c10d_functional


@pytest.fixture
def all_kinds_gm():
    with fake_process_group(8):
        yield trace_all_kinds()


# -- verifier ---------------------------------------------------------------
def test_verifier_accepts_traced_graph(all_kinds_gm):
    report = verify_graph(all_kinds_gm)
    assert report.ok, report.problems
    assert set(report.sequence_hashes) == {"0"} and report.order_hash


def _first(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def test_verifier_catches_missing_wait(all_kinds_gm):
    gm = all_kinds_gm
    start = _first(gm, c10d.all_reduce.default)
    (wait,) = start.users
    wait.replace_all_uses_with(start)
    gm.graph.erase_node(wait)
    problems = verify_graph(gm).problems
    assert any("all_reduce result all_reduce is never waited" in p for p in problems), problems


def test_verifier_catches_use_before_wait(all_kinds_gm):
    gm = all_kinds_gm
    start = _first(gm, c10d.all_gather_into_tensor.default)
    (wait,) = start.users
    with gm.graph.inserting_after(start):
        early = gm.graph.call_function(torch.ops.aten.relu.default, (start,))
        early.meta["val"] = start.meta["val"]
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0]) + (early,),)
    problems = verify_graph(gm).problems
    assert any("used before its wait by relu" in p for p in problems), problems


def test_verifier_catches_double_wait_and_bad_shape(all_kinds_gm):
    gm = all_kinds_gm
    start = _first(gm, c10d.all_gather_into_tensor.default)
    with gm.graph.inserting_after(start):
        w2 = gm.graph.call_function(c10d.wait_tensor.default, (start,))
        w2.meta["val"] = start.meta["val"]
    start.meta["val"] = torch.empty(3, 3, device="meta")
    problems = verify_graph(gm).problems
    assert any("waited 2 times" in p for p in problems), problems
    assert any("expected [64, 16]" in p for p in problems), problems


def test_verifier_catches_missing_metadata(all_kinds_gm):
    gm = all_kinds_gm
    node = _first(gm, torch.ops.aten.cat.default)
    del node.meta["val"]
    assert any("no 'val' metadata" in p for p in verify_graph(gm).problems)


# -- fallback -----------------------------------------------------------------
class _Raises(GraphPass):
    """Test pass: mutates the graph, then raises."""

    name = "test_raises"
    stage = Stage.JOINT

    def run(self, ctx):
        for n in list(ctx.gm.graph.nodes):
            if n.op == "call_function" and n.target is c10d.wait_tensor.default:
                n.replace_all_uses_with(n.args[0])
                ctx.gm.graph.erase_node(n)
                break
        raise RuntimeError("boom: pattern not handled")


class _BreaksWaits(GraphPass):
    """Test pass: removes a wait and claims success; the verifier must reject it."""

    name = "test_breaks_waits"
    stage = Stage.JOINT

    def run(self, ctx):
        n = next(
            n for n in ctx.gm.graph.nodes if n.op == "call_function" and n.target is c10d.wait_tensor.default
        )
        n.replace_all_uses_with(n.args[0])
        ctx.gm.graph.erase_node(n)
        return PassResult(changed=True, counts={"removed": 1})


@pytest.fixture
def test_passes():
    register_pass(_Raises)
    register_pass(_BreaksWaits)
    yield
    unregister_pass("test_raises")
    unregister_pass("test_breaks_waits")


@pytest.mark.parametrize(
    "name, reason", [("test_raises", "boom: pattern not handled"), ("test_breaks_waits", "never waited")]
)
def test_failing_pass_falls_back_to_unchanged_graph(all_kinds_gm, test_passes, name, reason):
    gm = all_kinds_gm
    before = gm.code
    with pytest.warns(RuntimeWarning, match=f"pass '{name}' failed"):
        commfuse.optimize(gm, commfuse.Config(passes=[name]))
    assert gm.code == before
    record = commfuse.last_report(gm).passes[0]
    assert record.name == name and not record.changed and reason in record.error
    assert verify_graph(gm).ok


class _NoChange(GraphPass):
    """Test pass: looks, changes nothing."""

    name = "test_no_change"
    stage = Stage.JOINT

    def run(self, ctx):
        return PassResult(changed=False, refusals=["nothing to do"])


def test_a_failing_pass_after_unchanged_and_changed_passes_restores_the_graph_before_it(
    all_kinds_gm, test_passes, monkeypatch
):
    """One snapshot serves a run of passes that change nothing; after a pass that changed the
    graph, a failing pass restores the changed graph, not the input."""
    import commfuse.passmgr.pipeline as pipeline_mod

    register_pass(_NoChange)
    copies = []
    real = pipeline_mod.snapshot_graph
    monkeypatch.setattr(pipeline_mod, "snapshot_graph", lambda g: copies.append(1) or real(g))
    try:
        gm = all_kinds_gm
        before = gm.code
        with pytest.warns(RuntimeWarning, match="pass 'test_raises' failed"):
            commfuse.optimize(gm, commfuse.Config(passes=["test_no_change", "test_no_change", "test_raises"]))
        assert gm.code == before and verify_graph(gm).ok
        assert len(copies) == 1  # before the first pass; the unchanged passes reused it
        gm = trace_all_kinds()  # the fixture's fake world is still up
        with pytest.warns(RuntimeWarning, match="pass 'test_raises' failed"):
            commfuse.optimize(
                gm, commfuse.Config(passes=["test_no_change", "sink_waits", "test_raises"], verify=True)
            )
        sunk = commfuse.last_report(gm).passes[1]
        assert sunk.name == "sink_waits" and sunk.changed
        assert len(copies) == 1 + 2  # a fresh snapshot after sink_waits changed the graph
        ref = trace_all_kinds()
        commfuse.optimize(ref, commfuse.Config(passes=["sink_waits"]))
        assert gm.code == ref.code  # restored to the graph after sink_waits
    finally:
        unregister_pass("test_no_change")


def test_strict_reraises(test_passes):
    with fake_process_group(8):
        gm, gm2 = trace_all_kinds(), trace_all_kinds()
    with pytest.raises(PassError, match="pass 'test_raises' failed: RuntimeError: boom"):
        commfuse.optimize(gm2, commfuse.Config(passes=["test_raises"], strict=True))
    with pytest.raises(VerificationError, match="after pass 'test_breaks_waits'"):
        commfuse.optimize(gm, commfuse.Config(passes=["test_breaks_waits"], strict=True))


# -- pass manager: nested pipelines, preserved analyses, instrumentation --------------
class _Sink(GraphPass):
    """Test step: the sink_waits pass under another name (changes the graph)."""

    name = "test_sink"
    stage = Stage.JOINT

    def run(self, ctx):
        r = SinkWaits().run(ctx)
        return PassResult(r.changed, counts={"moved": int(r.changed)}, refusals=["looked"])


class _Nested(PassPipeline):
    """Test pipeline: a pass made of two steps."""

    name = "test_nested"
    stage = Stage.JOINT
    steps = (_NoChange, _Sink)


class _NestedBreaks(PassPipeline):
    name = "test_nested_breaks"
    stage = Stage.JOINT
    steps = (_NoChange, _BreaksWaits)


def test_a_pipeline_is_a_pass_and_reports_its_steps(all_kinds_gm):
    """A PassPipeline runs as one pass: its steps' counts and refusals come prefixed with the
    step, and the verifier runs between steps, naming the step that broke the graph."""
    gm = all_kinds_gm
    res = _Nested().run(PassContext(gm, commfuse.Config()))
    assert res.changed and res.counts == {"test_sink.moved": 1}
    assert res.refusals == ["test_no_change: nothing to do", "test_sink: looked"]
    assert verify_graph(gm).ok
    broken = trace_all_kinds()  # the fixture's fake world is still up
    with pytest.raises(VerificationError, match="after pass 'test_nested_breaks/test_breaks_waits'"):
        run_step(_NestedBreaks(), PassContext(broken, commfuse.Config()))


_COUNTED = []
_PRESERVED = Analysis("test_preserved", lambda ctx: _COUNTED.append("p") or len(ctx.gm.graph.nodes))
_DROPPED = Analysis("test_dropped", lambda ctx: _COUNTED.append("d") or len(ctx.gm.graph.nodes))


class _SinkPreserving(_Sink):
    name = "test_sink_preserving"
    preserves = frozenset({_PRESERVED})


def test_a_change_drops_the_analyses_its_pass_does_not_preserve(all_kinds_gm):
    ctx = PassContext(all_kinds_gm, commfuse.Config())
    _COUNTED.clear()
    ir = ctx.ir
    assert ctx.get(_PRESERVED) == ctx.get(_PRESERVED) and ctx.get(_DROPPED) is not None
    assert _COUNTED == ["p", "d"]  # computed once each
    assert run_step(_SinkPreserving(), ctx).changed
    ctx.get(_PRESERVED), ctx.get(_DROPPED)
    assert _COUNTED == ["p", "d", "d"]  # the declared one survived the change, the other was rebuilt
    assert ctx.ir is not ir  # the IR is not declared preserved: rebuilt for the changed graph
    cost = ctx.cost
    ctx.invalidate()
    assert ctx.cost is cost  # the cost policy is no analysis of the graph


class _Watch(Instrumentation):
    def __init__(self):
        self.seen = []

    def before_pipeline(self, gm, ctx, report):
        self.seen.append(("start", len(gm.graph.nodes)))

    def before_pass(self, p, record):
        self.seen.append(("before", p.name))

    def after_pass(self, p, record, gm, ctx):
        self.seen.append(("after", p.name, record.changed, record.error is not None, len(gm.graph.nodes)))

    def after_pipeline(self, gm, ctx, report):
        self.seen.append(("end", [r.name for r in report.passes]))


def test_instruments_see_every_pass_and_a_failure_after_the_restore(all_kinds_gm, test_passes):
    gm = all_kinds_gm
    n = len(gm.graph.nodes)
    watch = _Watch()
    pipe = Pipeline([SinkWaits(), _Raises()], commfuse.Config(), instruments=[watch])
    with pytest.warns(RuntimeWarning, match="pass 'test_raises' failed"):
        report = pipe.run(gm, graph_kind="joint", stages={Stage.JOINT, Stage.SCHEDULE})
    assert watch.seen == [
        ("start", n),
        ("before", "sink_waits"),
        ("after", "sink_waits", True, False, n),
        ("before", "test_raises"),
        ("after", "test_raises", False, True, n),
        ("end", ["sink_waits", "test_raises"]),
    ]
    assert all(r.seconds >= 0 for r in report.passes)


def test_invalid_input_graph_is_left_alone(all_kinds_gm):
    gm = all_kinds_gm
    start = _first(gm, c10d.broadcast.default)
    (wait,) = start.users
    wait.replace_all_uses_with(start)
    gm.graph.erase_node(wait)
    gm.recompile()
    before = gm.code
    with pytest.warns(RuntimeWarning, match="input graph failed verification"):
        commfuse.optimize(gm, commfuse.Config(passes=["sink_waits"]))
    report = commfuse.last_report(gm)
    assert gm.code == before and report.skipped_reason and report.passes == []


# -- sink_waits (the first scheduling pass) -----------------------------------------
def test_sink_waits_moves_wait_to_first_use_and_keeps_collective_order():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        a = torch.ops._c10d_functional.all_reduce(x, "sum", dist.group.WORLD.group_name)
        a = torch.ops._c10d_functional.wait_tensor(a)
        y = torch.mm(w, w)  # independent compute: can run while the all_reduce is in flight
        b = funcol.all_gather_tensor(y, 0, dist.group.WORLD)
        return a + 1, b, y.sum()

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
        before = commfuse.analyze(gm)
        commfuse.optimize(gm, commfuse.Config(passes=["sink_waits"]))
        after = commfuse.analyze(gm)
    # Both waits sink: the all_reduce's below the mm, the all_gather's down to the graph output.
    assert commfuse.last_report(gm).passes[0].counts["waits_sunk"] == 2
    FileCheck().check("all_reduce").check("mm").check("all_gather_into_tensor").check(
        "wait_tensor.default(all_reduce)"
    ).check("add").run(gm.code)
    assert before.sequence_hashes == after.sequence_hashes and before.order_hash == after.order_hash


def test_sink_waits_does_not_cross_mutation():
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, buf):
        a = torch.ops._c10d_functional.all_gather_into_tensor(x, 4, dist.group.WORLD.group_name)
        a = torch.ops._c10d_functional.wait_tensor(a)
        x.add_(1)  # the in-flight gather reads x: the wait must stay before this
        return a.sum() + x.sum()

    with fake_process_group(4):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 2), torch.randn(2))
        commfuse.optimize(gm, commfuse.Config(passes=["sink_waits"]))
    FileCheck().check("wait_tensor").check("add_").run(gm.code)


# -- dumps ----------------------------------------------------------------------
def test_dumps_written_and_named(all_kinds_gm, tmp_path, monkeypatch):
    gm = all_kinds_gm
    # Make sink_waits change something: move one wait up to right after its collective start.
    commfuse.optimize(gm, commfuse.Config(passes=["sink_waits"], dump_dir=str(tmp_path), verify=True))
    (d,) = list((tmp_path / "rank0").iterdir())  # no process group: rank 0
    assert d.name.startswith("graph_")
    names = sorted(p.name for p in d.iterdir())
    assert "00_input.py.txt" in names and "00_input.json" in names and "pipeline.json" in names
    assert "00_input.svg" in names or "00_input.dot" in names
    data = json.loads((d / "00_input.json").read_text())
    assert data["total"]["count"] == 10
    svg = (d / "00_input.svg").read_text() if (d / "00_input.svg").exists() else ""
    if svg:
        assert "all_gather" in svg and "group 0" in svg
    pipe = json.loads((d / "pipeline.json").read_text())
    assert pipe["passes"][0]["name"] == "sink_waits"


def test_dump_dir_from_environment(all_kinds_gm, tmp_path, monkeypatch):
    monkeypatch.setenv(commfuse.DUMP_DIR_ENV, str(tmp_path / "env"))
    commfuse.optimize(all_kinds_gm, commfuse.Config(passes=[]))
    assert [p.name for p in (tmp_path / "env" / "rank0").iterdir()] == ["graph_000"]
    assert (tmp_path / "env" / "index.json").exists()


def test_after_pass_dump_written_for_changing_pass(tmp_path):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        a = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0"))
        y = torch.mm(w, w)
        return a + 1, y

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
        commfuse.optimize(
            gm, commfuse.Config(passes=["sink_waits"], dump_dir=str(tmp_path)), graph_kind="forward"
        )
    (d,) = list((tmp_path / "rank0").iterdir())
    assert d.name == "forward_000"
    names = sorted(p.name for p in d.iterdir())
    assert "01_after_sink_waits.py.txt" in names, names
    FileCheck().check("mm").check("wait_tensor").run((d / "01_after_sink_waits.py.txt").read_text())


def test_unwritable_dump_dir_warns_and_does_not_change_result(tmp_path):
    with fake_process_group(8):
        a, b = trace_all_kinds(), trace_all_kinds()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    commfuse.optimize(a, commfuse.Config(passes=["sink_waits"]))
    with pytest.warns(RuntimeWarning, match="cannot write graph dump"):
        commfuse.optimize(b, commfuse.Config(passes=["sink_waits"], dump_dir=str(blocker / "sub")))
    assert a.code == b.code


def test_dump_escapes_markup_in_names(tmp_path):
    from commfuse.ir import CollectiveIR
    from commfuse.passmgr.render import graph_to_dot

    def f(x):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x, "sum", "<b>&grp")
        )

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2))
    dot = graph_to_dot(gm, CollectiveIR(gm), title="<script>")
    assert "<script>" not in dot and "&lt;script&gt;" in dot and "&lt;b&gt;&amp;grp" in dot


def test_condensed_picture_of_a_run_without_ops_renders():
    """A run of placeholders only (no call_function) once produced an empty <i></i> that
    Graphviz rejects, so the SVGs of joint/backward graphs silently fell back to .dot."""
    import shutil

    from commfuse.ir import CollectiveIR
    from commfuse.passmgr.render import condensed_dot, dot_to_svg

    def f(x, y):
        return (
            torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0")) + y
        )

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2), torch.randn(2))
    dot = condensed_dot(gm, CollectiveIR(gm), title="t")
    assert "<i></i>" not in dot
    if shutil.which("dot"):
        assert dot_to_svg(dot) is not None


# -- config / topology validation ---------------------------------------------------
def test_unknown_pass_name_is_named():
    with pytest.raises(ValueError, match=r"passes[\s\S]*unknown pass name\(s\) \['fuse_everything'\]"):
        commfuse.Config(passes=["sink_waits", "fuse_everything"])
    with pytest.raises(ValueError, match="unknown pass"):
        commfuse.backend(passes=["nope"])


@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_size_is_named(value):
    with pytest.raises(ValueError, match="svg_max_nodes"):
        commfuse.Config(svg_max_nodes=value)


def test_unknown_config_field_is_named():
    with pytest.raises(ValueError, match="dump_dri"):
        commfuse.Config(dump_dri="/tmp/x")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_nodes=0), "num_nodes"),
        (dict(ranks_per_node=-1), "ranks_per_node"),
        (dict(intra_node_bandwidth_GBps=0), "intra_node_bandwidth_GBps"),
        (dict(inter_node_latency_us=-1), "inter_node_latency_us"),
    ],
)
def test_invalid_topology_is_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        commfuse.Topology(**kwargs)
    with pytest.raises(ValueError, match=field):
        commfuse.Config(topology=kwargs)


def test_topology_preset_file_and_world_size(tmp_path):
    t = commfuse.Topology.preset("dgx-h100", num_nodes=2)
    assert t.world_size == 16 and t.spans_nodes((0, 8)) and not t.spans_nodes((0, 7))
    assert t.intra_node_groups()[1] == tuple(range(8, 16)) and t.inter_node_groups()[0] == (0, 8)
    with pytest.raises(ConfigError, match="unknown preset 'dgx-z'"):
        commfuse.Topology.preset("dgx-z")
    p = tmp_path / "topo.json"
    p.write_text(t.model_dump_json())
    assert commfuse.Topology.load(p) == t
    p.write_text("{truncated")
    with pytest.raises(ConfigError, match="cannot read topology file"):
        commfuse.Topology.load(p)
    with fake_process_group(4):
        with pytest.raises(ConfigError, match="topology: .* world_size 4"):
            commfuse.setup(topology=t)


def test_setup_creates_subgroups_and_mesh_roles():
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse.session import reset

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        s = commfuse.setup(topology=dict(num_nodes=2, ranks_per_node=2), mesh=mesh)
        assert sorted(s.intra_node_groups) == [(0, 1), (2, 3)]
        assert sorted(s.inter_node_groups) == [(0, 2), (1, 3)]
        assert sorted(s.group_roles.values()) == ["dp", "tp"]
        reset()


def test_the_session_fingerprint_follows_what_the_passes_decide_from():
    """The compile cache keys on the session too: the sub-group aliases (and the blocks they stand
    for), the declared roles and the communicator pool change what the passes decide; the same
    setup on another rank gives the same fingerprint (a rank's own sub-groups are left out)."""
    from commfuse.session import current_session, reset

    prints = {}
    for rank in (0, 3):
        for groups in (None, [[[0, 1, 2, 3]]]):
            with fake_process_group(4, rank=rank):
                commfuse.setup(topology=dict(num_nodes=2, ranks_per_node=2), groups=groups)
                prints[rank, groups is None] = current_session().fingerprint()
                reset()
    assert prints[0, True] == prints[3, True] and prints[0, False] == prints[3, False]
    with fake_process_group(4):
        empty = current_session().fingerprint()
    assert len({prints[0, True], empty}) == 2


# -- optimize on a make_fx-traced training step ---------------------------------------------
def test_optimize_on_make_fx_training_step():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    def train_step(w, x):
        # SimpleFSDP-like: gather the weight shard, compute, reduce-scatter the gradient.
        full = funcol.all_gather_tensor(w, 0, dist.group.WORLD)
        loss = torch.tanh(x @ full.t()).sum()
        (g,) = torch.autograd.grad(loss, [full])
        return loss, funcol.reduce_scatter_tensor(g, "avg", 0, dist.group.WORLD)

    with fake_process_group(4):
        w = torch.randn(2, 8, requires_grad=True)
        gm = make_fx(train_step, tracing_mode="fake")(w, torch.randn(3, 8))
        report = commfuse.analyze(gm)
        commfuse.optimize(gm)
    assert [(c.kind, c.role) for c in report.collectives] == [
        ("all_gather", "fsdp"),
        ("reduce_scatter", "unknown"),
    ]
    assert verify_graph(gm).ok
    # the default pipeline: accumulate_gradient_sync (one micro-batch: no sum of gradient syncs),
    # chimera (nothing to fuse here: the gathered weight feeds a matmul, the scattered gradient the
    # output), schedule_overlap, bucket_collectives, sink_waits, gloo_reduce_scatter (no topology,
    # CPU tensors: the reduce_scatter becomes an all_to_all)
    assert [p.name for p in commfuse.last_report(gm).passes] == [
        "accumulate_gradient_sync",
        "chimera",
        "schedule_overlap",
        "bucket_collectives",
        "sink_waits",
        "gloo_reduce_scatter",
    ]
    assert [c.kind for c in commfuse.analyze(gm).collectives] == ["all_gather", "all_to_all"]


class _WrongMeta(GraphPass):
    """Test pass: records a wrong shape on a compute node (only fake re-propagation can tell)."""

    name = "test_wrong_meta"
    stage = Stage.JOINT

    def run(self, ctx):
        node = next(n for n in ctx.gm.graph.nodes if n.target is torch.ops.aten.relu.default)
        node.meta["val"] = torch.empty(5, 5, device="meta")
        return PassResult(changed=True)


def test_debug_verifier_repropagates_fake_tensors():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        a = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0"))
        return torch.mm(a, w).relu()

    register_pass(_WrongMeta)
    try:
        with fake_process_group(2):
            gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(3, 4))
            ok = make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(3, 4))
        assert verify_graph(ok, deep=True).ok
        commfuse.optimize(gm, commfuse.Config(passes=["test_wrong_meta"]))  # shallow: not detectable
        assert commfuse.last_report(gm).passes[0].changed
        with fake_process_group(2):
            gm2 = make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(3, 4))
        with pytest.raises(
            VerificationError, match=r"relu: recorded \(5, 5\)/torch.float32 but computes \(4, 4\)"
        ):
            commfuse.optimize(gm2, commfuse.Config(passes=["test_wrong_meta"], debug=True, strict=True))
    finally:
        unregister_pass("test_wrong_meta")
