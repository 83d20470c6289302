"""Safe, streaming, idempotent extraction of dataset archives (zip, tar, tar.gz).

Entries are streamed in fixed-size chunks into a staging folder beside the target and renamed
into place only when the whole archive extracted cleanly, so a failed or refused archive leaves
nothing behind. Absolute paths, ``..`` components and links that would point outside the target
are refused before anything is written. A marker records the archive's sha256, so extracting the
same archive again is skipped.
"""

from __future__ import annotations

import filecmp
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from training.data.labels import is_safe_relative_path
from training.data.space import allocated, archive_needs, block_bytes, ensure_free, names_a_full_volume

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


def updated_files(target: Path) -> set[str]:
    """The paths (relative to ``target``) an artifact of kind update put into the folder ``assemble`` built."""
    return set((read_marker(target) or {}).get("updated") or [])


def read_marker(target: Path) -> dict | None:
    try:
        return json.loads((target / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _unpack(archive: Path, into: Path) -> int:
    """Extract a zip or tar into the empty folder ``into``, refusing unsafe entries; the entry count."""
    kind = archive_kind(archive)
    count = _extract_zip(archive, into) if kind == "zip" else _extract_tar(archive, into)
    _check_links_stay_inside(into)
    return count


def _replace_dir(staging: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)


def _ensure_room(step: str, parts: list[tuple[Path, str]], where: Path, volume: Path) -> None:
    """Refuse ``step`` before it writes when the volume cannot hold what ``parts`` ((path, "archive" or
    "file")) unpack to. A compressed tar's size is unknown until it is decompressed: the others still count."""
    block = block_bytes(where)
    needed = 0
    for path, kind in parts:
        size = archive_needs(path, block) if kind != "file" else allocated(path.stat().st_size, block)
        if size is None:
            log.info("%s is a compressed tar: its unpacked size is known only once it is extracted", path.name)
            continue
        needed += size
    ensure_free(step, volume, where, needed)


def extract(archive: str | Path, target: str | Path, archive_sha256: str, volume: Path | None = None) -> bool:
    """Extract ``archive`` into ``target``; returns False when it was already extracted from the same bytes.

    Refused before anything is written when ``volume`` (the folder errors name; default: ``target``'s
    parent) lacks the space the archive's index says it needs."""
    archive, target = Path(archive), Path(target)
    volume = volume or target.parent
    marker = read_marker(target)
    if marker and marker.get("archive_sha256") == archive_sha256:
        log.info("%s already extracted from archive sha256 %s; skipping", target, archive_sha256)
        return False
    if not archive.is_file():
        raise FileNotFoundError(f"archive {archive} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.extracting")
    shutil.rmtree(staging, ignore_errors=True)
    step = f"extract {archive.name}"
    _ensure_room(step, [(archive, "archive")], target.parent, volume)
    staging.mkdir()
    try:
        with names_a_full_volume(step, volume, staging):
            count = _unpack(archive, staging)
            (staging / MARKER).write_text(json.dumps({"archive": archive.name, "archive_sha256": archive_sha256,
                                                       "entries": count}))
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("extracted %d entries from %s into %s", count, archive.name, target)
    return True


@dataclass(frozen=True)
class Part:
    """A verified download that goes into a dataset: an archive to extract, or a file to place."""

    path: Path
    sha256: str
    kind: str  # "archive" | "file"


#: Files that say "this folder is a TuSimple root" (``clips/`` beside the label or task files).
_ROOT_MARKERS = ("clips", "label_data_0313.json", "label_data_0601.json", "label_data_0531.json",
                 "test_label.json", "test_tasks_0627.json")


#: Folders that say "this folder is a CULane root": a driver's frames (``driver_23_30frame``), the shipped
#: segmentation labels, the lists. CULane ships each as an archive of its own that wraps just that folder.
_CULANE_ROOT_FOLDER = re.compile(r"(driver_\d+_\d+frame|laneseg_label_w16|list)")  # see training.data.culane


def content_root(folder: Path) -> Path:
    """Where an extracted archive's dataset content starts: the folder itself, or the single wrapping
    folder(s) some mirrors add (``train_set/clips/...``) — never a ``clips`` folder itself, nor one of
    CULane's driver, label or list folders."""
    while True:
        if any((folder / marker).exists() for marker in _ROOT_MARKERS) or any(
                child.is_dir() and _CULANE_ROOT_FOLDER.fullmatch(child.name) for child in folder.iterdir()):
            return folder
        children = [child for child in folder.iterdir() if child.name != MARKER]
        if len(children) == 1 and children[0].is_dir() and not children[0].is_symlink():
            folder = children[0]
            continue
        return folder


#: How ``_merge`` marks a path an update put there.
UPDATE_OWNER = "update "


def _merge(source: Path, target: Path, origin: str, owners: dict[str, str], replace: bool = False) -> int:
    """Move ``source``'s files into ``target``; a path two artifacts both hold must hold the same bytes, unless
    ``source`` is an update, whose files replace what the others put there."""
    moved = 0
    for directory, _, files in os.walk(source):
        here = Path(directory)
        for name in files:
            src = here / name
            relative = src.relative_to(source).as_posix()
            dst = target / relative
            if dst.exists() or dst.is_symlink():
                # Two updates that disagree would make the dataset depend on their order: refused too.
                clash = not replace or owners[relative].startswith(UPDATE_OWNER)
                if clash and not filecmp.cmp(src, dst, shallow=False):
                    raise ValueError(f"'{relative}' is in both {owners[relative].removeprefix(UPDATE_OWNER)} and "
                                     f"{origin} with different contents; the artifacts do not belong to one dataset")
                if not replace:
                    continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
            owners[relative] = UPDATE_OWNER + origin if replace else origin
            moved += 1
    return moved


def assemble(parts: list[Part], target: str | Path, volume: Path | None = None) -> bool:
    """Build one dataset folder from several artifacts; False when ``target`` was built from the same ones.

    Archives are extracted (each into its own staging folder, with every safety check of ``extract``)
    and merged by content root, so the test clips of ``test_set.zip`` land in the same
    ``clips/<date>/`` folders as the training clips of ``train_set.zip``; files are placed at the root.
    The folder appears whole or not at all, and is refused before anything is written when ``volume``
    (default: ``target``'s parent) lacks the space the archives' indexes and the files' sizes add up to.
    """
    target = Path(target)
    volume = volume or target.parent
    wanted = [{"name": part.path.name, "sha256": part.sha256, "kind": part.kind} for part in parts]
    marker = read_marker(target)
    if marker and sorted(map(json.dumps, marker.get("artifacts", []))) == sorted(map(json.dumps, wanted)):
        log.info("%s already assembled from these %d artifacts; skipping", target, len(parts))
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.assembling")
    shutil.rmtree(staging, ignore_errors=True)
    for part in parts:
        if not part.path.is_file():
            raise FileNotFoundError(f"artifact {part.path} does not exist")
    step = "extract " + ", ".join(part.path.name for part in parts)
    _ensure_room(step, [(part.path, part.kind) for part in parts], target.parent, volume)
    merged = staging / "dataset"
    merged.mkdir(parents=True)
    owners: dict[str, str] = {}
    entries = 0
    try:
        with names_a_full_volume(step, volume, staging):
            # Updates last, whatever the order given: they replace what the archives and files hold.
            for index, part in sorted(enumerate(parts), key=lambda indexed: indexed[1].kind == "update"):
                if part.kind in ("archive", "update"):
                    unpacked = staging / f"part-{index}"
                    unpacked.mkdir()
                    entries += _unpack(part.path, unpacked)
                    _merge(content_root(unpacked), merged, part.path.name, owners, replace=part.kind == "update")
                    shutil.rmtree(unpacked)
                else:
                    single = staging / f"part-{index}"
                    single.mkdir()
                    shutil.copyfile(part.path, single / part.path.name)
                    entries += _merge(single, merged, part.path.name, owners)
            _check_links_stay_inside(merged)
            # What the updates put there: a label drawn from lines an update replaced is stale (preprocess_culane).
            updated = sorted(path for path, owner in owners.items() if owner.startswith(UPDATE_OWNER))
            (merged / MARKER).write_text(json.dumps({"artifacts": wanted, "entries": entries, "updated": updated}))
            _replace_dir(merged, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("assembled %s from %d artifacts (%d archive entries)", target, len(parts), entries)
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
