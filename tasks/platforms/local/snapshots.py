"""The local platform's snapshots: immutable copies of a dataset and a run, under ``snapshots/<name>``.

Separate because what makes them cheap and safe is its own rule set: files the pipeline only ever
replaces (images, checkpoints) are hard-linked, everything else is copied and frozen read-only; caches and
partial files stay out; a snapshot or a restore appears whole (built beside it, then renamed) or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.names import validate_name
from tasks.platforms.base import SnapshotRef, VolumeRef, refuse_other_data
from tasks.platforms.local.files import now, within, write_json

if TYPE_CHECKING:
    from tasks.platforms.local import LocalPlatform

LINEAGE_FILE = "lineage.json"
RESTORED_MARKER = ".laneflow-restored-from"
#: Files the pipeline only ever replaces (new inode), never rewrites in place: safe to hard-link into
#: a snapshot. Everything else (json, metrics, overlays) is copied.
_LINKABLE_SUFFIXES = (".jpg", ".jpeg", ".pt")
#: Regenerable and large: never part of a snapshot.
_SKIPPED_DIRS = ("cache",)


def create(platform: LocalPlatform, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
           lineage: dict[str, Any]) -> SnapshotRef:
    validate_name(name, "snapshot")
    final = platform.snapshots_dir() / name
    if (final / LINEAGE_FILE).is_file():
        existing = _snapshot_ref(final)
        refuse_other_data(name, existing.lineage.get("dataset_version"), lineage.get("dataset_version"))
        return existing
    partial = final.with_name(f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    content = partial / "content"
    stats = {"files": 0, "bytes": 0, "linked": 0, "copied": 0}
    for relative in (data_dir, run_dir):
        _copy_tree(platform.inside(volume, relative), content / relative, stats, freeze=True)
    record = {"snapshot": name, "volume": volume.name, "created_at": now(), "data_dir": data_dir,
              "run_dir": run_dir, "content": stats, "ready": True, **lineage}
    write_json(partial / LINEAGE_FILE, record)
    partial.rename(final)  # the snapshot appears whole or not at all
    return _snapshot_ref(final)


def wait(platform: LocalPlatform, snapshot: SnapshotRef) -> SnapshotRef:
    path = platform.snapshots_dir() / snapshot.name
    if not (path / LINEAGE_FILE).is_file():
        raise RuntimeError(f"snapshot {snapshot.name} is missing from {path.parent}")
    return _snapshot_ref(path)


def list_all(platform: LocalPlatform) -> list[SnapshotRef]:
    root = platform.snapshots_dir()
    found = [_snapshot_ref(p) for p in root.iterdir() if (p / LINEAGE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda ref: ref.lineage.get("created_at", ""))


def restore(platform: LocalPlatform, snapshot_name: str, volume_name: str) -> VolumeRef:
    source = platform.snapshots_dir() / validate_name(snapshot_name, "snapshot")
    if not (source / LINEAGE_FILE).is_file():
        known = ", ".join(ref.name for ref in platform.list_snapshots()) or "none"
        raise KeyError(f"no snapshot named '{snapshot_name}' (known: {known})")
    target = platform.volume_path(volume_name)
    if target.exists():
        marker = target / RESTORED_MARKER
        if marker.is_file() and marker.read_text().strip() == snapshot_name:
            return VolumeRef(name=volume_name, location=str(target), created=False)
        raise FileExistsError(f"volume '{volume_name}' already exists and was not restored from "
                              f"'{snapshot_name}'; choose a new volume name")
    partial = target.with_name(f".{volume_name}.restoring")
    shutil.rmtree(partial, ignore_errors=True)
    _copy_tree(source / "content", partial, {"files": 0, "bytes": 0, "linked": 0, "copied": 0}, freeze=False)
    (partial / RESTORED_MARKER).write_text(snapshot_name + "\n")
    partial.rename(target)
    return VolumeRef(name=volume_name, location=str(target), created=True)


def find_lineage(platform: LocalPlatform, name: str) -> dict[str, Any]:
    snapshot = platform.snapshots_dir() / name / LINEAGE_FILE
    if not snapshot.is_file():
        raise KeyError(f"no snapshot named '{name}' under {platform.snapshots_dir()}")
    return json.loads(snapshot.read_text())


def read_file(platform: LocalPlatform, name: str, relative_path: str) -> bytes:
    content = platform.snapshots_dir() / validate_name(name, "snapshot") / "content"
    path = within(content.resolve(), relative_path, f"snapshot '{name}'")
    if not path.is_file():
        raise FileNotFoundError(f"{relative_path} is not in snapshot '{name}' ({content})")
    return path.read_bytes()


def _copy_tree(source: Path, target: Path, stats: dict[str, int], *, freeze: bool) -> None:
    """Hard-link files that are only ever replaced, copy the rest; ``freeze`` makes copies read-only."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source} does not exist: nothing to copy")
    for directory, subdirs, files in os.walk(source):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
        here = Path(directory)
        out = target / here.relative_to(source)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            src, dst = here / name, out / name
            if name.endswith((".tmp", ".part")):
                continue
            linkable = name.lower().endswith(_LINKABLE_SUFFIXES) or (name.endswith(".png") and "seg_label" in src.parts)
            if linkable:
                try:
                    os.link(src, dst)
                    stats["linked"] += 1
                except OSError:  # another file system: copy instead
                    shutil.copy2(src, dst)
                    stats["copied"] += 1
            else:
                shutil.copy2(src, dst)
                os.chmod(dst, 0o444 if freeze else 0o644)
                stats["copied"] += 1
            stats["files"] += 1
            stats["bytes"] += dst.stat().st_size


def _snapshot_ref(path: Path) -> SnapshotRef:
    lineage = json.loads((path / LINEAGE_FILE).read_text())
    return SnapshotRef(name=path.name, volume=lineage.get("volume", ""), ready=bool(lineage.get("ready")),
                       location=str(path), lineage=lineage)
