"""Expert-parallel mixture-of-experts building blocks with known semantics.

* :class:`MoELayer` / :class:`RouterStats` -- the module (:mod:`.layer`);
* ``torch.ops.commfuse.moe_layer`` and its backward -- the graph op (:mod:`.ops`);
* :mod:`.routing` -- router, top-k, GShard capacity slots, auxiliary statistics;
* :mod:`.comm_volume` -- the bytes the op sends, for the IR.
"""

from commfuse.moe import comm_volume  # noqa: F401  (registers the op's bytes with the IR)
from commfuse.moe.layer import MoELayer, RouterStats
from commfuse.moe.ops import MOE_LAYER, MOE_LAYER_BACKWARD, moe_layer

__all__ = ["MOE_LAYER", "MOE_LAYER_BACKWARD", "MoELayer", "RouterStats", "moe_layer"]
