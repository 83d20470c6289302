"""A row-anchor lane detector in the Ultra-Fast-Lane-Detection family (Qin et al., ECCV 2020): for each of four
lane slots, on each of a fixed set of image rows (the row anchors), which of ``cells`` columns the lane crosses,
or none — a classification of a few thousand values instead of a dense mask, which is what makes it fast.

As the authors' network (cfzd/Ultra-Fast-Lane-Detection ``model/model.py``): a ResNet-18/34 backbone
(``training.models.resnet``; ImageNet weights in torchvision's layout with ``--weights``), a 1x1 convolution of
its stride-32 features to 8 channels, flattened, a hidden layer (2,048 at full size) and a linear layer to
``(cells + 1) x anchors x 4`` logits, the extra class meaning "no lane on this row"; in training an auxiliary
segmentation head on the stride-8, 16 and 32 features. Their input is 800x288; TuSimple's anchors are 56 rows
from 64 to 284 of 288 with 100 cells, CULane's 18 rows from 121 to 287 with 200 (``data/constant.py``,
``configs/*.py``); here the anchors are that span evenly divided, at any input size.

Losses (the paper's): softmax focal loss (gamma 2) on the row classifications; the structural similarity loss
(smooth L1 between adjacent anchors' logits, weight 1 for TuSimple and 0 for CULane, as the authors' configs);
cross-entropy of the auxiliary segmentation against the lane mask (weight 1). The shape loss is left out: the
authors' configs weight it 0. Documented choices of this implementation: an existence branch (four sigmoids
from the hidden layer, binary cross-entropy with the dataset's flags, weight 0.1, as SCNN's) that gates each
slot as SCNN's does; row anchors only (UFLDv2's column anchors are not built); a row's target cell is the
rounded mean column of the slot's mask pixels on it (the authors take the mean too, then floor).

Decoding (inside the exported module, as the authors' demo decodes): a lane's column on an anchor is the
softmax-weighted mean cell over the ``cells`` real classes, in input pixels; absent where the "no lane" class
wins. Lanes at other rows (TuSimple's h_samples, CULane's points every 20 px) are interpolated linearly between
the two anchors around the row, absent outside the anchors or next to an absent one; a lane needs 2 points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.inference import ABSENT, EXIST_THRESHOLD, culane_point_rows, input_contract
from training.models.base import Criterion, LaneModel, Outputs, PointLanes, RowLanes, TrainingDiverged
from training.models.resnet import DEPTHS, STAGE_CHANNELS, ResNet, load_torchvision_weights

LANES = 4
FOCAL_GAMMA = 2.0


@dataclass(frozen=True)
class RowAnchorSettings:
    """The network's shape and its losses' weights (see the module docstring for the paper's values)."""

    input_height: int = 288
    input_width: int = 800
    backbone: str = "resnet18"
    #: Columns a lane's position is classified into on each anchor (the authors' "griding_num").
    cells: int = 100
    #: Row anchors, evenly spread from ``anchor_top`` to ``anchor_bottom`` (fractions of the input height).
    anchors: int = 56
    anchor_top: float = 64 / 288
    anchor_bottom: float = 284 / 288
    pool_channels: int = 8
    hidden: int = 2048
    similarity_weight: float = 1.0
    aux_weight: float = 1.0
    existence_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.input_height % 32 or self.input_width % 32:
            raise ValueError(f"input size {self.input_width}x{self.input_height} must be a multiple of 32 (the "
                             "backbone's stride)")
        if self.backbone not in DEPTHS:
            raise ValueError(f"unknown backbone '{self.backbone}'; choose one of {', '.join(DEPTHS)}")
        if self.cells < 2 or self.anchors < 2:
            raise ValueError(f"cells ({self.cells}) and anchors ({self.anchors}) must be at least 2")
        if not 0 <= self.anchor_top < self.anchor_bottom <= 1:
            raise ValueError(f"anchor_top {self.anchor_top} and anchor_bottom {self.anchor_bottom} must satisfy "
                             "0 <= top < bottom <= 1 (fractions of the input height)")

    def anchor_rows(self) -> np.ndarray:
        """The anchors' rows in input pixels, top to bottom."""
        top, bottom = self.anchor_top * self.input_height, self.anchor_bottom * self.input_height
        return np.clip(np.round(np.linspace(top, bottom, self.anchors)), 0, self.input_height - 1).astype(np.int64)

    @property
    def cell_width(self) -> float:
        """Input pixels between two cells' centres: cells span the width, the first at 0, the last at width-1."""
        return (self.input_width - 1) / (self.cells - 1)


PRESETS = {
    "tusimple": RowAnchorSettings(),
    "culane": RowAnchorSettings(cells=200, anchors=18, anchor_top=121 / 288, anchor_bottom=287 / 288,
                                similarity_weight=0.0),
    # Trains in minutes on two CPU cores: a smaller input and hidden layer, the same structure.
    "cpu-demo": RowAnchorSettings(input_height=128, input_width=256, cells=50, hidden=256),
}


def _conv(in_channels: int, channels: int, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(channels), nn.ReLU(inplace=True))


class AuxSegmentation(nn.Module):
    """Training only: the lane mask at stride 8 from the three deepest stages, which shapes the features."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.reduce = nn.ModuleList(_conv(channels, width) for channels in STAGE_CHANNELS[1:])
        self.combine = nn.Sequential(_conv(3 * width, width, dilation=2), nn.Conv2d(width, LANES + 1, 1))

    def forward(self, x8: torch.Tensor, x16: torch.Tensor, x32: torch.Tensor) -> torch.Tensor:
        size = x8.shape[-2:]
        maps = [F.interpolate(reduce(x), size=size, mode="bilinear", align_corners=False) if x is not x8 else
                reduce(x) for reduce, x in zip(self.reduce, (x8, x16, x32), strict=True)]
        return self.combine(torch.cat(maps, dim=1))


class RowAnchorNet(nn.Module):
    """Normalised RGB in; (row logits ``(N, cells+1, anchors, 4)``, existence ``(N, 4)``) out, and in training
    the auxiliary segmentation logits ``(N, 5, H/8, W/8)`` third."""

    def __init__(self, settings: RowAnchorSettings) -> None:
        super().__init__()
        self.settings = settings
        self.backbone = ResNet(settings.backbone)
        self.pool = nn.Conv2d(STAGE_CHANNELS[-1], settings.pool_channels, 1)
        flat = settings.pool_channels * (settings.input_height // 32) * (settings.input_width // 32)
        self.hidden = nn.Sequential(nn.Linear(flat, settings.hidden), nn.ReLU(inplace=True))
        self.classify = nn.Linear(settings.hidden, (settings.cells + 1) * settings.anchors * LANES)
        self.exist = nn.Linear(settings.hidden, LANES)
        self.aux = AuxSegmentation() if settings.aux_weight > 0 else None
        nn.init.normal_(self.classify.weight, std=0.01)  # as the authors initialise their classifier
        nn.init.zeros_(self.classify.bias)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x8, x16, x32 = self.backbone(images)
        hidden = self.hidden(self.pool(x32).flatten(1))
        settings = self.settings
        rows = self.classify(hidden).view(-1, settings.cells + 1, settings.anchors, LANES)
        existence = torch.sigmoid(self.exist(hidden))
        if self.training and self.aux is not None:
            return rows, existence, self.aux(x8, x16, x32)
        return rows, existence


def row_targets(masks: torch.Tensor, settings: RowAnchorSettings) -> torch.Tensor:
    """Each slot's cell on each anchor, ``(N, anchors, 4)``, from lane masks ``(N, H, W)`` at the input size
    (values 0..4): the rounded mean column of the slot's pixels on the anchor's row, or ``cells`` ("no lane")."""
    rows = torch.as_tensor(settings.anchor_rows(), device=masks.device)
    band = masks[:, rows, :].long()  # (N, anchors, W)
    columns = torch.arange(masks.shape[-1], device=masks.device, dtype=torch.float32)
    slots = torch.arange(1, LANES + 1, device=masks.device).view(1, 1, LANES, 1)
    hit = (band.unsqueeze(2) == slots).float()  # (N, anchors, 4, W)
    count = hit.sum(-1)
    mean = (hit * columns).sum(-1) / count.clamp(min=1)
    cell = torch.round(mean / settings.cell_width).long().clamp(0, settings.cells - 1)
    return torch.where(count > 0, cell, torch.full_like(cell, settings.cells))


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float = FOCAL_GAMMA) -> torch.Tensor:
    """Softmax focal loss over dimension 1 (the authors' ``SoftmaxFocalLoss``)."""
    log_probs = F.log_softmax(logits, dim=1)
    return F.nll_loss((1 - log_probs.exp()) ** gamma * log_probs, targets)


class RowAnchorLoss:
    """Focal loss on the rows, similarity between adjacent anchors, auxiliary segmentation, existence."""

    def __init__(self, settings: RowAnchorSettings, check_finite: bool = True) -> None:
        self.settings, self.check_finite = settings, check_finite

    def __call__(self, outputs: tuple[torch.Tensor, ...], masks: torch.Tensor, existence: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        settings = self.settings
        rows, predicted = outputs[0], outputs[1]
        classification = focal_loss(rows, row_targets(masks, settings))
        if self.check_finite and not torch.isfinite(classification.detach()):
            raise TrainingDiverged("training diverged: the row classification loss is not finite (NaN or inf)")
        similarity = F.smooth_l1_loss(rows[:, :, :-1], rows[:, :, 1:])  # adjacent anchors alike
        exist = F.binary_cross_entropy(predicted, existence.float())
        total = classification + settings.similarity_weight * similarity + settings.existence_weight * exist
        parts = {"cls_loss": float(classification.detach()), "sim_loss": float(similarity.detach()),
                 "exist_loss": float(exist.detach())}
        if len(outputs) > 2:
            aux = outputs[2]
            small = masks[:, ::8, ::8][:, :aux.shape[-2], :aux.shape[-1]].long()
            segmentation = F.cross_entropy(aux, small)
            total = total + settings.aux_weight * segmentation
            parts["aux_loss"] = float(segmentation.detach())
        return total, parts


class DeployedRowAnchor(nn.Module):
    """The input contract (uint8 BGR NHWC) in, normalised with the model's statistics; each slot's column on
    each anchor in input pixels ``(N, 4, anchors)`` (-1: no lane) and existence ``(N, 4)`` out."""

    def __init__(self, network: RowAnchorNet, mean_rgb: Sequence[float], std_rgb: Sequence[float]) -> None:
        super().__init__()
        self.network = network
        settings = network.settings
        self.cells, self.cell_width = settings.cells, settings.cell_width
        self.register_buffer("mean", torch.tensor(mean_rgb, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std_rgb, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("cell_index", torch.arange(settings.cells, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rgb = images.permute(0, 3, 1, 2)[:, [2, 1, 0]].float() / 255.0
        rows, existence = self.network((rgb - self.mean) / self.std)[:2]
        return columns_from_rows(rows, self.cell_index, self.cell_width), existence


def columns_from_rows(rows: torch.Tensor, cell_index: torch.Tensor, cell_width: float) -> torch.Tensor:
    """Row logits ``(N, cells+1, anchors, 4)`` to each slot's column per anchor ``(N, 4, anchors)`` in input pixels:
    the softmax-weighted mean of the real cells, -1 where "no lane" wins (``cell_index``: 0..cells-1 shaped
    ``(1, cells, 1, 1)``)."""
    cells = cell_index.shape[1]
    expected = (torch.softmax(rows[:, :cells], dim=1) * cell_index).sum(1) * cell_width
    absent = rows.argmax(1) == cells
    return torch.where(absent, torch.full_like(expected, -1.0), expected).transpose(1, 2)


def lanes_at(columns: np.ndarray, existence: np.ndarray, settings: RowAnchorSettings, rows: np.ndarray,
             image_size: tuple[int, int]) -> list[tuple[int, np.ndarray]]:
    """``(slot, x)`` of each slot kept (existence over the threshold), ``x`` in source pixels at source ``rows``
    (``ABSENT`` where the lane is not there), interpolated between anchors."""
    width, height = image_size
    anchors = settings.anchor_rows().astype(np.float64)
    at = np.asarray(rows, dtype=np.float64) * settings.input_height / height  # the rows in input pixels
    upper = np.clip(np.searchsorted(anchors, at, side="right"), 1, len(anchors) - 1)
    lower = upper - 1
    inside = (at >= anchors[0]) & (at <= anchors[-1])
    share = np.clip((at - anchors[lower]) / (anchors[upper] - anchors[lower]), 0, 1)
    lanes = []
    for slot in range(LANES):
        if existence[slot] <= EXIST_THRESHOLD:
            continue
        line = columns[slot]
        present = inside & (line[lower] >= 0) & (line[upper] >= 0)
        x = (line[lower] * (1 - share) + line[upper] * share) * width / settings.input_width
        xs = np.where(present, np.clip(np.round(x), 0, width - 1), ABSENT).astype(int)
        if (xs >= 0).sum() >= 2:
            lanes.append((slot, xs))
    return lanes


class RowAnchorModel(LaneModel):
    """The row-anchor detector behind the model interface (``model=ufld``)."""

    name = "ufld"
    architecture = "UFLD (row anchors)"
    settings_type = RowAnchorSettings
    output_names = ("columns", "existence")

    def settings(self, preset: str, **overrides: object) -> RowAnchorSettings:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[preset], **overrides) if overrides else PRESETS[preset]

    def network(self, settings: Any) -> nn.Module:
        return RowAnchorNet(settings)

    def criterion(self, settings: Any, check_finite: bool = True) -> Criterion:
        return RowAnchorLoss(settings, check_finite)

    def deployed(self, network: nn.Module) -> nn.Module:
        return DeployedRowAnchor(network, self.mean_rgb, self.std_rgb)

    def contract(self, settings: Any) -> dict[str, Any]:
        contract = input_contract(settings.input_width, settings.input_height, self.mean_rgb, self.std_rgb)
        contract["outputs"] = {"columns": ["batch", LANES, settings.anchors], "existence": ["batch", LANES],
                               "anchor_rows": settings.anchor_rows().tolist(), "absent_column": -1}
        contract["lanes"] = {"existence_threshold": EXIST_THRESHOLD, "rows": "linear between the two anchors "
                             "around a row, in input pixels scaled to the source image", "absent_x": ABSENT,
                             "min_points": 2}
        return contract

    def row_lanes(self, settings: Any, outputs: Outputs, rows: list[int], image_size: tuple[int, int]) -> RowLanes:
        columns, existence = outputs
        return [(slot, xs.tolist()) for slot, xs in lanes_at(columns, existence, settings, np.asarray(rows),
                                                              image_size)]

    def culane_lanes(self, settings: Any, outputs: Outputs, frame_size: tuple[int, int]) -> PointLanes:
        """CULane's points: every 20 rows of a 590-row frame from the bottom (SCNN's rule, scaled to the frame)."""
        columns, existence = outputs
        _, ys = culane_point_rows(frame_size[1])
        return [(slot, [(int(x), int(y)) for x, y in zip(xs, ys, strict=True) if x >= 0])
                for slot, xs in lanes_at(columns, existence, settings, ys, frame_size)]

    def load_backbone(self, network: nn.Module, path: Path) -> int:
        return load_torchvision_weights(network.backbone, path)
