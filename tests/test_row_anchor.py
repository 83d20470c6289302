"""The row-anchor detector (training.models.row_anchor, ``model=ufld``): known lanes encoded into its row
targets and decoded back land within one cell, at its anchors and at any image's rows; and it goes through
everything SCNN does — a sweep over ``model`` trains both with horovodrun -np 2, scores them with the official
metric and ranks them, packages with export parity, and the package predicts on a video."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from flows.sweep import sweep
from tests.test_pipeline import params_for
from training.config import parse_overrides
from training.data.synthetic import labelled_video
from training.models import get_model
from training.models.row_anchor import LANES, columns_from_rows, lanes_at, row_targets
from training.package import load_package
from training.predict import predict

#: Four lanes in a 1280x720 source image, as (x at the bottom row 719, x at row 300): none crosses another.
SOURCE = (1280, 720)
LANE_ENDS = ((80.0, 560.0), (420.0, 610.0), (860.0, 690.0), (1250.0, 760.0))


def true_x(slot: int, y: float) -> float:
    """Slot ``slot``'s lane at source row ``y`` (a straight line from row 300 to row 719)."""
    bottom, top = LANE_ENDS[slot]
    return top + (bottom - top) * (y - 300) / (719 - 300)


def lane_mask(width: int, height: int) -> np.ndarray:
    """The lanes drawn at the model's input size, 5 px wide, value slot + 1, from row 300 of the source down."""
    mask = np.zeros((height, width), np.uint8)
    sx, sy = width / SOURCE[0], height / SOURCE[1]
    for slot in range(LANES):
        start = (round(true_x(slot, 300) * sx), round(300 * sy))
        end = (round(true_x(slot, 719) * sx), round(719 * sy))
        cv2.line(mask, start, end, slot + 1, 5)
    return mask


@pytest.mark.parametrize("preset", ["cpu-demo", "tusimple", "culane"])
def test_known_lanes_encoded_into_row_targets_decode_back_within_one_cell(preset: str) -> None:
    settings = get_model("ufld").settings(preset)
    mask = torch.from_numpy(lane_mask(settings.input_width, settings.input_height))[None]
    targets = row_targets(mask, settings)[0]  # (anchors, 4)
    anchors = settings.anchor_rows()
    # Where a lane is (below source row 300), its cell; above it, "no lane".
    start = 300 * settings.input_height / SOURCE[1]  # where the lanes begin, in input rows
    for index, row in enumerate(anchors):
        source_row = row * SOURCE[1] / settings.input_height
        for slot in range(LANES):
            if row < start - 4:  # above the lanes and their 5 px wide round ends
                assert targets[index, slot] == settings.cells, (row, slot)
            if row < start + 4:
                continue
            cell = int(targets[index, slot])
            x = true_x(slot, source_row) * settings.input_width / SOURCE[0]
            assert cell < settings.cells and abs(cell * settings.cell_width - x) <= settings.cell_width, (row, slot)
    # Logits that are sure of those targets decode to the same columns (within a cell), "no lane" to -1.
    logits = torch.full((1, settings.cells + 1, settings.anchors, LANES), -20.0)
    logits.scatter_(1, targets[None, None], 20.0)
    cell_index = torch.arange(settings.cells, dtype=torch.float32).view(1, -1, 1, 1)
    columns = columns_from_rows(logits, cell_index, settings.cell_width)[0].numpy()  # (4, anchors)
    absent = (targets == settings.cells).T.numpy()
    assert np.array_equal(columns < 0, absent)
    expected = targets.T.numpy() * settings.cell_width
    assert np.abs(np.where(absent, 0, columns - expected)).max() < 0.05 * settings.cell_width
    # At TuSimple's h_samples of the source image: the true lanes within a cell, in source pixels.
    rows = list(range(320, 711, 10))
    decoded = dict(lanes_at(columns, np.ones(LANES), settings, np.asarray(rows), SOURCE))
    cell_in_source = settings.cell_width * SOURCE[0] / settings.input_width
    assert sorted(decoded) == [0, 1, 2, 3]
    for slot, xs in decoded.items():
        for row, x in zip(rows, xs, strict=True):
            if x >= 0:
                assert abs(x - min(max(true_x(slot, row), 0), SOURCE[0] - 1)) <= cell_in_source + 1, (slot, row, x)
        assert (xs >= 0).sum() >= len(rows) - 3, (slot, xs)  # near the top anchors a lane may start a row late


#: Four lanes in CULane's 1640x590 frame, as (x at the bottom row 589, x at row 230).
CULANE_ENDS = ((40.0, 600.0), (560.0, 760.0), (1150.0, 900.0), (1620.0, 1060.0))


def culane_x(slot: int, y: float) -> float:
    bottom, top = CULANE_ENDS[slot]
    return top + (bottom - top) * (y - 230) / (589 - 230)


def test_known_lanes_decode_to_culanes_points_within_one_cell() -> None:
    """Encoded into ufld's CULane targets and decoded by the model's CULane rule: points on CULane's rows (every
    20 from the bottom of the 590-row frame) within one anchor cell of the true lanes, in the frame's pixels."""
    from training.inference import culane_point_rows

    model = get_model("ufld")
    settings = model.settings("culane")
    width, height, frame = settings.input_width, settings.input_height, (1640, 590)
    mask = np.zeros((height, width), np.uint8)
    for slot in range(LANES):
        ends = [(round(culane_x(slot, y) * width / frame[0]), round(y * height / frame[1])) for y in (230, 589)]
        cv2.line(mask, ends[0], ends[1], slot + 1, 5)
    targets = row_targets(torch.from_numpy(mask)[None], settings)
    logits = torch.full((1, settings.cells + 1, settings.anchors, LANES), -20.0)
    logits.scatter_(1, targets[None], 20.0)
    columns = columns_from_rows(logits, torch.arange(settings.cells, dtype=torch.float32).view(1, -1, 1, 1),
                                settings.cell_width)[0].numpy()
    lanes = dict(model.culane_lanes(settings, (columns, np.ones(LANES, np.float32)), frame))
    _, culane_rows = culane_point_rows(frame[1])
    cell = settings.cell_width * frame[0] / width  # one cell in the frame's pixels
    assert sorted(lanes) == [0, 1, 2, 3]
    for slot, points in lanes.items():
        assert all(y in culane_rows for _, y in points), points
        for x, y in points:
            assert abs(x - min(max(culane_x(slot, y), 0), frame[0] - 1)) <= cell + 1, (slot, x, y)
        # Every CULane row between the top and bottom anchors has its point (589 lies below the last anchor).
        top, bottom = (row * frame[1] / height for row in settings.anchor_rows()[[0, -1]])
        assert {y for _, y in points} == {int(y) for y in culane_rows if top <= y <= bottom}, (slot, points)


@pytest.mark.slow
def test_a_sweep_over_the_model_trains_scores_ranks_and_packages_both_and_the_row_anchor_package_runs_on_video(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    base = params_for(synthetic_archive, volume="models", max_steps=4, snapshot=False, package=True)
    # The model, and one of ufld's own settings (scnn has no cells: each run names its model and settings).
    table = sweep(**base, runs=[{"model": "scnn"}, {"model": "ufld", "model_settings.cells": 32}], max_concurrent=1)
    assert sorted(row["model"] for row in table) == ["scnn", "ufld"]
    assert all(row["state"] == "Completed" and row["val accuracy"] is not None for row in table)
    assert [row["val accuracy"] for row in table] == sorted((row["val accuracy"] for row in table), reverse=True)
    (ufld,) = [row for row in table if row["model"] == "ufld"]
    run_dir = laneflow_home / "volumes" / "models" / "runs" / ufld["run"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model_name"] == "ufld" and config["world_size"] == 2  # horovodrun -np 2
    assert config["model"]["cells"] == 32 != get_model("ufld").settings("cpu-demo").cells
    lineage = json.loads((run_dir / "lineage.json").read_text())
    assert lineage["parameters"]["model"] == "ufld" and lineage["training"]["model"]["name"] == "ufld"
    assert lineage["parameters"]["model_settings"] == {"cells": 32}
    assert lineage["training"]["model"]["settings"]["cells"] == 32
    (scnn,) = [row for row in table if row["model"] == "scnn"]
    scnn_config = json.loads((laneflow_home / "volumes" / "models" / "runs" / scnn["run"] / "config.json").read_text())
    assert scnn_config["model_name"] == "scnn" and scnn_config["train"]["model_overrides"] == {}
    package = load_package(run_dir / "package")
    assert package.model_name == "ufld" and package.manifest["parity"]["passed"] and package.config.cells == 32
    assert set(package.manifest["parity"]["backends"]["onnx"]) >= {"max_abs_diff_columns", "max_abs_diff_existence"}
    # The demo's video (scripts/demo.py): the test frames as a clip.
    video = tmp_path / "drive.avi"
    labelled_video(laneflow_home / "volumes" / "models" / lineage["dataset_dir"], "test_label.json", video)
    summary = predict(package, str(video), tmp_path / "out", backend="onnx")
    assert (summary.frames, summary.predicted, summary.skipped) == (3, 3, [])
    lines = [json.loads(line) for line in Path(summary.predictions).read_text().splitlines()]
    assert len(lines) == 3 and all(len(line["h_samples"]) == 56 for line in lines)


def test_imagenet_weights_in_torchvisions_layout_load_into_the_backbone_and_another_depth_is_refused(
        tmp_path: Path) -> None:
    from training.models.resnet import ResNet

    model = get_model("ufld")
    network = model.network(model.settings("cpu-demo"))
    # What torchvision's resnet18().state_dict() holds: the backbone's tensors and the ImageNet classifier.
    saved = {**{key: torch.full_like(value, 0.5) for key, value in ResNet("resnet18").state_dict().items()},
             "fc.weight": torch.zeros(1000, 512), "fc.bias": torch.zeros(1000)}
    torch.save(saved, tmp_path / "resnet18.pth")
    assert model.load_backbone(network, tmp_path / "resnet18.pth") == len(saved) - 2
    assert bool((network.backbone.layer4[1].conv2.weight == 0.5).all())
    torch.save(ResNet("resnet34").state_dict(), tmp_path / "resnet34.pth")
    with pytest.raises(ValueError, match=r"stage tensors this ResNet lacks \(layer1\.2\..*another depth"):
        model.load_backbone(network, tmp_path / "resnet34.pth")
    # As the message says: the depth is a setting of the run.
    deeper = parse_overrides("cpu-demo", ["model=ufld", "model.backbone=resnet34"])
    assert model.settings("cpu-demo", **deeper.model_overrides).backbone == "resnet34"
    with pytest.raises(ValueError, match="unknown backbone 'resnet50'; choose one of resnet18, resnet34"):
        parse_overrides("cpu-demo", ["model=ufld", "model.backbone=resnet50"])
