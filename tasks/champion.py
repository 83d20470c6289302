"""Champion/challenger: a nightly model replaces the champion only when it scores better (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    champion_accuracy: float | None
    challenger_accuracy: float


def champion_variable(volume: str) -> str:
    """The Prefect variable holding a volume's champion record."""
    return f"laneflow-champion-{volume}"


#: The split champions are decided on; the evaluate stage's own split (``eval_split``) is reported.
DECISION_SPLIT = "val"


def stored_val_score(champion: dict[str, Any], dataset_version: str) -> dict[str, Any] | None:
    """The champion's recorded val evaluation when it describes the challenger's val images (same dataset
    version), else None: the caller re-scores it. Records from before val was recorded have none."""
    val = champion.get("val_metrics")
    if not val or val.get("split", DECISION_SPLIT) != DECISION_SPLIT:
        return None
    return val if champion.get("dataset_version") == dataset_version else None


def selection_accuracy(metrics: dict[str, Any]) -> float:
    """The accuracy models are compared by: the TuSimple score without the 200 ms run-time rule.

    The official rule scores an image that took over 200 ms as a complete miss; that measures the
    machine as much as the model (a busy CPU pushes every image over it), so champions and
    leaderboards never use it. Records from before this score existed fall back to ``accuracy``.
    """
    return float(metrics.get("untimed_accuracy", metrics["accuracy"]))


def decide_champion(champion_accuracy: float | None, challenger_accuracy: float,
                    min_improvement: float = 0.0) -> Decision:
    """Promote when there is no champion yet, or the challenger beats it by more than ``min_improvement``.

    Both accuracies must come from the same val images (the caller re-scores the champion on the
    challenger's dataset when the data changed), or the comparison means nothing. Val, never test: a
    nightly that crowned on test every night would fit the test split by selection, the adaptive reuse
    sweeps avoid by ranking on val and scoring only their winner on test.
    """
    if champion_accuracy is None:
        return Decision(True, "no champion yet", None, challenger_accuracy)
    margin = challenger_accuracy - champion_accuracy
    if margin > min_improvement:
        return Decision(True, f"accuracy improved by {margin:+.4f} (needed > {min_improvement:+.4f})",
                        champion_accuracy, challenger_accuracy)
    return Decision(False, f"accuracy changed by {margin:+.4f}; needed > {min_improvement:+.4f}: champion kept",
                    champion_accuracy, challenger_accuracy)


def champion_record(result: dict[str, Any], mlflow: dict[str, Any] | None = None) -> dict[str, Any]:
    """What is remembered about a champion: enough to find, re-score and restore it, and where MLflow has it
    (``mlflow``: its run and registered version, ``mlflow_record``), None when untracked."""
    record = {key: result.get(key) for key in ("run", "flow_run_id", "volume", "snapshot", "dataset_version",
                                               "metrics", "val_metrics", "data_dir", "run_dir", "package",
                                               "platform")}
    record["mlflow"] = mlflow
    return record


def mlflow_record(tracked: dict[str, Any] | None, registered: dict[str, Any] | None) -> dict[str, Any] | None:
    """The champion record's ``mlflow``: the tracked run (``tasks.tracking``'s run record) and the registered
    version (None while the registry has not taken it: the next nightly retries)."""
    if not tracked:
        return None
    return {"tracking_uri": tracked.get("tracking_uri"), "run_id": tracked.get("run_id"),
            "run_url": tracked.get("url", tracked.get("run_url")), "model_uri": tracked.get("model_uri"),
            **{key: (registered or {}).get(key) for key in ("model", "version", "alias")},
            "model_url": (registered or {}).get("url")}
