"""cpu-demo learns: trained within a CI-sized budget it scores clearly above the same model untrained."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tasks.processes import run_to_end
from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.evaluate import evaluate_run
from training.model import SCNN, model_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_demo_trained_beats_untrained(tmp_path: Path):
    data = tmp_path / "tusimple"
    generate(data, train=64, val=16, test=0, seed=5, width=640, height=360)
    preprocess(data, workers=1)

    torch.manual_seed(0)
    config = model_config("cpu-demo")
    untrained_dir = tmp_path / "untrained"
    untrained_dir.mkdir()
    untrained = evaluate_run(SCNN(config), config, data, untrained_dir, "val", torch.device("cpu"))

    run_dir = tmp_path / "trained"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = run_to_end(
        [sys.executable, "-m", "training.train", "--data-root", str(data), "--run-dir", str(run_dir),
         "--preset", "cpu-demo", "--set", "epochs=10", "--set", "batch_size=4", "--set", "log_every=16"],
        1800, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = json.loads((run_dir / "eval.json").read_text())
    print(f"untrained: {untrained}\ntrained: {trained}")
    assert trained["accuracy"] >= untrained["accuracy"] + 0.3, (untrained, trained)
    assert trained["fn"] < untrained["fn"]
