"""One SGD step of the trainer, alone: what the training loops run and what calibration and benches time.

Kept apart from ``training.run_parts`` so what times a step (``training.calibration``, bench/train_step.py,
bench/gpu.py) needs none of a run's machinery.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.dataset import IMAGENET_MEAN, IMAGENET_STD, normalize
from training.models.base import Criterion
from training.precision import MixedPrecision

__all__ = ["train_step"]


def train_step(model: torch.nn.Module, images: torch.Tensor, masks: torch.Tensor, exist: torch.Tensor,
               criterion: Criterion, optimizer: torch.optim.Optimizer, mixed: MixedPrecision,
               memory_format: torch.memory_format, distributed: bool,
               normalisation: tuple[Sequence[float], Sequence[float]] = (IMAGENET_MEAN, IMAGENET_STD),
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """One SGD step on a uint8 batch: moved without blocking, normalised on the device with the model's
    ``normalisation`` (``LaneModel.normalisation()``: mean and std of RGB; a timing may leave ImageNet's), forward
    in the run's precision, loss in fp32."""
    device = next(model.parameters()).device
    batch = normalize(images.to(device, non_blocking=True), memory_format, *normalisation)
    with mixed.autocast():
        outputs = model(batch)
    loss, parts = criterion(tuple(output.float() for output in outputs), masks.to(device, non_blocking=True),
                            exist.to(device, non_blocking=True))
    optimizer.zero_grad()  # set_to_none is torch's default; Horovod's wrapper takes no arguments
    mixed.backward_and_step(loss, optimizer, distributed)
    return loss, parts
