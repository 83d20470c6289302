"""MLflow tracking and registry (tasks.tracking): the pure helpers, a nightly run tracked on a real MLflow
server and registered as champion, and a tracking server that is down costing one warning, never the run."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest

from tasks import tracking
from tasks.registry import DECISION_ARTIFACT
from tasks.tracking import (
    HTTP_DEFAULTS,
    TRACKING_URI_ENV,
    TRACKING_URI_VARIABLE,
    evaluation_metrics,
    flatten_params,
    model_version_url,
    registered_model_name,
    run_params,
    run_tags,
    run_url,
    step_metrics,
    training_metrics,
)
from tests.http_server import FileServer
from tests.mlflow_server import MlflowServer, mlflow_server, server_missing
from tests.test_flows import latest_artifact
from tests.test_pipeline import params_for, served_culane, task_runs

#: One worker runs this module: its tests share the MLflow server that mlflow_booting starts.
pytestmark = pytest.mark.xdist_group("mlflow")

# --- pure helpers ----------------------------------------------------------------------------------------


def test_parameters_flatten_to_mlflow_strings_as_the_lineage_reads_them() -> None:
    parameters = {"lr": 0.05, "epochs": 3, "snapshot": True, "weights": None, "preset": "cpu-demo",
                  "grid": [1, 2], "nested": {"a": {"b": 1}}, "empty": {},
                  "source_artifacts": [{"url": "file:///a/train_set.zip", "sha256": "ab", "kind": "archive"},
                                       {"url": "https://m/test_label.json", "sha256": "cd", "kind": "file"}]}
    assert flatten_params(parameters) == {
        "lr": "0.05", "epochs": "3", "snapshot": "true", "weights": "null", "preset": "cpu-demo", "grid": "[1, 2]",
        "nested.a.b": "1", "empty": "{}",
        "source_artifacts.0.url": "file:///a/train_set.zip", "source_artifacts.0.sha256": "ab",
        "source_artifacts.0.kind": "archive", "source_artifacts.1.url": "https://m/test_label.json",
        "source_artifacts.1.sha256": "cd", "source_artifacts.1.kind": "file"}
    # MLflow's limits: keys of its alphabet and at most 250 characters, values at most 6000.
    odd = flatten_params({"what?*": "x" * 7000, "k" * 300: 1})
    assert odd["what__"] == "x" * 6000 and "k" * 250 in odd


def test_the_model_trained_and_its_settings_are_parameters_of_the_run() -> None:
    lineage = {"parameters": {"model": "ufld", "model_settings": {"cells": 32}, "lr": 0.05},
               "training": {"model": {"name": "ufld", "settings": {"cells": 32, "backbone": "resnet18",
                                                                    "anchor_top": 0.25}},
                            "numerics": {"precision": "fp32"}}}
    params = run_params(lineage)
    assert params["model"] == "ufld" and params["model_settings.cells"] == "32"  # what the run asked
    assert {key: value for key, value in params.items() if key.startswith("model.")} == {  # what it trained
        "model.name": "ufld", "model.settings.cells": "32", "model.settings.backbone": "resnet18",
        "model.settings.anchor_top": "0.25"}
    assert params["numerics.precision"] == "fp32"
    # A record from before the trainer named its model has no model parameters beyond what the run asked.
    assert not any(key.startswith("model.") for key in run_params({"parameters": {"model": "scnn"}}))


def test_step_metrics_follow_the_events_at_their_steps_and_a_resumed_step_counts_once() -> None:
    events = [
        {"event": "start", "step": 0, "total_steps": 20},
        {"event": "step", "step": 10, "loss": 2.0, "lr": 0.1, "img_per_s": 5.0, "input_stall": 0.25},
        {"event": "val", "step": 10, "accuracy": 0.1, "untimed_accuracy": 0.2, "fp": 0.3, "fn": 0.4},
        {"event": "checkpoint", "step": 10, "path": "x"},
        {"event": "start", "step": 10, "total_steps": 20, "resumed": True},  # a resumed attempt logs 20 again
        {"event": "step", "step": 20, "loss": 9.0, "lr": 0.05, "img_per_s": 4.0, "input_stall": 0.5},
        {"event": "step", "step": 20, "loss": 1.0, "lr": 0.05, "img_per_s": 6.0, "input_stall": 0.0},
        {"event": "val", "step": 20, "accuracy": 0.5, "untimed_accuracy": 0.6, "fp": 0.1, "fn": 0.2},
        {"event": "eval", "split": "val", "accuracy": 0.5},  # the trainer's own: the evaluate stage's is logged
    ]
    points = step_metrics(events)
    assert [p for p in points if p[0] == "train/loss"] == [("train/loss", 2.0, 10), ("train/loss", 1.0, 20)]
    assert [p for p in points if p[0] == "train/images_per_second"] == [("train/images_per_second", 5.0, 10),
                                                                        ("train/images_per_second", 6.0, 20)]
    assert ("train/input_stall", 0.25, 10) in points and ("train/lr", 0.05, 20) in points
    assert [p for p in points if p[0] == "val/untimed_accuracy"] == [("val/untimed_accuracy", 0.2, 10),
                                                                     ("val/untimed_accuracy", 0.6, 20)]
    assert {name for name, _, _ in points} == {"train/loss", "train/lr", "train/images_per_second",
                                               "train/input_stall", "val/accuracy", "val/untimed_accuracy",
                                               "val/fp", "val/fn"}


def test_metric_names_are_tensorboards() -> None:
    from training.tensorboard_log import SCORE_SCALARS, TRAIN_SCALARS

    assert TRAIN_SCALARS.items() <= tracking.STEP_METRICS.items()
    assert tracking.SCORE_METRICS == SCORE_SCALARS


def test_evaluation_and_training_metrics_sit_at_the_last_step_under_the_split() -> None:
    evaluation = {"split": "test", "accuracy": 0.5, "untimed_accuracy": 0.75, "fp": 0.1, "fn": 0.2, "images": 3,
                  "over_time_limit": 0, "flag": True, "note": "x"}
    assert evaluation_metrics(evaluation, 20) == [
        ("test/accuracy", 0.5, 20), ("test/untimed_accuracy", 0.75, 20), ("test/fp", 0.1, 20), ("test/fn", 0.2, 20),
        ("test/images", 3.0, 20), ("test/over_time_limit", 0.0, 20)]
    culane = {"split": "test", "metric": "culane", "accuracy": 0.6, "images": 9,
              "scenarios": {"night": {"f1": 0.4, "fp": 3}, "cross": {"f1": 0.0, "fp": 2}, "noline": {"f1": None}}}
    assert evaluation_metrics(culane, 5) == [("test/accuracy", 0.6, 5), ("test/images", 9.0, 5),
                                             ("test/night/f1", 0.4, 5), ("test/cross/fp", 2.0, 5)]
    assert training_metrics({"steps": 20, "duration_s": 12.5, "resumed_from": 0, "trainer_eval": {}}) == [
        ("training/duration_s", 12.5, 20), ("training/resumed_from", 0.0, 20)]


def test_tags_and_links_find_the_run_from_laneflow_prefect_and_mlflow() -> None:
    lineage = {"run": "train-abc", "flow_run_id": "f1", "flow_run_name": "brave-fox", "volume": "v",
               "platform": "local", "dataset_version": "d1", "code_version": "git:1", "snapshot": None,
               "package": "runs/train-abc/package", "metrics": {"accuracy": 0.5}, "parameters": {"lr": 0.1}}
    tags = run_tags({**lineage, "dataset": "culane"}, "http://127.0.0.1:4200/")
    assert tags["laneflow.dataset"] == "culane"
    # A record from before lineage named the dataset: the evaluation's metric says which.
    assert run_tags({**lineage, "metrics": {"metric": "culane", "accuracy": 0.5}})["laneflow.dataset"] == "culane"
    assert "laneflow.dataset" not in run_tags({**lineage, "metrics": {}})  # never scored: unknown
    tags = run_tags(lineage, "http://127.0.0.1:4200/")
    assert tags["laneflow.dataset"] == "tusimple"
    assert tags["laneflow.run"] == "train-abc" and tags["prefect.flow_run_id"] == "f1"
    assert tags["laneflow.dataset_version"] == "d1" and "laneflow.snapshot" not in tags
    assert tags["laneflow.package"] == "runs/train-abc/package on volume v"
    assert tags["prefect.flow_run_url"] == "http://127.0.0.1:4200/runs/flow-run/f1"
    assert tags["mlflow.note.content"].startswith("# Lineage of `train-abc`")
    assert run_url("http://m:5000/", "3", "r1") == "http://m:5000/#/experiments/3/runs/r1"
    assert run_url("sqlite:///tmp/m.db", "3", "r1") is None  # no UI behind a database
    assert model_version_url("https://m", "laneflow-v", "2") == "https://m/#/models/laneflow-v/versions/2"
    assert registered_model_name("v") == tracking.experiment_name("v") == "laneflow-v"


def test_the_environment_setting_wins_and_an_empty_one_turns_tracking_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACKING_URI_ENV, " http://m:5000 ")
    assert tracking.tracking_uri() == "http://m:5000"  # the Prefect variable is not even read
    monkeypatch.setenv(TRACKING_URI_ENV, "")
    assert tracking.tracking_uri() is None


def test_a_uri_without_mlflow_installed_is_one_warning_naming_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    for name, value in HTTP_DEFAULTS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # what importing it does without the extra
    logger = logging.getLogger("test.tracking")
    with caplog.at_level(logging.WARNING, logger="test.tracking"):
        assert tracking.load_client("http://m:5000", logger) is None
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "pip install 'laneflow[mlflow]'" in caplog.text and "http://m:5000" in caplog.text


# --- against a real MLflow server and a real Prefect server ---------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def mlflow_booting(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[MlflowServer | None]:
    """The MLflow server, started when this module's tests begin and left to boot (10-30 s on two cores)
    while the tests before the one that needs it run; None when no selected test needs it or it cannot
    start here."""
    needed = any("mlflow" in item.fixturenames for item in request.session.items
                 if item.module is request.module)
    if not needed or server_missing() is not None:
        yield None
        return
    with mlflow_server(tmp_path_factory.mktemp("mlflow"), wait=False) as server:
        yield server


@pytest.fixture
def mlflow(mlflow_booting: MlflowServer | None) -> MlflowServer:
    """A healthy MLflow server, or a skip saying why there is none."""
    if mlflow_booting is None:
        pytest.skip(server_missing() or "the MLflow server was not started")
    return mlflow_booting.wait_until_healthy()


@pytest.fixture
def short_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's HTTP defaults, set as tracking sets them, and gone after the test."""
    for name, value in HTTP_DEFAULTS.items():
        monkeypatch.setenv(name, value)


def flow_run_warnings(flow_run_id: UUID) -> list[str]:
    """Every WARNING-or-above line of a flow run (its tasks' included), as the UI shows them."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]),
                                                     level=LogFilterLevel(ge_=30)))
    return [log.message for log in logs]


@pytest.mark.slow
def test_a_tracking_server_that_is_down_costs_one_warning_and_the_run_completes(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], short_http: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Set from the UI (the Prefect variable), pointing at a port nobody listens on."""
    from prefect.variables import Variable

    from flows.local_server import free_port
    from flows.train import train_pipeline

    monkeypatch.delenv(TRACKING_URI_ENV, raising=False)
    uri = f"http://127.0.0.1:{free_port()}"
    Variable.set(TRACKING_URI_VARIABLE, uri, overwrite=True)
    try:
        state = train_pipeline(**params_for(synthetic_archive, volume="untracked", workers=1, max_steps=1,
                                            snapshot=False), return_state=True)
    finally:
        Variable.unset(TRACKING_URI_VARIABLE)
    assert state.is_completed(), state.message
    assert state.result()["mlflow"] is None
    flow_run_id = state.state_details.flow_run_id
    warnings = [message for message in flow_run_warnings(flow_run_id) if "mlflow" in message.lower()]
    assert len(warnings) == 1, warnings
    assert uri in warnings[0] and "training is unaffected" in warnings[0] and "Connection refused" in warnings[0]
    (tracked,) = task_runs(flow_run_id)["track_in_mlflow"]  # tried once: never retried
    assert tracked.state.is_completed() and tracked.run_count == 1
    assert tracked.total_run_time.total_seconds() < 20, tracked.total_run_time  # seconds, not MLflow's minutes


@pytest.mark.slow
def test_nightly_tracks_the_challenger_and_makes_it_the_registered_champion(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], mlflow: MlflowServer,
        short_http: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.variables import Variable

    from flows.cli import champion_command
    from flows.nightly import nightly_retrain
    from tasks.champion import champion_variable

    monkeypatch.setenv(TRACKING_URI_ENV, mlflow.uri)
    # The nightly reads the data team's index and trains on its newest version (an older one is listed first).
    archive, sha256 = synthetic_archive
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"datasets": [
        {"version": "2030-01-02", "published": "2030-01-02T00:00:00+00:00",
         "artifacts": [{"url": archive.as_uri(), "sha256": sha256, "kind": "archive"}]},
        {"version": "2030-01-01", "published": "2030-01-01T00:00:00Z",
         "artifacts": [{"url": (tmp_path / "gone.zip").as_uri(), "sha256": "0" * 64}]}]}))
    result = nightly_retrain(**{**params_for(synthetic_archive, volume="tracked", workers=1, epochs=5, max_steps=20,
                                             eval_every=10, snapshot=False, package=True),
                                "source": {"index": index.as_uri()}})
    challenger = result["challenger"]
    assert result["promoted"] and challenger["mlflow"] is not None
    tracked = challenger["mlflow"]
    client = MlflowClient(tracking_uri=mlflow.uri)
    run = client.get_run(tracked["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == challenger["run"]
    assert client.get_experiment(run.info.experiment_id).name == "laneflow-tracked"
    assert tracked["url"] == f"{mlflow.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    tags = run.data.tags
    assert tags["laneflow.run"] == challenger["run"] and tags["prefect.flow_run_id"] == challenger["flow_run_id"]
    assert tags["laneflow.dataset_version"] == challenger["dataset_version"]

    params = run.data.params
    assert params["lr"] == "0.05" and params["batch_size"] == "2" and params["max_steps"] == "20"
    assert params["source_artifacts.0.sha256"] == synthetic_archive[1]

    run_dir = laneflow_home / "volumes" / "tracked" / challenger["run_dir"]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # What precision=auto became on this machine, as the trainer said when it started (it differs by CPU).
    start = next(e for e in events if e["event"] == "start")
    assert params["precision"] == "auto" and start["precision"] in ("fp32", "bf16")
    assert {key: params[f"numerics.{key}"] for key in ("precision", "memory_format", "compile")} == {
        "precision": start["precision"], "memory_format": start["memory_format"], "compile": "false"}
    assert params["numerics.numerics_reason"] == start["numerics_reason"]
    # The model it trained and every one of its settings, as the trainer built them (cpu-demo's SCNN).
    assert params["model"] == "scnn" and params["model.name"] == "scnn" and tags["laneflow.dataset"] == "tusimple"
    from training.models import get_model

    trained = dataclasses.asdict(get_model("scnn").settings("cpu-demo"))
    assert {key: params[f"model.settings.{key}"] for key in trained} == {
        key: json.dumps(list(value) if isinstance(value, tuple) else value) for key, value in trained.items()}

    # Step metrics: the run's own metrics.jsonl, value for value, step for step.
    steps = [e for e in events if e["event"] == "step"]
    vals = [e for e in events if e["event"] == "val"]
    assert [e["step"] for e in steps] == [10, 20] and [e["step"] for e in vals] == [10]  # the end: an eval event
    for metric, field, source in (("train/loss", "loss", steps), ("train/lr", "lr", steps),
                                  ("train/images_per_second", "img_per_s", steps),
                                  ("val/untimed_accuracy", "untimed_accuracy", vals)):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric))
        assert history == [(e["step"], pytest.approx(e[field])) for e in source], metric
    metrics = challenger["metrics"]
    assert run.data.metrics["test/accuracy"] == pytest.approx(metrics["accuracy"])
    assert run.data.metrics["test/untimed_accuracy"] == pytest.approx(metrics["untimed_accuracy"])

    lineage = json.loads(Path(client.download_artifacts(run.info.run_id, "lineage.json", str(tmp_path))).read_text())
    assert lineage["run"] == challenger["run"] and lineage["package"] == challenger["package"]
    assert lineage["dataset_release"] == {"index": index.as_uri(), "version": "2030-01-02",
                                          "published": "2030-01-02T00:00:00+00:00"}
    assert [artifact["sha256"] for artifact in lineage["artifacts"]] == [sha256]
    uploaded = {Path(item.path).name for item in client.list_artifacts(run.info.run_id, "package")}
    on_volume = {path.name for path in (laneflow_home / "volumes" / "tracked" / challenger["package"]).iterdir()}
    assert "model.onnx" in uploaded and uploaded == on_volume

    # The registry: a version of laneflow-tracked from this run's package, aliased champion.
    version = client.get_model_version_by_alias("laneflow-tracked", "champion")
    assert version.run_id == run.info.run_id and version.source == f"runs:/{run.info.run_id}/package"
    assert result["mlflow"]["version"] == version.version
    record = Variable.get(champion_variable("tracked"))
    assert record["mlflow"]["version"] == version.version and record["mlflow"]["run_id"] == run.info.run_id
    link = f"{mlflow.uri}/#/models/laneflow-tracked/versions/{version.version}"
    assert record["mlflow"]["model_url"] == link

    capsys.readouterr()
    assert champion_command("tracked", "local") == 0
    shown = capsys.readouterr().out
    assert f"mlflow      : {link} (laneflow-tracked version {version.version}, alias champion" in shown
    assert tracked["url"] in shown


@pytest.mark.slow
def test_a_registry_that_was_down_at_a_promotion_follows_the_champion_the_next_night_it_answers(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], mlflow: MlflowServer,
        short_http: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.variables import Variable

    from flows.local_server import free_port
    from flows.nightly import nightly_retrain
    from tasks.champion import champion_variable
    from training.package import load_package

    name, client = registered_model_name("resync"), MlflowClient(tracking_uri=mlflow.uri)
    # Scored on val only (the nightly decides on val: one evaluation per night, not two).
    nightly = params_for(synthetic_archive, volume="resync", workers=1, max_steps=2, snapshot=False, package=True,
                         eval_split="val")
    monkeypatch.setenv(TRACKING_URI_ENV, mlflow.uri)
    first = nightly_retrain(**nightly)
    assert first["promoted"] and client.get_model_version_by_alias(name, "champion").run_id == \
        first["challenger"]["mlflow"]["run_id"]

    # The server is unreachable all night: the challenger trains untracked and is crowned in Prefect only.
    monkeypatch.setenv(TRACKING_URI_ENV, f"http://127.0.0.1:{free_port()}")
    second = nightly_retrain(**nightly, min_improvement=-1.0, gate_margin=1.0)  # any challenger wins
    assert second["promoted"] and second["challenger"]["mlflow"] is None and second["mlflow"] is None
    assert Variable.get(champion_variable("resync"))["run"] == second["challenger"]["run"]
    assert client.get_model_version_by_alias(name, "champion").run_id == first["challenger"]["mlflow"]["run_id"]

    # It answers again: the next nightly keeps the champion and brings @champion in line with it.
    monkeypatch.setenv(TRACKING_URI_ENV, mlflow.uri)
    third = nightly_retrain(**{**nightly, "package": False}, min_improvement=1.0)  # (a challenger that loses)
    assert not third["promoted"] and third["champion"] == second["challenger"]["run"]
    tags = client.get_run(third["challenger"]["mlflow"]["run_id"]).data.tags
    assert tags["laneflow.champion.decision"] == "kept"
    assert tags["laneflow.champion.against"] == second["challenger"]["run"]
    assert tags["laneflow.release_gates"] == "not scored: the challenger did not win on val (the gates only refuse)"
    version = client.get_model_version_by_alias(name, "champion")
    run = client.get_run(version.run_id)
    assert run.info.run_name == second["challenger"]["run"] and run.info.status == "FINISHED"
    assert run.data.tags["prefect.flow_run_id"] == second["challenger"]["flow_run_id"]
    record = Variable.get(champion_variable("resync"))
    assert record["run"] == second["challenger"]["run"] and record["mlflow"]["version"] == version.version
    # The version is a loadable model package, the very files the run packaged on its volume.
    assert version.source == f"runs:/{version.run_id}/package"
    downloaded = Path(client.download_artifacts(version.run_id, "package", str(tmp_path)))
    package = load_package(downloaded)
    on_volume = load_package(laneflow_home / "volumes" / "resync" / second["challenger"]["package"])
    assert package.manifest["files"] == on_volume.manifest["files"]


def better_at_night(record: dict) -> dict:
    """A CULane champion's record made worse on val but perfect at night (and unbeatable at the crossroads): a
    challenger better on average falls behind it on ``night`` by more than any margin."""
    return {**record, "val_metrics": {**record["val_metrics"], "accuracy": 0.0, "untimed_accuracy": 0.0},
            "metrics": {**record["metrics"], "scenarios": {
                name: {**figures, "f1": None if name == "cross" else float(name == "night"),
                       "fp": 10 ** 6 if name == "cross" else figures["fp"]}
                for name, figures in record["metrics"]["scenarios"].items()}}}


@pytest.mark.slow
def test_a_culane_nightly_refuses_a_challenger_better_on_val_that_falls_behind_at_night(
        prefect_server: dict, laneflow_home: Path, file_server: FileServer, mlflow: MlflowServer,
        short_http: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The release gates on CULane: a challenger that wins on val is refused because its night F1 is more than
    the margin below the champion's, and the decision and every gate are in the UI and on the challenger's
    MLflow run. The champion's record is edited into a model that was better at night and no better anywhere
    else (worse on val, F1 0 on every other scenario, the crossroads full of false positives): training such a
    model on demand is not deterministic, and the nightly reads exactly this record."""
    from mlflow.tracking import MlflowClient
    from prefect.variables import Variable

    from flows.nightly import nightly_retrain
    from flows.params import TrainParams
    from tasks.champion import champion_variable

    volume, variable = "culane-nightly", champion_variable("culane-nightly")
    source = served_culane(file_server, tmp_path)
    base = {"epochs": 1, "batch_size": 2, "workers": 1, "loader_workers": 0, "volume": volume, "snapshot": False}
    monkeypatch.setenv(TRACKING_URI_ENV, mlflow.uri)
    client = MlflowClient(tracking_uri=mlflow.uri)
    try:
        first = nightly_retrain(**TrainParams(source=source, **base).flow_parameters())
        assert first["promoted"] and first["gates"] == []  # no champion: nothing to fall behind
        tags = client.get_run(first["challenger"]["mlflow"]["run_id"]).data.tags
        assert (tags["laneflow.champion.decision"], tags["laneflow.release_gates"]) == (
            "promoted", "not scored: no champion yet")
        record = Variable.get(variable)
        Variable.set(variable, better_at_night(record), overwrite=True)
        second = nightly_retrain(**TrainParams(source=source, **base).flow_parameters(), min_improvement=-0.5)
        night = second["challenger"]["metrics"]["scenarios"]["night"]["f1"]
        assert night is not None and night < 0.98, night  # the premise: short of the champion's 1.0 by the margin
        assert not second["promoted"] and second["reason"].endswith("champion kept"), second["reason"]
        assert "F1 improved" in second["reason"] and f"night F1 1.0000 -> {night:.4f}" in second["reason"]
        assert [gate["figure"] for gate in second["gates"] if not gate["passed"]] == ["night F1"]
        assert Variable.get(variable)["run"] == first["challenger"]["run"]
        table = latest_artifact(f"champion-gates-{volume}")
        rows = json.loads(table) if isinstance(table, str) else table
        assert {row["figure"]: row["passed"] for row in rows}["night F1"] is False and len(rows) == len(second["gates"])
        decision = latest_artifact(f"champion-{volume}")
        assert "failed: night F1" in decision and "CULane's F1 at IoU 0.5" in decision
        # MLflow: the refused challenger's run says so, searchably, with every gate's figures beside it.
        run_id = second["challenger"]["mlflow"]["run_id"]
        (found,) = client.search_runs([client.get_run(run_id).info.experiment_id],
                                      "tags.`laneflow.champion.decision` = 'kept'")
        assert found.info.run_id == run_id and found.data.metrics["test/night/f1"] == pytest.approx(night)
        assert found.data.tags["laneflow.champion.against"] == first["challenger"]["run"]
        assert found.data.tags["laneflow.release_gates"].endswith("; failed: night F1")
        assert "night F1 1.0000 -> " in found.data.tags["laneflow.champion.reason"]
        recorded = json.loads(Path(client.download_artifacts(run_id, DECISION_ARTIFACT, str(tmp_path))).read_text())
        assert recorded["promoted"] is False and recorded["gates"] == rows
    finally:
        Variable.unset(variable)
