"""prefect.yaml applied to a real server: four deployments, a scheduled nightly, a typed form, a worker
that runs what the UI creates, and the UI page of that run checked in headless Chromium."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from flows.cli import WORK_POOL, apply_deployments, ensure_local_setup
from tests.browser import Browser, find_chromium
from tests.conftest import PROJECT_ROOT, TEST_OUTPUT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployed(prefect_server: dict, synthetic_artifacts: list[dict], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, str]:
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(tmp_path_factory.mktemp("worker-home"))}
    for prefix, artifact in zip(("LANEFLOW_TRAIN", "LANEFLOW_TEST", "LANEFLOW_TEST_LABEL"), synthetic_artifacts,
                                strict=True):
        env[f"{prefix}_URL"], env[f"{prefix}_SHA256"] = artifact["url"], artifact["sha256"]
    ensure_local_setup()
    apply_deployments(env)
    return env


def test_prefect_yaml_creates_the_four_deployments(deployed: dict) -> None:
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert {"train", "nightly", "sweep", "restore"} <= set(deployments)
    assert all(d.work_pool_name == WORK_POOL for d in deployments.values())
    nightly = deployments["nightly"].schedules
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in nightly] == [("0 2 * * *", "Europe/Berlin",
                                                                                   True)]
    schema = deployments["train"].parameter_openapi_schema
    form = schema["definitions"]["TrainParams"]["properties"]
    assert form["lr"]["type"] == "number" and form["lr"]["exclusiveMinimum"] == 0
    assert form["epochs"]["type"] == "integer" and form["preset"]["enum"] == ["cpu-demo", "tusimple"]
    assert schema["definitions"]["DatasetArtifact"]["properties"]["sha256"]["pattern"] == "^[0-9a-fA-F]{64}$"
    assert schema["definitions"]["DatasetArtifact"]["properties"]["kind"]["enum"] == ["archive", "file"]
    artifacts = deployments["train"].parameters["params"]["source"]["artifacts"]
    assert [(a["sha256"], a["kind"]) for a in artifacts] == [
        (deployed["LANEFLOW_TRAIN_SHA256"], "archive"), (deployed["LANEFLOW_TEST_SHA256"], "archive"),
        (deployed["LANEFLOW_TEST_LABEL_SHA256"], "file")]


@pytest.fixture(scope="module")
def worker_run(deployed: dict) -> str:
    """A run created through the API as the UI does, executed by a real process worker."""
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train_pipeline/train")
        params = {**deployment.parameters["params"], "epochs": 1, "batch_size": 2, "loader_workers": 0,
                  "volume": "from-ui"}
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
    prefect = str(Path(sys.executable).parent / "prefect")
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", WORK_POOL, "--type", "process"],
                              env=deployed, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        deadline = time.monotonic() + 600
        with get_client(sync_client=True) as client:
            while not (state := client.read_flow_run(flow_run.id).state).is_final():
                assert time.monotonic() < deadline, f"flow run still {state.name} after 600 s"
                assert worker.poll() is None, f"worker exited: {worker.stdout.read()[-3000:]}"
                time.sleep(2)
    finally:
        worker.terminate()
        output = worker.communicate(timeout=60)[0]
    assert state.is_completed(), f"{state.name}: {state.message}\n{output[-3000:]}"
    return str(flow_run.id)


def test_a_run_created_like_the_ui_does_is_executed_by_the_worker(worker_run: str) -> None:
    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[worker_run])))}
    assert any(key.startswith("metrics-train-") for key in keys), keys


@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (scripts/bootstrap.sh installs it "
                                                    "when run as root)")
def test_prefect_ui_shows_the_metrics_artifact_of_a_finished_run(worker_run: str, deployed: dict) -> None:
    ui = deployed["PREFECT_API_URL"].removesuffix("/api")
    with Browser() as browser:
        browser.open(f"{ui}/runs/flow-run/{worker_run}")
        browser.wait_for_text("Completed", timeout_s=120)
        browser.click_text("Artifacts")
        text = browser.wait_for_text("metrics-train-", timeout_s=60)
        browser.evaluate("[...document.querySelectorAll('*')].find(e => e.childElementCount === 0 && "
                         "e.textContent.trim().startsWith('metrics-train-'))?.scrollIntoView({block: 'center'})")
        shot = browser.screenshot(TEST_OUTPUT / "prefect-ui-run-artifacts.png")
    assert "TABLE" in text and "TuSimple metrics" in text
    assert shot.stat().st_size > 10_000


def test_cancelling_a_flow_run_stops_its_training_process_group(deployed: dict) -> None:
    from prefect.states import Cancelling

    from tasks.platforms.local import _group_alive

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train_pipeline/train")
        params = {**deployment.parameters["params"], "epochs": 500, "batch_size": 2, "loader_workers": 0,
                  "snapshot": False, "volume": "cancel-me"}
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
    run_dir = Path(deployed["LANEFLOW_HOME"]) / "volumes" / "cancel-me" / "runs" / f"train-{flow_run.id.hex[:12]}"
    prefect = str(Path(sys.executable).parent / "prefect")
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", WORK_POOL, "--type", "process"],
                              env=deployed, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and '"step"' in (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        pgid = json.loads((run_dir / "launcher.json").read_text())["pgid"]
        assert _group_alive(pgid)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
            deadline = time.monotonic() + 180
            while not (state := client.read_flow_run(flow_run.id).state).is_final() or _group_alive(pgid):
                assert time.monotonic() < deadline, f"still {state.name}; group alive: {_group_alive(pgid)}"
                time.sleep(1)
        assert state.is_cancelled()
    finally:
        worker.terminate()
        worker.wait(timeout=60)
