"""Turn a CULane-format folder into training inputs: the same lists, masks and manifest as TuSimple's.

Written into the dataset root, as ``training.data.preprocess`` writes for TuSimple (DESIGN §4)::

    seg_label/<frame path>.png               a mask drawn from the lines (``training.data.culane.seg_label``)
                                             where the dataset ships none under laneseg_label_w16/
    seg_label/list/{train,val,test}_gt.txt   "/<img> /<mask> e1 e2 e3 e4"
    manifest.json                            checksums, counts, quarantine report, dataset version

Training and validation frames come from ``list/train_gt.txt`` and ``list/val_gt.txt`` (their flags say which
slot each lane fills), test frames from ``list/test.txt``, whose lanes take slots by where they meet the bottom
of the image (``slots_by_position``). A frame whose list line, image, lines file or shipped label cannot be used
is quarantined with its list file, line and reason; the rest are prepared. Unchanged inputs are not prepared
again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from training.data.archive import updated_files
from training.data.culane import (
    DRIVER_FOLDER,
    GT_LISTS,
    HEIGHT,
    LIST_DIR,
    SEG_LABEL_WIDTH,
    SLOTS,
    TEST_LIST,
    WIDTH,
    CulaneListError,
    LinesFileError,
    Point,
    existence_for,
    lanes_in_slots,
    lines_path_for,
    parse_gt_list_line,
    parse_lines,
    seg_label,
)
from training.data.images import UnreadableImage, image_size
from training.data.labels import list_line
from training.data.preprocess import (
    MANIFEST,
    DatasetLayoutError,
    Kept,
    Located,
    PrepareReport,
    Quarantined,
    load_manifest,
    run_jobs,
    summarize_counts,
    write_atomic,
)
from training.data.space import block_bytes, ensure_free, names_a_full_volume

log = logging.getLogger("laneflow.data.preprocess_culane")

SCHEMA = "laneflow.culane-prepared/1"
PARAMS = {"seg_label_width": SEG_LABEL_WIDTH, "slots": SLOTS, "size": [WIDTH, HEIGHT],
          "test_slot_rule": "bottom-crossing-nearest-two-per-side"}
#: The list files read, by split, in the order their lines are reported.
LIST_FILES = {f"{LIST_DIR}/{GT_LISTS['train']}": "train", f"{LIST_DIR}/{GT_LISTS['val']}": "val",
              f"{LIST_DIR}/{TEST_LIST}": "test"}


@dataclass(frozen=True)
class Frame(Located):
    """A list line whose shipped label, if any, is stale: an update replaced the frame's lines file and not the
    label, which was drawn from the lines before; its mask is drawn from the new lines instead."""

    stale_label: bool = False


class Reason:
    """Why a CULane frame was set aside; stable strings that end up in manifest.json."""

    BAD_LIST_LINE = "bad_list_line"
    MISSING_IMAGE = "missing_image"
    UNREADABLE_IMAGE = "unreadable_image"
    WRONG_SIZE = "wrong_image_size"
    MISSING_LINES = "missing_lines_file"
    BAD_LINES = "bad_lines_file"
    EXISTENCE_MISMATCH = "existence_mismatch"
    BAD_SEG_LABEL = "bad_seg_label"
    DUPLICATE = "duplicate_image"


def is_culane(path: Path) -> bool:
    """Whether ``path`` (or its single sub-folder) is a CULane root: ``list/train_gt.txt`` beside a driver's
    folder (``driver_23_30frame``) — not a prepared TuSimple root, whose ``seg_label/list`` has the lists."""
    return _culane_root(path) is not None


def _looks_like_culane(path: Path) -> bool:
    return (path / LIST_DIR / GT_LISTS["train"]).is_file() and any(
        child.is_dir() and DRIVER_FOLDER.fullmatch(child.name) for child in path.iterdir())


def _culane_root(path: Path) -> Path | None:
    if not path.is_dir():
        return None
    if _looks_like_culane(path):
        return path
    found = [child for child in sorted(path.iterdir()) if child.is_dir() and _looks_like_culane(child)]
    return found[0] if len(found) == 1 else None


def slots_by_position(lanes: list[list[Point]], width: int = WIDTH) -> list[list[Point]]:
    """Four slots for lanes without flags (the test list has none): each lane's x where it is lowest in the
    image; the two nearest the image's centre on its left fill slots 2 and 1, on its right 3 and 4."""
    usable = [lane for lane in lanes if len(lane) >= 2]
    bottom_x = [max(lane, key=lambda point: point[1])[0] for lane in usable]
    left = sorted((x, index) for index, x in enumerate(bottom_x) if x < width / 2)[-2:]
    right = sorted((x, index) for index, x in enumerate(bottom_x) if x >= width / 2)[:2]
    slots: list[list[Point]] = [[] for _ in range(SLOTS)]
    for slot, (_, index) in zip((1, 0)[:len(left)], reversed(left), strict=True):
        slots[slot] = usable[index]
    for slot, (_, index) in zip((2, 3)[:len(right)], right, strict=True):
        slots[slot] = usable[index]
    return slots


def process_entry(item: Located, root: Path) -> Kept | Quarantined:
    """Check one list line's frame and write its mask where none is shipped (or the shipped one is stale, a
    ``Frame``'s ``stale_label``). Runs in a worker process."""
    def quarantine(reason: str, detail: str, image: str | None = None) -> Quarantined:
        return Quarantined(item.label_file, item.line, reason, detail, image)

    try:
        if item.split == "test":
            image, shipped, existence = _test_entry(item.text), None, None
        else:
            entry = parse_gt_list_line(item.text)
            image, shipped, existence = entry.image, entry.mask, entry.existence
    except CulaneListError as exc:
        return quarantine(Reason.BAD_LIST_LINE, str(exc))
    try:
        data = (root / image).read_bytes()
        size = image_size(data)
    except FileNotFoundError:
        return quarantine(Reason.MISSING_IMAGE, f"image {image} does not exist", image)
    except (OSError, UnreadableImage) as exc:
        return quarantine(Reason.UNREADABLE_IMAGE, f"image {image}: {getattr(exc, 'strerror', None) or exc}", image)
    if size != (WIDTH, HEIGHT):
        return quarantine(Reason.WRONG_SIZE, f"image {image} is {size[0]}x{size[1]}, CULane's are {WIDTH}x{HEIGHT}",
                          image)
    lines_file = lines_path_for(image)
    try:
        lanes = [[(float(x), float(y)) for x, y in lane] for lane in parse_lines((root / lines_file).read_text(),
                                                                                   lines_file)]
    except FileNotFoundError:
        return quarantine(Reason.MISSING_LINES, f"{lines_file} does not exist", image)
    except (LinesFileError, UnicodeDecodeError) as exc:
        return quarantine(Reason.BAD_LINES, str(exc), image)
    try:
        slots = slots_by_position(lanes) if existence is None else lanes_in_slots(lanes, existence)
    except CulaneListError as exc:
        return quarantine(Reason.EXISTENCE_MISMATCH, f"{image}: {exc}", image)
    if shipped is not None and (root / shipped).is_file() and not (isinstance(item, Frame) and item.stale_label):
        label = cv2.imread(str(root / shipped), cv2.IMREAD_UNCHANGED)
        if label is None or label.shape != (HEIGHT, WIDTH) or label.dtype != np.uint8 or int(label.max()) > SLOTS:
            return quarantine(Reason.BAD_SEG_LABEL, f"{shipped} is not a {WIDTH}x{HEIGHT} label of values 0..{SLOTS}",
                              image)
        mask_file = shipped
    else:
        mask_file = f"seg_label/{image.rsplit('.', 1)[0]}.png"
        ok, png = cv2.imencode(".png", seg_label(slots))
        if not ok:
            raise RuntimeError(f"OpenCV could not encode the label of {image} as PNG")
        target = root / mask_file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # a fresh inode: snapshots hard-link masks and keep their version
        target.write_bytes(png.tobytes())
    flags = existence if existence is not None else existence_for(slots)
    return Kept(item.label_file, item.line, item.split, image, mask_file, tuple(flags),
                hashlib.sha256(data).hexdigest())


def _test_entry(text: str) -> str:
    fields = text.split()
    if len(fields) != 1:
        raise CulaneListError(f"expected one image path per line of {TEST_LIST}, found {len(fields)} fields")
    parts = fields[0].lstrip("/").split("/")
    if ".." in parts or not fields[0].strip("/"):
        raise CulaneListError(f"the image path {fields[0]!r} is not a path inside the dataset")
    return fields[0].lstrip("/")


def _mark_stale_labels(jobs: list[Located], given: Path, root: Path) -> list[Located]:
    """``jobs``, each train/val line whose frame's lines file an update replaced without its shipped label made a
    ``Frame`` with a stale label (``training.data.archive``'s marker says what the updates put there)."""
    prefix = root.relative_to(given).as_posix() + "/" if root != given else ""
    updated = {path.removeprefix(prefix) for path in updated_files(given) if path.startswith(prefix)}
    if not updated:
        return jobs
    marked = []
    for item in jobs:
        fields = item.text.split()
        image, label = (fields[0].lstrip("/"), fields[1].lstrip("/")) if len(fields) > 1 else (fields[0], None)
        stale = label is not None and lines_path_for(image) in updated and label not in updated
        marked.append(Frame(item.label_file, item.line, item.split, item.text, True) if stale else item)
    stale = sum(isinstance(item, Frame) for item in marked)
    if stale:
        log.info("%d frames have lines an update replaced and shipped labels it did not: their masks are drawn "
                 "from the updated lines", stale)
    return marked


def read_lists(root: Path) -> tuple[list[Located], dict[str, dict]]:
    """Every non-blank line of the three lists, located, and each list file's sha256 and split."""
    located, sources = [], {}
    for name, split in LIST_FILES.items():
        path = root / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        sources[name] = {"sha256": hashlib.sha256(data).hexdigest(), "split": split, "bytes": len(data)}
        located += [Located(name, number, split, text) for number, text in
                    enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1) if text.strip()]
    return located, sources


def _fingerprint(root: Path, sources: dict[str, dict], located: list[Located]) -> str:
    """Cheap identity of the inputs: the lists' checksums, the params, size and mtime of each named file."""
    digest = hashlib.sha256(json.dumps({"schema": SCHEMA, "params": PARAMS, "sources": sources},
                                       sort_keys=True).encode())
    for item in located:
        for name in item.text.split()[:2]:
            for path in {name.lstrip("/"), lines_path_for(name)} if name.endswith(".jpg") else {name.lstrip("/")}:
                try:
                    stat = (root / path).stat()
                    digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
                except OSError:
                    digest.update(f"{path}\0missing\n".encode())
    return digest.hexdigest()


def _version(sources: dict[str, dict], root: Path, kept: list[Kept]) -> str:
    """Content identity: params, the lists' checksums, and each kept frame's image and lines."""
    digest = hashlib.sha256(json.dumps({"schema": SCHEMA, "params": PARAMS,
                                        "lists": {name: info["sha256"] for name, info in sources.items()}},
                                       sort_keys=True).encode())
    for item in sorted(kept, key=lambda k: (k.split, k.raw_file)):
        lines = hashlib.sha256((root / lines_path_for(item.raw_file)).read_bytes()).hexdigest()
        digest.update(f"{item.split}\0{item.raw_file}\0{item.image_sha256}\0{lines}\0{item.existence}\n".encode())
    return digest.hexdigest()[:16]


def preprocess_culane(dataset_dir: str | Path, *, workers: int | None = None, sources_extra: dict | None = None,
                      force: bool = False, volume: Path | None = None) -> PrepareReport:
    """Prepare the masks, lists and manifest of a CULane root; a no-op when its inputs are unchanged. Refused
    before any mask is written when ``volume`` (default: the root) has not one block free per frame."""
    given = Path(dataset_dir)
    root = _culane_root(given)
    if root is None:
        raise DatasetLayoutError(f"no CULane lists ({LIST_DIR}/{GT_LISTS['train']}) in {given} or its one "
                                 "sub-folder")
    located, sources = read_lists(root)
    fingerprint = _fingerprint(root, sources, located)
    previous = load_manifest(root)
    if not force and previous and previous.get("inputs_fingerprint") == fingerprint and all(
            (root / path).is_file() for path in previous.get("lists", {}).values()):
        log.info("inputs unchanged since the last preparation; dataset version %s", previous["dataset_version"])
        return PrepareReport(root, previous["dataset_version"], previous["counts"], True, previous)
    first_line: dict[str, Located] = {}
    outcomes: list[Kept | Quarantined] = []
    jobs = []
    for item in located:  # a frame named twice would be prepared twice: the first line keeps it
        image = item.text.split()[0].lstrip("/")
        if (earlier := first_line.setdefault(image, item)) is not item:
            outcomes.append(Quarantined(item.label_file, item.line, Reason.DUPLICATE,
                                        f"{image} is already listed at {earlier.label_file}:{earlier.line}", image))
        else:
            jobs.append(item)
    jobs = _mark_stale_labels(jobs, given, root)
    step = "write the lane masks"
    ensure_free(step, volume or root, root, len(jobs) * block_bytes(root))
    with names_a_full_volume(step, volume or root, root / "seg_label"):
        outcomes += run_jobs(jobs, root, workers, process_entry)
    outcomes.sort(key=lambda outcome: (list(LIST_FILES).index(outcome.label_file), outcome.line))
    kept = [outcome for outcome in outcomes if isinstance(outcome, Kept)]
    quarantined = [outcome for outcome in outcomes if isinstance(outcome, Quarantined)]
    (root / "seg_label" / "list").mkdir(parents=True, exist_ok=True)
    lists = {}
    for split in ("train", "val", "test"):
        lists[split] = f"seg_label/list/{split}_gt.txt"
        write_atomic(root / lists[split], "".join(list_line(k.raw_file, k.mask_file, k.existence) + "\n"
                                                  for k in kept if k.split == split))
    counts = summarize_counts(located, kept, quarantined)
    version = _version(sources, root, kept)
    manifest = {"schema": SCHEMA, "dataset": "culane", "dataset_version": version, "params": PARAMS,
                "sources": {"list_files": sources, **(sources_extra or {})}, "counts": counts, "lists": lists,
                "quarantine": [q.as_dict() for q in quarantined], "inputs_fingerprint": fingerprint}
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for q in quarantined:
        log.warning("quarantined %s:%d (%s): %s", q.label_file, q.line, q.reason, q.detail)
    log.info("prepared %s: read %d, kept %d, quarantined %d (%s); dataset version %s", root, counts["read"],
             counts["kept"], counts["quarantined"], dict(Counter(q.reason for q in quarantined)), version)
    return PrepareReport(root, version, counts, False, manifest)

