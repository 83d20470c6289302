"""MLflow's side of the nightly's champion: the registered model ``laneflow-<volume>`` whose alias
``champion`` follows laneflow's champion, and the decision (promoted or kept, why, every release gate's
figures) recorded on the challenger's run, so a team that lives in MLflow sees what the Prefect UI shows.

Like tracking (``tasks.tracking``), none of it ever fails a nightly: an MLflow error costs one warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.tracking import (
    CHAMPION_ALIAS,
    LINEAGE_ARTIFACT,
    MAX_TAG_VALUE_LENGTH,
    PACKAGE_ARTIFACT,
    is_error,
    log_training_run,
    model_version_url,
    package_publisher,
    prefect_ui_url_setting,
    registered_model_name,
    run_events,
    short_error,
    tracked_record,
    tracking_client,
)

#: The challenger run's artifact with the nightly's decision and every gate's figures.
DECISION_ARTIFACT = "champion-decision.json"
#: Tags on the challenger's run: searchable in MLflow (``tags."laneflow.champion.decision" = 'kept'``).
DECISION_TAGS = ("laneflow.champion.decision", "laneflow.champion.reason", "laneflow.champion.against",
                 "laneflow.release_gates")


def decision_tags(decision: Mapping[str, Any]) -> dict[str, str]:
    """The tags of a decision record (``flows.nightly``'s): promoted or kept, why, against which champion, and
    the gates in one line."""
    values = ("promoted" if decision["promoted"] else "kept", decision["reason"],
              decision.get("champion") or "none (first champion)", decision["gates_summary"])
    return {tag: str(value)[:MAX_TAG_VALUE_LENGTH] for tag, value in zip(DECISION_TAGS, values, strict=True)}


def register_model_version(client: Any, tracked: Mapping[str, Any], name: str, run: str) -> dict[str, Any]:
    """Registered model ``name`` (created when missing), a version of it from the tracked run (reused when
    that run already has one), and the ``champion`` alias moved to it."""
    try:
        client.create_registered_model(name, description="laneflow champions: the `champion` alias is the "
                                                         "model nightly_retrain promoted last")
    except Exception as exc:
        if not is_error(exc, "RESOURCE_ALREADY_EXISTS"):
            raise
    run_id = tracked["run_id"]
    existing = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if existing:
        version = existing[0]
    else:
        version = client.create_model_version(
            name, source=tracked.get("model_uri") or f"runs:/{run_id}/{LINEAGE_ARTIFACT}", run_id=run_id,
            run_link=tracked.get("url"), tags={"laneflow.run": run}, await_creation_for=0,
            description=f"laneflow run {run}" + ("" if tracked.get("model_uri") else
                                                 " (its package is on the volume, not in MLflow)"))
    client.set_registered_model_alias(name, CHAMPION_ALIAS, str(version.version))
    return {"model": name, "version": str(version.version), "alias": CHAMPION_ALIAS,
            "url": model_version_url(tracked["tracking_uri"], name, str(version.version))}


def champion_run(client: Any, uri: str, platform: Any, volume: Any, record: Mapping[str, Any], logger: Any
                 ) -> dict[str, Any]:
    """The champion's MLflow run on ``uri``: the one its record names when that server has it finished, else
    logged now from the run's own files (the server was down, or another one, when it trained)."""
    known = record.get("mlflow") or {}
    if known.get("run_id") and known.get("tracking_uri") == uri:
        try:
            found = client.get_run(known["run_id"])
        except Exception as exc:
            if not is_error(exc, "RESOURCE_DOES_NOT_EXIST"):
                raise
        else:
            if found.info.status == "FINISHED" and found.info.lifecycle_stage == "active":
                has_package = any(item.path == PACKAGE_ARTIFACT for item in client.list_artifacts(found.info.run_id))
                return tracked_record(uri, found.info.experiment_id, found.info.run_id, has_package)
    run_dir = str(record["run_dir"])
    logger.info("champion %s has no MLflow run on %s: logging it now from %s", record["run"], uri, run_dir)
    lineage = json.loads(platform.read_file(volume, f"{run_dir}/lineage.json"))
    events = run_events(platform, volume, run_dir, str(record["run"]), logger)
    return log_training_run(client, uri, lineage, events, package_publisher(platform, volume, lineage, uri, logger),
                            prefect_ui_url_setting(), logger.warning)


@task(name="sync_champion_in_mlflow", task_run_name="mlflow-champion-{record[run]}", retries=0,
      cache_policy=NO_CACHE)
def sync_champion_in_mlflow(platform: Any, volume: Any, record: dict[str, Any]) -> dict[str, Any] | None:
    """Bring MLflow's registry in line with laneflow's champion ``record``: its run (logged now when it was
    not), a version of registered model ``laneflow-<volume>`` from it, the alias ``champion`` on that version.

    Every nightly calls it for whichever model is champion after its decision, kept or promoted, so a
    registry that was down when a champion was crowned is corrected the next time it answers, and
    ``@champion`` never stays on a dethroned model. Returns the record's new ``mlflow``
    (``tasks.champion.mlflow_record``); None when tracking is off or the server failed before it had the
    run (one warning: the champion is crowned in Prefect all the same, and the next nightly tries again).
    """
    from tasks.champion import mlflow_record

    logger = get_run_logger()
    run = record["run"]
    connected = tracking_client(logger, f"the registry is not brought in line with champion {run}",
                                f"no registry to bring in line with champion {run}")
    if connected is None:
        return None
    uri, client = connected
    name, tracked = registered_model_name(record["volume"]), None
    try:
        tracked = champion_run(client, uri, platform, volume, record, logger)
        registered = register_model_version(client, tracked, name, run)
    except Exception as exc:
        logger.warning("MLflow %s failed (%s): %s@%s is not on champion %s yet; the next nightly tries again, and "
                       "%s is champion in Prefect all the same", uri, short_error(exc), name, CHAMPION_ALIAS, run, run)
        return mlflow_record(tracked, None)
    logger.info("MLflow: %s version %s is %s@%s%s", run, registered["version"], name, CHAMPION_ALIAS,
                f" ({registered['url']})" if registered["url"] else "")
    return mlflow_record(tracked, registered)


@task(name="record_decision_in_mlflow", task_run_name="mlflow-decision-{decision[challenger]}", retries=0,
      cache_policy=NO_CACHE)
def record_decision_in_mlflow(tracked: dict[str, Any] | None, decision: dict[str, Any]) -> bool:
    """Put the nightly's ``decision`` on the challenger's MLflow run ``tracked`` (``tasks.tracking``'s run
    record): the ``decision_tags`` and ``champion-decision.json``, which holds every release gate's figures.
    False, after one line in the log, when the challenger was not tracked or MLflow failed; never raises."""
    logger = get_run_logger()
    challenger = decision["challenger"]
    if not tracked:
        logger.info("the decision on %s is not in MLflow: its run was not tracked there", challenger)
        return False
    connected = tracking_client(logger, f"the decision on {challenger} is not put on its MLflow run",
                                f"the decision on {challenger} is not put on its MLflow run")
    if connected is None:
        return False
    uri, client = connected
    if uri != tracked.get("tracking_uri"):
        logger.warning("challenger %s was tracked on %s, the setting is now %s: its decision is not put there",
                       challenger, tracked.get("tracking_uri"), uri)
        return False
    try:
        for key, value in decision_tags(decision).items():
            client.set_tag(tracked["run_id"], key, value)
        client.log_dict(tracked["run_id"], decision, DECISION_ARTIFACT)
    except Exception as exc:
        logger.warning("MLflow %s failed (%s): the decision on %s is not on its run %s", uri, short_error(exc),
                       challenger, tracked["run_id"])
        return False
    logger.info("MLflow run %s of %s has the decision: %s", tracked["run_id"], challenger,
                "promoted" if decision["promoted"] else "kept")
    return True
