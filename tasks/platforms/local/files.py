"""Files on this machine's disk as the local platform keeps them: paths held inside a root, JSON records
replaced whole, UTC time stamps.

Separate because the block (volumes), the launcher (its per-run record) and the snapshots (their
lineage) all write them, and each must refuse a path that leaves its root the same way.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def within(base: Path, relative: str, what: str) -> Path:
    """``base / relative`` resolved, refused when it leaves ``base`` (``..``, an absolute path, a link)."""
    path = (base / relative).resolve()
    if path != base and base not in path.parents:
        raise ValueError(f"path '{relative}' leaves {what}")
    return path


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replaced whole (temporary file, then rename): a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
