"""The local platform: a directory is the volume and ``horovodrun`` runs on this machine's CPUs.

Layout under the platform's home (``$LANEFLOW_HOME``, else ``~/.laneflow/local``)::

    volumes/<volume>/{downloads,datasets,runs}/     what the pipeline reads and writes
    snapshots/<snapshot>/{lineage.json,content/}     immutable copies (hard links where safe)

Needs no configuration: the flows' default platform name ``local`` resolves to ``LocalPlatform()``
unless a block of that name was saved.

This module is the Prefect block: its fields, the paths they give, the volume and its files (plain file
operations), and the other ``Platform`` operations, each handed to the module of its concern:
``processes`` (horovodrun and the other stages' processes) and ``snapshots`` (hard-linked copies).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from tasks.launch import prepare_args
from tasks.names import validate_name, validate_subdomain
from tasks.platforms.base import (
    EventSink,
    LogSink,
    Platform,
    SnapshotRef,
    TrainingHandle,
    TrainingOutcome,
    TrainingSpec,
    VolumeRef,
    check_cooldown,
    paths_in,
)
from tasks.platforms.local import processes, snapshots
from tasks.platforms.local.files import within
from training.data.sources import SOURCES_ENV, Artifact, sources_json

__all__ = ["LocalPlatform"]

#: Where a volume's records (``update_volume_record``) live on it.
RECORDS_DIR = ".laneflow/records"
#: Deadlines of the stages that run a module of their own (a training run has its own, a parameter).
PREPARE_TIMEOUT_S = 12 * 3600
EVALUATE_TIMEOUT_S = 6 * 3600
PREDICT_TIMEOUT_S = 12 * 3600


class LocalPlatform(Platform):
    """This machine: a folder per volume, ``horovodrun -np N`` on the CPUs, snapshots as hard-linked copies."""

    _block_type_name: ClassVar[str] = "Laneflow Local Platform"
    _block_type_slug: ClassVar[str] = "laneflow-local-platform"
    _description: ClassVar[str] = "Runs the laneflow DAG on this machine: folders as volumes, horovodrun on CPUs."

    home: str | None = Field(None, description="where volumes and snapshots live; default $LANEFLOW_HOME "
                                                "or ~/.laneflow/local")
    python: str | None = Field(None, description="interpreter with torch + horovod; default: this one")
    threads_per_worker: int = Field(1, ge=1, description="OMP threads per Horovod process")
    elastic_cooldown_min_s: int = Field(5, ge=1, le=3600, description="elastic runs: the shortest time a failed "
                                                                      "worker is left out before it is tried again")
    elastic_cooldown_max_s: int = Field(60, ge=1, le=3600, description="elastic runs: the longest such time (it "
                                                                       "doubles with each failure of the same worker)")
    elastic_timeout_s: int = Field(600, ge=1, description="elastic runs: how long to wait for min_workers to be there")

    @model_validator(mode="after")
    def _cooldown_is_a_range(self) -> LocalPlatform:
        check_cooldown(self.elastic_cooldown_min_s, self.elastic_cooldown_max_s)
        return self

    # --- paths ---------------------------------------------------------------------------------------
    def home_dir(self) -> Path:
        configured = self.home or os.environ.get("LANEFLOW_HOME") or "~/.laneflow/local"
        return Path(configured).expanduser().resolve()

    def volume_path(self, volume: VolumeRef | str) -> Path:
        name = volume.name if isinstance(volume, VolumeRef) else volume
        return self.home_dir() / "volumes" / validate_name(name, "volume")

    def snapshots_dir(self) -> Path:
        return self.home_dir() / "snapshots"

    def inside(self, volume: VolumeRef, relative: str) -> Path:
        """A path on the volume; ValueError when ``relative`` leaves it."""
        return within(self.volume_path(volume), relative, f"volume '{volume.name}'")

    def interpreter(self) -> str:
        """The Python that runs the stages: the block's ``python``, else this one."""
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
        return processes.run_module(self, prepare_args(str(self.volume_path(volume))), log,
                                    f"preparing the dataset on volume '{volume.name}'", timeout_s=PREPARE_TIMEOUT_S,
                                    env={SOURCES_ENV: sources_json(artifacts)})

    def read_file(self, volume: VolumeRef, relative_path: str) -> bytes:
        path = self.inside(volume, relative_path)
        if not path.is_file():
            raise FileNotFoundError(f"{relative_path} does not exist on volume '{volume.name}' ({path})")
        return path.read_bytes()

    def write_text(self, volume: VolumeRef, relative_path: str, text: str) -> None:
        path = self.inside(volume, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(text)
        os.replace(partial, path)

    def append_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        path = self.inside(volume, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as sink:
            sink.write(data)
            sink.flush()
            os.fsync(sink.fileno())

    def replace_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        path = self.inside(volume, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
        with partial.open("wb") as sink:
            sink.write(data)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(partial, path)

    def update_volume_record(self, volume: VolumeRef, key: str,
                             change: Callable[[str | None], str | None]) -> str | None:
        """Under an exclusive ``flock`` of the record's lock file: every process of this machine (the only one
        that reaches a local volume) takes turns, and a holder that dies drops its lock with its descriptor."""
        validate_subdomain(key, "record key")
        folder = self.volume_path(volume) / RECORDS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{key}.json"
        with (folder / f".{key}.lock").open("a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            current = path.read_text() if path.is_file() else None
            updated = change(current)
            if updated != current:
                if updated is None:
                    path.unlink()
                else:
                    partial = path.with_name(path.name + ".partial")
                    partial.write_text(updated)
                    os.replace(partial, path)
            return updated

    # --- launcher ------------------------------------------------------------------------------------
    def submit_training(self, spec: TrainingSpec) -> TrainingHandle:
        return processes.submit(self, spec)

    def wait_for_training(self, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
                          timeout_s: float) -> TrainingOutcome:
        return processes.wait(self, handle, on_event, on_log, timeout_s)

    def cancel_training(self, job_name: str, volume: VolumeRef, owner: str | None = None) -> bool:
        return processes.cancel(self, job_name, volume, owner)

    def evaluate(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, log: LogSink,
                 out_dir: str | None = None) -> dict[str, Any]:
        out = ["--out", str(self.inside(volume, out_dir))] if out_dir else []
        return processes.run_module(self, ["-m", "training.evaluate", "--run-dir", str(self.inside(volume, run_dir)),
                                           "--data-root", str(self.inside(volume, data_dir)), "--split", split, *out],
                                    log, f"evaluation of {run_dir} on '{split}'", timeout_s=EVALUATE_TIMEOUT_S)

    def package_model(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, lineage: dict[str, Any],
                      log: LogSink) -> dict[str, Any]:
        summary = processes.run_module(self, ["-m", "training.package", "--run-dir", str(self.inside(volume, run_dir)),
                                              "--data-root", str(self.inside(volume, data_dir)), "--split", split,
                                              "--lineage", json.dumps(lineage)], log, f"packaging {run_dir}",
                                       timeout_s=EVALUATE_TIMEOUT_S)
        return paths_in(run_dir, summary, ("package", "archive"))

    def predict(self, volume: VolumeRef, package: str, inputs: str, out_dir: str, backend: str,
                log: LogSink) -> dict[str, Any]:
        summary = processes.run_module(self, ["-m", "training.predict", "--package", str(self.inside(volume, package)),
                                              "--input", str(self.inside(volume, inputs)),
                                              "--out", str(self.inside(volume, out_dir)), "--backend", backend],
                                       log, f"prediction with {package} on {inputs}", timeout_s=PREDICT_TIMEOUT_S)
        return paths_in(out_dir, summary, ("predictions", "overlay"))

    def publish_package(self, volume: VolumeRef, package: str, tracking_uri: str, run_id: str, artifact_path: str,
                        env: dict[str, str], log: LogSink) -> dict[str, Any]:
        return processes.run_module(self, ["-m", "training.publish_package", "--package",
                                           str(self.inside(volume, package)), "--tracking-uri", tracking_uri,
                                           "--run-id", run_id, "--artifact-path", artifact_path], log,
                                    f"publishing {package} to MLflow", timeout_s=EVALUATE_TIMEOUT_S, env=env)

    # --- snapshots -----------------------------------------------------------------------------------
    def create_snapshot(self, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
                        lineage: dict[str, Any]) -> SnapshotRef:
        return snapshots.create(self, volume, name, data_dir, run_dir, lineage)

    def wait_for_snapshot(self, snapshot: SnapshotRef, timeout_s: float) -> SnapshotRef:
        return snapshots.wait(self, snapshot)

    def list_snapshots(self) -> list[SnapshotRef]:
        return snapshots.list_all(self)

    def restore_snapshot(self, snapshot_name: str, volume_name: str) -> VolumeRef:
        return snapshots.restore(self, snapshot_name, volume_name)

    def find_lineage(self, name: str) -> dict[str, Any]:
        return snapshots.find_lineage(self, name)

    def read_snapshot_file(self, name: str, relative_path: str) -> bytes:
        return snapshots.read_file(self, name, relative_path)

    # --- service level -------------------------------------------------------------------------------
    def current_service_level(self, volume: VolumeRef) -> str | None:
        return None

    def change_service_level(self, volume: VolumeRef, level: str) -> bool:
        return False
