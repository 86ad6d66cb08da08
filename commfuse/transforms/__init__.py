"""The passes: one module per registered pass, and the table of them (:mod:`.registry`).

Chimera's fusion (``split_all_reduce``, ``collective_motion``, ``fuse_collectives``, and
``chimera`` running the three), MoE recognition, boundary fusion, Centauri's partitions
(``workload_partition``, ``primitive_substitution``, ``group_partition``) and their search
(``centauri_partition``), the schedulers (``schedule_overlap``, ``dhelix_interleave``),
``bucket_collectives``, ``sink_waits``, ``lagom_tune`` and ``gloo_reduce_scatter``. Each
module opens with its contract and source.
"""
