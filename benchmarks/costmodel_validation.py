"""Predicted vs measured: the cost model against this machine.

    python benchmarks/costmodel_validation.py [--profile P.json] [--json out.json]

1. Calibrates (``commfuse calibrate``'s sweep) unless ``--profile`` is given.
2. Collectives: measures every kind at sizes *between* the calibration sizes (2 ranks,
   gloo, one thread each, fresh runs) and prints measured median / IQR next to the
   profile's prediction and the error.
3. Full training steps: for each example workload (size ``s``, 2 ranks), compiles the
   model with an AOTAutograd backend that runs the forward and backward graphs as they
   are (the graphs commfuse's passes see, default partition), times forward + loss +
   backward, and predicts the step with :func:`commfuse.costmodel.step.predict_step`:
   the same two graphs simulated with the profile's model (collectives priced as inside
   a graph) plus the profile's step runtime (fixed + per plain / DTensor parameter, the
   model's parameter counts). Prints measured median / IQR, predicted, error.

Median absolute errors (and their IQR over the points) are printed at the end: the
targets are <= 20% for collectives and <= 25% for full steps. Nothing here feeds the
profile: calibration measures synthetic programs only (``commfuse.tools.calibrate``). Numbers are only meaningful on a quiet machine: the
script prints the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS = ("llama_tp_sp:s", "llama_tp:s", "moe_ep:s", "simple_fsdp:s", "dp:s")
VALIDATION_SIZES = tuple(2 * 4**i * 1024 for i in range(0, 7))  # 2 KiB .. 8 MiB, between calibration sizes


def _iqr(xs):
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def step_job(workload: str, profile_json: str, warmup: int, steps: int) -> dict:
    """Rank job: measured step times and the simulated prediction for one workload."""
    import torch
    import torch.distributed as dist
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from benchmarks.workloads import get_workload
    from commfuse.costmodel.profile import CostProfile
    from commfuse.costmodel.step import predict_step

    torch.set_num_threads(1)
    torch._dynamo.reset()
    built = get_workload(workload).build(dist.get_world_size(), dist.get_rank())
    graphs = {}

    def recorder(kind):
        def compiler(gm, _inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    be = aot_autograd(
        fw_compiler=recorder("forward"),
        bw_compiler=recorder("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    model = torch.compile(built.model, backend=be)

    def step():
        for p in built.model.parameters():
            p.grad = None
        built.loss(model(*built.inputs)).backward()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    from torch.distributed.tensor import DTensor

    params = [p for p in built.model.parameters() if p.requires_grad]
    dtensor = sum(1 for p in params if isinstance(p, DTensor))
    est = CostProfile.model_validate_json(profile_json).build_model()
    pred = predict_step(
        graphs, est, params=len(params) - dtensor, dtensor_params=dtensor, slowdown=est.slowdown
    )
    return {"times_us": times, "predicted_us": pred.total_us, "prediction": pred.summary()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="use this profile instead of calibrating")
    ap.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from commfuse.tools.calibrate import COLLECTIVE_KINDS, calibrate, measure_collectives_job, merge_ranks
    from commfuse.costmodel.profile import CostProfile
    from commfuse.tools.rank_pool import get_pool

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if a.profile:
        profile = CostProfile.load(a.profile)
    else:
        profile = calibrate(2, reps=a.reps).profile
        if a.save_profile:
            profile.save(a.save_profile)
    model = profile.build_model()
    pool = get_pool(2)
    out = {"collectives": [], "steps": [], "provenance": profile.provenance.model_dump()}

    samples = merge_ranks(
        pool.run(
            measure_collectives_job,
            [k.value for k in COLLECTIVE_KINDS],
            list(VALIDATION_SIZES),
            3,
            a.reps,
            timeout=900,
        )
    )
    print(f"\n{'kind':<16}{'bytes':>10}{'measured us':>14}{'IQR':>9}{'predicted':>12}{'error':>9}")
    errs = []
    for s in samples:
        pred = model.collectives.time(s.key, int(s.x), 2).time_us
        err = (pred - s.median) / s.median
        errs.append(abs(err))
        out["collectives"].append(
            {
                "kind": s.key,
                "bytes": int(s.x),
                "median_us": s.median,
                "iqr_us": s.iqr,
                "predicted_us": pred,
                "error": err,
            }
        )
        print(f"{s.key:<16}{int(s.x):>10}{s.median:>14.1f}{s.iqr:>9.1f}{pred:>12.1f}{err:>+9.1%}")
    coll_err = statistics.median(errs)

    print(f"\n{'workload':<16}{'measured ms':>13}{'IQR':>8}{'predicted':>11}{'error':>9}")
    step_errs = []
    for w in WORKLOADS:
        res = pool.run(step_job, w, profile.model_dump_json(), 3, a.steps, timeout=900)
        times = [max(ts) for ts in zip(*(r["times_us"] for r in res), strict=True)]
        med, pred = statistics.median(times), res[0]["predicted_us"]
        err = (pred - med) / med
        step_errs.append(abs(err))
        p = res[0]["prediction"]
        out["steps"].append(
            {
                "workload": w,
                "median_us": med,
                "iqr_us": _iqr(times),
                "predicted_us": pred,
                "error": err,
                "prediction": p,
                "times_us": times,
            }
        )
        g = p["graphs"]
        comm = sum(x["exposed_comm_us"] for x in g.values())
        print(
            f"{w:<16}{med / 1e3:>13.2f}{_iqr(times) / 1e3:>8.2f}{pred / 1e3:>11.2f}{err:>+9.1%}"
            f"   (graphs {p['graphs_us'] / 1e3:.2f}: compute {sum(x['compute_us'] for x in g.values()) / 1e3:.2f}"
            f" + exposed comm {comm / 1e3:.2f}; runtime {p['runtime_us'] / 1e3:.2f} for "
            f"{p['params']} + {p['dtensor_params']} DTensor params)"
        )
    step_err = statistics.median(step_errs)
    print(
        f"\nmedian |error|: collectives {coll_err:.1%} (IQR {_iqr(errs):.1%}, target <= 20%), "
        f"full steps {step_err:.1%} (IQR {_iqr(step_errs):.1%}, target <= 25%)"
    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    out.update(
        collective_median_abs_error=coll_err,
        collective_abs_error_iqr=_iqr(errs),
        step_median_abs_error=step_err,
        step_abs_error_iqr=_iqr(step_errs),
        profile=profile.model_dump(mode="json"),
    )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
