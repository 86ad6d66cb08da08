"""The emulated cluster's network, built and run inside private namespaces.

Contract
- Runs as PID 1 of fresh PID, mount and network namespaces (``commfuse.emulate.launch`` execs
  ``unshare`` onto this file; a user namespace too when not root). When this process ends, for
  any reason, the kernel kills every process of its PID namespace, so the rank processes, the
  namespace holders and with them every namespace, link and qdisc go too: nothing survives a
  SIGKILL of the launcher (``unshare --kill-child`` passes it on).
- Builds, in its own network namespace (the switch): one bridge per node; for several nodes a
  core bridge and one uplink per node (a veth pair, tbf at the node's inter rate on both ends);
  per rank a network namespace held by a sleeping process, joined to its node's bridge by a veth
  pair with tbf at the intra rate on both ends (the rank's egress and its ingress). Addresses
  10.77.0.0/16, rank r at ``address(r)``.
- Checks the links (unless told not to): one TCP stream each way between two ranks of a node
  and between two nodes, against the rate the spec expects of a single stream; more than
  ``tolerance`` off and it refuses to run the command.
- With ``spec["host"]``, runs the command once, in the switch's namespace, with ``RANKS_ENV``
  saying where each rank's namespace is: a process that starts its own ranks (commfuse's rank
  pool, the benchmark runner) starts each in its namespace. Otherwise:
- Runs the command once per rank in that rank's namespace (``nsenter --net``, so the rank's
  first socket is already on its link) with what torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), GLOO_SOCKET_IFNAME, and the spec's
  extra environment; each rank pinned to one core (rank r on core r mod the cores it may use)
  unless the spec says not to. Like torchrun, the first rank to fail stops the others; the exit
  status is that rank's.

Imports only the standard library: it runs by path (``python netns.py SPEC -- CMD``), without
the commfuse package and torch, also as an unprivileged user in a user namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

SUBNET = "10.77.0.0/16"
# TCP payload per frame on a 1500-byte MTU with timestamps (1448) against what tbf counts
# (the frame without preamble and FCS, 1514 bytes): a single stream's goodput at a tbf rate.
TCP_GOODPUT = 1448 / 1514
TBF_LATENCY = "2000ms"  # the queue a tbf may hold, in time at its rate: TCP backs off, no drops
# Where each rank's namespace is, for a command run once in the switch's namespace (run_host).
RANKS_ENV = "COMMFUSE_EMULATED_RANKS"


class NetworkError(RuntimeError):
    """The emulated network could not be built or does not run at its spec."""


def address(rank: int) -> str:
    return f"10.77.{rank // 250}.{rank % 250 + 1}"


def _run(cmd: list[str], what: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise NetworkError(f"{what}: {cmd[0]} is not installed") from None
    if out.returncode != 0:
        raise NetworkError(f"{what}: `{' '.join(cmd)}` failed: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def _in_ns(pid: int, cmd: list[str]) -> list[str]:
    return ["nsenter", f"--net=/proc/{pid}/ns/net", "--", *cmd]


def _tbf(dev: str, rate_bps: float, burst: int) -> list[str]:
    return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
            "burst", str(burst), "latency", TBF_LATENCY]  # fmt: skip


@dataclass
class Rank:
    rank: int
    node: int
    holder: subprocess.Popen
    ifname: str

    @property
    def pid(self) -> int:
        return self.holder.pid


def _new_netns_holder() -> subprocess.Popen:
    """A sleeping process in a network namespace of its own (the namespace lives while it does)."""
    mine = os.stat("/proc/self/ns/net").st_ino
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.stat(f"/proc/{holder.pid}/ns/net").st_ino != mine:
                return holder
        except FileNotFoundError:
            pass
        if holder.poll() is not None:
            raise NetworkError(
                f"`unshare --net` exited with status {holder.returncode}: no network namespace"
            )
        time.sleep(0.01)
    raise NetworkError("`unshare --net` did not create a network namespace within 10 s")


def build(spec: dict) -> list[Rank]:
    """The switch, the uplinks and one namespace per rank, shaped as ``spec`` says."""
    nodes, per_node = spec["nodes"], spec["ranks_per_node"]
    intra, uplink = spec["intra_bps"], spec.get("uplink_bps", 0)
    burst_intra, burst_up = spec["burst_intra"], spec.get("burst_uplink", 0)
    _run(["ip", "link", "set", "lo", "up"], "the switch's loopback")
    for n in range(nodes):
        _run(["ip", "link", "add", f"br{n}", "type", "bridge"], f"node {n}'s bridge")
        _run(["ip", "link", "set", f"br{n}", "up"], f"node {n}'s bridge")
    if nodes > 1:
        _run(["ip", "link", "add", "brc", "type", "bridge"], "the core bridge")
        _run(["ip", "link", "set", "brc", "up"], "the core bridge")
        for n in range(nodes):
            up, down = f"up{n}", f"dn{n}"
            _run(["ip", "link", "add", up, "type", "veth", "peer", "name", down], f"node {n}'s uplink")
            _run(["ip", "link", "set", up, "master", f"br{n}"], f"node {n}'s uplink")
            _run(["ip", "link", "set", down, "master", "brc"], f"node {n}'s uplink")
            for dev in (up, down):  # up: the node's traffic out; dn: into the node
                _run(_tbf(dev, uplink, burst_up), f"node {n}'s uplink shaping")
                _run(["ip", "link", "set", dev, "up"], f"node {n}'s uplink")
    ranks = []
    for r in range(nodes * per_node):
        node = r // per_node
        holder = _new_netns_holder()
        rank = Rank(r, node, holder, f"vr{r}")
        ranks.append(rank)
        host = f"vh{r}"
        _run(["ip", "link", "add", host, "type", "veth", "peer", "name", rank.ifname], f"rank {r}'s link")
        _run(["ip", "link", "set", rank.ifname, "netns", str(rank.pid)], f"rank {r}'s link")
        _run(["ip", "link", "set", host, "master", f"br{node}"], f"rank {r}'s link")
        _run(_tbf(host, intra, burst_intra), f"rank {r}'s ingress shaping")
        _run(["ip", "link", "set", host, "up"], f"rank {r}'s link")
        inside = [
            ["ip", "link", "set", "lo", "up"],
            ["ip", "addr", "add", f"{address(r)}/16", "dev", rank.ifname],
            _tbf(rank.ifname, intra, burst_intra),
            ["ip", "link", "set", rank.ifname, "up"],
        ]
        for cmd in inside:
            _run(_in_ns(rank.pid, cmd), f"rank {r}'s namespace")
    return ranks


# --------------------------------------------------------------------------- link check
_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
_SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
left = int(sys.argv[3]); chunk = b"x" * (1 << 16)
while left > 0:
    c.sendall(chunk[:left]); left -= len(chunk)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def stream_rate_bps(src: Rank, dst: Rank, nbytes: int, python: str, port: int = 29400) -> float:
    """One TCP stream of ``nbytes`` from ``src`` to ``dst``: payload bits per second at the
    receiver, from its first byte to its last."""
    recv = subprocess.Popen(
        _in_ns(dst.pid, [python, "-c", _RECEIVER, address(dst.rank), str(port)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "listening":
            raise NetworkError(f"link check: the receiver on rank {dst.rank} did not start")
        send = subprocess.run(
            _in_ns(src.pid, [python, "-c", _SENDER, address(dst.rank), str(port), str(nbytes)]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if send.returncode != 0:
            raise NetworkError(f"link check: rank {src.rank} -> {dst.rank} failed: {send.stderr.strip()}")
        n, seconds = recv.stdout.readline().split()
        return int(n) * 8 / float(seconds)
    finally:
        recv.kill()
        recv.wait()


def check_links(ranks: list[Rank], spec: dict, python: str) -> list[dict]:
    """Each way between two ranks of node 0, and between node 0 and node 1: measured against
    what one stream should get (the tbf rate on its path times ``TCP_GOODPUT``). Raises
    NetworkError naming every path more than ``spec["tolerance"]`` off."""
    per_node, tolerance = spec["ranks_per_node"], spec["tolerance"]
    pairs = []
    if per_node > 1:
        pairs += [("intra", ranks[0], ranks[1]), ("intra", ranks[1], ranks[0])]
    if spec["nodes"] > 1:
        other = ranks[per_node]
        pairs += [("inter", ranks[0], other), ("inter", other, ranks[0])]
    rows = []
    for level, a, b in pairs:
        path_bps = spec["intra_bps"] if level == "intra" else min(spec["intra_bps"], spec["uplink_bps"])
        expected = path_bps * TCP_GOODPUT
        nbytes = max(1 << 20, int(expected / 8 * spec.get("check_seconds", 0.5)))
        measured = stream_rate_bps(a, b, nbytes, python)
        rows.append(
            {
                "level": level,
                "from": a.rank,
                "to": b.rank,
                "expected_bps": expected,
                "measured_bps": measured,
                "off": measured / expected - 1,
            }
        )
    bad = [r for r in rows if abs(r["off"]) > tolerance]
    if bad:
        raise NetworkError(
            "the emulated links are not at their spec (more than "
            f"{tolerance:.0%} off; a machine too busy to pace them, or a kernel without tbf): "
            + "; ".join(_describe(r) for r in bad)
        )
    return rows


def _describe(row: dict) -> str:
    return (
        f"{row['level']} rank {row['from']} -> {row['to']}: {row['measured_bps'] / 1e6:.1f} Mbit/s, "
        f"expected {row['expected_bps'] / 1e6:.1f} ({row['off']:+.1%})"
    )


# --------------------------------------------------------------------------- the ranks
def launch(ranks: list[Rank], spec: dict, cmd: list[str]) -> int:
    """The command on every rank, as torchrun would start it; the first failure stops the rest."""
    world, per_node = len(ranks), spec["ranks_per_node"]
    cores = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen] = []
    for r in ranks:
        env = dict(os.environ)
        env.update(spec.get("env", {}))
        env.update(
            RANK=str(r.rank),
            LOCAL_RANK=str(r.rank % per_node),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(per_node),
            GROUP_RANK=str(r.node),
            ROLE_RANK=str(r.rank),
            ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR=address(0),
            MASTER_PORT=str(spec.get("master_port", 29500)),
            GLOO_SOCKET_IFNAME=r.ifname,
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        core = cores[r.rank % len(cores)]
        pin = spec.get("pin", True)
        procs.append(
            subprocess.Popen(
                _in_ns(r.pid, cmd),
                env=env,
                preexec_fn=(lambda c=core: os.sched_setaffinity(0, {c})) if pin else None,
            )
        )

    def stop(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed and status == 0:
            status = failed[0].returncode
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.05)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode != 0), 0)
    return status if status >= 0 else 128 - status


def run_host(ranks: list[Rank], spec: dict, cmd: list[str]) -> int:
    """The command once, here in the switch's namespace, told where each rank's namespace is
    (``RANKS_ENV``: rank, holder pid, interface, address, core): a process that starts its own
    rank processes (commfuse's rank pool) starts each one in its namespace."""
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    env[RANKS_ENV] = json.dumps(
        [
            {
                "rank": r.rank,
                "pid": r.pid,
                "ifname": r.ifname,
                "address": address(r.rank),
                "core": cores[r.rank % len(cores)] if spec.get("pin", True) else None,
            }
            for r in ranks
        ]
    )
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = proc.wait()
    return status if status >= 0 else 128 - status


def main(argv: list[str]) -> int:
    """``netns.py SPEC_JSON -- CMD ...``: build, check, run; the ranks' exit status."""
    if "--" not in argv or argv.index("--") != 1:
        print("usage: netns.py SPEC_JSON -- CMD [ARGS...]", file=sys.stderr)
        return 2
    spec, cmd = json.loads(argv[0]), argv[2:]
    missing = [b for b in ("ip", "tc", "unshare", "nsenter", "sleep") if shutil.which(b) is None]
    if missing:
        print(f"commfuse emulate: not installed: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        ranks = build(spec)
        if spec.get("check", True):
            rows = check_links(ranks, spec, spec.get("python", sys.executable))
            for row in rows:
                print(f"commfuse emulate: link check {_describe(row)}", file=sys.stderr, flush=True)
    except NetworkError as e:
        print(f"commfuse emulate: {e}", file=sys.stderr)
        return 2
    if not cmd:
        return 0
    if spec.get("host"):
        return run_host(ranks, spec, cmd)
    return launch(ranks, spec, cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
