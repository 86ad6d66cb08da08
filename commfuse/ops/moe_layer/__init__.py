"""``commfuse::moe_layer`` and its backward: a whole expert-parallel MoE layer as one graph op.

The op and its fake kernel (:mod:`.op`), the token routing and the exchange it runs
(:mod:`.routing`, :mod:`.exchange`), the bytes it sends for the IR (:mod:`.comm_volume`), its
time for the cost model (:mod:`.cost`) and its reference semantics (:mod:`.semantics`);
:func:`install` plugs the last three into the lower layers.
"""

from __future__ import annotations

from commfuse.ops.moe_layer import comm_volume, cost, semantics
from commfuse.ops.moe_layer.op import MOE_LAYER, MOE_LAYER_BACKWARD, moe_layer


def install() -> None:
    comm_volume.register()
    cost.register()
    semantics.register()


__all__ = ["MOE_LAYER", "MOE_LAYER_BACKWARD", "install", "moe_layer"]
