"""The torch.compile backend in one process (no process group needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import commfuse
from commfuse import Config, ConfigError, Topology
from commfuse.reference.numerics import assert_bitwise_equal_tree


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.n = nn.LayerNorm(32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.n(self.a(x)))).softmax(-1)


def _step(model, x):
    out = model(x)
    out.pow(2).sum().backward()
    grads = {k: p.grad.clone() for k, p in getattr(model, "_orig_mod", model).named_parameters()}
    return out.detach(), grads


def _fresh(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def test_backend_registered_by_name_and_entry_point():
    from importlib.metadata import entry_points

    assert "commfuse" in torch._dynamo.list_backends()
    eps = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "commfuse"]
    assert eps and eps[0].load() is commfuse.commfuse_backend


@pytest.mark.slow(reason="starts a fresh Python process that imports torch")
def test_entry_point_works_without_import():
    # torch.compile(backend="commfuse") in a fresh interpreter that never imports commfuse.
    code = (
        "import torch\nm=torch.nn.Linear(4,4)\nc=torch.compile(m, backend='commfuse')\n"
        "torch._dynamo.config.suppress_errors=False\n"
        "import torch._dynamo.backends.registry as r\nprint(r.lookup_backend('commfuse').__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "commfuse.backend"


@pytest.mark.parametrize("passes", [[], None])
def test_eager_inner_compiler_is_bitwise_equal_to_eager(passes):
    x = torch.randn(4, 16)
    ref = _step(_fresh(), x)
    torch._dynamo.reset()
    cfg = commfuse.Config(passes=passes, inner_compiler="eager", strict=True)
    got = _step(torch.compile(_fresh(), backend=commfuse.backend(cfg)), x)
    assert_bitwise_equal_tree(got, ref)


def test_inference_graph_runs_pipeline(tmp_path):
    torch._dynamo.reset()
    cfg = commfuse.Config(inner_compiler="eager", dump_dir=str(tmp_path))
    m = torch.compile(_fresh(), backend=commfuse.backend(cfg))
    with torch.no_grad():
        m(torch.randn(2, 16))
    assert [p.name for p in (tmp_path / "rank0").iterdir()] == ["inference_000"]


def test_state_dict_unchanged_by_compilation():
    m = _fresh()
    before = {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()}
    torch._dynamo.reset()
    c = torch.compile(m, backend=commfuse.backend(inner_compiler="eager"))
    _step(c, torch.randn(2, 16))
    assert {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()} == before


@pytest.fixture
def no_compile_caches():
    """Inductor's FX-graph and AOTAutograd caches skip commfuse's hooks on a hit (by design);
    tests that look at what the hooks did must compile for real."""
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg

    with icfg.patch(fx_graph_cache=False), fcfg.patch(enable_autograd_cache=False):
        yield


@pytest.mark.slow(reason="cold Inductor compiles (caches off)")
def test_inductor_inner_compiler_equals_torch_compile(tmp_path, no_compile_caches):
    """Empty pass list through Inductor == plain torch.compile (Inductor), bitwise."""
    x = torch.randn(4, 16)
    torch._dynamo.reset()
    ref = _step(torch.compile(_fresh()), x)
    torch._dynamo.reset()
    got = _step(torch.compile(_fresh(), backend=commfuse.backend(passes=[], dump_dir=str(tmp_path))), x)
    assert_bitwise_equal_tree(got, ref)
    # The commfuse hooks ran inside Inductor (joint, forward, backward dumps exist).
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == [
        "backward_000",
        "forward_000",
        "joint_000",
    ]


@pytest.mark.slow(reason="cold Inductor compile (caches off)")
def test_inductor_chains_user_post_grad_pass(no_compile_caches):
    import torch._inductor.config as icfg
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "user-pass-v1"

    torch._dynamo.reset()
    with icfg.patch(post_grad_custom_post_pass=UserPass()):
        m = torch.compile(_fresh(), backend=commfuse.backend(passes=["sink_waits"]))
        with torch.no_grad():
            m(torch.randn(2, 16))
    assert seen, "the user's post-grad pass was dropped"


# -- configuring commfuse where no Config can be passed ------------------------------------
@pytest.fixture
def no_process_default(monkeypatch):
    monkeypatch.delenv(commfuse.CONFIG_ENV, raising=False)
    commfuse.set_default_config(None)
    yield monkeypatch
    commfuse.set_default_config(None)


def _passes_run_when_given_no_config() -> list[str]:
    """Optimise a small traced graph without a config; the passes its pipeline ran."""
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.testing.fake_pg import fake_process_group

    def f(x):
        return funcol.all_reduce(x * 2, "sum", torch.distributed.group.WORLD) + 1

    with fake_process_group(2):
        gm = make_fx(f, tracing_mode="fake")(torch.ones(4))
        commfuse.optimize(gm)
    return [p.name for p in commfuse.last_report(gm).passes]


def test_set_default_config_reaches_compiles_given_no_config(no_process_default):
    assert commfuse.default_config() == commfuse.Config()
    prev = commfuse.set_default_config(commfuse.Config(passes=["sink_waits"]), strict=True)
    assert prev is None
    assert commfuse.default_config().passes == ["sink_waits"] and commfuse.default_config().strict
    assert commfuse.backend().config.passes == ["sink_waits"]
    assert commfuse.CommfuseBackend().config.strict  # what backend="commfuse" builds
    assert commfuse.backend(commfuse.Config()).config.passes is None  # an explicit config wins
    assert _passes_run_when_given_no_config() == ["sink_waits"]
    assert commfuse.set_default_config(None).passes == ["sink_waits"]
    assert commfuse.default_config() == commfuse.Config()
    with pytest.raises(TypeError, match="commfuse.Config"):
        commfuse.set_default_config({"passes": []})


def test_config_from_the_environment(no_process_default, tmp_path):
    mp = no_process_default
    mp.setenv(commfuse.CONFIG_ENV, '{"passes": ["sink_waits"], "inner_compiler": "eager"}')
    assert commfuse.default_config().passes == ["sink_waits"]
    assert commfuse.CommfuseBackend().config.inner_compiler == "eager"
    assert _passes_run_when_given_no_config() == ["sink_waits"]
    path = tmp_path / "commfuse.json"
    path.write_text(json.dumps({"schedule_cpsat_max_nodes": 0}))
    mp.setenv(commfuse.CONFIG_ENV, str(path))
    assert commfuse.default_config().schedule_cpsat_max_nodes == 0
    commfuse.set_default_config(
        commfuse.Config(strict=True)
    )  # the process-wide default wins over the variable
    assert commfuse.default_config().strict and commfuse.default_config().schedule_cpsat_max_nodes == 60


@pytest.mark.parametrize(
    "value, words",
    [
        ('{"passes": ["sink_waits"', ["COMMFUSE_CONFIG", "not valid JSON"]),
        ('{"no_such_field": 1}', ["COMMFUSE_CONFIG", "no_such_field"]),
        ('{"max_chunks": 0}', ["COMMFUSE_CONFIG", "max_chunks"]),
        ("[1, 2]", ["COMMFUSE_CONFIG", "not a JSON object and not a readable file"]),
        ("/nonexistent/commfuse.json", ["COMMFUSE_CONFIG", "/nonexistent/commfuse.json"]),
    ],
)
def test_bad_environment_config_names_the_variable_and_the_field(no_process_default, value, words):
    no_process_default.setenv(commfuse.CONFIG_ENV, value)
    with pytest.raises(commfuse.ConfigError) as e:
        commfuse.default_config()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_config_file_names_the_file(no_process_default, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"lowering": "nope"}')
    no_process_default.setenv(commfuse.CONFIG_ENV, str(path))
    with pytest.raises(commfuse.ConfigError, match="lowering") as e:
        commfuse.default_config()
    assert str(path) in str(e.value)


def test_roles_come_from_the_dtensor_meshes_the_graph_holds(recwarn):
    """No setup(): the backend reads the roles of the groups from the mesh dim names of the
    graph's DTensors; a name without a known role warns once and is left to inference."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import commfuse.session as session
    from commfuse.backend import _dtensor_meshes
    from commfuse.testing.fake_pg import fake_mesh

    def _dtensor_roles(gm, inputs):
        return session.roles_from_meshes(_dtensor_meshes(gm, inputs))

    session._WARNED_DIMS.discard("stage_x")
    with fake_mesh(4, (2, 2), ("dp_shard", "tp")) as mesh:
        w = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0), Shard(1)], run_check=False)
        b = DTensor.from_local(torch.ones(2), mesh["tp"], [Replicate()], run_check=False)
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        roles = _dtensor_roles(gm, [torch.ones(1), w, b])
        assert roles == {mesh.get_group("dp_shard").group_name: "fsdp", mesh.get_group("tp").group_name: "tp"}
        # a DTensor on the "tp" slice: its mesh lists this rank's block, the root mesh every block
        (tp_slice,) = _dtensor_meshes(gm, [b])
        assert session.mesh_partitions(tp_slice) == [[(0, 1)]]
        root = commfuse.core.torch_private.device_mesh_root(tp_slice)
        assert session.mesh_partitions(root) == [[(0, 2), (1, 3)], [(0, 1), (2, 3)]]
        resolved, sources = session.resolved_roles(
            commfuse.Config(group_roles={mesh.get_group("tp").group_name: "sp"}), roles
        )
        assert resolved[mesh.get_group("tp").group_name] == "sp"  # the user's word wins
        assert sources[mesh.get_group("dp_shard").group_name] == "dtensor"
    with fake_mesh(4, (2, 2), ("stage_x", "tp")) as mesh:
        w = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0), Shard(1)], run_check=False)
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        assert _dtensor_roles(gm, [w]) == {mesh.get_group("tp").group_name: "tp"}
        _dtensor_roles(gm, [w])
    unknown = [w for w in recwarn if "stage_x" in str(w.message)]
    assert len(unknown) == 1 and "no known role" in str(unknown[0].message)


# --------------------------------------------------------------- topology from the environment


def test_topology_is_detected_from_the_torchrun_environment():
    from commfuse.session import detected_topology

    t = detected_topology({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16"}, device_name="NVIDIA H100 80GB HBM3")
    assert (t.name, t.num_nodes, t.ranks_per_node) == ("dgx-h100", 2, 8)
    assert detected_topology({"WORLD_SIZE": "16"}, device_name="cpu") is None  # not under torchrun
    cpu = detected_topology({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, device_name="cpu")
    assert (cpu.name, cpu.ranks_per_node) == ("cpu-gloo", 2)


def test_an_unknown_device_gets_the_generic_topology_with_one_warning():
    from commfuse.session import detected_topology

    env = {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}
    with pytest.warns(RuntimeWarning, match="no topology preset for device 'Quantum 9000'") as caught:
        t = detected_topology(env, device_name="Quantum 9000")
        assert detected_topology(env, device_name="Quantum 9000") is t  # decided once per process
    assert len(caught) == 1
    assert (t.name, t.num_nodes, t.ranks_per_node, t.device) == ("generic", 2, 4, "Quantum 9000")


@pytest.mark.parametrize(
    "env, match",
    [
        ({"LOCAL_WORLD_SIZE": "eight", "WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE='eight' is not an integer"),
        ({"LOCAL_WORLD_SIZE": "0", "WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE='0' must be at least 1"),
        (
            {"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "16"},
            "LOCAL_WORLD_SIZE=3 does not divide the world size 16",
        ),
        ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "x"}, "WORLD_SIZE='x' is not an integer"),
    ],
)
def test_a_malformed_torchrun_environment_names_the_variable(env, match):
    from commfuse.session import detected_topology

    with pytest.raises(ConfigError, match=match):
        detected_topology(env, device_name="cpu")


def test_the_report_names_the_topology_and_where_it_came_from(monkeypatch):
    from commfuse.api import pipeline_for

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    rep = pipeline_for(Config()).run(gm, graph_kind="forward", stages=set())
    assert rep.topology.startswith("none")
    rep = pipeline_for(Config(topology=Topology.preset("dgx-a100"))).run(
        gm, graph_kind="forward", stages=set()
    )
    assert rep.topology == "dgx-a100: 1 node(s) x 8 ranks, device A100-SXM (Config.topology)"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rep = pipeline_for(Config()).run(gm, graph_kind="forward", stages=set())
    assert (
        rep.topology.endswith("(detected from the torchrun environment)")
        and "2 node(s) x 2 ranks" in rep.topology
    )


@pytest.mark.multirank
def test_a_topology_that_contradicts_the_world_size_is_refused_by_name(rank_pool_2):
    from _multirank_jobs import topology_against_the_world

    for r in rank_pool_2.run(topology_against_the_world):
        assert (
            "topology: num_nodes*ranks_per_node = 1*8 = 8, but the process group has world_size 2"
            in r["error"]
        )
        assert r["detected"] == ("cpu-gloo", 2, "detected")


def test_inductor_cache_key_covers_the_layout_read_from_dtensors():
    """Roles and mesh blocks from the graph's DTensors change what the passes decide (fusion across
    mesh dims), so Inductor's cache key for commfuse's passes differs when they differ."""
    from commfuse.api import pipeline_for
    from commfuse.backend import _layout_digest

    cfg = commfuse.Config()
    rows = pipeline_for(cfg, dtensor_partitions=[[(0, 1), (2, 3)], [(0, 2), (1, 3)]])
    cols = pipeline_for(cfg, dtensor_partitions=[[(0, 2), (1, 3)], [(0, 1), (2, 3)]])
    assert _layout_digest(rows) != _layout_digest(cols)
    assert _layout_digest(rows) == _layout_digest(
        pipeline_for(cfg, dtensor_partitions=[[(0, 1), (2, 3)], [(0, 2), (1, 3)]])
    )
    assert _layout_digest(pipeline_for(cfg, dtensor_roles={"1": "tp"})) != _layout_digest(pipeline_for(cfg))
