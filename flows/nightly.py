"""``nightly_retrain``: train a challenger on tonight's data; it becomes champion only if it scores better.

The champion is a Prefect variable (``laneflow-champion-<volume>``), visible in the UI. When the data
changed since the champion was crowned, the champion is re-scored on the challenger's test images
first, so both accuracies describe the same images.

With MLflow tracking on (``tasks.tracking``), a promoted challenger's MLflow run also becomes a version of
registered model ``laneflow-<volume>`` carrying the alias ``champion``; the champion record keeps its link.
A registry that fails costs a warning, never the promotion.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.variables import Variable

from flows.params import TrainParams, takes_train_params
from flows.train import train_pipeline
from tasks.champion import champion_record, champion_variable, decide_champion, selection_accuracy
from tasks.pipeline import evaluate
from tasks.platforms import VolumeRef, load_platform
from tasks.tracking import register_champion_in_mlflow


@flow(name="nightly_retrain")
@takes_train_params
def nightly_retrain(params: TrainParams, min_improvement: float = 0.0) -> dict[str, Any]:
    """Retrain, compare with the champion on the same test images, promote the better model.

    Args:
        min_improvement: how much higher the challenger's accuracy must be to become champion
    """
    logger = get_run_logger()
    challenger = train_pipeline(**params.flow_parameters())
    name = champion_variable(params.volume)
    champion = Variable.get(name, default=None)
    if challenger.get("stopped") is not None:  # its training honoured a stop request: there is no model to judge
        reason = (f"challenger {challenger['run']} was stopped at step {challenger['steps']} of "
                  f"{challenger['total_steps']} ({challenger['stopped'].get('reason', 'on request')}): not scored")
        logger.info("champion kept: %s", reason)
        return {"champion": champion["run"] if champion else None, "promoted": False, "reason": reason,
                "challenger": challenger}
    champion_accuracy = None
    if champion:
        champion_accuracy = selection_accuracy(champion["metrics"])
        same_data = champion.get("dataset_version") == challenger["dataset_version"]
        same_split = champion["metrics"].get("split") == challenger["metrics"]["split"]
        if not (same_data and same_split) and champion.get("volume") == challenger["volume"]:
            logger.info("data changed since champion %s was crowned: re-scoring it on dataset %s",
                        champion["run"], challenger["dataset_version"])
            platform = load_platform(params.platform)
            rescored = evaluate(platform, VolumeRef(name=params.volume, location=""), champion["run_dir"],
                                challenger["data_dir"], challenger["metrics"]["split"])
            champion_accuracy = selection_accuracy(rescored)
    decision = decide_champion(champion_accuracy, selection_accuracy(challenger["metrics"]), min_improvement)
    registered = None
    if decision.promote:
        if challenger.get("mlflow"):  # tracked: its MLflow run becomes the registered model's champion too
            registered = register_champion_in_mlflow(challenger["mlflow"], params.volume, challenger["run"])
        Variable.set(name, champion_record(challenger, registered), overwrite=True)
    event = "laneflow.champion.promoted" if decision.promote else "laneflow.champion.kept"
    winner = challenger["run"] if decision.promote else champion["run"]
    emit_event(event, resource={"prefect.resource.id": f"laneflow.champion.{params.volume}",
                                "prefect.resource.name": name},
               related=[{"prefect.resource.id": f"laneflow.run.{challenger['run']}",
                         "prefect.resource.role": "challenger"}],
               payload={"champion": winner, "challenger": challenger["run"], "reason": decision.reason,
                        "champion_accuracy": decision.champion_accuracy,
                        "challenger_accuracy": decision.challenger_accuracy})
    previous = f"{champion['run']} ({decision.champion_accuracy:.4f})" if champion else "none"
    create_markdown_artifact(
        key=f"champion-{params.volume}", description="nightly champion/challenger decision",
        markdown=f"# Champion for volume `{params.volume}`: `{winner}`\n\n"
                 f"| | |\n|---|---|\n| challenger | `{challenger['run']}` ({decision.challenger_accuracy:.4f}) |\n"
                 f"| previous champion | {previous} |\n| decision | {'promoted' if decision.promote else 'kept'}: "
                 f"{decision.reason} |\n| snapshot | `{challenger['snapshot']}` |\n"
                 f"| package | `{(challenger if decision.promote else champion).get('package')}` |\n"
                 + (f"| MLflow | [{registered['model']} version {registered['version']}]({registered['url']}) "
                    f"(alias `{registered['alias']}`) |\n" if registered and registered.get("url") else "") + "\n"
                 "Accuracies are TuSimple accuracy without the benchmark's 200 ms run-time rule, so the decision "
                 "does not depend on how busy the evaluating machine was.\n")
    logger.info("champion %s: %s", "promoted" if decision.promote else "kept", decision.reason)
    return {"champion": winner, "promoted": decision.promote, "reason": decision.reason, "challenger": challenger,
            "mlflow": registered}
