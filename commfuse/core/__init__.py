"""The bottom layer: what every other layer may use and nothing in commfuse is below.

* :mod:`.errors` -- the exception types commfuse raises;
* :mod:`.torch_private` -- every private PyTorch API commfuse touches, in one place;
* :mod:`.meta` -- every key commfuse reads or writes in ``node.meta`` / ``gm.meta``, and
  ``microbatch_of``.
"""
