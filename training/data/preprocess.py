"""Turn a TuSimple-format folder into training inputs: lane masks, list files and a manifest.

Layout written into the dataset root (DESIGN §4)::

    seg_label/<date>/<id>/20.png             uint8 mask: 0 background, 1..4 lane slot left to right
    seg_label/list/{train,val,test}_gt.txt   "/<img> /<mask> e1 e2 e3 e4"
    manifest.json                            checksums, counts, quarantine report, dataset version

Records are checked and rasterized in parallel worker processes; a bad record is quarantined with
its label file, line and reason instead of failing the run. A re-run on unchanged inputs finds the
manifest's input fingerprint unchanged and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cv2

from training.data import labels
from training.data.images import UnreadableImage, image_size
from training.data.labels import LABEL_FILES, SPLITS, LabelError, QuarantineReason
from training.data.png import encode_gray_png_scanlines
from training.data.space import block_bytes, ensure_free, names_a_full_volume
from training.parallel import process_pool

log = logging.getLogger("laneflow.data.preprocess")

MANIFEST = "manifest.json"
SCHEMA = "laneflow.tusimple-prepared/1"
#: Everything that changes the produced masks; part of the dataset version.
PARAMS = {
    "opencv_thickness_at_1280": labels.THICKNESS_AT_REFERENCE,
    "min_points_for_existence": labels.MIN_POINTS_FOR_EXISTENCE,
    "slots": labels.NUM_SLOTS,
    "slot_rule": "angle-nearest-two-per-side",
}


class DatasetLayoutError(ValueError):
    """The folder does not look like a TuSimple dataset."""


@dataclass(frozen=True)
class Located:
    """A line of a label file, remembered by where it came from."""

    label_file: str
    line: int
    split: str
    text: str


@dataclass(frozen=True)
class Kept:
    label_file: str
    line: int
    split: str
    raw_file: str
    mask_file: str
    existence: tuple[int, ...]
    image_sha256: str


@dataclass(frozen=True)
class Quarantined:
    label_file: str
    line: int
    reason: str
    detail: str
    raw_file: str | None = None

    def as_dict(self) -> dict:
        return {"file": self.label_file, "line": self.line, "reason": self.reason, "detail": self.detail,
                "raw_file": self.raw_file}


@dataclass
class PrepareReport:
    root: Path
    dataset_version: str
    counts: dict
    skipped: bool
    manifest: dict = field(repr=False)


def find_dataset_root(path: str | Path) -> Path:
    """The folder holding the label files: ``path`` itself or its single sub-folder that does."""
    path = Path(path)
    if not path.is_dir():
        raise DatasetLayoutError(f"dataset folder {path} does not exist")
    if any((path / name).is_file() for name in LABEL_FILES):
        return path
    found = [child for child in sorted(path.iterdir()) if child.is_dir()
             and any((child / name).is_file() for name in LABEL_FILES)]
    if len(found) == 1:
        return found[0]
    expected = ", ".join(LABEL_FILES)
    if not found:
        raise DatasetLayoutError(f"no TuSimple label files ({expected}) in {path} or its sub-folders")
    raise DatasetLayoutError(f"several folders under {path} hold label files: {', '.join(map(str, found))}; "
                             "point at one of them")


def read_label_lines(root: Path) -> tuple[list[Located], dict[str, dict]]:
    """All non-blank label lines with their location, and each label file's sha256 and split."""
    located: list[Located] = []
    sources: dict[str, dict] = {}
    for name, split in LABEL_FILES.items():
        path = root / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        sources[name] = {"sha256": hashlib.sha256(data).hexdigest(), "split": split, "bytes": len(data)}
        for lineno, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if text.strip():
                located.append(Located(name, lineno, split, text))
    return located, sources


def peek_raw_file(text: str) -> str | None:
    """The line's ``raw_file`` if it has a usable one; full validation happens in the workers."""
    try:
        raw_file = labels.load_json_line(text).get("raw_file")
    except (LabelError, AttributeError):
        return None
    return raw_file if isinstance(raw_file, str) and labels.is_safe_relative_path(raw_file) else None


def process_line(item: Located, root: Path) -> Kept | Quarantined:
    """Parse and check one label line, then write its mask. Runs in a worker process."""
    try:
        record = labels.parse_label_line(item.text)
    except LabelError as exc:
        return Quarantined(item.label_file, item.line, exc.reason, exc.detail)

    def quarantine(reason: str, detail: str) -> Quarantined:
        return Quarantined(item.label_file, item.line, reason, detail, record.raw_file)

    image_path = root / record.raw_file
    try:
        data = image_path.read_bytes()
    except FileNotFoundError:
        return quarantine(QuarantineReason.MISSING_IMAGE, f"image {record.raw_file} does not exist")
    except OSError as exc:
        return quarantine(QuarantineReason.UNREADABLE_IMAGE, f"image {record.raw_file}: {exc.strerror}")
    try:
        width, height = image_size(data)
    except UnreadableImage as exc:
        return quarantine(QuarantineReason.UNREADABLE_IMAGE, f"image {record.raw_file}: {exc}")
    try:
        labels.check_against_image(record, width, height)
    except LabelError as exc:
        return quarantine(exc.reason, exc.detail)
    slots = labels.assign_slots(record.lanes, record.h_samples)
    top, scanlines = labels.rasterize_band(slots, width, height, pad_left=1)
    mask_file = labels.mask_path_for(record.raw_file)
    mask_path = root / mask_file
    mask_path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh inode, never a rewrite in place: snapshots hard-link masks and must keep their version.
    mask_path.unlink(missing_ok=True)
    mask_path.write_bytes(encode_gray_png_scanlines(scanlines, top, height))
    return Kept(item.label_file, item.line, item.split, record.raw_file, mask_file,
                labels.existence_flags(slots), hashlib.sha256(data).hexdigest())


# Worker-process state: the dataset root and what to do with a line are sent once per worker, not per record.
_worker_root: Path | None = None
_worker_process: Callable[[Located, Path], Kept | Quarantined] = process_line


def _init_worker(root: str, process: Callable[[Located, Path], Kept | Quarantined]) -> None:
    global _worker_root, _worker_process
    _worker_root, _worker_process = Path(root), process
    cv2.setNumThreads(1)


def _process_in_worker(item: Located) -> Kept | Quarantined:
    assert _worker_root is not None
    return _worker_process(item, _worker_root)


def inputs_fingerprint(root: Path, sources: dict[str, dict], raw_files: list[str | None]) -> str:
    """Cheap identity of the inputs: label checksums, params, and size+mtime of every named image."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"schema": SCHEMA, "params": PARAMS, "sources": sources}, sort_keys=True).encode())
    for raw_file in raw_files:
        if raw_file is None:
            continue
        try:
            st = (root / raw_file).stat()
            digest.update(f"{raw_file}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{raw_file}\0missing\n".encode())
    return digest.hexdigest()


def dataset_version(sources: dict[str, dict], kept: list[Kept]) -> str:
    """Content identity of the prepared dataset: params, label checksums, and each kept image's bytes."""
    digest = hashlib.sha256()
    label_sums = {name: info["sha256"] for name, info in sources.items()}
    digest.update(json.dumps({"schema": SCHEMA, "params": PARAMS, "labels": label_sums}, sort_keys=True).encode())
    for item in sorted(kept, key=lambda k: (k.split, k.raw_file)):
        digest.update(f"{item.split}\0{item.raw_file}\0{item.image_sha256}\0{item.existence}\n".encode())
    return digest.hexdigest()[:16]


def _outputs_present(root: Path, manifest: dict) -> bool:
    return all((root / path).is_file() for path in manifest.get("lists", {}).values())


def load_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def preprocess(
    dataset_dir: str | Path,
    *,
    workers: int | None = None,
    sources_extra: dict | None = None,
    force: bool = False,
    volume: Path | None = None,
) -> PrepareReport:
    """Prepare masks, list files and manifest under the dataset root; a no-op when inputs are unchanged.

    Refused before any mask is written when ``volume`` (the folder errors name; default: the dataset
    root) has not even one block free per mask; a volume that fills up anyway is named with the path."""
    root = find_dataset_root(dataset_dir)
    volume = volume or root
    located, sources = read_label_lines(root)
    raw_files = [peek_raw_file(item.text) for item in located]
    fingerprint = inputs_fingerprint(root, sources, raw_files)
    previous = load_manifest(root)
    if (not force and previous and previous.get("inputs_fingerprint") == fingerprint
            and _outputs_present(root, previous)):
        log.info("inputs unchanged since the last preparation; dataset version %s", previous["dataset_version"])
        return PrepareReport(root, previous["dataset_version"], previous["counts"], True, previous)

    outcomes: list[Kept | Quarantined] = []
    jobs: list[Located] = []
    # Lines naming the same image would write the same mask: settle them here, before any worker
    # runs. The first well-formed line wins; the others keep their own reason or become duplicates.
    # Only these rare lines are parsed in this process; the rest are parsed in parallel by the workers.
    occurrences = Counter(raw_file for raw_file in raw_files if raw_file is not None)
    claimed: dict[str, Located] = {}
    for item, raw_file in zip(located, raw_files, strict=True):
        if raw_file is None or occurrences[raw_file] == 1:
            jobs.append(item)
            continue
        try:
            labels.parse_label_line(item.text)
        except LabelError as exc:
            outcomes.append(Quarantined(item.label_file, item.line, exc.reason, exc.detail, raw_file))
            continue
        first = claimed.setdefault(raw_file, item)
        if first is not item:
            outcomes.append(Quarantined(item.label_file, item.line, QuarantineReason.DUPLICATE,
                                        f"{raw_file} is already labelled at {first.label_file}:{first.line}",
                                        raw_file))
            continue
        jobs.append(item)

    step = "write the lane masks"
    ensure_free(step, volume, root, len(jobs) * block_bytes(root))  # each mask takes at least one block
    with names_a_full_volume(step, volume, root / "seg_label"):
        outcomes.extend(run_jobs(jobs, root, workers))
    outcomes.sort(key=lambda o: (list(LABEL_FILES).index(o.label_file), o.line))
    kept = [o for o in outcomes if isinstance(o, Kept)]
    quarantined = [o for o in outcomes if isinstance(o, Quarantined)]
    with names_a_full_volume("write the list files", volume, root / "seg_label" / "list"):
        lists = _write_lists(root, kept)

    counts = summarize_counts(located, kept, quarantined)
    version = dataset_version(sources, kept)
    manifest = {
        "schema": SCHEMA,
        "dataset_version": version,
        "params": PARAMS,
        "sources": {"label_files": sources, **(sources_extra or {})},
        "counts": counts,
        "lists": lists,
        "quarantine": [q.as_dict() for q in quarantined],
        "inputs_fingerprint": fingerprint,
    }
    with names_a_full_volume("write the manifest", volume, root / MANIFEST):
        write_atomic(root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for q in quarantined:
        log.warning("quarantined %s:%d (%s): %s", q.label_file, q.line, q.reason, q.detail)
    log.info("prepared %s: read %d, kept %d, quarantined %d; dataset version %s",
             root, counts["read"], counts["kept"], counts["quarantined"], version)
    return PrepareReport(root, version, counts, False, manifest)


def summarize_counts(located: list[Located], kept: list[Kept], quarantined: list[Quarantined]) -> dict:
    """read = kept + quarantined, overall and per split, plus quarantine reasons."""
    split_of = {(item.label_file, item.line): item.split for item in located}
    by_split = {split: {"read": 0, "kept": 0, "quarantined": 0} for split in SPLITS}
    for item in located:
        by_split[item.split]["read"] += 1
    for k in kept:
        by_split[k.split]["kept"] += 1
    for q in quarantined:
        by_split[split_of[(q.label_file, q.line)]]["quarantined"] += 1
    return {
        "read": len(located),
        "kept": len(kept),
        "quarantined": len(quarantined),
        "by_split": by_split,
        "quarantine_reasons": dict(sorted(Counter(q.reason for q in quarantined).items())),
    }


def _write_lists(root: Path, kept: list[Kept]) -> dict[str, str]:
    """``seg_label/list/<split>_gt.txt`` for every split; split -> path relative to ``root``."""
    (root / "seg_label" / "list").mkdir(parents=True, exist_ok=True)
    lists = {}
    for split in SPLITS:
        lines = [labels.list_line(k.raw_file, k.mask_file, k.existence) for k in kept if k.split == split]
        rel = f"seg_label/list/{split}_gt.txt"
        write_atomic(root / rel, "".join(line + "\n" for line in lines))
        lists[split] = rel
    return lists


def run_jobs(jobs: list[Located], root: Path, workers: int | None,
             process: Callable[[Located, Path], Kept | Quarantined] = process_line) -> list[Kept | Quarantined]:
    """``process`` each located line in worker processes (``python -m training.data.prepare`` runs this, so
    the pool never depends on a caller's ``__main__``); ``process`` is a module-level function."""
    workers = max(1, workers or os.cpu_count() or 1)
    if workers == 1 or len(jobs) < 2:
        return [process(item, root) for item in jobs]
    chunksize = max(1, min(32, len(jobs) // (workers * 8)))
    with process_pool(workers, preload=process.__module__, initializer=_init_worker,
                      initargs=(str(root), process)) as pool:
        return list(pool.map(_process_in_worker, jobs, chunksize=chunksize))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
