"""Commands built on the library (``python -m commfuse ...``) and the multi-rank helper they share.

* :mod:`.cli` -- the ``commfuse`` parser: one subcommand per command module, exit statuses, errors;
* :mod:`.demo` -- ``demo``: a TP+SP Llama block on 4 gloo CPU ranks, compiled with commfuse;
* :mod:`.calibrate` -- ``calibrate``: measure this machine and write a cost profile;
* :mod:`.profile_overlap` -- ``profile-overlap``: measure DHelix's overlap factors;
* :mod:`.rank_pool` -- a persistent pool of real gloo rank processes (the tools' and the tests').
"""
