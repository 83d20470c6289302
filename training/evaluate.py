"""Score a model on a split with the TuSimple metric, and draw predictions for the UI.

A CULane root (its manifest says so) is scored by the official CULane metric instead
(``training.evaluate_culane``), into the same keys: see there.

Images go through the same input contract and deployable module as ``laneflow predict`` and the
exported models (``training.inference``) -> lane x positions at the h_samples -> prediction JSON lines ->
``training.metric`` -> ``eval.json``; plus ``overlay.png`` with predicted (coloured per slot) and
ground-truth (white) lanes on a few images.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch

from training.checkpoints import UnsafeCheckpoint, load_weights, recorded_model
from training.data.labels import LABEL_FILES
from training.dataset import DataError, read_frames, read_list
from training.evaluate_culane import evaluate_culane_run, score_culane_split
from training.inference import draw_lanes, lanes_from_probabilities, resize_for_model
from training.metric import MAX_RUN_TIME_MS, parse_ground_truth, score_predictions
from training.models import get_model, model_for
from training.models.base import ModelSettings, image_outputs, run_deployed
from training.signals import exit_on_sigterm

log = logging.getLogger("laneflow.evaluate")

__all__ = ["evaluate_run", "lanes_from_probabilities", "load_model", "predict", "score_split"]


def ground_truth_for(data_root: Path, split: str, raw_files: set[str]) -> dict[str, dict]:
    """Ground-truth label records of ``split`` restricted to the images preparation kept."""
    records: dict[str, dict] = {}
    for name, file_split in LABEL_FILES.items():
        path = data_root / name
        if file_split != split or not path.is_file():
            continue
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = []
        for line in lines:
            try:
                if json.loads(line).get("raw_file") in raw_files:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue
        records.update(parse_ground_truth(kept, source=str(path)))
    return records


@torch.no_grad()
def predict(model: torch.nn.Module, config: ModelSettings, data_root: Path, split: str, device: torch.device,
            batch_size: int = 8) -> tuple[list[dict], dict[str, dict]]:
    """Prediction records (``raw_file``, ``lanes``, ``run_time`` in ms per image) for a split, and its
    ground truth (the kept images' label records, which give the h_samples to predict at)."""
    samples = read_list(data_root, split)
    lane_model = model_for(config)
    deployed = lane_model.deployed(model).to(device).eval()
    gt_lines = ground_truth_for(data_root, split, {s.image for s in samples})
    predictions = []
    wanted = [s.image for s in samples if s.image in gt_lines]
    for start in range(0, len(wanted), batch_size):
        names = wanted[start:start + batch_size]
        frames = read_frames(data_root, names)
        batch = np.stack([resize_for_model(f, config.input_width, config.input_height) for f in frames])
        began = time.perf_counter()
        outputs = run_deployed(deployed, torch.from_numpy(batch).to(device))
        per_image_ms = (time.perf_counter() - began) * 1000 / len(names)
        for offset, (name, frame) in enumerate(zip(names, frames, strict=True)):
            size = (frame.shape[1], frame.shape[0])
            lanes = lane_model.row_lanes(config, image_outputs(outputs, offset), gt_lines[name]["h_samples"], size)
            predictions.append({"raw_file": name, "lanes": [lane for _, lane in lanes], "slots": [s for s, _ in lanes],
                                "run_time": per_image_ms})
    return predictions, gt_lines


def draw_overlay(data_root: Path, predictions: list[dict], ground_truth: dict[str, dict], out: Path,
                 count: int = 4, tile: tuple[int, int] = (640, 360)) -> Path:
    """Tile ``count`` images with predicted lanes (colour per slot) over ground truth (white dots)."""
    tiles = []
    for record in predictions[:count]:
        image = cv2.imread(str(data_root / record["raw_file"]))
        gt = ground_truth[record["raw_file"]]
        for lane in gt["lanes"]:
            for x, y in zip(lane, gt["h_samples"], strict=True):
                if x >= 0:
                    cv2.circle(image, (int(x), int(y)), 5, (255, 255, 255), -1)
        image = draw_lanes(image, list(zip(record["slots"], record["lanes"], strict=True)), gt["h_samples"])
        tiles.append(cv2.resize(image, tile))
    while len(tiles) % 2:
        tiles.append(np.zeros_like(tiles[0]))
    grid = np.vstack([np.hstack(tiles[i:i + 2]) for i in range(0, len(tiles), 2)]) if tiles else \
        np.zeros((tile[1], tile[0], 3), np.uint8)
    cv2.imwrite(str(out), grid)
    return out


def dataset_kind(data_root: Path) -> str:
    """``culane`` or ``tusimple``: what the preparation wrote in the root's manifest (TuSimple's has no name)."""
    try:
        return str(json.loads((Path(data_root) / "manifest.json").read_text()).get("dataset", "tusimple"))
    except (OSError, ValueError, AttributeError):
        return "tusimple"


def score_split(model: torch.nn.Module, config: ModelSettings, data_root: Path, split: str,
                device: torch.device) -> dict:
    """The scores of ``model`` on ``split``, in memory: the trainer's periodic validation (a sweep's pruner
    reads it), which must leave the run's files as they are. The model is left in eval mode."""
    if dataset_kind(data_root) == "culane":
        return score_culane_split(model, config, Path(data_root), split, device)
    predictions, ground_truth = predict(model, config, Path(data_root), split, device)
    score = score_predictions(prediction_lines(predictions), ground_truth, source=f"{split} predictions")
    return {"split": split, **score.as_dict()}


def prediction_lines(predictions: list[dict]) -> list[str]:
    """Prediction records as the benchmark's JSON lines (without laneflow's own slot numbers)."""
    return [json.dumps({k: v for k, v in p.items() if k != "slots"}) for p in predictions]


def evaluate_run(model: torch.nn.Module, config: ModelSettings, data_root: Path, run_dir: Path, split: str,
                 device: torch.device, suffix: str = "") -> dict:
    """Predict, score and draw; writes predictions_<split>.json, eval<suffix>.json and overlay<suffix>.png.

    The trainer scores its own ``eval_split`` at the end of a run (no suffix); the pipeline's evaluate
    stage scores a chosen split afterwards (suffix ``_<split>``) without touching the trainer's files.
    """
    data_root, run_dir = Path(data_root), Path(run_dir)
    if dataset_kind(data_root) == "culane":
        return evaluate_culane_run(model, config, data_root, run_dir, split, device, suffix)
    predictions, ground_truth = predict(model, config, data_root, split, device)
    prediction_file = run_dir / f"predictions_{split}.json"
    lines = prediction_lines(predictions)
    prediction_file.write_text("".join(line + "\n" for line in lines))
    score = score_predictions(lines, ground_truth, source=str(prediction_file))
    # Both the official score and the one models are chosen by (no run-time rule); see training.metric.
    result = {"split": split, **score.as_dict(),
              "run_time_ms": float(np.mean([p["run_time"] for p in predictions])) if predictions else 0.0}
    (run_dir / f"eval{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    draw_overlay(data_root, predictions, ground_truth, run_dir / f"overlay{suffix}.png")
    log.info("%s: accuracy %.4f (%.4f without the %d ms rule; %d of %d images over it), FP %.4f, FN %.4f", split,
             score.accuracy, score.untimed.accuracy, MAX_RUN_TIME_MS, score.over_time_limit, score.images, score.fp,
             score.fn)
    return result


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, ModelSettings]:
    """A model saved by the trainer (``model.pt``), of whichever lane model wrote it."""
    state = load_weights(Path(path), map_location=device)  # data only: model.pt lies on a shared volume
    lane_model = get_model(recorded_model(state))
    config = lane_model.settings_from_record(state["model_config"])
    model = lane_model.network(config).to(device)
    model.load_state_dict(state["model"])
    return model, config


def main(argv: list[str] | None = None) -> int:
    """``python -m training.evaluate --run-dir R --data-root D --split test``: score a trained run's model.pt."""
    parser = argparse.ArgumentParser(prog="python -m training.evaluate", description=main.__doc__)
    parser.add_argument("--run-dir", required=True, type=Path, help="a finished run (with model.pt)")
    parser.add_argument("--data-root", required=True, type=Path, help="prepared dataset root (with seg_label/)")
    parser.add_argument("--split", default="test", choices=("train", "val", "test"))
    parser.add_argument("--out", type=Path, default=None,
                        help="where the predictions, eval_<split>.json and overlay go (default: the run dir); a "
                             "model scored for someone else's decision writes there, leaving its own run's files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    model_file = args.run_dir / "model.pt"
    if not model_file.is_file():
        print(f"error: {model_file} does not exist: evaluate a run that finished training", file=sys.stderr)
        return 2
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, config = load_model(model_file, device)
        out = args.out or args.run_dir
        out.mkdir(parents=True, exist_ok=True)
        result = evaluate_run(model, config, args.data_root, out, args.split, device, suffix=f"_{args.split}")
    except (DataError, FileNotFoundError, UnsafeCheckpoint) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "eval", **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
