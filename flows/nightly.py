"""``nightly_retrain``: train a challenger on tonight's data; it becomes champion only if it scores better.

The champion is a Prefect variable (``laneflow-champion-<volume>``), visible in the UI. The decision is
made on val: the challenger is scored on its dataset's val split (when the run's own evaluate stage scored
test, which is what the decision record and lineage report), and when the data changed since the
champion was crowned the champion is re-scored on the same val images first, so both accuracies describe
the same images. Test is reported beside it, never decided on.

A challenger that wins on val must also pass the release gates before it is crowned: on the split its run
reported (test, by default), scored beside the champion on the same images, it may fall no more than
``gate_margin`` behind on any CULane scenario's F1 (on the crossroads' false positives per frame), or on
TuSimple's accuracy, FP and FN. The gates only refuse; they never choose. Every gate's figures are a table
artifact (``champion-gates-<volume>``), and a refusal names each gate that failed. The decision, with every
gate's figures, is also written beside the challenger's run (``runs/<run>/champion-decision.json``), where
``laneflow compare`` reads it with the run's other records, MLflow or not.

With MLflow tracking on (``tasks.tracking``), every nightly brings registered model ``laneflow-<volume>``
in line with the champion it leaves, promoted or kept: the champion's MLflow run (logged then if the server
was down when it trained) becomes a version carrying the alias ``champion``, and the champion record keeps
its link. A registry that fails costs a warning, never the promotion; the next nightly tries again.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event
from prefect.variables import Variable

from flows.params import TrainParams, takes_train_params
from flows.train import evaluate_on_a_gpu, train_pipeline
from tasks.champion import (
    DECISION_FILE,
    DECISION_SPLIT,
    Gate,
    champion_record,
    champion_variable,
    decide_champion,
    decision_record,
    gated,
    gates_summary,
    gates_table,
    mlflow_record,
    release_gates,
    score_name,
    selection_accuracy,
    stored_score,
    stored_val_score,
)
from tasks.platforms import Platform, VolumeRef, load_platform
from tasks.registry import record_decision_in_mlflow, sync_champion_in_mlflow


def champion_scored_like(platform: Platform, volume: VolumeRef, champion: dict[str, Any], challenger: dict[str, Any],
                         champion_val: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """The champion's evaluation of the split the challenger's run reported, on the same images — the decision's
    own val score, its recorded one, or re-scored on the challenger's data (same volume) — or None and why."""
    split = challenger["metrics"].get("split", "test")
    recorded = stored_score(champion, split, challenger["dataset_version"])
    if recorded is not None:
        return recorded, ""
    if champion.get("volume") != challenger["volume"]:
        return None, (f"not scored: champion `{champion['run']}` was crowned on volume `{champion.get('volume')}`, "
                      f"so its {split} figures describe other images")
    if split == DECISION_SPLIT and champion_val is not None:
        return champion_val, ""  # scored for the decision, on the challenger's val images
    get_run_logger().info("champion %s has no %s score on dataset %s: re-scoring it for the release gates",
                          champion["run"], split, challenger["dataset_version"])
    return evaluate_on_a_gpu(platform, volume, champion["run_dir"], challenger["data_dir"], split,
                             rescored_dir(challenger, champion)), ""


def record_decision(platform: Platform, volume: VolumeRef, challenger: dict[str, Any], decision: dict[str, Any]
                    ) -> None:
    """The nightly's ``decision`` kept with the challenger: ``champion-decision.json`` in its run folder (what
    ``laneflow compare`` shows) and on its MLflow run when it was tracked. Neither fails the nightly: the
    champion is decided and crowned in Prefect whatever the volume or MLflow say; a write that failed costs a
    warning (compare then shows the run without its decision)."""
    path = f"{challenger['run_dir']}/{DECISION_FILE}"
    try:
        platform.write_text(volume, path, json.dumps(decision, indent=1, sort_keys=True) + "\n")
    except Exception as exc:  # the volume's own failure (a cluster API blip): the decision stands
        get_run_logger().warning("the decision on %s is not in %s (%s: %s): laneflow compare will not show it",
                                 challenger["run"], path, type(exc).__name__, exc)
    record_decision_in_mlflow(challenger.get("mlflow"), decision)


def rescored_dir(challenger: dict[str, Any], champion: dict[str, Any]) -> str:
    """Where the champion's scores on the challenger's images go: the challenger's run folder, beside the decision
    they were made for. The champion's own evaluation files, of its own dataset, stay as they were."""
    return f"{challenger['run_dir']}/champion-{champion['run']}"


@flow(name="nightly_retrain")
@takes_train_params
def nightly_retrain(params: TrainParams, min_improvement: float = 0.0, gate_margin: float = 0.02,
                    cross_fp_margin: float = 0.1) -> dict[str, Any]:
    """Retrain, compare with the champion on the same val images, promote the better model if it passes the gates.

    Args:
        min_improvement: how much higher the challenger's accuracy must be to become champion
        gate_margin: how far the challenger may fall behind the champion on a CULane scenario's F1 or TuSimple's
            accuracy, FP or FN, as a fraction: 0.02 is 2 points, 1 turns these gates off
        cross_fp_margin: how many more false positives than the champion's the challenger may make at CULane's
            crossroads, as a share of the champion's: 0.1 is 10 % more (and one more is always allowed)
    """
    if not 0.0 <= gate_margin <= 1.0:
        raise ValueError(f"gate_margin {gate_margin:g} is not a fraction in [0, 1]: 0.02 lets a challenger fall 2 "
                         "points behind on a scenario, 1 turns the gates off")
    if not cross_fp_margin >= 0.0:
        raise ValueError(f"cross_fp_margin {cross_fp_margin:g} is negative: 0.1 lets a challenger make 10 % more "
                         "false positives at the crossroads than the champion")
    logger = get_run_logger()
    challenger = train_pipeline(**params.flow_parameters())
    name = champion_variable(params.volume)
    champion = Variable.get(name, default=None)
    platform = load_platform(params.platform)
    volume = VolumeRef(name=params.volume, location="")
    if challenger.get("stopped") is not None:  # its training honoured a stop request: there is no model to judge
        reason = (f"challenger {challenger['run']} was stopped at step {challenger['steps']} of "
                  f"{challenger['total_steps']} ({challenger['stopped'].get('reason', 'on request')}): not scored")
        logger.info("champion kept: %s", reason)
        record_decision(platform, volume, challenger, {
            "promoted": False, "reason": reason, "champion": champion["run"] if champion else None,
            "challenger": challenger["run"], "gates_summary": "not scored: the challenger was stopped", "gates": [],
            "stopped": True})
        return {"champion": champion["run"] if champion else None, "promoted": False, "reason": reason,
                "challenger": challenger, "gates": []}
    challenger["val_metrics"] = (challenger["metrics"] if challenger["metrics"].get("split") == DECISION_SPLIT else
                                 evaluate_on_a_gpu(platform, volume, challenger["run_dir"], challenger["data_dir"],
                                                   DECISION_SPLIT))
    champion_accuracy, champion_val = None, None
    if champion:
        champion_val = stored_val_score(champion, challenger["dataset_version"])
        if champion_val is None and champion.get("volume") == challenger["volume"]:
            logger.info("champion %s has no val score on dataset %s: re-scoring it on the challenger's val images",
                        champion["run"], challenger["dataset_version"])
            champion_val = evaluate_on_a_gpu(platform, volume, champion["run_dir"], challenger["data_dir"],
                                             DECISION_SPLIT, rescored_dir(challenger, champion))
        if champion_val is None:  # crowned on another volume: its own val score is the best there is
            champion_val = champion.get("val_metrics") or champion["metrics"]
        champion_accuracy = selection_accuracy(champion_val)
    decision = decide_champion(champion_accuracy, selection_accuracy(challenger["val_metrics"]), min_improvement,
                               score_name(challenger["val_metrics"]))
    gates: list[Gate] = []
    gate_split = challenger["metrics"].get("split", "test")
    no_gates = ("not scored: the challenger did not win on val (the gates only refuse)" if champion else
                "not scored: no champion yet")
    if decision.promote and champion:  # the gates only refuse: scored when the challenger would win on val
        champion_figures, no_gates = champion_scored_like(platform, volume, champion, challenger, champion_val)
        if champion_figures is None:
            logger.warning("no release gates: %s", no_gates)
        else:
            gates = release_gates(champion_figures, challenger["metrics"], gate_margin, cross_fp_margin)
            decision = gated(decision, gates)
            no_gates = "" if gates else f"not scored: the {gate_split} figures have no gate to compare"
    crowned = (champion_record(challenger, mlflow_record(challenger.get("mlflow"), None)) if decision.promote
               else champion)
    # MLflow's @champion follows laneflow's champion, kept or promoted: a registry that was down at a
    # promotion is corrected here the next night it answers.
    synced = sync_champion_in_mlflow(platform, volume, crowned)
    if synced is not None and synced != crowned.get("mlflow"):
        crowned = {**crowned, "mlflow": synced}
    if decision.promote or crowned is not champion:
        Variable.set(name, crowned, overwrite=True)
    registered = synced if synced and synced.get("version") else None
    failed = [gate.name for gate in gates if not gate.passed]
    event = "laneflow.champion.promoted" if decision.promote else "laneflow.champion.kept"
    winner = challenger["run"] if decision.promote else champion["run"]
    emit_event(event, resource={"prefect.resource.id": f"laneflow.champion.{params.volume}",
                                "prefect.resource.name": name},
               related=[{"prefect.resource.id": f"laneflow.run.{challenger['run']}",
                         "prefect.resource.role": "challenger"}],
               payload={"champion": winner, "challenger": challenger["run"], "reason": decision.reason,
                        "champion_accuracy": decision.champion_accuracy,
                        "challenger_accuracy": decision.challenger_accuracy,
                        "failed_gates": failed})
    if gates:
        create_table_artifact(key=f"champion-gates-{params.volume}", table=gates_table(gates),
                              description=f"release gates on {gate_split}: challenger {challenger['run']} against "
                                          f"champion {champion['run']}, margin {gate_margin:g}")
    summary = gates_summary(gates, gate_split, gate_margin, no_gates)
    record_decision(platform, volume, challenger, decision_record(
        decision, champion["run"] if champion else None, challenger["run"], score_name(challenger["val_metrics"]),
        gate_split, gate_margin, cross_fp_margin, gates, summary))
    gates_row = summary + (f" — table `champion-gates-{params.volume}`" if gates else "")
    culane = challenger["metrics"].get("metric") == "culane"
    scores = ("Scores are CULane's F1 at IoU 0.5 (the official metric). " if culane else
              "Accuracies are TuSimple accuracy without the benchmark's 200 ms run-time rule, so the decision "
              "does not depend on how busy the evaluating machine was. ")
    previous = f"`{champion['run']}` (val {decision.champion_accuracy:.4f})" if champion else "none"
    create_markdown_artifact(
        key=f"champion-{params.volume}", description="nightly champion/challenger decision",
        markdown=f"# Champion for volume `{params.volume}`: `{winner}`\n\n"
                 f"| | |\n|---|---|\n| challenger | `{challenger['run']}` (val {decision.challenger_accuracy:.4f}) |\n"
                 f"| previous champion | {previous} |\n"
                 f"| challenger on {challenger['metrics'].get('split', 'test')} (reported, not decided on) | "
                 f"{selection_accuracy(challenger['metrics']):.4f} |\n"
                 f"| decision | {'promoted' if decision.promote else 'kept'}: "
                 f"{decision.reason} |\n| release gates | {gates_row} |\n"
                 f"| snapshot | `{challenger['snapshot']}` |\n"
                 f"| package | `{(challenger if decision.promote else champion).get('package')}` |\n"
                 + (f"| MLflow | [{registered['model']} version {registered['version']}]({registered['model_url']}) "
                    f"(alias `{registered['alias']}`) |\n" if registered and registered.get("model_url") else "") + "\n"
                 + scores + "The decision is on val, both models scored on the challenger's val images; test is "
                 "reported, never decided on, and its release gates can only refuse.\n")
    logger.info("champion %s: %s", "promoted" if decision.promote else "kept", decision.reason)
    return {"champion": winner, "promoted": decision.promote, "reason": decision.reason, "challenger": challenger,
            "gates": gates_table(gates), "mlflow": registered}
