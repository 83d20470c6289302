"""Models whose network gives SCNN's outputs — lane-mask logits ``(N, 5, H, W)`` at the input size (background
and four slots, left to right) and existence probabilities ``(N, 4)`` — need no deployable module or lane
decoding of their own: ``SegmentationLaneModel`` gives them SCNN's (``training.inference``: softmax inside the
exported module, lanes at each row from the smoothed probability peak). SCNN is one; a team's segmentation
network can be another by subclassing it (docs/examples/tinylanes)."""

from __future__ import annotations

from typing import Any

from torch import nn

from training.inference import DeployedSCNN, culane_lanes, input_contract, slot_lanes
from training.models.base import LaneModel, Outputs, PointLanes, RowLanes


class SegmentationLaneModel(LaneModel):
    """A ``LaneModel`` with SCNN's outputs: subclasses give settings, the network, its loss and backbone loader."""

    output_names = ("probabilities", "existence")

    def deployed(self, network: nn.Module) -> nn.Module:
        return DeployedSCNN(network, self.mean_rgb, self.std_rgb)

    def contract(self, settings: Any) -> dict[str, Any]:
        return input_contract(settings.input_width, settings.input_height, self.mean_rgb, self.std_rgb)

    def row_lanes(self, settings: Any, outputs: Outputs, rows: list[int], image_size: tuple[int, int]) -> RowLanes:
        probabilities, existence = outputs
        return slot_lanes(probabilities, existence, rows, image_size)

    def culane_lanes(self, settings: Any, outputs: Outputs, frame_size: tuple[int, int]) -> PointLanes:
        probabilities, existence = outputs
        return culane_lanes(probabilities, existence, frame_size=frame_size)
