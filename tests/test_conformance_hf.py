"""Conformance: Hugging Face transformers models under commfuse's default config and executor.

The models are built from tiny configs in the test (no hub downloads), parallelised the way
transformers does it (``DistributedConfig``: the model's own ``tp_plan``), trained for one SGD
step per input shape eagerly and compiled with ``backend="commfuse"``, and compared loss by loss
and gradient by gradient (fp32, rtol 1e-4). Each case also checks what commfuse did to the
collectives, so that "nothing rewritten" fails as loudly as a crash. Needs the ``conformance``
extra (``pip install -e '.[conformance]' -c .ci/lock.txt``).
"""

from __future__ import annotations

import pytest
import torch

from commfuse.reference.numerics import assert_close_tree

transformers = pytest.importorskip("transformers", reason="the conformance extra is not installed")

from _jobs_conformance import hf_trains_like_eager  # noqa: E402

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.slow(reason="third-party models: cold Inductor compiles of whole models on gloo ranks"),
]


SHAPES = [(2, 32), (2, 24)]
# dynamic=False (see _jobs_conformance._train_both): the second shape is a second static compile
# of the whole model, through the same paths as the first. The Llama case keeps both shapes (the
# backend recompiling on a guard failure); the Qwen3-MoE cases, each a full set of cold Inductor
# regions per shape, train on the first.
MOE_SHAPES = SHAPES[:1]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A 2-layer Llama saved with save_pretrained, as a user's checkpoint would be. 16 heads of 16:
    a layout for which a compute region compiled by Inductor received other strides than it was
    compiled for (the executor crashed in the backward graph)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("hf-llama")
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def test_hf_llama_tp_plan_without_setup_trains_like_eager_and_prices_tp_to_sp_motion(
    rank_pool_2, llama_checkpoint
):
    """Zero configuration: no commfuse.setup(); the TP role comes from the mesh dim name ("tp") of
    the DTensor parameters transformers created. Chimera's TP -> SP motion rewrites the all_reduces
    into reduce_scatters and all_gathers; on this tiny model the step-time gate predicts that
    slower (more, smaller collectives) and keeps the all_reduces, and every rank decides the same."""
    results = rank_pool_2.run(hf_trains_like_eager, llama_checkpoint, {"tp_size": 2}, SHAPES, timeout=600)
    for rank, r in enumerate(results):
        assert len(r["loss"]) == 2
        assert_close_tree(r["loss"], r["ref_loss"], rtol=1e-4, atol=1e-5, msg=f"loss on rank {rank}")
        assert_close_tree(r["grads"], r["ref_grads"], rtol=1e-4, atol=1e-5, msg=f"gradients on rank {rank}")
        chimera = [v for k, vs in r["gate"].items() if k.endswith("/chimera") for v in vs]
        assert chimera and all(v["gate"] == "reverted" for v in chimera), r["gate"]
        assert all(v["predicted_after_us"] > v["predicted_before_us"] for v in chimera), chimera
        assert r["collectives"].get("reduce_scatter", 0) == 0 and r["collectives"].get("all_reduce", 0) > 0, r
        assert "forward" in r["graphs"] and "backward" in r["graphs"], r["graphs"]
        # every compute region compiled: none fell back to eager (the region compiled for other
        # strides than its producer gave it used to, in the backward graph)
        assert r["warnings"] == [], r["warnings"]
    assert results[0]["gate"] == results[1]["gate"]


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tmp_path_factory):
    """A 1-layer Qwen3-MoE (4 experts, top-2), saved as a user's checkpoint would be."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = tmp_path_factory.mktemp("hf-qwen3-moe")
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def _trains_like_eager_and_rewrites(results, *, collectives_change: bool = True):
    for rank, r in enumerate(results):
        assert len(r["loss"]) == len(MOE_SHAPES)
        assert_close_tree(r["loss"], r["ref_loss"], rtol=1e-4, atol=1e-5, msg=f"loss on rank {rank}")
        assert_close_tree(r["grads"], r["ref_grads"], rtol=1e-4, atol=1e-5, msg=f"gradients on rank {rank}")
        assert {"forward", "backward"} <= set(r["graphs"]), r["graphs"]
        assert r["warnings"] == [], r["warnings"]
        assert r["passes_changed"], r
        if collectives_change:
            assert r["collectives"] != r["collectives_before"], r
        for graph, before, after in r["wire_bytes"]:  # never more bytes on the wire
            if isinstance(before, int) and isinstance(after, int):
                assert after <= before, f"rank {rank}, {graph} graph: {before} -> {after} wire bytes"
    assert results[0]["collectives"] == results[1]["collectives"]


def test_hf_qwen3_moe_tensor_parallel_experts_trains_like_eager(rank_pool_2, qwen3_moe_checkpoint):
    """transformers' MoE TP plan (experts sharded by columns/rows, all_reduces)."""
    results = rank_pool_2.run(
        hf_trains_like_eager, qwen3_moe_checkpoint, {"tp_size": 2}, MOE_SHAPES, timeout=600
    )
    _trains_like_eager_and_rewrites(results)
    assert results[0]["collectives_before"].get("all_reduce", 0) > 0
    # bucketing merged all_reduces of the same group
    assert results[0]["collectives"]["all_reduce"] < results[0]["collectives_before"]["all_reduce"]


def test_hf_qwen3_moe_expert_parallel_trains_like_eager(rank_pool_2, qwen3_moe_checkpoint):
    """transformers' expert parallel (``ep_size``; its dispatch exchanges tokens with all_to_all),
    attention tensor parallel on the same two ranks."""
    results = rank_pool_2.run(
        hf_trains_like_eager, qwen3_moe_checkpoint, {"tp_size": 2, "ep_size": 2}, MOE_SHAPES, timeout=600
    )
    # The default config prices only what every rank of the expert group shares (its ranks may
    # hold different local batches, docs/architecture.md "The rule"), so nothing is bucketed here;
    # the scheduler still reorders the issue (passes_changed). uniform_batches=True prices the rest.
    _trains_like_eager_and_rewrites(results, collectives_change=False)
    assert results[0]["collectives_before"].get("all_to_all", 0) > 0
