"""Mixed precision, memory format and compression settings: resolved for the device, checkpointed, and
on CPUs (where the tests run) a bf16 run that follows the fp32 one. GPU paths are covered by their
configuration and by CPU autocast (the same code, another device type)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.processes import run_to_end
from tests.test_train import events, prepared, run, train_cmd  # noqa: F401  (prepared is a fixture)
from training.checkpoints import load_latest_checkpoint
from training.config import TRAIN_PRESETS, parse_overrides
from training.evaluate import predict
from training.model import SCNN, SCNNLoss, model_config
from training.precision import Device, MixedPrecision, resolve_memory_format, resolve_precision

H200 = Device("cuda", bf16=True)
T4 = Device("cuda", bf16=False)
CPU = Device("cpu", bf16=False)


def test_auto_picks_the_fastest_safe_precision_and_layout_for_the_device() -> None:
    assert [resolve_precision("auto", device) for device in (H200, T4, CPU)] == ["bf16", "fp16", "fp32"]
    assert [resolve_precision(p, CPU) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    assert resolve_memory_format("auto", H200) == torch.channels_last
    assert resolve_memory_format("auto", CPU) == torch.contiguous_format
    assert resolve_memory_format("channels_last", CPU) == torch.channels_last
    assert TRAIN_PRESETS["tusimple"].precision == "auto" and TRAIN_PRESETS["cpu-demo"].precision == "fp32"
    assert parse_overrides("cpu-demo", ["precision=bf16", "memory_format=channels_last",
                                        "compression=fp16"]).precision == "bf16"
    with pytest.raises(ValueError, match="setting 'precision' must be one of auto, fp32, bf16, fp16, got 'fp8'"):
        parse_overrides("cpu-demo", ["precision=fp8"])
    with pytest.raises(ValueError, match="setting 'compression' must be one of none, fp16"):
        parse_overrides("cpu-demo", ["compression=int8"])


def test_the_fp16_loss_scale_is_checkpointed_and_resumed_in_any_precision() -> None:
    fp16 = MixedPrecision("fp16", "cpu")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # overflowing steps halve the scale; finite ones keep it
        with fp16.autocast():
            loss = model(torch.full((2, 4), 1e4)).float().sum() * 1e30
        optimizer.zero_grad()
        fp16.backward_and_step(loss, optimizer, distributed=False)
    state = fp16.state_dict()
    assert state is not None and state["scale"] < 65536.0
    resumed = MixedPrecision("fp16", "cpu")
    assert resumed.load_state_dict(state) == f"loss scale {state['scale']:g} resumed"
    assert resumed.scaler.get_scale() == state["scale"]
    assert MixedPrecision("bf16", "cpu").state_dict() is None
    assert "dropped" in MixedPrecision("bf16", "cpu").load_state_dict(state)
    assert "fresh scaler" in MixedPrecision("fp16", "cpu").load_state_dict(None)


def test_message_passing_trains_under_autocast() -> None:
    """The custom autograd op computes in autocast's dtype, forward and backward alike."""
    torch.manual_seed(0)
    config = model_config("cpu-demo")
    model = SCNN(config)
    images = torch.randn(2, 3, config.input_height, config.input_width)
    masks = torch.randint(0, 5, (2, config.input_height, config.input_width))
    exist = torch.randint(0, 2, (2, 4)).float()
    grads = {}
    for dtype in (None, torch.bfloat16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            logits, existence = model(images)
        loss, _ = SCNNLoss()(logits.float(), existence.float(), masks, exist)
        loss.backward()
        grads[dtype] = model.message_passing[0].weight.grad.clone()
    assert grads[torch.bfloat16].dtype == torch.float32 and torch.isfinite(grads[torch.bfloat16]).all()
    cosine = torch.nn.functional.cosine_similarity(grads[None].flatten(), grads[torch.bfloat16].flatten(), dim=0)
    assert cosine > 0.98


def test_evaluation_scores_fp32_outputs_even_inside_autocast(prepared: Path) -> None:  # noqa: F811
    torch.manual_seed(0)
    config = model_config("cpu-demo")
    model = SCNN(config)
    plain, _ = predict(model, config, prepared, "val", torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside, _ = predict(model, config, prepared, "val", torch.device("cpu"))
    assert [p["lanes"] for p in inside] == [p["lanes"] for p in plain]


def losses(stdout: str) -> np.ndarray:
    return np.array([e["loss"] for e in events(stdout) if e["event"] == "step"])


def test_a_bf16_run_follows_the_fp32_loss_curve_and_checkpoints_cross_precisions(
        prepared: Path, tmp_path: Path) -> None:  # noqa: F811
    steps = ["--set", "max_steps=30", "--set", "epochs=10", "--set", "checkpoint_every=10"]
    fp32 = run(train_cmd(prepared, tmp_path / "fp32", *steps))
    bf16 = run(train_cmd(prepared, tmp_path / "bf16", *steps, "--set", "precision=bf16"))
    assert fp32.returncode == 0 and bf16.returncode == 0, bf16.stderr[-2000:]
    assert next(e for e in events(bf16.stdout) if e["event"] == "start")["precision"] == "bf16"
    a, b = losses(fp32.stdout), losses(bf16.stdout)
    assert len(a) == len(b) == 30
    # Same data, augmentation and initial weights (the runs are deterministic): bf16's 8-bit mantissa moves
    # each step's loss by a few per cent (batch 2: no averaging). Tolerance: on average within 8 %, no step
    # beyond 20 %, the last ten steps' mean within 10 %; and both learn. (Measured: 3.6 %, 10 %, 4.6 %.)
    relative = np.abs(b - a) / a
    assert relative.mean() < 0.08 and relative.max() < 0.20, np.round(relative, 4)
    assert abs(b[-10:].mean() - a[-10:].mean()) / a[-10:].mean() < 0.10
    assert a[-5:].mean() < a[:5].mean() / 2 and b[-5:].mean() < b[:5].mean() / 2

    # A bf16 checkpoint resumes in fp16 (a fresh loss scale), whose checkpoint resumes in fp32 (dropped).
    more = ["--set", "epochs=10", "--set", "checkpoint_every=10"]
    # Two steps each: a resume, a step in the new precision and the checkpoint at the end are what is tested.
    fp16 = run(train_cmd(prepared, tmp_path / "bf16", *more, "--set", "max_steps=32", "--set", "precision=fp16"))
    assert fp16.returncode == 0, fp16.stderr[-2000:]
    start = next(e for e in events(fp16.stdout) if e["event"] == "start")
    assert (start["step"], start["precision"], start["resumed"]) == (30, "fp16", True)
    assert "has no loss scale (another precision): starting a fresh scaler" in fp16.stderr
    state = load_latest_checkpoint(tmp_path / "bf16")
    assert state["step"] == 32 and state["precision"] == "fp16" and state["scaler"]["scale"] > 0
    back = run(train_cmd(prepared, tmp_path / "bf16", *more, "--set", "max_steps=34"))
    assert back.returncode == 0 and "(the checkpoint's is dropped)" in back.stderr
    assert json.loads((tmp_path / "bf16" / "eval.json").read_text())["images"] == 4


def test_the_gpu_bench_dry_run_exercises_every_configuration_on_cpu(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    done = run_to_end([sys.executable, str(bench), "--dry-run", "--json", str(tmp_path / "gpu.json")], 600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())["results"]
    assert [(r["precision"], r["memory_format"]) for r in results] == [
        (p, m) for p in ("fp32", "bf16", "fp16") for m in ("contiguous", "channels_last")]
    assert all(r["img_per_s"] > 0 and 0 <= r["input_stall"] <= 1 for r in results)
