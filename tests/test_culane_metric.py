"""The CULane metric against an independent implementation of the official tool's rule.

The reference below follows XingangPan/SCNN ``tools/lane_evaluation`` as its source reads, written apart from
``training.culane_metric``: SciPy's natural cubic spline over the chord length (``src/spline.cpp``), two fresh
590×1640 canvases per lane pair (``src/lane_compare.cpp``), and the best total IoU found by trying every
assignment (``src/counter.cpp`` maximises it with a tolerant Kuhn–Munkres), a pair counting above the threshold.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from scipy.interpolate import CubicSpline

from training.culane_eval import main as evaluate_main
from training.culane_eval import score_list, score_lists
from training.culane_metric import (
    SCENARIOS,
    THRESHOLDS,
    Counts,
    LinesFileError,
    format_lines,
    interpolate,
    lane_mask,
    mask_iou,
    match,
    parse_lines,
    score_image,
)
from training.inference import culane_lanes

HEIGHT, WIDTH = 590, 1640


def reference_points(lane: list[tuple[float, float]]) -> np.ndarray:
    """splineInterpTimes(lane, 50) for more than two points; the two points themselves otherwise."""
    points = np.asarray(lane, dtype=np.float32).astype(np.float64)
    if len(points) == 2:
        return points.astype(np.float32)
    knots = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(points, axis=0), axis=1))])
    spline = CubicSpline(knots, points, bc_type="natural")
    samples = [spline(knots[i] + (knots[i + 1] - knots[i]) / 50 * k) for i in range(len(points) - 1)
               for k in range(50)]
    return np.vstack([*samples, points[-1]]).astype(np.float32)


def reference_iou(first: list, second: list) -> float:
    if len(first) < 2 or len(second) < 2:
        return 0.0
    canvases = []
    for lane in (first, second):
        canvas = np.zeros((HEIGHT, WIDTH), np.uint8)
        points = reference_points(lane)
        for a, b in itertools.pairwise(points):
            cv2.line(canvas, tuple(int(v) for v in np.rint(a)), tuple(int(v) for v in np.rint(b)), 1, 30)
        canvases.append(canvas.astype(np.int64))
    inter = int((canvases[0] * canvases[1]).sum())
    union = int(canvases[0].sum() + canvases[1].sum()) - inter
    return inter / union if union else 0.0


def reference_counts(truth: list, predicted: list, threshold: float) -> tuple[int, int, int]:
    if not truth:
        return 0, len(predicted), 0
    if not predicted:
        return 0, 0, len(truth)
    iou = np.array([[reference_iou(t, p) for p in predicted] for t in truth])
    best, best_total = (), -1.0
    small, large = sorted((len(truth), len(predicted)))
    for chosen in itertools.permutations(range(large), small):
        pairs = list(enumerate(chosen)) if len(truth) <= len(predicted) else [(c, r) for r, c in enumerate(chosen)]
        total = sum(iou[t, p] for t, p in pairs)
        if total > best_total + 1e-9:
            best, best_total = pairs, total
    tp = sum(1 for t, p in best if iou[t, p] > threshold)
    return tp, len(predicted) - tp, len(truth) - tp


def curve(x0: float, bend: float, top: float = 260, bottom: float = 590, step: float = 20,
          shift: float = 0.0) -> list[tuple[float, float]]:
    """A lane as CULane's labels give it: a point every ``step`` rows from the bottom up."""
    return [(x0 + shift + bend * ((bottom - y) / 100) ** 2, y) for y in np.arange(bottom, top - 1, -step)]


def varied_set() -> list[tuple[str, list, list]]:
    """Images a detector's output meets: exact, shifted, curved, leaving the image, touching, crossing, short,
    missing, extra and empty."""
    left, right = curve(500, -30), curve(1100, 40)
    return [
        ("exact", [left, right], [left, right]),
        *[(f"shifted {dx} px", [left, right], [curve(500, -30, shift=dx), curve(1100, 40, shift=-dx)])
          for dx in (4, 11, 17, 26, 45)],
        ("curves", [curve(300, 80), curve(900, -120)], [curve(306, 75), curve(880, -110, step=30)]),
        ("leaving the image", [curve(40, -60), curve(1600, 70)], [curve(52, -60), curve(1590, 70)]),
        ("points outside", [[(-50, 590), (100, 400), (250, 260)]], [[(-40, 590), (110, 400), (260, 260)]]),
        ("touching lanes", [curve(700, 0), curve(725, 0)], [curve(712, 0)]),
        ("crossing lanes", [[(300, 590), (900, 260)], [(900, 590), (300, 260)]], [[(310, 590), (890, 260)]]),
        ("two-point lanes", [[(400, 590), (600, 300)]], [[(405, 590), (600, 310)], [(1200, 590), (1000, 300)]]),
        ("a one-point lane", [left, [(800, 400)]], [left, [(800, 400)]]),
        ("sparse prediction", [right], [right[::4]]),
        ("missed lanes", [left, right, curve(800, 5)], [right]),
        ("extra lanes", [left], [left, right, curve(800, 5), curve(1400, 90)]),
        ("no ground truth (crossroads)", [], [left, right]),
        ("no prediction", [left, right], []),
        ("nothing at all", [], []),
        ("near ties", [curve(600, 0), curve(630, 0), curve(660, 0)], [curve(615, 0), curve(645, 0)]),
    ]


@pytest.mark.parametrize(("name", "truth", "predicted"), varied_set(), ids=[case[0] for case in varied_set()])
def test_counts_agree_with_an_independent_implementation_of_the_official_rule(name: str, truth: list,
                                                                              predicted: list) -> None:
    lanes = ([np.asarray(lane, np.float32) for lane in truth], [np.asarray(lane, np.float32) for lane in predicted])
    scores = score_image(*lanes)
    for threshold in THRESHOLDS:
        assert (scores[threshold].tp, scores[threshold].fp, scores[threshold].fn) == \
            reference_counts(truth, predicted, threshold), (name, threshold)
    masks = [[lane_mask(lane) for lane in side] for side in lanes]
    for (i, t), (j, p) in itertools.product(enumerate(truth), enumerate(predicted)):
        assert mask_iou(masks[0][i], masks[1][j]) == pytest.approx(reference_iou(t, p), abs=1e-12), (name, i, j)


def test_the_spline_is_the_natural_one_over_the_chord_length_sampled_fifty_times_a_segment() -> None:
    lane = curve(300, 80, step=40)
    ours = interpolate(np.asarray(lane, np.float32))
    assert ours.shape == ((len(lane) - 1) * 50 + 1, 2)
    np.testing.assert_allclose(ours, reference_points(lane), atol=1e-3)
    np.testing.assert_array_equal(ours[::50], np.asarray(lane, np.float32))  # through every labelled point


def test_the_matching_is_the_official_tolerant_one_not_an_exact_optimum() -> None:
    """Kuhn–Munkres with edges tight within 0.01, searched in column order: a lane with no overlap at all takes
    column 0 and moves row 0 to its 0.595 — 0.595 in all, where 0.600 was the best."""
    assert match(np.array([[0.600, 0.595], [0.0, 0.0]])) == [1, 0]
    assert match(np.array([[0.600, 0.580], [0.0, 0.0]])) == [0, 1]  # 0.02 apart: not tight, the best kept
    assert match(np.array([[0.9, 0.0, 0.2], [0.1, 0.8, 0.0]])) == [0, 1]
    assert match(np.array([[0.9, 0.1], [0.0, 0.8], [0.7, 0.0]])) == [0, 1, -1]  # more truth than predictions
    assert match(np.zeros((0, 2))) == []


def test_lines_files_read_as_the_official_reader_reads_them_and_bad_tokens_name_the_line() -> None:
    lanes = parse_lines("10 590 20 570 \n\n30.5 590 40 570 7\n", "a.lines.txt")
    assert [lane.tolist() for lane in lanes] == [[[10, 590], [20, 570]], [], [[30.5, 590], [40, 570]]]
    assert [lane.tolist() for lane in parse_lines(format_lines([[(1.25, 590.0), (2.5, 570.0)]]))] == \
        [[[1.25, 590.0], [2.5, 570.0]]]
    with pytest.raises(LinesFileError, match=r"b\.lines\.txt, line 2: 'x' is not a number"):
        parse_lines("1 2 3 4\n5 x\n", "b.lines.txt")
    with pytest.raises(LinesFileError, match="line 1: 'nan' is not a finite number"):
        parse_lines("nan 2 3 4\n", "c.lines.txt")


def write_frames(root: Path, frames: dict[str, list[tuple[str, list | None, list | None]]]) -> tuple[Path, Path]:
    """A CULane-shaped tree under ``root``: ground truth next to each image with the scenario lists, and the
    predictions in a folder of their own (None: no file)."""
    truth_root, predicted_root = root / "culane", root / "pred"
    for index, name in enumerate(SCENARIOS):
        if name in frames:
            split = truth_root / "list" / "test_split" / f"test{index}_{name}.txt"
            split.parent.mkdir(parents=True, exist_ok=True)
            split.write_text("".join(f"{image}\n" for image, _, _ in frames[name]))
    for entries in frames.values():
        for image, truth, predicted in entries:
            for where, lanes in ((truth_root, truth), (predicted_root, predicted)):
                if lanes is not None:
                    path = where / (image.lstrip("/").removesuffix(".jpg") + ".lines.txt")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(format_lines(lanes))
    return truth_root, predicted_root


SCENES = {
    "normal": [("/driver_1/a.MP4/00000.jpg", [curve(500, -30), curve(1100, 40)], [curve(500, -30), curve(1100, 40)])],
    "night": [("/driver_1/b.MP4/00000.jpg", [curve(500, -30), curve(1100, 40)], [curve(500, -30, shift=45)])],
    "cross": [("/driver_1/c.MP4/00000.jpg", [], [curve(500, -30)]), ("/driver_1/c.MP4/00030.jpg", [], [])],
    "curve": [("/driver_1/d.MP4/00000.jpg", [curve(500, -30)], None)],  # no prediction file: every lane missed
}


def test_scenarios_sum_to_the_official_total_where_the_crossroads_add_false_positives_only(tmp_path: Path) -> None:
    truth_root, predicted_root = write_frames(tmp_path, SCENES)
    scores = score_lists({name: [image for image, _, _ in entries] for name, entries in SCENES.items()},
                         truth_root, predicted_root)
    as_counts = {name: score.counts[0.5] for name, score in scores.items()}
    assert as_counts == {"normal": Counts(2, 0, 0), "night": Counts(0, 1, 2), "cross": Counts(0, 1, 0),
                         "curve": Counts(0, 0, 1), "all": Counts(2, 2, 3)}
    assert scores["cross"].f1 == 0.0 and scores["cross"].as_dict()["fp"] == 1  # no lanes: FP is its figure
    assert (Counts(0, 0, 3).f1, Counts(0, 2, 0).f1, Counts().f1) == (0.0, 0.0, None)  # the tool's -0, -0, NaN
    assert scores["all"].f1 == pytest.approx(2 * 0.5 * 0.4 / 0.9)
    assert scores["all"].images == 5


def test_the_evaluation_command_reads_the_split_lists_and_prints_f1_per_scenario(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth_root, predicted_root = write_frames(tmp_path, SCENES)
    figures = tmp_path / "figures.json"
    assert evaluate_main(["--data", str(truth_root), "--predictions", str(predicted_root), "--json", str(figures),
                          "--workers", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == ["normal", "curve", "cross", "night", "all"]
    assert table[2].split("|")[8].strip() == "100.00" and table[4].split("|")[4].strip() == "1"
    assert json.loads(figures.read_text())["all"]["f1"] == pytest.approx(2 * 0.5 * 0.4 / 0.9)
    assert evaluate_main(["--data", str(tmp_path / "pred"), "--predictions", str(predicted_root)]) == 2
    assert "has no CULane test lists: expected list/test_split/test<k>_<scenario>.txt" in capsys.readouterr().err


def test_scoring_in_worker_processes_sums_to_the_same_counts(tmp_path: Path) -> None:
    truth_root, predicted_root = write_frames(tmp_path, SCENES)
    images = [image for entries in SCENES.values() for image, _, _ in entries] * 14  # 70 entries: pooled
    alone, pooled = (score_list(images, truth_root, predicted_root, workers) for workers in (1, 2))
    assert pooled == alone and alone.counts[0.5] == Counts(28, 28, 42)


def get_lane(score: np.ndarray, threshold: float = 0.3) -> list[int]:
    """SCNN's tools/prob2lines/getLane.m, line by line, with MATLAB's 1-based indices and uint16() rounding."""
    def uint16(value: float) -> int:
        return int(min(max(np.floor(value + 0.5), 0), 65535))

    height = score.shape[0]
    coordinate = [0] * 18
    for i in range(1, 19):
        line_id = uint16(height - (i - 1) * 20 / 590 * height)
        line = score[line_id - 1, :]
        if line.max() > threshold:
            coordinate[i - 1] = int(np.argmax(line)) + 1
    return coordinate if sum(1 for c in coordinate if c > 0) >= 2 else [0] * 18


def test_lanes_decode_from_probability_maps_as_scnns_prob2lines_does_and_score_as_true_positives() -> None:
    """main.m writes 'uint16(coordinates(j,m)*1640/800)-1 uint16(590-(m-1)*20)-1' for each point of each slot
    that exists and has more than one point; the decoded lanes of a map drawn from a ground truth score it."""
    truth = [curve(500, -30), curve(1100, 40), curve(150, -80)]
    probs = np.zeros((5, 288, 800), np.float32)
    for slot, lane in enumerate(truth, start=1):
        scaled = [(x * 800 / 1640, y * 288 / 590) for x, y in lane]
        for (x0, y0), (x1, y1) in itertools.pairwise(scaled):
            cv2.line(probs[slot], (round(x0), round(y0)), (round(x1), round(y1)), 0.9, 3)
    probs[4, 150:160, 300:305] = 0.8  # slot 4: one row only, so dropped
    existence = np.array([0.9, 0.8, 0.2, 0.7])  # slot 3 drawn but said absent
    decoded = culane_lanes(probs, existence)
    expected = []
    for slot in (0, 1, 3):
        coordinate = get_lane(cv2.blur(probs[slot + 1], (3, 3)))
        points = [(int(np.floor(c * 1640 / 800 + 0.5)) - 1, 590 - m * 20 - 1) for m, c in enumerate(coordinate)
                  if c > 0]
        if len(points) > 1:
            expected.append((slot, points))
    assert decoded == expected and [slot for slot, _ in decoded] == [0, 1]
    predicted = [np.asarray(points, np.float32) for _, points in decoded]
    scores = score_image([np.asarray(lane, np.float32) for lane in truth[:2]], predicted)
    assert scores[0.5] == Counts(2, 0, 0)
