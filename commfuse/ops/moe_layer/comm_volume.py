"""The bytes ``commfuse::moe_layer`` and its backward send (registered with the IR).

Per rank, N = EP group size = ``E / local experts``, ``elt`` the token dtype size,
``T`` the tokens of this call, ``k`` top-k, ``H`` hidden size:

* capacity (``capacity_factor > 0``): static buffers of ``E * G * C`` rows
  (``G`` token groups, ``C`` slots per expert per group); forward sends ``H`` values
  per row out (dispatch) and back (combine); backward ``2H + 1`` out (token, output
  gradient, gate) and ``H + 1`` back (input gradient, gate gradient);
* dropless: ``T * k`` rows (kept assignments) of the same widths, plus the
  per-expert counts (``E`` int64 per token chunk, one exchange per call) before the rows;
  a call cut into token chunks sends the same rows in one all_to_all per chunk and way. Rows per peer depend on the
  routing: the numbers assume balanced routing and are marked ``estimated``.

Each all_to_all: logged = buffer bytes, wire = ``(N - 1) / N`` of it.
"""

from __future__ import annotations

import math

import torch.fx as fx

from commfuse.ir.embedded import EmbeddedTransfer, register_embedded_comm
from commfuse.ir.kinds import CollectiveKind
from commfuse.ir.shapes import shape_of
from commfuse.ops.moe_layer.op import MOE_LAYER, MOE_LAYER_BACKWARD, MoeOperands, token_chunk_count
from commfuse.ops.moe_layer.routing import capacity


def transfers(
    x_shape: tuple[int, ...],
    elt: int,
    num_experts: int,
    n: int,
    top_k: int,
    capacity_factor: float,
    token_groups: int,
    group_name: str,
    widths: dict[str, int],
    chunks: int = 1,
) -> list[EmbeddedTransfer]:
    """The exchanges of one call on tokens ``x_shape``; ``widths``: values per row of each
    exchange, in issue order; ``chunks``: token chunks of a dropless call (one transfer per
    chunk and way, the chunks' rows as the kernel cuts them)."""
    if not group_name or n < 2:
        return []
    tokens, experts = math.prod(x_shape[:-1]), num_experts
    dropless = capacity_factor <= 0
    chunks = token_chunk_count(chunks, capacity_factor)
    out: list[EmbeddedTransfer] = []
    if dropless:
        rows = tokens * top_k
        counts = experts * 8 * chunks  # int64 counts per expert and chunk, one exchange per call
        out.append(
            EmbeddedTransfer(
                CollectiveKind.ALL_TO_ALL, group_name, n, counts, counts * (n - 1) // n, "counts"
            )
        )
    else:
        rows = experts * token_groups * capacity(capacity_factor, top_k, tokens // token_groups, experts)
    for what, width in widths.items():
        for i in range(chunks):
            # the kernel's token chunks: tensor_split, the first ``tokens % chunks`` one token longer
            chunk_tokens = tokens // chunks + (1 if i < tokens % chunks else 0)
            logged = (rows if chunks == 1 else chunk_tokens * top_k) * width * elt
            label = what if chunks == 1 else f"{what} {i + 1}/{chunks}"
            out.append(
                EmbeddedTransfer(
                    CollectiveKind.ALL_TO_ALL,
                    group_name,
                    n,
                    logged,
                    logged * (n - 1) // n,
                    label,
                    estimated=dropless,
                )
            )
    return out


def forward_widths(hidden: int) -> dict[str, int]:
    return {"dispatch": hidden, "combine": hidden}


def backward_widths(hidden: int) -> dict[str, int]:
    return {"dispatch (token, grad, gate)": 2 * hidden + 1, "return (grad, gate grad)": hidden + 1}


def node_transfers(
    node: fx.Node,
    x_shape: tuple[int, ...] | None = None,
    token_groups: int | None = None,
    chunks: int | None = None,
) -> list[EmbeddedTransfer]:
    """Transfers of a moe_layer / moe_layer_backward node; ``x_shape``, ``token_groups`` and
    ``chunks`` override the node's (what the same call would send on a token shard, or cut
    into that many token chunks)."""
    ops = MoeOperands.of(node)
    x, router_w, w1 = ops.x, ops.router_w, ops.w1
    chunks = int(ops.chunks) if chunks is None else chunks
    if (x_shape is None and shape_of(x) is None) or shape_of(router_w) is None or shape_of(w1) is None:
        return []  # no fake-tensor metadata (e.g. the Dynamo graph before AOTAutograd): bytes unknown
    shape = tuple(x_shape or shape_of(x))
    widths = (backward_widths if ops.backward else forward_widths)(shape[-1])
    num_experts = shape_of(router_w)[0]
    if not isinstance(num_experts, int) or not isinstance(shape_of(w1)[0], int):
        return []  # symbolic expert counts: the group size, and so the bytes, are unknown
    return transfers(
        shape,
        x.meta["val"].element_size(),
        num_experts,
        num_experts // shape_of(w1)[0],
        ops.top_k,
        ops.capacity_factor,
        ops.token_groups if token_groups is None else token_groups,
        ops.group_name,
        widths,
        chunks,
    )


def chunks_of(node: fx.Node) -> int:
    """The ``chunks`` argument of a moe_layer / moe_layer_backward node (1 when not given)."""
    return int(MoeOperands.of(node).chunks)


def register() -> None:
    """The bytes both MoE ops send, with the IR (called by :func:`commfuse.ops.install`)."""
    register_embedded_comm(MOE_LAYER, node_transfers)
    register_embedded_comm(MOE_LAYER_BACKWARD, node_transfers)
