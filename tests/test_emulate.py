"""The emulated cluster network (commfuse/emulate): structure, not speed.

Namespaces and links built and torn down (also after a SIGKILL of the launcher), a 2-rank gloo
all_reduce through them, the unprivileged path as user ``nobody``, torchrun's environment, the
README's quickstart under ``commfuse emulate``, and the emulated topology reaching the passes.
The links' rates are checked by the tool itself at every start and by the benchmarks, never
here: a test asserts the check's rows, at a tolerance no load can miss.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from commfuse.core.errors import ConfigError
from commfuse.emulate import PRESETS, emulated_topology, network_spec, preset, run_emulated
from commfuse.emulate.launch import NETNS_SCRIPT, check_can_emulate, unshare_command
from commfuse.emulate.presets import burst_bytes

REPO = Path(__file__).resolve().parents[1]


def _can_emulate() -> str:
    try:
        check_can_emulate()
    except ConfigError as e:
        return str(e)
    return ""


needs_namespaces = pytest.mark.skipif(bool(_can_emulate()), reason=_can_emulate() or "ok")


def _spec(nodes=1, per_node=2, **kw):
    kw.setdefault("check", False)
    return network_spec(preset("h100-nvlink-ib400"), nodes, per_node, **kw)


def _emulated(spec, command, timeout=120, **kw):
    return run_emulated(spec, command, capture_output=True, text=True, timeout=timeout, **kw)


def test_presets_keep_their_cluster_ratio_and_name_what_they_emulate():
    assert {"h100-nvlink", "h100-nvlink-ib400", "a100-nvlink-ib100"} <= set(PRESETS)
    for p in PRESETS.values():
        assert p.intra_bps > 0 and p.emulates and "dgx" not in p.name
        # bits per second here / bytes per second there = the same scale for every link
        assert p.intra_bps / (p.gpu_intra_GBps * 8e9) == pytest.approx(p.scale)
        if p.two_level:
            assert p.inter_bps_per_rank / (p.gpu_inter_GBps * 8e9) == pytest.approx(p.scale)
            assert p.inter_bps_per_rank < p.intra_bps
    assert not PRESETS["h100-nvlink"].two_level
    assert burst_bytes(1e6) == 16 * 1024 and burst_bytes(8e9) == 1_000_000


def test_bad_input_names_the_field():
    with pytest.raises(ConfigError, match="unknown name 'dgx-h100'"):
        preset("dgx-h100")
    with pytest.raises(ConfigError, match="emulates one node"):
        network_spec(preset("h100-nvlink"), 2, 2)
    with pytest.raises(ConfigError, match="--nodes and --ranks-per-node"):
        network_spec(preset("h100-nvlink"), 1, 0)
    from commfuse.tools.cli import main

    assert main(["emulate", "--preset", "h100-nvlink"]) == 2  # no command
    assert main(["emulate", "--", "true"]) == 2  # no preset


def test_the_emulated_topology_is_what_the_passes_price(monkeypatch):
    from commfuse.config import Config
    from commfuse.session import detected_topology, resolved_topology

    topo = emulated_topology(preset("a100-nvlink-ib100"), 2, 2)
    assert (topo.num_nodes, topo.ranks_per_node) == (2, 2)
    assert topo.inter_node_bandwidth_GBps < topo.intra_node_bandwidth_GBps
    monkeypatch.setenv("COMMFUSE_TOPOLOGY", topo.model_dump_json())
    assert detected_topology() == topo
    assert resolved_topology(Config()) == (topo, "detected")
    monkeypatch.setenv("COMMFUSE_TOPOLOGY", "no-such-preset")
    with pytest.raises(ConfigError, match="COMMFUSE_TOPOLOGY"):
        detected_topology()


@needs_namespaces
def test_two_nodes_get_their_own_namespaces_addresses_and_torchrun_environment():
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "GLOO_SOCKET_IFNAME", "COMMFUSE_NETWORK"]  # fmt: skip
    script = (
        "import json, os, socket; os.write(1, ('ENV ' + json.dumps({'env': [os.environ[k] for k in %r], "
        "'ifs': sorted(i for _, i in socket.if_nameindex()), 'cores': sorted(os.sched_getaffinity(0))}) "
        "+ '\\n').encode())" % keys
    )
    out = _emulated(_spec(2, 2, check=True, tolerance=100.0), [sys.executable, "-c", script])
    assert out.returncode == 0, out.stderr
    # one os.write per rank: the four share the pipe, and PYTHONUNBUFFERED splits a print in pieces
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ENV")]
    rows.sort(key=lambda row: int(row["env"][0]))
    cores = sorted(os.sched_getaffinity(0))
    assert len(rows) == 4
    for r, row in enumerate(rows):
        assert row["env"] == [str(x) for x in (r, r % 2, 4, 2, r // 2)] + [
            "10.77.0.1", "29500", f"vr{r}", "h100-nvlink-ib400"]  # fmt: skip
        assert row["ifs"] == ["lo", f"vr{r}"]  # its own namespace: its link and loopback only
        assert row["cores"] == [cores[r % len(cores)]]
    # the link check ran each way inside node 0 and between the nodes
    checked = [line for line in out.stderr.splitlines() if "link check" in line]
    assert len(checked) == 4 and sum("inter" in line for line in checked) == 2, out.stderr


@needs_namespaces
def test_a_killed_launcher_leaves_no_process_and_no_namespace():
    marker = f"commfuse-emulate-test-{os.getpid()}"
    proc = subprocess.Popen(
        [
            *unshare_command(),
            sys.executable,
            NETNS_SCRIPT,
            json.dumps(_spec(2, 2)),
            "--",
            "sh",
            "-c",
            f"sleep 600; : {marker}",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def alive() -> list[str]:
            ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            return [line for line in ps.splitlines() if marker in line and "ps -eo" not in line]

        deadline = time.monotonic() + 30
        while len(alive()) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(alive()) == 4, alive()  # the 4 ranks' shells
        namespaces_before = len(_net_namespaces())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive() == []
        # the switch and the 4 rank namespaces went with their last process
        assert len(_net_namespaces()) <= namespaces_before - 5
    finally:
        if proc.poll() is None:
            proc.kill()


def _net_namespaces() -> set[int]:
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
            except OSError:
                pass
    return out


_ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.arange(1 << 18, dtype=torch.float32) * (r + 1)
dist.all_reduce(t)
n = dist.get_world_size()
ok = torch.equal(t, torch.arange(1 << 18, dtype=torch.float32) * (n * (n + 1) // 2))
os.write(1, f"RESULT {r} {ok}\\n".encode())  # one write: the ranks share the pipe, unbuffered or not
dist.destroy_process_group()
"""


@needs_namespaces
@pytest.mark.slow(reason="4 Python ranks import torch and join gloo over shaped links")
def test_gloo_all_reduce_through_the_emulated_links_gives_correct_values():
    out = _emulated(_spec(2, 2), [sys.executable, "-c", _ALL_REDUCE], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = sorted(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    assert results == [f"RESULT {r} True" for r in range(4)], out.stdout


_EXCHANGE = """
import os, socket, time
r, master = int(os.environ["RANK"]), os.environ["MASTER_ADDR"]
if r == 0:
    s = socket.socket(); s.bind((master, 29501)); s.listen(1)
    c, _ = s.accept(); print("GOT", c.recv(64).decode(), os.getuid(), flush=True)
else:
    for _ in range(100):
        try:
            c = socket.create_connection((master, 29501)); break
        except OSError:
            time.sleep(0.05)
    c.sendall(f"from rank {r}".encode())
"""


@needs_namespaces
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to become nobody"
)
def test_unprivileged_user_builds_the_same_network():
    """As ``nobody``: a user namespace maps it to root inside; the network script runs by path
    with the system's Python (no torch), so it is copied where nobody can read it."""
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    with tempfile.TemporaryDirectory() as where:  # pytest's tmp_path is private to root
        os.chmod(where, 0o755)
        script = Path(where) / "netns.py"
        shutil.copy(NETNS_SCRIPT, script)
        script.chmod(0o644)
        _run_as_nobody(python, script, where)


def _run_as_nobody(python: str, script: Path, cwd: str) -> None:
    spec = _spec(2, 1, check=True, tolerance=100.0, python=python)
    spec["env"] = {}
    argv = [
        "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
        *unshare_command(privileged=False), python, str(script), json.dumps(spec), "--",
        python, "-c", _EXCHANGE,
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert "GOT from rank 1 0" in out.stdout  # uid 0 inside: nobody mapped to root
    assert sum("link check inter" in line for line in out.stderr.splitlines()) == 2


@needs_namespaces
@pytest.mark.slow(reason="the README's quickstart: 2 ranks, cold compiles, on emulated links")
def test_quickstart_runs_under_commfuse_emulate():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "commfuse",
            "emulate",
            "--preset",
            "h100-nvlink",
            "--nodes",
            "1",
            "--ranks-per-node",
            "2",
            "--no-link-check",
            "--",
            sys.executable,
            "examples/quickstart.py",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 3: loss" in out.stdout, out.stdout


@needs_namespaces
@pytest.mark.slow(reason="a 2-rank pool (torch, gloo) started beside the emulated namespaces")
def test_a_rank_pool_started_beside_the_network_puts_each_rank_in_its_namespace():
    """The benchmark runner's way in: the command runs once (``host``), and the rank pool it
    starts spawns each rank on its own link, core and gloo interface."""
    spec = _spec(1, 2)
    spec["host"] = True
    out = _emulated(
        spec, [sys.executable, str(REPO / "tests" / "_jobs_emulate.py"), "2"], timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("POOL")]
    cores = sorted(os.sched_getaffinity(0))
    for r, got in enumerate(json.loads(line[5:])):
        assert got == {
            "ifs": ["lo", f"vr{r}"],
            "gloo": f"vr{r}",
            "cores": [cores[r % len(cores)]],
            "sum_ok": True,
        }
