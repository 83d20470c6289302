"""CULane's format (training.data.culane) and the synthetic CULane-format data (training.data.synthetic_culane)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import cv2
import numpy as np
import pytest

from training.culane_eval import scenario_lists, score_lists
from training.culane_metric import SCENARIOS, parse_lines
from training.data.culane import (
    CulaneListError,
    lanes_in_slots,
    lines_path_for,
    parse_gt_list_line,
    seg_label,
)
from training.data.synthetic_culane import generate


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("culane")
    assert generate(root, train=6, val=3, test=9, seed=3) == {"train_gt.txt": 6, "val_gt.txt": 3, "test.txt": 9}
    return root


def test_the_synthetic_set_is_laid_out_as_culane_ships_it(synthetic: Path) -> None:
    """Frames of 1640x590 under driver folders, a lines file beside each, labels whose flags the lines fill,
    segmentation labels drawn from the lines (value k for slot k), and the test list split by scenario."""
    for split in ("train", "val"):
        for line in (synthetic / "list" / f"{split}_gt.txt").read_text().splitlines():
            entry = parse_gt_list_line(line)
            image = cv2.imread(str(synthetic / entry.image))
            assert image.shape == (590, 1640, 3) and entry.image.split("/")[0].startswith("driver_")
            lanes = parse_lines((synthetic / lines_path_for(entry.image)).read_text())
            slots = lanes_in_slots([[tuple(point) for point in lane] for lane in lanes], entry.existence)
            mask = cv2.imread(str(synthetic / entry.mask), cv2.IMREAD_UNCHANGED)
            np.testing.assert_array_equal(mask, seg_label(slots))
            assert set(np.unique(mask)) == {0, *(k + 1 for k, flag in enumerate(entry.existence) if flag)}
    tests = (synthetic / "list" / "test.txt").read_text().splitlines()
    lists = scenario_lists(synthetic)
    assert list(lists) == list(SCENARIOS)
    assert sorted(image for images in lists.values() for image in images) == sorted(tests)
    assert all(len(images) == 1 for images in lists.values())
    assert (synthetic / lines_path_for(lists["cross"][0])).read_text() == ""  # crossroads: no lanes
    assert all(parse_lines((synthetic / lines_path_for(image)).read_text())
               for name, images in lists.items() if name != "cross" for image in images)


def test_the_ground_truth_scores_perfectly_on_every_scenario_with_no_false_positive_at_the_crossroads(
        synthetic: Path) -> None:
    scores = score_lists(scenario_lists(synthetic), synthetic, synthetic)
    assert all(scores[name].f1 == 1.0 for name in SCENARIOS if name != "cross"), scores
    assert scores["cross"].counts[0.5].fp == 0 and scores["all"].f1 == 1.0


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_frames(tmp_path: Path) -> None:
    def digest(root: Path) -> str:
        files = sorted(path for path in root.rglob("*") if path.is_file())
        return hashlib.sha256(b"".join(str(p.relative_to(root)).encode() + p.read_bytes() for p in files)).hexdigest()

    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        generate(tmp_path / name, train=2, val=1, test=2, seed=seed)
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")


@pytest.mark.parametrize(("line", "says"), [
    ("/a.jpg /a.png 1 1 1", "expected '/image /label e1 e2 e3 e4' (6 fields), found 5"),
    ("/a.jpg /a.png 1 1 2 0", "existence flags must be 0 or 1, found '1 1 2 0'"),
    ("/../etc/x.jpg /a.png 1 1 1 1", "the image path '/../etc/x.jpg' is not a path inside the dataset"),
    ("/a.jpg / 1 1 1 1", "the label path '/' is not a path inside the dataset"),
])
def test_a_bad_list_line_says_what_is_wrong(line: str, says: str) -> None:
    with pytest.raises(CulaneListError) as raised:
        parse_gt_list_line(line)
    assert str(raised.value) == says


def test_lanes_fill_the_flagged_slots_in_order_and_a_disagreeing_count_is_an_error() -> None:
    left, right = [(100.0, 590.0), (200.0, 400.0)], [(900.0, 590.0), (800.0, 400.0)]
    assert lanes_in_slots([left, right], (0, 1, 1, 0)) == [[], left, right, []]
    with pytest.raises(CulaneListError, match="the existence flags 1 1 1 0 name 3 lane"):
        lanes_in_slots([left, right], (1, 1, 1, 0))
