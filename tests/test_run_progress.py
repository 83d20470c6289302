"""What ``laneflow run`` shows while a run goes on, from the run's state, running tasks and log lines; and how
it reads ``--set KEY=VALUE``."""

from __future__ import annotations

import pytest

from flows.run_progress import OverrideError, Progress, advance, metrics_summary, parse_overrides, render


def test_set_values_read_as_json_where_they_are_json_else_as_typed() -> None:
    assert parse_overrides(["epochs=2", "lr=0.02", "package=false", 'grid={"lr": [0.02, 0.05]}', "volume=demo",
                            "run_key=a=b"]) == {"epochs": 2, "lr": 0.02, "package": False,
                                                 "grid": {"lr": [0.02, 0.05]}, "volume": "demo", "run_key": "a=b"}
    for bad in ("epochs", "=2", ""):
        with pytest.raises(OverrideError, match=r"expected KEY=VALUE, e.g. --set epochs=2"):
            parse_overrides([bad])


def test_progress_follows_the_stage_and_the_training_lines() -> None:
    # The lines as tasks.pipeline.wait_for_training logs them.
    started = "training started at step 0 of 40 on 2 worker(s)"
    line_format = "step %s: loss %.4f, lr %.4g, %.1f img/s, input stall %.0f%%%s"  # the logger call's, as it is
    step = line_format % (12, 0.4321, 0.05, 58.24, 3.0, "")
    progress = advance(Progress(), "Running", ["prepare-dataset-demo"], [])
    assert render(progress) == "Running     prepare-dataset-demo"
    progress = advance(progress, "Running", ["wait-for-training-x"], [started, "something else", step])
    assert (progress.step, progress.total) == (12, 40)
    assert progress.loss == pytest.approx(0.4321) and progress.img_per_s == pytest.approx(58.2)
    line = render(progress)
    assert "[#######.................] step 12/40" in line and "loss 0.4321" in line and "58.2 img/s" in line
    # No task running between stages: the last stage stays shown; the state follows the run.
    assert advance(progress, "Completed", [], []).stage == "wait-for-training-x"
    assert render(advance(progress, "Completed", [], [])).startswith("Completed ")


def test_the_summary_lists_the_metrics_table_rows() -> None:
    rows = [{"metric": "test accuracy (official)", "value": 0.8123}, {"metric": "steps", "value": 40}]
    assert metrics_summary(rows) == ["test accuracy (official): 0.8123", "steps: 40"]


def test_a_key_the_deployment_has_no_parameter_for_is_named_with_the_nearest_ones() -> None:
    from flows.run_progress import unknown_parameters

    schema = {"properties": {"epochs": {}, "lr": {}, "max_steps": {}, "workers": {}}}
    assert unknown_parameters({"epochs": 2, "lr": 0.1}, schema) is None
    said = unknown_parameters({"epoch": 2, "max_step": 3, "zzz": 1}, schema)
    assert said.startswith("no parameter 'epoch' (did you mean epochs?), 'max_step' (did you mean max_steps?), "
                           "'zzz': the deployment's parameters are epochs, lr, max_steps, workers"), said
    assert unknown_parameters({"anything": 1}, {}) is None  # no schema to judge by: the server decides


def test_a_key_of_this_laneflow_that_the_deployment_predates_says_to_apply_it_again() -> None:
    from flows.run_command import _flow_parameters
    from flows.run_progress import unknown_parameters

    old_schema = {"properties": {"epochs": {}, "model": {}}}  # applied before model_settings existed
    current = frozenset(_flow_parameters("train_pipeline/train"))
    assert "model_settings" in current and "epochs" in current
    said = unknown_parameters({"model_settings": {"cells": 50}}, old_schema, current)
    assert said == ("the deployment predates the parameter 'model_settings' of this laneflow: apply prefect.yaml's "
                    "deployments again (laneflow deploy) where it was applied"), said
    assert unknown_parameters({"epoch": 2}, old_schema, current).startswith("no parameter 'epoch' (did you mean")
