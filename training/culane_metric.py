"""The CULane lane metric (TP, FP, FN, precision, recall, F1) following the benchmark's official tool.

The official evaluator (XingangPan/SCNN ``tools/lane_evaluation``, run by its ``Run.sh`` with a 30-pixel lane
width, IoU 0.5 and a 1640×590 image) scores one image at a time:

- every lane of the ground truth and of the prediction with more than two points is interpolated by a natural
  cubic spline fitted to x and to y over the chord length, sampled 50 times per segment plus the last point
  (``src/spline.cpp``); a two-point lane is used as it is; one with fewer than two scores IoU 0 against
  anything, yet still counts as a lane;
- each lane is drawn alone on a 590×1640 canvas, as ``cv::line`` segments 30 pixels wide between its points
  rounded to whole pixels (``src/lane_compare.cpp``), and the IoU of two lanes is that of their pixels;
- ground-truth and predicted lanes are paired by the tool's Kuhn–Munkres matching that maximises the summed
  IoU, edges counting as tight within 0.01 (``include/hungarianGraph.hpp``); a pair whose IoU is *above* the
  threshold is a true positive, every other lane a false negative or false positive (``src/counter.cpp``);
- TP, FP and FN are summed over the images of a list, and precision, recall and F1 computed from the sums
  (``src/evaluate.cpp``); the test set is scored per scenario list (``list/test_split/test<k>_<name>.txt``)
  and over all of them — the crossroads frames carry no lanes, so they add false positives only.

``score_image`` is the pure per-image rule (``training.culane_eval`` applies it to files and lists). Besides IoU
0.5 it counts at 0.75 and at every step of 0.5:0.95, whose mean F1 recent papers add; the matching does not
depend on the threshold, so one matching serves them all.

Decided here, where the official tool has no rule or fails: consecutive repeated points of a lane are merged
(the tool divides by their zero distance); two lanes with no pixel in the image have IoU 0 (the tool's 0/0);
precision or recall with nothing to count is ``None`` (the tool prints -1), F1 then 0 as the tool's -0, and
``None`` where there is nothing to count at all (the tool's NaN); a token that is not a number is an error
naming the file and line (the tool stops reading the line there).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from training.data.culane import SCENARIOS, Lane, LinesFileError, format_lines, parse_lines

__all__ = ["SCENARIOS", "THRESHOLDS", "Counts", "Lane", "LinesFileError", "format_lines", "interpolate", "lane_mask",
           "mask_iou", "match", "parse_lines", "score_image"]

IMAGE_WIDTH, IMAGE_HEIGHT = 1640, 590
LANE_WIDTH = 30
IOU_THRESHOLD = 0.5
#: The thresholds reported: the benchmark's 0.5, the stricter 0.75, and 0.5:0.95 for the mean F1.
THRESHOLDS = tuple(round(0.5 + 0.05 * step, 2) for step in range(10))
SPLINE_STEPS = 50
#: The tool's edges count as tight within this (include/hungarianGraph.hpp).
MATCH_TOLERANCE = 1e-2
def interpolate(lane: Lane, steps: int = SPLINE_STEPS) -> Lane:
    """``lane`` as the official tool draws it: more than two points through a natural cubic spline in x and y
    over the chord length, ``steps`` samples per segment and the last point; two points as they are."""
    points = np.asarray(lane, dtype=np.float64)
    if len(points) <= 2:
        return points.astype(np.float32)
    points = points[np.concatenate([[True], np.any(np.diff(points, axis=0) != 0, axis=1)])]  # repeats merged
    if len(points) == 1:  # every point the same: a dot, as a two-point lane of one point is drawn
        return np.repeat(points, 2, axis=0).astype(np.float32)
    if len(points) == 2:
        return points.astype(np.float32)
    chord = np.hypot(*np.diff(points, axis=0).T)
    second = _natural_second_derivatives(points, chord)
    t = (np.arange(steps, dtype=np.float64) / steps)[None, :] * chord[:, None]  # (segments, steps)
    slope = np.diff(points, axis=0) / chord[:, None] - chord[:, None] * (2 * second[:-1] + second[1:]) / 6
    start = points[:-1]
    samples = (start[:, None, :] + slope[:, None, :] * t[..., None] + second[:-1, None, :] / 2 * t[..., None] ** 2
               + (np.diff(second, axis=0) / (6 * chord[:, None]))[:, None, :] * t[..., None] ** 3)
    return np.vstack([samples.reshape(-1, 2), points[-1:]]).astype(np.float32)


def _natural_second_derivatives(points: np.ndarray, chord: np.ndarray) -> np.ndarray:
    """The spline's second derivative at each knot (zero at both ends), for x and y together: the tridiagonal
    system of a natural cubic spline, solved by elimination down and substitution up."""
    inner = len(points) - 2
    second = np.zeros_like(points)
    lower, upper = chord[:-1], chord[1:]
    diagonal = 2 * (lower + upper)
    right = 6 * (np.diff(points[1:], axis=0) / upper[:, None] - np.diff(points[:-1], axis=0) / lower[:, None])
    diag, rhs = diagonal.copy(), right.copy()
    for row in range(1, inner):
        factor = lower[row] / diag[row - 1]
        diag[row] -= factor * upper[row - 1]
        rhs[row] -= factor * rhs[row - 1]
    solved = np.zeros_like(rhs)
    solved[-1] = rhs[-1] / diag[-1]
    for row in range(inner - 2, -1, -1):
        solved[row] = (rhs[row] - upper[row] * solved[row + 1]) / diag[row]
    second[1:-1] = solved
    return second


@dataclass(frozen=True)
class LaneMask:
    """A lane's pixels as the official tool draws them, kept as the box they fill (an empty box: none)."""

    top: int
    left: int
    pixels: np.ndarray  # bool (height, width) of the box

    @property
    def area(self) -> int:
        return int(np.count_nonzero(self.pixels))


def lane_mask(lane: Lane, width: int = LANE_WIDTH, size: tuple[int, int] = (IMAGE_HEIGHT, IMAGE_WIDTH)
              ) -> LaneMask | None:
    """The pixels of ``lane`` drawn ``width`` wide on an image of ``size`` (height, width), None for a lane of
    fewer than two points (which matches nothing). Points round to the nearest pixel, halves to even (cvRound)."""
    if len(lane) < 2:
        return None
    points = np.rint(interpolate(lane)).astype(np.int64)
    canvas = np.zeros(size, dtype=np.uint8)
    for start, end in itertools.pairwise(points):
        cv2.line(canvas, (int(start[0]), int(start[1])), (int(end[0]), int(end[1])), 1, width)
    rows, columns = np.nonzero(np.any(canvas, axis=1))[0], np.nonzero(np.any(canvas, axis=0))[0]
    if not len(rows):
        return LaneMask(0, 0, np.zeros((0, 0), dtype=bool))
    top, bottom, left, right = rows[0], rows[-1] + 1, columns[0], columns[-1] + 1
    return LaneMask(int(top), int(left), canvas[top:bottom, left:right].astype(bool))


def mask_iou(first: LaneMask | None, second: LaneMask | None) -> float:
    """The IoU of two drawn lanes: 0 when either has fewer than two points or neither has a pixel."""
    if first is None or second is None:
        return 0.0
    union = first.area + second.area
    if union == 0:
        return 0.0
    top, left = max(first.top, second.top), max(first.left, second.left)
    bottom = min(first.top + first.pixels.shape[0], second.top + second.pixels.shape[0])
    right = min(first.left + first.pixels.shape[1], second.left + second.pixels.shape[1])
    inter = 0
    if bottom > top and right > left:
        a = first.pixels[top - first.top:bottom - first.top, left - first.left:right - first.left]
        b = second.pixels[top - second.top:bottom - second.top, left - second.left:right - second.left]
        inter = int(np.count_nonzero(a & b))
    return inter / (union - inter)


def match(similarity: np.ndarray) -> list[int]:
    """For each row (ground-truth lane), the column (predicted lane) the official matching pairs it with, or -1.

    The official tool's rule: Kuhn–Munkres on the IoUs with the smaller side on the left, left labels starting
    at each row's best, an edge tight when the labels' sum is within ``MATCH_TOLERANCE`` of its weight, and
    augmenting paths searched in column order."""
    rows, columns = similarity.shape
    if rows == 0 or columns == 0:
        return [-1] * rows
    swapped = rows > columns
    weights = similarity.T if swapped else similarity
    pairs = _kuhn_munkres(np.asarray(weights, dtype=np.float64))
    if not swapped:
        return pairs
    paired = [-1] * rows
    for left, right in enumerate(pairs):
        if right >= 0:
            paired[right] = left
    return paired


def _kuhn_munkres(weights: np.ndarray) -> list[int]:
    """The right vertex matched to each left one (at most as many left as right), by the tolerant labelling
    the official tool uses; a left vertex no label change can reach stays unmatched, as there."""
    left_count, right_count = weights.shape
    left_label = weights.max(axis=1).clip(min=-1e5)
    right_label = np.zeros(right_count)
    owner = [-1] * right_count  # the left vertex matched to each right one

    def augment(vertex: int, left_seen: list[bool], right_seen: list[bool]) -> bool:
        left_seen[vertex] = True
        for column in range(right_count):
            if right_seen[column] or abs(left_label[vertex] + right_label[column] - weights[vertex, column]) \
                    >= MATCH_TOLERANCE:
                continue
            right_seen[column] = True
            if owner[column] == -1 or augment(owner[column], left_seen, right_seen):
                owner[column] = vertex
                return True
        return False

    for vertex in range(left_count):
        while True:
            left_seen, right_seen = [False] * left_count, [False] * right_count
            if augment(vertex, left_seen, right_seen):
                break
            slack = min((left_label[i] + right_label[j] - weights[i, j] for i in range(left_count) if left_seen[i]
                         for j in range(right_count) if not right_seen[j]), default=None)
            if slack is None:
                return _pairs(owner, left_count)
            for i in range(left_count):
                if left_seen[i]:
                    left_label[i] -= slack
            for j in range(right_count):
                if right_seen[j]:
                    right_label[j] += slack
    return _pairs(owner, left_count)


def _pairs(owner: list[int], left_count: int) -> list[int]:
    pairs = [-1] * left_count
    for column, vertex in enumerate(owner):
        if vertex >= 0:
            pairs[vertex] = column
    return pairs


@dataclass(frozen=True)
class Counts:
    """True positives, false positives and false negatives, and what they give."""

    tp: int = 0
    fp: int = 0
    fn: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.tp + other.tp, self.fp + other.fp, self.fn + other.fn)

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None

    @property
    def f1(self) -> float | None:
        """2PR / (P + R), which is 2TP / (2TP + FP + FN); 0 when only one of P and R is defined (the tool's -0:
        no prediction at all, or no lane to find), None when neither is (nothing to count)."""
        counted = 2 * self.tp + self.fp + self.fn
        return 2 * self.tp / counted if counted else None


def score_image(truth: Sequence[Lane], predicted: Sequence[Lane],
                thresholds: Sequence[float] = THRESHOLDS) -> dict[float, Counts]:
    """One image's counts at each IoU threshold, by the official rule (see the module docstring)."""
    if not truth:
        return {threshold: Counts(fp=len(predicted)) for threshold in thresholds}
    if not predicted:
        return {threshold: Counts(fn=len(truth)) for threshold in thresholds}
    true_masks, predicted_masks = [lane_mask(lane) for lane in truth], [lane_mask(lane) for lane in predicted]
    similarity = np.array([[mask_iou(a, b) for b in predicted_masks] for a in true_masks])
    paired = match(similarity)
    scores = {}
    for threshold in thresholds:
        tp = sum(1 for row, column in enumerate(paired) if column >= 0 and similarity[row, column] > threshold)
        scores[threshold] = Counts(tp, len(predicted) - tp, len(truth) - tp)
    return scores
