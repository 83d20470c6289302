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

    Both accuracies must come from the same test images (the caller re-scores the champion on the
    challenger's dataset when the data changed), or the comparison means nothing.
    """
    if champion_accuracy is None:
        return Decision(True, "no champion yet", None, challenger_accuracy)
    margin = challenger_accuracy - champion_accuracy
    if margin > min_improvement:
        return Decision(True, f"accuracy improved by {margin:+.4f} (needed > {min_improvement:+.4f})",
                        champion_accuracy, challenger_accuracy)
    return Decision(False, f"accuracy changed by {margin:+.4f}; needed > {min_improvement:+.4f}: champion kept",
                    champion_accuracy, challenger_accuracy)


def champion_record(result: dict[str, Any], registered: dict[str, Any] | None = None) -> dict[str, Any]:
    """What is remembered about a champion: enough to find, re-score and restore it, and where MLflow has it
    (its run, and the registered model version ``registered`` when the registry took it), None when untracked."""
    record = {key: result.get(key) for key in ("run", "flow_run_id", "volume", "snapshot", "dataset_version",
                                               "metrics", "data_dir", "run_dir", "package", "platform")}
    tracked = result.get("mlflow")
    record["mlflow"] = None if not tracked else {
        "tracking_uri": tracked.get("tracking_uri"), "run_id": tracked.get("run_id"), "run_url": tracked.get("url"),
        **{key: (registered or {}).get(key) for key in ("model", "version", "alias")},
        "model_url": (registered or {}).get("url")}
    return record
