"""commfuse's own boundary ops (issue #10): the primitives a pipeline boundary needs.

* ``commfuse::m2ms`` / ``commfuse::m2ms_autograd`` -- many-to-many scatter (Chimera §3,
  Table 1 "M2MS"): every rank of group A sends a possibly different-sized piece to every
  rank of group B (:mod:`.m2ms`).
* ``commfuse::stage_transfer`` / ``commfuse::stage_transfer_autograd`` -- point-to-point
  transfer of a whole tensor between paired ranks (Table 1 "P2P", :mod:`.stage_transfer`).
* :func:`trace_position` -- trace m2ms as another member of its receiving group (:mod:`.trace`).

The async variants behave like ``_c10d_functional`` collectives (result waited with
``_c10d_functional.wait_tensor``); the ``*_autograd`` variants wait inside and carry
``register_autograd`` backward formulas. All are implemented with batched point-to-point
``isend``/``irecv`` (:mod:`._p2p`). :func:`parse_m2ms` / :func:`parse_stage_transfer` read
their arguments from graph nodes. Importing :mod:`commfuse` registers the ops.
Semantics, implementation and limits: docs/boundary-ops.md.
"""

from __future__ import annotations

from commfuse.ops.m2ms import M2MS, M2MS_AUTOGRAD, M2MSArgs, m2ms, parse_m2ms
from commfuse.ops.stage_transfer import (STAGE_TRANSFER, STAGE_TRANSFER_AUTOGRAD, StageTransferArgs, parse_stage_transfer,
                             stage_transfer)
from commfuse.ops.trace import trace_as_rank, trace_position

__all__ = ["M2MS", "M2MSArgs", "M2MS_AUTOGRAD", "STAGE_TRANSFER", "STAGE_TRANSFER_AUTOGRAD", "StageTransferArgs",
           "m2ms", "parse_m2ms", "parse_stage_transfer", "stage_transfer", "trace_as_rank", "trace_position"]
