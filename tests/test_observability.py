"""commfuse in PyTorch's own tools: the structured trace (TORCH_TRACE / tlparse), TORCH_LOGS,
torch.profiler labels, and the recorder's trace as a Chrome trace Perfetto opens."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._logging import _internal as torch_logs

import commfuse
from commfuse.core import torch_private as priv
from commfuse.lowering import lower_runtime, runtime
from commfuse.lowering.recorder import CollectiveRecord, Recorder, RegionRecord, profiler_offset_us
from commfuse.passmgr.pipeline import PassLog, StructuredTrace
from commfuse.testing.fake_pg import fake_process_group

from _graphs import prefetch_graph
from _jobs_observability import traced_profiled_step

REPO = Path(__file__).resolve().parent.parent
# the prefix torch's TorchLogsFormatter(trace=True) writes before each event's JSON envelope
# one pass that changes the prefetch graph (sink_waits), ones that refuse it (with reasons)
PASSES = ["accumulate_gradient_sync", "sink_waits", "schedule_overlap"]
_ENVELOPE = re.compile(r"^[A-Z]\d{4} [\d:.]+ +\d+ [^\]]*\] (\{.*\})$")


# ----------------------------------------------------------------------------- helpers
def parse_structured_trace(text: str) -> list[tuple[dict, str | None]]:
    """(envelope, payload) per event of a torch structured-trace log: each event is one line, the
    glog-style prefix then its JSON envelope; its payload follows on lines that start with a tab."""
    events: list[tuple[dict, list[str] | None]] = []
    for line in text.splitlines():
        if line.startswith("\t"):
            assert events, f"payload line before any envelope: {line[:80]!r}"
            if events[-1][1] is None:
                events[-1] = (events[-1][0], [])
            events[-1][1].append(line[1:])
            continue
        m = _ENVELOPE.match(line)
        assert m, f"not a structured-trace line: {line[:120]!r}"
        events.append((json.loads(m.group(1)), None))
    return [(env, None if body is None else "\n".join(body)) for env, body in events]


def commfuse_artifacts(events: list[tuple[dict, str | None]]) -> dict[str, list[tuple[dict, str]]]:
    """commfuse's artifacts by name (a name may repeat across compiles)."""
    out: dict[str, list[tuple[dict, str]]] = {}
    for env, payload in events:
        art = env.get("artifact")
        if art and str(art.get("name", "")).startswith("commfuse_"):
            assert art["encoding"] in ("string", "json")
            assert payload is not None and env.get("has_payload")
            if art["encoding"] == "json":
                json.loads(payload)
            out.setdefault(art["name"], []).append((env, payload))
    return out


_PHASES = {"X", "B", "E", "i", "I", "M", "C", "b", "e", "n", "s", "t", "f"}
_METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def check_chrome_trace(trace: object) -> list[str]:
    """Problems of ``trace`` as a Chrome Trace Event Format JSON object (what Perfetto and
    chrome://tracing load): a ``traceEvents`` list; per event a string ``name``, a known ``ph``,
    integer ``pid``/``tid``; ``ts`` (microseconds) finite and non-negative on every event but
    metadata; ``dur`` finite and non-negative on complete (``X``) events; metadata (``M``) events
    naming a process or thread with ``args.name``; ``args`` an object; the whole strict JSON
    (no NaN or infinity, which Perfetto rejects)."""
    problems = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {trace['displayTimeUnit']!r}")
    try:
        json.dumps(trace, allow_nan=False)
    except ValueError as e:
        problems.append(f"not strict JSON: {e}")

    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    for i, ev in enumerate(trace["traceEvents"]):
        where = f"event {i} ({ev.get('name') if isinstance(ev, dict) else ev!r})"
        if not isinstance(ev, dict):
            problems.append(f"{where}: not an object")
            continue
        if not isinstance(ev.get("name"), str) or not ev["name"]:
            problems.append(f"{where}: no name")
        if ev.get("ph") not in _PHASES:
            problems.append(f"{where}: ph {ev.get('ph')!r}")
        for k in ("pid", "tid"):
            if not isinstance(ev.get(k), int) or isinstance(ev.get(k), bool):
                problems.append(f"{where}: {k} {ev.get(k)!r}")
        if "args" in ev and not isinstance(ev["args"], dict):
            problems.append(f"{where}: args not an object")
        if ev.get("ph") == "M":
            if ev.get("name") not in _METADATA or not isinstance(
                ev.get("args", {}).get("name", 0), (str, int)
            ):
                problems.append(f"{where}: metadata event without a known name / args.name")
            continue
        if not number(ev.get("ts")):
            problems.append(f"{where}: ts {ev.get('ts')!r}")
        if ev.get("ph") == "X" and not number(ev.get("dur")):
            problems.append(f"{where}: dur {ev.get('dur')!r}")
    return problems


@pytest.fixture
def captured_trace():
    """Torch's structured trace into a string, as torch's own structured-trace tests capture it."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(torch_logs.TorchLogsFormatter(trace=True))
    torch_logs.trace_log.addHandler(handler)
    try:
        yield buf
    finally:
        torch_logs.trace_log.removeHandler(handler)


# ----------------------------------------------------------------------------- structured trace
def test_pipeline_emits_graphs_and_decisions_as_structured_artifacts(captured_trace):
    """Before/after graph per changing pass, one decisions artifact per pass (refusals included),
    and the report, as torch.compile's trace holds them; parsed back from the log text."""
    with fake_process_group(8):
        gm = commfuse.optimize(prefetch_graph(64), commfuse.Config(passes=PASSES))
        rep = commfuse.last_report(gm)
    arts = commfuse_artifacts(parse_structured_trace(captured_trace.getvalue()))
    kind = rep.graph
    assert f"commfuse_{kind}_input" in arts and "def forward" in arts[f"commfuse_{kind}_input"][0][1]
    for p in rep.passes:
        ((env, payload),) = arts[f"commfuse_{kind}_pass_{p.name}"]
        got = json.loads(payload)
        assert (got["name"], got["changed"], got["refusals"], got["counts"]) == (
            p.name,
            p.changed,
            p.refusals,
            p.counts,
        )
        assert env["rank"] == 0  # the fake group's rank: each rank's trace says whose it is
        assert (f"commfuse_{kind}_after_{p.name}" in arts) == p.changed
    assert any(p.changed for p in rep.passes) and any(p.refusals for p in rep.passes)
    report = json.loads(arts[f"commfuse_{kind}_report"][0][1])
    assert [p["name"] for p in report["passes"]] == [p.name for p in rep.passes]


def test_nothing_is_built_for_torch_trace_or_logs_when_they_are_off(monkeypatch):
    """Without TORCH_TRACE (torch's lazy handler has no directory) and with the logger at its
    default level, the pipeline adds neither instrument, so no graph is printed for them."""
    assert "TORCH_TRACE" not in os.environ
    assert not priv.structured_trace_enabled()
    assert not logging.getLogger("commfuse.passmgr.pipeline").isEnabledFor(logging.INFO)
    pipeline = commfuse.api.pipeline_for(commfuse.Config(passes=["sink_waits"]))
    kinds = {type(i) for i in pipeline._instruments("forward", False)}
    assert StructuredTrace not in kinds and PassLog not in kinds
    calls = []
    monkeypatch.setattr("commfuse.passmgr.pipeline.graph_text", lambda gm: calls.append(gm) or "")
    with fake_process_group(8):
        commfuse.optimize(prefetch_graph(64), commfuse.Config(passes=["sink_waits"]))
    assert calls == []


@pytest.mark.slow(reason="a subprocess that imports torch and compiles a model (about 10 s)")
def test_torch_trace_and_torch_logs_of_a_compile(tmp_path):
    """``TORCH_TRACE=dir TORCH_LOGS=commfuse`` on a real torch.compile (4 fake ranks): the trace
    file holds commfuse's artifacts next to Dynamo's and AOTAutograd's, in the same compile; the
    log prints one summary line per pass and per graph."""
    script = textwrap.dedent("""
        import json, torch, commfuse
        from commfuse.models import llama
        from commfuse.testing.fake_pg import fake_mesh
        with fake_mesh(4) as mesh:
            cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_dim=64)
            model = llama.parallelize_llama(llama.build_llama(cfg, seed=0), mesh, sequence_parallel=True)
            x = llama.make_inputs(cfg, 2, 8, rank=0, world_size=4).inputs
            be = commfuse.backend(commfuse.Config(group_roles={mesh.get_group().group_name: "tp"},
                                                  inner_compiler="eager"))
            y = torch.compile(model, backend=be)(x)
            (y.to_local() if hasattr(y, "to_local") else y).float().mean().backward()
        print(json.dumps([r.model_dump(include={"graph", "passes"}) for r in be.reports]))
    """)
    env = {
        **os.environ,
        "TORCH_TRACE": str(tmp_path / "trace"),
        "TORCH_LOGS": "commfuse",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    files = list((tmp_path / "trace").glob("dedicated_log_torch_trace_*.log"))
    assert len(files) == 1, files
    events = parse_structured_trace(files[0].read_text())
    arts = commfuse_artifacts(events)
    assert any("dynamo_start" in env for env, _ in events)  # torch's own events, same file
    assert any(
        env.get("artifact", {}).get("name") == "aot_forward_graph" or "aot_forward_graph" in env
        for env, _ in events
    )
    for rep in reports:
        kind = rep["graph"]
        assert f"commfuse_{kind}_input" in arts, kind
        for p in rep["passes"]:
            ((env, payload),) = arts[f"commfuse_{kind}_pass_{p['name']}"]
            assert json.loads(payload)["refusals"] == p["refusals"]
            assert env["frame_id"] == 0 and env["frame_compile_id"] == 0  # filed under the compile
            if p["changed"]:
                assert "def forward" in arts[f"commfuse_{kind}_after_{p['name']}"][0][1]
    assert {"commfuse_forward_lowering_plan", "commfuse_backward_lowering_plan"} <= arts.keys()
    assert any(p["changed"] for rep in reports for p in rep["passes"])
    # TORCH_LOGS=commfuse: one INFO line per pass that ran and one per graph
    for rep in reports:
        for p in rep["passes"]:
            assert re.search(
                rf"commfuse: {rep['graph']} graph: {p['name']}: "
                rf"{'changed' if p['changed'] else 'unchanged'}",
                out.stderr,
            ), (rep["graph"], p["name"])
        assert re.search(rf"commfuse: {rep['graph']} graph: \d+ pass\(es\) ran", out.stderr)


# ----------------------------------------------------------------------------- TORCH_LOGS, loggers
def test_commfuse_is_a_torch_log_and_modules_log_under_it():
    assert torch_logs.log_registry.is_log("commfuse")
    assert torch_logs.log_registry.log_alias_to_log_qnames["commfuse"] == ["commfuse"]
    calls = []
    for path in sorted((REPO / "commfuse").rglob("*.py")):
        for m in re.finditer(r"getLogger\(([^)]*)\)", path.read_text()):
            calls.append((str(path.relative_to(REPO)), m.group(1)))
    assert calls
    # every module logs on its own logger (a child of "commfuse"); torch's are named, not ours
    wrong = [(p, a) for p, a in calls if a != "__name__" and not a.strip("\"'").startswith("torch.")]
    assert wrong == []


def test_pass_log_lines_at_info_and_refusals_at_debug(caplog):
    with fake_process_group(8), caplog.at_level(logging.DEBUG, logger="commfuse"):
        rep = commfuse.last_report(commfuse.optimize(prefetch_graph(64), commfuse.Config(passes=PASSES)))
    lines = [r for r in caplog.records if r.name == "commfuse.passmgr.pipeline"]
    info = [r.getMessage() for r in lines if r.levelno == logging.INFO]
    assert len(info) == len(rep.passes) + 1
    refused = [(p.name, why) for p in rep.passes for why in p.refusals]
    debug = [r.getMessage() for r in lines if r.levelno == logging.DEBUG]
    assert refused and all(any(f"{name} refused: {why}" in m for m in debug) for name, why in refused)


# ----------------------------------------------------------------------------- profiler labels
def test_runtime_labels_the_plan_for_the_profiler_only(monkeypatch):
    """Under torch.profiler every issue, wait and compute region of a lowered graph carries the
    plan's name; without a profiler no label is made."""
    with fake_process_group(8):
        gm = prefetch_graph(64)
        plans = []
        fn = lower_runtime(gm, "forward", on_plan=plans.append, group_roles={"0": "fsdp"})
        args = [torch.randn(64, 64), *[torch.randn(8, 64) for _ in range(3)]]
        with torch.profiler.profile() as prof:
            fn(list(args))
        names = [e.name for e in prof.events() if e.name.startswith("commfuse::")]
        (plan,) = plans
        for c in plan.collectives:
            assert c.label() in names and f"commfuse::wait:{c.kind}[{c.role or c.group}]:{c.start}" in names
        assert sum(n.startswith("commfuse::graph:forward#") for n in names) == 1
        regions = {n for n in names if n.startswith("commfuse::region:")}
        assert "commfuse::region:0" in regions and len(regions) >= len(plan.collectives)

        made = []
        real = runtime.record_function
        monkeypatch.setattr(runtime, "record_function", lambda *a: made.append(a) or real(*a))
        fn(list(args))
        assert made == []


@pytest.mark.slow(reason="two gloo ranks compile and profile a model (about 20 s)")
def test_each_rank_traces_profiles_and_records_its_own_plan(rank_pool_2, tmp_path):
    """2 gloo ranks: each rank's structured-trace file holds its own commfuse artifacts; its
    profiler trace of a compiled step carries the plan's labels; its recorder trace is a Chrome
    trace that lines up with the profiler's through ``profiler_offset_us``."""
    results = rank_pool_2.run(traced_profiled_step, str(tmp_path), timeout=600)
    for r in results:
        rank = r["rank"]
        files = list(tmp_path.glob(f"dedicated_log_torch_trace_rank_{rank}_*.log"))
        assert len(files) == 1, sorted(p.name for p in tmp_path.iterdir())
        events = parse_structured_trace(files[0].read_text())
        arts = commfuse_artifacts(events)
        assert all(env.get("rank") == rank for env, _ in events if "rank" in env)
        for graph in r["graphs"]:
            assert f"commfuse_{graph}_input" in arts and f"commfuse_{graph}_report" in arts
            for p in r["changed"][graph]:
                assert f"commfuse_{graph}_after_{p}" in arts

        names = {name for name, _, _ in r["events"]}
        assert r["labels"] and set(r["labels"]) <= names
        assert any(n.startswith("commfuse::region:") for n in names)
        graphs = {n.split(":")[-1].split("#")[0] for n in names if n.startswith("commfuse::graph:")}
        assert {"forward", "backward"} <= graphs

        trace = r["recorder"]
        assert check_chrome_trace(trace) == []
        offset = profiler_offset_us(trace, {"baseTimeNanoseconds": r["base_ns"]})
        recorded = [e for e in trace["traceEvents"] if e.get("cat", "").startswith("comm")]
        assert recorded
        for e in recorded:
            # issued inside the profiler's label of the same collective (clocks agree to well under 5 ms)
            label_of = [
                (ts, dur)
                for name, ts, dur in r["events"]
                if name.endswith(f"]:{e['args']['name']}")
                and name.startswith(f"commfuse::{e['args']['kind']}[")
            ]
            at = e["ts"] + offset
            assert any(ts - 5e3 <= at <= ts + dur + 5e3 for ts, dur in label_of), (
                e["name"],
                at,
                label_of[:3],
            )


# ----------------------------------------------------------------------------- the recorder's trace
def test_recorder_trace_is_a_chrome_trace_with_its_clock():
    r = Recorder(rank=1)
    r.collectives.append(
        CollectiveRecord(0, "ag", "g#0", "all_gather", "0", "0", 8, 8, 64, 1_000, done_ns=5_000)
    )
    r.collectives.append(CollectiveRecord(1, "rs", "g#0", "reduce_scatter", "0", "pool", None, 8, 8, 6_000))
    r.regions += [RegionRecord("g#0", 0, 2_000), RegionRecord("g#0", 2_000, 4_000, kind="wait")]
    trace = json.loads(json.dumps(r.chrome_trace()))  # what write() puts in rank<r>.json
    assert check_chrome_trace(trace) == []
    meta = {(e["name"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 0)] == "commfuse rank 1" and meta[("thread_name", 0)] == "compute"
    other = trace["otherData"]
    assert other["t0_perf_counter_ns"] == 0 and other["t0_unix_ns"] == r.unix_minus_perf_ns
    assert profiler_offset_us(trace, {"baseTimeNanoseconds": r.unix_minus_perf_ns - 2_000}) == 2.0
    with pytest.raises(ValueError, match="baseTimeNanoseconds"):
        profiler_offset_us(trace, {})
    # the checker does catch what Perfetto would not load
    bad = {
        "traceEvents": [
            {"name": "x", "ph": "X", "pid": 0, "tid": 0, "ts": float("nan")},
            {"name": "y", "ph": "Q", "pid": "p", "tid": 0, "ts": 1},
        ]
    }
    assert len(check_chrome_trace(bad)) >= 4
