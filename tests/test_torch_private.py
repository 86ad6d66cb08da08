"""Version differences kept in `commfuse.core.torch_private`: what commfuse does on a torch
release that lacks a name (the lent GPU machine runs torch 2.11)."""

from __future__ import annotations

import types

import torch.distributed as dist

from commfuse.core.torch_private import (
    c10d_all_gather_single,
    c10d_functional,
    c10d_reduce_scatter_single,
    functional_overload,
)
from commfuse.ir.kinds import CollectiveKind, collective_spec


def test_functional_overload_returns_the_op_or_none_when_the_release_lacks_it():
    assert functional_overload(c10d_functional, "all_reduce") is c10d_functional.all_reduce.default
    assert functional_overload(c10d_functional, "no_such_collective") is None
    assert functional_overload(types.SimpleNamespace(), "isend") is None  # a release without functional p2p


def test_p2p_ops_are_tagged_where_the_release_has_them():
    op = functional_overload(c10d_functional, "isend")
    if op is not None:
        assert collective_spec(op).kind is CollectiveKind.SEND


def test_single_tensor_collectives_use_the_new_names_and_fall_back_to_the_old(monkeypatch):
    new_ag, new_rs = getattr(dist, "all_gather_single", None), getattr(dist, "reduce_scatter_single", None)
    assert c10d_all_gather_single() is (new_ag or dist.all_gather_into_tensor)
    assert c10d_reduce_scatter_single() is (new_rs or dist.reduce_scatter_tensor)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    assert c10d_all_gather_single() is dist.all_gather_into_tensor
    assert c10d_reduce_scatter_single() is dist.reduce_scatter_tensor
