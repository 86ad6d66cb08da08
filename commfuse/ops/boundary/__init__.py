"""The boundary ops a pipeline boundary needs: ``commfuse::m2ms`` and ``commfuse::stage_transfer``.

* ``m2ms`` / ``m2ms_autograd`` -- many-to-many scatter (Chimera §3, Table 1 "M2MS"): every
  rank of group A sends a possibly different-sized piece to every rank of group B (:mod:`.m2ms`).
* ``stage_transfer`` / ``stage_transfer_autograd`` -- point-to-point transfer of a whole tensor
  between paired ranks (Table 1 "P2P", :mod:`.stage_transfer`).
* :func:`trace_position` -- trace m2ms as another member of its receiving group (:mod:`.trace`).

Everything about the two ops lives here: the ops and their fake kernels, the IR's view
(:mod:`.ir_view`), their cost rule (:mod:`.cost`) and their reference semantics
(:mod:`.semantics`); :func:`install` plugs the last three into the lower layers.
"""

from __future__ import annotations

from commfuse.ops.boundary import cost, ir_view, semantics
from commfuse.ops.boundary.m2ms import M2MS, M2MS_AUTOGRAD, M2MSArgs, m2ms, parse_m2ms
from commfuse.ops.boundary.stage_transfer import (
    STAGE_TRANSFER,
    STAGE_TRANSFER_AUTOGRAD,
    StageTransferArgs,
    parse_stage_transfer,
    stage_transfer,
)
from commfuse.ops.boundary.trace import trace_as_rank, trace_position


def install() -> None:
    ir_view.register()
    cost.register()
    semantics.register()


__all__ = [
    "M2MS",
    "M2MSArgs",
    "M2MS_AUTOGRAD",
    "STAGE_TRANSFER",
    "STAGE_TRANSFER_AUTOGRAD",
    "StageTransferArgs",
    "install",
    "m2ms",
    "parse_m2ms",
    "parse_stage_transfer",
    "stage_transfer",
    "trace_as_rank",
    "trace_position",
]
