"""DHelix overlap profiling: Eq. 1 measured on gloo ranks, file format, fallback."""

from __future__ import annotations

import dataclasses
import json

import pytest

from commfuse.dhelix.overlap import OEFTable, default_oef, pair_time
from commfuse.dhelix.profile import (
    COMM_KINDS,
    COMPUTE_KINDS,
    SCHEMA_VERSION,
    OEFEntry,
    OEFProfile,
    overlap_effectiveness,
    load_oef_profile,
    oef_for,
    oef_table,
    read_oef_profile,
    save_oef_profile,
)
from commfuse.core.errors import ConfigError

import _jobs_dhelix_profile as jobs


def _profile(entries, scope="local") -> OEFProfile:
    return OEFProfile(
        SCHEMA_VERSION,
        {"hostname": "h"},
        "2026-11-25T00:00:00+00:00",
        2,
        "gloo",
        scope,
        3,
        (4096,),
        tuple(entries),
    )


def _entry(a, b, oef, size=4096):
    return OEFEntry(a, b, size, 100.0, 50.0, 150.0 - oef * 50.0, oef)


@pytest.mark.multirank
def test_measured_table_identical_on_every_rank_and_sane(rank_pool_2):
    got = rank_pool_2.run(jobs.tiny_profile, timeout=120)
    assert got[0] == dataclasses.replace(got[1], machine=got[0].machine, date=got[0].date)
    p = got[0]
    assert p.world_size == 2 and p.backend == "gloo"
    pairs = {(e.a, e.b) for e in p.entries}
    assert len(pairs) == len(COMPUTE_KINDS) * len(COMM_KINDS) + len(COMM_KINDS) * (len(COMM_KINDS) + 1) // 2
    for e in p.entries:
        assert e.t_a_us > 0 and e.t_b_us > 0 and e.t_ab_us > 0
        assert e.oef == pytest.approx(overlap_effectiveness(e.t_a_us, e.t_b_us, e.t_ab_us))
        # no bounds on the times themselves: on a shared machine load comes and goes between the
        # solo and co-run timings (timing numbers are the profile's output, not test assertions)
    table = oef_table(p)
    for _pair, v in table.factors:
        assert 0.0 <= v <= 1.0


def test_eq1_inverts_pair_time():
    t = OEFTable.from_mapping(
        {
            (a, b): 0.6
            for a in ("compute", "comm_local", "comm_cross")
            for b in ("compute", "comm_local", "comm_cross")
        }
    )
    p = pair_time("compute", 80.0, "comm_local", 30.0, t)
    assert overlap_effectiveness(80.0, 30.0, p) == pytest.approx(0.6)


def test_save_load_round_trip(tmp_path):
    p = _profile(
        [
            _entry("matmul", "all_gather", 0.7),
            _entry("elementwise", "all_gather", 0.3),
            _entry("all_reduce", "all_to_all", -0.4),
            _entry("all_reduce", "all_reduce", 1.2),
        ]
    )
    f = tmp_path / "oef.json"
    save_oef_profile(str(f), p)
    q = read_oef_profile(str(f))
    assert q == p
    t = load_oef_profile(str(f))
    assert t("compute", "comm_local") == pytest.approx(0.5)  # median of 0.7 and 0.3
    assert t("comm_local", "comm_local") == pytest.approx(0.5)  # median of clamp(-0.4)=0, clamp(1.2)=1
    assert t("compute", "compute") == default_oef()("compute", "compute")  # never measured
    assert t("comm_cross", "compute") == default_oef()("compute", "comm_cross")  # other scope


def test_oef_for_measured_clamped_and_fallback():
    p = _profile(
        [
            _entry("matmul", "all_gather", 0.7),
            _entry("all_to_all", "all_reduce", -0.4),
            _entry("matmul", "reduce_scatter", 0.2, size=10),
            _entry("matmul", "reduce_scatter", 0.8, size=1000),
        ]
    )
    assert oef_for("all_gather", "matmul", p) == pytest.approx(0.7)  # either order
    assert oef_for("all_reduce", "all_to_all", p) == 0.0  # negative gain planned as no gain
    assert oef_for("matmul", "reduce_scatter", p) == pytest.approx(0.5)  # median over sizes
    assert oef_for("matmul", "reduce_scatter", p, size=900) == pytest.approx(0.8)  # nearest size
    assert oef_for("elementwise", "all_gather", p) == default_oef()("compute", "comm_local")
    custom = OEFTable.from_mapping(
        {
            (a, b): 0.25
            for a in ("compute", "comm_local", "comm_cross")
            for b in ("compute", "comm_local", "comm_cross")
        }
    )
    assert oef_for("elementwise", "all_gather", p, fallback=custom) == 0.25
    assert oef_for("matmul", "all_gather", None) == default_oef()("compute", "comm_local")
    assert oef_for("matmul", "all_gather", _profile([], scope="cross")) == default_oef()(
        "compute", "comm_cross"
    )
    with pytest.raises(ConfigError, match="'gemm'"):
        oef_for("gemm", "all_gather", p)


def _write(tmp_path, d):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    return str(f)


def _good():
    d = dataclasses.asdict(_profile([_entry("matmul", "all_gather", 0.7)]))
    d["sizes"] = list(d["sizes"])
    d["entries"] = [dict(e) for e in d["entries"]]
    return d


@pytest.mark.parametrize(
    "field",
    [
        "schema_version",
        "machine",
        "date",
        "world_size",
        "backend",
        "comm_scope",
        "repeats",
        "sizes",
        "entries",
    ],
)
def test_missing_field_named(tmp_path, field):
    d = _good()
    del d[field]
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        read_oef_profile(_write(tmp_path, d))


def test_bad_files_name_field_or_path(tmp_path):
    d = _good()
    d["schema_version"] = 99
    with pytest.raises(ConfigError, match="'schema_version' is 99"):
        read_oef_profile(_write(tmp_path, d))
    d = _good()
    del d["entries"][0]["t_ab_us"]
    with pytest.raises(ConfigError, match=r"entries\[0\]: missing field 't_ab_us'"):
        read_oef_profile(_write(tmp_path, d))
    d = _good()
    d["entries"][0]["a"] = "gemm"
    with pytest.raises(ConfigError, match=r"entries\[0\]: field 'a'"):
        read_oef_profile(_write(tmp_path, d))
    d = _good()
    d["world_size"] = "2"
    with pytest.raises(ConfigError, match="field 'world_size' must be int"):
        read_oef_profile(_write(tmp_path, d))
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="nope.json.*cannot read"):
        load_oef_profile(missing)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match="junk.json.*not valid JSON"):
        read_oef_profile(str(tmp_path / "junk.json"))
