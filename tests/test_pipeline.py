"""The whole train_pipeline on the local platform: real Prefect server, real horovodrun -np 2, real files."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

from flows.params import DataSource, TrainParams
from flows.predict import predict as predict_flow
from flows.train import train_pipeline
from tasks.processes import run_to_end
from tests.http_server import FileServer
from training.culane_metric import SCENARIOS
from training.data.synthetic_culane import generate, pack_artifacts

pytestmark = pytest.mark.slow


def params_for(archive: tuple[Path | str, str], **changes: object) -> dict[str, object]:
    """The flows' keyword arguments for a small run on ``archive`` (a file or a URL, and its sha256);
    validated here, so a test's typo fails early."""
    path, sha256 = archive
    url = path if isinstance(path, str) else path.as_uri()
    # Packaging (export + parity, seconds per run) is on only where a test is about it.
    base = {"source": DataSource(url=url, sha256=sha256), "epochs": 1, "batch_size": 2, "workers": 2,
            "loader_workers": 0, "volume": "pipeline", "package": False}
    return TrainParams(**{**base, **changes}).flow_parameters()


def task_runs(flow_run_id: UUID) -> dict[str, list]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    by_name: dict[str, list] = {}
    for run in runs:
        by_name.setdefault(run.task_key.rsplit("-", 1)[0], []).append(run)
    return by_name


def artifact_keys(flow_run_id: UUID) -> set[str]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))
    return {artifact.key for artifact in found if artifact.key}


def laneflow_events(timeout_s: float = 60.0) -> set[str]:
    """Names of the ``laneflow.*`` events the server has stored (it persists them in batches)."""
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30)
    deadline, names = time.monotonic() + timeout_s, set()
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["laneflow."])), limit=50)
            names = {event.event for event in page.events}
            if {"laneflow.snapshot.created", "laneflow.training.finished"} <= names:
                break
            time.sleep(1)
    return names


def test_pipeline_end_to_end_then_cached_dataset(prefect_server: dict, laneflow_home: Path,
                                                 synthetic_archive: tuple[Path, str],
                                                 synthetic_artifacts: list[dict]) -> None:
    # The dataset as TuSimple ships it: train_set.zip, test_set.zip and test_label.json.
    source = DataSource(artifacts=synthetic_artifacts)
    state = train_pipeline(**params_for(synthetic_archive, source=source, package=True), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    flow_run_id = state.state_details.flow_run_id

    runs = task_runs(flow_run_id)
    expected = {"ensure_dataset_volume", "promote_service_level", "prepare_dataset", "ensure_shared_access",
                "submit_training", "wait_for_training", "evaluate", "package_model", "capture_snapshot",
                "publish_artifacts", "demote_service_level"}
    assert expected <= set(runs), sorted(runs)
    assert all(run.state.is_completed() for stage in runs.values() for run in stage)

    run = result["run"]
    assert run == f"train-{flow_run_id.hex[:12]}"  # named after the flow run: a retry finds the same run
    assert {f"metrics-{run}", f"curve-{run}", f"lineage-{run}", f"predictions-{run}", f"package-{run}"} <= \
        artifact_keys(flow_run_id)
    assert result["package"] == f"runs/{run}/package"

    snapshot = laneflow_home / "snapshots" / result["snapshot"]
    lineage = json.loads((snapshot / "lineage.json").read_text())
    assert lineage["ready"] is True and lineage["run"] == run
    assert lineage["dataset_version"] == result["dataset_version"]
    assert [a["name"] for a in lineage["artifacts"]] == ["train_set.zip", "test_set.zip", "test_label.json"]
    assert result["metrics"]["split"] == "test" and result["metrics"]["images"] == 3  # test images from test_set.zip
    assert lineage["metrics"]["accuracy"] == result["metrics"]["accuracy"]
    assert lineage["code_version"].startswith(("git:", "laneflow=="))
    assert (snapshot / "content" / "runs" / run / "model.pt").is_file()
    assert (snapshot / "content" / "runs" / run / "package" / "model.onnx").is_file()  # the snapshot carries it
    assert lineage["package"] == result["package"]
    assert (snapshot / "content" / result["data_dir"] / "manifest.json").is_file()
    assert result["dataset_steps"] == {"downloaded": True, "extracted": True, "preprocessed": True}

    # The CLI prints the same lineage for the snapshot and (from the run's artifact) for the run.
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home)}
    laneflow = str(Path(sys.executable).parent / "laneflow")
    for name in (result["snapshot"], run):
        shown = run_to_end([laneflow, "lineage", name], 600, env=env)
        assert shown.returncode == 0, shown.stderr
        assert f"# Lineage of `{run}`" in shown.stdout and result["dataset_version"] in shown.stdout
    missing = run_to_end([laneflow, "lineage", "no-such-run"], 600, env=env)
    assert missing.returncode == 1 and "no run named 'no-such-run'" in missing.stderr

    assert {"laneflow.snapshot.created", "laneflow.training.finished"} <= laneflow_events()

    # The run's package on the volume, by run name, through the predict flow (what the UI's form runs).
    predicted = predict_flow(inputs=f"{result['data_dir']}/clips/0530", model=run, volume="pipeline",
                             output="predictions/from-flow")
    assert predicted["package"] == result["package"] and predicted["predicted"] == predicted["frames"] == 1
    assert (laneflow_home / "volumes" / "pipeline" / predicted["predictions"]).is_file()

    second = train_pipeline(**params_for(synthetic_archive, source=source, snapshot=False, workers=1, max_steps=1),
                            return_state=True).result()
    assert second["dataset_steps"] == {"downloaded": False, "extracted": False, "preprocessed": False}
    assert second["dataset_version"] == result["dataset_version"] and second["run"] != run


def _kill_one_rank_after_checkpoint(run_dir: Path, killed: list[int]) -> None:
    """Once a checkpoint is on disk, SIGKILL rank 1 of the training job (a lost worker)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and '"checkpoint"' in metrics.read_text():
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    parts = cmdline.read_bytes().split(b"\0")
                    environ = (cmdline.parent / "environ").read_bytes()
                except OSError:
                    continue
                if b"training.train" in parts and str(run_dir).encode() in parts and b"HOROVOD_RANK=1" in environ:
                    os.kill(int(cmdline.parent.name), signal.SIGKILL)
                    killed.append(int(cmdline.parent.name))
                    return
        time.sleep(0.2)


def served_culane(file_server: FileServer, root: Path) -> DataSource:
    """A synthetic CULane release (8 train, 4 val, 9 test frames) packed as CULane ships it, served over HTTP."""
    generate(root / "culane", train=8, val=4, test=9, seed=2)
    artifacts = []
    for packed in pack_artifacts(root / "culane", root / "archives"):
        name = Path(packed["path"]).name
        file_server.files[name] = Path(packed["path"]).read_bytes()
        artifacts.append({"url": file_server.url(name), "sha256": packed["sha256"], "kind": "archive"})
    return DataSource(artifacts=artifacts)


def test_a_culane_release_trains_and_is_judged_per_scenario_by_the_official_metric(
        prefect_server: dict, laneflow_home: Path, file_server: FileServer, tmp_path: Path) -> None:
    """CULane's archives as it ships them, over HTTP: prepared, trained on by horovodrun, scored on its test
    split per scenario list, packaged (parity on CULane frames) and snapshotted, as a TuSimple run is."""
    base = {"epochs": 1, "batch_size": 2, "workers": 2, "loader_workers": 0, "volume": "culane", "package": True}
    state = train_pipeline(**TrainParams(source=served_culane(file_server, tmp_path), **base).flow_parameters(),
                           return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    metrics = result["metrics"]
    assert metrics["metric"] == "culane" and metrics["split"] == "test" and metrics["images"] == 9
    assert list(metrics["scenarios"]) == list(SCENARIOS)
    assert metrics["accuracy"] == (metrics["counts"]["f1"] or 0.0)  # what runs are selected by: F1
    volume = laneflow_home / "volumes" / "culane"
    predicted = sorted((volume / result["run_dir"] / "culane_test").rglob("*.lines.txt"))
    assert len(predicted) == 9 and (volume / result["run_dir"] / "overlay_test.png").is_file()
    assert (volume / result["package"] / "model.onnx").is_file()
    assert json.loads((laneflow_home / "snapshots" / result["snapshot"] / "lineage.json").read_text())[
        "metrics"]["scenarios"] == metrics["scenarios"]
    # The run's page in the UI says which benchmark its tables are: CULane's, with its F1 and scenarios.
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = {str(a.key).split("-", 1)[0]: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))}
    assert artifacts["metrics"].description == f"CULane metrics and training summary of {result['run']}"
    assert artifacts["curve"].description == f"loss, learning rate and validation F1 of {result['run']}"
    table = artifacts["metrics"].data
    rows = {row["metric"] for row in (json.loads(table) if isinstance(table, str) else table)}
    assert {f"test {name} F1" for name in SCENARIOS if name != "cross"} <= rows, rows
    assert not [name for name in rows if "accuracy" in name], rows


def test_transient_launcher_failure_is_retried_and_resumes_from_checkpoint(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    killed: list[int] = []
    runs_root = laneflow_home / "volumes" / "resume" / "runs"

    def watch() -> None:  # the run's name comes from its flow run id: wait for its folder to appear
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for run_dir in runs_root.glob("train-*") if runs_root.is_dir() else []:
                _kill_one_rank_after_checkpoint(run_dir, killed)
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    # 8 epochs of 2 steps (8 images, batch 2, two ranks), a checkpoint at each epoch's end: the kill comes
    # after the first, with most of the run still to go.
    state = train_pipeline(**params_for(synthetic_archive, epochs=8, volume="resume", snapshot=False),
                           return_state=True)
    assert killed, "the test never found a training rank to kill"
    assert state.is_completed(), state.message
    result = state.result()
    assert result["resumed_from"] > 0  # resumed from its checkpoint, not from step 0
    assert result["steps"] == 16
    record = json.loads((laneflow_home / "volumes" / "resume" / result["run_dir"] / "launcher.json").read_text())
    assert record["attempts"] == 2 and record["exit_code"] == 0
    waits = task_runs(UUID(result["flow_run_id"]))["wait_for_training"]
    assert [run.run_count for run in waits] == [2]
    # A retried stage is no error: nothing on the way logs one.
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        this_run = LogFilterFlowRunId(any_=[UUID(result["flow_run_id"])])
        errors = client.read_logs(log_filter=LogFilter(flow_run_id=this_run, level=LogFilterLevel(ge_=40)))
    assert [log.message for log in errors] == []


def test_invalid_parameter_fails_at_once_naming_the_field(prefect_server: dict, laneflow_home: Path,
                                                          synthetic_archive: tuple[Path, str]) -> None:
    state = train_pipeline(**{**params_for(synthetic_archive), "lr": -1}, return_state=True)
    assert state.is_failed()
    assert "lr" in state.message and "greater than 0" in state.message
    assert not (laneflow_home / "volumes").exists()  # nothing ran


def test_training_failure_fails_the_flow_with_log_tail_and_no_snapshot(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    # 8 training images cannot fill a step of 2 workers x 8 images: the trainer refuses (exit 2).
    state = train_pipeline(**params_for(synthetic_archive, batch_size=8, volume="broken"), return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "refused its configuration or data" in message
    assert "training log tail" in message and "too few for 2 worker(s) x batch size 8" in message
    waits = task_runs(state.state_details.flow_run_id)["wait_for_training"]
    assert [run.run_count for run in waits] == [1]  # not transient: not retried
    snapshots = laneflow_home / "snapshots"
    assert not snapshots.exists() or not any(snapshots.iterdir())
