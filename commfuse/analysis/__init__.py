"""Analyses the passes decide with: facts about a graph, no rewriting policy of their own.

* :mod:`.chains` -- chains of compute a collective can be chunked together with (Centauri §3.1);
* :mod:`.chunking` -- Centauri's operation-level rule (Algorithm 1): how many chunks, which granularity;
* :mod:`.shard_layouts`, :mod:`.shard_rules`, :mod:`.moe_rules` -- how an op runs on shards (the
  rules collective motion propagates with);
* :mod:`.boundary` -- Chimera's fusions of a pipeline stage transfer with its neighbours (one module per rule);
* :mod:`.rank_local` -- whether the ranks of a program may hold different graphs or sizes.
"""
