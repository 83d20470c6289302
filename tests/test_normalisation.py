"""Input normalisation is part of a model's contract (``LaneModel.mean_rgb``/``std_rgb``): a model registered with
other statistics than ImageNet's gets them in the trainer's batches and inside its exported modules (TorchScript
and ONNX), and its package's contract records them; SCNN and ufld keep ImageNet's."""

from __future__ import annotations

import contextlib
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import TrainConfig
from training.dataset import IMAGENET_MEAN, IMAGENET_STD
from training.models import get_model
from training.package import export_models, open_backend
from training.precision import MixedPrecision, Numerics
from training.run_parts import RunParts

MEAN, STD = (0.3, 0.5, 0.7), (0.2, 0.4, 0.8)

#: A model of its own package: SCNN with other input statistics, which keeps the batch its network last trained on.
MODULE = f'''
from dataclasses import dataclass

from training.model import SCNN, ModelConfig, model_config
from training.models.scnn import SCNNModel


@dataclass(frozen=True)
class OtherStatsSettings(ModelConfig):
    pass


class Recording(SCNN):
    def forward(self, images):
        if self.training:
            self.seen = images.detach().clone()
        return super().forward(images)


class OtherStatsModel(SCNNModel):
    name = "otherstats"
    settings_type = OtherStatsSettings
    mean_rgb = {MEAN!r}
    std_rgb = {STD!r}

    def settings(self, preset, **overrides):
        return OtherStatsSettings(**{{**vars(model_config(preset)), **overrides}})

    def network(self, settings):
        return Recording(settings)
'''


@pytest.fixture
def other_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """``otherstats`` registered in the entry-point group as an installed package would be (its dist-info)."""
    (tmp_path / "otherstats_model.py").write_text(textwrap.dedent(MODULE))
    info = tmp_path / "otherstats-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otherstats\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[laneflow.models]\notherstats = otherstats_model:OtherStatsModel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = get_model("otherstats")
    yield model
    get_model.cache_clear()


def by_hand(images: torch.Tensor, mean: tuple, std: tuple) -> torch.Tensor:
    """uint8 BGR NHWC -> RGB NCHW, scaled to 0..1 and normalised with ``mean``/``std``."""
    rgb = images.permute(0, 3, 1, 2)[:, [2, 1, 0]].float() / 255
    return (rgb - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def test_a_model_with_other_statistics_trains_and_exports_with_them(other_stats: object, tmp_path: Path) -> None:
    model = other_stats
    settings = model.settings("cpu-demo")
    network = model.network(settings)
    torch.manual_seed(0)
    images = torch.randint(0, 256, (2, settings.input_height, settings.input_width, 3), dtype=torch.uint8)
    masks = torch.zeros((2, settings.input_height, settings.input_width), dtype=torch.long)
    exist = torch.zeros((2, 4))
    # The trainer's step: the batch the network trains on is normalised with the model's statistics.
    optimizer = torch.optim.SGD(network.parameters(), lr=0.01)
    parts = RunParts(TrainConfig(model="otherstats"), tmp_path, tmp_path, None, None, torch.device("cpu"),
                     Numerics("fp32", "contiguous"), MixedPrecision("fp32", "cpu"), model, settings, None, network,
                     optimizer, model.criterion(settings), contextlib.ExitStack())
    network.train()
    parts.step(images, masks, exist, optimizer, 0)
    assert torch.allclose(network.seen, by_hand(images, MEAN, STD), atol=1e-5)
    assert not torch.allclose(network.seen, by_hand(images, IMAGENET_MEAN, IMAGENET_STD), atol=1e-2)

    # The exported modules normalise with them too: their outputs are the network's on the batch so normalised.
    network.eval()
    with torch.no_grad():
        first = next(module for module in network.modules() if isinstance(module, torch.nn.Conv2d))
        first.weight.mul_(50)  # an untrained network barely sees its input: make it see it
        expected = torch.softmax(network(by_hand(images, MEAN, STD))[0], dim=1).numpy()
        imagenet = torch.softmax(network(by_hand(images, IMAGENET_MEAN, IMAGENET_STD))[0], dim=1).numpy()
    assert np.abs(expected - imagenet).max() > 1e-3  # the statistics make a difference the check can see
    (tmp_path / "export").mkdir()
    export_models(network, settings, tmp_path / "export")
    for backend in ("torchscript", "onnx"):  # as predict runs them
        outputs = open_backend(tmp_path / "export", settings, backend)(images.numpy())
        assert np.abs(outputs[0] - expected).max() < 1e-4, backend
    recorded = model.contract(settings)["input"]["normalisation"]
    assert (recorded["mean_rgb"], recorded["std_rgb"]) == (list(MEAN), list(STD))
    json.dumps(recorded)  # as the package's manifest keeps it


@pytest.mark.parametrize("name", ["scnn", "ufld"])
def test_the_built_in_models_keep_imagenets_statistics(name: str) -> None:
    model = get_model(name)
    assert model.normalisation() == (IMAGENET_MEAN, IMAGENET_STD)
    recorded = model.contract(model.settings("cpu-demo"))["input"]["normalisation"]
    assert (recorded["mean_rgb"], recorded["std_rgb"]) == (list(IMAGENET_MEAN), list(IMAGENET_STD))
    deployed = model.deployed(model.network(model.settings("cpu-demo")))
    assert deployed.mean.flatten().tolist() == pytest.approx(IMAGENET_MEAN)
    assert deployed.std.flatten().tolist() == pytest.approx(IMAGENET_STD)


def test_a_model_that_borrows_a_built_in_models_settings_type_is_refused(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved settings name their model by their type: a package model whose settings type is SCNN's would be
    evaluated and exported as SCNN (its own normalisation lost), so it is refused, saying what to do."""
    (tmp_path / "borrowing_model.py").write_text(textwrap.dedent('''
        from training.model import ModelConfig
        from training.models.scnn import SCNNModel


        class BorrowingModel(SCNNModel):
            name = "borrowing"
            settings_type = ModelConfig
            mean_rgb = (0.5, 0.5, 0.5)
    '''))
    info = tmp_path / "borrowing-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: borrowing\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[laneflow.models]\nborrowing = borrowing_model:BorrowingModel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"model 'borrowing' .* uses scnn's settings type ModelConfig: give it a "
                                             r"settings dataclass of its own"):
            get_model("borrowing")
    finally:
        get_model.cache_clear()
