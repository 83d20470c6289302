"""Launching training: the horovodrun command, its output lines, reading its exit, and which failures are retried."""

from __future__ import annotations

import http.client
import os
import shutil
import sys
from pathlib import Path

import pytest

from tasks.k8s.diagnose import pod_ends, scheduling_advice
from tasks.launch import (
    JobOutput,
    RankLines,
    horovodrun_command,
    parse_output_line,
    read_exit,
    read_mpijob_failure,
)
from tasks.platforms import TrainingFailed, TrainingInterrupted, TrainingSpec, VolumeRef
from tasks.platforms.cluster.mpijob_ends import SeenPods, workers_replaced_under
from tasks.processes import run_to_end
from tasks.retry import is_transient
from tests.conftest import PROJECT_ROOT
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


def test_a_line_cut_by_another_ranks_output_is_put_back_together() -> None:
    """As mpirun 4.1 printed it with rank 0 writing an event in two writes and rank 1 writing between them:
    the event arrives once, whole, and rank 1's line is rank 1's."""
    events, logged = [], []
    output = JobOutput(on_event=events.append, on_log=logged.append)
    for line in ['[1,0]<stdout>:{"event": "st[1,1]<stdout>:rank one says 0\n', '[1,0]<stdout>:ep", "i": 0}\n',
                 '[1,0]<stdout>:{"event": "st[1,0]<stdout>:ep", "i": 1}\n', "[1,1]<stdout>:rank one says 1\n",
                 '[1,0]<stdout>:{"event": "done"}', '[1,0]<stdout>:{"ev[1,1]<stdout>:bye\n']:
        output.feed(line)
    assert events == [{"event": "step", "i": 0}, {"event": "step", "i": 1}, {"event": "done"}]
    output.finish()  # the output ended with rank 0's line cut short: logged as it is, not dropped
    assert logged == ["rank one says 0", "rank one says 1", "bye", '{"ev']
    untagged = RankLines()  # mpirun's own words are cut the same way
    assert untagged.feed("mpirun: still[1,2]<stderr>:late\n") == [(2, "late")]
    assert untagged.feed(" waiting\n") == [(None, "mpirun: still waiting")]


#: Rank 0 writes each event in two writes and rank 1 writes a line between them (a file each says when),
#: both unbuffered, as the trainer's ranks write at once under mpirun.
TWO_WRITERS = """
import os, sys, time
from pathlib import Path
rank, here = int(os.environ["OMPI_COMM_WORLD_RANK"]), Path(sys.argv[1])
def wait_for(name):
    while not (here / name).exists():
        time.sleep(0.01)
for i in range(int(sys.argv[2])):
    if rank == 0:
        os.write(1, b'{"event": "step", "st')
        (here / f"half-{i}").touch()
        wait_for(f"other-{i}")
        os.write(1, b'ep": %d, "loss": 0.5}\\n' % i)
    else:
        wait_for(f"half-{i}")
        os.write(1, b"rank one at %d\\n" % i)
        (here / f"other-{i}").touch()
from training.ranks import launcher_rank
print(f"label rank{launcher_rank(os.environ)}", file=sys.stderr, flush=True)
"""


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI's mpirun (make install puts it here)")
def test_two_ranks_writing_at_once_under_real_mpirun_lose_no_event_and_keep_their_labels(tmp_path: Path) -> None:
    script, rounds = tmp_path / "two_writers.py", 20
    script.write_text(TWO_WRITERS)
    done = run_to_end(["mpirun", "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np", "2",
                       sys.executable, str(script), str(tmp_path), str(rounds)], 120, cwd=PROJECT_ROOT,
                      env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    events, logged = [], []
    output = JobOutput(on_event=events.append, on_log=logged.append)
    for line in (done.stdout + done.stderr).splitlines(keepends=True):  # a pod's log: both streams in one
        output.feed(line)
    output.finish()
    assert events == [{"event": "step", "step": i, "loss": 0.5} for i in range(rounds)]
    assert sorted(line for line in logged if line.startswith("rank one")) == sorted(
        f"rank one at {i}" for i in range(rounds))
    assert sorted(line for line in logged if line.startswith("label")) == ["label rank0", "label rank1"]


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
    reading = read_mpijob_failure(reason, None, lines, [], [])
    assert not reading.succeeded and reading.resumable is resumable and why in reading.reason


@pytest.mark.parametrize(("message", "says"), [
    ("0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint {sku: gpu}. "
     "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.",
     "lower gpus_per_worker or workers, or add nodes with those resources (a cluster autoscaler needs a node pool "
     "that has them); or, if the nodes that have it are tainted, add a matching toleration"),
    ("0/1 nodes are available: 1 node(s) had untolerated taint {kubernetes.azure.com/scalesetpriority: spot}. "
     "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.",
     "the nodes that could take the pod are tainted: add a matching toleration"),
    ("0/3 nodes are available: 3 node(s) had untolerated taint {node.kubernetes.io/not-ready: }. preemption: ...",
     "lower gpus_per_worker"),  # the node lifecycle's own taint: not the block's to tolerate
    ("0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector. preemption: ...",
     "no node has the labels the platform block's node_selector and affinity require"),
])
def test_advice_for_a_pod_no_node_takes_follows_the_schedulers_reasons(message: str, says: str) -> None:
    assert says in scheduling_advice(message)


#: What the launcher says when it cannot reach a worker at start: horovodrun's ssh check and OpenSSH's client
#: (horovod 0.28.1 runner/launch.py), and ORTE's [failed-daemon-launch] (OpenMPI 4.1 help-errmgr-base.txt).
UNRESOLVED = ["ssh not successful for host train-x-worker-1.train-x.laneflow.svc:",
              "ssh: Could not resolve hostname train-x-worker-1.train-x.laneflow.svc: Name or service not known",
              "", "Traceback (most recent call last):", "RuntimeError: could not connect to some hosts via ssh"]
REFUSED = ["ssh: connect to host train-x-worker-0.train-x port 22: Connection refused",
           "ORTE was unable to reliably start one or more daemons."]
#: A setting, not a race: the worker's host key refused (an image without the operator's ssh client settings).
HOST_KEY = ["ssh not successful for host train-x-worker-0.train-x:", "Host key verification failed.", "",
            "RuntimeError: could not connect to some hosts via ssh"]
LOST = ["ORTE has lost communication with a remote daemon.", "", "  HNP daemon   : [[5107,0],0] on node launcher",
        "  Remote daemon: [[5107,0],2] on node train-x-worker-1"]


@pytest.mark.parametrize(("code", "lines", "events", "kind", "resumable", "says"), [
    (1, UNRESOLVED, [], "start-failed", True, "could not start on every worker (ssh: Could not resolve hostname"),
    (1, REFUSED, [], "start-failed", True, "port 22: Connection refused"),
    (1, REFUSED, [{"event": "start"}, {"event": "step"}], "failed", False, "exit code 1"),  # it had started
    (1, HOST_KEY, [], "failed", False, "could not log in to every worker over ssh (Host key verification failed.)"),
    (1, LOST, [{"event": "start"}], "preempted", True, "a worker was lost while it ran (ORTE has lost"),
    (1, ["Process name: [[5107,1],1]", "Exit code:    2", *LOST], [{"event": "start"}], "refused", False,
     "exit code 2"),  # a rank failed on its own first; the lost daemon is its teardown
    (137, MPIRUN_SIGNAL, [{"event": "start"}], "preempted", True, "signal 9 on rank 1"),
    (3, [], [], "failed", False, "exit code 3"),
])
def test_the_launchers_own_words_say_whether_it_never_started_or_lost_a_worker(
        code: int, lines: list[str], events: list[dict], kind: str, resumable: bool, says: str) -> None:
    output = JobOutput(on_event=lambda _: None, on_log=lambda _: None)
    for line in lines:
        output.feed(line, may_be_event=False)
    reading = read_exit(code, output.exit_lines, events)
    assert (reading.kind, reading.resumable, says in reading.reason) == (kind, resumable, True), reading.reason


def pod(name: str, role: str, terminated: dict | None = None, *, reason: str | None = None,
        disruption: str | None = None, limit: str | None = None) -> dict:
    """A pod as the API returns it, with what the kubelet reports of its end."""
    status: dict = {"phase": "Failed" if terminated or reason else "Running", "conditions": []}
    if reason:
        status["reason"] = reason
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    state = {"terminated": terminated} if terminated else {"running": {}}
    status["containerStatuses"] = [{"name": "worker", "state": state}]
    resources = {"limits": {"memory": limit}} if limit else {}
    return {"metadata": {"name": name, "labels": {"training.kubeflow.org/job-role": role}},
            "spec": {"containers": [{"name": "worker", "resources": resources}]}, "status": status}


def test_a_failed_mpijob_is_read_from_its_pods_first_oom_then_disruption_then_the_launcher() -> None:
    oom = pod("train-x-worker-1", "worker", {"exitCode": 137, "reason": "OOMKilled"}, limit="2Gi")
    evicted = pod("train-x-worker-0", "worker", {"exitCode": 143, "reason": "Error"},
                  disruption="EvictionByEvictionAPI")
    launcher = pod("train-x-launcher-abc", "launcher", {"exitCode": 1, "reason": "Error"})
    running = pod("train-x-worker-2", "worker")
    signalled = MPIRUN_SIGNAL  # what mpirun says when the OOM killer took a rank's whole container

    reading = read_mpijob_failure("MPIJobFailed", 1, signalled, [], pod_ends([launcher, oom, running]))
    assert (reading.kind, reading.resumable) == ("out-of-memory", False)
    assert "pod train-x-worker-1 ran out of memory: container worker, exit code 137 (OOMKilled; limits.memory 2Gi)" \
        in reading.reason and "raise worker_memory in the platform block" in reading.reason

    reading = read_mpijob_failure("MPIJobFailed", 1, LOST, [], pod_ends([launcher, evicted, running]))
    assert (reading.kind, reading.resumable) == ("preempted", True)
    assert "train-x-worker-0 EvictionByEvictionAPI" in reading.reason
    # The worker's PID 1 passed the stop on: the ranks checkpointed (exit 75), which the reading says first.
    checkpointed = ["Process name: [[5107,1],1]", "Exit code:    75"]
    reading = read_mpijob_failure("BackoffLimitExceeded/", 1, checkpointed, [{"event": "start"}],
                                  pod_ends([launcher, evicted]))
    assert reading.reason == "preempted: it checkpointed and can resume on rank 1 (its pods were stopped from " \
                             "outside: train-x-worker-0 EvictionByEvictionAPI)", reading.reason
    # The launcher's node shut down gracefully: the kubelet's reason says so, whatever the launcher exited with.
    shut_down = pod("train-x-launcher-def", "launcher", {"exitCode": 1, "reason": "Error"}, reason="Terminated")
    reading = read_mpijob_failure("BackoffLimitExceeded/Terminated", 1, [], [], pod_ends([shut_down]))
    assert reading.resumable and "train-x-launcher-def Terminated" in reading.reason
    # Evicted: resumable when the node ran short; not when the pod went over its own limits.
    pressure = pod("train-x-worker-0", "worker", reason="Evicted")
    pressure["status"]["message"] = "The node was low on resource: memory. Threshold quantity: 100Mi."
    own = pod("train-x-worker-0", "worker", reason="Evicted")
    own["status"]["message"] = "Usage of EmptyDir volume \"dshm\" exceeds the limit \"8Gi\"."
    assert [end.disruption for end in pod_ends([pressure, own])] == ["Evicted"]
    # A sidecar listed first (the kubelet sorts by name) does not hide the worker's OOM.
    sidecar = pod("train-x-worker-1", "worker", {"exitCode": 137, "reason": "OOMKilled"}, limit="2Gi")
    sidecar["status"]["containerStatuses"].insert(0, {"name": "istio-proxy", "state": {"terminated": {
        "exitCode": 0, "reason": "Completed"}}})
    assert pod_ends([sidecar])[0].out_of_memory

    # Nothing from outside: the launcher's own exit code, not a made-up 1.
    reading = read_mpijob_failure("MPIJobFailed", 2, [], [], pod_ends([launcher, running]))
    assert (reading.kind, reading.resumable) == ("refused", False)
    assert [end.name for end in pod_ends([launcher, running])] == ["train-x-launcher-abc"]  # a running pod says nothing



def created_at(pod_dict: dict, second: int) -> dict:
    pod_dict["metadata"]["creationTimestamp"] = f"2026-12-06T03:06:{second:02d}+00:00"
    return pod_dict


def test_workers_created_again_while_a_launcher_ran_are_seen_before_the_jobs_end_removes_them() -> None:
    """The operator creates every worker before the launcher, and afterwards only in place of one that is gone:
    a worker younger than the launcher that failed was taken from under it (a drain, an eviction), though neither
    its end nor horovodrun's words (exit 255 from a replacement still starting sshd) say so. The job's end
    removes the running replacements, so what a listing showed while it ran is kept per launcher."""
    first = created_at(pod("train-x-launcher-abc", "launcher", {"exitCode": 1, "reason": "Error",
                                                                "finishedAt": "2026-12-06T03:06:20+00:00"}), 10)
    second = created_at(pod("train-x-launcher-def", "launcher"), 30)
    kept = created_at(pod("train-x-worker-1", "worker"), 5)
    again = created_at(pod("train-x-worker-0", "worker"), 45)
    assert workers_replaced_under([first, second, kept, again], "train-x-launcher-def") == ["train-x-worker-0"]
    assert workers_replaced_under([first, kept, created_at(pod("train-x-worker-0", "worker"), 15)],
                                  "train-x-launcher-abc") == ["train-x-worker-0"]
    assert workers_replaced_under([kept, again], "train-x-launcher-gone") == []  # no such pod: nothing to say

    seen = SeenPods()
    seen.observe([first, second, kept, again])
    seen.observe([first, kept])  # the job's end removed the running ones: what was seen stays
    assert seen.replaced == {"train-x-launcher-def": {"train-x-worker-0"}}  # abc had ended when it came
    seen.observe([created_at(pod("train-x-launcher-ghi", "launcher"), 50), again])
    assert "train-x-launcher-ghi" not in seen.replaced  # created after the worker: it ran with that one

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
