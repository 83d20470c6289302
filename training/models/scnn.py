"""SCNN (Pan et al., AAAI 2018) behind the model interface: its network, loss and backbone loader are
``training.model``'s, its deployable module and lane decoding ``training.inference``'s
(``training.models.segmentation``), unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.model import SCNN, ModelConfig, SCNNLoss, load_backbone_weights, model_config
from training.models.base import Criterion
from training.models.segmentation import SegmentationLaneModel


class SCNNModel(SegmentationLaneModel):
    """VGG16-BN with spatial message passing: a 5-class lane mask and four existence probabilities."""

    name = "scnn"
    architecture = "SCNN"
    settings_type = ModelConfig

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

    def load_backbone(self, network: nn.Module, path: Path) -> int:
        return load_backbone_weights(network, path)
