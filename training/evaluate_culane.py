"""Score a model on a CULane split with the official metric: predictions as ``.lines.txt``, F1 per scenario.

Frames go through the same input contract and deployable module as every other consumer
(``training.inference``), their lanes are decoded by SCNN's CULane rule (``culane_lanes``) and written as the
official tool reads them, under ``<run>/culane_<split>/`` at each frame's path, and scored against the lines
files beside the frames (``training.culane_eval``): the validation split as one list, the test split per
scenario list and in total. Only frames the preparation kept are predicted and scored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import cv2
import numpy as np
import torch

from training.culane_eval import scenario_lists, score_lists
from training.culane_metric import format_lines
from training.data.culane import lines_path_for
from training.dataset import DataError, read_list
from training.inference import DeployedSCNN, culane_lanes, resize_for_model
from training.model import SCNN, ModelConfig

log = logging.getLogger("laneflow.evaluate_culane")


@torch.no_grad()
def predict_lines(model: SCNN, config: ModelConfig, data_root: Path, images: list[str], out: Path,
                  device: torch.device, batch_size: int = 8) -> None:
    """Write each frame's predicted lanes as ``out/<frame path>.lines.txt`` (an empty file: no lane)."""
    deployed = DeployedSCNN(model).to(device).eval()
    for start in range(0, len(images), batch_size):
        names = images[start:start + batch_size]
        frames = []
        for name in names:
            frame = cv2.imread(str(data_root / name), cv2.IMREAD_COLOR)
            if frame is None:
                raise DataError(f"cannot read {data_root / name}")
            frames.append(resize_for_model(frame, config.input_width, config.input_height))
        with torch.autocast(device.type, enabled=False):  # scored on fp32 outputs, as TuSimple's
            probs, existence = deployed(torch.from_numpy(np.stack(frames)).to(device))
        probs, existence = probs.cpu().numpy(), existence.cpu().numpy()
        for offset, name in enumerate(names):
            path = out / lines_path_for(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(format_lines(points for _, points in culane_lanes(probs[offset], existence[offset])))


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


def evaluate_culane_run(model: SCNN, config: ModelConfig, data_root: Path, run_dir: Path, split: str,
                        device: torch.device, suffix: str = "") -> dict:
    """Predict and score ``split``; writes the predictions and ``eval<suffix>.json`` in ``run_dir``."""
    data_root, run_dir = Path(data_root), Path(run_dir)
    lists = split_lists(data_root, split)
    out = run_dir / f"culane_{split}"
    predict_lines(model, config, data_root, sorted({image for images in lists.values() for image in images}), out,
                  device)
    scores = score_lists(lists, data_root, out)
    total = scores["all"].as_dict()
    result = {"split": split, "metric": "culane", **total,
              "scenarios": {name: score.as_dict() for name, score in scores.items() if name != "all"}}
    (run_dir / f"eval{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    log.info("%s: F1 %s over %d frames (TP %d, FP %d, FN %d)", split,
             "—" if total["f1"] is None else f"{total['f1']:.4f}", total["images"], total["tp"], total["fp"],
             total["fn"])
    return result
