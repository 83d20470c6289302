"""``compile: on``: the network through torch.compile (inductor, real C++ kernels) in the real trainer — the same
losses as eager, Horovod's gradient hooks still averaging, a resume from a checkpoint, and an export of the
compiled run's weights. One scenario, in order, so inductor compiles the graph once (its cache in /tmp serves
the later processes). The suite runs it on ``ufld`` (a cold compile of its cpu-demo training graph: ~40 s on 2
cores); ``make test-compile`` also runs it on SCNN, whose message passing is a custom autograd op (~2 minutes
cold, 5 in a loaded suite: too long for every run of the suite), and compares compiled with eager steps in the
numerics ``auto`` picks on a CPU with native bf16 (bf16, channels-last) on both models: a cold compile of that graph
adds 65 s on ufld (12 s from inductor's cache)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_train import BIN, REPO, env, events, prepared, run, train_cmd  # noqa: F401  (prepared: a fixture)

# fp32, contiguous, no dropout (inductor draws its masks in its own order): the comparison with eager is then as
# tight as float summation order allows.
RUN = ("--set", "epochs=1", "--set", "checkpoint_every=2")
FIXED = ("--set", "precision=fp32", "--set", "memory_format=contiguous", *RUN)
# bf16 rounds every op's output to an 8-bit mantissa (unit roundoff u = 2^-8 = 0.39 %); inductor fuses ops and keeps
# some intermediates in fp32 where eager rounds them to bf16, so an op's result may differ from eager's by about one
# ulp. The first step's loss (a mean over every pixel) averages those differences out; the second step's also
# carries the first's slightly different bf16 gradients. Measured: ufld 0.0017 % and 0.088 %, SCNN 0.0002 % and 0.28 %.
# Allowed: 1 %, about 2.5 u — 3.6x SCNN's second step, and far below what a graph computing something else moves.
BF16_RTOL = 1e-2
MODEL_SETTINGS = {"ufld": (), "scnn": ("--set", "model.dropout=0.0")}
#: Set by ``make test-compile``: the SCNN case too, and both models compiled in bf16 + channels-last.
WITH_SCNN = os.environ.get("LANEFLOW_TEST_COMPILE_SCNN") == "1"


def step_losses(stdout: str) -> np.ndarray:
    return np.array([e["loss"] for e in events(stdout) if e["event"] == "step"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ufld", pytest.param("scnn", marks=pytest.mark.skipif(
    not WITH_SCNN, reason="make test-compile runs SCNN's compile scenario (2 minutes of compiling)"))])
def test_a_compiled_run_trains_as_eager_does_under_horovod_resumes_and_exports(model: str, prepared: Path,  # noqa: F811
                                                                                 tmp_path: Path) -> None:
    fixed = (*FIXED, "--set", f"model={model}", *MODEL_SETTINGS[model])
    # The same two attempts each way: 2 steps, then a resume from the step-2 checkpoint to step 4 (a resume draws
    # new augmentations, so the comparison is attempt for attempt).
    attempts = {}
    for setting in ("off", "on"):
        for steps in (2, 4):
            done = run(train_cmd(prepared, tmp_path / setting, *fixed, "--set", f"max_steps={steps}",
                                 "--set", f"compile={setting}"), timeout=900)
            assert done.returncode == 0, done.stderr[-3000:]
            attempts[setting, steps] = done
    first, resumed = attempts["on", 2], attempts["on", 4]
    start = next(e for e in events(first.stdout) if e["event"] == "start")
    assert start["compile"] is True and "compile=on: set" in start["numerics_reason"]
    start = next(e for e in events(resumed.stdout) if e["event"] == "start")
    assert (start["step"], start["resumed"], start["compile"]) == (2, True, True)
    # Same seed, data order and weights: the compiled steps' losses are eager's (fp32 summation order aside).
    for steps in (2, 4):
        np.testing.assert_allclose(step_losses(attempts["on", steps].stdout),
                                   step_losses(attempts["off", steps].stdout), rtol=2e-3)

    # Exported: TorchScript and ONNX of the weights the compiled run trained, parity proven by the packager.
    packaged = subprocess.run([sys.executable, "-m", "training.package", "--run-dir", str(tmp_path / "on"),
                               "--data-root", str(prepared), "--split", "val"], env=env(), cwd=REPO,
                              capture_output=True, text=True, timeout=600)
    assert packaged.returncode == 0, packaged.stderr[-3000:]
    assert json.loads((tmp_path / "on" / "package" / "package.json").read_text())["parity"]["passed"]

    # Two ranks, each compiled: Horovod's hooks on the gradient accumulators still fire (un-averaged gradients
    # would leave the ranks with different weights) and the ranks end identical.
    two = run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
               *train_cmd(prepared, tmp_path / "two", *fixed, "--set", "max_steps=3", "--set", "compile=on")],
              timeout=900)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    reported = re.findall(r"final weights sha256 ([0-9a-f]{64}) \(rank (\d)\)", two.stdout + two.stderr)
    assert sorted(rank for _, rank in reported) == ["0", "1"], reported
    assert len({digest for digest, _ in reported}) == 1, f"ranks diverged: {reported}"


@pytest.mark.slow
@pytest.mark.skipif(not WITH_SCNN, reason="make test-compile runs it: a cold compile of the bf16 graph adds 65 s")
@pytest.mark.parametrize("model", ["ufld", "scnn"])
def test_compiled_steps_in_autos_numerics_give_eagers_losses(model: str, prepared: Path,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """What ``auto`` picks on a CPU with native bf16 — bf16 autocast, channels-last — compiled and not: the same
    losses within bf16's rounding (``BF16_RTOL``)."""
    half = (*RUN, "--set", f"model={model}", *MODEL_SETTINGS[model], "--set", "precision=bf16",
            "--set", "memory_format=channels_last", "--set", "max_steps=2")
    bf16 = {}
    for setting in ("off", "on"):
        done = run(train_cmd(prepared, tmp_path / f"bf16-{setting}", *half, "--set", f"compile={setting}"),
                   timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        start = next(e for e in events(done.stdout) if e["event"] == "start")
        assert (start["precision"], start["memory_format"], start["compile"]) == ("bf16", "channels_last",
                                                                                   setting == "on")
        bf16[setting] = step_losses(done.stdout)
    print(f"bf16 channels-last losses, eager {bf16['off']}, compiled {bf16['on']}")
    np.testing.assert_allclose(bf16["on"], bf16["off"], rtol=BF16_RTOL)
