"""Where dumps go: one sub-directory per rank under the dump dir, and one index at its top.

Every rank of a job is given the same dump dir (``Config(dump_dir=...)`` or
``COMMFUSE_DUMP_DIR``, which torchrun hands to every rank alike). Written as given, the ranks'
graph dumps would overwrite each other under the same names, so each rank writes into
``<dump_dir>/rank<r>/`` (``r`` the global rank). A process without a process group is rank 0
and writes into ``rank0/`` too: one layout for every run, so the readers (``commfuse volume``,
``report``, ``validate``) never guess. A dump dir that already ends in this rank's
``rank<r>`` (the older recipe ``dump_dir=f"dumps/rank{rank}"``) is that rank's directory as
it is, and its parent is the top.

``<dump_dir>/index.json`` lists what every rank wrote (:func:`update_dump_index`)::

    {"format": "commfuse-dumps", "version": 1, "layout": "rank<r>/<kind>_<index>/",
     "world_size": 2,
     "ranks": [{"rank": 0, "dir": "rank0", "graphs": ["forward_000", ...], "files": [...]}, ...]}

Each rank rewrites its own entry (from its directory on disk) after each graph it dumps and
keeps the others' entries, under a file lock and by an atomic rename, so the index lists every
rank's dumps whatever order the ranks finish in, and an update lists one directory however
many ranks the job has. On a dump dir that is not shared between nodes, each node's index
lists the ranks of that node.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

INDEX_FILE = "index.json"
_RANK_DIR = re.compile(r"rank(\d+)")

try:  # POSIX: serialise the ranks' rewrites of the index
    import fcntl
except ImportError:  # pragma: no cover - Windows: last writer wins
    fcntl = None  # type: ignore[assignment]


def rank_dump_dir(dump_dir: Union[str, os.PathLike], rank: Optional[int]) -> tuple[Path, Path]:
    """``(top, rank_dir)`` for ``dump_dir`` and this process's ``rank`` (None: no process group,
    rank 0). ``rank_dir`` is ``top/rank<r>``."""
    d = Path(dump_dir)
    r = 0 if rank is None else rank
    if d.name == f"rank{r}":
        return d.parent, d
    return d, d / f"rank{r}"


def rank_of_dir(path: Union[str, os.PathLike]) -> Optional[int]:
    """``r`` for a directory named ``rank<r>``, else None."""
    m = _RANK_DIR.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def _describe_rank(d: Path, rank: int) -> dict[str, Any]:
    with os.scandir(d) as it:
        entries = sorted(it, key=lambda e: e.name)
    return {
        "rank": rank,
        "dir": d.name,
        "graphs": [e.name for e in entries if e.is_dir()],
        "files": [e.name for e in entries if e.is_file()],
    }


def _rank_dirs(top: Path) -> dict[int, Path]:
    out = {}
    with os.scandir(top) as it:
        for e in it:
            r = rank_of_dir(e.name)
            if r is not None and e.is_dir():
                out[r] = Path(e.path)
    return out


def update_dump_index(
    top: Union[str, os.PathLike], rank: Optional[int] = None, world_size: Optional[int] = None
) -> Path:
    """Rewrite ``top/index.json``: the entry of ``rank`` from its ``rank<r>/`` directory, the
    other ranks' entries as the index held them (None: every ``rank<r>/`` under ``top``, read
    from disk). One directory listing per call, however many ranks the job has. Raises
    ``OSError`` when it cannot be written (callers that must not fail catch it)."""
    top = Path(top)
    top.mkdir(parents=True, exist_ok=True)
    path = top / INDEX_FILE
    with open(top / ".index.lock", "a") as lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: the rewrite is still atomic
                pass
        old = read_dump_index(top) or {}
        entries: dict[int, dict[str, Any]] = {}
        if rank is None:
            for r, d in _rank_dirs(top).items():
                entries[r] = _describe_rank(d, r)
        else:
            for e in old.get("ranks") or []:
                if (
                    isinstance(e, dict)
                    and isinstance(e.get("rank"), int)
                    and (top / str(e.get("dir"))).is_dir()
                ):
                    entries[e["rank"]] = e
            mine = top / f"rank{rank}"
            if mine.is_dir():
                entries[rank] = _describe_rank(mine, rank)
        doc = {
            "format": "commfuse-dumps",
            "version": 1,
            "layout": "rank<r>/<kind>_<index>/",
            "world_size": world_size if world_size is not None else old.get("world_size"),
            "ranks": [entries[r] for r in sorted(entries)],
        }
        fd, tmp = tempfile.mkstemp(dir=top, prefix=".index.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, path)  # readers never see a half-written index
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def read_dump_index(top: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
    """The index of a dump dir, or None when it has none (dumps written before the index, or a
    rank's own directory)."""
    try:
        return json.loads((Path(top) / INDEX_FILE).read_text())
    except (OSError, ValueError):
        return None
