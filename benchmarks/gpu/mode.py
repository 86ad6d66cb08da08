"""GPU mode (``python benchmarks/run.py --gpu``): what one CUDA GPU can check of commfuse, in one command.

:func:`run_gpu_mode` runs, each part on its own so one failure keeps the others (its error and
traceback tail are recorded instead):

1. ``runtime``: commfuse's runtime on NCCL world size 1 (recorded collectives) and the stream
   program with events (:func:`benchmarks.gpu.checks.check_runtime`);
2. ``inductor_regions``: Inductor compiling commfuse's compute regions for CUDA;
3. ``dhelix``: DHelix's interleaved step with the forward strand on a second compute stream;
4. ``calibration``: the compute model's predictions against measured kernel times of an 8B-class
   layer in bf16 (:mod:`benchmarks.gpu.kernels`), the compute model fitted to them and the fit
   checked on a held-out sequence length.

It writes ``gpu-<date>.json`` and ``gpu-<date>.md`` into the output directory after every part
(an interrupted run keeps what it measured), and once the calibration has run,
``gpu-profile-<date>.json``: a cost profile (``Config(cost_profile=...)``) whose compute model is
the fit; its collective model stays nominal, since one GPU measures no collective between ranks. :func:`assemble` and :func:`markdown` are pure, so
the report is tested on CPU from synthetic parts. The process group is one rank (NCCL on CUDA,
gloo for a CPU smoke run of the same code) over a file store in a temporary directory.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

RESULTS = Path(__file__).resolve().parents[1] / "results"
PARTS = ("runtime", "inductor_regions", "dhelix", "calibration")
NO_CUDA = "--gpu: no CUDA device"


def environment(device: str) -> dict[str, Any]:
    """Date, versions and the device, as this report records them."""
    import torch

    import commfuse

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    except (AttributeError, RuntimeError, TypeError):  # a torch built without NCCL, or an int version
        nccl = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "device_kind": "cuda" if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "commfuse": commfuse.__version__,
    }


def run_part(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` with its wall time; an exception becomes ``ok: False`` with the error and traceback tail."""
    t = time.perf_counter()
    try:
        out = dict(fn())
        out.setdefault("ok", True)
        out.setdefault("error", None)
    except Exception as e:  # noqa: BLE001 - one failing part must not lose the others
        out = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc()[-3000:],
        }
    out["wall_s"] = round(time.perf_counter() - t, 2)
    return out


def assemble(
    env: dict[str, Any],
    parts: dict[str, dict[str, Any]],
    *,
    command: str,
    wheels: Optional[dict[str, Any]] = None,
    wall_s: Optional[float] = None,
) -> dict[str, Any]:
    """The JSON document of one run."""
    return {
        "mode": "gpu",
        "command": command,
        "environment": env,
        "wheels": wheels,
        "parts": parts,
        "ok": bool(parts) and all(p.get("ok") for p in parts.values()),
        "wall_s": wall_s,
    }


def _num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 10**-digits or x == 0 else f"{x:.2g}"
    return str(x)


def _check_line(name: str, p: dict[str, Any]) -> str:
    what = []
    for key in (
        "plans",
        "recorded",
        "regions_compiled",
        "fallbacks",
        "partitions",
        "kept",
        "max_abs_diff",
        "loss_abs_diff",
        "grad_max_abs_diff",
    ):
        if key not in p:
            continue
        v = p[key]
        if key == "plans":
            v = "; ".join(
                f"{q['graph']}: {q['collectives']} coll., {q['streams']} streams, {q['events']} events"
                for q in v
            )
        elif key == "recorded":
            v = f"{v['collectives']} collectives ({v['completed_by_work_callback']} by work callback)"
        elif key == "fallbacks":
            v = len(v)
        what.append(f"{key}: {_num(v, 3) if isinstance(v, float) else v}")
    if isinstance(p.get("overall"), dict):
        o = p["overall"]
        what.append(
            f"{o['timed']} of {o['count']} ops timed, measured / predicted {_num(o['ratio'], 2)} overall"
        )
    if "streams" in p and isinstance(p["streams"], dict):
        s = p["streams"]
        ops = ", ".join(f"{k} {n}" for k, n in sorted(s.get("stream_ops", {}).items())) or "none applied"
        what.append(
            f"stream program: {s['plan']['events']} events, ops {ops}, diff {_num(s['max_abs_diff'], 3)}"
        )
    if p.get("error"):
        what.append(f"error: {p['error'].splitlines()[0][:300]}")
    detail = "; ".join(what).replace("|", "/")
    return f"| {name} | {'yes' if p.get('ok') else 'NO'} | {_num(p.get('wall_s'))} | {detail} |"


def _family_rows(title: str, table: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        f"| {title} | ops (timed) | predicted us | measured us | measured / predicted | median op ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in table.items():
        lines.append(
            f"| {name} | {s['count']} ({s['timed']}) | {_num(s['predicted_us'])} | {_num(s['measured_us'])} "
            f"| {_num(s['ratio'], 2)} | {_num(s['median_op_ratio'], 2)} |"
        )
    return lines


def _calibration_lines(c: dict[str, Any]) -> list[str]:
    layer, dev = c["layer"], c["device_model"]
    lines = [
        "",
        "## Compute model vs measured kernel times",
        "",
        f"One transformer layer, dim {layer['dim']}, {layer['n_heads']} heads ({layer['kv_heads']} KV), "
        f"SwiGLU {layer['ffn_dim']}, batch {layer['batch']} x {layer['seq']} tokens, {layer['dtype']}; "
        f"forward and backward ATen graphs (AOTAutograd); each compute node timed alone ({c.get('timer')}); "
        f"predicted by the `{c['preset']}` preset ({dev['device']}: "
        f"{dev['peak_tflops_bf16']} TFLOP/s bf16, {dev['memory_bandwidth_GBps']} GB/s).",
    ]
    if c.get("note"):
        lines.append(f"Note: {c['note']}.")
    lines += [
        "",
        *_family_rows("op family", c["families"]),
        "",
        *_family_rows("graph", {**c["graphs"], "overall": c["overall"]}),
        "",
    ]
    whole = c.get("whole_graph_measured_us") or {}
    if whole:
        lines.append(
            "Whole graphs run at once (measured us): "
            + ", ".join(f"{k} {_num(v) if isinstance(v, float) else v}" for k, v in whole.items())
            + "."
        )
    top = c.get("top_ops") or []
    if top:
        lines += [
            "",
            "| largest ops | op | family | bound | predicted us | measured us |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {t['graph']}/{t['node']} | {t['op']} | {t['family']} | {t['bound']} | "
            f"{_num(t['predicted_us'])} | {_num(t['measured_us'])} |"
            for t in top
        ]
    if c.get("errors"):
        lines += ["", f"{len(c['errors'])} node(s) could not be timed alone: " + "; ".join(c["errors"][:10])]
    return lines


def markdown(doc: dict[str, Any]) -> str:
    """The Markdown report of :func:`assemble`'s document."""
    env = doc["environment"]
    lines = [
        f"# GPU mode, {env['date'][:10]}",
        "",
        f"`{doc['command']}` on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, "
        f"Python {env['python']}, commfuse {env['commfuse']}); wall {_num(doc.get('wall_s'))} s.",
        "",
    ]
    if doc.get("wheels"):
        lines += [f"Carried wheels unpacked for {', '.join(doc['wheels']['missing'])}.", ""]
    lines += ["| part | ok | wall s | what ran |", "|---|---|---|---|"]
    lines += [_check_line(name, p) for name, p in doc["parts"].items()]
    cal = doc["parts"].get("calibration")
    if cal and cal.get("families"):
        lines += _calibration_lines(cal)
    if cal and cal.get("holdout"):
        lines += _holdout_lines(cal)
    return "\n".join(lines) + "\n"


def _holdout_lines(c: dict[str, Any]) -> list[str]:
    h = c["holdout"]
    lines = [
        "",
        "## The fitted compute model on a held-out size",
        "",
        f"Fitted per op family to the times above (`a + b x FLOPs` for matmul and attention, `x bytes` "
        f"otherwise; written as `gpu-profile-<date>.json`), then checked on the same layer at "
        f"{h['seq']} tokens, captured and timed anew.",
        "",
        "| op family | measured us | nominal predicted us | nominal measured / predicted "
        "| fitted predicted us | fitted measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    nominal, fitted = h["nominal"], h["fitted"]
    for name in [*nominal["families"], "overall"]:
        n = nominal["overall"] if name == "overall" else nominal["families"][name]
        f = fitted["overall"] if name == "overall" else fitted["families"].get(name, {})
        lines.append(
            f"| {name} | {_num(n['measured_us'])} | {_num(n['predicted_us'])} | {_num(n['ratio'], 2)} "
            f"| {_num(f.get('predicted_us'))} | {_num(f.get('ratio'), 2)} |"
        )
    return lines


def cost_profile(doc: dict[str, Any]):
    """The cost profile of a run whose calibration part ran: the preset's topology, NCCL, the fitted
    compute model (None when the calibration did not run or failed)."""
    cal = doc["parts"].get("calibration") or {}
    if not cal.get("ok") or not cal.get("fitted_compute"):
        return None
    from commfuse.costmodel.compute import ComputeParams
    from commfuse.costmodel.profile import CostProfile, Provenance

    env = doc["environment"]
    notes = (
        f"benchmarks/run.py --gpu on {env['device']} (torch {env['torch']}): compute model fitted to "
        f"{cal['overall']['timed']} ATen ops of one {cal['layer']['dim']}-dim layer at {cal['layer']['seq']} "
        f"tokens, {cal['layer']['dtype']}; collective model nominal (not measured)"
    )
    return CostProfile(
        topology=cal["preset"],
        backend="nccl",
        compute=ComputeParams.model_validate(cal["fitted_compute"]),
        provenance=Provenance(
            machine=env["device"],
            date=env["date"],
            torch_version=env["torch"],
            commfuse_version=env["commfuse"],
            notes=notes,
        ),
    )


def write(doc: dict[str, Any], out_dir: Path, json_path: Optional[Path] = None) -> list[Path]:
    """``gpu-<date>.json`` and ``.md`` into ``out_dir`` (and the JSON also to ``json_path``), and
    ``gpu-profile-<date>.json`` once the calibration has run."""
    date = doc["environment"]["date"][:10]
    paths = [out_dir / f"gpu-{date}.json", out_dir / f"gpu-{date}.md"] + ([json_path] if json_path else [])
    texts = [json.dumps(doc, indent=1, default=str), markdown(doc)] + (
        [json.dumps(doc, indent=1, default=str)] if json_path else []
    )
    profile = cost_profile(doc)
    if profile is not None:
        paths.append(out_dir / f"gpu-profile-{date}.json")
        texts.append(profile.model_dump_json(indent=2) + "\n")
    for path, text in zip(paths, texts, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return paths


def _process_group(device: str) -> Callable[[], None]:
    """One-rank process group (NCCL on CUDA, else gloo) over a file store; returns its teardown."""
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(0)
    store = tempfile.mkdtemp(prefix="commfuse-gpu-pg-")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}/store", rank=0, world_size=1
    )

    def teardown() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    return teardown


def run_gpu_mode(
    out_dir: Path = RESULTS,
    *,
    device: str = "cuda",
    parts: tuple[str, ...] = PARTS,
    seq: int = 4096,
    layer_sizes: Optional[dict[str, int]] = None,
    command: Optional[str] = None,
    json_path: Optional[Path] = None,
    wheels: Optional[dict[str, Any]] = None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the GPU mode's ``parts`` (see the module docstring) and write the report; returns its document.

    ``device="cpu"`` runs the same code on gloo (a smoke run: no streams applied, host-clock timings)."""
    import torch

    from benchmarks.gpu import checks, kernels

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown GPU-mode parts {unknown}; known: {list(PARTS)}")
    t0 = time.perf_counter()
    env = environment(device)
    command = command or " ".join(["python"] + sys.argv)
    results: dict[str, dict[str, Any]] = {}
    doc = assemble(env, results, command=command, wheels=wheels)
    teardown = _process_group(device) if set(parts) & set(checks.CHECKS) else (lambda: None)
    try:
        for name in parts:
            log(f"gpu mode: {name} ...")
            torch._dynamo.reset()
            if name == "calibration":
                results[name] = run_part(
                    lambda: kernels.calibrate_layer(env["device"], seq=seq, device=device, sizes=layer_sizes)
                )
            else:
                results[name] = run_part(lambda: checks.CHECKS[name](device))  # noqa: B023 - run_part runs it now
            log(
                f"gpu mode: {name}: {'ok' if results[name]['ok'] else 'FAILED'} in {results[name]['wall_s']} s"
                + (f" ({results[name]['error'].splitlines()[0][:200]})" if results[name].get("error") else "")
            )
            doc = assemble(env, results, command=command, wheels=wheels, wall_s=time.perf_counter() - t0)
            write(doc, out_dir, json_path)
    finally:
        teardown()
    return doc


def gpu_main(
    json_path: Optional[Path],
    refuse: Callable[[str], Any],
    *,
    out_dir: Path = RESULTS,
    wheels: Optional[dict[str, Any]] = None,
) -> int:
    """``run.py --gpu``: ``refuse(NO_CUDA)`` without CUDA (argparse's error: exit 2), else run, print the
    Markdown and return 1 when a part failed."""
    import torch

    if not torch.cuda.is_available():
        refuse(NO_CUDA)
        return 2
    doc = run_gpu_mode(out_dir, json_path=json_path, wheels=wheels)
    print(markdown(doc))
    return 0 if doc["ok"] else 1


__all__ = [
    "NO_CUDA",
    "PARTS",
    "RESULTS",
    "assemble",
    "cost_profile",
    "environment",
    "gpu_main",
    "markdown",
    "run_gpu_mode",
    "run_part",
    "write",
]
