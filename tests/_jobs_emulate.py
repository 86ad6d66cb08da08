"""Rank jobs for tests/test_emulate.py: run by a rank pool started beside an emulated network."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def where_am_i() -> dict:
    """This rank's links, its gloo interface and an all_reduce's result."""
    t = torch.full((1 << 16,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    n = dist.get_world_size()
    return {
        "ifs": sorted(i for _, i in socket.if_nameindex()),
        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
        "cores": sorted(os.sched_getaffinity(0)),
        "sum_ok": bool(torch.all(t == n * (n + 1) / 2)),
    }


if __name__ == "__main__":  # run once beside the namespaces: a pool of the emulated size
    import json
    import sys

    from commfuse.tools.rank_pool import RankPool

    with RankPool(int(sys.argv[1])) as pool:
        print("POOL", json.dumps(pool.run(where_am_i)), flush=True)
