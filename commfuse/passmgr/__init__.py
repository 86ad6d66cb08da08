"""The pass manager: what a pass is, what it sees, and how pipelines of passes run.

* :mod:`.base` -- :class:`GraphPass` (name, stage, contract docstring, ``run`` reporting change,
  ``preserves``, ``fuzz``), :class:`PassResult`, :class:`Stage`, :class:`FuzzSpec`;
* :mod:`.context` -- :class:`PassContext`: the graph, config, topology, cost policy, session
  state, and typed :class:`Analysis` keys;
* :mod:`.cost` -- :class:`CostPolicy`, the one way passes price candidates;
* :mod:`.pipeline` -- :class:`Pipeline` (verification, fallback, instrumentation) and
  :class:`PassPipeline` (a pipeline that is itself a pass);
* :mod:`.verifier`, :mod:`.report`, :mod:`.dumps`, :mod:`.render` -- checking, reporting and
  drawing graphs.

Built-in passes live one level up, in :mod:`commfuse.transforms`.
"""
