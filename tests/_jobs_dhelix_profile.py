"""Rank-pool jobs for the DHelix overlap-profiling tests (module-level so the pool can pickle them)."""

from __future__ import annotations

from commfuse.dhelix.profile import measure_oef


def tiny_profile():
    """A small measurement (one size, 3 repeats) on every rank of the pool."""
    return measure_oef(sizes=[4096], repeats=3)
