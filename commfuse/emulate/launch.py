"""`commfuse emulate`: run a command's ranks on an emulated cluster network.

Contract
- Takes a preset (``commfuse.emulate.presets``), a node count and ranks per node, and a
  command; replaces this process with ``unshare`` (fresh PID, mount and network namespaces, and
  a user namespace mapping this user to root when not root) running ``netns.py`` as the
  namespaces' first process, which builds the links, checks them and starts the command once
  per rank as torchrun would (``commfuse/emulate/netns.py``). The exit status is the ranks'.
- The ranks see ``COMMFUSE_TOPOLOGY``: the emulated cluster as a commfuse ``Topology``, so the
  passes price the links the ranks really have rather than the ``cpu-gloo`` placeholder
  (a profile ``commfuse calibrate`` fits on these links, given as ``Config.cost_profile``,
  refines it), and ``COMMFUSE_NETWORK``: the preset's name, which benchmark results record.
- Anything that keeps it from running (no user namespaces for a non-root user, a missing
  ``unshare``/``ip``/``tc``/``nsenter``) is one error naming what is missing, before any rank
  starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from commfuse.core.errors import ConfigError
from commfuse.costmodel.topology import PRESETS as TOPOLOGY_PRESETS
from commfuse.costmodel.topology import Topology
from commfuse.emulate.netns import TCP_GOODPUT
from commfuse.emulate.presets import CPU_MATMUL_GFLOPS, NetworkPreset, burst_bytes

NETNS_SCRIPT = str(Path(__file__).with_name("netns.py"))
NETWORK_ENV = "COMMFUSE_NETWORK"
TOOLS = ("unshare", "ip", "tc", "nsenter", "sleep")


def emulated_topology(p: NetworkPreset, nodes: int, ranks_per_node: int) -> Topology:
    """The emulated cluster as the cost model sees it: the links' goodput per rank, this
    machine's per-message costs and compute (the ``cpu-gloo`` preset's, and the compute
    convention's matmul rate), no compute slow-down under communication (the kernel moves the
    bytes; ``commfuse calibrate`` on these links measures it)."""
    cpu = TOPOLOGY_PRESETS["cpu-gloo"]
    per_rank_inter = p.inter_bps_per_rank if p.two_level else p.intra_bps
    return Topology(
        name=f"emulated-{p.name}",
        num_nodes=nodes,
        ranks_per_node=ranks_per_node,
        intra_node_bandwidth_GBps=p.intra_bps * TCP_GOODPUT / 8e9,
        inter_node_bandwidth_GBps=min(p.intra_bps, per_rank_inter) * TCP_GOODPUT / 8e9,
        intra_node_latency_us=cpu["intra_node_latency_us"],
        inter_node_latency_us=cpu["inter_node_latency_us"],
        collective_launch_us=cpu["collective_launch_us"],
        device="cpu",
        peak_tflops_fp32=CPU_MATMUL_GFLOPS / 1e3,
        peak_tflops_bf16=cpu["peak_tflops_bf16"],
        memory_bandwidth_GBps=cpu["memory_bandwidth_GBps"],
        num_sms=0,
        nccl_channels=1,
        contention_kappa=0.0,
    )


def network_spec(
    p: NetworkPreset,
    nodes: int,
    ranks_per_node: int,
    *,
    check: bool = True,
    tolerance: float = 0.10,
    pin: bool = True,
    python: Optional[str] = None,
    extra_env: Optional[dict] = None,
) -> dict:
    """What ``netns.py`` builds and runs (JSON-able)."""
    if nodes < 1 or ranks_per_node < 1:
        raise ConfigError(
            f"emulate: --nodes and --ranks-per-node must be at least 1, got {nodes}, {ranks_per_node}"
        )
    if nodes > 1 and not p.two_level:
        raise ConfigError(f"emulate: preset {p.name!r} emulates one node; --nodes must be 1, got {nodes}")
    uplink = p.uplink_bps(ranks_per_node) if nodes > 1 else 0.0
    topo = emulated_topology(p, nodes, ranks_per_node)
    env = {"COMMFUSE_TOPOLOGY": topo.model_dump_json(), NETWORK_ENV: p.name, **(extra_env or {})}
    return {
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "intra_bps": p.intra_bps,
        "uplink_bps": uplink,
        "burst_intra": burst_bytes(p.intra_bps),
        "burst_uplink": burst_bytes(uplink) if uplink else 0,
        "check": check,
        "tolerance": tolerance,
        "pin": pin,
        "python": python or sys.executable,
        "env": env,
    }


def unshare_command(privileged: Optional[bool] = None) -> list[str]:
    """The ``unshare`` prefix: as root, PID + mount + network namespaces; otherwise a user
    namespace mapping this user to root as well."""
    root = os.geteuid() == 0 if privileged is None else privileged
    user = [] if root else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]


def check_can_emulate(privileged: Optional[bool] = None) -> None:
    """ConfigError naming what is missing: a tool, or the right to create the namespaces."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ConfigError(f"emulate: not installed: {', '.join(missing)} (iproute2 and util-linux)")
    probe = subprocess.run([*unshare_command(privileged), "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        root = os.geteuid() == 0 if privileged is None else privileged
        need = (
            "root with CAP_SYS_ADMIN (a container may need --privileged)"
            if root
            else "unprivileged user namespaces (sysctl user.max_user_namespaces > 0, and "
            "kernel.unprivileged_userns_clone=1 where the kernel has it), or root"
        )
        raise ConfigError(
            f"emulate: cannot create the namespaces ({probe.stderr.strip()}); this needs {need}"
        )


def _argv(spec: dict, command: Sequence[str], privileged: Optional[bool] = None) -> list[str]:
    return [*unshare_command(privileged), spec["python"], NETNS_SCRIPT, json.dumps(spec), "--", *command]


def exec_emulated(spec: dict, command: Sequence[str]) -> None:
    """Replace this process with the emulated cluster running ``command`` (does not return)."""
    argv = _argv(spec, command)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


def run_emulated(
    spec: dict, command: Sequence[str], *, privileged: Optional[bool] = None, **kw
) -> subprocess.CompletedProcess:
    """``command`` on the emulated cluster as a child process (tests, benchmarks)."""
    return subprocess.run(_argv(spec, command, privileged), **kw)
