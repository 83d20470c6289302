"""Score a model on a CULane split with the official metric: predictions as ``.lines.txt``, F1 per scenario.

Frames go through the same input contract and deployable module as every other consumer
(``training.inference``), their lanes are decoded by the model's CULane rule (``culane_lanes``) and written as the
official tool reads them, under ``<run>/culane_<split>/`` at each frame's path, and scored against the lines
files beside the frames (``training.culane_eval``): the validation split as one list, the test split per
scenario list and in total. Only frames the preparation kept are predicted and scored.

The result has the keys every consumer of a TuSimple evaluation reads, with CULane's meaning (``metric``
says which): ``accuracy`` and ``untimed_accuracy`` are F1 at IoU 0.5 — the figure the benchmark ranks by, and
models are selected by (0 when there is nothing to score) —, ``fp`` the share of predicted lanes that are
false (1 - precision) and ``fn`` the share of true lanes missed (1 - recall); ``counts`` holds the official
TP, FP, FN, precision, recall, F1, F1@0.75 and mean F1, and ``scenarios`` the same per scenario list.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch

from training.culane_eval import read_lanes, scenario_lists, score_lists
from training.culane_metric import format_lines
from training.data.culane import lines_path_for
from training.dataset import read_frames, read_list
from training.inference import CULANE_SIZE, SLOT_COLOURS, resize_for_model
from training.models import model_for
from training.models.base import ModelSettings, image_outputs, run_deployed

log = logging.getLogger("laneflow.evaluate_culane")


@torch.no_grad()
def predict_lines(model: torch.nn.Module, config: ModelSettings, data_root: Path, images: list[str], out: Path,
                  device: torch.device, batch_size: int = 8) -> None:
    """Write each frame's predicted lanes as ``out/<frame path>.lines.txt`` (an empty file: no lane)."""
    lane_model = model_for(config)
    deployed = lane_model.deployed(model).to(device).eval()
    for start in range(0, len(images), batch_size):
        names = images[start:start + batch_size]
        frames = [resize_for_model(frame, config.input_width, config.input_height)
                  for frame in read_frames(data_root, names)]
        outputs = run_deployed(deployed, torch.from_numpy(np.stack(frames)).to(device))
        for offset, name in enumerate(names):
            path = out / lines_path_for(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            lanes = lane_model.culane_lanes(config, image_outputs(outputs, offset), CULANE_SIZE)
            path.write_text(format_lines(points for _, points in lanes))


def split_lists(data_root: Path, split: str) -> dict[str, list[str]]:
    """The lists a split is scored on, by name, limited to the frames the preparation kept: the validation
    split as one list, the test split per scenario list (``list/test_split``) when the dataset has them."""
    kept = [sample.image for sample in read_list(data_root, split)]
    if split != "test":
        return {split: kept}
    try:
        scenarios = scenario_lists(data_root)
    except FileNotFoundError:
        return {"test": kept}
    wanted = set(kept)
    return {name: [image.lstrip("/") for image in images if image.strip().lstrip("/") in wanted]
            for name, images in scenarios.items()}


def evaluate_culane_run(model: torch.nn.Module, config: ModelSettings, data_root: Path, run_dir: Path, split: str,
                        device: torch.device, suffix: str = "") -> dict:
    """Predict and score ``split``; writes the predictions and ``eval<suffix>.json`` in ``run_dir``."""
    data_root, run_dir = Path(data_root), Path(run_dir)
    lists = split_lists(data_root, split)
    out = run_dir / f"culane_{split}"
    predict_lines(model, config, data_root, sorted({image for images in lists.values() for image in images}), out,
                  device)
    result = culane_result(split, score_lists(lists, data_root, out))
    (run_dir / f"eval{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    draw_overlay(data_root, [image for images in lists.values() for image in images], out,
                 run_dir / f"overlay{suffix}.png")
    counts = result["counts"]
    log.info("%s: F1 %.4f over %d frames (TP %d, FP %d, FN %d)", split, result["accuracy"], result["images"],
             counts["tp"], counts["fp"], counts["fn"])
    return result


def draw_overlay(data_root: Path, images: list[str], predictions: Path, out: Path, count: int = 4,
                 tile: tuple[int, int] = (820, 295)) -> Path:
    """Tile the first ``count`` frames with their predicted lanes (a colour per lane) over the ground truth's
    points (white), as the UI shows a run's evaluation."""
    tiles = []
    for image in images[:count]:
        frame = cv2.imread(str(data_root / image), cv2.IMREAD_COLOR)
        if frame is None:
            continue
        for lane in read_lanes(data_root / lines_path_for(image)):
            for x, y in lane:
                cv2.circle(frame, (round(float(x)), round(float(y))), 6, (255, 255, 255), -1)
        for index, lane in enumerate(read_lanes(predictions / lines_path_for(image))):
            points = np.rint(lane).astype(np.int32).reshape(-1, 1, 2)
            cv2.polylines(frame, [points], False, SLOT_COLOURS[index % len(SLOT_COLOURS)], 5)
        tiles.append(cv2.resize(frame, tile))
    while len(tiles) % 2 or not tiles:
        tiles.append(np.zeros((tile[1], tile[0], 3), np.uint8))
    cv2.imwrite(str(out), np.vstack([np.hstack(tiles[i:i + 2]) for i in range(0, len(tiles), 2)]))
    return out


def score_culane_split(model: torch.nn.Module, config: ModelSettings, data_root: Path, split: str,
                       device: torch.device) -> dict:
    """``evaluate_culane_run``'s result without writing in the run: the predictions go to a folder of their own
    that is removed afterwards (the trainer's periodic validation)."""
    lists = split_lists(data_root, split)
    with tempfile.TemporaryDirectory(prefix="laneflow-culane-") as folder:
        predict_lines(model, config, data_root, sorted({image for images in lists.values() for image in images}),
                      Path(folder), device)
        return culane_result(split, score_lists(lists, data_root, Path(folder)))


def culane_result(split: str, scores: dict) -> dict:
    """The evaluation's keys (see the module docstring) from the lists' scores (``score_lists``)."""
    total = scores["all"].as_dict()

    def share_missing(value: float | None) -> float:
        return 1.0 - value if value is not None else 0.0

    return {"split": split, "metric": "culane", "accuracy": total["f1"] or 0.0, "untimed_accuracy": total["f1"] or 0.0,
            "fp": share_missing(total["precision"]), "fn": share_missing(total["recall"]), "images": total["images"],
            "counts": total, "scenarios": {name: score.as_dict() for name, score in scores.items() if name != "all"}}
