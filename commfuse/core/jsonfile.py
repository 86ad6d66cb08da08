"""Reading the JSON files commfuse writes (dumps, recorder traces) back, with errors that name the file.

``json.loads`` and pydantic say what is wrong but not in which file; a dump dir holds hundreds
of them, so every reader goes through here and a bad one is an :class:`InputFileError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from commfuse.core.errors import InputFileError

M = TypeVar("M", bound=BaseModel)


def _describe(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "(top level)"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"invalid {where}: {first.get('msg', 'invalid value')}{more}"


def _read_text(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputFileError(path, f"cannot read {what}: {getattr(e, 'strerror', None) or e}") from e


def read_json_file(path: str | Path, what: str = "JSON file") -> Any:
    """The JSON document in ``path``; an unreadable or corrupt file is an InputFileError."""
    text = _read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(path, f"not valid JSON ({what}): {e}") from e


def read_json_object(path: str | Path, what: str, list_of_objects: str | None = None) -> dict[str, Any]:
    """A JSON object from ``path``; with ``list_of_objects``, that key must hold a list of objects
    (a Chrome trace's ``traceEvents``). Checked here, where the file's name is known, so that a
    wrong file fails with its name rather than an AttributeError deep in a reader."""
    doc = read_json_file(path, what)
    if not isinstance(doc, dict):
        raise InputFileError(path, f"not a {what}: expected a JSON object, got {type(doc).__name__}")
    if list_of_objects is not None:
        items = doc.get(list_of_objects)
        if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
            raise InputFileError(path, f"not a {what}: expected {list_of_objects!r} to be a list of objects")
    return doc


def read_model_file(cls: type[M], path: str | Path, what: str | None = None) -> M:
    """``cls`` validated from the JSON file ``path`` (pydantic's JSON mode, as
    ``model_validate_json``); corrupt JSON or invalid fields name the file."""
    what = what or cls.__name__
    text = _read_text(path, what)
    try:
        return cls.model_validate_json(text)
    except ValidationError as e:
        if e.errors()[0].get("type") == "json_invalid":
            raise InputFileError(path, f"not valid JSON ({what}): {e.errors()[0].get('msg')}") from e
        raise InputFileError(path, f"not a valid {what}: {_describe(e)}") from e


__all__ = ["read_json_file", "read_json_object", "read_model_file"]
