"""Shard rules for commfuse's MoE layer op: the MoE dispatch region of Chimera §3.2.

``commfuse::moe_layer`` (:mod:`commfuse.ops.moe_layer.op`) is router -> dispatch ->
all_to_all -> experts -> all_to_all -> combine as one op whose semantics the IR
knows: each token's output depends on that token (and the weights) only, except
through the capacity rule. So when its tokens are sharded along a leading dim
``d`` over the region's group, the op runs on the shard and its outputs are:

* ``out``: ``Sharded(d)``;
* the router statistics (sums over tokens): ``Partial`` -- the region all-reduces
  them where they are used, so auxiliary losses keep their values.

Backward (``moe_layer_backward``) with the output gradient and the tokens both
``Sharded(d)`` (the same group):

* input gradient ``Sharded(d)``; router-weight gradient ``Partial``;
* expert-weight gradients ``Complete``: the expert's owner receives every rank's
  tokens either way. In the unoptimised program every rank of the group held
  *all* tokens (they were gathered) and dispatched them, so each expert saw N
  copies and its gradient was N times the one-copy sum; the local op is given
  ``expert_grad_scale * N`` to keep that value. Without expert parallelism
  (``group_name == ""``) each rank has all experts and the gradients are
  ``Partial`` instead.

The op's EP group may also be the *other* dim of a 2-D mesh whose first dim is the
region's group (TP x EP on separate dims, ``RuleEnv.crossing``): the EP peers of a rank
all hold the shard with that rank's index, so each runs the op on its shard and the
experts see, per TP position, that position's shards of every EP peer's tokens. Outputs
and statistics as above; the expert-weight gradients are ``Partial`` over the region's
group (its TP positions together saw every token once, as each rank did before) and
``expert_grad_scale`` stays. The expert weights must be known identical across the region's
group (a shard's tokens now meet another TP rank's copy of each expert).

Refused (the op stays on full tokens):

* the op's EP group is another group than the region's that does not cross it as the
  dims of a mesh every rank knows (the token exchange would mix shards of different
  groups);
* the sharded dim is the hidden dim, or router/weights are not replicated;
* capacity that can drop tokens (``capacity_can_bind``) when the shards split a
  token group: drops depend on the group's other tokens. Exact when
  ``token_groups`` is a multiple of N and the shard is a run of whole groups
  (then each shard holds ``token_groups / N`` groups). With
  ``Config.moe_capacity_regroup`` a shard that is a contiguous run of tokens
  becomes one token group -- the program's numbers then equal the unoptimised
  program with ``token_groups = N`` (the grouping changes which tokens drop).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch.fx as fx

from commfuse.analysis.shard_layouts import Complete, LocalOp, Partial, RuleEnv, Sharded, StateOf
from commfuse.ir.shapes import shape_of
from commfuse.ops.moe_layer.comm_volume import node_transfers
from commfuse.ops.moe_layer.op import MOE_LAYER, MOE_LAYER_BACKWARD, MoeOperands
from commfuse.ops.moe_layer.routing import capacity_can_bind


def _token_groups(
    x: fx.Node, d: int, top_k: int, capacity_factor: float, groups: int, num_experts: int, env: RuleEnv
) -> int | str:
    """``token_groups`` of the op on the shard, or why the shard would change drops."""
    if not capacity_can_bind(capacity_factor, top_k, num_experts):
        return 1
    shape = shape_of(x)
    if not all(s == 1 for s in shape[:d]):
        return (
            f"capacity can drop tokens and the shard along dim {d} of {list(shape)} is not a run of "
            "whole token groups"
        )
    if groups % env.n == 0:
        return groups // env.n
    if env.moe_capacity_regroup and groups == 1:
        return 1
    return (
        f"capacity can drop tokens and token_groups={groups} does not split over {env.n} ranks "
        "(set Config.moe_capacity_regroup to regroup per shard)"
    )


def _common(
    node: fx.Node,
    x: fx.Node,
    router_w: fx.Node,
    experts: tuple,
    state: StateOf,
    env: RuleEnv,
    top_k: int,
    capacity_factor: float,
    groups: int,
    group_name: str,
) -> Optional[tuple[int, int, bool]]:
    """(sharded dim, token_groups on the shard, whether the EP group crosses the region's) when
    the op can run on x's shard."""
    s = state(x)
    shape = shape_of(x)
    why = None
    crossing = group_name not in ("", env.group)
    not_crossing = env.crossing(group_name) if crossing else None
    if not isinstance(s, Sharded) or shape is None or s.dim >= len(shape) - 1:
        why = f"tokens are not sharded along a leading dim ({s})"
    elif not_crossing:
        why = (
            f"its expert-parallel group {group_name} is not the gathered group {env.group} and does not cross "
            f"it as a mesh dim ({not_crossing})"
        )
    elif crossing and not all(env.replicated(w) for w in experts):
        # across mesh dims a shard's tokens meet another TP rank's copy of each expert
        why = "its expert weights are not known to be identical on every rank of the gathered group"
    elif state(router_w) is not None or not env.replicated(router_w):
        why = "router weight not known to be identical on every rank"
    else:
        g = _token_groups(x, s.dim, top_k, capacity_factor, groups, shape_of(router_w)[0], env)
        if isinstance(g, str):
            why = g
        elif (math.prod(shape[:-1]) // env.n) % g:
            why = f"{math.prod(shape[:-1]) // env.n} tokens per shard do not split into {g} groups"
        else:
            return s.dim, g, crossing
    env.refusals[node] = f"{node.name} stays on full tokens: {why}"
    return None


def moe_forward_rule(node: fx.Node, state: StateOf, env: RuleEnv) -> LocalOp | None:
    ops = MoeOperands.of(node)  # its token chunks stay as they are on a shard
    experts = (ops.w1, ops.w3, ops.w2)
    if any(state(w) is not None for w in experts):
        env.refusals[node] = f"{node.name} stays on full tokens: expert weights computed in the region"
        return None
    got = _common(
        node,
        ops.x,
        ops.router_w,
        experts,
        state,
        env,
        ops.top_k,
        ops.capacity_factor,
        ops.token_groups,
        ops.group_name,
    )
    if got is None:
        return None
    d, g, _ = got
    args = replace(ops, token_groups=g).args()
    return LocalOp(
        args, {}, (Sharded(d), Partial(), Partial(), Partial()), wire_saved=_wire_saved(node, d, g, env.n)
    )


def moe_backward_rule(node: fx.Node, state: StateOf, env: RuleEnv) -> LocalOp | None:
    ops = MoeOperands.of(node)
    x, experts = ops.x, (ops.w1, ops.w3, ops.w2)
    stats = (ops.grad_probs_sum, ops.grad_z_sum)
    if state(ops.grad_out) != state(x):
        env.refusals[node] = (
            f"{node.name} stays full: output gradient is {state(ops.grad_out)}, tokens {state(x)}"
        )
        return None
    if any(state(a) is not None for a in (*stats, *experts)) or any(not env.replicated(a) for a in stats):
        env.refusals[node] = f"{node.name} stays full: statistics gradients not replicated"
        return None
    got = _common(
        node,
        x,
        ops.router_w,
        experts,
        state,
        env,
        ops.top_k,
        ops.capacity_factor,
        ops.token_groups,
        ops.group_name,
    )
    if got is None:
        return None
    d, g, crossing = got
    scale = ops.expert_grad_scale
    if ops.group_name and not crossing:
        scale, weights = scale * env.n, Complete()
    else:
        weights = Partial()
    args = replace(ops, token_groups=g, expert_grad_scale=scale).args()
    return LocalOp(
        args,
        {},
        (Sharded(d), Partial(), weights, weights, weights),
        wire_saved=_wire_saved(node, d, g, env.n),
    )


def _wire_saved(node: fx.Node, d: int, groups: int, n: int) -> int:
    shape = list(shape_of(MoeOperands.of(node).x))
    full = sum(t.wire_bytes for t in node_transfers(node))
    shape[d] //= n
    return full - sum(t.wire_bytes for t in node_transfers(node, tuple(shape), groups))


MOE_RULES = {MOE_LAYER: moe_forward_rule, MOE_LAYER_BACKWARD: moe_backward_rule}
