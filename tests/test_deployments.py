"""prefect.yaml applied to a real server: four deployments, a scheduled nightly, a typed form, a worker
that runs what the UI creates, and the UI page of that run checked in headless Chromium."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import yaml
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from flows.serving import WORK_POOL, apply_deployments, deployment_environment, ensure_local_setup
from tasks.gpu_slot import GPU_LEASE_LABEL
from tasks.names import run_name, snapshot_name
from tasks.processes import PREFECT_WORKER_SIGNALS, running
from tests import leaks
from tests.browser import Browser, find_chromium
from tests.conftest import PROJECT_ROOT, SESSION_MARKER, TEST_OUTPUT
from tests.gpu_limit import active_gpu_slots, lease_released, operator_gpu_limit
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deployments")]


@pytest.fixture(scope="module")
def deployed(prefect_server: dict, synthetic_artifacts: list[dict], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, str]:
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(tmp_path_factory.mktemp("worker-home"))}
    for prefix, artifact in zip(("LANEFLOW_TRAIN", "LANEFLOW_TEST", "LANEFLOW_TEST_LABEL"), synthetic_artifacts,
                                strict=True):
        env[f"{prefix}_URL"], env[f"{prefix}_SHA256"] = artifact["url"], artifact["sha256"]
    # The nightly and the dataset watch read a dataset index: the local one `laneflow serve` writes.
    env = deployment_environment(tmp_path_factory.mktemp("deploy-home"), env)
    ensure_local_setup(gpu_slots=2)  # the deployments' two-worker runs fit, whatever this machine's cores
    apply_deployments(env)
    return env


def test_prefect_yaml_creates_the_deployments(deployed: dict) -> None:
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
        raw = client._client.get(f"/deployments/{deployments['nightly'].id}").raise_for_status().json()
    assert {"train", "nightly", "dataset_watch", "sweep", "restore", "predict", "compare"} <= set(deployments)
    compare_form = deployments["compare"].parameter_openapi_schema
    assert compare_form["required"] == ["runs"] and compare_form["properties"]["target_accuracy"]["maximum"] == 1
    # One nightly at a time; the server cancels one that would overlap (collision strategy CANCEL_NEW).
    assert raw["global_concurrency_limit"]["limit"] == 1, raw
    assert raw["concurrency_options"]["collision_strategy"] == "CANCEL_NEW", raw
    assert deployments["nightly"].parameters["source"] == {"index": deployed["LANEFLOW_DATASET_INDEX"]}
    assert [s.schedule.interval.total_seconds() for s in deployments["dataset_watch"].schedules] == [900]
    # prefect.yaml's deployments (the session's server may hold others: the cluster pool's, say) all run on
    # the local process pool.
    names = {entry["name"] for entry in yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]}
    assert names <= set(deployments) and all(deployments[name].work_pool_name == WORK_POOL for name in names)
    nightly = deployments["nightly"].schedules
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in nightly] == [("0 2 * * *", "Europe/Berlin",
                                                                                   True)]
    schema = deployments["train"].parameter_openapi_schema
    # A typed, described form: one top-level field per parameter, the dataset as a nested object.
    form = schema["properties"]
    assert form["lr"]["type"] == "number" and form["lr"]["exclusiveMinimum"] == 0
    assert form["lr"]["description"].startswith("base learning rate")
    assert form["epochs"]["type"] == "integer" and form["preset"]["enum"] == ["cpu-demo", "tusimple", "culane"]
    assert form["source"]["$ref"] == "#/definitions/DataSource" and schema["required"] == ["source"]
    assert schema["definitions"]["DatasetArtifact"]["properties"]["sha256"]["pattern"] == "^[0-9a-fA-F]{64}$"
    assert schema["definitions"]["DatasetArtifact"]["properties"]["kind"]["enum"] == ["archive", "file", "update"]
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


def running_worker(env: dict[str, str], output, niceness: int = 0) -> AbstractContextManager[subprocess.Popen]:
    """``prefect worker start`` on the pool, stopped as its CLI documents (Ctrl-C, then a second one) and
    killed with its process group if it still runs after that (Prefect 3.9 may hang in its shutdown).
    ``niceness`` lowers the CPU priority of the worker and the runs it starts (``nice`` execs the worker).
    It asks for scheduled runs every 2 s, not every 10 s (Prefect's default): the runs a test creates while it
    runs start without the test waiting idle for them."""
    prefect = str(Path(sys.executable).parent / "prefect")
    nice = ["nice", "-n", str(niceness)] if niceness else []
    return running([*nice, prefect, "worker", "start", "--pool", WORK_POOL, "--type", "process"],
                   stop_signals=PREFECT_WORKER_SIGNALS, grace_s=20, env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"},
                   cwd=PROJECT_ROOT, stdout=output, stderr=subprocess.STDOUT)


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
        # The server asks for its auth string: signed in as the UI's login page does (it keeps the string's base64
        # under this key of the origin's local storage), then the run's page.
        browser.open(f"{ui}/")
        wait_until("the UI's page", lambda: str(browser.evaluate("location.href")).startswith(ui), timeout_s=60)
        auth = json.dumps(deployed["PREFECT_API_AUTH_STRING"])
        browser.evaluate(f"localStorage.setItem('prefect-password', btoa({auth}))")
        browser.open(f"{ui}/runs/flow-run/{worker_run}")
        browser.wait_for_text("Completed", timeout_s=180, reload_blank_after_s=60)
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
            lease = client.read_flow_run(flow_run.id).labels[GPU_LEASE_LABEL]  # it trains in a 'gpu' slot
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
            deadline = time.monotonic() + 180
            while not (state := client.read_flow_run(flow_run.id).state).is_final() or group_alive(pgid):
                assert time.monotonic() < deadline, f"still {state.name}; group alive: {group_alive(pgid)}"
                time.sleep(1)
        assert state.is_cancelled()
        assert lease_released(lease)  # its slot is free now, not when the killed process's lease expires


def trial_starts(run_dir: Path) -> list[dict]:
    """The ``start`` events a trial's training wrote (one per attempt), as the run's metrics file has them."""
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [event for line in lines if line.endswith("}") and (event := json.loads(line))["event"] == "start"]


def test_cancelling_a_sweep_stops_every_trial_frees_their_slots_and_the_next_sweep_runs_them_again(
        deployed: dict, tmp_path: Path) -> None:
    """Two trials of a kept study train side by side; the sweep is cancelled from the API (as from the UI) and
    its worker stops the sweep's process, which stops its trials as it ends. Both trainings stop, both trial runs
    end Cancelled by their own hooks, their 'gpu' slots are free, and the study says they were interrupted; the
    same sweep again runs both from their checkpoints, under their run keys."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState
    from prefect.states import Cancelling

    from flows.sweep import trial_runs
    from tasks.processes import group_alive
    from tasks.pruning import STOP_REQUEST, StopVerdict
    from tests.test_cluster_pipeline import flow_run_messages

    volume = Path(deployed["LANEFLOW_HOME"]) / "volumes" / "cancel-sweep"
    parameters = {"grid": None, "search": "random", "space": {"lr": {"low": 0.01, "high": 0.1, "log": True}},
                  "trials": 2, "seed": 5, "study": "cxl", "max_concurrent": 2, "volume": "cancel-sweep",
                  "epochs": 500, "batch_size": 2, "loader_workers": 0}
    log = tmp_path / "worker.log"
    # Two trials side by side, each on the sweep deployment's one worker: a slot each.
    with operator_gpu_limit(2), log.open("wb") as sink, running_worker(deployed, sink) as worker, \
            get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("sweep/sweep")
        first = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)

        def both_training() -> list[Path] | None:
            assert worker.poll() is None, log.read_text()[-3000:]
            state = client.read_flow_run(first.id).state
            assert not state.is_final(), f"sweep ended {state.name}: {state.message}\n{log.read_text()[-3000:]}"
            dirs = [metrics.parent for metrics in (volume / "runs").glob("train-cxl-*/metrics.jsonl")
                    if '"step"' in metrics.read_text()]
            return sorted(dirs) if len(dirs) == 2 else None

        trial_dirs = wait_until("both trials training", both_training, timeout_s=600)
        groups = [json.loads((run_dir / "launcher.json").read_text())["pgid"] for run_dir in trial_dirs]
        leases = [child.labels[GPU_LEASE_LABEL] for child in trial_runs(client, first.id)]
        slots_in_use = active_gpu_slots()
        assert len(leases) == 2 and slots_in_use >= 2
        client.set_flow_run_state(first.id, Cancelling(), force=True)
        cancelled = wait_until("the sweep cancelled", lambda: (
            state if (state := client.read_flow_run(first.id).state).is_final() else None), timeout_s=300)
        assert cancelled.is_cancelled(), f"{cancelled.name}: {cancelled.message}\n{log.read_text()[-3000:]}"
        assert not [pgid for pgid in groups if group_alive(pgid)], "a trial's training still runs"
        trials = trial_runs(client, first.id)
        assert sorted(child.state.name for child in trials) == ["Cancelled", "Cancelled"], [
            (child.name, child.state.name, child.state.message) for child in trials]
        # Each trial was stopped by its sweep's process as it ended (not only by the worker's hook once that
        # process was gone): the trial's own cancellation hook ran, in the trial's log.
        for child in trials:
            messages = flow_run_messages(str(child.id))  # every page: a trial logs each of its steps
            assert "Running hook 'stop_training' in response to entering state 'Cancelling'" in messages, (
                child.name, messages[-10:])
        assert all(lease_released(lease) for lease in leases)
        assert active_gpu_slots() <= slots_in_use - 2  # (another test's slot may expire meanwhile: at most)
        journal = str(volume / "studies" / "cxl.journal")
        study = optuna.load_study(study_name="cxl", storage=JournalStorage(JournalFileBackend(journal)))
        assert [(trial.state, trial.user_attrs.get("interrupted")) for trial in study.trials] == [
            (TrialState.FAIL, True), (TrialState.FAIL, True)], study.trials
        keys = {trial.number: trial.user_attrs["run_key"] for trial in study.trials}

        # The same sweep again: it asks for both trials first, and each resumes from its checkpoint; once it has,
        # the test stops it as a pruner would (the trials' own 500 epochs are not the point).
        again = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        asked_to_stop: set[Path] = set()

        def rerun_over():
            assert worker.poll() is None, log.read_text()[-3000:]
            for run_dir in set(trial_dirs) - asked_to_stop:
                if len(trial_starts(run_dir)) == 2:
                    (run_dir / STOP_REQUEST).write_bytes(StopVerdict("the test has seen enough", "Stopped").request(0))
                    asked_to_stop.add(run_dir)
            state = client.read_flow_run(again.id).state
            return state if state.is_final() else None

        ended = wait_until("the sweep run again", rerun_over, timeout_s=600)
        assert ended.is_completed(), f"{ended.name}: {ended.message}\n{log.read_text()[-3000:]}"
        reruns = trial_runs(client, again.id)
    assert sorted(child.parameters["run_key"] for child in reruns) == sorted(keys.values())
    for run_dir in trial_dirs:
        starts = trial_starts(run_dir)
        assert [start["resumed"] for start in starts] == [False, True] and starts[1]["step"] > 0, starts
    study = optuna.load_study(study_name="cxl", storage=JournalStorage(JournalFileBackend(journal)))
    retries = {trial.user_attrs.get("retry_of"): trial.user_attrs["run_key"] for trial in study.trials[2:]}
    assert retries == keys  # trial 2 runs trial 0 again, trial 3 trial 1, each under its own run key


def test_ctrl_c_stops_laneflow_serve_cleanly_and_leaves_the_server_running(deployed: dict, session_server,
                                                                          tmp_path: Path) -> None:
    """``make serve``, then Ctrl-C: one line says what stopped, no traceback, the worker is gone, the UI stays.
    (Its home is the session server's: a server on the port is reused only by the home that started it.)"""
    from flows.local_server import is_healthy

    laneflow = str(Path(sys.executable).parent / "laneflow")
    port = deployed["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink, running([laneflow, "serve", "--home", str(session_server.home), "--port", port],
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
        try:
            code = serve.wait(timeout=120)
        except subprocess.TimeoutExpired:  # say what the process made of the signal, for the next one to read
            status = Path(f"/proc/{serve.pid}/status").read_text()
            pytest.fail("laneflow serve still runs 120 s after Ctrl-C; its signal state: "
                        + " ".join(line for line in status.splitlines() if line.startswith("Sig"))
                        + "\n" + log.read_text()[-3000:])
        assert code == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == (f"laneflow serve: worker stopped; the Prefect server keeps running on "
                                               f"127.0.0.1:{port} (`make stop-server` stops it)")
    assert not [p for p in leaks.marked_processes(SESSION_MARKER) if p.pid in {w.pid for w in workers}]
    assert is_healthy(deployed["PREFECT_API_URL"])


# --- Operating the nightly retrain: new data starts it, overlaps are refused, failures are announced -----------

def nightly_runs(client) -> list:
    """The nightly deployment's flow runs made by the API or a trigger (the cron's own runs excluded)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deployment = client.read_deployment_by_name("nightly_retrain/nightly")
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return [run for run in runs if not run.auto_scheduled]


def publish(index: Path, version: str, published: str, artifacts: list[dict]) -> None:
    """The data team's side: one more version in the index file."""
    document = json.loads(index.read_text())
    document["datasets"].append({"version": version, "published": published, "artifacts": artifacts})
    index.write_text(json.dumps(document))


@pytest.fixture
def worker_champion(deployed: dict) -> Iterator[None]:
    """The retrain below crowns a champion of volume `nightly` on the session's server (a Prefect variable)
    from the worker's home; it is forgotten afterwards, so no other test meets a champion it cannot find."""
    from prefect.variables import Variable

    from tasks.champion import champion_variable

    yield
    Variable.unset(champion_variable("nightly"))


def test_a_new_dataset_version_starts_one_nightly_on_its_artifacts_and_an_overlapping_nightly_never_trains(
        deployed: dict, synthetic_archive: tuple[Path, str], tmp_path: Path, worker_champion: None) -> None:
    from flows.dataset_watch import dataset_watch

    index = Path(deployed["LANEFLOW_DATASET_INDEX"].removeprefix("file://"))
    with get_client(sync_client=True) as client:
        before = {run.id for run in nightly_runs(client)}
    # The first look (or a scheduled one before it) takes the baseline: nothing is announced, nothing runs.
    assert dataset_watch(index=deployed["LANEFLOW_DATASET_INDEX"])["announced"] is None
    # A new drop: one archive with the labels inside (the one-archive form of a dataset).
    archive, sha256 = synthetic_archive
    drop = [{"url": archive.as_uri(), "sha256": sha256, "kind": "archive"}]
    publish(index, "2030-01-01", "2030-01-01T00:00:00Z", drop)
    assert dataset_watch(index=deployed["LANEFLOW_DATASET_INDEX"])["new_versions"] == ["2030-01-01"]
    with get_client(sync_client=True) as client:
        started = wait_until("a nightly run started by the dataset event", lambda: [
            run for run in nightly_runs(client) if run.id not in before], timeout_s=120)
    # A burst: another drop right after starts no second retrain (the trigger is debounced).
    publish(index, "2030-01-02", "2030-01-02T00:00:00Z", drop)
    assert dataset_watch(index=deployed["LANEFLOW_DATASET_INDEX"])["new_versions"] == ["2030-01-02"]
    assert len(started) == 1 and started[0].parameters["source"] == {"artifacts": drop}, started
    retrain = started[0]
    log = tmp_path / "worker.log"
    with log.open("wb") as sink, running_worker(deployed, sink) as worker, get_client(sync_client=True) as client:
        wait_until("the retrain running", lambda: client.read_flow_run(retrain.id).state.is_running() or
                   (worker.poll() is not None and pytest.fail(log.read_text()[-3000:])), timeout_s=300)
        # While it runs, tonight's scheduled retrain comes due (created by hand here): the server cancels it.
        deployment = client.read_deployment_by_name("nightly_retrain/nightly")
        overlapping = client.create_flow_run_from_deployment(deployment.id)
        refused = wait_until("the overlapping run handled", lambda: (
            state if (state := client.read_flow_run(overlapping.id).state).is_final() else None), timeout_s=180)
        final = wait_until("the retrain finished", lambda: (
            state if (state := client.read_flow_run(retrain.id).state).is_final() else None), timeout_s=600)
        assert final.is_completed(), f"{final.name}: {final.message}\n{log.read_text()[-3000:]}"
        assert refused.is_cancelled() and "concurrency limit" in (refused.message or ""), refused
        assert client.read_flow_run(overlapping.id).run_count == 0  # never ran (and the volume has no run of it)
        assert len([run for run in nightly_runs(client) if run.id not in before]) == 2  # the retrain + refused one
    runs = Path(deployed["LANEFLOW_HOME"]) / "volumes" / "nightly" / "runs"
    trained = list(runs.iterdir())  # one training: the retrain's (the refused run has none)
    assert len(trained) == 1, trained
    snapshot = Path(deployed["LANEFLOW_HOME"]) / "snapshots" / snapshot_name("nightly", trained[0].name)
    lineage = json.loads((snapshot / "lineage.json").read_text())
    assert [artifact["sha256"] for artifact in lineage["artifacts"]] == [sha256]
    assert lineage["parameters"]["source_artifacts"][0]["sha256"] == sha256


def test_a_bad_index_fails_the_watch_naming_the_problem_and_starts_nothing(deployed: dict, tmp_path: Path) -> None:
    from flows.dataset_watch import dataset_watch

    index = tmp_path / "index.json"
    good = {"version": "v1", "published": "2030-01-01T00:00:00Z",
            "artifacts": [{"url": "https://data.example.com/v1/train_set.zip", "sha256": "a" * 64}]}
    index.write_text(json.dumps({"datasets": [good]}))
    assert dataset_watch(index=index.as_uri())["announced"] is None  # the baseline
    with get_client(sync_client=True) as client:
        before = {run.id for run in nightly_runs(client)}
    for entry, named in [
        ({**good, "version": "v2", "artifacts": [{"url": "https://data.example.com/v2/train_set.zip"}]},
         "datasets[1] (v2).artifacts[0].sha256: missing"),
        ({**good, "version": "v2", "artifacts": [{"url": "http://data.example.com/v2.zip", "sha256": "b" * 64}]},
         "'http://data.example.com/v2.zip' must be https://"),
    ]:
        index.write_text(json.dumps({"datasets": [good, {**entry, "published": "2030-02-01T00:00:00Z"}]}))
        state = dataset_watch(index=index.as_uri(), return_state=True)
        assert state.is_failed() and named in str(state.result(raise_on_failure=False)), state
    index.write_text('{"datasets": [')
    state = dataset_watch(index=index.as_uri(), return_state=True)
    assert state.is_failed() and "not JSON" in str(state.result(raise_on_failure=False))
    time.sleep(5)  # what a trigger would have had to start a run in
    with get_client(sync_client=True) as client:
        assert {run.id for run in nightly_runs(client)} == before


def test_alerts_apply_once_each_and_a_failed_nightly_reaches_the_webhook_through_the_servers_automation(
        deployed: dict, tmp_path: Path) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from flows.alerts import PREFIX, AlertSettings, apply_alerts
    from tests.http_server import RunningServer

    with RunningServer() as receiver:
        CustomWebhookNotificationBlock(name="laneflow-test-alerts", url=receiver.url("alerts"), method="POST",
                                       json_data={"subject": "{{subject}}", "body": "{{body}}"}).save(
            "laneflow-test-alerts", overwrite=True)
        settings = AlertSettings(block="custom-webhook/laneflow-test-alerts", running_hours=6)
        assert apply_alerts(settings) == apply_alerts(settings)  # twice: updated in place, not added again
        with get_client(sync_client=True) as client:
            ours = [a for a in client.read_automations() if a.name.startswith(PREFIX)]
            assert sorted(a.name for a in ours) == sorted(apply_alerts(settings))
            assert len(ours) == 4, [a.name for a in ours]
            # The nightly's own trigger (prefect.yaml) is left alone: one, as deployed.
            assert len(client.read_automations_by_name("laneflow: retrain on a new dataset version")) == 1
            # A nightly whose dataset index is not there fails at its first stage.
            deployment = client.read_deployment_by_name("nightly_retrain/nightly")
            missing = (tmp_path / "no-such-index.json").as_uri()
            failing = client.create_flow_run_from_deployment(deployment.id, parameters={"source": {"index": missing}})
        log = tmp_path / "worker.log"
        with log.open("wb") as sink, running_worker(deployed, sink), get_client(sync_client=True) as client:
            final = wait_until("the failing nightly finished", lambda: (
                state if (state := client.read_flow_run(failing.id).state).is_final() else None), timeout_s=300)
            assert final.is_failed(), f"{final.name}: {log.read_text()[-3000:]}"
            posted = wait_until("the notification", lambda: [r for r in receiver.requests if r.get("method") == "POST"],
                                timeout_s=120)
    message = json.loads(posted[0]["body"])
    assert message["subject"] == "laneflow: nightly retrain Failed", message
    with get_client(sync_client=True) as client:
        flow_run_name = client.read_flow_run(failing.id).name
    assert flow_run_name in message["body"] and "no such file" in message["body"], message
    assert f"/runs/flow-run/{failing.id}" in message["body"], message


# --- The Prefect server restarted (an upgrade) while a nightly trains ---------------------------------------

def _step_lines(run_dir: Path) -> int:
    """How many training steps the run has recorded so far."""
    return (run_dir / "metrics.jsonl").read_text().count('"event": "step"')


#: Prefect keeps a deployment's concurrency lease of a running flow run by renewing it for 300 s every
#: 0.75 x 300 s (prefect.flow_engine: maintain_concurrency_lease(lease_id, 300,
#: raise_on_lease_renewal_failure=True); prefect.concurrency._leases: _RENEWAL_FRACTION = 0.75), the first
#: time as the run starts. A renewal that fails terminates the run.
DEPLOYMENT_LEASE_RENEWED_AFTER_S = 0.75 * 300


def deployment_slots(client, name: str) -> int:
    """Active slots of a deployment's concurrency limit, as the UI's deployment page shows them."""
    deployment = client.read_deployment_by_name(name)
    return client._client.get(f"/deployments/{deployment.id}").raise_for_status().json()[
        "global_concurrency_limit"]["active_slots"]


def test_a_server_restarted_while_a_nightly_trains_neither_aborts_it_nor_leaks_its_slots(
        deployed: dict, session_server, synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    """The server goes down and comes back (same database) mid-training; the nightly's deployment lease is then
    renewed on the restarted server, and when the run ends every slot it held is free again."""
    from tasks.pruning import STOP_REQUEST, StopVerdict

    archive, sha256 = synthetic_archive
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("nightly_retrain/nightly")
        nightly = client.create_flow_run_from_deployment(deployment.id, parameters={
            "source": {"artifacts": [{"url": archive.as_uri(), "sha256": sha256, "kind": "archive"}]},
            "volume": "restarted", "epochs": 1000, "batch_size": 2, "loader_workers": 0, "snapshot": False,
            "workers": 1})
    runs = Path(deployed["LANEFLOW_HOME"]) / "volumes" / "restarted" / "runs"
    log = tmp_path / "worker.log"
    # The training only has to outlast Prefect's lease renewal (minutes): one rank at a low priority, so it
    # takes what CPU the tests beside it leave.
    with log.open("wb") as sink, running_worker(deployed, sink, niceness=10) as worker:
        def training() -> Path | None:
            assert worker.poll() is None, log.read_text()[-3000:]
            return next((metrics.parent for metrics in runs.glob("*/metrics.jsonl") if '"step"' in metrics.read_text()),
                        None)

        run_dir = wait_until("the nightly training", training, timeout_s=400)
        with get_client(sync_client=True) as client:
            assert (active_gpu_slots(), deployment_slots(client, "nightly_retrain/nightly")) == (1, 1)
            started = client.read_flow_run(nightly.id).start_time.timestamp()
        steps_before = _step_lines(run_dir)
        session_server.restart()
        with get_client(sync_client=True) as client:
            def since_start(seconds: float) -> Callable[[], bool]:
                def reached() -> bool:
                    state = client.read_flow_run(nightly.id).state
                    assert not state.is_final(), (f"nightly ended {state.name}: {state.message}\n"
                                                  f"{log.read_text()[-3000:]}")
                    return time.time() - started > seconds
                return reached

            wait_until("the training going on after the restart", lambda: _step_lines(run_dir) > steps_before,
                       timeout_s=120)
            # Minutes of waiting for Prefect's clock: the training (its whole process group) holds still meanwhile
            # rather than take CPU from the tests beside it, and goes on before the renewal is due.
            pgid = json.loads((run_dir / "launcher.json").read_text())["pgid"]
            os.killpg(pgid, signal.SIGSTOP)
            try:
                wait_until("the renewal nearly due", since_start(DEPLOYMENT_LEASE_RENEWED_AFTER_S - 15),
                           timeout_s=DEPLOYMENT_LEASE_RENEWED_AFTER_S, every_s=2)
            finally:
                os.killpg(pgid, signal.SIGCONT)
            wait_until("the nightly's deployment lease renewed after the restart",
                       since_start(DEPLOYMENT_LEASE_RENEWED_AFTER_S + 20), timeout_s=120, every_s=2)
            assert (active_gpu_slots(), deployment_slots(client, "nightly_retrain/nightly")) == (1, 1)
            # Enough: stop the training the way a sweep's pruner does (the trainer checkpoints and exits 0).
            (run_dir / STOP_REQUEST).write_bytes(StopVerdict("the test has seen enough", "Stopped").request(0))
            final = wait_until("the nightly finished", lambda: (
                state if (state := client.read_flow_run(nightly.id).state).is_final() else None), timeout_s=300)
            assert final.is_completed(), f"{final.name}: {final.message}\n{log.read_text()[-3000:]}"
            assert (active_gpu_slots(), deployment_slots(client, "nightly_retrain/nightly")) == (0, 0)
