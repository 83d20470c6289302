"""SCNN (Pan et al., AAAI 2018) behind the model interface: its network, loss and backbone loader are
``training.model``'s, its deployable module and lane decoding ``training.inference``'s, unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.inference import DeployedSCNN, culane_lanes, input_contract, slot_lanes
from training.model import SCNN, ModelConfig, SCNNLoss, load_backbone_weights, model_config
from training.models.base import Criterion, LaneModel, Outputs, PointLanes, RowLanes


class SCNNModel(LaneModel):
    """VGG16-BN with spatial message passing: a 5-class lane mask and four existence probabilities."""

    name = "scnn"
    architecture = "SCNN"
    settings_type = ModelConfig
    output_names = ("probabilities", "existence")

    def settings(self, preset: str, **overrides: object) -> ModelConfig:
        return model_config(preset, **overrides)

    def network(self, settings: Any) -> nn.Module:
        return SCNN(settings)

    def criterion(self, settings: Any, check_finite: bool = True) -> Criterion:
        loss = SCNNLoss(check_finite=check_finite)

        def scnn_loss(outputs: tuple[torch.Tensor, ...], masks: torch.Tensor, existence: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, float]]:
            logits, predicted = outputs
            return loss(logits, predicted, masks, existence)

        return scnn_loss

    def deployed(self, network: nn.Module) -> nn.Module:
        return DeployedSCNN(network)

    def contract(self, settings: Any) -> dict[str, Any]:
        return input_contract(settings.input_width, settings.input_height)

    def row_lanes(self, settings: Any, outputs: Outputs, rows: list[int], image_size: tuple[int, int]) -> RowLanes:
        probabilities, existence = outputs
        return slot_lanes(probabilities, existence, rows, image_size)

    def culane_lanes(self, settings: Any, outputs: Outputs, frame_size: tuple[int, int]) -> PointLanes:
        probabilities, existence = outputs
        return culane_lanes(probabilities, existence, frame_size=frame_size)

    def load_backbone(self, network: nn.Module, path: Path) -> int:
        return load_backbone_weights(network, path)
