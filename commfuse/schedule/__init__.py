"""Scheduling problems and their solvers, for the passes that order a graph.

* :mod:`.list_scheduler` -- the scheduling problem of one graph and the greedy list scheduler;
* :mod:`.cpsat` -- exact re-ordering of small windows with OR-Tools CP-SAT;
* :mod:`.layer_level` -- Centauri's layer-level backward order (§3.2.2);
* :mod:`.model_level` -- Centauri's model-level micro-batch grouping (§3.2.3).

DHelix's strand planning (:mod:`commfuse.dhelix`) sits in this layer too and builds on these.
"""
