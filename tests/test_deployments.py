"""prefect.yaml applied to a real server: four deployments, a scheduled nightly, a typed form, a worker
that runs what the UI creates, and the UI page of that run checked in headless Chromium."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from flows.cli import WORK_POOL, apply_deployments, ensure_local_setup
from tasks.names import run_name, snapshot_name
from tasks.processes import PREFECT_WORKER_SIGNALS, running
from tests import leaks
from tests.browser import Browser, find_chromium
from tests.conftest import PROJECT_ROOT, SESSION_MARKER, TEST_OUTPUT
from tests.test_anf import anf_volume

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
    # A typed, described form: one top-level field per parameter, the dataset as a nested object.
    form = schema["properties"]
    assert form["lr"]["type"] == "number" and form["lr"]["exclusiveMinimum"] == 0
    assert form["lr"]["description"].startswith("base learning rate")
    assert form["epochs"]["type"] == "integer" and form["preset"]["enum"] == ["cpu-demo", "tusimple"]
    assert form["source"]["$ref"] == "#/definitions/DataSource" and schema["required"] == ["source"]
    assert schema["definitions"]["DatasetArtifact"]["properties"]["sha256"]["pattern"] == "^[0-9a-fA-F]{64}$"
    assert schema["definitions"]["DatasetArtifact"]["properties"]["kind"]["enum"] == ["archive", "file"]
    assert all(deployments[name].enforce_parameter_schema for name in ("train", "nightly", "sweep", "restore"))
    artifacts = deployments["train"].parameters["source"]["artifacts"]
    assert [(a["sha256"], a["kind"]) for a in artifacts] == [
        (deployed["LANEFLOW_TRAIN_SHA256"], "archive"), (deployed["LANEFLOW_TEST_SHA256"], "archive"),
        (deployed["LANEFLOW_TEST_LABEL_SHA256"], "file")]


ONE_FIELD = {  # deployment -> a run's only parameter; everything else comes from the deployment
    "train_pipeline/train": {"lr": 0.02},
    "nightly_retrain/nightly": {"min_improvement": 0.01},
    "sweep/sweep": {"max_concurrent": 2},
    "restore/restore": {"snapshot": "tusimple-train-0123456789ab"},
}


def test_one_field_overrides_keep_every_other_default_of_each_deployment(deployed: dict) -> None:
    from flows.nightly import nightly_retrain
    from flows.restore import restore
    from flows.sweep import sweep
    from flows.train import train_pipeline

    flows = {"train_pipeline/train": train_pipeline, "nightly_retrain/nightly": nightly_retrain,
             "sweep/sweep": sweep, "restore/restore": restore}
    with get_client(sync_client=True) as client:
        for name, override in ONE_FIELD.items():
            deployment = client.read_deployment_by_name(name)
            run = client.create_flow_run_from_deployment(deployment.id, parameters=override)
            try:
                assert run.parameters == {**deployment.parameters, **override}, name
                flows[name].validate_parameters(run.parameters)  # what the worker's flow run will accept
            finally:
                client.delete_flow_run(run.id)  # never picked up: the worker tests below start from a clean queue


@pytest.mark.parametrize(("deployment", "override", "named"), [
    ("train_pipeline/train", {"lr": -1}, "lr"),
    ("train_pipeline/train", {"epochs": "many"}, "epochs"),
    ("train_pipeline/train", {"volume": "Not_A_Volume"}, "volume"),
    ("nightly_retrain/nightly", {"preset": "huge"}, "preset"),
    ("sweep/sweep", {"max_concurrent": 0}, "max_concurrent"),
])
def test_a_bad_override_is_refused_when_the_run_is_created_naming_the_field(
        deployed: dict, deployment: str, override: dict, named: str) -> None:
    from prefect.exceptions import PrefectHTTPStatusError

    def created_by_hand(client) -> set:
        """Runs made through the API (the scheduler adds the nightly's own scheduled runs at any moment)."""
        return {run.id for run in client.read_flow_runs() if not run.auto_scheduled}

    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        before = created_by_hand(client)
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(found.id, parameters=override)
        assert created_by_hand(client) == before  # nothing was created
    detail = refused.value.response.json()["detail"]
    assert refused.value.response.status_code == 409 and f"'{named}'" in detail, detail


def running_worker(env: dict[str, str], output) -> AbstractContextManager[subprocess.Popen]:
    """``prefect worker start`` on the pool, stopped as its CLI documents (Ctrl-C, then a second one) and
    killed with its process group if it still runs after that (Prefect 3.9 may hang in its shutdown)."""
    prefect = str(Path(sys.executable).parent / "prefect")
    return running([prefect, "worker", "start", "--pool", WORK_POOL, "--type", "process"],
                   stop_signals=PREFECT_WORKER_SIGNALS, grace_s=20, env=env, cwd=PROJECT_ROOT, stdout=output,
                   stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def worker_run(deployed: dict, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run created through the API with one field, executed by a real process worker."""
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train_pipeline/train")
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=ONE_FIELD["train_pipeline/train"])
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with log.open("wb") as sink, running_worker(deployed, sink) as worker:
        deadline = time.monotonic() + 900
        with get_client(sync_client=True) as client:
            while not (state := client.read_flow_run(flow_run.id).state).is_final():
                assert time.monotonic() < deadline, f"flow run still {state.name} after 900 s"
                assert worker.poll() is None, f"worker exited: {log.read_text()[-3000:]}"
                time.sleep(2)
    assert state.is_completed(), f"{state.name}: {state.message}\n{log.read_text()[-3000:]}"
    return str(flow_run.id)


def test_a_one_field_run_is_executed_by_the_worker_with_the_deployments_dataset(worker_run: str,
                                                                                deployed: dict) -> None:
    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[worker_run])))}
    assert any(key.startswith("metrics-train-") for key in keys), keys
    # The run trained with lr 0.02 on the deployment's three artifacts and its other defaults.
    snapshot = snapshot_name("tusimple", run_name(worker_run))
    lineage = json.loads((Path(deployed["LANEFLOW_HOME"]) / "snapshots" / snapshot / "lineage.json").read_text())
    parameters = lineage["parameters"]
    assert parameters["lr"] == 0.02 and parameters["epochs"] == 4 and parameters["workers"] == 2
    assert [a["sha256"] for a in parameters["source_artifacts"]] == [
        deployed["LANEFLOW_TRAIN_SHA256"], deployed["LANEFLOW_TEST_SHA256"], deployed["LANEFLOW_TEST_LABEL_SHA256"]]


@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (scripts/bootstrap.sh installs it "
                                                    "when run as root)")
def test_prefect_ui_shows_the_metrics_artifact_of_a_finished_run(worker_run: str, deployed: dict) -> None:
    ui = deployed["PREFECT_API_URL"].removesuffix("/api")
    with Browser() as browser:
        browser.open(f"{ui}/runs/flow-run/{worker_run}")
        browser.wait_for_text("Completed", timeout_s=120)
        browser.click_text("Artifacts")
        # What the user sees on the run's Artifacts tab: the key, the type and the description. The key renders
        # before the other two, so the wait is for all three (it fails naming what never appeared).
        browser.wait_for_text("metrics-train-", "TABLE", "TuSimple metrics", timeout_s=120)
        browser.evaluate("[...document.querySelectorAll('*')].find(e => e.childElementCount === 0 && "
                         "e.textContent.trim().startsWith('metrics-train-'))?.scrollIntoView({block: 'center'})")
        shot = browser.screenshot(TEST_OUTPUT / "prefect-ui-run-artifacts.png")
    assert shot.stat().st_size > 10_000


def test_cancelling_a_flow_run_stops_its_training_process_group(deployed: dict) -> None:
    from prefect.states import Cancelling

    from tasks.processes import group_alive

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train_pipeline/train")
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={
            "epochs": 500, "batch_size": 2, "loader_workers": 0, "snapshot": False, "volume": "cancel-me"})
    run_dir = Path(deployed["LANEFLOW_HOME"]) / "volumes" / "cancel-me" / "runs" / f"train-{flow_run.id.hex[:12]}"
    with running_worker(deployed, subprocess.DEVNULL):
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and '"step"' in (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        pgid = json.loads((run_dir / "launcher.json").read_text())["pgid"]
        assert group_alive(pgid)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
            deadline = time.monotonic() + 180
            while not (state := client.read_flow_run(flow_run.id).state).is_final() or group_alive(pgid):
                assert time.monotonic() < deadline, f"still {state.name}; group alive: {group_alive(pgid)}"
                time.sleep(1)
        assert state.is_cancelled()


def test_cancelling_a_cluster_run_that_promoted_its_volume_stops_the_mpijob_and_returns_the_volume(
        deployed: dict, served_archive: tuple[str, str], arm: tuple, tmp_path: Path) -> None:
    """Cancel from the UI while an MPIJob trains on a volume promoted to Premium: the worker ends the run,
    its hook deletes the MPIJob (and with it the launcher and workers) and moves the volume back."""
    from prefect.states import Cancelling

    from tests.cluster.runtime import pod_runtime_missing
    from tests.k8s_emulator import KubernetesEmulator
    from tests.test_cluster_platform import cluster_platform
    from tests.test_pipeline import params_for

    if missing := pod_runtime_missing():
        pytest.skip(missing)
    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")
    with k8s as cluster:
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-anf-cancel", overwrite=True)
        parameters = json.loads(json.dumps(params_for(served_archive, platform="emu-anf-cancel", volume="tusimple",
                                                      promote=True, epochs=500),
                                           default=lambda value: value.model_dump(mode="json")))
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train_pipeline/train")
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        log = tmp_path / "worker.log"
        with log.open("wb") as sink, running_worker(deployed, sink):
            deadline = time.monotonic() + 400
            while not any("launcher" in name and pod["status"].get("phase") == "Running"
                          for (_, name), pod in list(cluster.objects["pods"].items())):
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            assert state.volumes["tusimple"]["pool"] == "pool-premium"
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
                deadline = time.monotonic() + 240
                while not (final := client.read_flow_run(flow_run.id).state).is_final():
                    assert time.monotonic() < deadline, f"still {final.name}: {log.read_text()[-3000:]}"
                    time.sleep(1)
            cluster.wait_empty("mpijobs")
        assert final.is_cancelled(), final
    state.run_out()
    assert state.volumes["tusimple"]["pool"] == "pool-standard", log.read_text()[-3000:]


def test_ctrl_c_stops_laneflow_serve_cleanly_and_leaves_the_server_running(deployed: dict,
                                                                          tmp_path: Path) -> None:
    """``make serve``, then Ctrl-C: one line says what stopped, no traceback, the worker is gone, the UI stays."""
    from flows.local_server import is_healthy

    laneflow = str(Path(sys.executable).parent / "laneflow")
    port = deployed["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink, running([laneflow, "serve", "--home", str(tmp_path / "serve"), "--port", port],
                                         stop_signals=(signal.SIGINT,), grace_s=60, env=deployed, cwd=PROJECT_ROOT,
                                         stdout=sink, stderr=subprocess.STDOUT) as serve:
        deadline = time.monotonic() + 600
        while "Worker 'ProcessWorker" not in log.read_text():  # the worker's own start-up line
            assert serve.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        workers = [p for p in leaks.marked_processes(SESSION_MARKER) if "worker start" in p.command]
        assert workers, "no worker process found"
        os.killpg(serve.pid, signal.SIGINT)  # the terminal's Ctrl-C: the foreground group, that is `laneflow serve`
        assert serve.wait(timeout=120) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == (f"laneflow serve: worker stopped; the Prefect server keeps running on "
                                               f"127.0.0.1:{port} (`make stop-server` stops it)")
    assert not [p for p in leaks.marked_processes(SESSION_MARKER) if p.pid in {w.pid for w in workers}]
    assert is_healthy(deployed["PREFECT_API_URL"])
