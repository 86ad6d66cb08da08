"""commfuse's collective model next to Inductor's NCCL estimator (DGX-H100).

    python benchmarks/inductor_estimator.py [--markdown] [--sizes 1K,1M,1G] [--inter-node-GBps 5]

For all_reduce / all_gather / reduce_scatter at 8 ranks (one DGX-H100 node) and
16 ranks (two nodes), message sizes 1 KiB ... 1 GiB (nccl-tests convention: AR
buffer, AG total output, RS total input; fp32), prints

* commfuse: `AnalyticCostModel(Topology.preset("dgx-h100", num_nodes=...))`
  on the `Collective` commfuse's IR builds for the traced node;
* inductor-fx: `torch._inductor.comm_analysis.estimate_nccl_collective_runtime_from_fx_node`
  on the same FX node (what Inductor's FX-level overlap scheduler uses; its
  size is input + output bytes, see docs/costmodel.md);
* inductor@S: `estimate_nccl_collective_runtime_impl` called with the
  nccl-tests size, i.e. Inductor's *model* without its size convention.

Rows where commfuse and inductor-fx differ by more than 2x are marked `*`
(`!` when inductor@S differs too). Graphs are traced with `make_fx` under the
fake process group, on meta tensors (nothing is allocated or sent).

Patched inside this script only (documented here because they change what
Inductor sees): `comm_analysis.get_gpu_type` is made to return HOPPER. On a
machine without CUDA it falls back to nvidia-smi string matching and then to
AMPERE, which would compare an A100 model with our H100 preset. Everything else
Inductor looks up already behaves as on an 8-GPU NVLink node when CUDA is absent
(`gpus_per_node` = 8, `_has_nvlink()` = True); `torch._inductor.config.intra_node_bw`
/ `inter_node_bw` are left unset (auto-detection).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
import torch._inductor.comm_analysis as ca  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from commfuse.costmodel import AnalyticCostModel, Topology  # noqa: E402
from commfuse.ir import CollectiveIR  # noqa: E402
from commfuse.testing.fake_pg import fake_process_group  # noqa: E402

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_COLL = {
    "all_reduce": ca.NCCL_COLL.ALL_REDUCE,
    "all_gather": ca.NCCL_COLL.ALL_GATHER,
    "reduce_scatter": ca.NCCL_COLL.REDUCE_SCATTER,
}
DEFAULT_SIZES = [1 << s for s in range(10, 31, 2)]  # 1 KiB, 4 KiB, ..., 1 GiB


def _patch_inductor_for_cpu() -> None:
    ca.get_gpu_type = lambda: ca.NVIDIA_GPU_TYPE.HOPPER  # see module docstring
    torch._inductor.config.intra_node_bw = None
    torch._inductor.config.inter_node_bw = None


def _trace(kind: str, size: int, n: int):
    g = dist.group.WORLD
    elt = 4  # fp32
    if kind == "all_reduce":
        fn, numel = (lambda x: funcol.all_reduce(x, "sum", g)), size // elt
    elif kind == "all_gather":
        fn, numel = (lambda x: funcol.all_gather_single(x, 0, g)), size // elt // n
    else:
        fn, numel = (lambda x: funcol.reduce_scatter_single(x, "sum", 0, g)), size // elt
    gm = make_fx(fn, tracing_mode="fake")(torch.empty(numel, device="meta"))
    ir = CollectiveIR(gm)
    (c,) = ir.collectives
    return c


def _fmt_size(b: int) -> str:
    for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << s:
            return f"{b / (1 << s):g} {unit}"
    return f"{b} B"


def rows(sizes: list[int], inter_node_GBps: float | None = None) -> list[dict]:
    _patch_inductor_for_cpu()
    out = []
    for nodes, n in ((1, 8), (2, 16)):
        topo = Topology.preset("dgx-h100", num_nodes=nodes)
        if inter_node_GBps is not None:
            topo = Topology.model_validate(
                {**topo.model_dump(), "inter_node_bandwidth_GBps": inter_node_GBps}
            )
        model = AnalyticCostModel(topo, backend="nccl")
        with fake_process_group(n):
            for kind in KINDS:
                for size in sizes:
                    c = _trace(kind, size, n)
                    est = model.collective(c)
                    ind_fx_us = ca.estimate_nccl_collective_runtime_from_fx_node(c.start) * 1e3
                    ind_s_us = ca.estimate_nccl_collective_runtime_impl(size, n, _COLL[kind]) * 1e3
                    _, algo, proto = ca._nccl_best_algo_time(size, n, _COLL[kind])
                    out.append(
                        dict(
                            kind=kind,
                            ranks=n,
                            size=size,
                            commfuse_us=est.time_us,
                            algorithm=est.algorithm,
                            inductor_fx_us=ind_fx_us,
                            inductor_size_us=ind_s_us,
                            inductor_algo=f"{ca.NCCL_ALGO(algo).name.lower()}/"
                            f"{ca.NCCL_PROTO(proto).name.lower()}",
                            fx_size=ca.estimate_fx_collective_size(c.start),
                        )
                    )
    return out


def table(rs: list[dict], markdown: bool = False) -> str:
    head = [
        "kind",
        "ranks",
        "size",
        "commfuse us",
        "algo",
        "inductor-fx us",
        "fx/cf",
        "inductor@S us",
        "@S/cf",
        "ind algo@S",
        "",
    ]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append(
            f"{head[0]:<15}{head[1]:>5} {head[2]:>9} {head[3]:>12} {head[4]:<13}{head[5]:>15}{head[6]:>7}"
            f"{head[7]:>15}{head[8]:>7}  {head[9]:<13}"
        )
    n_flag = 0
    for r in rs:
        fx_ratio = r["inductor_fx_us"] / r["commfuse_us"]
        s_ratio = r["inductor_size_us"] / r["commfuse_us"]
        far = lambda x: x > 2 or x < 0.5  # noqa: E731
        mark = ("*" if far(fx_ratio) else "") + ("!" if far(s_ratio) else "")
        n_flag += bool(mark)
        cells = [
            r["kind"],
            str(r["ranks"]),
            _fmt_size(r["size"]),
            f"{r['commfuse_us']:.1f}",
            r["algorithm"],
            f"{r['inductor_fx_us']:.1f}",
            f"{fx_ratio:.2f}",
            f"{r['inductor_size_us']:.1f}",
            f"{s_ratio:.2f}",
            r["inductor_algo"],
            mark,
        ]
        if markdown:
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append(
                f"{cells[0]:<15}{cells[1]:>5} {cells[2]:>9} {cells[3]:>12} {cells[4]:<13}{cells[5]:>15}"
                f"{cells[6]:>7}{cells[7]:>15}{cells[8]:>7}  {cells[9]:<13}{cells[10]}"
            )
    lines.append("")
    lines.append(
        f"{n_flag} of {len(rs)} rows differ by more than 2x (* inductor-fx, ! inductor@S); "
        "explanations in docs/costmodel.md, 'Comparison with Inductor'."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 1K,64M,1G")
    ap.add_argument(
        "--inter-node-GBps",
        type=float,
        default=None,
        help="override commfuse's per-rank inter-node bandwidth (e.g. 5.0 = Inductor's single-NIC "
        "40 GB/s per node spread over 8 ranks)",
    )
    a = ap.parse_args(argv)
    sizes = DEFAULT_SIZES
    if a.sizes:
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes = [
            int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s) for s in a.sizes.split(",")
        ]
    print(table(rows(sizes, a.inter_node_GBps), markdown=a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
