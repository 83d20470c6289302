"""The one seam between the DAG and where it runs (DESIGN §3).

A platform is a Prefect block, so a configured one is saved once (UI or code) and flows name it by
its block name. It offers the few operations the DAG needs: a volume, shared access to it, dataset
preparation on it, a launcher for Horovod training, evaluation, snapshots and the service level.
Flows and tasks call these and never ask which platform they hold.

Everything a platform returns is a small pydantic model, so Prefect can show it and pass it between
tasks; everything it raises is either ``TransientPlatformError`` (retry me) or a plain error (don't).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.platform_errors import ServiceLevelBusy as ServiceLevelBusy  # exported with the other errors
from tasks.platform_errors import TransientPlatformError
from training.data.sources import Artifact

if TYPE_CHECKING:
    from tasks.level_holds import LevelRecord


class VolumeReadFailed(TransientPlatformError):
    """A file on the volume could not be read — which says nothing about whether it is there (a
    ``FileNotFoundError`` says it is not). Worth retrying; never to be taken as "missing"."""


class TrainingInterrupted(TransientPlatformError):
    """The training job stopped before finishing but can resume from its newest checkpoint."""


class StageDeadlineExceeded(RuntimeError):
    """A stage ran past its deadline. Not retried: another try would wait as long again; the platform
    stopped what the stage had started before raising."""


class StageBlocked(RuntimeError):
    """A stage cannot progress: its pods cannot run (image, scheduling, configuration) or its claim cannot be
    provisioned, and it did not recover within the grace period. Not retried: the cause is in the cluster or
    the platform block; the message says what to fix."""


class NotOurJob(PermissionError):
    """A training job of the run's name that another flow run started (the same run key): never adopted or
    stopped by this one."""


class NotOurClaim(PermissionError):
    """A claim of the volume's name that laneflow did not make and the platform was not told to adopt: using it
    would let a run write to, snapshot and move between service levels a volume someone else may own."""


class NoServiceLevel(LookupError):
    """The volume has no service level laneflow can change (its storage is of another kind); the message says
    why. A run that asked for promotion fails on it; one that did not, and every way out of a run, go on."""


class VolumeNotBound(NoServiceLevel):
    """The volume has no storage behind it yet (a claim not bound): nothing holds its service level."""


class TrainingFailed(RuntimeError):
    """The training job failed for a reason a retry will not fix; carries the job's log tail."""

    def __init__(self, message: str, log_tail: list[str] | None = None) -> None:
        self.log_tail = list(log_tail or [])
        tail = "\n".join(self.log_tail)
        super().__init__(f"{message}\n--- training log tail ---\n{tail}" if tail else message)


class VolumeRef(BaseModel):
    """A volume the pipeline reads and writes: a directory locally, a PVC on a cluster."""

    name: str
    location: str = Field(description="where it lives: a path, or namespace/claim")
    created: bool = False


class ElasticWorkers(BaseModel):
    """Elastic Horovod: the run goes on when workers are lost (spot nodes reclaimed) and takes them back when
    they return, between ``min_workers`` and ``max_workers``, without restarting the job."""

    model_config = ConfigDict(extra="forbid")

    min_workers: int = Field(1, ge=1, le=512, description="the fewest workers the run trains on; with fewer it "
                                                          "stops and resumes from its checkpoint when resubmitted")
    max_workers: int = Field(ge=1, le=512, description="the most workers the run grows to as they become available")
    commit_every: int = Field(10, ge=1, le=100_000, description="steps between the workers' in-memory commits: a "
                                                               "lost worker costs the others at most this many steps")

    @model_validator(mode="after")
    def _ordered(self) -> ElasticWorkers:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) is more than max_workers ({self.max_workers}): the "
                             "run could never have enough workers; raise max_workers or lower min_workers")
        return self

    def check_start(self, workers: int) -> None:
        """``workers`` (what the run starts with) must lie between the two bounds."""
        if not self.min_workers <= workers <= self.max_workers:
            raise ValueError(f"workers ({workers}) must lie between elastic.min_workers ({self.min_workers}) and "
                             f"elastic.max_workers ({self.max_workers}): the run starts once that many are there")


def check_cooldown(low: int, high: int) -> None:
    """A platform's elastic cooldown range: horovodrun's ``--blacklist-cooldown-range MIN MAX``."""
    if low > high:
        raise ValueError(f"elastic_cooldown_min_s ({low}) is more than elastic_cooldown_max_s ({high}); make the "
                         "longest cooldown at least the shortest")


class TrainingSpec(BaseModel):
    """What to train: everything a launcher needs, with paths relative to the volume root."""

    job_name: str = Field(description="deterministic per flow run: a retry finds the same job")
    volume: VolumeRef
    data_dir: str = Field(description="dataset root relative to the volume, e.g. datasets/4d561454fb71df42")
    run_dir: str = Field(description="run directory relative to the volume, e.g. runs/train-1a2b3c4d")
    preset: str
    workers: int = Field(ge=1, description="Horovod processes (one per GPU on a cluster)")
    settings: dict[str, str] = Field(default_factory=dict, description="trainer --set key=value overrides")
    labels: dict[str, str] = Field(default_factory=dict, description="lineage labels for the job")
    elastic: ElasticWorkers | None = Field(None, description="elastic Horovod bounds; None: a fixed-size run")

    @model_validator(mode="after")
    def _elastic_start(self) -> TrainingSpec:
        if self.elastic is not None:
            self.elastic.check_start(self.workers)
        return self


class TrainingHandle(BaseModel):
    """A submitted training job."""

    job_name: str
    spec: TrainingSpec
    state: str = Field(description="pending, running, succeeded, or failed")
    adopted: bool = Field(False, description="True when submit found the job already there")
    details: dict[str, Any] = Field(default_factory=dict)


class TrainingOutcome(BaseModel):
    """How a finished training job ended, with what its event stream said."""

    job_name: str
    steps: int
    total_steps: int
    resumed_from: int = Field(0, description="the step the last attempt started from (0 = fresh)")
    eval: dict[str, Any] = Field(default_factory=dict, description="the trainer's own end-of-run evaluation")
    duration_s: float
    log_tail: list[str] = Field(default_factory=list)
    stopped: dict[str, Any] | None = Field(None, description="the stop request the run honoured (ended early on "
                                                              "purpose: a pruned trial), None when it ran to its end")
    val: list[dict[str, Any]] = Field(default_factory=list, description="the periodic val scores (eval_every)")
    model: dict[str, Any] = Field(default_factory=dict, description="the lane model trained: its name and settings, "
                                                                    "as the last attempt's start event gave them")
    numerics: dict[str, Any] = Field(default_factory=dict, description="how the last attempt computed: precision, "
                                       "memory format, compile and the reason for them (its start event's)")


class SnapshotRef(BaseModel):
    """A point-in-time copy of dataset + run, labelled with lineage."""

    name: str
    volume: str
    ready: bool
    location: str
    lineage: dict[str, Any] = Field(default_factory=dict)


#: What a start event says about how the attempt computes (``training.precision.Numerics.record``).
NUMERICS_FIELDS = ("precision", "memory_format", "compile", "numerics_reason")


def outcome_from_events(job_name: str, events: list[dict[str, Any]], duration_s: float,
                        log_tail: list[str]) -> TrainingOutcome:
    """What a finished job's event stream says: last step, where the last attempt started, its evaluation. An
    attempt that resumed at its last step (an earlier one trained to the end, but its launcher was lost before it
    could report) trained no step: it ends where it started."""
    starts = [e for e in events if e.get("event") == "start"]
    plans = [e for e in events if e.get("event") in ("start", "workers") and "total_steps" in e]  # elastic: re-planned
    steps = [e for e in events if e.get("event") in ("step", "done", "stopped")]
    evals = [e for e in events if e.get("event") == "eval"]
    stopped = [e for e in events if e.get("event") == "stopped"]
    return TrainingOutcome(
        job_name=job_name, steps=int(steps[-1]["step"]) if steps else int(starts[-1]["step"]) if starts else 0,
        total_steps=int(plans[-1]["total_steps"]) if plans else 0,
        resumed_from=int(starts[-1]["step"]) if starts else 0,
        eval=_payload(evals[-1]) if evals else {},
        duration_s=round(duration_s, 3), log_tail=log_tail,
        stopped=_payload(stopped[-1]) if stopped else None,
        val=[_payload(e) for e in events if e.get("event") == "val"],
        model={"name": starts[-1]["model"], "settings": starts[-1].get("model_settings") or {}}
        if starts and starts[-1].get("model") else {},
        numerics={key: starts[-1][key] for key in NUMERICS_FIELDS if key in starts[-1]} if starts else {})


def _payload(event: dict[str, Any]) -> dict[str, Any]:
    """An event's fields without its kind and its time stamp (``metrics.jsonl`` keeps both)."""
    return {k: v for k, v in event.items() if k not in ("event", "time")}


def last_attempt(metrics_jsonl: str) -> list[dict[str, Any]]:
    """The events of a run's ``metrics.jsonl`` since its newest ``start`` (a resumed run appends to it)."""
    events = [json.loads(line) for line in metrics_jsonl.splitlines() if line.strip()]
    starts = [index for index, event in enumerate(events) if event.get("event") == "start"]
    return events[starts[-1]:] if starts else events


def paths_in(folder: str, summary: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``summary`` with the named paths as ``<folder>/<file name>``: relative to the volume, whatever path the
    process that wrote them saw the volume under (a container sees it at /data)."""
    return {**summary, **{key: f"{folder}/{PurePosixPath(summary[key]).name}" for key in keys if summary.get(key)}}


EventSink = Callable[[dict[str, Any]], None]
LogSink = Callable[[str], None]


class Platform(Block):
    """Operations the DAG needs from wherever it runs; implemented by local and cluster platforms."""

    # --- volume ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def ensure_volume(self, name: str) -> VolumeRef:
        """Create the volume, or adopt it when it exists."""

    @abc.abstractmethod
    def ensure_shared_access(self, volume: VolumeRef) -> str:
        """Make the volume mountable by every worker at once; returns what was done, for the log."""

    @abc.abstractmethod
    def prepare_dataset(self, volume: VolumeRef, artifacts: list[Artifact], log: LogSink) -> dict[str, Any]:
        """Download, verify, extract and preprocess the dataset's artifacts onto the volume; a cached no-op
        when already there.

        Returns the preparation summary: dataset_dir (relative to the volume), dataset_version, artifacts,
        counts, steps.
        """

    @abc.abstractmethod
    def read_file(self, volume: VolumeRef, relative_path: str) -> bytes:
        """A file from the volume (metrics, eval results, images for artifacts). ``FileNotFoundError`` only
        when the file is not there; a read that failed (an API blip, a reader that never ran) raises
        ``VolumeReadFailed`` after retrying, so no caller mistakes it for a missing file."""

    @abc.abstractmethod
    def write_text(self, volume: VolumeRef, relative_path: str, text: str) -> None:
        """A small text file on the volume (made with its folders), replaced whole: readers never see half of
        it (a run's ``lineage.json``)."""

    @abc.abstractmethod
    def append_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        """``data`` added to the end of a file on the volume (made with its folders when missing), flushed to
        the volume before this returns (a sweep's study journal)."""

    @abc.abstractmethod
    def replace_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        """A file on the volume replaced whole by ``data`` (written beside it, then renamed over it): readers
        see the old content or the new, never a mix (a study journal repaired after a torn write)."""

    @abc.abstractmethod
    def update_volume_record(self, volume: VolumeRef, key: str,
                             change: Callable[[str | None], str | None]) -> str | None:
        """Replace the small text record ``key`` kept with the volume by ``change(record)`` (None: no record),
        atomically: no other writer's update is lost between the read and the write, on this machine or any
        other (``change`` may be called again after a lost race). Returns the record as written. Who holds a
        study is one (``tasks.study_lock``)."""

    # --- launcher ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def submit_training(self, spec: TrainingSpec) -> TrainingHandle:
        """Start the job, or adopt it when a job of that name is already running or finished."""

    @abc.abstractmethod
    def wait_for_training(self, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
                          timeout_s: float) -> TrainingOutcome:
        """Stream events and logs until the job ends.

        Raises ``TrainingInterrupted`` when it can resume (preempted, a worker lost) and
        ``TrainingFailed`` when it cannot; stops the job if the wait itself is interrupted.
        """

    @abc.abstractmethod
    def cancel_training(self, job_name: str, volume: VolumeRef, owner: str | None = None) -> bool:
        """Stop the job and everything it started; False when there was nothing to stop. With ``owner`` (a flow
        run id) only a job that flow run started: another's (a run of the same run key) raises ``NotOurJob``."""

    @abc.abstractmethod
    def evaluate(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, log: LogSink,
                 out_dir: str | None = None) -> dict[str, Any]:
        """Score the run's final model on ``split`` (TuSimple's metric, or CULane's on a CULane dataset); writes
        eval_<split>.json and the predictions in ``out_dir`` (relative to the volume; default the run's folder)."""

    @abc.abstractmethod
    def package_model(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, lineage: dict[str, Any],
                      log: LogSink) -> dict[str, Any]:
        """Export the run's model as a package (``<run_dir>/package`` and its archive), parity-checked on
        ``split``; returns the package's summary with its paths relative to the volume."""

    @abc.abstractmethod
    def predict(self, volume: VolumeRef, package: str, inputs: str, out_dir: str, backend: str,
                log: LogSink) -> dict[str, Any]:
        """Run a package on images or a video on the volume (paths relative to it); the prediction summary."""

    @abc.abstractmethod
    def publish_package(self, volume: VolumeRef, package: str, tracking_uri: str, run_id: str, artifact_path: str,
                        env: dict[str, str], log: LogSink) -> dict[str, Any]:
        """Check a package on the volume (a path on it) and log its folder to MLflow run ``run_id`` under
        ``artifact_path``, from where the volume is (so from a pod on a cluster): ``tracking_uri`` must be
        reachable from there; ``env`` are MLflow client settings for the uploader. Its summary (the files)."""

    # --- snapshots ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def create_snapshot(self, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
                        lineage: dict[str, Any]) -> SnapshotRef:
        """Capture dataset + run under ``name`` with lineage; adopts an existing snapshot of that name."""

    @abc.abstractmethod
    def wait_for_snapshot(self, snapshot: SnapshotRef, timeout_s: float) -> SnapshotRef:
        """Block until the snapshot is ready to use; raises when it reports an error."""

    @abc.abstractmethod
    def list_snapshots(self) -> list[SnapshotRef]:
        """Every snapshot this platform made, oldest first."""

    @abc.abstractmethod
    def restore_snapshot(self, snapshot_name: str, volume_name: str) -> VolumeRef:
        """A new volume holding the snapshot's content."""

    @abc.abstractmethod
    def find_lineage(self, name: str) -> dict[str, Any]:
        """The lineage record a snapshot carries, by snapshot name; KeyError when there is none."""

    def read_snapshot_file(self, name: str, relative_path: str) -> bytes:
        """A file as the snapshot holds it (paths as on the volume). Where a snapshot is readable only once
        restored (a CSI or ANF snapshot), FileNotFoundError: callers read the run's volume instead."""
        raise FileNotFoundError(f"snapshot '{name}' is read only after a restore (laneflow restore)")

    # --- service level -----------------------------------------------------------------------------
    @abc.abstractmethod
    def current_service_level(self, volume: VolumeRef) -> str | None:
        """The volume's storage service level, or None where the idea does not apply."""

    @abc.abstractmethod
    def change_service_level(self, volume: VolumeRef, level: str) -> bool:
        """Move the volume to ``level``; False when nothing had to change."""

    def service_level_limits(self, volume: VolumeRef) -> tuple[float, str] | None:
        """(quota in TiB, highest level allowed) for choosing a level; None where levels do not apply."""
        return None

    def service_level_command(self, volume: VolumeRef, level: str) -> str | None:
        """The command an operator runs to move the volume to ``level`` by hand, for when laneflow cannot."""
        return None

    def update_level_record(self, volume: VolumeRef,
                            change: Callable[[LevelRecord | None], LevelRecord | None]) -> LevelRecord | None:
        """Replace the record of who holds the volume's level with ``change(record)``, atomically: no other
        writer's update is lost between the read and the write (``change`` may be called again after a lost
        race). Returns the record as written. Only platforms with service levels keep one."""
        raise TypeError(f"{type(self).__name__} has no service levels, so no record of who holds one")

    def level_record(self, volume: VolumeRef) -> LevelRecord | None:
        """The record of who holds the volume's level (an update that changes nothing writes nothing)."""
        return self.update_level_record(volume, lambda record: record)

    def level_hold_ttl_s(self, volume: VolumeRef) -> float:
        """How long a run's hold on the volume's level lasts without renewal before it is taken for dead."""
        return 600.0


def refuse_other_data(snapshot: str, existing: object, wanted: object) -> None:
    """A snapshot of the run's name that exists already is this run's own (a retry of the stage) only when it holds
    the same dataset version: adopting one of other data (a run key reused after a new drop) would record lineage
    that is not true."""
    unknown = ("", "None")  # a label written for a run whose version was not known says nothing
    if str(existing or "") not in unknown and str(wanted or "") not in unknown and str(existing) != str(wanted):
        raise FileExistsError(f"snapshot '{snapshot}' already exists with dataset version {existing}, but this run "
                              f"trained on version {wanted}: it is not this run's. Use another run_key, or delete the "
                              "snapshot if it is no longer needed")
