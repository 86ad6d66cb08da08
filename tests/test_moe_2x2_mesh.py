"""Hybrid meshes: MoE decoder blocks written the torchtitan way
(:mod:`commfuse.models.moe_styles`, GShard capacity and dropless token choice) on 4 gloo ranks as
a 2 x 2 DeviceMesh ``("ep", "tp")``: attention TP (or SP) on the ``tp`` dim (ranks {0, 1},
{2, 3}), the experts split over the ``ep`` dim (ranks {0, 2}, {1, 3}). Compiled with the default
pipeline (eager inner compiler), two SGD steps against eager; the bytes the runtime recorder saw
each rank send checked against the shapes.

Cross-group fusion (fuse_collectives' ``m2ms_ag_a2a`` / ``m2ms_a2a_rs`` / ``plane_*`` rows) does
not fire on these blocks, and fuse_collectives has no cross-group pair to refuse: its rows need
the exchange to read the gather's output directly (through views), and here the router and the
dispatch sit between them.

* Default pipeline: ``moe_recognition`` turns each layer into one ``commfuse::moe_layer`` op, so
  the expert exchange is inside that op, not a collective of the graph. Under SP+EP+SP chimera's
  collective_motion runs the op on sequence shards (the gather gone; the EP group crosses TP as
  the other mesh dim, so each rank's EP peers hold the shards with its TP position) when the
  shard's smaller exchange outweighs the all-reduce of the expert gradients it makes partial:
  not at 4 tokens per sequence ("would ... all-reduce 6436 B to save ..."), at 64 (the last
  test, gate off). Under
  TP+EP chimera splits the TP all_reduces and moves the gathers, and the step-time gate reverts
  it at this size ("rewrite reverted: predicted ... with it vs ... without").
* Recognition off (the user's all_to_alls stay in the graph, on ``ep``): the TP gather cannot move
  down to the exchange: chimera's collective_motion says "no user computes independently along
  the gathered dim" (top-k / capacity slots / the sort by expert mix the tokens), so the
  all_gather(tp) + all_to_all(ep) pair that Chimera's Table 2 fuses into one many-to-many scatter
  ((N1·N2 - 1)/(N1·N2) of the gathered buffer instead of (N1-1)/N1 + (N2-1)/N2) never forms.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.slow(reason="compiles MoE decoder blocks on 4 gloo ranks and trains them against eager"),
]

FLOAT = 4
STYLES = ["gshard", "dropless"]
LAYOUTS = ["tp_ep", "sp_ep_sp"]


def _run(pool, style, layout, **config):
    import _jobs_moe_2x2_mesh as jobs

    results = pool.run(jobs.moe_block_on_2x2_mesh, style, layout, timeout=600, **config)
    # the same decisions and the same graphs (collectives per kind, wire bytes) on every rank
    same = [
        json.dumps(
            [r["counts"], {g: (d["before"], d["after"], d["wire"]) for g, d in r["graphs"].items()}],
            sort_keys=True,
            default=str,
        )
        for r in results
    ]
    assert len(set(same)) == 1, same
    for rank, r in enumerate(results):
        assert {"forward", "backward"} <= set(r["graphs"]), r["graphs"]
        for graph, d in r["graphs"].items():  # never more bytes per rank than the unfused graph
            before, after = d["wire"]
            if isinstance(before, int) and isinstance(after, int):
                assert after <= before, f"rank {rank}, {graph} graph: {before} -> {after} wire bytes"
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("style", STYLES)
def test_moe_block_with_tp_and_ep_on_separate_mesh_dims_trains_like_eager(rank_pool_4, style, layout):
    """The default pipeline: each layer recognised as one MoE op, its expert exchange on ``ep``
    inside the op (which announces its all_to_alls to the recorder); the TP collectives on ``tp``
    as the shapes say. x: [2, 4, 16] fp32 per TP group (512 B), a sequence shard [2, 2, 16]
    (256 B) under SP.

    tp_ep: forward, wo's all_reduce of x (512 B); backward, the all_reduces of the gradient of x
    for wq, wk, wv (3 x 512 B, bucketed into one [384]): 2048 B.
    sp_ep_sp: forward and backward each gather the shard twice (attention, MoE input: 2 x 256 B)
    and reduce_scatter wo's output [2, 4, 16] once, which gloo runs as an all_to_all of the whole
    512 B buffer: all_gather 1024 B, all_to_all 1024 B.

    The op's exchange on ``ep``, 8 tokens of 16 values, top-2, 4 experts: the rows out carry H
    (forward dispatch), 2H + 1 (backward: token, output gradient, gate), and back H (combine),
    H + 1 (input and gate gradients). GShard: static buffers of 4 experts x 16 slots
    (ceil(4.0 * 2 * 8 / 4)), so every rank hands c10d 64 x (16 + 16 + 33 + 17) x 4 = 20992 B.
    Dropless: the 16 kept rows out and a count per expert (4 int64) before each direction;
    the rows back are those this rank's experts received (the routing decides), which over the
    EP group are the rows sent: over the 4 ranks 4 x (2 x 32 + 16 x (16 + 33) x 4) +
    4 x 16 x (16 + 17) x 4 = 21248 B."""
    results = _run(rank_pool_4, style, layout)
    expected = (
        {"all_reduce@tp": 512 + 3 * 512}
        if layout == "tp_ep"
        else {"all_gather@tp": 4 * 256, "all_to_all@tp": 2 * 512}
    )
    for r in results:
        assert r["counts"].get(f"dynamo:moe_recognition.{style}_rewritten") == 1, r["counts"]
        sent = dict(r["recorded_sent"])
        exchange = sent.pop("all_to_all@ep")
        assert sent == expected, r["recorded_sent"]
        if style == "gshard":
            assert exchange == 4 * 16 * (16 + 16 + 33 + 17) * FLOAT, r["recorded_sent"]
    if style == "dropless":
        total = sum(r["recorded_sent"]["all_to_all@ep"] for r in results)
        assert total == 4 * (2 * 32 + 16 * (16 + 33) * FLOAT) + 4 * 16 * (16 + 17) * FLOAT, total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_gshard_exchange_on_the_ep_dim_next_to_tp_collectives_trains_like_eager(rank_pool_4, layout):
    """Recognition off: the user's equal-split all_to_alls stay in the graph, on the ``ep`` dim,
    beside the TP collectives on ``tp``. Each rank routes 8 tokens (the whole sequence of its TP
    group) to 4 experts of capacity ceil(4.0 · 2 · 8 / 4) = 16: the dispatch buffer is
    [4 · 16, 16] fp32 = 4096 B, exchanged twice forward (dispatch, combine) and twice backward,
    the whole buffer handed to c10d each time: 16384 B on ``ep``. Not fused with the TP gather
    (see the module docstring)."""
    results = _run(rank_pool_4, "gshard", layout, moe_recognition="off", step_time_gate=False)
    for r in results:
        assert r["recorded_sent"]["all_to_all@ep"] == 4 * (4 * 16) * 16 * FLOAT, r["recorded_sent"]
        kinds = {c[0] for d in r["graphs"].values() for c in d["collectives"]}
        assert "all_to_all" in kinds and ({"all_reduce", "all_gather"} & kinds), kinds


def test_moe_op_runs_on_sequence_shards_when_its_expert_group_is_the_other_mesh_dim(rank_pool_4):
    """SP+EP+SP, dropless, 64 tokens per sequence: chimera's collective_motion drops the gather
    in front of the MoE op, which runs on this rank's sequence shard with its EP group (the
    other mesh dim) unchanged: each rank's EP peers hold the shard with its own TP position.
    The step-time gate is off (at this size gloo's model predicts the 7 new all-reduces slower,
    1959 vs 1242 us): this checks the rewrite's numbers, not its price.

    Recorded: the gathers of x's shard [2, 32, 16] fp32 (4096 B) go from 4 (attention and MoE
    input, forward and backward) to 2; the partial sums all-reduced over TP once (bucketed): the
    expert-weight gradients 3 x [2, 16, 16] (6144 B), the router's [4, 16] (256 B) and the router
    statistics (4 + 4 + 1 floats, 36 B): 6436 B."""
    results = _run(rank_pool_4, "dropless", "sp_ep_sp", seq=64, step_time_gate=False)
    for r in results:
        assert r["counts"].get("joint:chimera.collective_motion.ops_on_shards", 0) > 0, r["refusals"]
        assert r["recorded_sent"]["all_gather@tp"] == 2 * 4096, r["recorded_sent"]
        assert r["recorded_sent"]["all_reduce@tp"] == 6144 + 256 + 36, r["recorded_sent"]
