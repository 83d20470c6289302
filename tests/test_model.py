"""SCNN: the published parameter count, message passing equal to its sequential definition, learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.model import (
    SCNN,
    MessagePassing,
    SCNNLoss,
    _MessagePassingFn,
    count_parameters,
    load_backbone_weights,
    model_config,
)


def sequential_reference(x: torch.Tensor, weight: torch.Tensor, direction: str) -> torch.Tensor:
    """The paper's definition, slice by slice with 2-D convolutions, written independently of the model."""
    vertical = direction in ("down", "up")
    dim = 2 if vertical else 3
    slices = list(x.split(1, dim=dim))
    if direction in ("up", "left"):
        slices.reverse()
    padding = (0, weight.shape[3] // 2) if vertical else (weight.shape[2] // 2, 0)
    out = [slices[0]]
    for current in slices[1:]:
        out.append(current + F.relu(F.conv2d(out[-1], weight, padding=padding)))
    if direction in ("up", "left"):
        out.reverse()
    return torch.cat(out, dim=dim)


def test_tusimple_preset_has_the_published_parameter_count():
    assert count_parameters(SCNN(model_config("tusimple"))) == 20_534_857


def test_culane_preset_is_the_tusimple_network_at_the_official_culane_input():
    """SCNN's CULane model reads 800x288 (XingangPan/SCNN datasets/lane.lua: ScaleWH(800, 288)); of the weights only
    the existence branch's first FC grows with the input: 5 classes x 288/16 x 800/16 pooled values, not x 512/16."""
    culane = model_config("culane")
    assert (culane.input_width, culane.input_height) == (800, 288)
    model = SCNN(culane)
    assert count_parameters(model) == 20_534_857 + 5 * (288 // 16) * (800 // 16 - 512 // 16) * 128
    with torch.no_grad():
        logits, existence = model.eval()(torch.randn(1, 3, 288, 800))
    assert logits.shape == (1, 5, 288, 800) and existence.shape == (1, 4)


def test_cpu_demo_preset_is_small_and_shapes_are_right():
    model = SCNN(model_config("cpu-demo"))
    assert count_parameters(model) < 1_000_000
    logits, existence = model(torch.randn(2, 3, 144, 256))
    assert logits.shape == (2, 5, 144, 256) and existence.shape == (2, 4)
    assert ((existence > 0) & (existence < 1)).all()


@pytest.mark.parametrize("direction", ["down", "up", "right", "left"])
def test_message_passing_equals_the_sequential_definition(direction: str):
    torch.manual_seed(0)
    layer = MessagePassing(6, 5, direction).double()
    with torch.no_grad():
        layer.weight.mul_(3.0)  # large enough that the ReLU both passes and blocks
    x = torch.randn(2, 6, 7, 9, dtype=torch.double, requires_grad=True)
    ours = layer(x)
    reference = sequential_reference(x, layer.weight, direction)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(ours)
    grads_ours = torch.autograd.grad(ours, (x, layer.weight), upstream)
    grads_ref = torch.autograd.grad(reference, (x, layer.weight), upstream)
    for a, b in zip(grads_ours, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_message_passing_gradcheck():
    torch.manual_seed(1)
    seq = torch.randn(4, 1, 3, 5, dtype=torch.double, requires_grad=True)  # (steps, N, C, L)
    weight = torch.randn(3, 3, 3, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(_MessagePassingFn.apply, (seq, weight))


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = SCNN(model_config("cpu-demo"))
    images = torch.randn(2, 3, 144, 256)
    masks = torch.zeros(2, 144, 256, dtype=torch.long)
    masks[:, 60:, 100:108] = 2
    masks[:, 60:, 150:158] = 3
    exist = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.float)
    criterion = SCNNLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        logits, existence = model(images)
        loss, _ = criterion(logits, existence, masks, exist)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_backbone_weights_file(tmp_path):
    donor = SCNN(model_config("cpu-demo"))
    state = {f"features.{k}": v for k, v in donor.backbone.state_dict().items()}
    torch.save(state, tmp_path / "vgg.pt")
    model = SCNN(model_config("cpu-demo"))
    assert load_backbone_weights(model, tmp_path / "vgg.pt") == len(state)
    torch.testing.assert_close(model.backbone[0].weight, donor.backbone[0].weight)
    torch.save({"features.0.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="has shape"):
        load_backbone_weights(model, tmp_path / "bad.pt")


def test_presets_validate():
    with pytest.raises(ValueError, match="unknown preset"):
        model_config("resnet")
    with pytest.raises(ValueError, match="multiple of 16"):
        model_config("cpu-demo", input_height=100)
