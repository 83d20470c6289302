"""What a lane detector is to laneflow: the one interface the trainer, the evaluation, the package and its
exports, prediction and the Horovod paths use, so a model is a choice and not a fork.

A model (``LaneModel``) gives:

- its input normalisation: the RGB mean and standard deviation (of values scaled to 0..1) its network's input is
  normalised with — the trainer's batches, the evaluation's and the deployed module's alike (ImageNet's unless
  the model says otherwise: a backbone pretrained on other statistics);
- its settings: a frozen dataclass with at least ``input_width`` and ``input_height`` (the size every image
  is resized to), built from a preset and ``model.<field>=value`` overrides, and read back from the record a
  checkpoint, ``model.pt`` or a package keeps;
- its network: normalised RGB float images ``(N, 3, H, W)`` in, a tuple of raw tensors out, and the loss that
  turns those outputs and the dataset's targets (the 5-class lane mask and the four existence flags every
  prepared dataset holds) into a scalar and the parts the trainer logs;
- its deployable module: the input contract's uint8 BGR NHWC batch in (``training.inference``), a tuple of
  arrays named ``output_names`` out — what TorchScript and ONNX export, with parity checked on each output;
- how one image's deployed outputs become lanes: at TuSimple's h_samples (``(slot, x per row)``, -2 where
  absent) and as CULane's points (``(slot, [(x, y), ...])``), both in the source image's pixels;
- its backbone-weight loader (a file in torchvision's key layout, when the user has one).

Models are found by name (``training.models.get_model``): the built-in ones, and any a package registers in
the entry-point group ``laneflow.models``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from training.dataset import IMAGENET_MEAN, IMAGENET_STD


class ModelSettings(Protocol):
    """What laneflow reads of any model's settings: the input size."""

    input_width: int
    input_height: int


#: One image's deployed outputs, in ``output_names`` order, without the batch axis.
Outputs = tuple[np.ndarray, ...]
#: (slot, x at each requested row; -2 where the lane is absent), slots 0..3 left to right.
RowLanes = list[tuple[int, list[int]]]
#: (slot, [(x, y), ...]) in the source image's pixels.
PointLanes = list[tuple[int, list[tuple[int, int]]]]
#: (network outputs, lane masks, existence flags) -> (loss, the parts the trainer logs).
Criterion = Callable[[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class LaneModel(abc.ABC):
    """A lane detector laneflow can train, score, package and run (see the module docstring)."""

    #: The name runs choose it by (``model`` in a run's settings) and records keep.
    name: ClassVar[str]
    #: What the package manifest calls the network.
    architecture: ClassVar[str]
    #: Its settings' dataclass.
    settings_type: ClassVar[type]
    #: The deployed module's outputs, in order (the exported models' output names).
    output_names: ClassVar[tuple[str, ...]]
    #: The RGB mean and standard deviation the network's input is normalised with, after scaling to 0..1: in
    #: training (``training.step``), and inside the deployed module that evaluation, export and predict run.
    mean_rgb: ClassVar[tuple[float, float, float]] = IMAGENET_MEAN
    std_rgb: ClassVar[tuple[float, float, float]] = IMAGENET_STD

    def normalisation(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """``(mean_rgb, std_rgb)``: what the trainer normalises its batches with."""
        return self.mean_rgb, self.std_rgb

    @abc.abstractmethod
    def settings(self, preset: str, **overrides: object) -> ModelSettings:
        """The settings of ``preset`` (laneflow's presets: ``cpu-demo``, ``tusimple``, ``culane``) with overrides."""

    def settings_from_record(self, record: Mapping[str, Any]) -> ModelSettings:
        """Settings as a checkpoint, ``model.pt`` or a package recorded them (``dataclasses.asdict``)."""
        known = {field.name for field in fields(self.settings_type)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"the recorded {self.name} settings have fields this laneflow does not know: "
                             f"{', '.join(unknown)}; use the laneflow version that wrote them")
        return self.settings_type(**{key: tuple(value) if isinstance(value, list) else value
                                     for key, value in record.items()})

    def overridable_settings(self) -> dict[str, str]:
        """The settings a run may override (``model.<name>=value``): name -> ``int``, ``float`` or ``str``."""
        kinds = {int: "int", float: "float", str: "str", "int": "int", "float": "float", "str": "str"}
        # A field's type is its annotation's text under ``from __future__ import annotations``, else the class.
        return {field.name: kinds[field.type] for field in fields(self.settings_type)
                if isinstance(field.type, type | str) and field.type in kinds}

    @abc.abstractmethod
    def network(self, settings: ModelSettings) -> nn.Module:
        """A new network: normalised RGB float ``(N, 3, H, W)`` in, a tuple of raw outputs out."""

    @abc.abstractmethod
    def criterion(self, settings: ModelSettings, check_finite: bool = True) -> Criterion:
        """The training loss; with ``check_finite`` a non-finite loss raises ``TrainingDiverged``."""

    @abc.abstractmethod
    def deployed(self, network: nn.Module) -> nn.Module:
        """The network behind the input contract: uint8 BGR NHWC in, normalised with ``mean_rgb``/``std_rgb``
        inside, ``output_names`` out."""

    @abc.abstractmethod
    def contract(self, settings: ModelSettings) -> dict[str, Any]:
        """The package's record of inputs, outputs and how lanes are read from them."""

    @abc.abstractmethod
    def row_lanes(self, settings: ModelSettings, outputs: Outputs, rows: list[int],
                  image_size: tuple[int, int]) -> RowLanes:
        """The lanes of one image at source rows ``rows`` (TuSimple's h_samples), ``image_size`` (width, height)."""

    @abc.abstractmethod
    def culane_lanes(self, settings: ModelSettings, outputs: Outputs, frame_size: tuple[int, int]) -> PointLanes:
        """The lanes of one image as the points of CULane's ``.lines.txt`` in a frame of ``frame_size``."""

    @abc.abstractmethod
    def load_backbone(self, network: nn.Module, path: Path) -> int:
        """Backbone weights from ``path`` into ``network``; how many tensors were loaded (errors name the first
        mismatch)."""


class TrainingDiverged(ValueError):
    """The weights blew up (a learning rate too high for the batch): training cannot go on, nor resume."""


def run_deployed(deployed: nn.Module, batch: torch.Tensor) -> tuple[np.ndarray, ...]:
    """A deployed module's outputs for a uint8 batch, as numpy arrays (scored in fp32, whatever the run trained
    in: the metric is computed on fp32 outputs)."""
    with torch.no_grad(), torch.autocast(batch.device.type, enabled=False):
        return tuple(output.cpu().numpy() for output in deployed(batch))


def image_outputs(outputs: tuple[np.ndarray, ...], index: int) -> Outputs:
    """Image ``index``'s outputs out of a batch's."""
    return tuple(output[index] for output in outputs)


def load_backbone_tensors(backbone: nn.Module, path: str | Path, name_of: Callable[[str], str], expected: str) -> int:
    """The tensors of the state dict in ``path`` (read as data only) whose ``name_of(key)`` is one of ``backbone``'s,
    loaded into it; how many. A tensor of another shape is refused naming it; a file with none of them is
    refused saying what was ``expected``."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    own = backbone.state_dict()
    loaded = {}
    for key, value in state.items():
        name = name_of(key)
        if name in own:
            if own[name].shape != value.shape:
                raise ValueError(f"backbone weight '{key}' has shape {tuple(value.shape)}, expected "
                                 f"{tuple(own[name].shape)}")
            loaded[name] = value
    if not loaded:
        raise ValueError(f"{path} holds no {expected}")
    backbone.load_state_dict(loaded, strict=False)
    return len(loaded)
