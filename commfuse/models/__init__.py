"""Small but real models, parallelised the way users do it, for commfuse.

* :mod:`commfuse.models.llama` - Llama decoder with DTensor tensor parallelism
  (+ sequence parallelism), torchtitan style;
* :mod:`commfuse.models.moe` - GShard MoE block with expert parallelism
  (functional all_to_all);
* :mod:`commfuse.models.simple_fsdp` - SimpleFSDP-style FSDP / DDP whose
  all_gather / reduce_scatter / all_reduce are traced into the compiled graph.

Each module has a deterministic ``build_*`` (or reuses :func:`build_llama`), a
``parallelize_*`` / ``data_parallel`` function, ``make_inputs`` (one rank's
share of a deterministic global batch) and ``loss_fn``. See docs/models.md.
"""

from commfuse.models import common, llama, moe, simple_fsdp
from commfuse.models.common import Batch, GraphRecorder
from commfuse.models.llama import LlamaConfig, LlamaModel, build_llama, parallelize_llama
from commfuse.models.moe import MoEBlock, build_moe, parallelize_moe
from commfuse.models.simple_fsdp import data_parallel

__all__ = [
    "Batch",
    "GraphRecorder",
    "LlamaConfig",
    "LlamaModel",
    "MoEBlock",
    "build_llama",
    "build_moe",
    "common",
    "data_parallel",
    "llama",
    "moe",
    "parallelize_llama",
    "parallelize_moe",
    "simple_fsdp",
]
