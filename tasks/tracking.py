"""MLflow tracking, optional: each finished training run becomes one MLflow run (a nightly champion becomes a
registered model version with the alias ``champion``, and the decision goes on the challenger's run, in
``tasks.registry``, which uses this module's client and settings).

The setting is a tracking URI: ``$LANEFLOW_MLFLOW_TRACKING_URI``, else the Prefect variable
``laneflow-mlflow-tracking-uri`` (so a UI user can turn it on), else tracking is off: nothing is logged
and mlflow is never imported, so laneflow works without the ``mlflow`` extra. An empty environment value
turns tracking off even where the variable is set (one worker opting out).

What a run logs, in experiment ``laneflow-<volume>`` under the laneflow run name (``train-...``):

- parameters: the lineage's ``parameters`` flattened (``source_artifacts.0.url``, ...), and what the
  trainer resolved them to (``numerics.precision``, ``numerics.memory_format``, ``numerics.compile``,
  ``numerics.numerics_reason``: ``precision: auto`` on this machine);
- step metrics from the run's ``metrics.jsonl``, at their step, under TensorBoard's names
  (``train/loss``, ``train/lr``, ``train/images_per_second``, ``train/input_stall``, ``val/accuracy``,
  ``val/untimed_accuracy``, ``val/fp``, ``val/fn``);
- the evaluation as ``<split>/accuracy`` etc. at the run's last step, and ``training/duration_s``;
- ``lineage.json`` and the model package under ``package/``, uploaded from where the volume is (a process
  on this machine; on a cluster a Job on the claim, in the training image, so the tracking server must be
  reachable from pods): a registered version ``runs:/<id>/package`` is the loadable package;
- tags ``laneflow.run``, ``laneflow.volume``, ``laneflow.dataset_version``, ``prefect.flow_run_id``, ... and
  the lineage markdown as the run's description.

Tracking never fails or slows a pipeline: the client talks to the server with short timeouts and few
retries, and any error ends the run's tracking with one warning (the URI, the error, "training is
unaffected"). Only ``mlflow.tracking.MlflowClient`` is used, one per call, never MLflow's fluent API
and its process-global active run, so concurrent sweep trials cannot log into each other's runs.

Pure helpers (names, flattening, metric extraction, URLs) first; the edge that talks to MLflow after.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.lineage import render_lineage_markdown
from tasks.report import step_series

TRACKING_URI_ENV = "LANEFLOW_MLFLOW_TRACKING_URI"
TRACKING_URI_VARIABLE = "laneflow-mlflow-tracking-uri"
INSTALL_HINT = "pip install 'laneflow[mlflow]'"
CHAMPION_ALIAS = "champion"
#: Where in an MLflow run the model package folder and the lineage record go.
PACKAGE_ARTIFACT = "package"
LINEAGE_ARTIFACT = "lineage.json"

#: MLflow's HTTP defaults (7 retries with exponential backoff, 120 s per request) make a server that is down
#: cost minutes per request. MLflow reads these at every request and has no per-client setting, so they
#: are set for the process, only where the operator has not set them, and only once tracking is on.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
    # The run's link goes to the Prefect log instead (MLflow would print it to stdout, fetching the run again).
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}

#: MLflow metric -> field of a ``step`` event (TensorBoard tags, training.tensorboard_log.TRAIN_SCALARS, + the stall).
STEP_METRICS = {"train/loss": "loss", "train/lr": "lr", "train/images_per_second": "img_per_s",
                "train/input_stall": "input_stall"}
#: ``val/`` + suffix -> field of a ``val`` event (training.tensorboard_log.SCORE_SCALARS).
SCORE_METRICS = {"accuracy": "accuracy", "untimed_accuracy": "untimed_accuracy", "fp": "fp", "fn": "fn"}
#: The evaluate stage's numbers logged as ``<split>/<name>``.
EVALUATION_METRICS = ("accuracy", "untimed_accuracy", "fp", "fn", "untimed_fp", "untimed_fn", "images",
                      "over_time_limit")

#: MLflow's limits (mlflow.utils.validation): longer keys are refused, longer values truncated with a warning.
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :/]")


# --- pure helpers --------------------------------------------------------------------------------------

def experiment_name(volume: str) -> str:
    """The MLflow experiment of a volume's runs (one per volume, like the champion)."""
    return f"laneflow-{volume}"


def registered_model_name(volume: str) -> str:
    """The registered model whose ``champion`` alias is the volume's champion."""
    return f"laneflow-{volume}"


def mlflow_run_name(lineage: Mapping[str, Any]) -> str:
    """An MLflow run is named like the laneflow run (``train-...``): the name on the volume and in Prefect."""
    return str(lineage["run"])


def _key(name: str) -> str:
    return _KEY_UNSAFE.sub("_", name)[:MAX_KEY_LENGTH]


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:MAX_PARAM_VALUE_LENGTH]


def flatten_params(parameters: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """MLflow parameters (flat strings) from a nested record: dict keys joined with ``.``, lists of dicts
    indexed (``source_artifacts.0.url``), everything else as text (JSON for non-strings: ``true``, ``null``,
    ``[1, 2]``) so a parameter reads the same as in the lineage."""
    flat: dict[str, str] = {}
    for key, value in parameters.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, f"{name}."))
        elif isinstance(value, list | tuple) and value and all(isinstance(item, Mapping) for item in value):
            for index, item in enumerate(value):
                flat.update(flatten_params(item, f"{name}.{index}."))
        else:
            flat[_key(name)] = _param_value(value)
    return flat


def run_params(lineage: Mapping[str, Any]) -> dict[str, str]:
    """The MLflow parameters of a run: what it was asked (``parameters``), the numerics it resolved them to, and
    the model it trained — its name and every one of its settings (``model.name``, ``model.settings.<name>``),
    as the trainer built them from the preset and the run's ``model_settings``, so runs of different models
    or settings compare in MLflow's table."""
    training = lineage.get("training") or {}
    numerics, model = training.get("numerics") or {}, training.get("model") or {}
    return {**flatten_params(lineage.get("parameters") or {}),
            **flatten_params({"numerics": numerics} if numerics else {}),
            **flatten_params({"model": {"name": model.get("name"), "settings": model.get("settings") or {}}}
                             if model.get("name") else {})}


def dataset_of(lineage: Mapping[str, Any]) -> str | None:
    """Which dataset the run trained on (``tusimple`` or ``culane``): the lineage's own word, else — a record from
    before it kept one — the evaluation's metric, chosen from the prepared dataset's manifest; None unscored."""
    if lineage.get("dataset"):
        return str(lineage["dataset"])
    metric = (lineage.get("metrics") or {}).get("metric")
    if not lineage.get("metrics"):
        return None
    return "culane" if metric == "culane" else "tusimple"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def step_metrics(events: Iterable[Mapping[str, Any]]) -> list[tuple[str, float, int]]:
    """``(metric, value, step)`` of a run's ``metrics.jsonl`` events: train metrics of each ``step`` event and
    val scores of each ``val`` event. A resumed run logged some steps twice; the last one counts."""
    events = list(events)
    points = [(metric, number, int(event["step"])) for event in step_series(events)
              for metric, field in STEP_METRICS.items() if (number := _number(event.get(field))) is not None]
    val: dict[int, Mapping[str, Any]] = {int(e["step"]): e for e in events if e.get("event") == "val" and "step" in e}
    points += [(f"val/{suffix}", number, step) for step in sorted(val) for suffix, field in SCORE_METRICS.items()
               if (number := _number(val[step].get(field))) is not None]
    return points


def evaluation_metrics(evaluation: Mapping[str, Any], step: int) -> list[tuple[str, float, int]]:
    """The evaluate stage's scores as ``<split>/<name>`` at the run's last step (as TensorBoard plots them); on
    CULane also each scenario's F1 (``<split>/<scenario>/f1``; the crossroads' ``fp``, as they have no lanes)."""
    split = evaluation.get("split", "eval")
    scenarios = [(f"{split}/{name}/{key}", number, step)
                 for name, figures in (evaluation.get("scenarios") or {}).items()
                 for key in (("fp",) if name == "cross" else ("f1",))
                 if (number := _number(figures.get(key))) is not None]
    return [(f"{split}/{name}", number, step) for name in EVALUATION_METRICS
            if (number := _number(evaluation.get(name))) is not None] + scenarios


def training_metrics(training: Mapping[str, Any]) -> list[tuple[str, float, int]]:
    """How long training took and where it resumed, at its last step."""
    step = int(training.get("steps") or 0)
    return [(f"training/{name}", number, step) for name in ("duration_s", "resumed_from")
            if (number := _number(training.get(name))) is not None]


def run_tags(lineage: Mapping[str, Any], prefect_ui_url: str | None = None) -> dict[str, str]:
    """What finds an MLflow run from laneflow and Prefect (and back): the run, volume, dataset and its version, code,
    the flow run; the lineage markdown as the run's description (``mlflow.note.content``)."""
    flow_run_id = lineage.get("flow_run_id")
    tags = {
        "laneflow.run": lineage.get("run"),
        "laneflow.volume": lineage.get("volume"),
        "laneflow.platform": lineage.get("platform"),
        "laneflow.dataset": dataset_of(lineage),
        "laneflow.dataset_version": lineage.get("dataset_version"),
        "laneflow.code_version": lineage.get("code_version"),
        "laneflow.snapshot": lineage.get("snapshot"),
        "laneflow.package": f"{lineage['package']} on volume {lineage.get('volume')}" if lineage.get("package")
        else None,
        "prefect.flow_run_id": flow_run_id,
        "prefect.flow_run_name": lineage.get("flow_run_name"),
        "prefect.flow_run_url": f"{prefect_ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"
        if prefect_ui_url and flow_run_id else None,
        "mlflow.note.content": render_lineage_markdown(dict(lineage)),
    }
    return {key: str(value)[:MAX_TAG_VALUE_LENGTH] for key, value in tags.items() if value is not None}


def _ui_base(tracking_uri: str) -> str | None:
    """The MLflow UI behind a tracking URI: only an HTTP(S) server has one."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else None


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI page of a run (None for a tracking URI with no UI: a file or database store)."""
    base = _ui_base(tracking_uri)
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}" if base else None


def model_version_url(tracking_uri: str, name: str, version: str) -> str | None:
    """The MLflow UI page of a registered model version."""
    base = _ui_base(tracking_uri)
    return f"{base}/#/models/{name}/versions/{version}" if base else None


def short_error(exc: BaseException, limit: int = 600) -> str:
    """An error for a one-line warning: its type and message, flattened and cut."""
    text = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


# --- the edge: settings, the client, MLflow calls ------------------------------------------------------

def tracking_uri() -> str | None:
    """The tracking URI setting (see the module docstring), None when tracking is off."""
    if TRACKING_URI_ENV in os.environ:
        return os.environ[TRACKING_URI_ENV].strip() or None
    from prefect.variables import Variable

    value = Variable.get(TRACKING_URI_VARIABLE, default=None)
    return (value.strip() or None) if isinstance(value, str) else None


def load_client(uri: str, logger: Any) -> Any | None:
    """An ``MlflowClient`` for ``uri`` (tracking and registry), with short HTTP timeouts; None, after one
    warning that names the install command, when mlflow is not installed."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        logger.warning("MLflow tracking is set to %s but mlflow is not installed (%s): nothing is logged there; "
                       "training is unaffected. Install the client with: %s", uri, exc, INSTALL_HINT)
        return None
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def tracking_client(logger: Any, if_unread: str, if_off: str) -> tuple[str, Any] | None:
    """(tracking URI, client) when tracking is on; None when it is off (``if_off`` logged), its setting
    cannot be read (a warning, with ``if_unread``) or mlflow is not installed (``load_client``'s warning)."""
    try:
        uri = tracking_uri()
    except Exception as exc:
        logger.warning("could not read the MLflow setting (Prefect variable %s: %s): %s", TRACKING_URI_VARIABLE,
                       short_error(exc), if_unread)
        return None
    if uri is None:
        logger.info("MLflow tracking off (%s)", if_off)
        return None
    client = load_client(uri, logger)
    return None if client is None else (uri, client)


def is_error(exc: BaseException, error_code: str) -> bool:
    return getattr(exc, "error_code", None) == error_code


def ensure_experiment(client: Any, name: str, volume: str) -> str:
    """The id of experiment ``name``: created when missing (concurrent trials may race to it), restored
    when someone deleted it (a deleted experiment takes no runs and keeps its name)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, tags={"laneflow.volume": volume})
        except Exception as exc:
            if not is_error(exc, "RESOURCE_ALREADY_EXISTS"):
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage == "deleted":
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def tracked_record(uri: str, experiment_id: str, run_id: str, has_package: bool) -> dict[str, Any]:
    """What the pipeline returns about its MLflow run (and nightly registers from)."""
    return {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run_id,
            "url": run_url(uri, experiment_id, run_id),
            "model_uri": f"runs:/{run_id}/{PACKAGE_ARTIFACT}" if has_package else None}


def _metric_entities(points: Iterable[tuple[str, float, int]]) -> list[Any]:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(_key(name), value, now, step) for name, value, step in points]


def log_training_run(client: Any, uri: str, lineage: Mapping[str, Any], events: list[dict[str, Any]],
                     publish: Callable[[str], None] | None, prefect_ui_url: str | None = None,
                     warn: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """One finished MLflow run for a laneflow run (see the module docstring for what it holds); ``publish``
    puts the run's package under the run's ``package`` artifacts (given the MLflow run id), None: it has none.

    A package that cannot be published costs a warning, not the run: it is tracked without it (and a version
    registered from it points at its lineage). A retried flow run finds the run its first try finished (same
    laneflow run, same flow run id) and logs nothing twice; one its first try left unfinished is deleted and
    logged again.
    """
    from mlflow.entities import Param

    run = mlflow_run_name(lineage)
    experiment_id = ensure_experiment(client, experiment_name(lineage["volume"]), lineage["volume"])
    earlier = client.search_runs([experiment_id], filter_string=(
        f"tags.`laneflow.run` = '{run}' and tags.`prefect.flow_run_id` = '{lineage.get('flow_run_id')}'"))
    for found in earlier:
        if found.info.status == "FINISHED":
            has_package = any(item.path == PACKAGE_ARTIFACT for item in client.list_artifacts(found.info.run_id))
            return tracked_record(uri, experiment_id, found.info.run_id, has_package)
        client.delete_run(found.info.run_id)
    step = int((lineage.get("training") or {}).get("steps") or 0)
    points = [*step_metrics(events), *evaluation_metrics(lineage.get("metrics") or {}, step),
              *training_metrics(lineage.get("training") or {})]
    run_id = client.create_run(experiment_id, run_name=run, tags=run_tags(lineage, prefect_ui_url)).info.run_id
    try:
        client.log_batch(run_id, metrics=_metric_entities(points),
                         params=[Param(key, value) for key, value in run_params(lineage).items()])
        client.log_dict(run_id, dict(lineage), LINEAGE_ARTIFACT)
    except BaseException:
        with contextlib.suppress(Exception):  # shown failed, not running forever; the first error is reported
            client.set_terminated(run_id, "FAILED")
        raise
    published = False
    if publish is not None:
        try:
            publish(run_id)
            published = True
        except Exception as exc:
            warn(f"the model package of {run} could not be put into MLflow run {run_id} ({short_error(exc)}): the "
                 "run is tracked without it")
    client.set_terminated(run_id, "FINISHED")
    return tracked_record(uri, experiment_id, run_id, published)


def package_publisher(platform: Any, volume: Any, lineage: Mapping[str, Any], uri: str, logger: Any
                      ) -> Callable[[str], None] | None:
    """How the run's package gets into its MLflow run: uploaded from where the volume is (a process on this
    machine, a Job on a cluster's claim: ``Platform.publish_package``); None when the run has no package."""
    package = lineage.get("package")
    if not package:
        return None
    settings = {name: os.environ[name] for name in HTTP_DEFAULTS if name in os.environ}

    def publish(run_id: str) -> None:
        summary = platform.publish_package(volume, str(package), uri, run_id, PACKAGE_ARTIFACT, settings,
                                           logger.debug)
        logger.info("package %s is in MLflow run %s (%s)", package, run_id, ", ".join(summary.get("files", [])))

    return publish


def run_events(platform: Any, volume: Any, run_dir: str, run: str, logger: Any) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` events for MLflow; none (one warning) when it cannot be read: the run is
    still worth tracking with its parameters, evaluation and lineage."""
    try:
        return [json.loads(line) for line in
                platform.read_file(volume, f"{run_dir}/metrics.jsonl").decode().splitlines() if line.strip()]
    except Exception as exc:
        logger.warning("could not read %s/metrics.jsonl for MLflow (%s): run %s is tracked without step metrics",
                       run_dir, short_error(exc), run)
        return []


def prefect_ui_url_setting() -> str | None:
    try:
        from prefect.settings import get_current_settings

        return get_current_settings().ui_url
    except Exception:  # a link back to Prefect is a convenience
        return None


@task(name="track_in_mlflow", task_run_name="mlflow-{lineage[run]}", retries=0, cache_policy=NO_CACHE)
def track_in_mlflow(platform: Any, volume: Any, run_dir: str, lineage: dict[str, Any]) -> dict[str, Any] | None:
    """Log a finished training run to MLflow when tracking is on; what the pipeline returns as ``mlflow``
    (run id, UI link, the package's model URI), or None when off or when it failed.

    Never raises and is never retried: a tracking server that is down or errors costs one warning and a
    few seconds. Step metrics come from the run's ``metrics.jsonl`` read through the platform (local or
    cluster); the package is uploaded from where the volume is (``package_publisher``), and the run's
    ``laneflow.package`` tag also says where it is on the volume.
    """
    logger = get_run_logger()
    run = lineage["run"]
    connected = tracking_client(logger, f"run {run} is not tracked; training is unaffected",
                                f"set {TRACKING_URI_ENV} or the Prefect variable {TRACKING_URI_VARIABLE} to a "
                                "tracking URI to turn it on")
    if connected is None:
        return None
    uri, client = connected
    events = run_events(platform, volume, run_dir, run, logger)
    try:
        tracked = log_training_run(client, uri, lineage, events, package_publisher(platform, volume, lineage, uri,
                                                                                   logger),
                                   prefect_ui_url_setting(), logger.warning)
    except Exception as exc:
        logger.warning("MLflow tracking server %s failed (%s): run %s is not tracked there; training is unaffected",
                       uri, short_error(exc), run)
        return None
    logger.info("MLflow run %s of %s%s", tracked["run_id"], run, f": {tracked['url']}" if tracked["url"] else "")
    return tracked
