"""Mixture-of-experts: the layer users put in a model, and MoE regions recognised in graphs.

* :class:`MoELayer` / :class:`RouterStats` -- the module (:mod:`.layer`), which calls
  ``torch.ops.commfuse.moe_layer`` (:mod:`commfuse.ops.moe_layer`: the op, its routing, bytes
  and semantics);
* recognition of MoE layers written by others: by template (:mod:`.templates`,
  :mod:`.regions`, :mod:`.patterns`) and by meaning (:mod:`.by_meaning`).
"""

from commfuse.moe.layer import MoELayer, RouterStats
from commfuse.ops.moe_layer.op import MOE_LAYER, MOE_LAYER_BACKWARD, moe_layer

__all__ = ["MOE_LAYER", "MOE_LAYER_BACKWARD", "MoELayer", "RouterStats", "moe_layer"]
