"""Splitting a training step's inputs into micro-batches (helpers of `commfuse.train_step`).

Inputs and targets are pytrees (tensors, tuples, lists, dicts, NamedTuples such as
`commfuse.models.Batch`). Every tensor leaf is split along dim 0 into `microbatches`
equal pieces; every other leaf (ints, strings, None) goes unchanged to every
micro-batch. Checking happens eagerly, before anything is compiled, so a bad input
raises an error naming the argument instead of a Dynamo trace error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def _leaf_name(root: str, path: tuple[Any, ...]) -> str:
    # pytree key paths render as "[0]", "['x']", ".target": good enough to name a field.
    return root + "".join(str(k) for k in path)


def check_divisible(root: str, tree: Any, microbatches: int) -> None:
    """Raise ValueError naming the leaf when a tensor cannot be split into `microbatches` along dim 0."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        name = _leaf_name(root, path)
        if leaf.dim() == 0:
            raise ValueError(
                f"{name} is a 0-dim tensor: it has no batch dim 0 to split into "
                f"microbatches={microbatches} (pass it inside a closure or as a non-tensor)"
            )
        batch = leaf.shape[0]
        if batch % microbatches:
            raise ValueError(
                f"{name} has batch size {batch} (dim 0 of shape {list(leaf.shape)}), "
                f"not divisible by microbatches={microbatches}"
            )


def split_microbatches(tree: Any, microbatches: int) -> list[Any]:
    """`tree` cut into `microbatches` pytrees of the same structure (tensor leaves split on dim 0).

    Traced by Dynamo inside the compiled step, so the graph takes the whole batch as one
    input and slices it: the captured graph covers the full step.
    """
    leaves, spec = pytree.tree_flatten(tree)
    pieces = [
        torch.tensor_split(leaf, microbatches, 0)
        if isinstance(leaf, torch.Tensor)
        else (leaf,) * microbatches
        for leaf in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(microbatches)]
