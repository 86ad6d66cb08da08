"""The boundary rules, one module each.

Each module defines ``match_<rule>(site, env) -> Match | str``: for one forward transfer
(:class:`~commfuse.analysis.boundary.matching.Site`) it returns the rewrite
(:class:`~commfuse.analysis.boundary.matching.Match`, applied by the caller only when the
per-rank boundary bytes do not grow) or the reason it refuses. Each module opens with its
contract (what it matches, what it produces, what it refuses, and why the replacement is the
same program). The rule table is :data:`commfuse.analysis.boundary.MATCHERS`.
"""
