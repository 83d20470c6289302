"""A run's reports: step and validation series, the training curve, metrics rows, thumbnails and lineage."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from flows.params import TrainParams
from tasks.lineage import build_lineage, render_lineage_markdown
from tasks.report import eval_series, metrics_rows, step_series, thumbnail_jpeg, training_curve_png, world_changes
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
