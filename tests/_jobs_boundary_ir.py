"""Rank-pool jobs for tests/test_boundary_ir.py (module-level so the pool can pickle them)."""

from __future__ import annotations

from typing import Any


def boundary_cases_on_gloo(seed: int = 0) -> dict[str, Any]:
    """Every case of ``crosscheck.BOUNDARY_CASES`` run eagerly on this gloo rank."""
    from commfuse.testing import crosscheck as cc

    return cc.gloo_job(sorted(cc.BOUNDARY_CASES), seed)
