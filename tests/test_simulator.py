"""Timeline simulator (`commfuse.costmodel.simulator`) on tiny hand-made graphs and a captured Llama."""

from __future__ import annotations

import copy
import json
import warnings
from fractions import Fraction

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import commfuse
from commfuse.costmodel.estimator import CollectiveEstimate
from commfuse.costmodel.simulator import Simulator, StreamAssignment, compare_schedules, simulate
from commfuse.ir.collective import Collective
from commfuse.ir.kinds import is_wait
from commfuse.testing.fake_pg import fake_mesh, fake_process_group

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


class TableEstimator:
    """Deterministic test double: costs by node name (prefix match), 0 for every other compute node.

    ``compute``: {node-name prefix: µs}; ``comm``: {collective start name: µs} (default ``comm_default``).
    Counts its calls so tests can check what a re-simulation re-estimates."""

    def __init__(self, compute=None, comm=None, comm_default=10, default=0):
        self.compute = dict(compute or {})
        self.comm = dict(comm or {})
        self.comm_default = comm_default
        self.default = default
        self.calls = 0

    def compute_time_us(self, node: fx.Node):
        self.calls += 1
        for prefix, t in self.compute.items():
            if node.name == prefix or node.name.startswith(prefix + "_"):
                return t
        return self.default if node.op == "call_function" and node.target is not aten.view.default else 0

    def collective(self, c: Collective) -> CollectiveEstimate:
        self.calls += 1
        return CollectiveEstimate(self.comm.get(c.name, self.comm_default), int(c.wire_bytes or 0), "ring")


def _gname(g) -> str:
    return g.group_name


def _trace(f, *shapes):
    return make_fx(f, tracing_mode="fake")(*[torch.randn(*s) for s in shapes])


# ------------------------------------------------------------------ streams and issue order
def _two_all_reduces(g1: str, g2: str):
    def f(x, y, w):
        a = c10d.all_reduce(x, "sum", g1)
        b = c10d.all_reduce(y, "sum", g2)
        z = torch.mm(w, w)
        a = c10d.wait_tensor(a)
        b = c10d.wait_tensor(b)
        return a + b + z

    return _trace(f, (4, 4), (4, 4), (4, 4))


def test_one_group_serialises():
    with fake_process_group(4) as pg:
        gm = _two_all_reduces(_gname(pg), _gname(pg))
        r = simulate(gm, TableEstimator({"mm": 5}, {"all_reduce": 10, "all_reduce_1": 10}))
    t = r.node_times
    assert t["all_reduce"][1:] == (0, 10) and t["all_reduce_1"][1:] == (10, 20)
    assert t["all_reduce"][0] == t["all_reduce_1"][0] == "comm:" + _gname(pg)
    assert t["mm"] == ("compute", 0, 5)
    assert r.makespan_us == 20 and r.compute_us == 5 and r.comm_us == 20
    assert r.exposed_comm_us == 15 and r.hidden_comm_us == 5 and r.overlap_ratio == Fraction(1, 4)


def test_different_groups_overlap_and_can_be_forced_onto_one_stream():
    with fake_mesh(4, (2, 2)) as mesh:
        g0, g1 = _gname(mesh.get_group(0)), _gname(mesh.get_group(1))
        gm = _two_all_reduces(g0, g1)
        est = TableEstimator({"mm": 5}, {"all_reduce": 10, "all_reduce_1": 10})
        r = simulate(gm, est)
        one = simulate(gm, est, StreamAssignment(single_comm_stream=True))
        mapped = simulate(gm, est, StreamAssignment(group_streams={g0: "nccl", g1: "nccl"}))
    assert r.node_times["all_reduce_1"][1:] == (0, 10) and r.makespan_us == 10
    assert r.exposed_comm_us == 5 and len(r.streams) == 3
    assert one.makespan_us == 20 and one.streams == ["compute", "comm"]
    assert mapped.makespan_us == 20 and mapped.streams == ["compute", "nccl"]


def test_collectives_start_no_earlier_than_their_issue_point():
    with fake_mesh(4, (2, 2)) as mesh:
        g0, g1 = _gname(mesh.get_group(0)), _gname(mesh.get_group(1))

        def f(x, y, w):
            a = c10d.all_reduce(x, "sum", g0)  # long, on group 0
            z = torch.mm(w, w)
            b = c10d.all_reduce(y, "sum", g1)  # group 1 is idle, but b is issued after the mm
            c = c10d.all_reduce(z, "sum", g0)  # queued behind a on group 0
            b = c10d.wait_tensor(b)
            a = c10d.wait_tensor(a)
            c = c10d.wait_tensor(c)
            return a + b + c

        gm = _trace(f, (4, 4), (4, 4), (4, 4))
        r = simulate(gm, TableEstimator({"mm": 5}, {"all_reduce": 30, "all_reduce_1": 10, "all_reduce_2": 4}))
    t = {c.name: c for c in r.collectives}
    assert (t["all_reduce"].start_us, t["all_reduce"].end_us) == (0, 30)
    assert (t["all_reduce_1"].issue_us, t["all_reduce_1"].start_us, t["all_reduce_1"].end_us) == (5, 5, 15)
    assert (t["all_reduce_2"].issue_us, t["all_reduce_2"].start_us, t["all_reduce_2"].end_us) == (5, 30, 34)
    assert r.makespan_us == 34 and r.exposed_comm_us == 34 - 5


def test_wait_before_its_collective_is_rejected():
    with fake_process_group(4) as pg:
        gm = _two_all_reduces(_gname(pg), _gname(pg))
        sim = Simulator(gm, TableEstimator())
        nodes = list(gm.graph.nodes)
        ar = next(n for n in nodes if n.name == "all_reduce")
        w = next(u for u in ar.users)
        bad = [n for n in nodes if n is not ar]
        bad.insert(bad.index(w) + 1, ar)
        with pytest.raises(ValueError, match="issued after it"):
            sim.simulate(order=bad)


# ------------------------------------------------------------------ exposed comm and sink_waits
def test_sink_waits_hides_communication():
    with fake_process_group(4) as pg:
        g = _gname(pg)

        def f(x, w):
            a = c10d.wait_tensor(c10d.all_reduce(x, "sum", g))  # waited at once: fully exposed
            y = torch.mm(w, w)
            y2 = torch.mm(y, w)
            return a + 1, y2

        gm = _trace(f, (4, 4), (4, 4))
        sunk = copy.deepcopy(gm)
        commfuse.optimize(sunk, commfuse.Config(passes=["sink_waits"]))
        est = TableEstimator({"mm": 6, "add": 1}, {"all_reduce": 10})
        cmp = compare_schedules(gm, sunk, est, names=("traced", "sink_waits"))
    before, after = cmp.results["traced"], cmp.results["sink_waits"]
    assert before.exposed_comm_us == 10 and before.makespan_us == 23 and before.overlap_ratio == 0
    assert after.exposed_comm_us == 0 and after.makespan_us == 13 and after.overlap_ratio == 1
    assert cmp.best == "sink_waits" and cmp.speedup("sink_waits") == pytest.approx(23 / 13)
    assert cmp.collective_counts == {"traced": 1, "sink_waits": 1}
    text = cmp.table()
    assert "exposed_comm_us" in text and "sink_waits" in text.splitlines()[0]


# ------------------------------------------------------------------ Centauri's overlap bound
@pytest.mark.parametrize(
    "alpha", [Fraction(1, 10), Fraction(1, 3), Fraction(1, 2), Fraction(2, 3), Fraction(9, 10)]
)
def test_centauri_overlap_bound(alpha):
    """One compute op of α·T and one overlappable collective of (1-α)·T: speedup = min(1/α, 1/(1-α))."""
    T = Fraction(1000)
    with fake_process_group(2) as pg:
        g = _gname(pg)

        def f(x, w):
            a = c10d.all_reduce(x, "sum", g)
            y = torch.mm(w, w)
            return c10d.wait_tensor(a), y

        gm = _trace(f, (4, 4), (4, 4))
        r = simulate(gm, TableEstimator({"mm": alpha * T}, {"all_reduce": (1 - alpha) * T}))
    assert r.serial_us == T
    assert r.makespan_us == max(alpha, 1 - alpha) * T
    assert r.serial_us / r.makespan_us == min(1 / alpha, 1 / (1 - alpha))  # exact (Fractions)
    assert r.hidden_comm_us == min(alpha, 1 - alpha) * T


# ------------------------------------------------------------------ contention hook
def test_contention_slows_compute_only_while_collectives_run():
    with fake_process_group(2) as pg:
        g = _gname(pg)

        def f(x, w):
            a = c10d.all_reduce(x, "sum", g)
            y = torch.mm(w, w)
            return c10d.wait_tensor(a), y

        gm = _trace(f, (4, 4), (4, 4))
        seen = []

        def slowdown(node, concurrent):
            seen.append((node.name, [c.name for c in concurrent]))
            return 2

        # 10 µs of compute, 4 µs of comm: 4 µs of wall time at half speed (2 µs of work), then 8 µs alone.
        r = simulate(gm, TableEstimator({"mm": 10}, {"all_reduce": 4}), slowdown=slowdown)
    assert r.node_times["mm"] == ("compute", 0, 12) and r.makespan_us == 12 and r.compute_us == 12
    assert seen == [("mm", ["all_reduce"])]


# ------------------------------------------------------------------ peak memory
def test_peak_memory_on_a_known_graph():
    def f(x):
        a = x * 2  # 64 B
        b = a + 1  # 64 B; a is freed after this
        c = b.view(16)  # alias of b: no allocation, keeps b alive
        return c.sum()  # 4 B

    gm = _trace(f, (4, 4))
    est = TableEstimator(default=1)
    r = Simulator(gm, est).simulate()
    assert (r.peak_memory_bytes, r.peak_memory_node) == (128, "mul")  # x + a; x is freed after mul
    r2 = Simulator(gm, est, inputs_persist=True).simulate()
    assert (r2.peak_memory_bytes, r2.peak_memory_node) == (192, "add")  # x + a + b


def test_collective_output_is_allocated_when_issued():
    with fake_process_group(4) as pg:
        g = _gname(pg)

        def f(x, w):
            a = c10d.all_gather_into_tensor(x, 4, g)  # 4 x 64 B, live from the issue
            y = torch.mm(w, w)  # 64 B while the gather is in flight
            a = c10d.wait_tensor(a)
            return a.sum() + y.sum() + x.sum()

        gm = _trace(f, (4, 4), (4, 4))
        r = simulate(gm, TableEstimator(default=1))
    # x, w (inputs, 64 B each) + the gather's output (256 B, from its issue) + mm (64 B)
    assert r.peak_memory_bytes == 64 + 64 + 256 + 64 and r.peak_memory_node == "mm"


# ------------------------------------------------------------------ chrome trace
def test_chrome_trace_schema():
    with fake_mesh(4, (2, 2)) as mesh:
        gm = _two_all_reduces(_gname(mesh.get_group(0)), _gname(mesh.get_group(1)))
        r = simulate(gm, TableEstimator({"mm": 5, "add": 1}, {"all_reduce": 10, "all_reduce_1": 3}))
    trace = json.loads(json.dumps(r.to_chrome_trace()))
    ev = trace["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == set(r.streams) and len(set(names.values())) == 3
    for e in ev:
        assert {"name", "ph", "pid", "tid"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    xs = {e["name"]: e for e in ev if e["ph"] == "X"}
    assert xs["mm"]["tid"] == names["compute"] and (xs["mm"]["ts"], xs["mm"]["dur"]) == (0, 5)
    assert xs["all_reduce"]["tid"] != xs["all_reduce_1"]["tid"] != names["compute"]
    assert xs["wait:wait_tensor"]["cat"] == "exposed" and xs["wait:wait_tensor"]["dur"] == 5
    assert trace["otherData"]["makespan_us"] == r.makespan_us


# ------------------------------------------------------------------ incremental on a real graph
@pytest.fixture(scope="module")
def llama_graphs():
    from commfuse.models import llama
    from commfuse.testing.graphs import capture_aot_graphs

    with fake_mesh(4) as mesh:
        cfg = llama.LlamaConfig(n_layers=2, dim=32, n_heads=4, ffn_dim=64)
        m = llama.parallelize_llama(llama.build_llama(cfg), mesh, sequence_parallel=True)
        data = llama.make_inputs(cfg, 2, 8, rank=0, world_size=4, sequence_parallel=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = capture_aot_graphs(m, data.inputs, loss=lambda o: llama.loss_fn(o, data))
    return g


class ShapeEstimator(TableEstimator):
    """Every compute node costs 1 + numel/64 µs; collectives 2 + wire/100 µs."""

    def compute_time_us(self, node):
        self.calls += 1
        v = node.meta.get("val")
        return (
            1 + Fraction(v.numel(), 64) if isinstance(v, torch.Tensor) and node.op == "call_function" else 0
        )

    def collective(self, c):
        self.calls += 1
        return CollectiveEstimate(2 + Fraction(int(c.wire_bytes), 100), int(c.wire_bytes), "ring")


def _summary(r):
    return (
        r.summary(),
        r.peak_memory_node,
        [(c.name, c.start_us, c.end_us) for c in r.collectives],
        r.node_names,
        r.node_starts,
        r.node_ends,
    )


def _hoistable(gm):
    """(node, collective start): the first compute node after a collective whose inputs all precede it."""
    from commfuse.ir.kinds import collective_spec

    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for c in gm.graph.nodes:
        if c.op != "call_function" or collective_spec(c.target) is None:
            continue
        for n in list(gm.graph.nodes)[pos[c] + 1 :]:
            if (
                n.op == "call_function"
                and not is_wait(n.target)
                and n.all_input_nodes
                and all(pos[a] < pos[c] for a in n.all_input_nodes)
            ):
                return n, c
    raise AssertionError("no hoistable node")


def test_incremental_equals_full_after_local_changes(llama_graphs):
    gm = copy.deepcopy(llama_graphs["forward"])
    est = ShapeEstimator()
    sim = Simulator(gm, est)
    base = sim.simulate()
    assert base.comm_us > 0 and base.peak_memory_bytes > 0
    calls = est.calls
    # Local change 1: hoist an independent compute node above a collective (the collective is
    # then issued later); moves a node, creates none: no re-estimation at all.
    moved_node, coll = _hoistable(gm)
    coll.prepend(moved_node)
    moved = sim.simulate()
    assert est.calls == calls
    assert _summary(moved) == _summary(Simulator(gm, ShapeEstimator()).simulate())
    assert _summary(moved) != _summary(base)
    # Local change 2: move one wait back to right after its collective, evaluated as a candidate
    # order without touching the graph.
    nodes = list(gm.graph.nodes)
    w = next(n for n in nodes if n.op == "call_function" and is_wait(n.target))
    cand = [n for n in nodes if n is not w]
    cand.insert(cand.index(w.args[0]) + 1, w)
    r_cand = sim.simulate(order=cand)
    w.args[0].append(w)
    assert _summary(r_cand) == _summary(Simulator(gm, ShapeEstimator()).simulate())
    assert est.calls == calls
    # Local change 3: a new compute node (and a new collective) -> update() re-estimates only them.
    first_mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    with gm.graph.inserting_after(first_mm):
        extra = gm.graph.call_function(aten.relu.default, (first_mm,))
        extra.meta["val"] = first_mm.meta["val"]
    w_node = next(n for n in gm.graph.nodes if n.op == "call_function" and is_wait(n.target))
    coll = w_node.args[0]
    with gm.graph.inserting_after(extra):
        ar = gm.graph.call_function(c10d.all_reduce.default, (extra, "sum", coll.args[-1]))
        ar.meta["val"] = extra.meta["val"]
    with gm.graph.inserting_after(ar):
        ar_w = gm.graph.call_function(c10d.wait_tensor.default, (ar,))
        ar_w.meta["val"] = extra.meta["val"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], ar_w),)
    sim.update([extra, ar, ar_w])
    assert est.calls - calls == 2  # relu + the new all_reduce
    with fake_mesh(4):
        assert _summary(sim.simulate()) == _summary(Simulator(gm, ShapeEstimator()).simulate())


def test_joint_graph_and_comparison_table(llama_graphs):
    est = ShapeEstimator()
    fw, bw = llama_graphs["forward"], llama_graphs["backward"]
    cmp = compare_schedules({"forward": fw, "backward": bw}, estimator=est)
    assert cmp.collective_counts == {"forward": 8, "backward": 8}
    assert cmp.table().splitlines()[1].startswith("makespan_us")  # exact Fraction times format too
    for r in cmp.results.values():
        assert r.makespan_us >= max(r.compute_us, max(c.end_us for c in r.collectives))
        assert r.makespan_us <= r.serial_us
        assert 0 <= r.overlap_ratio <= 1 and r.hidden_comm_us + r.exposed_comm_us >= r.comm_us - 1e-9
    with pytest.raises(TypeError, match="estimator"):
        compare_schedules(fw, bw)


# --------------------------------------------------------------------------- full training step


def test_predict_step_adds_runtime_terms_to_the_graphs():
    from commfuse.costmodel import RuntimeParams, predict_step
    from commfuse.costmodel.step import gradient_outputs

    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    args = (torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8))
    fw = make_fx(f)(*args)
    bw = make_fx(torch.func.grad(lambda x, w1, w2: f(x, w1, w2).sum(), argnums=(1, 2)))(*args)
    assert gradient_outputs(bw) == 2
    est = TableEstimator(compute={"mm": 10, "relu": 5, "t": 1})
    rt = RuntimeParams(step_fixed_us=100.0, param_us=3.0, dtensor_param_us=20.0)
    graphs = {"forward": fw, "backward": bw}
    p = predict_step(graphs, est, rt, params=1, dtensor_params=2)
    g = simulate(fw, est).makespan_us + simulate(bw, est).makespan_us
    assert p.graphs_us == g and p.runtime_us == 100.0 + 3.0 + 40.0 and p.total_us == g + 143.0
    assert set(p.graphs) == {"forward", "backward"} and p.summary()["graphs"]["forward"]["makespan_us"] > 0
    # parameter count from the backward graph's gradients when the caller does not know it
    assert predict_step(graphs, est, rt).params == 2 and predict_step(graphs, est, rt).runtime_us == 106.0
    assert predict_step([fw, bw], est).total_us == g  # no runtime terms: the graphs only
