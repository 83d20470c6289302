"""Pure pieces of the DAG: names, launcher output and exit reading, retry classification, reports,
champion decisions, parameter models and sweep expansion."""

from __future__ import annotations

import http.client
import json
from uuid import UUID

import cv2
import numpy as np
import pytest
from pydantic import ValidationError

from flows.params import DataSource, SweepError, TrainParams, expand_sweep, params_from_record, takes_train_params
from flows.sweep import leaderboard
from tasks.champion import decide_champion, selection_accuracy
from tasks.k8s.logs import LogCursor, LogFormatError, format_timestamp, parse_timestamp
from tasks.launch import JobOutput, horovodrun_command, parse_output_line, read_exit, read_mpijob_failure
from tasks.lineage import build_lineage, render_lineage_markdown
from tasks.names import InvalidName, run_name, snapshot_name, validate_name
from tasks.platforms import TrainingFailed, TrainingInterrupted, TrainingSpec, VolumeRef
from tasks.platforms.base import last_attempt, outcome_from_events
from tasks.report import eval_series, metrics_rows, step_series, thumbnail_jpeg, training_curve_png
from tasks.retry import is_transient
from training.data.fetch import ChecksumMismatch, TransientFetchError
from training.data.sources import Artifact, dataset_key

SHA = "a" * 64


def source() -> DataSource:
    return DataSource(url="https://mirror.example.org/train_set.zip?sig=secret", sha256=SHA)


# --- following a container log ----------------------------------------------------------------------

def test_log_timestamps_parse_at_nanosecond_precision() -> None:
    assert parse_timestamp("2026-11-30T23:59:59.000000001Z") == (1796083199, 1)
    assert parse_timestamp("2026-11-30T23:59:59.5Z") == (1796083199, 500_000_000)
    assert parse_timestamp("2026-12-01T01:59:59.000000001+02:00") == (1796083199, 1)
    with pytest.raises(LogFormatError):
        parse_timestamp("not-a-time")


def test_a_reconnect_drops_the_overlap_and_keeps_lines_sharing_a_timestamp() -> None:
    lines = ["2026-11-30T10:00:00.100000000Z a\n", "2026-11-30T10:00:00.200000000Z b\n",
             "2026-11-30T10:00:00.200000000Z c\n", "2026-11-30T10:00:01.000000000Z d\n"]
    cursor = LogCursor()
    cursor.start_reading()
    assert [cursor.accept(line, 0.0) for line in lines[:3]] == ["a", "b", "c"]
    # The stream was cut; the new one (sinceSeconds is whole seconds) starts before what we have.
    cursor.start_reading()
    assert [cursor.accept(line, 0.0) for line in lines] == [None, None, None, "d"]
    # A line arriving later with the same timestamp as the last one delivered is new.
    cursor.start_reading()
    assert cursor.accept(lines[3], 0.0) is None
    assert cursor.accept("2026-11-30T10:00:01.000000000Z e\n", 0.0) == "e"


def test_a_reconnect_that_starts_past_the_last_line_records_the_gap_it_could_not_read() -> None:
    cursor = LogCursor()
    cursor.start_reading("launcher-a")
    assert cursor.accept("2026-11-30T10:00:00.100000000Z a\n", 0.0) == "a"
    cursor.start_reading("launcher-a")  # the window covers "a", but the file was rotated: it starts at "d"
    assert cursor.accept("2026-11-30T10:00:02.000000000Z d\n", 0.0) == "d"
    assert cursor.gaps == [(parse_timestamp("2026-11-30T10:00:00.100000000Z"),
                            parse_timestamp("2026-11-30T10:00:02.000000000Z"))]
    assert format_timestamp(cursor.gaps[0][0]) == "2026-11-30T10:00:00.100000000Z"
    cursor.start_reading("launcher-a")  # an ordinary reconnect: "d" comes again first, then "e"
    assert [cursor.accept(line, 0.0) for line in ("2026-11-30T10:00:02.000000000Z d\n",
                                                  "2026-11-30T10:00:03.000000000Z e\n")] == [None, "e"]
    cursor.start_reading("launcher-b")  # another pod (the launcher replaced) has nothing to replay
    assert cursor.accept("2026-11-30T10:00:09.000000000Z f\n", 0.0) == "f"
    assert len(cursor.gaps) == 1


def test_a_resumed_runs_record_is_read_from_its_newest_start() -> None:
    record = "\n".join(json.dumps(e) for e in [
        {"event": "start", "step": 0, "total_steps": 4}, {"event": "step", "step": 1},
        {"event": "preempted", "step": 1},
        {"event": "start", "step": 1, "total_steps": 4}, {"event": "step", "step": 4}, {"event": "done", "step": 4}])
    assert [e["event"] for e in last_attempt(record + "\n")] == ["start", "step", "done"]
    assert outcome_from_events("j", last_attempt(record), 1.0, []).resumed_from == 1


def test_the_reconnect_window_covers_the_last_line_on_either_clock() -> None:
    cursor = LogCursor()
    assert cursor.since_seconds(100.0) is None  # nothing yet: from the start
    stamp = parse_timestamp("2026-11-30T10:00:00.500000000Z")[0]
    cursor.start_reading()
    cursor.accept("2026-11-30T10:00:00.500000000Z x", now=stamp + 30.0)  # read 30 s late (a reader behind)
    assert cursor.since_seconds(stamp + 42.0) == 42 + 10  # from its stamp: 41.5 s ago, plus the margin
    assert cursor.since_seconds(stamp + 32.0) == 32 + 10


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


# --- names -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["", "Upper", "under_score", "-lead", "trail-", "a" * 64, "dot.ted"])
def test_invalid_names_are_refused_with_the_rule(bad: str) -> None:
    with pytest.raises(InvalidName, match="volume name"):
        validate_name(bad, "volume")


def test_run_name_is_deterministic_per_flow_run() -> None:
    flow_run = UUID("7d2eaa95-c8df-43a7-b772-5e3435d03a6e")
    assert run_name(flow_run) == run_name(str(flow_run)) == "train-7d2eaa95c8df"
    assert run_name(flow_run, prefix="restore") == "restore-7d2eaa95c8df"
    assert run_name(flow_run, key="lanes-3") == run_name("00000000-0000-0000-0000-000000000000", key="lanes-3") \
        == "train-lanes-3"  # a keyed run is the same run whatever flow run resumes it
    for bad in ("Lanes", "-x", "a" * 25):
        with pytest.raises(ValueError, match="run_key"):
            run_name(flow_run, key=bad)


def test_snapshot_name_fits_63_characters_and_keeps_the_run() -> None:
    name = snapshot_name("v" * 60, "train-7d2eaa95c8df")
    assert len(name) <= 63 and name.endswith("-train-7d2eaa95c8df")
    assert snapshot_name("demo", "train-1") == "demo-train-1"


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


# --- reports and lineage -----------------------------------------------------------------------------

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


# --- champion ----------------------------------------------------------------------------------------

def test_champion_decisions() -> None:
    assert decide_champion(None, 0.1).promote
    assert decide_champion(0.80, 0.81).promote
    assert not decide_champion(0.80, 0.80).promote  # equal is not better
    assert not decide_champion(0.80, 0.805, min_improvement=0.01).promote
    assert "champion kept" in decide_champion(0.9, 0.5).reason


def test_models_are_compared_without_the_run_time_rule() -> None:
    busy = {"accuracy": 0.0, "fp": 0.0, "fn": 1.0, "untimed_accuracy": 0.93, "untimed_fp": 0.1, "untimed_fn": 0.05,
            "over_time_limit": 40}
    idle = {"accuracy": 0.81, "fp": 0.2, "fn": 0.2, "untimed_accuracy": 0.81, "untimed_fp": 0.2, "untimed_fn": 0.2,
            "over_time_limit": 0}
    assert selection_accuracy(busy) == 0.93 and selection_accuracy({"accuracy": 0.7}) == 0.7  # older records
    rows = [{"index": 0, "state": "Completed", "run": "train-a", "metrics": idle, "params": {"lr": 0.05},
             "steps": 30},
            {"index": 1, "state": "Completed", "run": "train-b", "metrics": busy, "params": {"lr": 0.02},
             "steps": 30},
            {"index": 2, "state": "Failed", "params": {"lr": 0.3}, "error": "boom"}]
    table = leaderboard(rows, ["lr"])
    assert [row["run"] for row in table] == ["train-b", "train-a", "-"]  # the better model first, busy or not
    assert table[0] == {"rank": 1, "trial": 1, "run": "train-b", "state": "Completed", "lr": 0.02,
                        "val accuracy": 0.93, "val official accuracy": 0.0, "steps": 30,
                        "test accuracy": None, "test official accuracy": None}
    assert table[2]["val accuracy"] is None and table[2]["state"] == "Failed"


def test_pruned_trials_rank_below_finished_ones_at_the_score_they_were_stopped_at() -> None:
    late = {"accuracy": 0.6, "untimed_accuracy": 0.6}
    rows = [{"index": 0, "state": "Pruned", "run": "train-p", "params": {"lr": 0.3}, "steps": 45,
             "val": [{"step": 20, "accuracy": 0.2, "untimed_accuracy": 0.3}, {"step": 40, **late}]},
            {"index": 1, "state": "Completed", "run": "train-c", "params": {"lr": 0.05}, "steps": 80,
             "metrics": {"accuracy": 0.5, "untimed_accuracy": 0.5}},
            {"index": 2, "state": "Failed", "params": {"lr": 0.1}, "error": "boom"}]
    table = leaderboard(rows, ["lr"])
    # 0.6 at step 40 is not a finished run's score: the finished run ranks first, the pruned one after it.
    assert [(row["run"], row["state"], row["val accuracy"], row["steps"]) for row in table] == [
        ("train-c", "Completed", 0.5, 80), ("train-p", "Pruned", 0.6, 45), ("-", "Failed", None, None)]


def test_stopped_runs_outcome_says_why_and_keeps_the_val_curve() -> None:
    events = [{"event": "start", "step": 0, "total_steps": 80}, {"event": "step", "step": 40},
              {"event": "val", "step": 40, "accuracy": 0.0, "untimed_accuracy": 0.0},
              {"event": "checkpoint", "step": 45}, {"event": "stopped", "step": 45, "reason": "pruned",
                                                     "state": "Pruned"}]
    outcome = outcome_from_events("j", events, 2.0, [])
    assert outcome.steps == 45 and outcome.total_steps == 80 and outcome.eval == {}
    assert outcome.stopped == {"step": 45, "reason": "pruned", "state": "Pruned"}
    assert outcome.val == [{"step": 40, "accuracy": 0.0, "untimed_accuracy": 0.0}]
    finished = outcome_from_events("j", [*events[:3], {"event": "eval"}, {"event": "done", "step": 80}], 2.0, [])
    assert finished.stopped is None and finished.steps == 80


@pytest.mark.parametrize(("name", "kind"), [("none", "NopPruner"), ("median", "MedianPruner"),
                                            ("successive_halving", "SuccessiveHalvingPruner"),
                                            ("hyperband", "HyperbandPruner")])
def test_each_pruner_name_is_optunas_pruner(name: str, kind: str) -> None:
    from flows.sweep import make_pruner

    assert type(make_pruner(name, trials=8, min_resource=10)).__name__ == kind


def test_the_median_pruner_stops_a_trial_below_the_median_of_finished_trials_after_as_many_images() -> None:
    """The judge a trial's wait loop calls, against a real Optuna study: quiet until one trial finished, then
    a trial worse after as many training images gets a "Pruned" verdict naming the images and step, and
    keeps it; a score replayed from an adopted log is not reported twice."""
    import threading

    import optuna
    from optuna.distributions import FloatDistribution

    from flows.sweep import TrialJudge, make_pruner

    study = optuna.create_study(direction="maximize", pruner=make_pruner("median", trials=4, min_resource=20))
    lock, space = threading.Lock(), {"lr": FloatDistribution(0.01, 0.1)}
    first = study.ask(space)
    assert TrialJudge(first, "median", lock, images_per_step=2)(10, 0.7) is None  # nothing finished to compare with
    study.tell(first, 0.8)
    assert study.trials[0].intermediate_values == {20: 0.7}  # heard after 10 steps x 2 images
    second = study.ask(space)
    assert TrialJudge(second, "median", lock, images_per_step=2)(10, 0.75) is None  # as good after 20 images
    # Batch 4: after 5 steps it has seen the 20 images the first trial had seen after 10.
    hopeless = TrialJudge(study.ask(space), "median", lock, images_per_step=4)
    verdict = hopeless(5, 0.1)
    assert verdict is not None and verdict.state == "Pruned"
    assert "val accuracy 0.1000 after 20 training images (step 5)" in verdict.reason
    assert hopeless(10, 0.9) is verdict  # it stands: a retried run is stopped at its next score
    assert json.loads(verdict.request(5)) == {"reason": verdict.reason, "state": "Pruned", "requested_at_step": 5}
    replayed = TrialJudge(study.ask(space), "median", lock, images_per_step=2)
    assert replayed(10, 0.9) is None and replayed(10, 0.0) is None  # the same step again is not reported


def test_a_halving_pruners_first_rung_is_eval_every_steps_of_the_smallest_batch_the_space_allows() -> None:
    from flows.search import check_space
    from flows.sweep import smallest_images_per_step

    base = TrainParams(source=source(), batch_size=8, workers=2)
    assert smallest_images_per_step(base, check_space({"lr": {"low": 0.01, "high": 0.1}})) == 16
    assert smallest_images_per_step(base, check_space({"batch_size": {"choices": [4, 2, 8]}})) == 4
    assert smallest_images_per_step(base, check_space({"workers": {"low": 1, "high": 4, "step": 1}})) == 8



# --- parameters and sweeps ---------------------------------------------------------------------------

def test_params_validate_with_field_names() -> None:
    with pytest.raises(ValidationError, match="lr"):
        TrainParams(source=source(), lr=0)
    with pytest.raises(ValidationError, match="sha256"):
        DataSource(url="https://x/a.zip", sha256="nope")
    with pytest.raises(ValidationError, match="url"):
        DataSource(url="ftp://x/a.zip", sha256=SHA)
    with pytest.raises(ValidationError, match="volume"):
        TrainParams(source=source(), volume="Bad_Name")
    with pytest.raises(ValidationError, match="bogus"):
        TrainParams(source=source(), bogus=1)


def test_params_round_trip_through_a_lineage_record_without_the_secret() -> None:
    params = TrainParams(source=source(), epochs=7, lr=0.02)
    record = params.for_record()
    assert record["source_artifacts"] == [{"url": "https://mirror.example.org/train_set.zip", "sha256": SHA,
                                           "kind": "archive"}]
    rebuilt = params_from_record(record, volume="restored")
    assert (rebuilt.epochs, rebuilt.lr, rebuilt.volume) == (7, 0.02, "restored")
    assert rebuilt.source.to_artifacts() == [Artifact("https://mirror.example.org/train_set.zip", SHA)]
    # A record from before datasets were lists of artifacts: one archive.
    old = {**{k: v for k, v in record.items() if k != "source_artifacts"},
           "source_url": "https://mirror.example.org/train_set.zip", "source_sha256": SHA}
    assert params_from_record(old).source.to_artifacts() == rebuilt.source.to_artifacts()


def test_a_dataset_is_a_list_of_artifacts_and_one_archive_still_works() -> None:
    three = DataSource(artifacts=[{"url": "https://m.example/train_set.zip", "sha256": SHA},
                                  {"url": "https://m.example/test_set.zip", "sha256": "b" * 64},
                                  {"url": "https://m.example/test_label.json", "sha256": "c" * 64, "kind": "file"}])
    assert [a.kind for a in three.to_artifacts()] == ["archive", "archive", "file"]
    assert DataSource(url="https://m.example/train_set.zip", sha256=SHA).to_artifacts() == \
        [Artifact("https://m.example/train_set.zip", SHA, "archive")]
    with pytest.raises(ValidationError, match=r"artifacts\.1\.kind"):
        DataSource(artifacts=[{"url": "https://m.example/a.zip", "sha256": SHA},
                              {"url": "https://m.example/b", "sha256": SHA, "kind": "folder"}])
    with pytest.raises(ValidationError, match="at least 1 item"):
        DataSource(artifacts=[])
    keys = {dataset_key(three.to_artifacts()), dataset_key(list(reversed(three.to_artifacts())))}
    assert len(keys) == 1 and dataset_key([Artifact("https://m.example/train_set.zip", SHA)]) == SHA[:16]


def test_flows_take_the_fields_of_train_params_as_their_own_top_level_parameters() -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.nightly import nightly_retrain
    from flows.sweep import sweep
    from flows.train import train_pipeline

    fields = list(TrainParams.model_fields)
    for flow, extras in ((train_pipeline, ["run_key"]), (nightly_retrain, ["min_improvement"]),
                         (sweep, ["grid", "runs", "max_concurrent", "search", "space", "trials", "seed", "study",
                                  "pruner"])):
        schema = flow.parameters.model_dump_for_openapi()
        assert list(schema["properties"]) == fields + extras, flow.name
        assert all(schema["properties"][name].get("description") for name in fields )
    validated = train_pipeline.validate_parameters({"source": source().model_dump(), "lr": 0.02})
    assert TrainParams.from_flow_parameters(validated) == TrainParams(source=source(), lr=0.02)
    with pytest.raises(ParameterTypeError, match="volume"):
        train_pipeline.validate_parameters({"source": source().model_dump(), "volume": "Not_A_Name"})


def test_takes_train_params_refuses_a_flow_it_cannot_wrap() -> None:
    def clashes(params: TrainParams, lr: float) -> None: ...

    def takes_no_params(volume: str) -> None: ...

    with pytest.raises(TypeError, match=r"\['lr'\] clash"):
        takes_train_params(clashes)
    with pytest.raises(TypeError, match="first parameter"):
        takes_train_params(takes_no_params)


def test_sweep_expands_grid_then_runs() -> None:
    base = TrainParams(source=source())
    sets = expand_sweep(base, {"lr": [0.01, 0.02], "batch_size": [2, 4]}, [{"workers": 1}])
    assert [(p.batch_size, p.lr, p.workers) for p in sets] == [(2, 0.01, 2), (2, 0.02, 2), (4, 0.01, 2),
                                                               (4, 0.02, 2), (4, 0.05, 1)]
    assert len(expand_sweep(base, {}, [])) == 1
    with pytest.raises(SweepError, match=r"sweep run 1 .*epochs"):
        expand_sweep(base, {}, [{"epochs": 2}, {"epochs": 0}])
    with pytest.raises(SweepError, match="grid entry 'lr'"):
        expand_sweep(base, {"lr": []}, [])


# --- search spaces -----------------------------------------------------------------------------------

def test_a_search_space_is_checked_against_the_fields_it_names() -> None:
    from flows.search import SearchChoices, SearchRange, SearchSpaceError, check_space, distributions

    dimensions = check_space({"lr": {"low": 0.001, "high": 0.3, "log": True}, "batch_size": {"choices": [2, 4, 8]},
                              "epochs": {"low": 1, "high": 5, "step": 2}, "preset": {"choices": ["cpu-demo"]}})
    assert dimensions["lr"] == SearchRange(low=0.001, high=0.3, log=True)
    assert dimensions["batch_size"] == SearchChoices(choices=[2, 4, 8])
    found = distributions(dimensions)
    assert (found["lr"].low, found["lr"].high, found["lr"].log) == (0.001, 0.3, True)
    assert type(found["epochs"]).__name__ == "IntDistribution" and found["epochs"].step == 2
    assert found["batch_size"].choices == (2, 4, 8)
    refused = {
        "unknown": ({"learning_rate": {"low": 0.1, "high": 0.2}},
                    r"space\['learning_rate'\]: TrainParams has no field"),
        "not searched": ({"volume": {"choices": ["a", "b"]}}, r"space\['volume'\]: volume is the same for every trial"),
        "low >= high": ({"lr": {"low": 0.3, "high": 0.3}}, r"space\['lr'\]: low \(0.3\) must be below high"),
        "log at 0": ({"lr": {"low": 0, "high": 0.3, "log": True}}, r"space\['lr'\]: a log range must stay above 0"),
        "past a limit": ({"lr": {"low": 0.1, "high": 20}}, r"space\['lr'\]: high 20 is outside what lr allows"),
        "wrong type": ({"batch_size": {"choices": [2, "4"]}}, r"space\['batch_size'\]: choice '4' is not a valid"),
        "fractional int": ({"epochs": {"low": 1, "high": 2.5}}, r"space\['epochs'\]: epochs is a whole number"),
        "range of a literal": ({"preset": {"low": 0, "high": 1}}, r"space\['preset'\]: preset is not a number"),
        "typo in a range": ({"lr": {"low": 0.1, "hihg": 0.2}}, r"space\['lr'\]: .*hihg"),
        "log and step": ({"lr": {"low": 0.1, "high": 0.2, "log": True, "step": 0.05}}, r"log or step, not both"),
        "a bound as text": ({"lr": {"low": "0.001", "high": 0.2}}, r"space\['lr'\]: low: "),
        "repeated choice": ({"lr": {"choices": [0.1, 0.1]}}, r"the choices repeat a value"),
        "empty": ({}, "space is empty"),
    }
    for case, (space, message) in refused.items():
        with pytest.raises(SearchSpaceError, match=message):
            check_space(space)
            pytest.fail(f"{case}: accepted")
