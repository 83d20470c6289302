"""TuSimple label records: parsing, validation, lane-slot assignment and mask rasterizing.

Everything here is pure (no file access) so the rules of DESIGN §4 can be tested on hand-made
lanes and reused unchanged by the preprocessing workers, the trainer and the benchmarks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import PurePosixPath

import cv2
import numpy as np

#: TuSimple's reference frame. Masks are drawn as the seed's ``gen_seg_label`` draws them: OpenCV
#: ``cv2.line(mask, p[j], p[j+1], slot, thickness=15)`` at this size (OpenCV paints that 17 px across),
#: the thickness scaled in proportion for other sizes.
REFERENCE_WIDTH = 1280
REFERENCE_HEIGHT = 720
THICKNESS_AT_REFERENCE = 15
#: Lane slots in the mask: 1..4 from left to right (0 is background).
NUM_SLOTS = 4
#: A lane needs this many labelled points for its slot to count as existing.
MIN_POINTS_FOR_EXISTENCE = 4
#: TuSimple marks an absent point with a negative x (-2 in the public labels).
ABSENT = -2

#: Label file -> split, as published with the TuSimple benchmark.
LABEL_FILES: dict[str, str] = {
    "label_data_0313.json": "train",
    "label_data_0601.json": "train",
    "label_data_0531.json": "val",
    "test_label.json": "test",
}
SPLITS = ("train", "val", "test")


class QuarantineReason:
    """Why a label record was set aside; stable strings that end up in manifest.json."""

    INVALID_JSON = "invalid_json"
    LINE_TOO_LONG = "line_too_long"
    INVALID_RECORD = "invalid_record"
    LENGTH_MISMATCH = "length_mismatch"
    X_OUT_OF_RANGE = "x_out_of_range"
    Y_OUT_OF_RANGE = "y_out_of_range"
    UNSAFE_PATH = "unsafe_path"
    DUPLICATE = "duplicate_raw_file"
    MISSING_IMAGE = "missing_image"
    UNREADABLE_IMAGE = "unreadable_image"


class LabelError(ValueError):
    """A label record that cannot be used; ``reason`` is a :class:`QuarantineReason` value."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class LabelRecord:
    """One validated line of a TuSimple label file."""

    raw_file: str
    h_samples: tuple[int, ...]
    lanes: tuple[tuple[float, ...], ...]


Point = tuple[float, float]


#: A TuSimple label line is ~1-2 KB (56 h_samples, up to 5 lanes); a longer one is not a label, and is not parsed.
MAX_LABEL_LINE_CHARS = 64 * 1024


def load_json_line(line: str) -> object:
    """``json.loads`` of one label line that never fails but with :class:`LabelError`: a line past
    ``MAX_LABEL_LINE_CHARS``, nested past the parser's recursion limit, or holding an integer of more digits
    than Python converts, is a bad line like any other (quarantined), never the end of the preparation."""
    if len(line) > MAX_LABEL_LINE_CHARS:
        raise LabelError(QuarantineReason.LINE_TOO_LONG,
                         f"{len(line)} characters; a label line has at most {MAX_LABEL_LINE_CHARS}")
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise LabelError(QuarantineReason.INVALID_JSON, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise LabelError(QuarantineReason.INVALID_JSON, "not valid JSON (nested too deeply to parse)") from None
    except ValueError as exc:  # e.g. an integer past sys.get_int_max_str_digits()
        raise LabelError(QuarantineReason.INVALID_JSON, f"not valid JSON ({str(exc)[:120]})") from None


def parse_label_line(line: str) -> LabelRecord:
    """Parse one JSON line of a label file, checking its shape (not yet against the image).

    Raises :class:`LabelError` naming what is wrong.
    """
    obj = load_json_line(line)
    if not isinstance(obj, dict):
        raise LabelError(QuarantineReason.INVALID_RECORD, "a label line must be a JSON object")
    for key in ("raw_file", "h_samples", "lanes"):
        if key not in obj:
            raise LabelError(QuarantineReason.INVALID_RECORD, f"missing field '{key}'")
    raw_file, h_samples, lanes = obj["raw_file"], obj["h_samples"], obj["lanes"]
    if not isinstance(raw_file, str) or not raw_file:
        raise LabelError(QuarantineReason.INVALID_RECORD, "'raw_file' must be a non-empty string")
    if not _is_number_list(h_samples) or not h_samples:
        raise LabelError(QuarantineReason.INVALID_RECORD, "'h_samples' must be a non-empty list of numbers")
    if not isinstance(lanes, list) or not all(_is_number_list(lane) for lane in lanes):
        raise LabelError(QuarantineReason.INVALID_RECORD, "'lanes' must be a list of lists of numbers")
    if not is_safe_relative_path(raw_file):
        raise LabelError(QuarantineReason.UNSAFE_PATH,
                         f"raw_file '{raw_file}' must be a relative path inside the dataset")
    for index, lane in enumerate(lanes):
        if len(lane) != len(h_samples):
            raise LabelError(
                QuarantineReason.LENGTH_MISMATCH,
                f"lane {index} has {len(lane)} x values but there are {len(h_samples)} h_samples",
            )
    return LabelRecord(
        raw_file=raw_file,
        h_samples=tuple(y if type(y) is int else round(y) for y in h_samples),
        lanes=tuple(tuple(lane) for lane in lanes),
    )


def _is_number_list(value: object) -> bool:
    """A list of finite ints/floats (bools are not numbers here). Hot path: labels are mostly ints."""
    if not isinstance(value, list):
        return False
    for v in value:
        kind = type(v)
        if kind is int or (kind is float and math.isfinite(v)):
            continue
        return False
    return True


def is_safe_relative_path(path: str) -> bool:
    """True for a relative POSIX path that stays inside its root (no absolute, no '..', no backslash)."""
    if "\\" in path or "\x00" in path:
        return False
    pure = PurePosixPath(path)
    return not pure.is_absolute() and ".." not in pure.parts and len(pure.parts) > 0


def check_against_image(record: LabelRecord, width: int, height: int) -> None:
    """Check that every labelled point lies inside a ``width`` x ``height`` image."""
    for y in record.h_samples:
        if not 0 <= y < height:
            raise LabelError(QuarantineReason.Y_OUT_OF_RANGE, f"h_sample {y} is outside the image height {height}")
    for index, lane in enumerate(record.lanes):
        for x, y in zip(lane, record.h_samples, strict=True):
            if x >= 0 and x >= width:
                raise LabelError(
                    QuarantineReason.X_OUT_OF_RANGE,
                    f"lane {index} has x={x:g} at y={y}, outside the image width {width}",
                )
            if x < 0 and x != ABSENT:
                raise LabelError(
                    QuarantineReason.X_OUT_OF_RANGE,
                    f"lane {index} has x={x:g} at y={y}; absent points must be {ABSENT}",
                )


def h_samples_for(height: int) -> list[int]:
    """TuSimple's label rows (160..710 step 10 at 720 px), scaled to ``height``."""
    return [round(y * height / REFERENCE_HEIGHT) for y in range(160, 720, 10)]


def lane_points(lane: tuple[float, ...], h_samples: tuple[int, ...]) -> list[Point]:
    """The labelled (x, y) points of a lane, top to bottom as in the label."""
    return [(x, float(y)) for x, y in zip(lane, h_samples, strict=True) if x >= 0]


def lane_angle_degrees(points: list[Point]) -> float:
    """Direction from the lane's bottom point to its top point, in degrees in (0, 180).

    Lanes left of the ego car lean right as they rise (< 90°), lanes on the right lean left (> 90°),
    and the further a lane is from the car the further its angle is from 90°. Image y grows downward.
    """
    (x_top, y_top), (x_bottom, y_bottom) = points[0], points[-1]
    return math.degrees(math.atan2(y_bottom - y_top, x_top - x_bottom))


def assign_slots(lanes: tuple[tuple[float, ...], ...], h_samples: tuple[int, ...]) -> list[list[Point]]:
    """Pick the lanes for slots 1..4 (left-outer, left-ego, right-ego, right-outer).

    Lanes with at least two points are ordered by angle; the two nearest the car on each side
    fill the slots. An empty list means the slot has no lane.
    """
    candidates = [pts for pts in (lane_points(lane, h_samples) for lane in lanes) if len(pts) >= 2]
    ordered = sorted(candidates, key=lane_angle_degrees)
    left = [pts for pts in ordered if lane_angle_degrees(pts) <= 90.0]
    right = [pts for pts in ordered if lane_angle_degrees(pts) > 90.0]
    slots: list[list[Point]] = [[], [], [], []]
    if left:
        slots[1] = left[-1]
    if len(left) >= 2:
        slots[0] = left[-2]
    if right:
        slots[2] = right[0]
    if len(right) >= 2:
        slots[3] = right[1]
    return slots


def existence_flags(slots: list[list[Point]]) -> tuple[int, ...]:
    """1 for a slot whose lane has enough points to be learned, else 0."""
    return tuple(int(len(points) >= MIN_POINTS_FOR_EXISTENCE) for points in slots)


def thickness_for(width: int) -> int:
    """The OpenCV line ``thickness`` for an image ``width`` px wide: the seed's 15 at 1280, in proportion."""
    return max(1, round(THICKNESS_AT_REFERENCE * width / REFERENCE_WIDTH))


def _polylines(slots: list[list[Point]]) -> list[tuple[int, np.ndarray]]:
    """(slot value, integer points) of each slot whose lane exists, in slot order (later slots paint over)."""
    return [(slot + 1, np.round(np.asarray(points, dtype=np.float64)).astype(np.int32))
            for slot, (points, exists) in enumerate(zip(slots, existence_flags(slots), strict=True)) if exists]


def rasterize_band(slots: list[list[Point]], width: int, height: int, pad_left: int = 0) -> tuple[int, np.ndarray]:
    """The mask from its first possibly non-zero row down: ``(top, band)``; rows above ``top`` are 0.

    Lanes start below the horizon, so drawing (and later encoding) only this band saves ~40 % of
    the work. ``pad_left`` zero columns are kept on the left of the band (a PNG writer puts its per-row
    filter byte there without copying the mask). The lanes are drawn into a view of the band that is
    exactly ``width`` columns wide, so OpenCV clips them at the image's own left edge (not at the
    padding's) and the band equals the same rows of ``rasterize_mask`` pixel for pixel.
    """
    thickness = thickness_for(width)
    polylines = _polylines(slots)
    if not polylines:
        return height, np.zeros((0, width + pad_left), dtype=np.uint8)
    # A thick line paints at most about thickness/2 + 1 rows above its highest point; keep a margin.
    highest = min(int(line[:, 1].min()) for _, line in polylines)
    top = min(height, max(0, highest - thickness - 2))
    band = np.zeros((height - top, width + pad_left), dtype=np.uint8)
    canvas = band[:, pad_left:]  # a strided view: OpenCV draws into it in place
    offset = np.array([0, -top], dtype=np.int32)
    for value, line in polylines:
        cv2.polylines(canvas, [(line + offset).reshape(-1, 1, 2)], isClosed=False, color=value, thickness=thickness)
    return top, band


def rasterize_mask(slots: list[list[Point]], width: int, height: int) -> np.ndarray:
    """Draw each existing slot's lane as a polyline of value slot+1 into a uint8 ``height`` x ``width`` mask.

    ``cv2.polylines`` paints exactly what consecutive ``cv2.line`` calls paint (each segment is the
    same thick line, and a segment's start cap is the previous one's end cap).
    """
    mask = np.zeros((height, width), dtype=np.uint8)
    top, band = rasterize_band(slots, width, height)
    mask[top:] = band
    return mask


def mask_path_for(raw_file: str) -> str:
    """Where the mask of ``clips/<date>/<id>/20.jpg`` lives: ``seg_label/<date>/<id>/20.png``."""
    parts = PurePosixPath(raw_file).parts
    if parts and parts[0] == "clips":
        parts = parts[1:]
    return str(PurePosixPath("seg_label", *parts).with_suffix(".png"))


def list_line(raw_file: str, mask_file: str, existence: tuple[int, ...]) -> str:
    """A list-file line: ``/<img> /<mask> e1 e2 e3 e4`` (paths relative to the dataset root)."""
    return f"/{raw_file} /{mask_file} {' '.join(str(e) for e in existence)}"
