"""Running a trained SCNN on images: the input contract, the deployable module, lanes from its output.

One path for every consumer — the evaluation stage, ``laneflow predict`` and the exported TorchScript
and ONNX models — so they agree to the pixel:

- **Input contract.** A batch of BGR ``uint8`` images as OpenCV decodes them (NHWC), each resized from
  the full decoded frame to the model's input size with ``cv2.INTER_LINEAR``.
- **Deployable module** (``DeployedSCNN``). Converts that batch to RGB float, normalises it with the
  statistics the network was trained with (the model's ``mean_rgb``/``std_rgb``: ImageNet's for SCNN), and
  returns softmax probabilities ``(N, 5, H, W)``
  (background + 4 lane slots) and lane existence ``(N, 4)``. This is what the package exports.
- **Lanes** (``lanes_from_probabilities``, pure). For each slot whose existence is over 0.5, at each
  h_sample row the column of the slot's (3x3-smoothed) probability peak when it is over 0.3, mapped back
  to source pixels; -2 elsewhere; lanes with fewer than 2 points are dropped. h_samples are TuSimple's
  rows (160..710 step 10 at 720 px) scaled to the source image's height.
- **CULane lanes** (``culane_lanes``, pure). SCNN's own post-processing for CULane (XingangPan/SCNN
  ``tools/prob2lines/getLane.m`` and ``main.m``): for each slot whose existence is over 0.5, 18 points, one
  every 20 rows of the 590-row frame from its bottom up, each at the column of the slot's probability peak on
  the matching row of the map when the peak is over 0.3; a lane of fewer than 2 points is dropped; the points
  go into a ``.lines.txt`` as ``x y`` in the frame's pixels. The maps are smoothed as above (SCNN read the
  averaged maps it had saved as 8-bit images; here they stay floats).
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
import torch
from torch import nn

from training.data.labels import h_samples_for
from training.dataset import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["DeployedSCNN", "culane_lanes", "draw_lanes", "h_samples_for", "input_contract",
           "lanes_from_probabilities", "resize_for_model", "slot_lanes"]

PROB_THRESHOLD = 0.3
EXIST_THRESHOLD = 0.5
ABSENT = -2
SLOT_COLOURS = ((255, 80, 80), (80, 255, 80), (80, 160, 255), (255, 220, 60))  # BGR per slot


def input_contract(width: int, height: int, mean_rgb: Sequence[float] = IMAGENET_MEAN,
                   std_rgb: Sequence[float] = IMAGENET_STD) -> dict:
    """What a consumer of an exported model must feed it and what it gets back (recorded in packages); the
    normalisation inside it is the model's (``LaneModel.mean_rgb``/``std_rgb``)."""
    return {
        "input": {"shape": ["batch", height, width, 3], "dtype": "uint8", "layout": "NHWC",
                  "colour_order": "BGR (as OpenCV decodes)",
                  "resize": "cv2.resize(full decoded image, (width, height), interpolation=cv2.INTER_LINEAR)",
                  "normalisation": {"inside_the_model": True, "scale": "1/255", "mean_rgb": list(mean_rgb),
                                    "std_rgb": list(std_rgb)}},
        "outputs": {"probabilities": ["batch", 5, height, width], "existence": ["batch", 4],
                    "classes": ["background", "lane slot 1 (left outer)", "lane slot 2 (left ego)",
                                "lane slot 3 (right ego)", "lane slot 4 (right outer)"]},
        "lanes": {"existence_threshold": EXIST_THRESHOLD, "probability_threshold": PROB_THRESHOLD,
                  "smoothing": "3x3 box filter on each slot's probability map",
                  "h_samples": "TuSimple rows 160..710 step 10 at 720 px, scaled to the source image height",
                  "absent_x": ABSENT, "min_points": 2},
    }


def resize_for_model(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """The input contract's resize: a full decoded BGR frame to the model's input size."""
    if image.shape[:2] == (height, width):
        return image
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)


class DeployedSCNN(nn.Module):
    """SCNN behind the input contract: uint8 BGR NHWC in, normalised with the model's RGB statistics (ImageNet's
    for SCNN), (probabilities, existence) out."""

    def __init__(self, model: nn.Module, mean_rgb: Sequence[float] = IMAGENET_MEAN,
                 std_rgb: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean_rgb, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std_rgb, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rgb = images.permute(0, 3, 1, 2)[:, [2, 1, 0]].float()
        logits, existence = self.model((rgb / 255.0 - self.mean) / self.std)
        return torch.softmax(logits, dim=1), existence


def lanes_from_probabilities(probs: np.ndarray, existence: np.ndarray, h_samples: list[int],
                             image_size: tuple[int, int], threshold: float = PROB_THRESHOLD,
                             exist_threshold: float = EXIST_THRESHOLD) -> list[list[int]]:
    """Lane x at each h_sample (-2 where absent) for slots whose existence > ``exist_threshold``.

    ``probs`` is (5, H, W) softmax output at network resolution; ``image_size`` is the original
    (width, height) the h_samples refer to.
    """
    return [lane for _, lane in slot_lanes(probs, existence, h_samples, image_size, threshold, exist_threshold)]


def slot_lanes(probs: np.ndarray, existence: np.ndarray, h_samples: list[int], image_size: tuple[int, int],
               threshold: float = PROB_THRESHOLD, exist_threshold: float = EXIST_THRESHOLD
               ) -> list[tuple[int, list[int]]]:
    """``(slot, lane)`` pairs of ``lanes_from_probabilities``: which slot (0..3) each lane came from."""
    _, height, width = probs.shape
    orig_w, orig_h = image_size
    rows = np.clip(np.round(np.asarray(h_samples) * height / orig_h).astype(int), 0, height - 1)
    lanes = []
    for slot in range(4):
        if existence[slot] <= exist_threshold:
            continue
        smooth = cv2.blur(probs[slot + 1].astype(np.float32), (3, 3))
        values = smooth[rows]
        peaks = values.argmax(axis=1)
        present = values[np.arange(len(rows)), peaks] > threshold
        xs = np.where(present, np.round((peaks + 0.5) * orig_w / width - 0.5), ABSENT).astype(int)
        xs = np.clip(xs, ABSENT, orig_w - 1)
        if (xs >= 0).sum() >= 2:
            lanes.append((slot, xs.tolist()))
    return lanes


#: CULane's frame, and SCNN's points for it: 18, one every 20 rows from the bottom (tools/prob2lines).
CULANE_SIZE = (1640, 590)
CULANE_POINTS, CULANE_ROW_STEP = 18, 20


def _matlab_round(values: np.ndarray) -> np.ndarray:
    """MATLAB's integer conversion: to the nearest, halves away from zero (as ``uint16()`` in getLane.m)."""
    return np.sign(values) * np.floor(np.abs(values) + 0.5)


def culane_point_rows(frame_height: int) -> tuple[np.ndarray, np.ndarray]:
    """SCNN's 18 CULane rows from the bottom up: as shares of the frame's height, and as the frame's (0-based)
    rows — CULane's every 20 of 590, or the same shares of another frame's height."""
    share = np.arange(CULANE_POINTS) * CULANE_ROW_STEP / CULANE_SIZE[1]  # of the frame's height, from the bottom
    return share, (_matlab_round(frame_height - share * frame_height) - 1).astype(int)


def culane_lanes(probs: np.ndarray, existence: np.ndarray, threshold: float = PROB_THRESHOLD,
                 exist_threshold: float = EXIST_THRESHOLD,
                 frame_size: tuple[int, int] = CULANE_SIZE) -> list[tuple[int, list[tuple[int, int]]]]:
    """``(slot, points)`` for each slot SCNN's CULane rule keeps: ``points`` are ``(x, y)`` in the frame, from the
    bottom up. ``probs`` is (5, H, W) softmax output of a frame resized whole to the network. The frame is CULane's
    1640×590 unless ``frame_size`` says otherwise (another camera's): its 18 rows are then the same share of its
    height from the bottom as CULane's are of 590, every 20·height/590 rows."""
    _, height, width = probs.shape
    frame_width, frame_height = frame_size
    share, ys = culane_point_rows(frame_height)
    rows = _matlab_round(height - share * height).astype(int) - 1  # 1-based there
    rows = np.clip(rows, 0, height - 1)
    lanes = []
    for slot in range(4):
        if existence[slot] <= exist_threshold:
            continue
        values = cv2.blur(probs[slot + 1].astype(np.float32), (3, 3))[rows]
        peaks = values.argmax(axis=1)
        present = values[np.arange(len(rows)), peaks] > threshold
        xs = (_matlab_round((peaks + 1) * frame_width / width) - 1).astype(int)  # 1-based column there
        points = [(int(x), int(y)) for x, y, keep in zip(xs, ys, present, strict=True) if keep]
        if len(points) >= 2:
            lanes.append((slot, points))
    return lanes


def draw_point_lanes(image: np.ndarray, lanes: list[tuple[int, list[tuple[int, int]]]],
                     thickness: int = 4) -> np.ndarray:
    """A copy of ``image`` with each ``(slot, points)`` lane (``culane_lanes``) drawn in its slot's colour."""
    out = image.copy()
    for slot, points in lanes:
        cv2.polylines(out, [np.array(points, np.int32)], False, SLOT_COLOURS[slot % 4], thickness)
    return out


def draw_lanes(image: np.ndarray, lanes: list[tuple[int, list[int]]], h_samples: list[int],
               thickness: int = 4) -> np.ndarray:
    """A copy of ``image`` with each ``(slot, lane)`` drawn in its slot's colour."""
    out = image.copy()
    for slot, lane in lanes:
        points = [(int(x), int(y)) for x, y in zip(lane, h_samples, strict=True) if x >= 0]
        if len(points) >= 2:
            cv2.polylines(out, [np.array(points, np.int32)], False, SLOT_COLOURS[slot % 4], thickness)
    return out
