"""``laneflow run`` and ``laneflow sweep`` as a user types them: a run of the deployment with the ``--set`` values
over its defaults, executed by a worker the command starts when none is online, followed with a progress line
and ended with the run's summary; a value the deployment's form refuses is named before anything runs; Ctrl-C
asks, and cancel stops the run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prefect import get_client

from flows.run_command import stop_detached_worker
from tasks.processes import stop_process
from tests.test_deployments import deployed  # noqa: F401  (the module's own deployments on the session server)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cli-run")]

LANEFLOW = str(Path(sys.executable).parent / "laneflow")
#: Short runs: the command's behaviour is what is tested, not the training. Every run here uses the volume "cli",
#: so only the first prepares the dataset.
SHORT = ["--set", "max_steps=6", "--set", "snapshot=false", "--set", "package=false"]


def laneflow(args: list[str], env: dict[str, str], home: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([LANEFLOW, *args, "--home", str(home)], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False, cwd=home)


def test_run_trains_with_its_overrides_follows_the_progress_and_ends_with_the_summary(
        deployed: dict, tmp_path: Path) -> None:  # noqa: F811
    done = laneflow(["run", "--set", "epochs=2", "--set", "volume=cli", *SHORT], deployed, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "starting a worker on work pool 'laneflow-local'" in out, out
    # The progress lines: the stage running (which stages a poll sees depends on their pace), a bar of the steps,
    # the loss and the throughput training reports (its log lines may arrive as a later stage runs).
    assert re.search(r"^Running +(prepare-dataset|train-|evaluate-)\S*", out, re.MULTILINE), out
    assert re.search(r"^\S+ +\S+ +\[#+\] step (\d+)/\1 {2}loss \d+\.\d{4} {2}\d+\.\d img/s$", out, re.MULTILINE), out
    assert re.search(r"^flow run {8}: Completed {2}http://127\.0\.0\.1:\d+/runs/flow-run/", out, re.MULTILINE), out
    run = re.search(r"^run {13}: (train-[0-9a-f]{12})$", out, re.MULTILINE)
    assert run and f"lineage         : laneflow lineage {run[1]}" in out and "  test accuracy (official): " in out, out
    flow_run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", out)[1]
    with get_client(sync_client=True) as client:
        parameters = client.read_flow_run(flow_run_id).parameters
    # The --set values over the deployment's defaults, as a run from the UI's form with those fields changed.
    assert (parameters["epochs"], parameters["volume"], parameters["workers"]) == (2, "cli", 2), parameters
    assert "source" in parameters and parameters["preset"] == "cpu-demo"


def test_a_value_the_form_refuses_is_named_and_nothing_runs(deployed: dict, tmp_path: Path) -> None:  # noqa: F811
    refused = laneflow(["run", "--set", "epochs=0"], deployed, tmp_path, timeout_s=120)
    assert refused.returncode == 2 and "the server refused the run's parameters" in refused.stderr, refused.stderr
    assert "epochs" in refused.stderr, refused.stderr
    malformed = laneflow(["run", "--set", "epochs"], deployed, tmp_path, timeout_s=120)
    assert malformed.returncode == 2 and "expected KEY=VALUE" in malformed.stderr, malformed.stderr
    misspelt = laneflow(["run", "--set", "epoch=2"], deployed, tmp_path, timeout_s=120)
    assert misspelt.returncode == 2, misspelt.stdout + misspelt.stderr
    assert "no parameter 'epoch' (did you mean epochs?)" in misspelt.stderr, misspelt.stderr
    assert "flow run" not in refused.stdout + malformed.stdout + misspelt.stdout


def test_sweep_runs_a_two_trial_grid_to_its_leaderboard(deployed: dict, tmp_path: Path) -> None:  # noqa: F811
    done = laneflow(["sweep", "--set", 'grid={"lr": [0.02, 0.05]}', "--set", "epochs=1", "--set", "volume=cli",
                     "--set", "max_steps=4"], deployed, tmp_path, timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    board = done.stdout.split("leaderboard     :\n", 1)[1].split("Prefect UI", 1)[0]
    trials = [line for line in board.splitlines() if line.startswith("  ")]
    assert len(trials) == 2 and all("state Completed" in line for line in trials), done.stdout
    assert {re.search(r"lr (0\.0\d)", line)[1] for line in trials} == {"0.02", "0.05"}, trials


def test_ctrl_c_asks_and_cancel_stops_the_run_and_the_worker(deployed: dict, tmp_path: Path) -> None:  # noqa: F811
    # As long a run as the form allows (the small dataset's epochs are a step or two): it is still training when the
    # test's Ctrl-C comes, however fast this machine trains.
    # Started with SIGINT ignored, as a test runner's worker (or a script's `trap '' INT`) passes it on: the command
    # must hear Ctrl-C all the same.
    command = subprocess.Popen([LANEFLOW, "run", "--set", "epochs=1000", "--set", "volume=cli",
                                "--home", str(tmp_path)], env=deployed, cwd=tmp_path, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    chunks: list[str] = []  # read as it comes: the question ends without a newline, waiting for the answer
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: command.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        wait_until("training under way", lambda: re.search(r"step \d+/\d+", "".join(chunks)), timeout_s=600,
                   every_s=0.5)
        assert command.poll() is None, "".join(chunks)  # still following its run
        os.kill(command.pid, signal.SIGINT)  # Ctrl-C, to the command alone
        wait_until("the question", lambda: "[c]ancel the run, or [d]etach and leave it running? [c/d] " in
                   "".join(chunks), timeout_s=60, every_s=0.2)
        command.stdin.write("c\n")
        command.stdin.flush()
        code = command.wait(timeout=300)
    finally:
        if command.poll() is None:  # SIGTERM detaches, leaving the worker recorded in the home: stopped below
            stop_process(command, grace_s=30)
        stop_detached_worker(tmp_path)
        reader.join(timeout=10)
    out = "".join(chunks)
    assert code == 1, out
    assert "cancelling the run..." in out and re.search(r"^flow run {8}: Cancelled ", out, re.MULTILINE), out
    # The worker the command started for the run was stopped with it: no process holds its log open any more,
    # and no pid file was left (that is for a detached run's worker only).
    assert (tmp_path / "worker.log").is_file() and not (tmp_path / "worker.pid").exists()
    assert not holders_of(tmp_path / "worker.log")


def holders_of(path: Path) -> list[int]:
    """The processes that have ``path`` open."""
    holders = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if Path(os.readlink(fd)) == path:
                holders.append(int(fd.parts[2]))
        except OSError:
            continue
    return holders


def test_stop_server_stops_the_worker_a_detached_run_left_and_nothing_else(deployed: dict,  # noqa: F811
                                                                             tmp_path: Path) -> None:
    """What a detached run leaves: its worker, recorded in the home; ``laneflow stop-server`` stops it (and no
    process that merely took a recorded pid over)."""
    prefect = str(Path(sys.executable).parent / "prefect")
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", "laneflow-local", "--type", "process"],
                              env=deployed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        (tmp_path / "worker.pid").write_text(str(worker.pid))
        stopped = laneflow(["stop-server"], deployed, tmp_path, timeout_s=120)
        assert "the worker a detached run left running stopped" in stopped.stdout, stopped.stdout + stopped.stderr
        assert worker.wait(timeout=60) is not None and not (tmp_path / "worker.pid").exists()
        (tmp_path / "worker.pid").write_text(str(bystander.pid))
        again = laneflow(["stop-server"], deployed, tmp_path, timeout_s=120)
        assert "worker" not in again.stdout and bystander.poll() is None, again.stdout
    finally:
        for process in (worker, bystander):
            if process.poll() is None:
                stop_process(process, grace_s=10)
