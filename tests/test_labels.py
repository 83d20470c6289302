"""Label parsing, lane-slot assignment and mask rasterizing on hand-made lanes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from training.data import labels
from training.data.labels import LabelError, QuarantineReason

H_SAMPLES = tuple(range(160, 720, 10))  # 56 rows, as in TuSimple
ABSENT = -2


def straight_lane(x_bottom: float, x_top: float, first_row: int = 0, last_row: int = 55) -> tuple[float, ...]:
    """A straight lane from (x_top, H_SAMPLES[first_row]) to (x_bottom, H_SAMPLES[last_row]); absent elsewhere."""
    xs = []
    for i, _ in enumerate(H_SAMPLES):
        if first_row <= i <= last_row:
            t = (i - first_row) / max(last_row - first_row, 1)
            xs.append(round(x_top + t * (x_bottom - x_top)))
        else:
            xs.append(ABSENT)
    return tuple(xs)


# A five-lane road seen from the second lane from the left: bottom x positions spread out,
# all lanes meet near (640, 160).
FAR_LEFT = straight_lane(-300, 560, last_row=30)   # leaves the image on the left: cut where x < 0
LEFT_OUTER = straight_lane(100, 600)
LEFT_EGO = straight_lane(450, 630)
RIGHT_EGO = straight_lane(850, 660)
RIGHT_OUTER = straight_lane(1200, 690)


def clip(lane: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x if 0 <= x < 1280 else ABSENT for x in lane)


def label_line(**overrides) -> str:
    record = {"lanes": [list(LEFT_EGO), list(RIGHT_EGO)], "h_samples": list(H_SAMPLES),
              "raw_file": "clips/0313-1/100/20.jpg"}
    record.update(overrides)
    return json.dumps(record)


def test_parse_valid_line():
    record = labels.parse_label_line(label_line())
    assert record.raw_file == "clips/0313-1/100/20.jpg"
    assert record.h_samples == H_SAMPLES
    assert len(record.lanes) == 2


@pytest.mark.parametrize(
    ("line", "reason", "detail"),
    [
        ('{"lanes": [', QuarantineReason.INVALID_JSON, "not valid JSON"),
        ("[1, 2]", QuarantineReason.INVALID_RECORD, "JSON object"),
        (json.dumps({"lanes": [], "h_samples": [160]}), QuarantineReason.INVALID_RECORD, "missing field 'raw_file'"),
        (label_line(h_samples=[]), QuarantineReason.INVALID_RECORD, "h_samples"),
        (label_line(lanes=[["a"] * 56]), QuarantineReason.INVALID_RECORD, "lists of numbers"),
        (label_line(lanes=[[1] * 55]), QuarantineReason.LENGTH_MISMATCH, "lane 0 has 55 x values but there are 56"),
        (label_line(raw_file="/etc/passwd"), QuarantineReason.UNSAFE_PATH, "relative path"),
        (label_line(raw_file="clips/../../x.jpg"), QuarantineReason.UNSAFE_PATH, "relative path"),
    ],
)
def test_parse_rejects_bad_lines_with_reason(line: str, reason: str, detail: str):
    with pytest.raises(LabelError) as info:
        labels.parse_label_line(line)
    assert info.value.reason == reason
    assert detail in info.value.detail


def test_points_outside_the_image_are_rejected():
    lane = list(LEFT_EGO)
    lane[40] = 1280
    record = labels.parse_label_line(label_line(lanes=[lane]))
    with pytest.raises(LabelError) as info:
        labels.check_against_image(record, 1280, 720)
    assert info.value.reason == QuarantineReason.X_OUT_OF_RANGE
    assert "x=1280 at y=560" in info.value.detail
    lane[40] = -7
    with pytest.raises(LabelError, match="absent points must be -2"):
        labels.check_against_image(labels.parse_label_line(label_line(lanes=[lane])), 1280, 720)
    with pytest.raises(LabelError) as info:
        labels.check_against_image(labels.parse_label_line(label_line()), 1280, 700)
    assert info.value.reason == QuarantineReason.Y_OUT_OF_RANGE


def test_slots_take_the_two_nearest_lanes_on_each_side():
    # Given in scrambled order: assignment must not depend on label order.
    lanes = (RIGHT_OUTER, clip(FAR_LEFT), LEFT_EGO, RIGHT_EGO, LEFT_OUTER)
    slots = labels.assign_slots(lanes, H_SAMPLES)
    bottoms = [points[-1][0] for points in slots]
    assert bottoms == [100, 450, 850, 1200]


def test_angles_order_lanes_from_left_to_right():
    angles = [labels.lane_angle_degrees(labels.lane_points(lane, H_SAMPLES))
              for lane in (LEFT_OUTER, LEFT_EGO, RIGHT_EGO, RIGHT_OUTER)]
    assert angles == sorted(angles)
    assert angles[1] < 90 < angles[2]


def test_one_lane_per_side_fills_the_ego_slots_only():
    slots = labels.assign_slots((RIGHT_EGO, LEFT_EGO), H_SAMPLES)
    assert [bool(s) for s in slots] == [False, True, True, False]
    assert labels.existence_flags(slots) == (0, 1, 1, 0)


def test_only_right_lanes():
    slots = labels.assign_slots((RIGHT_OUTER, RIGHT_EGO), H_SAMPLES)
    assert [s[-1][0] if s else None for s in slots] == [None, None, 850, 1200]


def test_lanes_with_fewer_than_two_points_are_ignored():
    single_point = tuple(500 if i == 50 else ABSENT for i in range(56))
    slots = labels.assign_slots((single_point, LEFT_EGO, RIGHT_EGO), H_SAMPLES)
    assert slots[0] == []  # the single point did not become the outer-left lane
    assert slots[1][-1][0] == 450


def test_lane_with_fewer_than_four_points_gets_existence_zero_and_is_not_drawn():
    short_left = straight_lane(450, 630, first_row=52, last_row=54)  # 3 points
    slots = labels.assign_slots((short_left, RIGHT_EGO), H_SAMPLES)
    assert len(slots[1]) == 3
    assert labels.existence_flags(slots) == (0, 0, 1, 0)
    mask = labels.rasterize_mask(slots, 1280, 720)
    assert set(np.unique(mask)) == {0, 3}


def test_mask_is_uint8_single_channel_with_slot_values():
    slots = labels.assign_slots((LEFT_OUTER, LEFT_EGO, RIGHT_EGO, RIGHT_OUTER), H_SAMPLES)
    mask = labels.rasterize_mask(slots, 1280, 720)
    assert mask.dtype == np.uint8 and mask.shape == (720, 1280)
    assert set(np.unique(mask)) == {0, 1, 2, 3, 4}
    # Each lane's own pixels are where its polyline is.
    assert mask[719 - 4, 450] == 2 and mask[719 - 4, 850] == 3


def test_line_width_is_15_px_at_1280x720_and_scales():
    vertical = tuple(640 for _ in H_SAMPLES)
    slots = [[], labels.lane_points(vertical, H_SAMPLES), [], []]
    mask = labels.rasterize_mask(slots, 1280, 720)
    row = mask[400]
    assert np.count_nonzero(row) == 15
    assert set(np.flatnonzero(row)) == set(range(633, 648))
    assert labels.line_width_for(1280) == 15
    assert labels.line_width_for(640) == 7  # 7.5 -> nearest odd width
    assert labels.line_width_for(320) == 3
    assert labels.line_width_for(64) == 1


@pytest.mark.parametrize("width", [1280, 640, 320, 128])
def test_drawn_width_matches_the_nominal_width(width: int):
    height = width * 9 // 16
    column = width // 2
    points = [(column, y) for y in range(height // 4, height, 10)]
    mask = labels.rasterize_mask([[], points, [], []], width, height)
    assert np.count_nonzero(mask[height // 2]) == labels.line_width_for(width)


def test_diagonal_lines_keep_the_width_across_the_lane():
    points = [(100.0 + i * 10, 100.0 + i * 10) for i in range(50)]  # 45 degrees
    mask = labels.rasterize_mask([[], points, [], []], 1280, 720)
    across_row = np.count_nonzero(mask[400])
    assert across_row / np.sqrt(2) == pytest.approx(15, abs=1.0)


def test_mask_path_and_list_line():
    assert labels.mask_path_for("clips/0313-1/6040/20.jpg") == "seg_label/0313-1/6040/20.png"
    assert labels.mask_path_for("other/a/20.jpg") == "seg_label/other/a/20.png"
    line = labels.list_line("clips/0313-1/6040/20.jpg", "seg_label/0313-1/6040/20.png", (0, 1, 1, 0))
    assert line == "/clips/0313-1/6040/20.jpg /seg_label/0313-1/6040/20.png 0 1 1 0"


@pytest.mark.parametrize(
    ("path", "safe"),
    [("clips/a/20.jpg", True), ("/abs.jpg", False), ("a/../../b", False), ("a\\b", False), ("", False)],
)
def test_safe_relative_paths(path: str, safe: bool):
    assert labels.is_safe_relative_path(path) is safe
