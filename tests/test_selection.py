"""Choosing models: champion decisions, the sweep leaderboard, stopped trials' outcomes and the pruners."""

from __future__ import annotations

import json

import pytest

from flows.params import TrainParams
from flows.sweep import leaderboard
from tasks.champion import (
    decide_champion,
    gated,
    gates_table,
    release_gates,
    scenario_gates,
    score_name,
    selection_accuracy,
    stored_score,
    tusimple_gates,
)
from tasks.platforms.base import outcome_from_events
from tests.unit_helpers import source


def test_champion_decisions() -> None:
    assert decide_champion(None, 0.1).promote
    assert decide_champion(0.80, 0.81).promote
    assert not decide_champion(0.80, 0.80).promote  # equal is not better
    assert not decide_champion(0.80, 0.805, min_improvement=0.01).promote
    assert "champion kept" in decide_champion(0.9, 0.5).reason
    # The reason names the figure compared: CULane's F1, TuSimple's accuracy.
    assert decide_champion(0.5, 0.6, score=score_name({"metric": "culane"})).reason.startswith("F1 improved by +0.1")
    assert decide_champion(0.5, 0.4, score=score_name({"split": "val"})).reason.startswith("accuracy changed by -0.1")


def culane_figures(f1: dict[str, float], cross_fp: int) -> dict[str, dict]:
    return {**{name: {"images": 100, "f1": value, "fp": 5} for name, value in f1.items()},
            "cross": {"images": 50, "f1": None, "fp": cross_fp}, "all": {"images": 350, "f1": 0.7, "fp": 0}}


def test_a_challenger_better_on_average_is_refused_when_one_scenario_falls_behind_by_more_than_the_margin() -> None:
    champion = culane_figures({"normal": 0.80, "night": 0.60, "curve": 0.50}, cross_fp=10)
    better_but_blind_at_night = culane_figures({"normal": 0.90, "night": 0.54, "curve": 0.70}, cross_fp=10)
    decision = decide_champion(0.63, 0.71)
    gates = scenario_gates(champion, better_but_blind_at_night, margin=0.02)
    refused = gated(decision, gates)
    assert decision.promote and not refused.promote
    assert "night F1 0.6000 -> 0.5400 (worse by 0.0600, margin 0.0200)" in refused.reason
    assert refused.reason.endswith("champion kept") and "normal" not in refused.reason.split("behind")[1]
    assert [row["figure"] for row in gates_table(gates) if not row["passed"]] == ["night F1"]
    assert gated(decision, scenario_gates(champion, better_but_blind_at_night, margin=0.1)).promote
    # The crossroads: false positives per frame may not rise by more than the margin either.
    seeing_lanes_at_crossroads = culane_figures({"normal": 0.90, "night": 0.62, "curve": 0.70}, cross_fp=15)
    refused = gated(decision, scenario_gates(champion, seeing_lanes_at_crossroads, margin=0.05))
    assert not refused.promote and "cross FP/frame 0.2000 -> 0.3000" in refused.reason
    # Relative to the champion's (a count, unbounded): 10 % more by default, and one more in any case.
    assert gated(decision, scenario_gates(champion, culane_figures({"night": 0.6}, cross_fp=11), 0.02)).promote
    assert not gated(decision, scenario_gates(champion, culane_figures({"night": 0.6}, cross_fp=12), 0.02)).promote
    assert gated(decision, scenario_gates(culane_figures({}, 0), culane_figures({}, 1), 0.02)).promote
    assert gated(decide_champion(None, 0.2), gates).promote  # no champion: nothing to fall behind
    assert gated(decide_champion(0.8, 0.7), gates) == decide_champion(0.8, 0.7)  # already kept: as it was


def test_on_tusimple_the_gates_are_accuracy_fp_and_fn_without_the_run_time_rule() -> None:
    champion = {"accuracy": 0.90, "fp": 0.10, "fn": 0.05, "untimed_accuracy": 0.90, "untimed_fp": 0.10,
                "untimed_fn": 0.05}
    missing_more = {"accuracy": 0.0, "fp": 0.0, "fn": 1.0, "untimed_accuracy": 0.93, "untimed_fp": 0.08,
                    "untimed_fn": 0.12}
    refused = gated(decide_champion(0.90, 0.93), tusimple_gates(champion, missing_more, margin=0.05))
    assert not refused.promote and "FN 0.0500 -> 0.1200" in refused.reason and "FP" not in refused.reason


def test_the_gates_follow_the_metric_and_a_champions_recorded_score_counts_only_on_the_same_images() -> None:
    champion = {"run": "c", "dataset_version": "v1",
                "metrics": {"split": "test", "metric": "culane", "scenarios": culane_figures({"night": 0.6}, 1)},
                "val_metrics": {"split": "val", "metric": "culane", "accuracy": 0.5}}
    assert stored_score(champion, "test", "v1") is champion["metrics"]
    assert stored_score(champion, "val", "v1") is champion["val_metrics"]
    assert stored_score(champion, "test", "v2") is None  # other images: re-scored
    assert stored_score({**champion, "metrics": {**champion["metrics"], "split": "val"}}, "test", "v1") is None
    challenger = {"split": "test", "metric": "culane", "scenarios": culane_figures({"night": 0.5}, 1)}
    assert [gate.name for gate in release_gates(champion["metrics"], challenger, 0.02)] == ["night F1",
                                                                                          "cross FP/frame"]
    assert release_gates(champion["val_metrics"], {"split": "val", "metric": "culane"}, 0.02) == []  # no lists
    tusimple = {"accuracy": 0.9, "fp": 0.1, "fn": 0.1}
    assert [gate.name for gate in release_gates(tusimple, tusimple, 0.02)] == ["accuracy", "FP", "FN"]


def test_models_are_compared_without_the_run_time_rule() -> None:
    busy = {"accuracy": 0.0, "fp": 0.0, "fn": 1.0, "untimed_accuracy": 0.93, "untimed_fp": 0.1, "untimed_fn": 0.05,
            "over_time_limit": 40}
    idle = {"accuracy": 0.81, "fp": 0.2, "fn": 0.2, "untimed_accuracy": 0.81, "untimed_fp": 0.2, "untimed_fn": 0.2,
            "over_time_limit": 0}
    assert selection_accuracy(busy) == 0.93 and selection_accuracy({"accuracy": 0.7}) == 0.7  # older records
    rows = [{"index": 0, "state": "Completed", "run": "train-a", "metrics": idle, "params": {"lr": 0.05},
             "steps": 30},
            {"index": 1, "state": "Completed", "run": "train-b", "metrics": busy, "params": {"lr": 0.02},
             "steps": 30},
            {"index": 2, "state": "Failed", "params": {"lr": 0.3}, "error": "boom"}]
    table = leaderboard(rows, ["lr"])
    assert [row["run"] for row in table] == ["train-b", "train-a", "-"]  # the better model first, busy or not
    assert table[0] == {"rank": 1, "trial": 1, "run": "train-b", "state": "Completed", "lr": 0.02,
                        "val accuracy": 0.93, "val official accuracy": 0.0, "steps": 30,
                        "test accuracy": None, "test official accuracy": None}
    assert table[2]["val accuracy"] is None and table[2]["state"] == "Failed"


def test_pruned_trials_rank_below_finished_ones_at_the_score_they_were_stopped_at() -> None:
    late = {"accuracy": 0.6, "untimed_accuracy": 0.6}
    rows = [{"index": 0, "state": "Pruned", "run": "train-p", "params": {"lr": 0.3}, "steps": 45,
             "val": [{"step": 20, "accuracy": 0.2, "untimed_accuracy": 0.3}, {"step": 40, **late}]},
            {"index": 1, "state": "Completed", "run": "train-c", "params": {"lr": 0.05}, "steps": 80,
             "metrics": {"accuracy": 0.5, "untimed_accuracy": 0.5}},
            {"index": 2, "state": "Failed", "params": {"lr": 0.1}, "error": "boom"}]
    table = leaderboard(rows, ["lr"])
    # 0.6 at step 40 is not a finished run's score: the finished run ranks first, the pruned one after it.
    assert [(row["run"], row["state"], row["val accuracy"], row["steps"]) for row in table] == [
        ("train-c", "Completed", 0.5, 80), ("train-p", "Pruned", 0.6, 45), ("-", "Failed", None, None)]


def test_stopped_runs_outcome_says_why_and_keeps_the_val_curve() -> None:
    events = [{"event": "start", "step": 0, "total_steps": 80}, {"event": "step", "step": 40},
              {"event": "val", "step": 40, "accuracy": 0.0, "untimed_accuracy": 0.0},
              {"event": "checkpoint", "step": 45}, {"event": "stopped", "step": 45, "reason": "pruned",
                                                     "state": "Pruned"}]
    outcome = outcome_from_events("j", events, 2.0, [])
    assert outcome.steps == 45 and outcome.total_steps == 80 and outcome.eval == {}
    assert outcome.stopped == {"step": 45, "reason": "pruned", "state": "Pruned"}
    assert outcome.val == [{"step": 40, "accuracy": 0.0, "untimed_accuracy": 0.0}]
    finished = outcome_from_events("j", [*events[:3], {"event": "eval"}, {"event": "done", "step": 80}], 2.0, [])
    assert finished.stopped is None and finished.steps == 80


@pytest.mark.parametrize(("name", "kind"), [("none", "NopPruner"), ("median", "MedianPruner"),
                                            ("successive_halving", "SuccessiveHalvingPruner"),
                                            ("hyperband", "HyperbandPruner")])
def test_each_pruner_name_is_optunas_pruner(name: str, kind: str) -> None:
    from flows.sweep import make_pruner

    assert type(make_pruner(name, trials=8, min_resource=10)).__name__ == kind


def test_the_median_pruner_stops_a_trial_below_the_median_of_finished_trials_after_as_many_images() -> None:
    """The judge a trial's wait loop calls, against a real Optuna study: quiet until one trial finished, then
    a trial worse after as many training images gets a "Pruned" verdict naming the images and step, and
    keeps it; a score replayed from an adopted log is not reported twice."""
    import threading

    import optuna
    from optuna.distributions import FloatDistribution

    from flows.sweep import TrialJudge, make_pruner

    study = optuna.create_study(direction="maximize", pruner=make_pruner("median", trials=4, min_resource=20))
    lock, space = threading.Lock(), {"lr": FloatDistribution(0.01, 0.1)}
    first = study.ask(space)
    assert TrialJudge(first, "median", lock, images_per_step=2)(10, 0.7) is None  # nothing finished to compare with
    study.tell(first, 0.8)
    assert study.trials[0].intermediate_values == {20: 0.7}  # heard after 10 steps x 2 images
    second = study.ask(space)
    assert TrialJudge(second, "median", lock, images_per_step=2)(10, 0.75) is None  # as good after 20 images
    # Batch 4: after 5 steps it has seen the 20 images the first trial had seen after 10.
    hopeless = TrialJudge(study.ask(space), "median", lock, images_per_step=4)
    verdict = hopeless(5, 0.1)
    assert verdict is not None and verdict.state == "Pruned"
    assert "val accuracy 0.1000 after 20 training images (step 5)" in verdict.reason
    assert hopeless(10, 0.9) is verdict  # it stands: a retried run is stopped at its next score
    assert json.loads(verdict.request(5)) == {"reason": verdict.reason, "state": "Pruned", "requested_at_step": 5}
    replayed = TrialJudge(study.ask(space), "median", lock, images_per_step=2)
    assert replayed(10, 0.9) is None and replayed(10, 0.0) is None  # the same step again is not reported


def test_a_halving_pruners_first_rung_is_eval_every_steps_of_the_smallest_batch_the_space_allows() -> None:
    from flows.search import check_space
    from flows.sweep import smallest_images_per_step

    base = TrainParams(source=source(), batch_size=8, workers=2)
    assert smallest_images_per_step(base, check_space({"lr": {"low": 0.01, "high": 0.1}})) == 16
    assert smallest_images_per_step(base, check_space({"batch_size": {"choices": [4, 2, 8]}})) == 4
    assert smallest_images_per_step(base, check_space({"workers": {"low": 1, "high": 4, "step": 1}})) == 8
