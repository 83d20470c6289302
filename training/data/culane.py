"""The CULane format as the dataset ships it: paths, list lines, lanes in slots and segmentation labels.

CULane (Pan et al., AAAI 2018) keeps each frame at ``driver_<n>_<fps>frame/<clip>.MP4/<frame>.jpg`` (1640×590)
with its lanes in ``<frame>.lines.txt`` next to it: one lane a line, ``x y`` pairs from the bottom of the image
up, left to right, at most the four lanes around the ego car. ``list/train_gt.txt`` and ``list/val_gt.txt``
name each frame with its segmentation label and four existence flags (``/img /mask e1 e2 e3 e4``): which of
the slots — the left lane's left boundary, the ego lane's left and right boundaries, the right lane's right
boundary — hold a lane; the lanes of the lines file fill the flagged slots in order. The shipped labels
(``laneseg_label_w16/``, the same paths with ``.png``) show slot k's lane with value k, 16 pixels wide; where
they are absent ``seg_label`` draws them from the lines by this rule, decided here: ``cv2.line`` 16 pixels wide
between consecutive points rounded to whole pixels, slots in order 1..4, a later slot over an earlier one.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

WIDTH, HEIGHT = 1640, 590
SLOTS = 4
SEG_LABEL_DIR = "laneseg_label_w16"
SEG_LABEL_WIDTH = 16
LIST_DIR = "list"
#: The lists the dataset ships (list/…): training and validation with labels, the test list and its split.
GT_LISTS = {"train": "train_gt.txt", "val": "val_gt.txt"}
TEST_LIST = "test.txt"
TEST_SPLIT_DIR = "test_split"
#: A driver's folder of frames, as the release names them (driver_<n>_<fps>frame).
DRIVER_FOLDER = re.compile(r"driver_\d+_\d+frame")

Point = tuple[float, float]

#: The test set's scenario lists, in the official order (list/test_split/test<k>_<name>.txt).
SCENARIOS = ("normal", "crowd", "hlight", "shadow", "noline", "arrow", "curve", "cross", "night")

Lane = np.ndarray  # (n, 2) float32 image coordinates, x then y


class LinesFileError(ValueError):
    """A ``.lines.txt`` file that cannot be read as lanes; the message names the file and the line."""


def parse_lines(text: str, source: str = "<lines>") -> list[Lane]:
    """The lanes of a ``.lines.txt``: one per text line, ``x y`` pairs in image pixels. As the official reader
    (``read_lane_file``), a blank line inside the file is a lane without points, an odd last number is
    ignored, and points outside the image are kept (drawing clips them)."""
    lanes = []
    rows = text.split("\n")
    if rows and rows[-1] == "":  # the newline that ends the last line starts no lane
        rows.pop()
    for number, row in enumerate(rows, start=1):
        values = []
        for token in row.split():
            try:
                value = float(token)
            except ValueError:
                raise LinesFileError(f"{source}, line {number}: {token!r} is not a number; each line is one lane "
                                     "as 'x y' pairs of image pixels") from None
            if not math.isfinite(value):
                raise LinesFileError(f"{source}, line {number}: {token!r} is not a finite number")
            values.append(value)
        pairs = len(values) // 2
        lanes.append(np.asarray(values[:2 * pairs], dtype=np.float32).reshape(pairs, 2))
    return lanes


def format_lines(lanes: Iterable[Sequence[tuple[float, float]]]) -> str:
    """The ``.lines.txt`` text of ``lanes`` (what a prediction writes for the official tool)."""
    return "".join(" ".join(f"{x:.7g} {y:.7g}" for x, y in lane) + "\n" for lane in lanes)


class CulaneListError(ValueError):
    """A list line that does not read as ``/img /mask e1 e2 e3 e4``; the message says which part and why."""


@dataclass(frozen=True)
class GtEntry:
    """One line of ``train_gt.txt``/``val_gt.txt``: the frame, its segmentation label, its existence flags."""

    image: str
    mask: str
    existence: tuple[int, int, int, int]


def lines_path_for(image: str) -> str:
    """The ``.lines.txt`` of frame ``image`` (a dataset-relative path, with or without the leading slash)."""
    return image.lstrip("/").rsplit(".", 1)[0] + ".lines.txt"


def seg_label_path_for(image: str) -> str:
    """Where the shipped segmentation label of frame ``image`` is: ``laneseg_label_w16/<same path>.png``."""
    return f"{SEG_LABEL_DIR}/{image.lstrip('/').rsplit('.', 1)[0]}.png"


def gt_list_line(entry: GtEntry) -> str:
    return f"/{entry.image.lstrip('/')} /{entry.mask.lstrip('/')} {' '.join(str(flag) for flag in entry.existence)}"


def parse_gt_list_line(line: str) -> GtEntry:
    """A ``train_gt.txt`` line; paths are kept relative (no leading slash) and may not leave the dataset."""
    fields = line.split()
    if len(fields) != 2 + SLOTS:
        raise CulaneListError(f"expected '/image /label e1 e2 e3 e4' (6 fields), found {len(fields)}")
    image, mask, *flags = fields
    if any(flag not in ("0", "1") for flag in flags):
        raise CulaneListError(f"existence flags must be 0 or 1, found {' '.join(flags)!r}")
    for what, path in (("image", image), ("label", mask)):
        parts = path.lstrip("/").split("/")
        if not path.strip("/") or ".." in parts or "\\" in path:
            raise CulaneListError(f"the {what} path {path!r} is not a path inside the dataset")
    return GtEntry(image.lstrip("/"), mask.lstrip("/"), tuple(int(flag) for flag in flags))  # type: ignore[arg-type]


def lanes_in_slots(lanes: Sequence[Sequence[Point]], existence: Sequence[int]) -> list[list[Point]]:
    """The four slots' lanes (empty where a slot has none): the file's lanes fill the flagged slots in order.
    More or fewer lanes than flags is an error: the list and the lines file disagree."""
    if sum(existence) != len(lanes):
        raise CulaneListError(f"the existence flags {' '.join(map(str, existence))} name {sum(existence)} lane(s) "
                              f"but the lines file has {len(lanes)}")
    filled = iter(lanes)
    return [list(next(filled)) if flag else [] for flag in existence]


def existence_for(slots: Sequence[Sequence[Point]]) -> tuple[int, int, int, int]:
    """The flags of four slots: 1 where the slot holds a lane of at least two points."""
    return tuple(int(len(slot) >= 2) for slot in slots)  # type: ignore[return-value]


def seg_label(slots: Sequence[Sequence[Point]], width: int = WIDTH, height: int = HEIGHT,
              thickness: int = SEG_LABEL_WIDTH) -> np.ndarray:
    """The segmentation label of four slots by the rule above: slot k's lane with value k, ``thickness`` pixels
    wide, between consecutive points rounded to whole pixels."""
    mask = np.zeros((height, width), dtype=np.uint8)
    for value, lane in enumerate(slots, start=1):
        points = np.rint(np.asarray(lane, dtype=np.float64)).astype(np.int64)
        for start, end in itertools.pairwise(points):
            cv2.line(mask, (int(start[0]), int(start[1])), (int(end[0]), int(end[1])), value, thickness)
    return mask
