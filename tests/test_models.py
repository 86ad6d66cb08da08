"""Tests of the example models in commfuse.models.

* Multi-rank (``multirank``): every parallelised model runs on 4 gloo ranks,
  eagerly and under ``torch.compile`` with an eager-executing AOTAutograd
  backend, and must match the single-process unsharded reference computed in
  this (pytest) process: gathered outputs, global loss and every gathered
  parameter gradient, in fp32. The compiled graphs of the gloo runs are
  checked for their collectives as well.
* Graph-only: the same models on a ``fake`` process group of 8 ranks, compiled
  in this process; FileCheck on the forward / backward graph code for the
  expected functional collectives (no communication happens).
* Small unit tests of input sharding, routing and state-dict layout.

Rank jobs are module-level functions (the rank pool pickles them by
reference) and return plain CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing import FileCheck

from commfuse.models import llama, moe, simple_fsdp
from commfuse.models.common import (
    Batch,
    GraphRecorder,
    all_gather_cat,
    full_tensor,
    global_loss,
)
from commfuse.testing.fake_pg import fake_mesh
from commfuse.tools.rank_pool import get_pool

WORLD = 4
FAKE_WORLD = 8
SEED = 0
# Divisible by 8 where it matters (heads, ffn, vocab, experts, seq, dims), so
# the same configs run on 4 gloo ranks and on the 8-rank fake group.
LLAMA = llama.LlamaConfig(n_layers=2, dim=32, n_heads=8, ffn_dim=64)
# Eager+compiled pairs on gloo use one block: compile time grows with depth,
# and the 2-block residual stream is covered by the eager multi-rank tests.
LLAMA_1 = llama.LlamaConfig(n_layers=1, dim=32, n_heads=8, ffn_dim=64)
LLAMA_VOCAB = llama.LlamaConfig(n_layers=2, dim=32, n_heads=8, ffn_dim=64, vocab=64)
BATCH, SEQ = 8, 16
MOE_KW: dict[str, Any] = dict(dim=32, num_experts=8, ffn_dim=64, capacity_factor=1.0)

Result = dict[str, Any]  # out, loss, grads (name -> full grad), fw/bw graph code


# ---------------------------------------------------------------- helpers


def _step(
    model: nn.Module,
    batch: Batch,
    loss_of: Callable[[Any, Batch], torch.Tensor],
    compiled: bool,
) -> tuple[Any, torch.Tensor, GraphRecorder | None]:
    """One forward + backward, eager or compiled with the recording backend."""
    rec = GraphRecorder() if compiled else None
    run = torch.compile(model, backend=rec.backend, fullgraph=True) if rec else model
    out = run(batch.inputs)
    loss = loss_of(out, batch)
    loss.backward()
    return out, loss, rec


def _result(
    out: torch.Tensor,
    loss: torch.Tensor,
    batch: Batch,
    grads: dict[str, torch.Tensor],
    rec: GraphRecorder | None,
) -> Result:
    return {
        "out": out.detach(),
        "loss": global_loss(loss, batch),
        "grads": {k: v.detach() for k, v in grads.items()},
        "fw": rec.forward_code if rec else "",
        "bw": rec.backward_code if rec else "",
    }


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _assert_matches(got: Result, want: Result, what: str) -> None:
    torch.testing.assert_close(got["out"], want["out"], msg=f"{what}: output")
    torch.testing.assert_close(got["loss"], want["loss"], msg=f"{what}: loss")
    assert got["grads"].keys() == want["grads"].keys(), what
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, msg=f"{what}: grad of {name}")


def _check_counts(code: str, counts: dict[str, int]) -> None:
    """Exactly ``n`` calls of each ``_c10d_functional.<op>`` in ``code``."""
    for op, n in counts.items():
        fc = FileCheck()
        if n:
            fc.check_count(f"_c10d_functional.{op}.default(", n, exactly=True)
        else:
            fc.check_not(f"_c10d_functional.{op}.default(")
        fc.run(code)


def _reference(model: nn.Module, batch: Batch, loss_of: Callable, out_of: Callable = lambda o: o) -> Result:
    out, loss, _ = _step(model, batch, loss_of, compiled=False)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return _result(out_of(out), loss, batch, grads, None)


# ------------------------------------------------------------------- Llama


def _llama_job(config: llama.LlamaConfig, sp: bool, compiled: bool) -> Result:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama.parallelize_llama(llama.build_llama(config, SEED), _mesh(), sequence_parallel=sp)
    batch = llama.make_inputs(config, BATCH, SEQ, rank=rank, world_size=world, sequence_parallel=sp)
    out, loss, rec = _step(model, batch, llama.loss_fn, compiled)
    if batch.loss_reduce == "sum":  # sequence shards -> full sequence
        out = all_gather_cat(out.detach(), dim=1)
    grads = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    return _result(out, loss, batch, grads, rec)


def _llama_reference(config: llama.LlamaConfig) -> Result:
    model = llama.build_llama(config, SEED)
    return _reference(model, llama.make_inputs(config, BATCH, SEQ), llama.loss_fn)


def _llama_counts(config: llama.LlamaConfig, sp: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Expected (forward, backward) collective counts of the compiled Llama."""
    n = config.n_layers
    head = 1 if config.vocab else 0
    if sp:
        # Per block: gather before attention and FFN, reduce-scatter after wo
        # and w2; the backward mirrors it. Norm-weight grads stay Partial
        # DTensors (reduced outside the graph), so no all_reduce.
        fw = {
            "all_gather_into_tensor": 2 * n + 2 * head,
            "reduce_scatter_tensor": 2 * n + head,
            "all_reduce": 0,
        }
        bw = {"all_gather_into_tensor": 2 * n + head, "reduce_scatter_tensor": 2 * n + head, "all_reduce": 0}
    else:
        # Forward: all_reduce after wo and w2. Backward: each column-parallel
        # layer all-reduces its input gradient separately (wq, wk, wv, w1, w3).
        fw = {"all_reduce": 2 * n + head, "all_gather_into_tensor": head, "reduce_scatter_tensor": 0}
        bw = {"all_reduce": 5 * n + head, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}
    return fw, bw


# --------------------------------------------------------------------- MoE


def _moe_loss(out: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> torch.Tensor:
    return moe.loss_fn(out[0], out[1], batch)


def _moe_job(top_k: int, compiled: bool) -> Result:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = moe.parallelize_moe(moe.build_moe(**MOE_KW, top_k=top_k, seed=SEED), _mesh())
    batch = moe.make_inputs(BATCH, SEQ, MOE_KW["dim"], rank=rank, world_size=world)
    (out, _aux), loss, rec = _step(model, batch, _moe_loss, compiled)
    grads = {}
    for name, p in model.named_parameters():
        grad = full_tensor(p.grad)
        # Local experts -> all experts (rank r holds experts [r*E/N, (r+1)*E/N)).
        grads[simple_fsdp.unwrapped_name(name)] = (
            all_gather_cat(grad, dim=0) if name.startswith("experts.") else grad
        )
    return _result(all_gather_cat(out.detach(), dim=0), loss, batch, grads, rec)


def _moe_reference(top_k: int, world: int) -> Result:
    # One token group per EP rank: the same capacity and the same drops.
    model = moe.build_moe(**MOE_KW, top_k=top_k, num_token_groups=world, seed=SEED)
    return _reference(model, moe.make_inputs(BATCH, SEQ, MOE_KW["dim"]), _moe_loss, lambda o: o[0])


# -------------------------------------------------------------- SimpleFSDP


def _fsdp_job(mode: str, compiled: bool) -> Result:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = simple_fsdp.data_parallel(llama.build_llama(LLAMA_1, SEED), _mesh(), mode)  # type: ignore[arg-type]
    batch = simple_fsdp.make_inputs(LLAMA_1, BATCH, SEQ, rank=rank, world_size=world)
    out, loss, rec = _step(model, batch, simple_fsdp.loss_fn, compiled)
    grads = {simple_fsdp.unwrapped_name(n): full_tensor(p.grad) for n, p in model.named_parameters()}
    return _result(all_gather_cat(out.detach(), dim=0), loss, batch, grads, rec)


def _fsdp_reference() -> Result:
    model = llama.build_llama(LLAMA_1, SEED)
    return _reference(model, simple_fsdp.make_inputs(LLAMA_1, BATCH, SEQ), simple_fsdp.loss_fn)


def _fsdp_counts(mode: str, num_params: int) -> tuple[dict[str, int], dict[str, int]]:
    if mode == "fully_shard":
        return (
            {"all_gather_into_tensor": num_params, "all_reduce": 0},
            {"reduce_scatter_tensor": num_params, "all_reduce": 0},
        )
    return ({"all_gather_into_tensor": 0, "all_reduce": 0}, {"all_reduce": num_params})


# ------------------------------------------------------- multi-rank tests


def _run_pair(job: Callable[..., Result], *args: Any) -> tuple[Result, Result]:
    """Eager and compiled results of ``job`` on rank 0 of the gloo pool (every
    rank returns the same gathered values)."""
    pool = get_pool(WORLD)
    eager = pool.run(job, *args, False)
    compiled = pool.run(job, *args, True)
    return eager[0], compiled[0]


def _check_pair(eager: Result, compiled: Result, reference: Result, counts: tuple[dict, dict]) -> None:
    _assert_matches(eager, reference, "eager parallel vs unsharded reference")
    _assert_matches(compiled, eager, "compiled vs eager")
    _check_counts(compiled["fw"], counts[0])
    _check_counts(compiled["bw"], counts[1])


@pytest.mark.slow(reason="runs the parallel model on gloo ranks against the single-device reference")
@pytest.mark.multirank
@pytest.mark.parametrize("sp", [True, False], ids=["tp_sp", "tp"])
def test_llama_matches_reference(sp: bool) -> None:
    eager, compiled = _run_pair(_llama_job, LLAMA_1, sp)
    _check_pair(eager, compiled, _llama_reference(LLAMA_1), _llama_counts(LLAMA_1, sp))


def _llama_sgd_job() -> dict[str, torch.Tensor]:
    model = llama.parallelize_llama(llama.build_llama(LLAMA, SEED), _mesh())
    batch = llama.make_inputs(LLAMA, BATCH, SEQ, rank=dist.get_rank(), world_size=dist.get_world_size())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    llama.loss_fn(model(batch.inputs), batch).backward()
    opt.step()
    return {n: full_tensor(p.detach()) for n, p in model.named_parameters()}


@pytest.mark.multirank
def test_llama_sgd_step_matches_reference() -> None:
    """An optimizer step on the TP+SP model updates the weights like the
    unsharded one; in particular the norm weights, whose grads are Partial
    DTensors that the update itself has to reduce."""
    weights = get_pool(WORLD).run(_llama_sgd_job)[0]
    reference = llama.build_llama(LLAMA, SEED)
    batch = llama.make_inputs(LLAMA, BATCH, SEQ)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    llama.loss_fn(reference(batch.inputs), batch).backward()
    opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=name)


@pytest.mark.multirank
def test_llama_with_vocab_matches_reference() -> None:
    results = get_pool(WORLD).run(_llama_job, LLAMA_VOCAB, True, False)
    _assert_matches(results[0], _llama_reference(LLAMA_VOCAB), "eager TP+SP with vocab")


@pytest.mark.slow(reason="runs the parallel model on gloo ranks against the single-device reference")
@pytest.mark.multirank
def test_moe_matches_reference() -> None:
    eager, compiled = _run_pair(_moe_job, 2)
    counts = ({"all_to_all_single": 2}, {"all_to_all_single": 2, "all_reduce": 2})
    _check_pair(eager, compiled, _moe_reference(2, WORLD), counts)


@pytest.mark.multirank
def test_moe_top1_matches_reference() -> None:
    results = get_pool(WORLD).run(_moe_job, 1, False)
    _assert_matches(results[0], _moe_reference(1, WORLD), "eager EP top-1")


@pytest.mark.slow(reason="runs the parallel model on gloo ranks against the single-device reference")
@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
def test_simple_fsdp_matches_reference(mode: str) -> None:
    eager, compiled = _run_pair(_fsdp_job, mode)
    reference = _fsdp_reference()
    _check_pair(eager, compiled, reference, _fsdp_counts(mode, len(reference["grads"])))


# ------------------------------------------------- graph-only (fake PG, 8 ranks)


@pytest.fixture
def mesh8():
    torch._dynamo.reset()
    with fake_mesh(FAKE_WORLD) as mesh:
        yield mesh
    torch._dynamo.reset()


def _compile_graphs(
    model: nn.Module, inputs: torch.Tensor, loss_of: Callable[[Any], torch.Tensor]
) -> GraphRecorder:
    rec = GraphRecorder()
    loss_of(torch.compile(model, backend=rec.backend, fullgraph=True)(inputs)).backward()
    assert rec.forward_graphs and rec.backward_graphs
    return rec


@pytest.mark.parametrize(
    "config,sp",
    [(LLAMA, True), (LLAMA, False), (LLAMA_VOCAB, True)],
    ids=["tp_sp", "tp", "tp_sp_vocab"],
)
def test_llama_graph_collectives(mesh8: DeviceMesh, config: llama.LlamaConfig, sp: bool) -> None:
    model = llama.parallelize_llama(llama.build_llama(config, SEED), mesh8, sequence_parallel=sp)
    batch = llama.make_inputs(config, 2, SEQ, world_size=FAKE_WORLD, sequence_parallel=sp)
    rec = _compile_graphs(model, batch.inputs, lambda out: llama.loss_fn(out, batch))
    fw, bw = _llama_counts(config, sp)
    _check_counts(rec.forward_code, fw)
    _check_counts(rec.backward_code, bw)
    if sp:
        # Megatron SP order inside a block: gather, (attention), scatter, gather, (FFN), scatter.
        fc = FileCheck()
        for _ in range(config.n_layers):
            fc.check("all_gather_into_tensor").check("reduce_scatter_tensor")
            fc.check("all_gather_into_tensor").check("reduce_scatter_tensor")
        fc.run(rec.forward_code)


def test_moe_graph_collectives(mesh8: DeviceMesh) -> None:
    model = moe.parallelize_moe(moe.build_moe(**MOE_KW, seed=SEED), mesh8)
    batch = moe.make_inputs(FAKE_WORLD, SEQ, MOE_KW["dim"], world_size=FAKE_WORLD)
    rec = _compile_graphs(model, batch.inputs, lambda out: moe.loss_fn(out[0], out[1], batch))
    FileCheck().check("all_to_all_single").check("bmm").check("all_to_all_single").run(rec.forward_code)
    _check_counts(rec.forward_code, {"all_to_all_single": 2, "all_reduce": 0})
    _check_counts(rec.backward_code, {"all_to_all_single": 2, "all_reduce": 2})


@pytest.mark.parametrize("mode", ["fully_shard", "replicate"])
def test_simple_fsdp_graph_collectives(mesh8: DeviceMesh, mode: str) -> None:
    model = simple_fsdp.data_parallel(llama.build_llama(LLAMA, SEED), mesh8, mode)  # type: ignore[arg-type]
    num_params = len(list(model.parameters()))
    batch = simple_fsdp.make_inputs(LLAMA, FAKE_WORLD, SEQ, world_size=FAKE_WORLD)
    rec = _compile_graphs(model, batch.inputs, lambda out: simple_fsdp.loss_fn(out, batch))
    fw, bw = _fsdp_counts(mode, num_params)
    _check_counts(rec.forward_code, fw)
    _check_counts(rec.backward_code, bw)
    if mode == "fully_shard":
        # Gradients are averaged (DDP semantics), by the reduce_scatter itself.
        FileCheck().check("reduce_scatter_tensor.default(").check_same("'avg'").run(rec.backward_code)


def test_simple_fsdp_state_dict(mesh8: DeviceMesh) -> None:
    model = simple_fsdp.data_parallel(llama.build_llama(LLAMA, SEED), mesh8, "fully_shard")
    reference = llama.build_llama(LLAMA, SEED).state_dict()
    state = model.state_dict()
    assert [simple_fsdp.unwrapped_name(k) for k in state] == list(reference)
    assert "layers.0.attention.wq.parametrizations.weight.original" in state
    for name, value in state.items():
        full = reference[simple_fsdp.unwrapped_name(name)]
        assert value.shape == full.shape  # DTensor: global shape
        assert value.to_local().shape == (full.shape[0] // FAKE_WORLD, *full.shape[1:])


# ------------------------------------------------------------- unit tests


def test_llama_inputs_shard_the_sequence() -> None:
    full = llama.make_inputs(LLAMA, 2, SEQ)
    shards = [llama.make_inputs(LLAMA, 2, SEQ, rank=r, world_size=WORLD) for r in range(WORLD)]
    torch.testing.assert_close(torch.cat([s.inputs for s in shards], dim=1), full.inputs)
    torch.testing.assert_close(torch.cat([s.target for s in shards], dim=1), full.target)
    assert all(s.loss_denominator == full.inputs.numel() and s.loss_reduce == "sum" for s in shards)
    replicated = llama.make_inputs(LLAMA, 2, SEQ, rank=1, world_size=WORLD, sequence_parallel=False)
    torch.testing.assert_close(replicated.inputs, full.inputs)


def test_gshard_gating_priority_and_capacity() -> None:
    # 4 tokens, 2 experts, top-2, capacity 3: every token picks both experts.
    probs = torch.tensor([[[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]])
    combine, dispatch, _ = moe.gshard_gating(probs, top_k=2, capacity=3)
    # Expert 0: first choices of tokens 0, 1, 3 fill slots 0..2, so the second
    # choice of token 2 is dropped. Expert 1: first choice of token 2 (slot 0),
    # then second choices of tokens 0, 1 (slots 1, 2); token 3's is dropped.
    slots = {(t, e): int(dispatch[0, t, e].nonzero()) for t, e in dispatch[0].any(-1).nonzero().tolist()}
    assert slots == {(0, 0): 0, (1, 0): 1, (3, 0): 2, (2, 1): 0, (0, 1): 1, (1, 1): 2}
    torch.testing.assert_close(combine[0].sum((-1, -2)), torch.tensor([1.0, 1.0, 0.7, 0.6]))


def test_moe_reference_drops_tokens() -> None:
    """The test config overflows capacity, so the EP-vs-reference comparison
    exercises dropping (it would pass trivially otherwise)."""
    model = moe.build_moe(**MOE_KW, seed=SEED)
    tokens = moe.make_inputs(BATCH, SEQ, MOE_KW["dim"], rank=0, world_size=WORLD).inputs
    tokens = model.norm(tokens).reshape(1, -1, MOE_KW["dim"])
    probs = torch.softmax(model.router(tokens), dim=-1)
    _, dispatch, _ = moe.gshard_gating(probs, top_k=2, capacity=model.capacity(tokens.shape[1]))
    assert int(dispatch.sum()) < 2 * tokens.shape[1]
