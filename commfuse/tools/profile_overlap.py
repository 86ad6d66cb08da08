"""``python -m commfuse profile-overlap``: measure DHelix's overlap factors (Eq. 1) on gloo ranks here
and write the profile ``Config.dhelix_oef_profile`` reads (:mod:`commfuse.dhelix.profile`)."""

from __future__ import annotations

import argparse

from commfuse.core.errors import ConfigError
from commfuse.dhelix.profile import DEFAULT_SIZES, OP_KINDS, measure_oef, oef_table, save_oef_profile
from commfuse.tools.rank_pool import get_pool


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``python -m commfuse profile-overlap -o FILE [--sizes N ...] [--world-size W] [--repeats R]``."""
    p.add_argument("-o", "--output", required=True, help="profile JSON file to write (required)")
    p.add_argument(
        "--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="float32 elements per operand"
    )
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (processes) to measure on")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per pair and size")


def run(a: argparse.Namespace) -> int:
    if a.world_size < 2 or a.repeats < 1 or min(a.sizes) < 1:
        raise ConfigError("--world-size must be >= 2, --repeats >= 1, --sizes >= 1")

    prof = get_pool(a.world_size).run(measure_oef, OP_KINDS, list(a.sizes), a.repeats, timeout=1800)[0]
    save_oef_profile(a.output, prof)
    table = oef_table(prof)
    print(f"wrote {a.output}: {len(prof.entries)} pairs x sizes on {a.world_size} {prof.backend} ranks")
    for e in prof.entries:
        print(
            f"  {e.a:>14} x {e.b:<14} n={e.size:<8} T_a={e.t_a_us:9.1f}us T_b={e.t_b_us:9.1f}us "
            f"P={e.t_ab_us:9.1f}us OEF={e.oef:+.2f}"
        )
    print("segment-kind table:", {f"{a}x{b}": v for (a, b), v in table.factors})
    return 0


__all__ = ["add_arguments", "run"]
