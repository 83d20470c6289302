"""A model scored on a prepared CULane split: its .lines.txt predictions and the official figures per scenario."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import pytest
import torch

from training.culane_eval import score_lists
from training.culane_metric import SCENARIOS
from training.data.culane import lines_path_for
from training.data.preprocess_culane import preprocess_culane
from training.data.synthetic_culane import generate
from training.dataset import read_list
from training.evaluate import dataset_kind, score_split
from training.evaluate_culane import evaluate_culane_run, split_lists
from training.model import SCNN, model_config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("culane")
    generate(root, train=4, val=3, test=18, seed=11)
    (root / "driver_37_30frame/00000000_0000.MP4/00030.jpg").write_bytes(b"")  # quarantined: not predicted
    preprocess_culane(root, workers=1)
    return root


def test_a_model_is_scored_per_scenario_on_the_frames_the_preparation_kept(prepared: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = model_config("cpu-demo")
    model = SCNN(config).eval()
    result = evaluate_culane_run(model, config, prepared, tmp_path, "test", torch.device("cpu"), suffix="_test")
    kept = {sample.image for sample in read_list(prepared, "test")}
    assert len(kept) == 17
    written = {str(path.relative_to(tmp_path / "culane_test")) for path in (tmp_path / "culane_test").rglob("*.txt")}
    assert written == {lines_path_for(image) for image in kept}
    assert list(result["scenarios"]) == list(SCENARIOS) and result["metric"] == "culane"
    assert sum(figures["images"] for figures in result["scenarios"].values()) == result["images"] == 17
    counts = result["counts"]
    assert counts["tp"] + counts["fn"] == sum(figures["tp"] + figures["fn"] for figures in result["scenarios"].values())
    assert result["accuracy"] == result["untimed_accuracy"] == (counts["f1"] or 0.0)
    assert 0.0 <= result["fp"] <= 1.0 and 0.0 <= result["fn"] <= 1.0
    assert json.loads((tmp_path / "eval_test.json").read_text()) == result
    assert cv2.imread(str(tmp_path / "overlay_test.png")).shape == (590, 1640, 3)  # 2x2 frames, as the UI shows
    # The trainer's in-memory scoring: the same figures, nothing written in the run.
    before = sorted(tmp_path.rglob("*"))
    assert score_split(model, config, prepared, "test", torch.device("cpu")) == result
    assert sorted(tmp_path.rglob("*")) == before and dataset_kind(prepared) == "culane"


def test_predictions_equal_to_the_ground_truth_score_one_on_every_scenario(prepared: Path, tmp_path: Path) -> None:
    """The scoring half alone: the ground truth's own lines, placed where predictions go, are a perfect score."""
    lists = split_lists(prepared, "test")
    out = tmp_path / "culane_test"
    for images in lists.values():
        for image in images:
            (out / lines_path_for(image)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(prepared / lines_path_for(image), out / lines_path_for(image))
    scores = score_lists(lists, prepared, out)
    assert all(scores[name].f1 == 1.0 for name in SCENARIOS if name != "cross")
    assert scores["cross"].counts[0.5].fp == 0 and scores["all"].images == 17
    assert split_lists(prepared, "val") == {"val": [sample.image for sample in read_list(prepared, "val")]}
