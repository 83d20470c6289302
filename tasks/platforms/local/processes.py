"""The local platform's processes: ``horovodrun`` for training, ``python -m`` for the other stages.

Separate because supervising them is its own craft: each runs in a process group of its own (so a
cancel, a deadline or an interrupted task stops all of it), its stdout and stderr are read as they come,
and a training run leaves a record (``launcher.json`` in its run folder) by which a later process of the
same flow run adopts it, resumes it, or stops what an earlier one left running (checking that the group
is still ours: pids get reused).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.launch import (
    DISCOVERY_SCRIPT,
    HOROVODRUN_MODULE,
    STOPPED_ON_REQUEST,
    ElasticLaunch,
    JobOutput,
    discovery_script,
    elastic_horovodrun_command,
    horovodrun_command,
    local_elastic_hosts,
    read_exit,
)
from tasks.platforms.base import (
    EventSink,
    LogSink,
    NotOurJob,
    TrainingFailed,
    TrainingHandle,
    TrainingInterrupted,
    TrainingOutcome,
    TrainingSpec,
    VolumeRef,
    last_attempt,
    outcome_from_events,
)
from tasks.platforms.local.files import now, read_json, write_json
from tasks.processes import stop_group, stop_process
from training.warm import hosts_text, keeper_lock

if TYPE_CHECKING:
    from tasks.platforms.local import LocalPlatform

LAUNCHER_RECORD = "launcher.json"
ELASTIC_HOSTS_FILE = "elastic_hosts"  # what the discovery script prints

_jobs: dict[str, subprocess.Popen] = {}
_jobs_lock = threading.Lock()


# --- training ---------------------------------------------------------------------------------------
def submit(platform: LocalPlatform, spec: TrainingSpec) -> TrainingHandle:
    run_dir = platform.inside(spec.volume, spec.run_dir)
    if spec.elastic is not None:  # a probe of seconds: before the lock every submit of this process takes
        _check_elastic(platform, spec)
    record_file = run_dir / LAUNCHER_RECORD
    with _jobs_lock:
        running = _jobs.get(spec.job_name)
        # Running, or ended before anyone read its end (between the submit that started it and this one: a stop
        # request met at once): adopted either way, and ``wait`` reads its output and exit. Only ``wait`` and
        # ``cancel`` forget a job, so one still here was never waited for; starting it again would redo it.
        if running is not None:
            return TrainingHandle(job_name=spec.job_name, spec=spec, state="running", adopted=True,
                                  details={"pid": running.pid})
        record = read_json(record_file)
        # Finished: trained to its end, or stopped for good on request (a pruned trial is not resumed).
        if record.get("exit_code") == 0 and ((run_dir / "model.pt").is_file() or
                                             record.get("reason") == STOPPED_ON_REQUEST):
            return TrainingHandle(job_name=spec.job_name, spec=spec, state="succeeded", adopted=True,
                                  details=record)
        if record.get("exit_code") is None and record.get("pgid"):
            other = _another_owner(record, spec.labels.get("flow-run"))
            if other is not None and _is_our_group(int(record["pgid"]), str(run_dir)):
                raise NotOurJob(f"training {spec.job_name} is still running for flow run {other}, another run of "
                                "the same run key: this run neither adopts nor stops it. Wait for that run to end or "
                                "cancel it, or give this run another run_key")
            # Started by an earlier process of this flow run that is gone: stop it before resuming.
            _stop_group(int(record["pgid"]), str(run_dir))
        python = platform.interpreter()
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = _launcher_command(platform, spec, python, run_dir)
        env = {**os.environ, "OMP_NUM_THREADS": str(platform.threads_per_worker), "PYTHONUNBUFFERED": "1",
               "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                   env=env, start_new_session=True)  # own process group: cancel kills it all
        _jobs[spec.job_name] = process
        attempts = int(record.get("attempts", 0)) + 1
        details = {"job_name": spec.job_name, "pid": process.pid, "pgid": process.pid, "command": cmd,
                   "started_at": now(), "attempts": attempts, "exit_code": None,
                   "owner": spec.labels.get("flow-run")}
        write_json(record_file, details)
    return TrainingHandle(job_name=spec.job_name, spec=spec, state="running", details=details)


def wait(platform: LocalPlatform, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
         timeout_s: float) -> TrainingOutcome:
    run_dir = platform.inside(handle.spec.volume, handle.spec.run_dir)
    if handle.state == "succeeded":
        return _outcome_from_metrics(handle.job_name, run_dir, 0.0)
    with _jobs_lock:
        process = _jobs.get(handle.job_name)
    if process is None:
        raise TrainingInterrupted(f"job {handle.job_name} is not running in this process any more; "
                                  "submitting it again resumes it from its newest checkpoint")
    started = time.monotonic()
    output = JobOutput(on_event, on_log, events_from_any_rank=handle.spec.elastic is not None)
    try:
        for stream, raw in _merged_lines(process, deadline=started + timeout_s):
            output.feed(raw, may_be_event=stream == "stdout")
        output.finish()
        code = process.wait()
    except BaseException as exc:  # timeout, task cancellation, flow-run termination: leave nothing behind
        _stop_group(process.pid, str(run_dir))
        _finish_record(run_dir, None, "timed out" if isinstance(exc, _Deadline) else "stopped")
        with _jobs_lock:
            _jobs.pop(handle.job_name, None)
        if isinstance(exc, _Deadline):  # running it again would take as long: not transient
            raise TrainingFailed(f"training job {handle.job_name} did not finish within {timeout_s:.0f} s; it was "
                                 "stopped (raise the timeout to let it run longer)", list(output.tail)) from None
        raise
    with _jobs_lock:
        _jobs.pop(handle.job_name, None)
    reading = read_exit(code, output.exit_lines, output.events)
    _finish_record(run_dir, code if reading.succeeded or not reading.resumable else None, reading.reason)
    if reading.succeeded:
        return outcome_from_events(handle.job_name, output.events, time.monotonic() - started, list(output.tail))
    if reading.resumable:
        raise TrainingInterrupted(f"training job {handle.job_name} stopped: {reading.reason}")
    raise TrainingFailed(f"training job {handle.job_name} failed: {reading.reason}", list(output.tail))


def _another_owner(record: dict, owner: str | None) -> str | None:
    """The flow run that started the recorded training when it is not ``owner`` (None: ``owner``'s, or nobody to
    compare: a record of a laneflow that did not write one)."""
    started_by = record.get("owner")
    return started_by if owner is not None and started_by and started_by != owner else None


def cancel(platform: LocalPlatform, job_name: str, volume: VolumeRef, owner: str | None = None) -> bool:
    run_dir = platform.volume_path(volume) / "runs" / job_name
    record = read_json(run_dir / LAUNCHER_RECORD)
    if (other := _another_owner(record, owner)) is not None:
        if record.get("exit_code") is not None:  # that run's training is over: nothing of this run's to stop
            return False
        raise NotOurJob(f"training {job_name} was started by flow run {other}, not {owner} (another run of the same "
                        "run key): left running")
    with _jobs_lock:
        process = _jobs.pop(job_name, None)
    pgid = process.pid if process else read_json(run_dir / LAUNCHER_RECORD).get("pgid")
    if not pgid:
        return False
    stopped = _stop_group(int(pgid), str(run_dir))
    if stopped:
        _finish_record(run_dir, None, "cancelled")
    return stopped


#: The most workers a local elastic run may have: each is a host name of its own (``local_elastic_hosts``).
LOCAL_ELASTIC_MAX_WORKERS = 32


def _launcher_command(platform: LocalPlatform, spec: TrainingSpec, python: str, run_dir: Path) -> list[str]:
    """horovodrun for the job: a fixed one on localhost, or an elastic one over the hosts of a discovery script
    written into the run's folder (one host name per worker slot, all of them this machine)."""
    # horovodrun that asks how Horovod was built once per installed build, not at every launch (a torch import)
    horovodrun, data_root = [python, *HOROVODRUN_MODULE], str(platform.inside(spec.volume, spec.data_dir))
    if spec.elastic is None:
        return horovodrun_command(horovodrun, python, spec, data_root, str(run_dir))
    # The hosts a warm spare is ready for, as the launcher's keeper of spares lists them (training.warm): a
    # worker that joins mid-run then starts at once instead of keeping the others waiting while it imports.
    script, hosts_file = run_dir / DISCOVERY_SCRIPT, run_dir / ELASTIC_HOSTS_FILE
    hosts = local_elastic_hosts(spec.elastic.max_workers)
    script.write_text(discovery_script(str(hosts_file), f"laneflow: the local hosts of elastic run {spec.job_name} "
                                                        "that have a worker or a warm spare ready for one",
                                       str(keeper_lock(hosts_file)), hosts_text(hosts, 1)))
    script.chmod(0o755)
    launch = ElasticLaunch(str(script), 1, (platform.elastic_cooldown_min_s, platform.elastic_cooldown_max_s),
                           platform.elastic_timeout_s, "lo")
    return [python, "-m", "training.warm", "launch", "--hosts", ",".join(hosts), "--slots", "1", "--hosts-file",
            str(hosts_file), "--",
            *elastic_horovodrun_command(horovodrun, python, spec, data_root, str(run_dir), launch, through_spares=True)]


def _check_elastic(platform: LocalPlatform, spec: TrainingSpec) -> None:
    """What an elastic run needs here, said before anything starts, with what to do: at most
    ``LOCAL_ELASTIC_MAX_WORKERS`` workers, and Horovod's Gloo controller (horovodrun refuses elastic mode without
    it)."""
    if spec.elastic is not None and spec.elastic.max_workers > LOCAL_ELASTIC_MAX_WORKERS:
        raise ValueError(f"elastic.max_workers {spec.elastic.max_workers} is more than the local platform's "
                         f"{LOCAL_ELASTIC_MAX_WORKERS}; lower it, or train on a cluster")
    python = platform.interpreter()
    # Horovod's own check, answered once per installed build (training.horovodrun): horovodrun asks it too.
    probe = subprocess.run([python, "-c", "import sys; from training.horovodrun import recorded_build; "
                                          "sys.exit(0 if recorded_build()['gloo'] else 3)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode == 3:
        raise ValueError(f"elastic training needs Horovod built with Gloo, and the Horovod of {python} has none: "
                         "rebuild it with HOROVOD_WITH_GLOO=1 (scripts/install_horovod.sh), or train without elastic")
    if probe.returncode != 0:
        raise ValueError(f"could not ask the Horovod of {python} whether it has Gloo: "
                         f"{probe.stderr.strip().splitlines()[-1:] or probe.returncode}")


# --- the other stages -------------------------------------------------------------------------------
def run_module(platform: LocalPlatform, args: list[str], log: LogSink, what: str, timeout_s: float,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python <args>`` (``-m module ...``) on all cores in its own process group: what it prints goes
    to ``log`` as it comes, its last JSON event on stdout is the result.

    The deadline is enforced here, from whichever thread calls: past ``timeout_s``, or when the task is
    interrupted, the whole group is stopped. Exit code 2 (the module refused its input) raises
    ValueError, not retried; anything else RuntimeError.
    """
    settings = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(max(1, os.cpu_count() or 1)),
                "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([platform.interpreter(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, bufsize=1, env=settings, start_new_session=True)
    output = JobOutput(on_event=lambda _: None, on_log=log)  # events are kept; the last is the result
    try:
        for stream, raw in _merged_lines(process, deadline=time.monotonic() + timeout_s):
            output.feed(raw, may_be_event=stream == "stdout")
        output.finish()
        code = process.wait()
    except BaseException as exc:
        stop_process(process)
        if isinstance(exc, _Deadline):  # it would take as long again: not retried
            raise RuntimeError(f"{what} did not finish within {timeout_s:.0f} s; it was stopped") from None
        raise
    if code != 0 or not output.events:
        kind = ValueError if code == 2 else RuntimeError
        reasons = [line.removeprefix("error: ") for line in output.tail if line.startswith("error: ")]
        reason = f": {reasons[-1]}" if reasons else ""
        raise kind(f"{what} failed (exit code {code}){reason}\n--- log tail ---\n" + "\n".join(output.tail))
    result = dict(output.events[-1])
    result.pop("event")
    return result


# --- helpers ----------------------------------------------------------------------------------------
def _finish_record(run_dir: Path, exit_code: int | None, reason: str) -> None:
    record = read_json(run_dir / LAUNCHER_RECORD)
    if record:
        write_json(run_dir / LAUNCHER_RECORD, {**record, "exit_code": exit_code, "reason": reason,
                                               "finished_at": now()})


def _is_our_group(pgid: int, run_dir: str) -> bool:
    """The group leader is the horovodrun we started for this run (pids get reused): ``training.horovodrun``.
    A process still in its exec shows an empty command line for a moment (the kernel closes the exec'ing
    process's close-on-exec files, which ends ``Popen``'s wait, before it sets up the new arguments): read it
    again then."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        if cmdline != [b""] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return any(part.endswith(b"horovodrun") for part in cmdline) and run_dir.encode() in cmdline


def _stop_group(pgid: int, run_dir: str, grace_s: float = 15.0) -> bool:
    """SIGTERM the job's process group (the trainer checkpoints and exits), SIGKILL what is left after ``grace_s``."""
    if not _is_our_group(pgid, run_dir):
        return False
    stop_group(pgid, (signal.SIGTERM,), grace_s)
    return True


class _Deadline(Exception):
    """The launcher's own timeout passed."""


def _merged_lines(process: subprocess.Popen, deadline: float) -> Iterator[tuple[str, str]]:
    """Lines from stdout and stderr as they come; ``_Deadline`` past ``deadline``."""
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()

    def pump(stream_name: str, stream: Any) -> None:
        for line in stream:
            lines.put((stream_name, line))
        lines.put((stream_name, None))

    for name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
        threading.Thread(target=pump, args=(name, stream), daemon=True, name=f"launcher-{name}").start()
    open_streams = 2
    while open_streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Deadline
        try:
            name, line = lines.get(timeout=min(remaining, 5.0))
        except queue.Empty:
            continue
        if line is None:
            open_streams -= 1
        else:
            yield name, line


def _outcome_from_metrics(job_name: str, run_dir: Path, duration_s: float) -> TrainingOutcome:
    return outcome_from_events(job_name, last_attempt((run_dir / "metrics.jsonl").read_text()), duration_s, [])
