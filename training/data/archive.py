"""Safe, streaming, idempotent extraction of dataset archives (zip, tar, tar.gz).

Entries are streamed in fixed-size chunks into a staging folder beside the target and renamed
into place only when the whole archive extracted cleanly, so a failed or refused archive leaves
nothing behind. Absolute paths, ``..`` components and links that would point outside the target
are refused before anything is written. A marker records the archive's sha256, so extracting the
same archive again is skipped.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from training.data.labels import is_safe_relative_path

log = logging.getLogger("laneflow.data.archive")

MARKER = ".laneflow-extracted.json"
CHUNK_BYTES = 1 << 20


class UnsafeArchiveError(ValueError):
    """An archive entry that would write outside the target folder."""


@dataclass(frozen=True)
class ArchiveEntry:
    name: str
    kind: str  # "file" | "dir" | "symlink" | "hardlink"
    link_target: str | None = None


def check_entry(entry: ArchiveEntry) -> str:
    """Return the entry's normalised relative path or raise naming why it is unsafe.

    Links must resolve (relative to their own folder, or to the root for hard links) inside the target.
    """
    name = entry.name.rstrip("/")
    while name.startswith("./"):
        name = name[2:]
    if name == "." and entry.kind == "dir":
        return "."  # the archive's own root folder, as written by `tar -C dir -cf x.tar .`
    if not name or not is_safe_relative_path(name):
        raise UnsafeArchiveError(f"archive entry '{entry.name}' is an absolute path or leaves the target with '..'")
    if entry.kind in ("symlink", "hardlink"):
        target = entry.link_target or ""
        if not target or posixpath.isabs(target) or "\\" in target:
            raise UnsafeArchiveError(f"archive link '{entry.name}' -> '{target}' points outside the target")
        base = posixpath.dirname(name) if entry.kind == "symlink" else ""
        resolved = posixpath.normpath(posixpath.join(base, target))
        if resolved == ".." or resolved.startswith("../"):
            raise UnsafeArchiveError(f"archive link '{entry.name}' -> '{target}' points outside the target")
    elif entry.kind not in ("file", "dir"):
        raise UnsafeArchiveError(
            f"archive entry '{entry.name}' is a {entry.kind}; only files, folders and links are allowed")
    return name


def _zip_entry(info: zipfile.ZipInfo, archive: zipfile.ZipFile) -> ArchiveEntry:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return ArchiveEntry(info.filename, "symlink", archive.read(info).decode("utf-8", "replace"))
    return ArchiveEntry(info.filename, "dir" if info.is_dir() else "file")


def _tar_entry(member: tarfile.TarInfo) -> ArchiveEntry:
    if member.isdir():
        return ArchiveEntry(member.name, "dir")
    if member.isfile():
        return ArchiveEntry(member.name, "file")
    if member.issym():
        return ArchiveEntry(member.name, "symlink", member.linkname)
    if member.islnk():
        return ArchiveEntry(member.name, "hardlink", member.linkname)
    return ArchiveEntry(member.name, "device or fifo")


def archive_kind(archive: Path) -> str:
    """"zip" or "tar" from the file's leading bytes (a tar may well contain a zip near its end)."""
    with archive.open("rb") as handle:
        head = handle.read(4)
    if head in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if tarfile.is_tarfile(archive):
        return "tar"
    raise ValueError(f"{archive} is neither a zip nor a tar archive")


def _check_links_stay_inside(root: Path) -> None:
    """Resolve every extracted symlink on disk: chains of individually harmless links can still escape."""
    real_root = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                resolved = os.path.realpath(path)
                if os.path.commonpath([real_root, resolved]) != real_root:
                    rel = os.path.relpath(path, root)
                    raise UnsafeArchiveError(
                        f"archive link '{rel}' -> '{os.readlink(path)}' resolves outside the target")


def read_marker(target: Path) -> dict | None:
    try:
        return json.loads((target / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def extract(archive: str | Path, target: str | Path, archive_sha256: str) -> bool:
    """Extract ``archive`` into ``target``; returns False when it was already extracted from the same bytes."""
    archive, target = Path(archive), Path(target)
    marker = read_marker(target)
    if marker and marker.get("archive_sha256") == archive_sha256:
        log.info("%s already extracted from archive sha256 %s; skipping", target, archive_sha256)
        return False
    if not archive.is_file():
        raise FileNotFoundError(f"archive {archive} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.extracting")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        kind = archive_kind(archive)
        count = _extract_zip(archive, staging) if kind == "zip" else _extract_tar(archive, staging)
        _check_links_stay_inside(staging)
        (staging / MARKER).write_text(json.dumps({"archive": archive.name, "archive_sha256": archive_sha256,
                                                   "entries": count}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("extracted %d entries from %s into %s", count, archive.name, target)
    return True


def _extract_zip(archive: Path, staging: Path) -> int:
    with zipfile.ZipFile(archive) as zf:
        # The central directory is cheap to read: refuse the archive before writing anything.
        entries = [(info, _zip_entry(info, zf)) for info in zf.infolist()]
        names = [check_entry(entry) for _, entry in entries]
        for (info, entry), name in zip(entries, names, strict=True):
            _write_entry(staging, name, entry, lambda info=info: zf.open(info))
    return len(entries)


def _extract_tar(archive: Path, staging: Path) -> int:
    count = 0
    # "r|*" streams: one pass over a possibly huge compressed archive, entries checked as they come.
    with tarfile.open(archive, mode="r|*") as tf:
        for member in tf:
            entry = _tar_entry(member)
            name = check_entry(entry)
            _write_entry(staging, name, entry, lambda member=member: tf.extractfile(member))
            count += 1
    return count


def _write_entry(root: Path, name: str, entry: ArchiveEntry, open_source) -> None:
    if name == ".":
        return
    path = root / name
    # A parent that is a symlink could redirect the write; never follow one.
    for parent in list(path.relative_to(root).parents)[:-1]:
        if (root / parent).is_symlink():
            raise UnsafeArchiveError(f"archive entry '{entry.name}' would be written through the link '{parent}'")
    if entry.kind == "dir":
        path.mkdir(parents=True, exist_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    if entry.kind == "symlink":
        os.symlink(entry.link_target, path)
    elif entry.kind == "hardlink":
        source = root / posixpath.normpath(entry.link_target)
        link = f"archive hard link '{entry.name}' -> '{entry.link_target}'"
        real_root, real_source = os.path.realpath(root), os.path.realpath(source)
        if os.path.commonpath([real_root, real_source]) != real_root:
            raise UnsafeArchiveError(f"{link} resolves outside the target")
        if source.is_symlink() or not source.is_file():
            raise UnsafeArchiveError(f"{link} has no file to link to")
        os.link(source, path, follow_symlinks=False)
    else:
        with open_source() as src, path.open("wb") as out:
            shutil.copyfileobj(src, out, CHUNK_BYTES)
