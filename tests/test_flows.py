"""nightly_retrain, sweep and restore on the local platform, each a real run against a real Prefect server."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.variables import Variable

from flows.nightly import champion_variable, nightly_retrain
from flows.predict import resolve_package
from flows.restore import restore
from flows.sweep import sweep
from flows.train import GPU_LIMIT, train_pipeline
from tasks.gpu_slot import GPU_LEASE_LABEL
from tasks.platforms import LocalPlatform
from tasks.processes import run_to_end
from tests.conftest import PROJECT_ROOT
from tests.gpu_limit import lease_released, operator_gpu_limit
from tests.test_pipeline import params_for

pytestmark = pytest.mark.slow


def latest_artifact(key: str) -> object:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no artifact {key}"
    return max(found, key=lambda artifact: artifact.created).data


@pytest.fixture
def forgotten_champion(prefect_server: dict) -> Iterator[None]:
    """The champion of volume `nightly` this test crowns (a Prefect variable on the session's server, its
    model in this test's home) is forgotten afterwards: no later nightly meets a champion it cannot find."""
    yield
    Variable.unset(champion_variable("nightly"))


def test_nightly_promotes_first_model_and_keeps_champion_against_a_worse_one(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], tmp_path: Path,
        forgotten_champion: None) -> None:
    first = nightly_retrain(**params_for(synthetic_archive, volume="nightly", epochs=6, snapshot=False, package=True))
    assert first["promoted"] and first["reason"] == "no champion yet"
    champion = Variable.get(champion_variable("nightly"))
    assert champion["run"] == first["challenger"]["run"]
    # The champion is a package: resolvable by name, shown by `laneflow champion`, usable by `laneflow predict`.
    assert champion["package"] == f"runs/{champion['run']}/package"
    assert resolve_package(LocalPlatform(), "nightly", "champion") == ("nightly", champion["package"])
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home)}
    laneflow = str(Path(sys.executable).parent / "laneflow")
    shown = run_to_end([laneflow, "champion", "--volume", "nightly"], 600, env=env)
    assert shown.returncode == 0, shown.stderr
    package_dir = laneflow_home / "volumes" / "nightly" / champion["package"]
    assert f"champion of nightly: {champion['run']}" in shown.stdout and str(package_dir) in shown.stdout
    assert f"# Lineage of `{champion['run']}`" in shown.stdout
    image = next((laneflow_home / "volumes" / "nightly" / champion["data_dir"] / "clips").rglob("20.jpg"))
    predicted = run_to_end([laneflow, "predict", str(image), "--model", "champion", "--volume", "nightly",
                            "--out", str(tmp_path / "champion")], 600, env=env)
    assert predicted.returncode == 0, predicted.stderr
    assert len((tmp_path / "champion" / "predictions.json").read_text().splitlines()) == 1

    # Decided on val, test reported: the record keeps both, each on its own split.
    assert first["challenger"]["metrics"]["split"] == "test" and champion["val_metrics"]["split"] == "val"
    true_val = champion["val_metrics"]["untimed_accuracy"]

    # The champion was a good model on val, evaluated on a busy machine: every image over 200 ms, so its
    # official val accuracy is 0 while without the run-time rule it scored 0.99; on test it scored nothing.
    # A one-step challenger must not beat it, even when the promotion bar is lowered to "not clearly worse"
    # (which 0 vs 0 would pass, and so would any test score against the champion's 0 on test).
    busy = {**champion,
            "metrics": {**champion["metrics"], "accuracy": 0.0, "untimed_accuracy": 0.0, "fp": 1.0, "fn": 1.0},
            "val_metrics": {**champion["val_metrics"], "accuracy": 0.0, "fp": 0.0, "fn": 1.0, "untimed_accuracy": 0.99,
                            "over_time_limit": champion["val_metrics"]["images"]}}
    Variable.set(champion_variable("nightly"), busy, overwrite=True)
    # The challenger is another model (the row-anchor detector): models compete on the same val images.
    second = nightly_retrain(**params_for(synthetic_archive, volume="nightly", max_steps=1, snapshot=False,
                                          workers=1, model="ufld"), min_improvement=-0.5)
    assert second["challenger"]["metrics"]["split"] == "test"
    second_config = laneflow_home / "volumes" / "nightly" / second["challenger"]["run_dir"] / "config.json"
    assert json.loads(second_config.read_text())["model_name"] == "ufld"
    assert second["challenger"]["val_metrics"]["untimed_accuracy"] < 0.49
    assert second["challenger"]["val_metrics"]["split"] == "val" and second["challenger"]["metrics"]["split"] == "test"
    assert not second["promoted"] and "champion kept" in second["reason"]
    assert Variable.get(champion_variable("nightly"))["run"] == first["challenger"]["run"]
    decision = latest_artifact("champion-nightly")
    assert f"`{first['challenger']['run']}` (val 0.9900)" in decision
    assert "without the benchmark's 200 ms run-time rule" in decision
    assert "test is reported, never decided on" in decision

    # Crowned on another dataset version: its recorded val score describes other images, so it is re-scored
    # on the challenger's val images (here the same files, so the model's true val score comes back).
    # Its scores go beside the challenger's run; its own run folder is left exactly as it was.
    volume = laneflow_home / "volumes" / "nightly"
    champion_files = {path: (path.read_bytes(), path.stat().st_mtime_ns)
                      for path in (volume / champion["run_dir"]).rglob("*") if path.is_file()}
    assert volume / champion["run_dir"] / "eval_val.json" in champion_files
    Variable.set(champion_variable("nightly"), {**busy, "dataset_version": "0" * 16}, overwrite=True)
    third = nightly_retrain(**params_for(synthetic_archive, volume="nightly", max_steps=1, snapshot=False,
                                         workers=1), min_improvement=1.0)
    assert not third["promoted"]
    assert f"`{first['challenger']['run']}` (val {true_val:.4f})" in latest_artifact("champion-nightly")
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns)
            for path in (volume / champion["run_dir"]).rglob("*") if path.is_file()} == champion_files
    rescored = volume / third["challenger"]["run_dir"] / f"champion-{champion['run']}" / "eval_val.json"
    assert json.loads(rescored.read_text())["untimed_accuracy"] == pytest.approx(true_val)


def warnings_since(started: datetime) -> list[str]:
    """Every log line of WARNING or above that reached the server since ``started``."""
    from prefect.client.schemas.filters import LogFilter, LogFilterLevel, LogFilterTimestamp
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the handler ships logs in batches
    with get_client(sync_client=True) as client:
        found = client.read_logs(log_filter=LogFilter(level=LogFilterLevel(ge_=30),
                                                      timestamp=LogFilterTimestamp(after_=started)))
    return [f"{log.name}: {log.message}" for log in found]


def test_a_run_asking_more_gpus_than_the_limit_is_refused_before_it_prepares_anything(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    """An elastic run takes up to max_workers GPUs: 3 under a limit of 2 could never start, so the run fails at
    once — not after downloading the dataset, and never waiting — with what to change."""
    from tasks.gpu_slot import MoreSlotsThanTheLimit

    params = params_for(synthetic_archive, volume="too-big", workers=1,
                        elastic={"min_workers": 1, "max_workers": 3})
    with operator_gpu_limit(2), pytest.raises(MoreSlotsThanTheLimit, match=r"asks for 3 GPUs.*limit has 2 slots"):
        train_pipeline(**params)
    assert not (laneflow_home / "volumes" / "too-big" / "datasets").exists()


def test_sweep_runs_children_within_the_gpu_limit_and_ranks_them(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    started = datetime.now(UTC)
    base = params_for(synthetic_archive, volume="sweep", workers=1, snapshot=False)
    # The operator allows two trainings at once; this sweep asks for one at a time, and leaves the limit alone.
    with operator_gpu_limit(2):
        table = sweep(**base, grid={"lr": [0.05, 0.02]}, runs=[{"lr": 0.1, "batch_size": 4}], max_concurrent=1)
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        assert (limit.limit, limit.active_slots) == (2, 0)
    # Children run in worker threads: nothing laneflow configures may make Prefect warn about that.
    assert warnings_since(started) == []

    assert [row["rank"] for row in table] == [1, 2, 3]
    assert sorted(row["lr"] for row in table) == [0.02, 0.05, 0.1]
    assert all(row["state"] == "Completed" and row["val accuracy"] is not None for row in table)
    accuracies = [row["val accuracy"] for row in table]
    assert accuracies == sorted(accuracies, reverse=True)
    assert table[0]["test accuracy"] is not None and all(row["test accuracy"] is None for row in table[1:])
    assert [row["run"] for row in json.loads(latest_artifact("sweep-leaderboard"))] == [row["run"] for row in table]

    # At most one training at a time (the sweep's own bound, under a limit of 2): launcher records never overlap.
    spans = []
    for row in table:
        record = json.loads((laneflow_home / "volumes" / "sweep" / "runs" / row["run"] / "launcher.json").read_text())
        spans.append((datetime.fromisoformat(record["started_at"]), datetime.fromisoformat(record["finished_at"])))
    spans.sort()
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans)), spans


def test_a_tpe_sweep_with_a_pruner_stops_a_hopeless_trial_at_its_first_report_and_scores_only_the_best_on_test(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    """Three TPE trials over lr: 0.05 learns the synthetic lanes within 40 steps (val accuracy ~0.75 here),
    1e-4 learns nothing (0.0). Seed 10 makes Optuna's first two (random) trials 0.05 then 1e-4, so the
    median pruner has one finished trial to compare the hopeless one with at its first val report."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.objects import StateType

    base = params_for(synthetic_archive, volume="search", workers=1, snapshot=False, epochs=20, max_steps=80,
                      eval_every=40)
    space = {"lr": {"choices": [0.05, 0.0001]}}
    state = sweep(**base, search="tpe", space=space, trials=3, seed=10, pruner="median", return_state=True)
    table = state.result()
    by_trial = {row["trial"]: row for row in table}
    assert sorted(by_trial) == [0, 1, 2] and all(row["lr"] in (0.05, 0.0001) for row in table)
    assert by_trial[0]["lr"] == 0.05 and by_trial[0]["state"] == "Completed" and by_trial[0]["steps"] == 80
    assert by_trial[1]["lr"] == 0.0001 and by_trial[1]["state"] == "Pruned", table
    for row in table:  # whatever TPE asked next: a hopeless trial never trains past its first report
        if row["lr"] == 0.0001:
            # Stopped at the first check after its report at step 40 (at 40 itself when the request was that quick).
            assert row["state"] == "Pruned" and row["val accuracy"] == 0.0 and 40 <= row["steps"] < 80, row
        run = laneflow_home / "volumes" / "search" / "runs" / row["run"]
        events = [json.loads(line)["event"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        if row["state"] == "Pruned":  # stopped on request after a checkpoint: no model, no final evaluation
            assert events.count("val") == 1 and events[-1] == "stopped" and "done" not in events, events
            assert events[-2] == "checkpoint" and not (run / "model.pt").exists()
        else:
            assert row["state"] == "Completed" and "stopped" not in events and (run / "model.pt").is_file()
    completed = [row for row in table if row["state"] == "Completed"]
    assert table[:len(completed)] == completed  # finished trials rank above pruned ones
    accuracies = [row["val accuracy"] for row in completed]
    assert accuracies == sorted(accuracies, reverse=True) and [row["rank"] for row in table] == [1, 2, 3]
    # The test set is looked at once: for the best trial, after the choice was made on val.
    assert table[0]["test accuracy"] is not None and all(row["test accuracy"] is None for row in table[1:])
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(state.state_details.flow_run_id).name
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[f"{name}-{trial}" for trial in range(3)])))
    assert len(children) == 3 and all(child.parameters["eval_split"] == "val" for child in children)
    child_of = {int(child.name.rsplit("-", 1)[1]): child for child in children}
    assert all(child_of[row["trial"]].parameters["lr"] == row["lr"] for row in table)  # what Optuna asked ran
    # In the UI a pruned trial is "Pruned": a completed run (not failed), run once (not retried).
    assert child_of[1].state.name == "Pruned" and child_of[1].state.type == StateType.COMPLETED
    assert "training stopped at step" in child_of[1].state.message and child_of[1].run_count == 1
    leaderboard_rows = latest_artifact("sweep-leaderboard")
    assert [row["run"] for row in json.loads(leaderboard_rows)] == [row["run"] for row in table]
    study = str(latest_artifact("sweep-study"))
    for section in ("Optimization history", "Parameter importances", "Parallel coordinates"):
        assert f"## {section}" in study, study[:2000]
    assert "![Optimization history](data:image/png;base64," in study


def test_a_search_space_is_refused_before_anything_trains_naming_the_key(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    from prefect.exceptions import ParameterTypeError

    base = params_for(synthetic_archive, volume="refused")
    with pytest.raises(ParameterTypeError, match="learning_rate"):  # the schema names the searchable fields
        sweep.validate_parameters({**base, "search": "tpe", "space": {"learning_rate": {"low": 0.1, "high": 0.2}}})
    state = sweep(**base, search="random", space={"lr": {"low": 0.2, "high": 0.1}}, return_state=True)
    assert state.is_failed()
    assert "space['lr']: low (0.2) must be below high (0.1)" in str(state.result(raise_on_failure=False))
    lr_space = {"lr": {"low": 0.01, "high": 0.1}}
    no_curve = sweep(**base, search="tpe", space=lr_space, pruner="median", return_state=True)
    assert "pruner='median' judges trials on their val scores during training: set eval_every" in \
        str(no_curve.result(raise_on_failure=False))
    grid = sweep(**{**base, "eval_every": 5}, grid={"lr": [0.1]}, pruner="hyperband", return_state=True)
    assert "pruner='hyperband' stops trials of a search" in str(grid.result(raise_on_failure=False))
    assert not (laneflow_home / "volumes").exists()


def test_a_sweep_killed_mid_trial_continues_its_study_and_resumes_that_trial_from_its_checkpoint(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    """SIGKILL to the sweep's process while trial 1 trains (trial 0 done); the same sweep again: trial 0 is
    not run again, trial 1 runs again under its run key and resumes from the checkpoint its run left. One slot of
    the operator's 'gpu' limit, which the killed trial held: the new sweep, taking the study over from the dead
    one, stops the killed trial's run (its training, its slot) as the dead sweep's hook would have — the retry
    does not wait out Prefect's lease on that slot."""
    import signal
    import subprocess

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from tasks.processes import running

    base = params_for(synthetic_archive, volume="study", workers=1, snapshot=False, epochs=4)
    arguments = {**base, "search": "random", "space": {"lr": {"low": 0.01, "high": 0.1, "log": True}},
                 "trials": 2, "seed": 3, "study": "killed"}
    script = "import json, sys\nfrom flows.sweep import sweep\nsweep(**json.loads(sys.argv[1]))"
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home)}
    runs = laneflow_home / "volumes" / "study" / "runs"
    output = tmp_path / "sweep.log"
    with operator_gpu_limit(1), output.open("wb") as sink, running(
            [sys.executable, "-c", script, json.dumps(arguments, default=lambda v: v.model_dump(mode="json"))],
            stop_signals=(signal.SIGKILL,), env=env, cwd=PROJECT_ROOT, stdout=sink,
            stderr=subprocess.STDOUT) as killed:
        deadline = time.monotonic() + 600
        while not ((found := sorted(runs.glob("train-killed-*-1/metrics.jsonl")))
                   and found[0].read_text().count('"event": "step"') >= 1):  # step 10 (of 16): checkpointed
            assert killed.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.5)
        metrics = found[0]
        killed.kill()  # no hook, no goodbye: trial 1 stays RUNNING in the journal; its training goes on
        killed.wait()
        table = sweep(**{key: value for key, value in arguments.items() if key not in base}, **base,
                      max_concurrent=2)
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
                any_=["killed-trial-0", "killed-trial-1", "killed-trial-2"])))
            children = {run.name: run for run in runs}
        # Killed outright, no hook handed the killed trial's slot back: the sweep that took the study over did.
        killed_trial = children["killed-trial-1"]
        assert lease_released(killed_trial.labels[GPU_LEASE_LABEL])
        assert killed_trial.state.is_cancelled() and "is gone (taken over)" in killed_trial.state.message, \
            killed_trial.state
    assert sorted(row["trial"] for row in table) == [0, 2]  # trial 1 interrupted; its retry is trial 2
    assert all(row["state"] == "Completed" for row in table), table
    retry = next(row for row in table if row["trial"] == 2)
    assert retry["run"] == metrics.parent.name  # the interrupted run's folder, under its run key
    with get_client(sync_client=True) as client:
        resumed = client.read_flow_run(children["killed-trial-2"].id)
    assert sorted(children) == ["killed-trial-0", "killed-trial-1", "killed-trial-2"]  # trial 0 ran once
    assert children["killed-trial-0"].state.is_completed()
    record = json.loads((metrics.parent / "launcher.json").read_text())
    assert record["attempts"] == 2 and resumed.state.is_completed()
    starts = [event for line in metrics.read_text().splitlines() if (event := json.loads(line))["event"] == "start"]
    assert [start["resumed"] for start in starts] == [False, True] and starts[1]["step"] > 0  # from its checkpoint


def test_a_rescheduled_sweep_stops_the_trials_its_killed_attempt_left_before_running_them_again(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    """A drained node's flow pod: the worker reschedules the same flow run (AwaitingRetry) and its process is
    killed, no hook run. The same sweep then runs again — the same flow run, its second attempt, holding its own
    study, so nothing is "taken over" — and stops what its first attempt left (the trial's training, its 'gpu'
    slot, its hold on the volume's level) before running that trial again from its checkpoint. Left as it was,
    the killed trial kept its level hold for the hold's whole lifetime (a volume left on Premium, seen in the soak)
    and its slot for Prefect's lease. Here, where volumes have no service levels, the slot shows it: the level
    hold goes back in the same ``stop_run`` (the soak checks the volume)."""
    import signal
    import subprocess
    from uuid import UUID

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    from flows.sweep import trial_runs
    from tasks.processes import running

    base = params_for(synthetic_archive, volume="again", workers=1, snapshot=False, epochs=3)
    arguments = json.loads(json.dumps(
        {**base, "search": "random", "space": {"lr": {"low": 0.01, "high": 0.1, "log": True}}, "trials": 1,
         "seed": 5, "study": "again"}, default=lambda v: v.model_dump(mode="json")))
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(sweep, parameters=arguments)
    script = ("import sys, uuid\nfrom prefect import get_client\nfrom prefect.flow_engine import run_flow\n"
              "from flows.sweep import sweep\nwith get_client(sync_client=True) as client:\n"
              "    flow_run = client.read_flow_run(uuid.UUID(sys.argv[1]))\n"
              "run_flow(sweep, flow_run=flow_run, parameters=flow_run.parameters)")
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home)}
    runs = laneflow_home / "volumes" / "again" / "runs"
    output = tmp_path / "attempt-1.log"
    with operator_gpu_limit(1), output.open("wb") as sink:
        with running([sys.executable, "-c", script, str(flow_run.id)], stop_signals=(signal.SIGKILL,), env=env,
                     cwd=PROJECT_ROOT, stdout=sink, stderr=subprocess.STDOUT) as first:
            deadline = time.monotonic() + 600
            while not ((found := sorted(runs.glob("train-again-*-0/metrics.jsonl")))
                       and found[0].read_text().count('"event": "step"') >= 1):
                assert first.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
                time.sleep(0.5)
            first.kill()  # what the drain leaves: no hook ran, the trial's run is still Running
            first.wait()
        with get_client(sync_client=True) as client:
            (killed_trial,) = trial_runs(client, flow_run.id)
            assert killed_trial.state.is_running()
            client.set_flow_run_state(flow_run.id, AwaitingRetry(), force=True)  # the worker's reschedule
            again = client.read_flow_run(flow_run.id)
        table = run_flow(sweep, flow_run=again, parameters=again.parameters)
        with get_client(sync_client=True) as client:
            ended = client.read_flow_run(killed_trial.id)
            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(str(flow_run.id))])))
            assert client.read_flow_run(flow_run.id).run_count == 2
        assert ended.state.is_cancelled() and "an earlier attempt of sweep" in ended.state.message, ended.state
        assert lease_released(ended.labels[GPU_LEASE_LABEL])
    assert [row["trial"] for row in table] == [1] and table[0]["state"] == "Completed", table  # trial 0 again
    assert table[0]["run"] == found[0].parent.name  # under its run key: resumed, not started over
    assert len(children) == 2


def test_two_sweeps_of_one_study_never_share_it_the_second_is_refused_naming_the_first_or_waits(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    """A sweep holds its study; one started beside it is refused at once, naming it; one asked to wait runs
    after it. Every trial in the journal then has its own parameters, score and run folder (as stock Optuna
    reads the file)."""
    import contextvars
    import threading

    import optuna
    from optuna.storages.journal import JournalFileBackend

    from tasks.study_lock import parse_holder, record_key

    base = params_for(synthetic_archive, volume="shared", workers=1, snapshot=False, max_steps=4)
    arguments = {**base, "search": "random", "space": {"lr": {"low": 0.01, "high": 0.1, "log": True}},
                 "trials": 2, "seed": 11, "study": "shared"}
    platform, states = LocalPlatform(), {}

    def run(name: str, **changes: object) -> threading.Thread:
        context = contextvars.copy_context()
        thread = threading.Thread(target=lambda: states.__setitem__(
            name, context.run(sweep, **{**arguments, **changes}, return_state=True)))
        thread.start()
        return thread

    def holder() -> object:
        return parse_holder(platform.update_volume_record(platform.ensure_volume("shared"), record_key("shared"),
                                                          lambda raw: raw))

    first = run("first")
    deadline = time.monotonic() + 300
    while (held := holder()) is None:
        assert first.is_alive() and time.monotonic() < deadline, states
        time.sleep(0.2)
    refused = sweep(**arguments, return_state=True)
    assert refused.is_failed()
    assert f"study 'shared' on volume 'shared' is held by sweep {held.name} (flow run {held.sweep}" in str(
        refused.result(raise_on_failure=False))
    waiting = run("waiting", trials=3, wait_for_study=True)
    first.join(600)
    waiting.join(600)
    assert states["first"].is_completed() and states["waiting"].is_completed(), states
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(states["first"].state_details.flow_run_id).name == held.name
    table = states["waiting"].result()
    assert sorted(row["trial"] for row in table) == [0, 1, 2]  # the study's three, two by the first sweep
    assert holder() is None  # let go when the last sweep ended

    journal = laneflow_home / "volumes" / "shared" / "studies" / "shared.journal"
    trials = optuna.load_study(study_name="shared", storage=optuna.storages.JournalStorage(
        JournalFileBackend(str(journal)))).trials
    assert [trial.state for trial in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert len({trial.params["lr"] for trial in trials}) == 3
    results = [trial.user_attrs["result"] for trial in trials]
    assert len({result["run"] for result in results}) == 3 and len({result["flow_run_id"] for result in results}) == 3
    by_run, runs = {row["run"]: row for row in table}, laneflow_home / "volumes" / "shared" / "runs"
    for trial, result in zip(trials, results, strict=True):  # each score is its own run's, on its own parameters
        lineage = json.loads((runs / result["run"] / "lineage.json").read_text())
        assert lineage["parameters"]["lr"] == pytest.approx(trial.params["lr"])
        assert trial.value == pytest.approx(lineage["metrics"]["untimed_accuracy"])
        assert by_run[result["run"]]["lr"] == pytest.approx(trial.params["lr"])


def test_sweep_refuses_an_invalid_run_naming_it(prefect_server: dict, laneflow_home: Path,
                                                synthetic_archive: tuple[Path, str]) -> None:
    state = sweep(**params_for(synthetic_archive), runs=[{"lr": 0.05}, {"epochs": 0}], return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "sweep run 1" in message and "epochs" in message
    assert not (laneflow_home / "volumes").exists()


def test_a_script_without_a_main_guard_can_call_a_flow(prefect_server: dict, laneflow_home: Path,
                                                       synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    # At module level, as a notebook-minded user writes it: the dataset stage's worker pool must not
    # re-run this script (multiprocessing imports a parent's __main__ into its workers).
    path, sha256 = synthetic_archive
    script = tmp_path / "train_now.py"
    script.write_text("from flows.train import train_pipeline\n\n"
                      f"result = train_pipeline(source={{'url': {path.as_uri()!r}, 'sha256': {sha256!r}}}, epochs=1,\n"
                      "                        batch_size=2, loader_workers=0, volume='script', package=False,\n"
                      "                        snapshot=False, workers=1, max_steps=1)\n"
                      "print('trained', result['run'], 'preprocessed', result['dataset_steps']['preprocessed'])\n")
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = run_to_end([sys.executable, str(script)], 1200, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "trained train-" in done.stdout and "preprocessed True" in done.stdout
    assert "bootstrapping phase" not in done.stderr


def test_restore_trains_on_a_new_volume_from_a_snapshot_without_downloading(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    # A private copy of the archive that disappears after the first run: a restore must not need it.
    archive = tmp_path / "train_set.zip"
    archive.write_bytes(synthetic_archive[0].read_bytes())
    original = train_pipeline(**params_for((archive, synthetic_archive[1]), volume="origin", workers=1))
    archive.unlink()
    (laneflow_home / "volumes" / "origin" / "downloads" / "train_set.zip").unlink()

    restored = restore(original["snapshot"], volume="restored", changes={"epochs": 2, "max_steps": 1})
    assert restored["volume"] == "restored" and restored["dataset_version"] == original["dataset_version"]
    assert restored["dataset_steps"] == {"downloaded": False, "extracted": False, "preprocessed": False}
    volume = laneflow_home / "volumes" / "restored"
    assert (volume / "runs" / original["run"] / "model.pt").is_file()  # the snapshot's run came back too
    lineage = json.loads((laneflow_home / "snapshots" / restored["snapshot"] / "lineage.json").read_text())
    assert lineage["parameters"]["epochs"] == 2 and lineage["volume"] == "restored"

    again = restore(original["snapshot"], volume="restored", changes={"max_steps": 1, "snapshot": False},
                    return_state=True)
    assert again.is_completed()  # the restored volume is adopted, not refused

    other = restore(original["snapshot"], volume="origin", return_state=True)
    assert other.is_failed() and "already exists" in str(other.result(raise_on_failure=False))
