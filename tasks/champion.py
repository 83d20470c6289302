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


#: The nightly's decision on a challenger, in its run folder (``runs/<run>/champion-decision.json``) and as the
#: artifact of its MLflow run: promoted or kept, why, against which champion, and every release gate's figures.
DECISION_FILE = "champion-decision.json"

#: The split champions are decided on; the evaluate stage's own split (``eval_split``) is reported.
DECISION_SPLIT = "val"


def stored_val_score(champion: dict[str, Any], dataset_version: str) -> dict[str, Any] | None:
    """The champion's recorded val evaluation when it describes the challenger's val images (same dataset
    version), else None: the caller re-scores it. Records from before val was recorded have none."""
    val = champion.get("val_metrics")
    if not val or val.get("split", DECISION_SPLIT) != DECISION_SPLIT:
        return None
    return val if champion.get("dataset_version") == dataset_version else None


def stored_score(champion: dict[str, Any], split: str, dataset_version: str) -> dict[str, Any] | None:
    """The champion's recorded evaluation of ``split`` (its val score, or the one its run reported) when it
    describes the challenger's images (same dataset version), else None: the caller re-scores it."""
    if split == DECISION_SPLIT:
        return stored_val_score(champion, dataset_version)
    reported = champion.get("metrics") or {}
    if reported.get("metric") == "culane" and not reported.get("scenarios"):
        return None  # recorded before scenarios were: no gate could be checked against it
    return reported if reported.get("split") == split and champion.get("dataset_version") == dataset_version else None


def selection_accuracy(metrics: dict[str, Any]) -> float:
    """The accuracy models are compared by: the TuSimple score without the 200 ms run-time rule.

    The official rule scores an image that took over 200 ms as a complete miss; that measures the
    machine as much as the model (a busy CPU pushes every image over it), so champions and
    leaderboards never use it. Records from before this score existed fall back to ``accuracy``.
    """
    return float(metrics.get("untimed_accuracy", metrics["accuracy"]))


def score_name(metrics: dict[str, Any]) -> str:
    """What ``selection_accuracy`` of these metrics is, in words: CULane's F1 or TuSimple's accuracy."""
    return "F1" if metrics.get("metric") == "culane" else "accuracy"


def score_summary(metrics: dict[str, Any]) -> str:
    """A recorded evaluation's score in words, named as its benchmark names it: CULane's F1 at IoU 0.5 (it has no
    run-time rule), or TuSimple's accuracy without the 200 ms rule (what models are chosen by) and official."""
    def shown(key: str) -> str:
        value = metrics.get(key)
        return f"{float(value):.4f}" if isinstance(value, int | float) else "?"

    if metrics.get("metric") == "culane":
        return f"F1 {shown('accuracy')} (official, IoU 0.5)"
    untimed = "untimed_accuracy" if "untimed_accuracy" in metrics else "accuracy"
    return f"accuracy {shown(untimed)} without the 200 ms rule, {shown('accuracy')} official"


def decide_champion(champion_accuracy: float | None, challenger_accuracy: float,
                    min_improvement: float = 0.0, score: str = "accuracy") -> Decision:
    """Promote when there is no champion yet, or the challenger beats it by more than ``min_improvement``.

    Both accuracies must come from the same val images (the caller re-scores the champion on the
    challenger's dataset when the data changed), or the comparison means nothing. Val, never test: a
    nightly that crowned on test every night would fit the test split by selection, the adaptive reuse
    sweeps avoid by ranking on val and scoring only their winner on test. ``score`` names the figure in the
    reason (``score_name``).
    """
    if champion_accuracy is None:
        return Decision(True, "no champion yet", None, challenger_accuracy)
    margin = challenger_accuracy - champion_accuracy
    if margin > min_improvement:
        return Decision(True, f"{score} improved by {margin:+.4f} (needed > {min_improvement:+.4f})",
                        champion_accuracy, challenger_accuracy)
    return Decision(False, f"{score} changed by {margin:+.4f}; needed > {min_improvement:+.4f}: champion kept",
                    champion_accuracy, challenger_accuracy)


@dataclass(frozen=True)
class Gate:
    """One figure a challenger may not lose by more than the margin: a CULane scenario's F1 (the crossroads'
    false positives per frame), or TuSimple's accuracy, FP and FN rates."""

    name: str
    champion: float
    challenger: float
    higher_is_better: bool
    margin: float

    @property
    def loss(self) -> float:
        """How much worse the challenger is (negative when better)."""
        change = self.challenger - self.champion
        return -change if self.higher_is_better else change

    @property
    def passed(self) -> bool:
        return self.loss <= self.margin + 1e-12  # a loss of exactly the margin, whatever the rounding, passes


#: CULane's crossroads have no lanes: their figure is false positives per frame, lower is better.
FP_ONLY_SCENARIOS = ("cross",)


def scenario_gates(champion: dict[str, dict[str, Any]], challenger: dict[str, dict[str, Any]],
                   margin: float, fp_margin: float = 0.1) -> list[Gate]:
    """The gates of every scenario both models were scored on (CULane's per-list figures, ``culane_eval``'s
    ``as_dict``): F1, which may fall by ``margin``, or for the crossroads false positives per frame, which may
    rise by ``fp_margin`` of the champion's (a count, unbounded: 0.1 is 10 % more) and by one false positive in
    any case. A scenario with no F1 on either side is left out (nothing to compare)."""
    gates = []
    for name in challenger:
        if name == "all" or name not in champion:
            continue
        ours, theirs = challenger[name], champion[name]
        if name in FP_ONLY_SCENARIOS:
            frames = max(1, int(theirs.get("images") or 0))
            per_frame = [float(figures["fp"]) / max(1, int(figures.get("images") or 0)) for figures in (theirs, ours)]
            gates.append(Gate(f"{name} FP/frame", per_frame[0], per_frame[1], False,
                              max(fp_margin * per_frame[0], 1 / frames)))
        elif ours.get("f1") is not None and theirs.get("f1") is not None:
            gates.append(Gate(f"{name} F1", float(theirs["f1"]), float(ours["f1"]), True, margin))
    return gates


def tusimple_gates(champion: dict[str, Any], challenger: dict[str, Any], margin: float) -> list[Gate]:
    """TuSimple's gates: accuracy (the selection score) may not fall, FP and FN may not rise, by more than
    ``margin``."""
    def rate(metrics: dict[str, Any], key: str) -> float:  # without the run-time rule, as selection_accuracy
        return float(metrics.get(f"untimed_{key}", metrics[key]))

    return [Gate("accuracy", selection_accuracy(champion), selection_accuracy(challenger), True, margin),
            *(Gate(key.upper(), rate(champion, key), rate(challenger, key), False, margin) for key in ("fp", "fn")
              if key in champion and key in challenger)]


def release_gates(champion: dict[str, Any], challenger: dict[str, Any], margin: float,
                  fp_margin: float = 0.1) -> list[Gate]:
    """The gates of two evaluations of the same images: CULane's per list of the split (``scenario_gates``: the
    test split's scenarios; val is one list), TuSimple's accuracy, FP and FN (``tusimple_gates``)."""
    if challenger.get("metric") == "culane":
        return scenario_gates(champion.get("scenarios") or {}, challenger.get("scenarios") or {}, margin, fp_margin)
    return tusimple_gates(champion, challenger, margin)


def gated(decision: Decision, gates: list[Gate]) -> Decision:
    """``decision``, refused when a challenger that would be promoted loses a gate by more than its margin; the
    reason names every such gate."""
    failed = [gate for gate in gates if not gate.passed]
    if not decision.promote or not failed or decision.champion_accuracy is None:
        return decision
    named = ", ".join(f"{gate.name} {gate.champion:.4f} -> {gate.challenger:.4f} (worse by {gate.loss:.4f}, "
                      f"margin {gate.margin:.4f})" for gate in failed)
    return Decision(False, f"{decision.reason}, but it falls behind the champion on {named}: champion kept",
                    decision.champion_accuracy, decision.challenger_accuracy)


def gates_table(gates: list[Gate]) -> list[dict[str, Any]]:
    """The gates as rows of a table artifact (Prefect's ``create_table_artifact``)."""
    return [{"figure": gate.name, "champion": round(gate.champion, 4), "challenger": round(gate.challenger, 4),
             "worse by": round(gate.loss, 4), "margin": gate.margin, "passed": gate.passed} for gate in gates]


def gates_summary(gates: list[Gate], split: str, margin: float, not_scored: str) -> str:
    """The release gates in one line: how many passed on ``split``, which failed; ``not_scored`` (why) if none."""
    if not gates:
        return not_scored
    failed = [gate.name for gate in gates if not gate.passed]
    return (f"{len(gates) - len(failed)} of {len(gates)} passed on {split} (margin {margin:g})"
            + (f"; failed: {', '.join(failed)}" if failed else ""))


def decision_record(decision: Decision, champion: str | None, challenger: str, score: str, split: str,
                    gate_margin: float, cross_fp_margin: float, gates: list[Gate], summary: str) -> dict[str, Any]:
    """What the nightly keeps of a decision (``DECISION_FILE``, MLflow's tags and artifact, ``laneflow compare``):
    promoted or kept, why, against which champion (None: there was none), both val scores (``score`` names
    them), the margins and every release gate's figures (``gates_table``), with ``summary`` (``gates_summary``)."""
    return {"promoted": decision.promote, "reason": decision.reason, "champion": champion, "challenger": challenger,
            "score": score, "champion_val": decision.champion_accuracy, "challenger_val": decision.challenger_accuracy,
            "split": split, "gate_margin": gate_margin, "cross_fp_margin": cross_fp_margin,
            "gates_summary": summary, "gates": gates_table(gates)}


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
