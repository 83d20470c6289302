"""Launching training: the horovodrun command, its output lines, reading its exit, and which failures are retried."""

from __future__ import annotations

import http.client

import pytest

from tasks.launch import JobOutput, horovodrun_command, parse_output_line, read_exit, read_mpijob_failure
from tasks.platforms import TrainingFailed, TrainingInterrupted, TrainingSpec, VolumeRef
from tasks.retry import is_transient
from tests.unit_helpers import SHA
from training.data.fetch import ChecksumMismatch, TransientFetchError

# --- launcher ----------------------------------------------------------------------------------------

def spec(**changes: object) -> TrainingSpec:
    base = {"job_name": "train-1", "volume": VolumeRef(name="v", location="/v"), "data_dir": "datasets/x",
            "run_dir": "runs/train-1", "preset": "cpu-demo", "workers": 2,
            "settings": {"lr": "0.05", "epochs": "3"}}
    return TrainingSpec(**{**base, **changes})


def test_horovodrun_command_is_an_argument_list_with_sorted_overrides() -> None:
    cmd = horovodrun_command("/venv/bin/horovodrun", "/venv/bin/python", spec(), "/v/datasets/x", "/v/runs/train-1")
    assert cmd == ["/venv/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "/venv/bin/python", "-m",
                   "training.train", "--data-root", "/v/datasets/x", "--run-dir", "/v/runs/train-1", "--preset",
                   "cpu-demo", "--set", "epochs=3", "--set", "lr=0.05"]


def test_output_lines_are_split_into_rank_text_and_event() -> None:
    line = parse_output_line('[0]<stdout>:{"event": "step", "step": 10, "loss": 0.5}\n')
    assert (line.rank, line.event) == (0, {"event": "step", "step": 10, "loss": 0.5})
    plain = parse_output_line("[1]<stderr>:2026 rank1 laneflow.train resuming")
    assert (plain.rank, plain.text, plain.event) == (1, "2026 rank1 laneflow.train resuming", None)
    assert parse_output_line('{"event": broken').event is None
    assert parse_output_line('{"event": "done", "step": 3}').rank is None


def test_openmpi_tagged_lines_are_read_as_gloo_ones() -> None:
    """``mpirun --tag-output`` (what ``horovodrun --hostfile`` runs with Horovod built with MPI) tags lines
    ``[<jobid>,<rank>]<stream>:`` and repeats the tag after each chunk of a long line."""
    line = parse_output_line('[1,0]<stdout>:{"event": "step", "step": 10, "loss": 0.5}\n')
    assert (line.rank, line.event) == (0, {"event": "step", "step": 10, "loss": 0.5})
    other = parse_output_line("[1,1]<stderr>:2026 rank1 laneflow.train resuming")
    assert (other.rank, other.text) == (1, "2026 rank1 laneflow.train resuming")
    split = parse_output_line('[1,0]<stdout>:{"event": "eval", "split": [1,0]<stdout>:"val"}')
    assert split.event == {"event": "eval", "split": "val"}


#: What mpirun (OpenMPI 4.1) prints on stderr when a rank exits non-zero or is killed: help-orterun.txt
#: ``orterun:non-zero-exit`` and ``orterun:proc-aborted-strsignal``, between lines of dashes.
MPIRUN_NONZERO = ["-" * 74, "Primary job  terminated normally, but 1 process returned",
                  "a non-zero exit code. Per user-direction, the job has been aborted.", "-" * 74, "-" * 74,
                  "mpirun detected that one or more processes exited with non-zero status, thus causing",
                  "the job to be terminated. The first process to do so was:", "",
                  "  Process name: [[14108,1],1]", "  Exit code:    {code}", "-" * 74]
MPIRUN_SIGNAL = ["-" * 74, "mpirun noticed that process rank 1 with PID 0 on node train-x-worker-1 exited on "
                 "signal 9 (Killed).", "-" * 74]


def mpirun_report(code: int) -> list[str]:
    return [line.format(code=code) for line in MPIRUN_NONZERO]


@pytest.mark.parametrize(("code", "lines", "events", "succeeded", "resumable", "reason"), [
    (75, mpirun_report(75), [], False, True, "preempted: it checkpointed and can resume on rank 1"),
    (3, mpirun_report(3), [], False, False, "training failed with exit code 3 on rank 1"),
    (2, mpirun_report(2), [], False, False, "configuration or data (exit code 2) on rank 1"),
    (137, MPIRUN_SIGNAL, [], False, True, "killed by signal 9 on rank 1"),
    (1, ["Process name: 1", "Exit code: 3"], [], False, False, "exit code 3 on rank 1"),  # horovodrun --gloo
])
def test_exit_reading_under_mpirun_names_the_rank(code: int, lines: list[str], events: list[dict],
                                                  succeeded: bool, resumable: bool, reason: str) -> None:
    output = JobOutput(on_event=lambda _: None, on_log=lambda _: None)
    for line in lines:
        output.feed(line, may_be_event=False)
    reading = read_exit(code, output.exit_lines, events)
    assert (reading.succeeded, reading.resumable, reading.reason.endswith(reason)) == (succeeded, resumable, True), \
        reading.reason


@pytest.mark.parametrize(("code", "lines", "events", "succeeded", "resumable", "reason"), [
    (0, [], [{"event": "done"}], True, False, "finished"),
    (1, ["Exit code: 75"], [{"event": "preempted"}], False, True, "preempted"),
    (1, ["[launcher] Process name: 1", "Exit code: -9"], [], False, True, "signal 9"),
    (137, [], [], False, True, "signal 9"),
    (1, ["Exit code: 2"], [], False, False, "configuration or data"),
    (2, [], [], False, False, "configuration or data"),
    (1, ["Exit code: 1"], [], False, False, "exit code 1"),
    (0, [], [{"event": "step"}], False, False, "never reported 'done'"),
    (0, [], [{"event": "val"}, {"event": "checkpoint"}, {"event": "stopped"}], True, False, "stopped on request"),
    (1, ["Exit code: 3"], [{"event": "stopped"}], False, False, "exit code 3"),  # a rank failed after stopping
])
def test_exit_reading(code: int, lines: list[str], events: list[dict], succeeded: bool, resumable: bool,
                      reason: str) -> None:
    reading = read_exit(code, lines, events)
    assert (reading.succeeded, reading.resumable) == (succeeded, resumable)
    assert reason in reading.reason


@pytest.mark.parametrize(("reason", "lines", "resumable", "why"), [
    ("MPIJobEvicted", [], True, "evicted"),
    ("BackoffLimitExceeded/Evicted", [], True, "evicted"),
    ("DeadlineExceeded", [], False, "active deadline"),
    ("BackoffLimitExceeded/", ["[1]<stderr>:Exit code: 2"], False, "exit code 2"),
    ("BackoffLimitExceeded/", ["Exit code: -9"], True, "signal 9"),
    ("MPIJobFailed", [], False, "exit code 1"),
])
def test_a_failed_mpijob_is_read_by_the_operators_reason_then_the_launcher_output(
        reason: str, lines: list[str], resumable: bool, why: str) -> None:
    reading = read_mpijob_failure(reason, lines, [])
    assert not reading.succeeded and reading.resumable is resumable and why in reading.reason


# --- retries -----------------------------------------------------------------------------------------

class _HttpError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@pytest.mark.parametrize(("error", "transient"), [
    (TrainingInterrupted("preempted"), True),
    (TrainingFailed("crashed", ["tail"]), False),
    (ConnectionResetError(), True),
    (TimeoutError(), True),
    (http.client.RemoteDisconnected(), True),
    (TransientFetchError("cut"), True),
    (ChecksumMismatch("u", SHA, "b" * 64, None), False),
    (ValueError("lr must be > 0"), False),
    (PermissionError("forbidden"), False),
    (_HttpError(429), True),
    (_HttpError(503), True),
    (_HttpError(403), False),
    (_HttpError(404), False),
    (RuntimeError("bug"), False),
    (None, False),
])
def test_only_transient_errors_are_retried(error: BaseException | None, transient: bool) -> None:
    assert is_transient(error) is transient


def test_training_failed_carries_the_log_tail() -> None:
    error = TrainingFailed("job failed", ["line 1", "line 2"])
    assert error.log_tail == ["line 1", "line 2"] and str(error).endswith("line 1\nline 2")
