"""``train_pipeline``: the seed's manual steps as one Prefect DAG (DESIGN §2), on any platform.

    volume -> dataset -> shared access -> submit -> wait (streams events) -> evaluate -> snapshot
    -> artifacts, with the volume's service level held while the run trains.

Training, evaluation and packaging hold one slot of the ``gpu`` concurrency limit (when it exists), so sweeps
and concurrent UI runs queue for accelerators instead of oversubscribing them, and a queued run never takes
the GPU a run still scores on. Once it has its slot, the run holds the
volume's service level (``tasks.holding``) until it has trained: runs side by side on one volume share the
promotion, and the volume goes home when the last of them is done — however it ends. A retried stage leaves
the level alone.
"""

from __future__ import annotations

from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.events import emit_event
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as current_run
from prefect.states import Completed, State
from pydantic import Field

from flows.params import TrainParams, credentials_in_parameters, takes_train_params
from tasks.gpu_slot import GPU_LIMIT, gpu_slot, refuse_more_than_the_limit, release_slot_of
from tasks.handover import handed_over
from tasks.lineage import build_lineage, code_version
from tasks.names import DNS_LABEL, MAX_RUN_KEY, run_name, snapshot_name
from tasks.pipeline import (
    capture_snapshot,
    demote_service_level,
    ensure_dataset_volume,
    ensure_shared_access,
    evaluate,
    package_model,
    prepare_dataset,
    promote_service_level,
    publish_artifacts,
    read_dataset_index,
    read_service_level,
    record_lineage,
    release_service_level,
    submit_training,
    wait_for_training,
)
from tasks.platforms import TrainingOutcome, TrainingSpec, VolumeRef, load_platform
from tasks.service_level import ThroughputNeed

RunKey = Annotated[str | None, Field(None, max_length=MAX_RUN_KEY, pattern=DNS_LABEL.pattern)]


def stop_run(flow_run: Any, why: str, logger: Any) -> None:
    """Stop a ``train_pipeline`` flow run's training and hand back what it held (the volume's level, its
    ``gpu`` slot), for a run whose own code no longer runs (cancelled, crashed, or its sweep's process
    killed). Each step is tried whatever the one before did: a failure is logged and the next goes on."""
    try:
        params = TrainParams.from_flow_parameters(flow_run.parameters)
        name = run_name(flow_run.id, key=flow_run.parameters.get("run_key"))
    except Exception:  # parameters or a run key the run refused: nothing was started under them
        return
    platform = load_platform(params.platform)
    volume = VolumeRef(name=params.volume, location="")
    try:
        stopped = platform.cancel_training(name, volume, owner=str(flow_run.id))
        logger.info("training job %s %s (%s)", name, "stopped" if stopped else "was not running", why)
    except Exception as exc:  # the volume and the slot below must still go back
        logger.error("could not stop training job %s (%s): %s", name, why, exc)
    release_service_level(platform, volume, str(flow_run.id), name, why, logger=logger)
    try:
        if release_slot_of(flow_run.id):
            logger.info("run %s: its '%s' slot is free again", name, GPU_LIMIT)
    except Exception as exc:
        logger.warning("run %s: could not release its '%s' slot (%s); Prefect frees it when the lease expires "
                       "(5 minutes)", name, GPU_LIMIT, exc)


def stop_training(flow: Any, flow_run: Any, state: Any) -> None:
    """Cancellation/crash hook: stop the run's training job so nothing keeps running unobserved."""
    stop_run(flow_run, f"flow run {state.name.lower()}", flow_run_logger(flow_run, flow))


@flow(name="train_pipeline", on_cancellation=[stop_training], on_crashed=[stop_training])
@takes_train_params
def train_pipeline(params: TrainParams, run_key: RunKey = None) -> dict[str, Any] | State:
    """Prepare TuSimple on a volume, train SCNN with Horovod, score it, snapshot and publish it.

    A run whose training honoured a stop request (a sweep's pruner) ends Completed under the request's
    state name ("Pruned") without scoring, snapshot or package.

    Args:
        run_key: names the run train-<run_key> instead of after this flow run: a later run of the same key
            resumes its checkpoint (a sweep's interrupted trial); empty for a new run each time
    """
    logger = get_run_logger()
    run = run_name(current_run.id, key=run_key)
    platform = load_platform(params.platform)
    logger.info("run %s on platform %s (%s)", run, params.platform, type(platform).__name__)
    for url in credentials_in_parameters(params.source):
        logger.warning("the dataset URL %s carries a credential in this run's parameters, which Prefect keeps in "
                       "its database and shows in its UI: keep the URL's query string in a Prefect Secret block and "
                       "name the block in the artifact's query_secret (an index's: the source's index_query_secret) "
                       "instead", url)
    refuse_more_than_the_limit(params.gpus)  # before anything is prepared: it could never train
    release = None
    if params.source.index is not None:  # trains on the newest version; lineage says which
        artifacts, release = read_dataset_index(params.source.index_url())
        params = params.pinned_to(artifacts)

    volume = ensure_dataset_volume(platform, params.volume)
    # An elastic run takes every worker there is, up to its max_workers: the volume must serve that many.
    need = ThroughputNeed(workers=params.elastic.max_workers if params.elastic else params.workers,
                          images_per_second_per_worker=params.images_per_second_per_worker,
                          bytes_per_image=params.bytes_per_image)
    # However the run fails (a promotion that itself failed included), it leaves its hold on the level; a
    # stage that is retried does not get here, and leaves the level where it is.
    try:
        return _train_on(params, platform, volume, need, run, release)
    except BaseException as exc:
        if not handed_over(exc):  # a run handed to its next attempt (a drained flow pod) trains on: it keeps it
            release_service_level(platform, volume, str(current_run.id), run, "a failed run")
        raise


def stopped_early(run: str, outcome: TrainingOutcome, dataset: dict[str, Any], spec: TrainingSpec,
                  params: TrainParams) -> State:
    """The flow run's end when its training honoured a stop request: in the state the request names
    ("Pruned"), a Completed state (not failed, so never retried) carrying what the run did."""
    request = outcome.stopped or {}
    message = (f"training stopped at step {outcome.steps} of {outcome.total_steps}: "
               f"{request.get('reason', 'a stop was requested')}")
    get_run_logger().info("run %s: %s; not evaluated, snapshotted or packaged", run, message)
    return Completed(name=str(request.get("state") or "Stopped"), message=message[:500], data={
        "run": run, "flow_run_id": str(current_run.id), "volume": spec.volume.name, "stopped": request,
        "steps": outcome.steps, "total_steps": outcome.total_steps, "resumed_from": outcome.resumed_from,
        "val": outcome.val, "dataset_version": dataset["dataset_version"], "data_dir": spec.data_dir,
        "run_dir": spec.run_dir, "platform": params.platform})


def _train_on(params: TrainParams, platform: Any, volume: VolumeRef, need: ThroughputNeed,
              run: str, release: dict[str, str] | None) -> dict[str, Any] | State:
    logger = get_run_logger()
    holder = str(current_run.id)
    dataset = {**prepare_dataset(platform, volume, params.source.to_artifacts()), "release": release}
    ensure_shared_access(platform, volume)
    spec = TrainingSpec(job_name=run, volume=volume, data_dir=dataset["dataset_dir"], run_dir=f"runs/{run}",
                        preset=params.preset, workers=params.workers, settings=params.trainer_settings(),
                        elastic=params.elastic,
                        labels={"flow-run": holder, "dataset-version": dataset["dataset_version"]})
    # One slot per GPU it trains on; scoring and packaging use fewer, within the same slots.
    with gpu_slot(holder, logger.warning, slots=params.gpus,
                  waiting=lambda said: logger.info("run %s: %s", run, said)):
        # The volume's level is held while the run trains: a run queued for a slot holds no costlier level
        # meanwhile, and one that has trained no longer adds its reads to those of the run that trains next.
        promote_service_level(platform, volume, params.promote, need, run, holder)
        submit_training(platform, spec)
        outcome = wait_for_training(platform, spec, params.timeout_minutes * 60)
        levels = demote_service_level(platform, volume, holder, run)
        if outcome.stopped is not None:  # ended early on purpose (a sweep pruned it): nothing to score or keep
            return stopped_early(run, outcome, dataset, spec, params)
        # Scoring and packaging run on a GPU too: still inside the slot, so that a run queued for it cannot
        # take the GPU this run has not finished with (its evaluation pod would wait behind that run's workers).
        evaluation, lineage, package, snapshot = _score_and_package(params, platform, volume, spec, run, dataset,
                                                                    outcome, levels)
    record_lineage(platform, volume, spec.run_dir, lineage)
    if snapshot:
        capture_snapshot(platform, volume, snapshot, spec.data_dir, spec.run_dir, lineage)
    else:
        logger.info("snapshot off for this run")
    publish_artifacts(platform, volume, spec.run_dir, outcome, evaluation, lineage)
    emit_event("laneflow.training.finished", resource={"prefect.resource.id": f"laneflow.run.{run}",
                                                       "prefect.resource.name": run},
               payload={"metrics": evaluation, "dataset_version": dataset["dataset_version"], "snapshot": snapshot})
    from tasks.tracking import track_in_mlflow

    tracked = track_in_mlflow(platform, volume, spec.run_dir, lineage)  # None when off or failed (one warning)
    return {"run": run, "flow_run_id": str(current_run.id), "volume": volume.name, "snapshot": snapshot,
            "dataset_version": dataset["dataset_version"], "metrics": evaluation, "steps": outcome.steps,
            "resumed_from": outcome.resumed_from, "data_dir": spec.data_dir, "run_dir": spec.run_dir,
            "dataset_steps": dataset["steps"], "package": package["package"] if package else None,
            "platform": params.platform, "mlflow": tracked}


def _score_and_package(params: TrainParams, platform: Any, volume: VolumeRef, spec: TrainingSpec, run: str,
                       dataset: dict[str, Any], outcome: TrainingOutcome, levels: Any
                       ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, str | None]:
    """The trained run scored on its split and packaged (the stages that need a GPU after training): its
    evaluation, lineage, package (None when off) and the snapshot name it will take (None when off)."""
    evaluation = evaluate(platform, volume, spec.run_dir, spec.data_dir, params.eval_split)
    snapshot = snapshot_name(volume.name, run) if params.snapshot else None
    service_level = read_service_level(platform, volume, levels)
    lineage = build_lineage(
        run=run, flow_run_id=str(current_run.id), flow_run_name=current_run.name, platform=params.platform,
        volume=volume.name, dataset=dataset, code=code_version(), parameters=params.for_record(),
        training={"steps": outcome.steps, "resumed_from": outcome.resumed_from,
                  "duration_s": outcome.duration_s, "trainer_eval": outcome.eval, "model": outcome.model,
                  "numerics": outcome.numerics},
        evaluation=evaluation, snapshot=snapshot, service_level=service_level)
    package = None
    if params.package:  # inside the run's folder: the snapshot carries it
        package = package_model(platform, volume, spec.run_dir, spec.data_dir, params.eval_split, lineage)
        lineage["package"] = package["package"]
    else:
        get_run_logger().info("packaging off for this run")
    return evaluation, lineage, package, snapshot


def evaluate_on_a_gpu(platform: Any, volume: VolumeRef, run_dir: str, data_dir: str, split: str,
                      out_dir: str | None = None) -> dict[str, Any]:
    """``evaluate`` outside a training run (a nightly's re-score, a sweep's test score): it needs a GPU as a run's
    own scoring does, so it holds one slot of the ``gpu`` limit while it scores — never while a run it waits for
    holds slots of its own (the caller's child runs have ended)."""
    with gpu_slot(str(current_run.id), get_run_logger().warning):
        return evaluate(platform, volume, run_dir, data_dir, split, out_dir)
