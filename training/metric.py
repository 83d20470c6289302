"""The TuSimple lane metric (Accuracy, FP, FN) following the benchmark's official rules.

``score_image`` is the pure per-image rule; ``score_predictions`` and ``score_files`` apply it to
prediction JSON lines against ground-truth JSON lines, refusing malformed predictions with an
error that names the line and the problem.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

PIXEL_THRESHOLD = 20.0
MATCH_THRESHOLD = 0.85
MAX_RUN_TIME_MS = 200.0
#: Absent points (negative x) are compared as this value, so "absent in both" counts as a hit.
ABSENT_VALUE = -100.0


@dataclass(frozen=True)
class LaneScore:
    """Accuracy, false-positive and false-negative rates; for a dataset, the means over images."""

    accuracy: float
    fp: float
    fn: float
    images: int = 1

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class PredictionFormatError(ValueError):
    """A prediction file line that cannot be scored; the message names the line and the problem."""


def lane_angle(xs: np.ndarray, ys: np.ndarray) -> float:
    """Angle of the least-squares line x = k*y + b through a lane's valid points (0 with < 2 points)."""
    valid = xs >= 0
    if valid.sum() < 2:
        return 0.0
    y, x = ys[valid].astype(np.float64), xs[valid].astype(np.float64)
    y_centered = y - y.mean()
    denominator = float(np.dot(y_centered, y_centered))
    k = 0.0 if denominator == 0.0 else float(np.dot(y_centered, x - x.mean())) / denominator
    return math.atan(k)


def line_accuracy(pred: np.ndarray, gt: np.ndarray, threshold: float) -> float:
    """Fraction of h_samples where prediction and ground truth agree within ``threshold`` px."""
    pred = np.where(pred >= 0, pred, ABSENT_VALUE)
    gt = np.where(gt >= 0, gt, ABSENT_VALUE)
    return float(np.count_nonzero(np.abs(pred - gt) < threshold)) / len(gt)


def score_image(
    pred_lanes: Sequence[Sequence[float]],
    gt_lanes: Sequence[Sequence[float]],
    h_samples: Sequence[float],
    run_time_ms: float,
) -> LaneScore:
    """Score one image's predicted lanes against its ground truth (official TuSimple rules)."""
    for index, lane in enumerate(pred_lanes):
        if len(lane) != len(h_samples):
            raise PredictionFormatError(
                f"predicted lane {index} has {len(lane)} points but there are {len(h_samples)} h_samples"
            )
    if run_time_ms > MAX_RUN_TIME_MS or len(pred_lanes) > len(gt_lanes) + 2:
        return LaneScore(0.0, 0.0, 1.0)
    ys = np.asarray(h_samples, dtype=np.float64)
    preds = [np.asarray(lane, dtype=np.float64) for lane in pred_lanes]
    best_accuracies: list[float] = []
    matched = 0
    missed = 0
    for gt_lane in gt_lanes:
        gt = np.asarray(gt_lane, dtype=np.float64)
        threshold = PIXEL_THRESHOLD / math.cos(lane_angle(gt, ys))
        best = max((line_accuracy(pred, gt, threshold) for pred in preds), default=0.0)
        best_accuracies.append(best)
        if best >= MATCH_THRESHOLD:
            matched += 1
        else:
            missed += 1
    total = sum(best_accuracies)
    if len(gt_lanes) > 4:
        total -= min(best_accuracies)
        if missed > 0:
            missed -= 1
    counted_gt = max(min(4, len(gt_lanes)), 1)
    accuracy = total / counted_gt
    fp = (len(pred_lanes) - matched) / len(pred_lanes) if pred_lanes else 0.0
    fn = missed / counted_gt
    return LaneScore(accuracy, fp, fn)


def mean_score(scores: Iterable[LaneScore]) -> LaneScore:
    """Dataset figures: the mean of per-image figures."""
    scores = list(scores)
    if not scores:
        raise ValueError("no images to score")
    n = len(scores)
    return LaneScore(
        accuracy=sum(s.accuracy for s in scores) / n,
        fp=sum(s.fp for s in scores) / n,
        fn=sum(s.fn for s in scores) / n,
        images=n,
    )


def parse_ground_truth(lines: Iterable[str], source: str = "ground truth") -> dict[str, dict]:
    """Ground-truth records keyed by ``raw_file``."""
    records: dict[str, dict] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            records[obj["raw_file"]] = {"lanes": obj["lanes"], "h_samples": obj["h_samples"]}
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{source} line {lineno}: not a TuSimple label record ({exc})") from exc
    return records


def _parse_prediction(line: str, where: str) -> tuple[str, list[list[float]], float]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PredictionFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise PredictionFormatError(f"{where}: a prediction must be a JSON object")
    for key in ("raw_file", "lanes", "run_time"):
        if key not in obj:
            raise PredictionFormatError(f"{where}: missing field '{key}'")
    raw_file, lanes, run_time = obj["raw_file"], obj["lanes"], obj["run_time"]
    if not isinstance(raw_file, str):
        raise PredictionFormatError(f"{where}: 'raw_file' must be a string")
    if not isinstance(lanes, list) or not all(
        isinstance(lane, list) and all(_is_number(x) for x in lane) for lane in lanes
    ):
        raise PredictionFormatError(f"{where}: 'lanes' must be a list of lists of numbers")
    if not _is_number(run_time) or run_time < 0:
        raise PredictionFormatError(f"{where}: 'run_time' must be a non-negative number of milliseconds")
    return raw_file, lanes, float(run_time)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def score_predictions(
    prediction_lines: Iterable[str],
    ground_truth: Mapping[str, dict],
    source: str = "predictions",
) -> LaneScore:
    """Score prediction JSON lines (``raw_file``, ``lanes``, ``run_time``) against ground truth.

    Every ground-truth image needs exactly one prediction, as in the official evaluation.
    """
    scores: list[LaneScore] = []
    seen: set[str] = set()
    for lineno, line in enumerate(prediction_lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {lineno}"
        raw_file, lanes, run_time = _parse_prediction(line, where)
        if raw_file not in ground_truth:
            raise PredictionFormatError(f"{where}: raw_file '{raw_file}' is not in the ground truth")
        if raw_file in seen:
            raise PredictionFormatError(f"{where}: raw_file '{raw_file}' is predicted twice")
        seen.add(raw_file)
        gt = ground_truth[raw_file]
        try:
            scores.append(score_image(lanes, gt["lanes"], gt["h_samples"], run_time))
        except PredictionFormatError as exc:
            raise PredictionFormatError(f"{where}: {exc}") from exc
    missing = sorted(set(ground_truth) - seen)
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise PredictionFormatError(f"{source}: {len(missing)} ground-truth images have no prediction ({shown})")
    return mean_score(scores)


def score_files(prediction_file: str | Path, ground_truth_file: str | Path) -> LaneScore:
    """Score a prediction JSON-lines file against a TuSimple ground-truth label file."""
    prediction_file, ground_truth_file = Path(prediction_file), Path(ground_truth_file)
    with ground_truth_file.open(encoding="utf-8") as handle:
        ground_truth = parse_ground_truth(handle, source=str(ground_truth_file))
    with prediction_file.open(encoding="utf-8") as handle:
        return score_predictions(handle, ground_truth, source=str(prediction_file))
