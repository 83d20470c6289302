"""SCNN (Pan et al., AAAI 2018): VGG16-BN with a dilated last stage, spatial message passing,
a 5-class segmentation head and a lane-existence branch.

Presets:
- ``tusimple``: the paper's architecture at 512x288 (20,534,857 parameters with a 4-lane head).
- ``culane``: the same network at 800x288, the input of SCNN's CULane model (its existence branch reads 4,500
  pooled values, as the official model's does: 20,742,217 parameters).
- ``cpu-demo``: the same structure, narrower and at 256x144, trains in minutes on 2 CPU cores.

Spatial message passing is sequential by definition (each row/column adds ReLU(conv(previous
output))). :class:`MessagePassing` runs that recurrence as one autograd op that writes into a
preallocated buffer and computes the weight gradient for all steps in a single batched call, instead
of building, autograd-tracking and concatenating a Python list of every slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from training.models.base import TrainingDiverged, load_backbone_tensors

__all__ = ["SCNN", "MessagePassing", "ModelConfig", "SCNNLoss", "TrainingDiverged", "count_parameters",
           "load_backbone_weights", "model_config"]

NUM_CLASSES = 5  # background + 4 lane slots
NUM_LANES = 4


@dataclass(frozen=True)
class ModelConfig:
    """Architecture knobs; the ``tusimple`` preset is the paper's network."""

    input_height: int = 288
    input_width: int = 512
    #: Output channels of the 5 VGG stages (VGG16: 64, 128, 256, 512, 512).
    stage_channels: tuple[int, ...] = (64, 128, 256, 512, 512)
    #: Convolutions per stage (VGG16: 2, 2, 3, 3, 3).
    stage_convs: tuple[int, ...] = (2, 2, 3, 3, 3)
    neck_channels: int = 1024
    mp_channels: int = 128
    mp_kernel: int = 9
    fc_hidden: int = 128
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.input_height % 16 or self.input_width % 16:
            raise ValueError(f"input size {self.input_width}x{self.input_height} must be a multiple of 16")
        if len(self.stage_channels) != 5 or len(self.stage_convs) != 5:
            raise ValueError("the backbone has exactly 5 stages")
        if self.mp_kernel % 2 == 0:
            raise ValueError("mp_kernel must be odd")


PRESETS: dict[str, ModelConfig] = {
    "tusimple": ModelConfig(),
    "culane": ModelConfig(input_height=288, input_width=800),
    "cpu-demo": ModelConfig(input_height=144, input_width=256, stage_channels=(16, 32, 64, 96, 96),
                            stage_convs=(1, 1, 2, 2, 2), neck_channels=128, mp_channels=32, mp_kernel=5,
                            fc_hidden=64),
}


def model_config(preset: str, **overrides: object) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **overrides) if overrides else PRESETS[preset]


class _MessagePassingFn(torch.autograd.Function):
    """out[0] = x[0]; out[i] = x[i] + relu(conv1d(out[i-1], w)) along dim 0 of a (S, N, C, L) tensor.

    Computes in the dtype it is given (``MessagePassing`` casts to autocast's dtype under mixed
    precision); autocast is off inside, so forward and backward agree on dtypes.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        padding = weight.shape[-1] // 2
        with torch.autocast(x.device.type, enabled=False):
            out = x.clone()
            active = torch.empty_like(x, dtype=torch.bool)
            active[0] = False
            for i in range(1, x.shape[0]):
                pre = F.conv1d(out[i - 1], weight, padding=padding)
                active[i] = pre > 0
                out[i] += pre.clamp_(min=0)
        ctx.save_for_backward(out, active, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, active, weight = ctx.saved_tensors
        padding = weight.shape[-1] // 2
        with torch.autocast(out.device.type, enabled=False):
            grad = grad_out.to(out.dtype, copy=True)  # becomes dL/dout[i] once everything downstream is added
            grad_pre = torch.zeros_like(grad)
            for i in range(out.shape[0] - 1, 0, -1):
                grad_pre[i] = grad[i] * active[i]
                grad[i - 1] += F.conv_transpose1d(grad_pre[i], weight, padding=padding)
            # All steps' weight gradients in one call: inputs out[0..S-2] against grad_pre[1..S-1].
            steps, n, c, length = out.shape
            grad_weight = torch.nn.grad.conv1d_weight(
                out[:-1].reshape((steps - 1) * n, c, length), weight.shape,
                grad_pre[1:].reshape((steps - 1) * n, c, length), padding=padding,
            ) if steps > 1 else torch.zeros_like(weight)
        return grad, grad_weight


def _pass_messages(seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same recurrence as ``_MessagePassingFn`` in plain tensor operations, for inference.

    Without gradients there is no backward to save memory for, and plain operations are what
    ``torch.jit.trace`` and the ONNX exporters can follow (a Python ``autograd.Function`` is not).
    """
    padding = weight.shape[-1] // 2
    out = [seq[0]]
    for i in range(1, seq.shape[0]):
        out.append(seq[i] + F.relu(F.conv1d(out[-1], weight, padding=padding)))
    return torch.stack(out)


class MessagePassing(nn.Module):
    """One direction of SCNN's spatial message passing ("down", "up", "right" or "left")."""

    def __init__(self, channels: int, kernel: int, direction: str):
        super().__init__()
        if direction not in ("down", "up", "right", "left"):
            raise ValueError(f"unknown direction '{direction}'")
        self.direction = direction
        vertical = direction in ("down", "up")
        # The 2-D kernel of the paper: 1 x k when passing between rows, k x 1 between columns.
        shape = (channels, channels, 1, kernel) if vertical else (channels, channels, kernel, 1)
        self.weight = nn.Parameter(torch.empty(shape))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vertical = self.direction in ("down", "up")
        # Move the passing axis first and the convolved axis last: (S, N, C, L).
        seq = x.permute(2, 0, 1, 3) if vertical else x.permute(3, 0, 1, 2)
        if self.direction in ("up", "left"):
            seq = seq.flip(0)
        weight = self.weight.reshape(self.weight.shape[0], self.weight.shape[1], -1)
        if torch.is_autocast_enabled(seq.device.type):  # mixed precision: pass messages in autocast's dtype
            dtype = torch.get_autocast_dtype(seq.device.type)
            seq, weight = seq.to(dtype), weight.to(dtype)
        passing = _MessagePassingFn.apply if torch.is_grad_enabled() else _pass_messages
        out = passing(seq.contiguous(), weight)
        if self.direction in ("up", "left"):
            out = out.flip(0)
        return out.permute(1, 2, 0, 3) if vertical else out.permute(1, 2, 3, 0)


def vgg16_bn_dilated(config: ModelConfig) -> nn.Sequential:
    """VGG16-BN features with pool4 and pool5 removed and stage 5 dilated by 2 (output stride 8)."""
    layers: list[nn.Module] = []
    in_channels = 3
    for stage, (channels, convs) in enumerate(zip(config.stage_channels, config.stage_convs, strict=True)):
        dilation = 2 if stage == 4 else 1
        for _ in range(convs):
            layers += [nn.Conv2d(in_channels, channels, 3, padding=dilation, dilation=dilation),
                       nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
            in_channels = channels
        if stage < 3:
            layers.append(nn.MaxPool2d(2, 2))
    return nn.Sequential(*layers)


class SCNN(nn.Module):
    """Returns (segmentation logits at input size, lane-existence probabilities)."""

    def __init__(self, config: ModelConfig | None = None):
        super().__init__()
        self.config = config = config or ModelConfig()
        self.backbone = vgg16_bn_dilated(config)
        self.neck = nn.Sequential(
            nn.Conv2d(config.stage_channels[-1], config.neck_channels, 3, padding=4, dilation=4, bias=False),
            nn.BatchNorm2d(config.neck_channels), nn.ReLU(inplace=True),
            nn.Conv2d(config.neck_channels, config.mp_channels, 1, bias=False),
            nn.BatchNorm2d(config.mp_channels), nn.ReLU(inplace=True),
        )
        self.message_passing = nn.Sequential(*(
            MessagePassing(config.mp_channels, config.mp_kernel, d) for d in ("down", "up", "right", "left")
        ))
        self.seg_head = nn.Sequential(nn.Dropout2d(config.dropout), nn.Conv2d(config.mp_channels, NUM_CLASSES, 1))
        pooled = NUM_CLASSES * (config.input_height // 16) * (config.input_width // 16)
        self.exist_head = nn.Sequential(
            nn.Linear(pooled, config.fc_hidden), nn.ReLU(inplace=True),
            nn.Linear(config.fc_hidden, NUM_LANES), nn.Sigmoid(),
        )

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.message_passing(self.neck(self.backbone(images)))
        logits_small = self.seg_head(features)
        logits = F.interpolate(logits_small, scale_factor=8, mode="bilinear", align_corners=False)
        pooled = F.avg_pool2d(F.softmax(logits_small, dim=1), 2)
        existence = self.exist_head(pooled.flatten(1))
        return logits, existence


def load_backbone_weights(model: SCNN, path: str | Path) -> int:
    """Load VGG16-BN backbone weights (a state dict of ``features.*`` or ``backbone.*`` tensors).

    ImageNet weights cannot be downloaded here; pass a file when you have one. Returns how many
    tensors were loaded; raises naming the first shape mismatch.
    """
    return load_backbone_tensors(
        model.backbone, path,
        lambda key: key.split("features.", 1)[-1] if key.startswith("features.") else key.removeprefix("backbone."),
        "VGG16-BN backbone tensors ('features.N.weight' ...)")


@dataclass
class SCNNLoss:
    """Cross-entropy over the 5 classes (background weighted 0.4) + 0.1 x BCE on lane existence."""

    background_weight: float = 0.4
    existence_weight: float = 0.1
    #: Fail on a non-finite loss (TrainingDiverged). Off under fp16, where the gradient scaler skips the
    #: step of an overflowed forward pass and lowers its scale instead.
    check_finite: bool = True
    _class_weights: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._class_weights = torch.tensor([self.background_weight] + [1.0] * NUM_LANES)

    def __call__(self, logits: torch.Tensor, existence: torch.Tensor, masks: torch.Tensor,
                 exist_targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        seg = F.cross_entropy(logits, masks.long(), weight=self._class_weights.to(logits.device))
        seg_value = float(seg.detach())  # read for the step's record anyway
        if self.check_finite and (not math.isfinite(seg_value) or not bool(torch.isfinite(existence).all())):
            # Otherwise binary_cross_entropy fails with "all elements of input should be between 0 and 1".
            raise TrainingDiverged("training diverged: the loss or the lane-existence outputs are not finite "
                                   "(NaN or inf)")
        exist = F.binary_cross_entropy(existence, exist_targets.float())
        total = seg + self.existence_weight * exist
        return total, {"seg_loss": seg_value, "exist_loss": float(exist.detach())}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
