"""Exception types raised by commfuse.

Every user-facing error names the offending field or pass so that a user can
fix the input without reading commfuse's source.
"""

from __future__ import annotations


class CommfuseError(Exception):
    """Base class of every error commfuse raises on purpose."""


class ConfigError(CommfuseError, ValueError):
    """A ``Config``/``Topology`` value is invalid; the message names the field."""


class VerificationError(CommfuseError):
    """The verifier found a graph that violates commfuse's invariants."""

    def __init__(self, problems: list[str], *, after_pass: str | None = None) -> None:
        self.problems = list(problems)
        self.after_pass = after_pass
        where = f" after pass '{after_pass}'" if after_pass else ""
        body = "\n  - ".join(self.problems)
        super().__init__(f"graph verification failed{where}:\n  - {body}")


class PassError(CommfuseError):
    """A pass raised; wraps the original exception with the pass name."""

    def __init__(self, pass_name: str, cause: BaseException) -> None:
        self.pass_name = pass_name
        self.cause = cause
        super().__init__(f"pass '{pass_name}' failed: {type(cause).__name__}: {cause}")


class InputFileError(ConfigError):
    """An input file cannot be read or does not hold what it should.

    ``path`` and ``problem`` are kept apart so that the command line can print
    ``commfuse <cmd>: <path>: <problem>``; ``message`` lets a loader keep the wording its
    callers already match on (``str(e)`` defaults to ``"<path>: <problem>"``).
    """

    def __init__(self, path: object, problem: str, message: str | None = None) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(message or f"{self.path}: {problem}")
