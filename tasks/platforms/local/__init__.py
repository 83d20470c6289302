"""The local platform: a directory is the volume and ``horovodrun`` runs on this machine's CPUs.

Layout under the platform's home (``$LANEFLOW_HOME``, else ``~/.laneflow/local``)::

    volumes/<volume>/{downloads,datasets,runs}/     what the pipeline reads and writes
    snapshots/<snapshot>/{lineage.json,content/}     immutable copies (hard links where safe)

Needs no configuration: the flows' default platform name ``local`` resolves to ``LocalPlatform()``
unless a block of that name was saved.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from tasks.launch import STOPPED_ON_REQUEST, JobOutput, horovodrun_command, prepare_args, read_exit
from tasks.names import validate_name
from tasks.platforms.base import (
    EventSink,
    LogSink,
    Platform,
    SnapshotRef,
    TrainingFailed,
    TrainingHandle,
    TrainingInterrupted,
    TrainingOutcome,
    TrainingSpec,
    VolumeRef,
    last_attempt,
    outcome_from_events,
    paths_in,
)
from tasks.processes import stop_group, stop_process
from training.data.sources import Artifact

LAUNCHER_RECORD = "launcher.json"
LINEAGE_FILE = "lineage.json"
RESTORED_MARKER = ".laneflow-restored-from"
#: Deadlines of the stages that run a module of their own (a training run has its own, a parameter).
PREPARE_TIMEOUT_S = 12 * 3600
EVALUATE_TIMEOUT_S = 6 * 3600
PREDICT_TIMEOUT_S = 12 * 3600
#: Files the pipeline only ever replaces (new inode), never rewrites in place: safe to hard-link into
#: a snapshot. Everything else (json, metrics, overlays) is copied.
_LINKABLE_SUFFIXES = (".jpg", ".jpeg", ".pt")
#: Regenerable and large: never part of a snapshot.
_SKIPPED_DIRS = ("cache",)

_jobs: dict[str, subprocess.Popen] = {}
_jobs_lock = threading.Lock()


class LocalPlatform(Platform):
    """This machine: a folder per volume, ``horovodrun -np N`` on the CPUs, snapshots as hard-linked copies."""

    _block_type_name: ClassVar[str] = "Laneflow Local Platform"
    _block_type_slug: ClassVar[str] = "laneflow-local-platform"
    _description: ClassVar[str] = "Runs the laneflow DAG on this machine: folders as volumes, horovodrun on CPUs."

    home: str | None = Field(None, description="where volumes and snapshots live; default $LANEFLOW_HOME "
                                                "or ~/.laneflow/local")
    python: str | None = Field(None, description="interpreter with torch + horovod; default: this one")
    threads_per_worker: int = Field(1, ge=1, description="OMP threads per Horovod process")

    # --- paths ---------------------------------------------------------------------------------------
    def home_dir(self) -> Path:
        configured = self.home or os.environ.get("LANEFLOW_HOME") or "~/.laneflow/local"
        return Path(configured).expanduser().resolve()

    def volume_path(self, volume: VolumeRef | str) -> Path:
        name = volume.name if isinstance(volume, VolumeRef) else volume
        return self.home_dir() / "volumes" / validate_name(name, "volume")

    def _inside(self, volume: VolumeRef, relative: str) -> Path:
        return _within(self.volume_path(volume), relative, f"volume '{volume.name}'")

    def _python(self) -> str:
        return self.python or sys.executable

    # --- volume --------------------------------------------------------------------------------------
    def ensure_volume(self, name: str) -> VolumeRef:
        path = self.volume_path(name)
        created = not path.is_dir()
        path.mkdir(parents=True, exist_ok=True)
        return VolumeRef(name=name, location=str(path), created=created)

    def ensure_shared_access(self, volume: VolumeRef) -> str:
        return f"local volume {volume.location}: every process on this machine already shares it; nothing to do"

    def prepare_dataset(self, volume: VolumeRef, artifacts: list[Artifact], log: LogSink) -> dict[str, Any]:
        # In its own process, as on a cluster: its worker pool then never depends on the caller's
        # ``__main__`` (a script that calls a flow without an ``if __name__ == "__main__"`` guard works).
        return self._run_module(prepare_args(artifacts, str(self.volume_path(volume))), log,
                                f"preparing the dataset on volume '{volume.name}'", timeout_s=PREPARE_TIMEOUT_S)

    def read_file(self, volume: VolumeRef, relative_path: str) -> bytes:
        path = self._inside(volume, relative_path)
        if not path.is_file():
            raise FileNotFoundError(f"{relative_path} does not exist on volume '{volume.name}' ({path})")
        return path.read_bytes()

    def write_text(self, volume: VolumeRef, relative_path: str, text: str) -> None:
        path = self._inside(volume, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(text)
        os.replace(partial, path)

    def append_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        path = self._inside(volume, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as sink:
            sink.write(data)
            sink.flush()
            os.fsync(sink.fileno())

    # --- launcher ------------------------------------------------------------------------------------
    def submit_training(self, spec: TrainingSpec) -> TrainingHandle:
        run_dir = self._inside(spec.volume, spec.run_dir)
        record_file = run_dir / LAUNCHER_RECORD
        with _jobs_lock:
            running = _jobs.get(spec.job_name)
            if running is not None and running.poll() is None:
                return TrainingHandle(job_name=spec.job_name, spec=spec, state="running", adopted=True,
                                      details={"pid": running.pid})
            record = _read_json(record_file)
            # Finished: trained to its end, or stopped for good on request (a pruned trial is not resumed).
            if record.get("exit_code") == 0 and ((run_dir / "model.pt").is_file() or
                                                 record.get("reason") == STOPPED_ON_REQUEST):
                return TrainingHandle(job_name=spec.job_name, spec=spec, state="succeeded", adopted=True,
                                      details=record)
            if record.get("exit_code") is None and record.get("pgid"):
                # Started by an earlier process of this flow run that is gone: stop it before resuming.
                _stop_group(int(record["pgid"]), str(run_dir))
            cmd = horovodrun_command(str(Path(self._python()).parent / "horovodrun"), self._python(), spec,
                                     str(self._inside(spec.volume, spec.data_dir)), str(run_dir))
            run_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "OMP_NUM_THREADS": str(self.threads_per_worker), "PYTHONUNBUFFERED": "1",
                   "PATH": f"{Path(self._python()).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                       env=env, start_new_session=True)  # own process group: cancel kills it all
            _jobs[spec.job_name] = process
            attempts = int(record.get("attempts", 0)) + 1
            details = {"job_name": spec.job_name, "pid": process.pid, "pgid": process.pid, "command": cmd,
                       "started_at": _now(), "attempts": attempts, "exit_code": None}
            _write_json(record_file, details)
        return TrainingHandle(job_name=spec.job_name, spec=spec, state="running", details=details)

    def wait_for_training(self, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
                          timeout_s: float) -> TrainingOutcome:
        run_dir = self._inside(handle.spec.volume, handle.spec.run_dir)
        if handle.state == "succeeded":
            return _outcome_from_metrics(handle.job_name, run_dir, 0.0)
        with _jobs_lock:
            process = _jobs.get(handle.job_name)
        if process is None:
            raise TrainingInterrupted(f"job {handle.job_name} is not running in this process any more; "
                                      "submitting it again resumes it from its newest checkpoint")
        started = time.monotonic()
        output = JobOutput(on_event, on_log)
        try:
            for stream, raw in _merged_lines(process, deadline=started + timeout_s):
                output.feed(raw, may_be_event=stream == "stdout")
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

    def cancel_training(self, job_name: str, volume: VolumeRef) -> bool:
        with _jobs_lock:
            process = _jobs.pop(job_name, None)
        run_dir = self.volume_path(volume) / "runs" / job_name
        pgid = process.pid if process else _read_json(run_dir / LAUNCHER_RECORD).get("pgid")
        if not pgid:
            return False
        stopped = _stop_group(int(pgid), str(run_dir))
        if stopped:
            _finish_record(run_dir, None, "cancelled")
        return stopped

    def _run_module(self, args: list[str], log: LogSink, what: str, timeout_s: float) -> dict[str, Any]:
        """``python <args>`` (``-m module ...``) on all cores in its own process group: what it prints goes
        to ``log`` as it comes, its last JSON event on stdout is the result.

        The deadline is enforced here, from whichever thread calls: past ``timeout_s``, or when the task is
        interrupted, the whole group is stopped. Exit code 2 (the module refused its input) raises
        ValueError, not retried; anything else RuntimeError.
        """
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() or 1)), "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen([self._python(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, bufsize=1, env=env, start_new_session=True)
        output = JobOutput(on_event=lambda _: None, on_log=log)  # events are kept; the last is the result
        try:
            for stream, raw in _merged_lines(process, deadline=time.monotonic() + timeout_s):
                output.feed(raw, may_be_event=stream == "stdout")
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

    def evaluate(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, log: LogSink) -> dict[str, Any]:
        return self._run_module(["-m", "training.evaluate", "--run-dir", str(self._inside(volume, run_dir)),
                                 "--data-root", str(self._inside(volume, data_dir)), "--split", split],
                                log, f"evaluation of {run_dir} on '{split}'", timeout_s=EVALUATE_TIMEOUT_S)

    def package_model(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, lineage: dict[str, Any],
                      log: LogSink) -> dict[str, Any]:
        summary = self._run_module(["-m", "training.package", "--run-dir", str(self._inside(volume, run_dir)),
                                    "--data-root", str(self._inside(volume, data_dir)), "--split", split,
                                    "--lineage", json.dumps(lineage)], log, f"packaging {run_dir}",
                                   timeout_s=EVALUATE_TIMEOUT_S)
        return paths_in(run_dir, summary, ("package", "archive"))

    def predict(self, volume: VolumeRef, package: str, inputs: str, out_dir: str, backend: str,
                log: LogSink) -> dict[str, Any]:
        summary = self._run_module(["-m", "training.predict", "--package", str(self._inside(volume, package)),
                                    "--input", str(self._inside(volume, inputs)),
                                    "--out", str(self._inside(volume, out_dir)), "--backend", backend],
                                   log, f"prediction with {package} on {inputs}", timeout_s=PREDICT_TIMEOUT_S)
        return paths_in(out_dir, summary, ("predictions", "overlay"))

    # --- snapshots -----------------------------------------------------------------------------------
    def _snapshots_dir(self) -> Path:
        return self.home_dir() / "snapshots"

    def create_snapshot(self, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
                        lineage: dict[str, Any]) -> SnapshotRef:
        validate_name(name, "snapshot")
        final = self._snapshots_dir() / name
        if (final / LINEAGE_FILE).is_file():
            return _snapshot_ref(final)
        partial = final.with_name(f".{name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        content = partial / "content"
        stats = {"files": 0, "bytes": 0, "linked": 0, "copied": 0}
        for relative in (data_dir, run_dir):
            _copy_tree(self._inside(volume, relative), content / relative, stats, freeze=True)
        record = {"snapshot": name, "volume": volume.name, "created_at": _now(), "data_dir": data_dir,
                  "run_dir": run_dir, "content": stats, "ready": True, **lineage}
        _write_json(partial / LINEAGE_FILE, record)
        partial.rename(final)  # the snapshot appears whole or not at all
        return _snapshot_ref(final)

    def wait_for_snapshot(self, snapshot: SnapshotRef, timeout_s: float) -> SnapshotRef:
        path = self._snapshots_dir() / snapshot.name
        if not (path / LINEAGE_FILE).is_file():
            raise RuntimeError(f"snapshot {snapshot.name} is missing from {path.parent}")
        return _snapshot_ref(path)

    def list_snapshots(self) -> list[SnapshotRef]:
        root = self._snapshots_dir()
        found = [_snapshot_ref(p) for p in root.iterdir() if (p / LINEAGE_FILE).is_file()] if root.is_dir() else []
        return sorted(found, key=lambda ref: ref.lineage.get("created_at", ""))

    def restore_snapshot(self, snapshot_name: str, volume_name: str) -> VolumeRef:
        source = self._snapshots_dir() / validate_name(snapshot_name, "snapshot")
        if not (source / LINEAGE_FILE).is_file():
            known = ", ".join(ref.name for ref in self.list_snapshots()) or "none"
            raise KeyError(f"no snapshot named '{snapshot_name}' (known: {known})")
        target = self.volume_path(volume_name)
        if target.exists():
            marker = target / RESTORED_MARKER
            if marker.is_file() and marker.read_text().strip() == snapshot_name:
                return VolumeRef(name=volume_name, location=str(target), created=False)
            raise FileExistsError(f"volume '{volume_name}' already exists and was not restored from "
                                  f"'{snapshot_name}'; choose a new volume name")
        partial = target.with_name(f".{volume_name}.restoring")
        shutil.rmtree(partial, ignore_errors=True)
        _copy_tree(source / "content", partial, {"files": 0, "bytes": 0, "linked": 0, "copied": 0}, freeze=False)
        (partial / RESTORED_MARKER).write_text(snapshot_name + "\n")
        partial.rename(target)
        return VolumeRef(name=volume_name, location=str(target), created=True)

    def find_lineage(self, name: str) -> dict[str, Any]:
        snapshot = self._snapshots_dir() / name / LINEAGE_FILE
        if not snapshot.is_file():
            raise KeyError(f"no snapshot named '{name}' under {self._snapshots_dir()}")
        return json.loads(snapshot.read_text())

    def read_snapshot_file(self, name: str, relative_path: str) -> bytes:
        content = self._snapshots_dir() / validate_name(name, "snapshot") / "content"
        path = _within(content.resolve(), relative_path, f"snapshot '{name}'")
        if not path.is_file():
            raise FileNotFoundError(f"{relative_path} is not in snapshot '{name}' ({content})")
        return path.read_bytes()

    # --- service level -------------------------------------------------------------------------------
    def current_service_level(self, volume: VolumeRef) -> str | None:
        return None

    def change_service_level(self, volume: VolumeRef, level: str) -> bool:
        return False


# --- helpers ----------------------------------------------------------------------------------------

def _within(base: Path, relative: str, what: str) -> Path:
    """``base / relative`` resolved, refused when it leaves ``base`` (``..``, an absolute path, a link)."""
    path = (base / relative).resolve()
    if path != base and base not in path.parents:
        raise ValueError(f"path '{relative}' leaves {what}")
    return path


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _finish_record(run_dir: Path, exit_code: int | None, reason: str) -> None:
    record = _read_json(run_dir / LAUNCHER_RECORD)
    if record:
        _write_json(run_dir / LAUNCHER_RECORD, {**record, "exit_code": exit_code, "reason": reason,
                                                "finished_at": _now()})


def _is_our_group(pgid: int, run_dir: str) -> bool:
    """The group leader is the horovodrun we started for this run (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
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
    """Lines from stdout and stderr as they come; TimeoutError past ``deadline``."""
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


def _copy_tree(source: Path, target: Path, stats: dict[str, int], *, freeze: bool) -> None:
    """Hard-link files that are only ever replaced, copy the rest; ``freeze`` makes copies read-only."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source} does not exist: nothing to copy")
    for directory, subdirs, files in os.walk(source):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
        here = Path(directory)
        out = target / here.relative_to(source)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            src, dst = here / name, out / name
            if name.endswith((".tmp", ".part")):
                continue
            linkable = name.lower().endswith(_LINKABLE_SUFFIXES) or (name.endswith(".png") and "seg_label" in src.parts)
            if linkable:
                try:
                    os.link(src, dst)
                    stats["linked"] += 1
                except OSError:  # another file system: copy instead
                    shutil.copy2(src, dst)
                    stats["copied"] += 1
            else:
                shutil.copy2(src, dst)
                os.chmod(dst, 0o444 if freeze else 0o644)
                stats["copied"] += 1
            stats["files"] += 1
            stats["bytes"] += dst.stat().st_size


def _snapshot_ref(path: Path) -> SnapshotRef:
    lineage = json.loads((path / LINEAGE_FILE).read_text())
    return SnapshotRef(name=path.name, volume=lineage.get("volume", ""), ready=bool(lineage.get("ready")),
                       location=str(path), lineage=lineage)

