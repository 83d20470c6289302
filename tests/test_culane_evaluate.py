"""A model scored on a prepared CULane split: its .lines.txt predictions and the official figures per scenario."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import pytest
import torch

from training.culane_eval import score_lists
from training.culane_metric import SCENARIOS, parse_lines
from training.data.culane import lines_path_for
from training.data.preprocess_culane import preprocess_culane
from training.data.synthetic_culane import generate
from training.dataset import read_list
from training.evaluate import dataset_kind, score_split
from training.evaluate_culane import evaluate_culane_run, split_lists
from training.model import SCNN, ModelConfig, model_config
from training.package import build_package, load_package, parity_images
from training.predict import predict


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


def one_lane_model() -> tuple[SCNN, ModelConfig]:
    """A cpu-demo SCNN that sees one lane, in slot 0, at the same columns of every frame: its segmentation logits
    are constants (no weights, class 1 far ahead) and its existence says slot 0 only — lines known exactly (what
    it cannot check, the input contract predict and evaluate share, tests/test_package.py checks)."""
    config = model_config("cpu-demo")
    model = SCNN(config).eval()
    with torch.no_grad():
        model.seg_head[-1].weight.zero_()
        model.seg_head[-1].bias.copy_(torch.tensor([-8.0, 8.0, -8.0, -8.0, -8.0]))
        model.exist_head[-2].weight.zero_()
        model.exist_head[-2].bias.copy_(torch.tensor([8.0, -8.0, -8.0, -8.0]))
    return model, config


def test_predict_with_a_culane_model_writes_the_lines_the_evaluation_writes_where_the_official_tool_reads_them(
        prepared: Path, tmp_path: Path) -> None:
    model, config = one_lane_model()
    evaluation = evaluate_culane_run(model, config, prepared, tmp_path / "run", "test", torch.device("cpu"))
    built = build_package(model, config, parity_images(prepared, "test", config), tmp_path / "package",
                          metrics=evaluation)
    package = load_package(built["package"])
    summary = predict(package, str(prepared), tmp_path / "out", backend="eager", overlays=False)
    assert summary.label_format == "culane" and summary.predictions == str(tmp_path / "out" / "lines")
    assert not (tmp_path / "out" / "predictions.json").exists()
    # Every frame of the dataset root at its own path; the test frames' lines are the evaluation's, byte for byte.
    for image in (sample.image for sample in read_list(prepared, "test")):
        predicted = (tmp_path / "out" / "lines" / lines_path_for(image)).read_text()
        assert predicted == (tmp_path / "run" / "culane_test" / lines_path_for(image)).read_text(), image
        (lane,) = parse_lines(predicted)
        # The peak is the network's first column (256 wide), the frame's column round(1640 / 256) - 1 (1-based
        # there), on SCNN's 18 rows every 20 from the bottom of 590.
        assert [tuple(point) for point in lane] == [(5, 589 - 20 * step) for step in range(18)]
    # A frame of another size: the same share of its height (rows every 10 of 295), columns in its own width.
    frame = cv2.imread(str(prepared / read_list(prepared, "test")[0].image))
    cv2.imwrite(str(tmp_path / "small.png"), cv2.resize(frame, (820, 295)))
    predict(package, str(tmp_path / "small.png"), tmp_path / "small", overlays=False)
    (lane,) = parse_lines((tmp_path / "small" / "lines" / "small.lines.txt").read_text())
    assert [tuple(point) for point in lane] == [(2, 294 - 10 * step) for step in range(18)]  # round(820 / 256) - 1
    # A video's frames by index under the video's name; the TuSimple format when asked for.
    writer = cv2.VideoWriter(str(tmp_path / "clip.avi"), cv2.VideoWriter_fourcc(*"FFV1"), 10.0, (1640, 590))
    for _ in range(2):
        writer.write(frame)
    writer.release()
    video = predict(package, str(tmp_path / "clip.avi"), tmp_path / "video", overlays=False)
    assert sorted(path.name for path in (tmp_path / "video" / "lines" / "clip.avi").iterdir()) == [
        "00000.lines.txt", "00001.lines.txt"] and video.predicted == 2
    tusimple = predict(package, str(tmp_path / "small.png"), tmp_path / "as-tusimple", overlays=False,
                       label_format="tusimple")
    assert json.loads(Path(tusimple.predictions).read_text())["raw_file"] == "small.png"
