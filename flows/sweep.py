"""``sweep``: many ``train_pipeline`` child flow runs — a grid and listed parameter sets, or a search of a
``space`` with Optuna (random or TPE) asked and told from this flow.

At most ``max_concurrent`` children run at once: the sweep's own bound, kept by the sweep itself. Their
training also holds a slot of the ``gpu`` concurrency limit, which is the operator's (``laneflow deploy``
creates it; no run or sweep changes it), so sweeps, nightlies and UI runs together never train on more
accelerators than it allows. The dataset is prepared once, before the children start, so they all find
it cached.

Hyperparameters are chosen without the test set: every child is scored on ``val`` (TuSimple's
``label_data_0531``, the split the trainer holds out), the leaderboard ranks by val accuracy without the
200 ms rule, and only the best run is then scored on ``test``, once. Ends with a leaderboard table
artifact and a ``laneflow.sweep.best`` event.

With a ``pruner`` a searching sweep also stops hopeless trials early: each trial's val scores (every
``eval_every`` steps) are reported to Optuna from the trial's wait loop (``tasks.pruning``), and a trial
Optuna prunes checkpoints, stops, and ends as a "Pruned" flow run — completed, not failed, not retried.
"""

from __future__ import annotations

import concurrent.futures
import io
import threading
from contextlib import ExitStack
from typing import Annotated, Any, Literal

from prefect import flow, get_client, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import deployment
from prefect.runtime import flow_run as current_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field, TypeAdapter, ValidationError

from flows.model_settings import flat
from flows.params import SweepError, TrainParams, expand_sweep, takes_train_params
from flows.search import (
    SearchChoices,
    SearchDimension,
    SearchRange,
    SearchSpace,
    SearchStrategy,
    check_space,
    distributions,
)
from flows.study import PRUNED, AskedTrial, SweepStudy, journal_path, record_interrupted
from flows.train import GPU_LIMIT, evaluate_on_a_gpu, train_pipeline
from flows.trial_threads import trial_thread, trials_stop_with_the_sweep
from tasks.champion import score_name, selection_accuracy
from tasks.names import DNS_LABEL, run_name
from tasks.pipeline import ensure_dataset_volume, prepare_dataset, read_dataset_index
from tasks.platforms import VolumeRef, load_platform
from tasks.pruning import StopVerdict, judged_by
from tasks.report import data_uri
from tasks.study_lock import StudyLease, holding_study

MAX_CHILDREN_IN_FLIGHT = 16
PrunerName = Literal["none", "median", "successive_halving", "hyperband"]
#: A study's name: its trials' run keys (<study>-<trial>) must fit a run name.
StudyName = Annotated[str | None, Field(None, max_length=12, pattern=DNS_LABEL.pattern)]


@task(name="sweep_run", task_run_name="sweep-run-{index}", cache_policy=NO_CACHE)
def run_child(params: TrainParams, index: int, name: str, run_key: str | None = None) -> dict[str, Any]:
    """One child flow run; its failure becomes a leaderboard row, not the sweep's failure."""
    with trial_thread(str(current_run.id)):  # the sweep's id: a stopped sweep stops this trial too
        state = train_pipeline.with_options(flow_run_name=name)(**params.flow_parameters(), run_key=run_key,
                                                                 return_state=True)
    result = state.result(raise_on_failure=False)
    row = {"index": index, "state": state.name, "flow_run_id": str(state.state_details.flow_run_id)}
    if state.is_completed():  # trained to its end, or stopped by the pruner (state "Pruned")
        return {**row, **result}
    return {**row, "error": str(result)[:500]}


def val_accuracy(row: dict[str, Any]) -> float | None:
    """What a sweep ranks by: the child's val score without the 200 ms rule (None when it did not finish)."""
    metrics = row.get("metrics")
    return selection_accuracy(metrics) if row.get("state") == "Completed" and metrics else None


def last_val_report(row: dict[str, Any]) -> dict[str, Any] | None:
    """A pruned trial's last periodic val score (the one it was judged on)."""
    return (row.get("val") or [None])[-1] if row.get("state") == PRUNED else None


def leaderboard(rows: list[dict[str, Any]], varied: list[str]) -> list[dict]:
    """Best val accuracy first, then pruned trials (by the val score they were stopped at), failed runs last.
    Each row's ``params`` are the values it was given; ``steps`` what it trained (the compute it used)."""
    table = []
    for row in rows:
        scored = row.get("metrics") if val_accuracy(row) is not None else last_val_report(row)
        accuracy = selection_accuracy(scored) if scored else None
        table.append({"rank": 0, "trial": row["index"], "run": row.get("run", "-"), "state": row["state"],
                      **{key: row["params"].get(key) for key in varied},
                      # Ranked without the 200 ms run-time rule (tasks.champion.selection_accuracy).
                      "val accuracy": round(accuracy, 4) if accuracy is not None else None,
                      "val official accuracy": round(scored["accuracy"], 4) if scored else None,
                      "steps": row.get("steps"),
                      "test accuracy": None, "test official accuracy": None})
    order = {"Completed": 0, PRUNED: 1}
    table.sort(key=lambda r: (order.get(r["state"], 2), r["val accuracy"] is None, -(r["val accuracy"] or 0.0),
                              r["trial"]))
    for rank, entry in enumerate(table, 1):
        entry["rank"] = rank
    return table


#: Child runs a stopped sweep leaves to themselves: they ended on their own.
_ENDED_ON_THEIR_OWN = ("COMPLETED", "FAILED")


def trial_runs(client: Any, sweep_run_id: Any) -> list[Any]:
    """The sweep's child ``train_pipeline`` flow runs (every trial it started), a page at a time."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    found, page = [], 200
    while True:
        batch = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_run_id])), limit=page, offset=len(found))
        found.extend(batch)
        if len(batch) < page:
            return found


def stop_trials(flow: Any, flow_run: Any, state: Any) -> None:
    """Cancellation/crash hook: every trial the sweep left running is stopped — its training (the local
    ``horovodrun`` or the MPIJob), its hold on the volume's level and its ``gpu`` slot — and ends Cancelled,
    and a kept study records those trials as interrupted, so the next sweep of it asks for them again.

    A sweep cancelled from the UI is ended by its worker: SIGTERM, which the sweep raises in its trials' threads
    too (``flows.trial_threads``: each trial stops its training and ends Cancelled by its own hook), then
    SIGKILL if the process is still there after the grace; this hook runs after that (in the worker), as the
    sweep's, and stops whatever a killed process left running."""
    logger = flow_run_logger(flow_run, flow)
    ended = "cancelled" if state.is_cancelling() or state.is_cancelled() else state.name.lower()
    why = f"its sweep {flow_run.name} was {ended}"
    with get_client(sync_client=True) as client:
        left = stop_left_trials(client, flow_run.id, why, logger)
        logger.info("sweep %s %s: %d trial run(s) stopped", flow_run.name, ended, left)
        _record_interrupted_trials(client, flow_run, why, logger)


def stop_left_trials(client: Any, sweep_run_id: Any, why: str, logger: Any) -> int:
    """Stop every trial run the sweep ``sweep_run_id`` left that did not end on its own — its training, its hold
    on the volume's level, its ``gpu`` slot — and end it Cancelled; how many there were. The sweep's hook does so
    when it ends; a sweep that takes over the study of one whose process was killed (no hook ran) does it for
    that one (without it, its resumed trial would wait out the killed trial's slot lease)."""
    from prefect.states import Cancelled

    from flows.train import stop_run

    left = [child for child in trial_runs(client, sweep_run_id)
            if child.state is None or child.state.type.value not in _ENDED_ON_THEIR_OWN]
    for child in left:  # each stopped first (nothing trains on), then told how it ended
        stop_run(child, why, logger)
    for child in left:
        if child.state is None or not child.state.is_final():
            client.set_flow_run_state(child.id, Cancelled(message=f"Cancelled: {why}"), force=True)
    return len(left)


def _record_interrupted_trials(client: Any, flow_run: Any, why: str, logger: Any) -> None:
    """The stopped sweep's kept study (if it had one) told which trials were interrupted, holding the study as
    that sweep (its process is gone; a sweep that took the study over has them in hand already)."""
    parameters = flow_run.parameters or {}
    if parameters.get("search", "grid") == "grid":
        return
    try:
        params = TrainParams.from_flow_parameters(parameters)
        deployment_name = client.read_deployment(flow_run.deployment_id).name if flow_run.deployment_id else None
        kept = study_name_of(parameters.get("study"), deployment_name)
    except Exception as exc:  # it never ran a study it could name
        logger.info("no kept study to update (%s)", exc)
        return
    if kept is None:
        return
    try:
        platform = load_platform(params.platform)
        volume = VolumeRef(name=params.volume, location="")  # it exists: the sweep prepared its dataset there
        with holding_study(platform, volume, kept, str(flow_run.id), str(flow_run.name), False, logger.info) as lease:
            marked = record_interrupted(platform, volume, kept, lease, why)
        logger.info("study %s: trial(s) %s recorded as interrupted; the next sweep of it runs them again from their "
                    "checkpoints", kept, ", ".join(map(str, marked)) or "none")
    except Exception as exc:  # the next sweep of the study finds them still running and does the same
        logger.warning("study %s: could not record its interrupted trials (%s); the next sweep of it still runs "
                       "them again", kept, exc)


@flow(name="sweep", task_runner=ThreadPoolTaskRunner(max_workers=MAX_CHILDREN_IN_FLIGHT),
      on_cancellation=[stop_trials], on_crashed=[stop_trials])
@takes_train_params
def sweep(params: TrainParams, grid: dict[str, list[Any]] | None = None, runs: list[dict[str, Any]] | None = None,
          max_concurrent: Annotated[int, Field(ge=1)] = 1, search: SearchStrategy = "grid",
          space: SearchSpace | None = None, trials: Annotated[int, Field(ge=1, le=1000)] = 8,
          seed: int | None = None, study: StudyName = None, pruner: PrunerName = "none",
          wait_for_study: bool = False) -> list[dict[str, Any]]:
    """Train every parameter set (grid product, then listed runs), or ``trials`` sampled from ``space``, on
    the base parameters; rank them by val accuracy and score the best on test.

    Args:
        grid: parameter name -> values; every combination is one run, e.g. {"lr": [0.02, 0.05]} (search=grid);
            model_settings.<name> varies one setting of the model, e.g. {"model_settings.cells": [50, 100]}
        runs: further runs, each a dict of the parameters it changes, e.g. [{"lr": 0.1, "batch_size": 4}] or
            [{"model": "ufld", "model_settings.backbone": "resnet34"}]
        max_concurrent: at most this many of this sweep's runs at once (the sweep's own bound; the operator's
            'gpu' concurrency limit still bounds all training, this sweep's and everyone else's)
        search: grid (grid and runs as given), random or tpe (Optuna's samplers over space)
        space: for random/tpe, parameter name (or model_settings.<name>) -> {"low", "high", "log", "step"} or
            {"choices": [...]}
        trials: for random/tpe, how many runs to sample
        seed: for random/tpe, the sampler's seed (the same seed asks the same first trials)
        study: for random/tpe, the study to continue, kept on the volume as studies/<study>.journal
            (default: the deployment's name; none outside a deployment): finished trials are kept, an
            interrupted one is run again from its checkpoint, and trials counts the study's total
        pruner: for random/tpe, stop trials whose val scores (every eval_every steps, which must be set) Optuna
            judges hopeless: median, successive_halving or hyperband; none trains every trial to its end
        wait_for_study: when another sweep holds the study, wait for it to end (else this sweep fails at once,
            naming it): one sweep per study at a time
    """
    logger = get_run_logger()
    if (current_run.run_count or 1) > 1:
        # This flow run ran before and was stopped without its hooks (its pod's node drained: the worker
        # reschedules the same flow run). The trials that attempt started are its children still marked running,
        # holding their 'gpu' slots and level holds: stopped here, before this attempt runs them again.
        _stop_trials_left_by(str(current_run.id), f"an earlier attempt of sweep {current_run.name} was stopped "
                             "(its flow run runs again)", logger)
    dimensions: dict[str, SearchDimension] = {}
    if params.source.index is not None:  # every trial trains on the same version, read once
        params = params.pinned_to(read_dataset_index(params.source.index_url())[0])
    if search == "grid":
        if space:
            raise SweepError("space is searched by search='random' or 'tpe'; a grid sweep takes grid and runs")
        if pruner != "none":
            raise SweepError(f"pruner={pruner!r} stops trials of a search: use search='random' or 'tpe'")
        param_sets = [p.model_copy(update={"eval_split": "val"}) for p in expand_sweep(params, grid or {}, runs or [])]
        values = [flat(p.model_dump()) for p in param_sets]  # a model setting is a column of its own
        varied = sorted({key for row in values for key in row if key not in ("source", "eval_split")
                         and len({repr(row_values.get(key)) for row_values in values}) > 1})
        planned = len(param_sets)
    else:
        if grid or runs:
            raise SweepError(f"search={search!r} samples from space; grid and runs are for search='grid'")
        if pruner != "none" and not params.eval_every:
            raise SweepError(f"pruner={pruner!r} judges trials on their val scores during training: set eval_every "
                             "(score val every that many steps, e.g. a tenth of a trial's steps)")
        dimensions = check_space(space or {}, params)
        varied, planned, param_sets = sorted(dimensions), trials, [params]
    logger.info("%s sweep of %d runs varying %s; at most %d at once (and within the '%s' limit); every run scored "
                "on val", search, planned, ", ".join(varied) or "nothing", max_concurrent, GPU_LIMIT)
    # Prepare each distinct dataset once, so concurrent children never download the same artifacts.
    datasets = {(p.platform, p.volume, tuple(p.source.to_artifacts())) for p in param_sets}
    for platform_name, volume_name, artifacts in sorted(datasets, key=repr):
        platform = load_platform(platform_name)
        prepare_dataset(platform, ensure_dataset_volume(platform, volume_name), list(artifacts))
    kept = study_name_of(study, deployment.name) if search != "grid" else None
    with ExitStack() as held:
        lease = None
        if kept is not None:  # one sweep per study, for as long as this one runs (its best's test score goes in too)
            platform = load_platform(params.platform)
            lease = held.enter_context(holding_study(platform, ensure_dataset_volume(platform, params.volume), kept,
                                                     str(current_run.id), str(current_run.name), wait_for_study,
                                                     logger.info))
            if lease.took_over_from is not None:  # a killed sweep's process ran no hook: its trials are ours to stop
                _stop_trials_left_by(lease.took_over_from.sweep, f"its sweep {lease.took_over_from.name} is gone "
                                     "(taken over)", logger)
        with trials_stop_with_the_sweep(str(current_run.id)):
            return _run_sweep(params, search, param_sets, varied, max_concurrent, dimensions, trials, seed, kept,
                              pruner, lease)


def _stop_trials_left_by(sweep_run_id: str, why: str, logger: Any) -> None:
    """What a dead sweep's hook would have done for its trials, before this sweep resumes them: their MPIJobs
    (or horovodruns) stopped, their volume levels and ``gpu`` slots handed back. Never fails the sweep: a trial
    left as it was still ends — its slot when Prefect's lease on it expires (5 minutes), its level hold when that
    hold's lifetime runs out."""
    try:
        with get_client(sync_client=True) as client:
            stopped = stop_left_trials(client, sweep_run_id, why, logger)
        logger.info("%d trial run(s) stopped and their slots and level holds handed back: %s", stopped, why)
    except Exception as exc:
        logger.warning("could not stop the trial runs left behind (%s; %s): a trial resumed now may wait for its "
                       "earlier run's 'gpu' slot until Prefect's lease on it expires (5 minutes)", why, exc)


def _run_sweep(params: TrainParams, search: str, param_sets: list[TrainParams], varied: list[str],
               max_concurrent: int, dimensions: dict[str, SearchDimension], trials: int, seed: int | None,
               study: str | None, pruner: str, lease: StudyLease | None) -> list[dict[str, Any]]:
    """The sweep's children, its leaderboard and its best scored on test (the dataset is prepared; ``study``
    is the kept study's name, held by ``lease``, or None)."""
    searched: SweepStudy | None = None
    if search == "grid":
        rows = [{**row, "params": {key: flat(child.model_dump()).get(key) for key in varied}}
                for row, child in zip(_run_grid(param_sets, max_concurrent, str(current_run.name)), param_sets,
                                      strict=True)]
    else:
        searched = _search(params, dimensions, search, trials, max_concurrent, seed, current_run.name, study, pruner,
                           str(current_run.id), lease)
        rows = searched.rows()  # a kept study's earlier sweeps' trials too
        create_markdown_artifact(markdown=study_plots_markdown(searched.optuna_study,
                                                               f"{search} sweep {current_run.name}"),
                                 key="sweep-study", description=f"Optuna's view of {search} sweep {current_run.name}")
    table = leaderboard(rows, varied)
    # Only a trial trained to its end has a model to test (a pruned one's score is from part of its run).
    best = next((entry for entry in table if entry["state"] == "Completed" and entry["val accuracy"] is not None),
                None)
    if best is not None:
        _score_best_on_test(best, next(row for row in rows if row["index"] == best["trial"]), searched)
        emit_event("laneflow.sweep.best", resource={"prefect.resource.id": f"laneflow.sweep.{current_run.name}",
                                                   "prefect.resource.name": str(current_run.name)},
                   payload={"best": best, "search": search})
    completed, pruned = sum(r["state"] == "Completed" for r in rows), sum(r["state"] == PRUNED for r in rows)
    create_table_artifact(table=table, key="sweep-leaderboard", description=(
        f"{search} sweep {current_run.name}: {completed} of {len(rows)} runs completed"
        + (f", {pruned} pruned (their val score is the one they were stopped at)" if pruned else "")
        + f", {sum(r.get('steps') or 0 for r in rows)} training steps in all; " + ranking_words(rows, best)))
    return table


def ranking_words(rows: list[dict[str, Any]], best: dict[str, Any] | None) -> str:
    """What the leaderboard is ranked by and what the best run scored on test, named as the trials' benchmark
    names its score: CULane's F1 (its "accuracy" columns hold it; it has no run-time rule), or TuSimple's
    accuracy without the 200 ms rule, the official score beside it."""
    scored = [report for row in rows for report in (row.get("metrics"), last_val_report(row)) if report]
    if any(score_name(report) == "F1" for report in scored):
        return ("ranked by val F1 (CULane's official metric at IoU 0.5, on its val list, held out from training; "
                "the accuracy columns hold this F1). Only the best run was scored on test, once"
                + (f": F1 {best['test accuracy']}" if best else "") + " — hyperparameters are never chosen on "
                "the test set.")
    return ("ranked by val accuracy (TuSimple's label_data_0531, held out from training) without the 200 ms "
            "run-time rule, the official score beside it. Only the best run was scored on test, once"
            + (f": {best['test accuracy']} (official {best['test official accuracy']})" if best else "")
            + " — hyperparameters are never chosen on the test set.")


def _run_grid(param_sets: list[TrainParams], max_concurrent: int, sweep_name: str) -> list[dict[str, Any]]:
    """Every parameter set as a child, at most ``max_concurrent`` at once; their rows in the sets' order."""
    pending = list(enumerate(param_sets))
    in_flight: dict[concurrent.futures.Future, tuple[Any, int]] = {}
    rows: dict[int, dict[str, Any]] = {}
    while pending or in_flight:
        while pending and len(in_flight) < max_concurrent:
            index, child = pending.pop(0)
            future = run_child.submit(child, index, f"{sweep_name}-{index}")
            in_flight[future.wrapped_future] = (future, index)
        done, _ = concurrent.futures.wait(list(in_flight), return_when=concurrent.futures.FIRST_COMPLETED)
        for wrapped in done:
            future, index = in_flight.pop(wrapped)
            rows[index] = future.result()
    return [rows[index] for index in sorted(rows)]


class TrialJudge:
    """Reports a trial's val scores to Optuna and stops the trial when its pruner says so; called from the
    trial's wait loop (another thread of this process), so every use of the study holds ``lock``.

    Optuna hears each score at the training images seen so far (steps x batch size x workers), so trials
    of different batch sizes or worker counts are compared at equal data, not at equal steps. A verdict
    stands: a retried run (its stop request lost with a preempted attempt) is stopped at its next score; a
    score at or before one already heard (a log replayed when a job is adopted) is not reported again.
    """

    def __init__(self, trial: Any, pruner: str, lock: threading.Lock, images_per_step: int) -> None:
        self.trial, self.pruner, self.lock, self.images_per_step = trial, pruner, lock, images_per_step
        self.verdict: StopVerdict | None = None
        self.heard = 0

    def __call__(self, step: int, value: float) -> StopVerdict | None:
        images = step * self.images_per_step
        if self.verdict is not None or images <= self.heard:
            return self.verdict
        self.heard = images
        with self.lock:
            self.trial.report(value, images)
            if not self.trial.should_prune():
                return None
        self.verdict = StopVerdict(f"Optuna's {self.pruner} pruner stopped trial {self.trial.number}: val accuracy "
                                   f"{value:.4f} after {images} training images (step {step}) is not promising "
                                   "against the study's other trials", PRUNED)
        return self.verdict


def images_per_step(params: TrainParams) -> int:
    """Training images one step of ``params`` uses, all workers together: the pruners' unit of resource."""
    return params.batch_size * params.workers


def smallest_images_per_step(params: TrainParams, dimensions: dict[str, SearchDimension]) -> int:
    """The fewest images per step any trial of the space can use: the first rung of a halving pruner is
    ``eval_every`` steps of it."""
    def lowest(name: str) -> int:
        dimension = dimensions.get(name)
        if isinstance(dimension, SearchChoices):
            return int(min(dimension.choices))
        if isinstance(dimension, SearchRange):
            return int(dimension.low)
        return int(getattr(params, name))

    return lowest("batch_size") * lowest("workers")


def make_pruner(name: str, trials: int, min_resource: int) -> Any:
    """Optuna's pruner for ``name``; resources are training images, the first judged at ``min_resource``.

    median: a trial worse than the median of finished trials after as many images stops, once a few trials
    (a quarter of the budget, 1 to 5) have finished to set the median. successive_halving / hyperband: only
    the best third at each rung (min_resource, 3x, 9x ... images) goes on.
    """
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=max(1, min(5, trials // 4)), n_warmup_steps=0)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=3)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=min_resource, max_resource="auto", reduction_factor=3)
    return optuna.pruners.NopPruner()


def _search(params: TrainParams, dimensions: dict[str, SearchDimension], strategy: str, trials: int,
            max_concurrent: int, seed: int | None, sweep_name: str, study_name: str | None,
            pruner: str = "none", sweep_id: str = "", lease: StudyLease | None = None) -> SweepStudy:
    """Ask Optuna for each trial's parameters, run it as a child, tell Optuna its val accuracy; at most
    ``max_concurrent`` in flight. With a ``study_name`` the study is kept on the volume (flows/study.py),
    continued where an earlier sweep left it; without, it is this sweep's own, in memory."""
    logger = get_run_logger()
    space = distributions(dimensions, params)
    if study_name is None:
        study = SweepStudy.of_sweep(sweep_id, space, params)
    else:
        platform = load_platform(params.platform)
        study = SweepStudy.open(study_name, space, params, platform, ensure_dataset_volume(platform, params.volume),
                                lease)
    if retried := study.recover():
        logger.info("study %s: trials %s were interrupted by an earlier sweep; they run again first, resuming "
                    "their checkpoints", study_name, retried)
    if study.kept:
        logger.info("study %s (%s on volume %s): %d of %d trials done", study_name, journal_path(study_name),
                    params.volume, study.counted(), trials)
    study.search_with(strategy, seed, trials, max_concurrent,
                      make_pruner(pruner, trials, params.eval_every * smallest_images_per_step(params, dimensions)))
    in_flight: dict[concurrent.futures.Future, tuple[Any, AskedTrial]] = {}
    asked = study.counted()
    gave_up: ValueError | None = None
    with ExitStack() as judges:  # every trial's judge is let go when the sweep ends, however it ends
        while asked < trials or in_flight:
            while asked < trials and len(in_flight) < max_concurrent:
                try:
                    trial = study.ask()
                except ValueError as exc:  # the space gives no run any more: the trials running end and are told
                    gave_up, asked = exc, trials
                    break
                if pruner != "none":
                    judges.enter_context(judged_by(run_name("", key=trial.run_key), TrialJudge(
                        trial.optuna_trial, pruner, study.lock, images_per_step(trial.params))))
                name = f"{study_name}-trial-{trial.number}" if study_name else f"{sweep_name}-{trial.number}"
                future = run_child.submit(trial.params, trial.number, name, trial.run_key)
                in_flight[future.wrapped_future] = (future, trial)
                asked += 1
            done, _ = concurrent.futures.wait(list(in_flight), return_when=concurrent.futures.FIRST_COMPLETED)
            for wrapped in done:
                future, trial = in_flight.pop(wrapped)
                chosen = dict(trial.optuna_trial.params)
                try:
                    row = {**future.result(), "params": chosen}
                except Exception as exc:  # the child could not even be run: a failed trial, the sweep goes on
                    row = {"index": trial.number, "state": "Failed", "error": str(exc)[:500], "params": chosen}
                study.tell(trial, row, val_accuracy(row))
    if gave_up is not None:
        raise gave_up
    return study


def study_name_of(given: str | None, deployment_name: str | None) -> str | None:
    """The study to continue: the one given, else the deployment's name (checked as a study name, since it
    becomes part of run names), else none (a study of this sweep only)."""
    name = given if given is not None else deployment_name
    if name is None:
        return None
    try:
        return TypeAdapter(StudyName).validate_python(name)
    except ValidationError:
        raise SweepError(f"study {name!r} (the {'given name' if given is not None else 'deployment name'}) cannot "
                         f"name a study: at most 12 lowercase letters, digits or '-'; pass study=...") from None


def study_plots_markdown(study: Any, title: str) -> str:
    """Optuna's optimization history, parameter importances and parallel coordinates as pictures in markdown;
    a plot Optuna cannot draw yet (importances need two finished trials that differ) says why instead."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory only
    import warnings

    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    sections = [f"# {title}\n\nVal accuracy (without the 200 ms rule) of each trial, as Optuna was told it."]
    for name, plot in (("Optimization history", plots.plot_optimization_history),
                       ("Parameter importances", plots.plot_param_importances),
                       ("Parallel coordinates", plots.plot_parallel_coordinate)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna.visualization.matplotlib is marked experimental
                axes = plot(study)
        except Exception as exc:  # a missing picture must not fail a finished sweep
            sections.append(f"## {name}\n\nnot drawn: {exc}")
            continue
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
        plt.close(figure)
        sections.append(f"## {name}\n\n![{name}]({data_uri(buffer.getvalue(), 'image/png')})")
    return "\n\n".join(sections) + "\n"


def _score_best_on_test(best: dict[str, Any], row: dict[str, Any], study: SweepStudy | None = None) -> None:
    """The best run's test score, the one time the test set is looked at (kept in a kept study, so a later
    sweep whose best is the same trial shows it without scoring it again)."""
    def score() -> dict[str, Any]:
        platform = load_platform(row["platform"])
        return evaluate_on_a_gpu(platform, ensure_dataset_volume(platform, row["volume"]), row["run_dir"],
                                 row["data_dir"], "test")

    metrics = study.test_metrics(row["index"], score) if study is not None else score()
    best["test accuracy"] = round(selection_accuracy(metrics), 4)
    best["test official accuracy"] = round(metrics["accuracy"], 4)
