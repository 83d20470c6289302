"""A run's reports: step and validation series, the training curve, metrics rows, thumbnails and lineage."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from flows.params import TrainParams
from tasks.lineage import build_lineage, dataset_label, render_lineage_markdown
from tasks.report import (
    eval_series,
    metrics_description,
    metrics_rows,
    render_package_markdown,
    step_series,
    thumbnail_jpeg,
    training_curve_png,
    world_changes,
)
from tests.unit_helpers import SHA, source

STEPS = [{"event": "step", "step": s, "loss": 1.0 / s, "lr": 0.01 * s, "img_per_s": 10.0, "input_stall": 0.1}
         for s in (10, 20, 30)]


def test_step_series_keeps_the_last_report_of_a_step_replayed_after_resume() -> None:
    replay = {**STEPS[1], "loss": 0.42}
    series = step_series([*STEPS, replay, {"event": "epoch"}])
    assert [s["step"] for s in series] == [10, 20, 30] and series[1]["loss"] == 0.42


def colour_pixels(image: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int((np.abs(image.astype(int) - rgb[::-1]).sum(axis=2) < 40).sum())


def test_curve_is_a_matplotlib_png_with_loss_lr_and_validation_accuracy() -> None:
    events = [*STEPS, {"event": "epoch", "epoch": 0, "step": 30},
              {"event": "eval", "split": "val", "accuracy": 0.4, "untimed_accuracy": 0.7}]
    validation = eval_series(events)
    assert validation == [(30, 0.7)]  # the accuracy models are compared by, at the step it was measured
    png = training_curve_png(step_series(STEPS), "train-1 (dataset 015713982decdf11)", validation)
    image = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)
    assert image.shape == (680, 800, 3)  # two panels: loss and lr on their own axes; validation accuracy
    top, bottom = image[:340], image[340:]
    assert colour_pixels(top, (255, 127, 14)) > 100 and colour_pixels(top, (44, 160, 44)) > 100  # loss, lr
    assert colour_pixels(bottom, (31, 119, 180)) > 20  # the validation point
    empty = cv2.imdecode(np.frombuffer(training_curve_png([], "run"), np.uint8), cv2.IMREAD_COLOR)
    assert empty.shape == (340, 800, 3)


def test_metrics_rows_and_thumbnail() -> None:
    rows = metrics_rows({"steps": 30, "resumed_from": 10, "duration_s": 12.5},
                        {"split": "test", "accuracy": 0.51234, "fp": 0.1, "fn": 0.2, "images": 40,
                         "untimed_accuracy": 0.91234, "untimed_fp": 0.1, "untimed_fn": 0.2, "over_time_limit": 18},
                        STEPS)
    table = {row["metric"]: row["value"] for row in rows}
    assert table["test accuracy (official)"] == 0.5123 and table["final loss"] == round(1 / 30, 4)
    assert table["test accuracy without the 200 ms rule (model selection)"] == 0.9123
    assert table["test images over 200 ms"] == 18
    assert table["resumed_from"] == 10 and table["mean img/s"] == 10.0
    wide = cv2.imencode(".png", np.zeros((720, 2560, 3), np.uint8))[1].tobytes()
    small = cv2.imdecode(np.frombuffer(thumbnail_jpeg(wide, 960), np.uint8), cv2.IMREAD_COLOR)
    assert small.shape == (270, 960, 3)
    with pytest.raises(ValueError, match="not a decodable image"):
        thumbnail_jpeg(b"not an image")


def test_lineage_markdown_has_every_fact_and_no_secret() -> None:
    params = TrainParams(source=source())
    lineage = build_lineage(run="train-1", flow_run_id="f", flow_run_name="happy-fox", platform="local",
                            volume="v", dataset={"dataset_version": "dv1", "counts": {"read": 3, "kept": 3,
                                                                                         "quarantined": 0},
                                                 "artifacts": [{"name": "train_set.zip", "sha256": SHA,
                                                                "kind": "archive"}]},
                            code="git:abc", parameters=params.for_record(), training={},
                            evaluation={"accuracy": 0.9}, snapshot="v-train-1")
    text = render_lineage_markdown(lineage)
    for fact in ("train-1", "happy-fox", "dv1", SHA, "train_set.zip", "git:abc", "v-train-1", "0.9000", "cpu-demo"):
        assert fact in text
    assert "secret" not in text and "secret" not in json.dumps(lineage)
    # What the run computed in (precision: auto resolved on its machine), as its start event said.
    numerics = {"precision": "bf16", "memory_format": "channels_last", "compile": False,
                "numerics_reason": "bf16/channels_last: 2.03x faster a step than fp32/contiguous"}
    assert ("| numerics | bf16, channels_last: bf16/channels_last: 2.03x faster a step than fp32/contiguous |"
            in render_lineage_markdown({**lineage, "training": {"numerics": numerics}}))
    older = {"precision": "fp32", "memory_format": "contiguous"}  # a trainer from before the reason was recorded
    assert "| numerics | fp32, contiguous |" in render_lineage_markdown({**lineage, "training": {"numerics": older}})


def test_an_elastic_runs_curve_marks_where_its_worker_count_changed() -> None:
    steps = [{"event": "step", "step": step, "loss": 1.0 / step, "lr": 0.1, "workers": workers}
             for step, workers in ((10, 2), (20, 2), (30, 1), (40, 1), (50, 2))]
    assert world_changes(steps) == [(30, 1), (50, 2)]
    assert world_changes(STEPS) == []  # a fixed run's steps carry no count
    plain = cv2.imdecode(np.frombuffer(training_curve_png([{**s, "workers": 2} for s in steps], "run"), np.uint8),
                         cv2.IMREAD_COLOR)
    marked = cv2.imdecode(np.frombuffer(training_curve_png(steps, "run"), np.uint8), cv2.IMREAD_COLOR)
    assert colour_pixels(marked, (127, 127, 127)) > colour_pixels(plain, (127, 127, 127)) + 50  # the markers


def culane_evaluation() -> dict:
    """What the evaluation of a CULane test split returns (``training.evaluate_culane.culane_result``): normal
    frames scored well, night frames badly, the crossroads with two false positives."""
    from training.culane_eval import ListScore
    from training.culane_metric import THRESHOLDS, Counts
    from training.evaluate_culane import culane_result

    def scored(images: int, at_half: Counts, strict: Counts) -> ListScore:  # strict: IoU above 0.5
        return ListScore(images, {t: at_half if t == 0.5 else strict for t in THRESHOLDS})

    normal = scored(4, Counts(tp=9, fp=1, fn=1), Counts(tp=6, fp=4, fn=4))
    night = scored(3, Counts(tp=1, fp=3, fn=3), Counts(tp=0, fp=4, fn=4))
    cross = scored(2, Counts(fp=2), Counts(fp=2))
    scores = {"normal": normal, "night": night, "cross": cross}
    return culane_result("test", {**scores, "all": normal + night + cross})


def test_a_culane_runs_metrics_table_says_f1_precision_recall_and_each_scenario() -> None:
    rows = metrics_rows({"steps": 30}, culane_evaluation(), STEPS)
    table = {row["metric"]: row["value"] for row in rows}
    # Over all lists: TP 10, FP 6, FN 4 at IoU 0.5 -> precision 10/16, recall 10/14, F1 20/30.
    assert table["test F1 (official, IoU 0.5; model selection)"] == round(20 / 30, 4)
    assert table["test precision"] == round(10 / 16, 4) and table["test recall"] == round(10 / 14, 4)
    assert table["test F1 at IoU 0.75"] == round(12 / 30, 4)  # TP 6, FP 10, FN 8 above 0.5
    assert table["test mean F1 (IoU 0.5:0.95)"] == round((20 / 30 + 9 * 12 / 30) / 10, 4)
    assert (table["test true positive lanes"], table["test false positive lanes"], table["test missed lanes"]) == \
        (10, 6, 4)
    assert table["test normal F1"] == 0.9 and table["test night F1"] == 0.25
    assert table["test cross false positive lanes (no lanes to find)"] == 2 and "test cross F1" not in table
    assert table["test images"] == 9 and table["steps"] == 30
    # Nothing of TuSimple's: CULane's fp is 1 - precision, not a false-positive rate, and it has no run-time rule.
    assert not [name for name in table if "accuracy" in name or "FP" in name or "200 ms" in name]
    assert metrics_description(culane_evaluation(), "train-1") == "CULane metrics and training summary of train-1"
    tusimple = {"split": "test", "accuracy": 0.9, "fp": 0.1, "fn": 0.2}
    assert metrics_description(tusimple, "train-1") == "TuSimple metrics and training summary of train-1"


def test_a_culane_scenario_without_anything_to_count_says_so() -> None:
    evaluation = {**culane_evaluation(), "scenarios": {"arrow": {"tp": 0, "fp": 0, "fn": 0, "f1": None}}}
    table = {row["metric"]: row["value"] for row in metrics_rows({}, evaluation, [])}
    assert table["test arrow F1"] == "undefined (nothing to count)"


def test_a_culane_package_shows_its_f1_not_an_accuracy() -> None:
    lineage = {"run": "train-1", "dataset_version": "dv1", "metrics": culane_evaluation()}
    package = {"package": "runs/train-1/package", "parity": {"backends": {}}}
    text = render_package_markdown(package, "culane", lineage)
    assert f"| test F1 (official, IoU 0.5) | {20 / 30:.4f} |" in text and "accuracy" not in text
    tusimple = render_package_markdown(package, "v", {**lineage, "metrics": {"split": "test", "accuracy": 0.9,
                                                                            "untimed_accuracy": 0.95}})
    assert "| test accuracy (official) | 0.9000 |" in tusimple
    assert "| test accuracy without the 200 ms rule | 0.9500 |" in tusimple


def test_lineage_names_the_dataset_beside_its_version() -> None:
    common = {"run": "train-1", "flow_run_id": "f", "flow_run_name": "happy-fox", "platform": "local",
              "volume": "v", "code": "git:abc", "parameters": {}, "training": {}, "snapshot": None}
    dataset = {"dataset_version": "dv1", "counts": {"read": 9, "kept": 9, "quarantined": 0}}
    culane = build_lineage(**common, dataset=dataset, evaluation=culane_evaluation())
    assert culane["dataset"] == "culane" and culane["dataset_version"] == "dv1"
    assert "| dataset | culane |\n| dataset version | `dv1` |" in render_lineage_markdown(culane)
    assert dataset_label(culane) == "culane dv1"
    tusimple = build_lineage(**common, dataset=dataset, evaluation={"split": "test", "accuracy": 0.9})
    assert tusimple["dataset"] == "tusimple" and "| dataset | tusimple |" in render_lineage_markdown(tusimple)
    # A preparation that names its dataset is taken at its word.
    assert build_lineage(**common, dataset={**dataset, "dataset": "culane"}, evaluation={})["dataset"] == "culane"
    # A record from before the name was kept renders as it did.
    older = {key: value for key, value in tusimple.items() if key != "dataset"}
    assert "| dataset |" not in render_lineage_markdown(older) and dataset_label(older) == "dv1"
