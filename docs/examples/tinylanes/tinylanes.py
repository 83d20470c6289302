"""TinyLanes: a lane model of a team's own, plugged into laneflow through the ``laneflow.models`` entry point.

Three strided convolution blocks and a 1x1 head give the same outputs SCNN does — a 5-class lane mask
(background and four slots, left to right) and four existence probabilities — so laneflow's deployable module
and lane decoding for such outputs (``training.models.segmentation``) serve it as they are; a model with other
outputs subclasses ``training.models.base.LaneModel`` and writes its own ``deployed``, ``contract``,
``row_lanes`` and ``culane_lanes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.models.base import Criterion, TrainingDiverged
from training.models.segmentation import SegmentationLaneModel


@dataclass(frozen=True)
class TinySettings:
    """The input size (a multiple of 8: three stride-2 blocks) and the width of the blocks."""

    input_width: int = 256
    input_height: int = 144
    channels: int = 16

    def __post_init__(self) -> None:
        if self.input_width % 8 or self.input_height % 8:
            raise ValueError(f"input size {self.input_width}x{self.input_height} must be a multiple of 8")


#: laneflow's presets, as this model reads them.
PRESETS = {"cpu-demo": TinySettings(), "tusimple": TinySettings(512, 288, 32), "culane": TinySettings(800, 288, 32)}


class TinyLanes(nn.Module):
    """Normalised RGB in; (lane-mask logits at input size, existence probabilities) out."""

    def __init__(self, settings: TinySettings) -> None:
        super().__init__()
        width = settings.channels
        blocks, channels = [], 3
        for out in (width, width * 2, width * 4):
            blocks += [nn.Conv2d(channels, out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True)]
            channels = out
        self.encoder = nn.Sequential(*blocks)
        self.head = nn.Conv2d(channels, 5, 1)
        self.existence = nn.Sequential(nn.Linear(channels, 4), nn.Sigmoid())

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.encoder(images)
        logits = F.interpolate(self.head(features), scale_factor=8, mode="bilinear", align_corners=False)
        return logits, self.existence(features.mean(dim=(2, 3)))


class TinyLanesModel(SegmentationLaneModel):
    """SCNN's outputs, so laneflow's deployable module and lane decoding serve it (``SegmentationLaneModel``);
    it gives its settings, network, loss and backbone loader."""

    name = "tinylanes"
    architecture = "TinyLanes"
    settings_type = TinySettings

    def settings(self, preset: str, **overrides: object) -> TinySettings:
        if preset not in PRESETS:
            raise ValueError(f"tinylanes has no preset '{preset}'; choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[preset], **overrides)

    def network(self, settings: Any) -> nn.Module:
        return TinyLanes(settings)

    def criterion(self, settings: Any, check_finite: bool = True) -> Criterion:
        weights = torch.tensor([0.4, 1.0, 1.0, 1.0, 1.0])

        def loss(outputs: tuple[torch.Tensor, ...], masks: torch.Tensor, existence: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, float]]:
            logits, predicted = outputs
            segmentation = F.cross_entropy(logits, masks.long(), weight=weights.to(logits.device))
            if check_finite and not math.isfinite(float(segmentation.detach())):
                raise TrainingDiverged("training diverged: the loss is not finite")
            exist = F.binary_cross_entropy(predicted, existence.float())
            return segmentation + 0.1 * exist, {"seg_loss": float(segmentation.detach()),
                                                "exist_loss": float(exist.detach())}

        return loss

    def load_backbone(self, network: nn.Module, path: Path) -> int:
        raise ValueError(f"tinylanes has no pretrained backbone to load from {path}: train it without weights")
