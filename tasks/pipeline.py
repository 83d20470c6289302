"""The DAG's stages as Prefect tasks (DESIGN §2): thin wrappers over the platform and the pure code.

Every task retries transient errors only (``tasks.retry``) and is named after what it works on.
Deadlines live where they can be enforced from any thread: the platforms stop a stage's process or job
past its own timeout, and every Kubernetes and Azure call has request timeouts. (A Prefect task timeout
cannot interrupt a task in a worker thread — where sweeps and concurrent runs put them — and Prefect
warns about each such task; so the tasks set none.)

Names of what they create come from the flow run, so a retried task finds what its first try made: the
volume, the dataset, the training job (which resumes from its checkpoint), the snapshot.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.exceptions import MissingContextError

from tasks.champion import selection_accuracy
from tasks.dataset_index import redact, release_for
from tasks.holding import join, leave_quietly, settle
from tasks.launch import describe_world_change
from tasks.level_holds import LevelHold, describe
from tasks.lineage import render_lineage_markdown
from tasks.platforms.base import (
    NoServiceLevel,
    Platform,
    SnapshotRef,
    TrainingHandle,
    TrainingOutcome,
    TrainingSpec,
    VolumeRef,
)
from tasks.pruning import judge_of, stop_request_path
from tasks.report import (
    data_uri,
    eval_series,
    metrics_description,
    metrics_rows,
    render_package_markdown,
    step_series,
    thumbnail_jpeg,
    training_curve_png,
    validation_score_name,
)
from tasks.retry import RETRY_POLICY
from tasks.service_level import SERVICE_LEVELS, ThroughputNeed, choose_service_level, render_tier_markdown
from training.data.redact import redact_exception, redacting
from training.data.sources import Artifact

HOUR = 3600
LEVEL_ORDER = [name for name, _ in SERVICE_LEVELS]
# Side effects live on the volume and the platform, never in Prefect's result cache.
_TASK = {**RETRY_POLICY, "cache_policy": NO_CACHE}


def _resource(kind: str, name: str) -> dict[str, str]:
    return {"prefect.resource.id": f"laneflow.{kind}.{name}", "prefect.resource.name": name}


@task(name="promote_service_level", task_run_name="promote-{volume.name}", **_TASK)
def promote_service_level(platform: Platform, volume: VolumeRef, wanted: bool, need: ThroughputNeed, run: str,
                          holder: str) -> dict[str, Any] | None:
    """Hold the volume's level for this run (``tasks.holding``): the volume moves to the cheapest level that
    feeds every run holding it, and stays there until the last of them leaves (``demote_service_level``).

    Called once the run has its ``gpu`` slot, just before it trains. A run with promotion off holds nothing,
    but settles the volume: a level left high by runs that died goes home. Returns the volume's home level
    and the level it trains on; None where service levels do not apply.
    """
    logger = get_run_logger()
    try:
        level = platform.current_service_level(volume)
    except NoServiceLevel as exc:  # the claim is not on storage with levels: fine unless this run wants one
        if wanted:
            raise
        logger.info("service level: not applicable (%s)", exc)
        return None
    if level is None:
        logger.info("service level: not applicable on %s; nothing to promote", type(platform).__name__)
        return None
    if not wanted:
        try:
            record, level = settle(platform, volume, "settled by a run with promotion off", logger)
        except Exception as exc:  # this run asked for nothing: what other runs left is not its failure
            logger.warning("service level of %s could not be settled (%s); this run trains on %s as it is (promotion "
                           "is off)", volume.name, exc, level)
            return {"home": None, "training": level, "held": False}
        logger.info("service level stays %s (promotion is off for this run; held by %s)", level, describe(record))
        return {"home": record.home if record else level, "training": level, "held": False}
    quota_tib, ceiling = platform.service_level_limits(volume) or (0.0, "Ultra")
    choice = choose_service_level(need, quota_tib, ceiling)
    create_markdown_artifact(markdown=render_tier_markdown(choice, need), key=f"service-level-{run}",
                             description=f"service level chosen for {run}")
    logger.info("service level: %s", choice.reason)
    hold = LevelHold(run=run, mib_per_second=choice.required_mib_per_second, level=choice.level or ceiling,
                     renewed=time.time(), ttl_s=platform.level_hold_ttl_s(volume))
    record, level = join(platform, volume, holder, hold, logger)
    logger.info("service level of %s: %s for %s (home %s)", volume.name, level, describe(record), record.home)
    return {"home": record.home, "training": level, "held": True}


@task(name="demote_service_level", task_run_name="demote-{volume.name}", **_TASK)
def demote_service_level(platform: Platform, volume: VolumeRef, holder: str, run: str) -> dict[str, Any] | None:
    """The run has trained: leave its hold; the volume goes home when no other run holds it. Returns the
    level the run trained on (where the volume was as it left), the volume's home and the level it is left
    on (None when it could not be settled: said loudly, with the command that moves it, and the run goes on
    to score and keep what it trained); None where service levels do not apply."""
    logger = get_run_logger()
    try:
        trained_on = platform.current_service_level(volume)
    except NoServiceLevel:  # promotion was off for it, or it would have failed there
        trained_on = None
    if trained_on is None:
        logger.info("service level: not applicable; nothing to demote")
        return None
    before = platform.level_record(volume)
    home = before.home if before else trained_on
    if not leave_quietly(platform, volume, holder, run, "training done", logger):
        return {"training": trained_on, "home": home, "after": None}
    record = platform.level_record(volume)
    level = platform.current_service_level(volume)
    if record is not None and record.holds:
        logger.info("service level of %s stays %s: still held by %s", volume.name, level, describe(record))
    else:
        logger.info("service level of %s: %s, nobody holds it", volume.name, level)
    return {"training": trained_on, "home": home, "after": level}


def release_service_level(platform: Platform, volume: VolumeRef, holder: str, run: str, why: str,
                          logger: Any = None) -> bool:
    """Leave the run's hold on the way out of a failure, a cancellation or a crash (never raises; says what to
    run when the volume stays promoted). True when the volume is where its remaining holders want it."""
    if logger is None:
        try:
            logger = get_run_logger()  # the run's log, in the UI
        except MissingContextError:  # a state hook outside the run that passed none
            logger = logging.getLogger("laneflow.service_level")
    return leave_quietly(platform, volume, holder, run, why, logger)


@task(name="read_service_level", task_run_name="service-level-{volume.name}", **_TASK)
def read_service_level(platform: Platform, volume: VolumeRef, levels: dict[str, Any] | None) -> dict[str, Any] | None:
    """The level the volume trained on, with its home level and quota, for the run's lineage (what a
    comparison bills); None where service levels do not apply."""
    if levels is None:
        return None
    try:
        limits = platform.service_level_limits(volume)
    except Exception as exc:  # a record for a report: it never fails a run that trained
        get_run_logger().warning("could not read the quota of %s for the run's lineage (%s); a comparison will "
                                 "not bill its storage", volume.name, exc)
        limits = None
    return {"training": levels["training"], "home": levels["home"], "quota_tib": limits[0] if limits else None}


@task(name="record_lineage", task_run_name="lineage-{volume.name}", **_TASK)
def record_lineage(platform: Platform, volume: VolumeRef, run_dir: str, lineage: dict[str, Any]) -> str:
    """``<run_dir>/lineage.json`` on the volume: the run's own record, beside its metrics, so a comparison
    (and anyone with the volume) reads where a run came from without the Prefect server; a snapshot
    carries it too."""
    path = f"{run_dir}/lineage.json"
    platform.write_text(volume, path, json.dumps(lineage, sort_keys=True, indent=1))
    return path


@task(name="ensure_dataset_volume", task_run_name="ensure-volume-{name}", **_TASK)
def ensure_dataset_volume(platform: Platform, name: str) -> VolumeRef:
    volume = platform.ensure_volume(name)
    get_run_logger().info("volume %s %s at %s", name, "created" if volume.created else "adopted", volume.location)
    return volume


@task(name="read_dataset_index", task_run_name="read-dataset-index", **_TASK)
def read_dataset_index(index_url: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The newest version a dataset index lists: its artifacts and what lineage records about it.

    Read when the run starts, so a nightly retrain trains on the drop published last; a bad index fails
    here (not retried), naming the problem, before anything is downloaded."""
    release, releases = release_for(index_url)
    get_run_logger().info("dataset index %s lists %d version(s); training on the newest: %s (published %s)",
                          redact(index_url), len(releases), release.version, release.published.isoformat())
    return release.source()["artifacts"], release.record(index_url)


@task(name="prepare_dataset", task_run_name="prepare-dataset-{volume.name}", **_TASK)
def prepare_dataset(platform: Platform, volume: VolumeRef, artifacts: list[Artifact]) -> dict[str, Any]:
    """Download -> verify -> extract -> preprocess; each step is skipped when its output is already there."""
    logger = get_run_logger()
    try:  # a URL may carry a credential (a SAS): neither its output nor its failure shows it
        summary = platform.prepare_dataset(volume, artifacts, redacting(logger.info))
    except Exception as exc:
        raise redact_exception(exc) from None
    steps = summary.get("steps", {})
    if not any(steps.values()):
        logger.info("dataset cache hit: version %s already prepared on %s", summary["dataset_version"], volume.name)
    counts = summary["counts"]
    logger.info("dataset %s: read %s, kept %s, quarantined %s", summary["dataset_version"], counts["read"],
                counts["kept"], counts["quarantined"])
    return summary


@task(name="ensure_shared_access", task_run_name="shared-access-{volume.name}", **_TASK)
def ensure_shared_access(platform: Platform, volume: VolumeRef) -> str:
    message = platform.ensure_shared_access(volume)
    get_run_logger().info("%s", message)
    return message


@task(name="submit_training", task_run_name="submit-{spec.job_name}", **_TASK)
def submit_training(platform: Platform, spec: TrainingSpec) -> TrainingHandle:
    handle = platform.submit_training(spec)
    get_run_logger().info("training job %s %s (%s, %d workers)", spec.job_name,
                          "adopted" if handle.adopted else "submitted", handle.state, spec.workers)
    return handle


@task(name="wait_for_training", task_run_name="train-{spec.job_name}", tags=["gpu"], **_TASK)
def wait_for_training(platform: Platform, spec: TrainingSpec, timeout_s: float) -> TrainingOutcome:
    """Stream the job's events into logs and a progress artifact until it ends.

    A retry (after a preemption or a lost worker) submits the job again: the same name, the same run
    directory, so the trainer resumes from its newest checkpoint. A judge registered for the run
    (``tasks.pruning``: a sweep's pruner) hears each periodic val score and may ask the run to stop.
    """
    logger = get_run_logger()
    handle = platform.submit_training(spec)  # adopts the running job; restarts an interrupted one
    progress_id = create_progress_artifact(progress=0.0, key=f"progress-{spec.job_name}",
                                           description=f"training {spec.job_name}")
    state: dict[str, float] = {"total": 0, "progress": 0.0}
    # A job adopted as already finished replays its log: nothing is left to judge.
    judge, asked = (judge_of(spec.job_name) if handle.state != "succeeded" else None), []

    def hear(event: dict[str, Any]) -> None:
        """Tell the judge a val score; leave the stop request it asks for (once) where the trainer reads it."""
        nonlocal judge
        try:
            verdict = judge(int(event["step"]), selection_accuracy(event))
        except Exception as exc:  # a judge that breaks stops judging; training goes on
            logger.warning("the run's judge failed on the val score at step %s (%s); it is not asked again",
                           event.get("step"), exc)
            judge = None
            return
        if verdict is None:
            return
        try:
            platform.append_file(spec.volume, stop_request_path(spec.run_dir), verdict.request(int(event["step"])))
        except Exception as exc:  # training goes on; the judge is asked again at the next score
            logger.warning("could not leave the stop request for %s (%s): %s; training goes on", spec.job_name,
                           verdict.state, exc)
            return
        asked.append(verdict)
        logger.info("asked training to stop at step %s (%s): %s; it checkpoints and ends", event["step"],
                    verdict.state, verdict.reason)

    def on_event(event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            state["total"] = int(event.get("total_steps") or 0)
            logger.info("training started at step %s of %s on %s worker(s)%s%s", event.get("step"),
                        event.get("total_steps"), event.get("world_size"), " (resumed)" if event.get("resumed") else "",
                        f", elastic between {spec.elastic.min_workers} and {spec.elastic.max_workers}"
                        if spec.elastic else "")
        elif kind == "step":
            on = f" on {event['workers']} worker(s)" if "workers" in event else ""
            logger.info("step %s: loss %.4f, lr %.4g, %.1f img/s, input stall %.0f%%%s", event["step"], event["loss"],
                        event["lr"], event["img_per_s"], 100 * event["input_stall"], on)
            if state["total"]:
                state["progress"] = min(100.0, 100.0 * event["step"] / state["total"])
                update_progress_artifact(progress_id, state["progress"],
                                         description=f"training {spec.job_name}")
        elif kind == "workers":  # an elastic run lost or gained workers and trains on
            state["total"] = int(event.get("total_steps") or state["total"])
            said = describe_world_change(event, spec.elastic.max_workers if spec.elastic else None)
            (logger.warning if event.get("lost") else logger.info)("%s", said)
            if state["total"]:
                update_progress_artifact(progress_id, min(100.0, 100.0 * event["step"] / state["total"]),
                                         description=f"training {spec.job_name} on {event.get('workers')} "
                                                     f"worker(s): {said}")
        elif kind == "val":
            logger.info("val at step %s: accuracy %.4f without the 200 ms rule (official %.4f)", event.get("step"),
                        selection_accuracy(event), event.get("accuracy", 0.0))
            if judge is not None and not asked:
                hear(event)
        elif kind == "queued":  # the platform's scheduler (Kueue) holds the job: why, where in the queue
            (logger.warning if event.get("state") == "preempted" else logger.info)("%s", event["message"])
            update_progress_artifact(progress_id, state["progress"],
                                     description=f"training {spec.job_name}: {event['message']}")
        elif kind in ("epoch", "checkpoint", "eval", "preempted", "stopped", "done"):
            logger.info("%s: %s", kind, json.dumps({k: v for k, v in event.items() if k != "event"}))

    outcome = platform.wait_for_training(handle, on_event, logger.debug, timeout_s)
    if outcome.stopped is not None:
        if asked:  # what this wait asked for names the state, whatever the trainer could read of the request
            outcome = outcome.model_copy(update={"stopped": {**outcome.stopped, "reason": asked[-1].reason,
                                                             "state": asked[-1].state}})
        update_progress_artifact(progress_id, 100.0 * outcome.steps / max(1, outcome.total_steps))
        logger.info("training %s stopped at step %d of %d as asked (%s)", spec.job_name, outcome.steps,
                    outcome.total_steps, outcome.stopped.get("reason", "no reason given"))
        return outcome
    update_progress_artifact(progress_id, 100.0)
    logger.info("training %s finished at step %d (resumed from %d)%s", spec.job_name, outcome.steps,
                outcome.resumed_from, "; the stop request came too late, it trained to its end" if asked else "")
    return outcome


@task(name="evaluate", task_run_name="evaluate-{split}", **_TASK)
def evaluate(platform: Platform, volume: VolumeRef, run_dir: str, data_dir: str, split: str,
             out_dir: str | None = None) -> dict[str, Any]:
    """TuSimple accuracy, FP and FN of the run's final model on ``split`` (CULane's F1, overall and per scenario,
    on a CULane dataset: training.evaluate_culane); its files in ``out_dir`` (default: the run's folder)."""
    logger = get_run_logger()
    result = platform.evaluate(volume, run_dir, data_dir, split, logger.debug, out_dir)
    if result.get("metric") == "culane":
        logger.info("%s: CULane F1 %.4f over %d frames; per scenario: %s", split, result["accuracy"], result["images"],
                    ", ".join(f"{name} FP {figures['fp']}" if name == "cross" else
                              f"{name} F1 {'—' if figures['f1'] is None else format(figures['f1'], '.4f')}"
                              for name, figures in result.get("scenarios", {}).items()))
        return result
    logger.info("%s: accuracy %.4f (official), %.4f without the 200 ms rule (%s of %d images over it); FP %.4f, "
                "FN %.4f", split, result["accuracy"], result.get("untimed_accuracy", result["accuracy"]),
                result.get("over_time_limit", "?"), result["images"], result["fp"], result["fn"])
    return result


@task(name="package_model", task_run_name="package-{lineage[run]}", **_TASK)
def package_model(platform: Platform, volume: VolumeRef, run_dir: str, data_dir: str, split: str,
                  lineage: dict[str, Any]) -> dict[str, Any]:
    """Export the model (TorchScript, ONNX) with its contract and lineage, parity proven; publish what it is."""
    logger = get_run_logger()
    package = platform.package_model(volume, run_dir, data_dir, split, lineage, logger.debug)
    parity = package["parity"]
    logger.info("package %s: TorchScript and ONNX match the eager model on %d images (max difference %s)",
                package["package"], parity["images"],
                ", ".join(f"{k} {v['max_abs_diff']:.1e}" for k, v in parity["backends"].items()))
    create_markdown_artifact(key=f"package-{lineage['run']}", description=f"model package of {lineage['run']}",
                             markdown=render_package_markdown(package, volume.name, lineage))
    return package


@task(name="predict", task_run_name="predict-{inputs}", **_TASK)
def predict(platform: Platform, volume: VolumeRef, package: str, inputs: str, out_dir: str,
            backend: str) -> dict[str, Any]:
    """Lanes on images or a video on the volume with a package; prediction lines and overlays."""
    logger = get_run_logger()
    summary = platform.predict(volume, package, inputs, out_dir, backend, logger.info)
    logger.info("predicted %d of %d frames with %s; %d skipped; lines in %s", summary["predicted"],
                summary["frames"], summary["backend"], len(summary["skipped"]), summary["predictions"])
    return summary


@task(name="restore_volume", task_run_name="restore-{snapshot}-to-{volume_name}", **_TASK)
def restore_volume(platform: Platform, snapshot: str, volume_name: str) -> VolumeRef:
    """A new volume from a snapshot (adopted when a retry finds it already restored)."""
    volume = platform.restore_snapshot(snapshot, volume_name)
    get_run_logger().info("volume %s %s from snapshot %s", volume_name, "restored" if volume.created else "adopted",
                          snapshot)
    return volume


@task(name="capture_snapshot", task_run_name="snapshot-{name}", **_TASK)
def capture_snapshot(platform: Platform, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
                     lineage: dict[str, Any]) -> SnapshotRef:
    """Version dataset + model together; the snapshot carries the run's lineage."""
    snapshot = platform.wait_for_snapshot(platform.create_snapshot(volume, name, data_dir, run_dir, lineage),
                                          timeout_s=HOUR)
    get_run_logger().info("snapshot %s ready at %s", snapshot.name, snapshot.location)
    emit_event("laneflow.snapshot.created", resource=_resource("snapshot", snapshot.name),
               related=[{"prefect.resource.id": f"laneflow.run.{lineage['run']}", "prefect.resource.role": "run"}],
               payload={"volume": volume.name, "dataset_version": lineage.get("dataset_version"),
                        "metrics": lineage.get("metrics", {})})
    return snapshot


@task(name="publish_artifacts", task_run_name="publish-{lineage[run]}", **_TASK)
def publish_artifacts(platform: Platform, volume: VolumeRef, run_dir: str, outcome: TrainingOutcome,
                      evaluation: dict[str, Any], lineage: dict[str, Any]) -> dict[str, str]:
    """Metrics table, training curve, lineage and prediction overlay, each keyed by the run."""
    run = lineage["run"]
    events = [json.loads(line) for line in platform.read_file(volume, f"{run_dir}/metrics.jsonl").splitlines()
              if line.strip()]
    steps = step_series(events)
    training = {"steps": outcome.steps, "resumed_from": outcome.resumed_from, "duration_s": outcome.duration_s}
    score = validation_score_name(evaluation)
    curve = training_curve_png(steps, f"{run} (dataset {lineage.get('dataset_version')})", eval_series(events),
                               score)
    ids = {
        "metrics": create_table_artifact(table=metrics_rows(training, evaluation, steps), key=f"metrics-{run}",
                                         description=metrics_description(evaluation, run)),
        "curve": create_markdown_artifact(
            markdown=f"# Training curve of `{run}`\n\n![training curve]({data_uri(curve, 'image/png')})\n",
            key=f"curve-{run}", description=f"loss, learning rate and {score} of {run}"),
        "lineage": create_markdown_artifact(markdown=render_lineage_markdown(lineage), key=f"lineage-{run}",
                                            description=f"what {run} was made from"),
    }
    overlay = f"{run_dir}/overlay_{evaluation['split']}.png"
    image = thumbnail_jpeg(platform.read_file(volume, overlay))
    ids["overlay"] = create_markdown_artifact(
        markdown=f"# Predictions of `{run}` on {evaluation['split']}\n\nColoured: predicted lanes per slot; "
                 f"white dots: ground truth.\n\n![predictions]({data_uri(image, 'image/jpeg')})\n",
        key=f"predictions-{run}", description=f"prediction overlay of {run}")
    get_run_logger().info("published artifacts for %s: %s", run, ", ".join(ids))
    return {name: str(artifact_id) for name, artifact_id in ids.items()}
