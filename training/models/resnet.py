"""ResNet-18 and ResNet-34 (He et al., 2016) as backbones: the stem and four stages of basic blocks, with
torchvision's parameter names (``conv1``, ``bn1``, ``layer1.0.conv1``, ``layer2.0.downsample.0``, ...), so an
ImageNet checkpoint saved by torchvision loads into it as it is (``load_torchvision_weights``); laneflow needs no
torchvision. ``forward`` returns the three deepest stages' features (strides 8, 16 and 32)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from training.models.base import load_backbone_tensors

#: Blocks per stage.
DEPTHS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}
#: Channels of each stage's output.
STAGE_CHANNELS = (64, 128, 256, 512)


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(channels))
                           if stride != 1 or in_channels != channels else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)


class ResNet(nn.Module):
    """A ResNet without its classifier: images in, (stride-8, stride-16, stride-32) features out."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in DEPTHS:
            raise ValueError(f"unknown backbone '{name}'; choose one of {', '.join(DEPTHS)}")
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = 64
        for index, (blocks, channels) in enumerate(zip(DEPTHS[name], STAGE_CHANNELS, strict=True), start=1):
            stride = 1 if index == 1 else 2
            stage = [BasicBlock(in_channels, channels, stride)] + [BasicBlock(channels, channels, 1)
                                                                   for _ in range(blocks - 1)]
            setattr(self, f"layer{index}", nn.Sequential(*stage))
            in_channels = channels

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.layer1(self.maxpool(self.relu(self.bn1(self.conv1(images)))))
        x8 = self.layer2(x)
        x16 = self.layer3(x8)
        return x8, x16, self.layer4(x16)


def load_torchvision_weights(backbone: ResNet, path: str | Path) -> int:
    """ImageNet weights saved from torchvision's ``resnet18``/``resnet34`` (a state dict; its ``fc.*`` classifier
    is not part of a backbone and is left out) into ``backbone``; how many tensors were loaded. A file with stage
    tensors this backbone lacks (another depth's) is refused: half of a deeper network is not a pretrained one."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    own = backbone.state_dict()
    foreign = sorted(key for key in state if key.removeprefix("backbone.").startswith("layer")
                     and key.removeprefix("backbone.") not in own)
    if foreign:
        raise ValueError(f"{path} has stage tensors this ResNet lacks ({', '.join(foreign[:3])}, ...): weights of "
                         "another depth? Set model.backbone to match them")
    return load_backbone_tensors(backbone, path, lambda key: key.removeprefix("backbone."),
                                 "ResNet tensors in torchvision's layout ('conv1.weight', 'layer1.0.conv1.weight')")
