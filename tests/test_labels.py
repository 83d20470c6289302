"""Label parsing, lane-slot assignment and mask rasterizing on hand-made lanes."""

from __future__ import annotations

import json

import cv2
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


def test_lines_are_drawn_with_the_seeds_thickness_scaled_to_the_image():
    assert [labels.thickness_for(w) for w in (1280, 640, 320, 64)] == [15, 8, 4, 1]
    vertical = tuple(640 for _ in H_SAMPLES)
    mask = labels.rasterize_mask([[], labels.lane_points(vertical, H_SAMPLES), [], []], 1280, 720)
    # OpenCV's thickness 15 paints 17 pixels across a vertical line: what the seed's masks hold.
    assert set(np.flatnonzero(mask[400])) == set(range(632, 649))


def test_diagonal_lines_keep_the_width_across_the_lane():
    points = [(100.0 + i * 10, 100.0 + i * 10) for i in range(50)]  # 45 degrees
    mask = labels.rasterize_mask([[], points, [], []], 1280, 720)
    across_row = np.count_nonzero(mask[400])
    assert across_row / np.sqrt(2) == pytest.approx(17, abs=1.5)


# --- the seed's masks, reproduced independently -------------------------------------------------------

def seed_gen_seg_label(lanes: list[list[int]], h_samples: list[int], size: tuple[int, int] = (1280, 720)):
    """The seed's ``gen_seg_label`` for one label line, rewritten here from its rules (not laneflow's code):
    lanes with > 1 point sorted by the angle from their last to their first point; the last lane at
    <= 90 degrees and the one before it go left of the car, the next two right; each of the four, if it
    has >= 4 points, drawn with ``cv2.line(..., slot, thickness=15)`` segment by segment into a 3-channel
    float image, slot 1 first. Returns (mask, existence)."""
    width, height = size
    kept, angles = [], []
    for lane in lanes:
        points = [(x, y) for x, y in zip(lane, h_samples, strict=True) if x >= 0]
        if len(points) > 1:
            kept.append(points)
            angles.append(np.arctan2(points[-1][1] - points[0][1], points[0][0] - points[-1][0]) / np.pi * 180)
    order = np.argsort(angles, kind="stable")
    kept, angles = [kept[i] for i in order], [angles[i] for i in order]
    index = [None] * 4
    for i, angle in enumerate(angles):
        if angle <= 90:
            index[1] = i
            index[0] = i - 1 if i > 0 else None
        else:
            index[2] = i
            index[3] = i + 1 if i + 1 < len(angles) else None
            break
    chosen = [[] if i is None else kept[i] for i in index]
    image = np.zeros((height, width, 3))
    existence = []
    for slot, coords in enumerate(chosen):
        if len(coords) < 4:
            existence.append(0)
            continue
        for j in range(len(coords) - 1):
            cv2.line(image, coords[j], coords[j + 1], (slot + 1, slot + 1, slot + 1), 15)
        existence.append(1)
    return image[:, :, 0].astype(np.uint8), tuple(existence)


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


EDGE_H_SAMPLES = list(range(5, 720, 10))  # 5..715: thick lines cross the top and bottom edges


def edge_lane(x_top: int, x_bottom: int, first: int = 0, last: int | None = None) -> list[int]:
    last = len(EDGE_H_SAMPLES) - 1 if last is None else last
    return [round(x_top + (x_bottom - x_top) * (i - first) / max(last - first, 1)) if first <= i <= last else ABSENT
            for i in range(len(EDGE_H_SAMPLES))]


HAND_MADE = [
    # leaving the image on the left, right, top and bottom (x at 0 and 1279, rows 5 and 715)
    [edge_lane(600, 0), edge_lane(620, 2, last=60), edge_lane(660, 1279), edge_lane(700, 1277, first=3)],
    # five lanes: the outermost left one is not drawn; a 3-point lane (existence 0) and a 2-point one
    [edge_lane(560, 3), edge_lane(600, 200), edge_lane(630, 450), edge_lane(660, 850, first=68, last=70),
     edge_lane(690, 1279), edge_lane(700, 1100, first=70)],
    # crossing lanes, a lane only in the top rows, and one hugging the left edge all the way down
    [edge_lane(0, 0), edge_lane(640, 300, last=20), edge_lane(300, 900), edge_lane(900, 300)],
    [edge_lane(1279, 1279), edge_lane(10, 1270, first=10, last=13)],
]


def test_masks_on_disk_are_pixel_identical_to_the_seeds(tmp_path):
    from training.data.preprocess import preprocess

    blank = cv2.imencode(".jpg", np.zeros((720, 1280, 3), np.uint8))[1].tobytes()
    lines = []
    for index, lanes in enumerate(HAND_MADE):
        raw_file = f"clips/0313-1/{index}/20.jpg"
        (tmp_path / raw_file).parent.mkdir(parents=True)
        (tmp_path / raw_file).write_bytes(blank)
        lines.append(json.dumps({"lanes": lanes, "h_samples": EDGE_H_SAMPLES, "raw_file": raw_file}))
    (tmp_path / "label_data_0313.json").write_text("\n".join(lines) + "\n")
    report = preprocess(tmp_path, workers=1)
    assert report.counts["kept"] == len(HAND_MADE)
    listed = (tmp_path / "seg_label" / "list" / "train_gt.txt").read_text().splitlines()
    for index, lanes in enumerate(HAND_MADE):
        expected, existence = seed_gen_seg_label(lanes, EDGE_H_SAMPLES)
        on_disk = cv2.imread(str(tmp_path / f"seg_label/0313-1/{index}/20.png"), cv2.IMREAD_UNCHANGED)
        assert on_disk.shape == (720, 1280) and on_disk.dtype == np.uint8
        assert np.array_equal(on_disk, expected), f"line {index}: {np.count_nonzero(on_disk != expected)} px differ"
        assert listed[index].split()[2:] == [str(flag) for flag in existence]
    assert set(np.unique(expected)) >= {0}


def test_in_memory_masks_equal_the_pngs_written_for_2000_random_lane_sets():
    """The band the PNG writer encodes (drawn with a padding column) is the full mask's rows exactly."""
    from training.data.png import encode_gray_png_scanlines

    rng = np.random.default_rng(11)
    for case in range(2000):
        width, height = ((1280, 720), (640, 360))[case % 2]
        slots = []
        for _ in range(4):
            count = int(rng.integers(0, 9))
            edge = rng.random()
            xs = rng.integers(0, 6 if edge < 0.3 else width, count) if edge < 0.5 else \
                rng.integers(width - 6, width, count) if edge < 0.7 else rng.integers(0, width, count)
            ys = np.sort(rng.choice(np.arange(0, height), size=count, replace=False))
            slots.append([(float(x), float(y)) for x, y in zip(xs, ys, strict=True)])
        mask = labels.rasterize_mask(slots, width, height)
        top, band = labels.rasterize_band(slots, width, height, pad_left=1)
        decoded = cv2.imdecode(np.frombuffer(encode_gray_png_scanlines(band, top, height), np.uint8),
                               cv2.IMREAD_UNCHANGED)
        assert np.array_equal(decoded, mask), f"case {case}: {slots}"


def test_the_left_edge_example_from_the_bug_report():
    slots = [[], [(112, 561.0), (75, 571.0), (38, 581.0), (1, 591.0)], [], []]
    top, band = labels.rasterize_band(slots, 1280, 720, pad_left=1)
    assert np.array_equal(band[:, 1:], labels.rasterize_mask(slots, 1280, 720)[top:])
