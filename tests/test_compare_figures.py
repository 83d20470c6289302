"""The comparison's rules on hand-made records: a resumed run, storage billed at its service level, prices
that are missing, the flags, the baseline and bad input. (tests/test_compare.py: real runs end to end.)"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from tasks.champion import decide_champion, decision_record, gated, gates_summary, scenario_gates
from tasks.compare import CompareError, Prices, RunRecords, compare, parse_events, run_figures
from tasks.compare_report import figures_record, render_markdown


def records(name: str, *, workers: int = 1, batch: int = 2, preset: str = "cpu-demo", version: str = "v1",
            platform: str = "local", service_level: dict | None = None, resumed: bool = False) -> RunRecords:
    """A run of 20 steps logged every 10 at 8 img/s, val scored at step 10 (0.4) and at the end (0.8); with
    ``resumed`` its first attempt died after step 10, 100 s went by, and the second started from step 5."""
    t0 = 1_000.0
    events = [{"event": "start", "step": 0, "world_size": workers, "precision": "fp32", "time": t0},
              {"event": "step", "step": 10, "img_per_s": 8.0, "input_stall": 0.25, "time": t0 + 10},  # no seconds
              {"event": "val", "step": 10, "accuracy": 0.1, "untimed_accuracy": 0.4, "time": t0 + 11}]
    if resumed:
        t0 += 100
        events.append({"event": "start", "step": 5, "world_size": workers, "precision": "fp32", "time": t0})
    events += [{"event": "step", "step": 20, "img_per_s": 4.0, "input_stall": 0.5, "seconds": 15.0 if resumed
                else 2.5 * workers * batch, "time": t0 + 20},
               {"event": "eval", "split": "val", "accuracy": 0.2, "untimed_accuracy": 0.8, "time": t0 + 22}]
    lineage = {"run": name, "platform": platform, "volume": "v", "dataset_version": version,
               "parameters": {"batch_size": batch, "preset": preset, "workers": workers},
               "training": {"trainer_eval": {"accuracy": 0.2, "untimed_accuracy": 0.8}},
               "metrics": {"split": "test", "accuracy": 0.15, "untimed_accuracy": 0.7},
               "service_level": service_level}
    return RunRecords(name=name, lineage=lineage, events=events)


def test_a_resumed_run_counts_every_image_it_fed_and_the_time_it_was_down() -> None:
    figures = run_figures(records("r", workers=2, resumed=True), target_accuracy=0.5)
    # Windows: steps 0-10 (10 x 2 x 2 = 40 images at 8/s: 5 s), 5-20 after the restart (60 images at 4/s: 15 s).
    assert figures.images_seen == 100 and math.isclose(figures.training_s, 20.0)
    assert math.isclose(figures.img_per_s, 5.0) and math.isclose(figures.img_per_s_per_worker, 2.5)
    assert math.isclose(figures.input_stall, (0.25 * 5 + 0.5 * 15) / 20)
    assert math.isclose(figures.wall_s, 122.0)  # first start to the last event, the 100 s down included
    assert figures.time_to_target_s == pytest.approx(122.0)  # 0.4 at step 10 is short of 0.5; the end reaches it
    assert figures.val_curve == [(11.0, 0.4), (122.0, 0.8)]
    assert math.isclose(figures.worker_hours, 2 * 122 / 3600)
    assert (figures.val_untimed_accuracy, figures.test_untimed_accuracy, figures.steps) == (0.8, 0.7, 20)


def test_storage_is_billed_at_the_level_the_volume_trained_on_and_a_missing_price_is_named() -> None:
    premium = {"training": "Premium", "home": "Standard", "quota_tib": 2.0}
    prices = Prices(worker_hour={"gpu": 3.0}, tib_hour={"Premium": 0.4})
    (row,) = compare([records("anf", platform="gpu", service_level=premium)], prices=prices).rows
    wall_h = 22 / 3600
    assert math.isclose(row["cost"], round(wall_h * 3.0 + 2.0 * wall_h * 0.4, 4))
    assert "worker-h x 3" in row["cost basis"] and "TiB-h Premium x 0.4" in row["cost basis"]
    ultra = {**premium, "training": "Ultra"}
    (row,) = compare([records("anf", platform="gpu", service_level=ultra)], prices=prices).rows
    assert row["cost"] == "no tib_hour price for service level 'Ultra'"
    (row,) = compare([records("elsewhere", platform="other")], prices=prices).rows
    assert row["cost"] == "no worker_hour price for platform 'other'"
    (row,) = compare([records("free")]).rows
    assert row["cost"] == "no prices given" and row["cost basis"] == ""


def test_runs_that_differ_from_the_baseline_are_compared_and_flagged_naming_each_difference() -> None:
    runs = [records("big", workers=2, preset="tusimple", batch=4, version="v2"), records("small")]
    comparison = compare(runs)
    assert comparison.baseline == "small"  # the fewest workers, wherever it is listed
    big, small = comparison.rows
    assert small["comparable"] == "baseline"
    assert big["comparable"] == ("NO: dataset version v2 (baseline small: v1); preset tusimple (baseline small: "
                                 "cpu-demo); batch size per worker 4 (baseline small: 2)")
    # Still compared: 160 images against 40 is another job, so no speed-up, but the throughput diagnostic.
    assert big["speed-up"] == "not the same work (160 images seen, baseline 40)" and big["efficiency"] is None
    assert math.isclose(big["throughput ratio (diagnostic)"], 1.0, abs_tol=1e-3)
    assert compare(runs, baseline="big").baseline == "big"
    with pytest.raises(CompareError, match=r"baseline 'gone' is not among the compared runs \(big, small\)"):
        compare(runs, baseline="gone")
    # Another model is another job too; a run from before models were a choice trained SCNN.
    fast = records("fast")
    fast.lineage["parameters"]["model"] = "ufld"
    ufld, scnn = compare([fast, records("small")], baseline="small").rows
    assert (ufld["model"], scnn["model"]) == ("ufld", "scnn")
    assert ufld["comparable"] == "NO: model ufld (baseline small: scnn)"


def test_bad_input_is_named() -> None:
    with pytest.raises(CompareError, match=r"r: metrics\.jsonl line 2 is not JSON"):
        parse_events('{"event": "start"}\n{"event": \n', "r")
    with pytest.raises(CompareError, match="no start event"):
        run_figures(RunRecords("r", {"parameters": {"batch_size": 2}}, [{"event": "step", "step": 1}]), 0.5)
    with pytest.raises(CompareError, match="target accuracy 90 is not a fraction"):
        compare([records("r")], target_accuracy=90)
    with pytest.raises(CompareError, match="nothing to compare"):
        compare([])
    with pytest.raises(ValidationError, match="gpu_hour"):
        Prices.model_validate({"gpu_hour": {"local": 1.0}})


def test_a_run_from_before_events_had_times_takes_its_launchers_duration_and_says_it_has_no_stamps() -> None:
    old = records("old")
    events = [{key: value for key, value in event.items() if key != "time"} for event in old.events]
    lineage = {**old.lineage, "training": {**old.lineage["training"], "duration_s": 30.0}}
    (row,) = compare([RunRecords("old", lineage, events)], target_accuracy=0.5).rows
    assert row["wall time (s)"] == 30.0 and row["time to 0.5 val (s)"] == "no time stamps"


def test_prices_come_from_the_prefect_variable_when_the_flow_is_given_none(prefect_server: dict) -> None:
    from prefect.variables import Variable

    from flows.compare import PRICES_VARIABLE, prices_setting

    try:
        assert prices_setting() is None
        Variable.set(PRICES_VARIABLE, {"currency": "EUR", "worker_hour": {"local": 1.5}}, overwrite=True)
        assert prices_setting() == Prices(currency="EUR", worker_hour={"local": 1.5})
        Variable.set(PRICES_VARIABLE, {"worker_hours": {"local": 1.5}}, overwrite=True)
        with pytest.raises(CompareError, match=r"variable laneflow-prices is not a price list: (.|\n)*worker_hours"):
            prices_setting()
    finally:
        Variable.unset(PRICES_VARIABLE)


def timed(name: str, workers: int, wall_s: float, images: int, batch: int = 8, train_share: float = 0.9) -> RunRecords:
    """A run that fed ``images`` images in ``workers`` processes and ended ``wall_s`` after it started, spending
    ``train_share`` of it in step windows (the rest: val scoring, start-up)."""
    steps = images // (batch * workers)
    events = [{"event": "start", "step": 0, "world_size": workers, "time": 0.0},
              {"event": "step", "step": steps, "img_per_s": images / (wall_s * train_share),
               "seconds": wall_s * train_share, "input_stall": 0.0, "time": wall_s * train_share},
              {"event": "eval", "split": "val", "accuracy": 0.9, "untimed_accuracy": 0.9, "time": wall_s}]
    lineage = {"run": name, "platform": "gpu", "volume": "v", "dataset_version": "v1",
               "parameters": {"batch_size": batch, "preset": "tusimple", "workers": workers},
               "training": {"trainer_eval": {"accuracy": 0.9, "untimed_accuracy": 0.9}}, "metrics": {}}
    return RunRecords(name=name, lineage=lineage, events=events)


def test_the_seeds_headline_is_the_elapsed_time_ratio_for_the_same_work() -> None:
    # The seed: 1 GPU 12 h 45 min, 3 GPUs 4 h 30 min, the same epochs (24000 images).
    one, three = timed("one-gpu", 1, 45_900.0, 24_000), timed("three-gpus", 3, 16_200.0, 24_000, train_share=0.8)
    comparison = compare([one, three])
    base, row = comparison.rows
    assert base["speed-up"] == 1.0 and row["speed-up"] == round(45_900 / 16_200, 3) == 2.833
    assert row["efficiency"] == round(45_900 / 16_200 / 3, 3) == 0.944
    # The diagnostic is the step windows' ratio, which leaves out the 3-GPU run's larger untimed share.
    assert math.isclose(row["throughput ratio (diagnostic)"], (45_900 * 0.9) / (16_200 * 0.8), abs_tol=1e-3)
    report = render_markdown(comparison)
    assert ("`three-gpus` (3 worker(s) against 1): the same work in 4 h 30 min instead of 12 h 45 min: "
            "**2.83×** speed-up, **94 %** efficiency") in report


def test_a_sampler_s_padding_is_still_the_same_work_and_more_epochs_are_not() -> None:
    padded = compare([timed("one", 1, 100.0, 24_000), timed("three", 3, 40.0, 24_048)])  # 0.2 % more: padding
    assert padded.rows[1]["speed-up"] == 2.5
    longer = compare([timed("one", 1, 100.0, 24_000), timed("three", 3, 40.0, 48_000)])
    assert longer.rows[1]["speed-up"] == "not the same work (48000 images seen, baseline 24000)"
    assert "`three` (3 worker(s) against 1): no speed-up: not the same work" in render_markdown(longer)


def test_an_elastic_run_counts_the_workers_each_window_had_and_the_steps_it_redid() -> None:
    """Two workers to step 10, one lost there (the survivor back at its commit, step 8) trains steps 8-20 alone,
    the worker back at 20, two to step 30; every window 10 s."""
    t0 = 1_000.0
    events = [{"event": "start", "step": 0, "world_size": 2, "time": t0},
              {"event": "step", "step": 10, "img_per_s": 4.0, "seconds": 10.0, "workers": 2, "time": t0 + 10},
              {"event": "workers", "step": 8, "workers": 1, "lost": ["b"], "joined": [], "time": t0 + 11},
              {"event": "step", "step": 20, "img_per_s": 2.4, "seconds": 10.0, "workers": 1, "time": t0 + 21},
              {"event": "workers", "step": 20, "workers": 2, "lost": [], "joined": ["b"], "time": t0 + 22},
              {"event": "step", "step": 30, "img_per_s": 4.0, "seconds": 10.0, "workers": 2, "time": t0 + 32}]
    lineage = {"run": "e", "platform": "local", "volume": "v", "dataset_version": "v1",
               "parameters": {"batch_size": 2, "preset": "cpu-demo", "workers": 2}, "training": {}, "metrics": {}}
    figures = run_figures(RunRecords("e", lineage, events), target_accuracy=0.5)
    # 10 x 2 x 2 = 40, then 12 x 2 x 1 = 24 (steps 9 and 10 trained twice), then 10 x 2 x 2 = 40.
    assert figures.images_seen == 104 and math.isclose(figures.training_s, 30.0)
    assert figures.workers == 2  # 50 worker-seconds over 30 s of training: 1.67 on average
    assert math.isclose(figures.img_per_s_per_worker, 104 / 50)
    assert math.isclose(figures.worker_hours, 50 / 30 * 32 / 3600)


def test_a_culane_runs_scenarios_are_a_table_of_their_own_and_the_crossroads_show_false_positives() -> None:
    culane = records("culane-run")
    culane.lineage["metrics"] = {
        "split": "test", "metric": "culane", "accuracy": 0.5, "untimed_accuracy": 0.5,
        "scenarios": {"normal": {"tp": 9, "fp": 1, "fn": 1, "f1": 0.9},
                      "night": {"tp": 1, "fp": 3, "fn": 3, "f1": 0.25},
                      "cross": {"tp": 0, "fp": 7, "fn": 0, "f1": None}}}
    comparison = compare([records("tusimple-run"), culane])
    text = render_markdown(comparison)
    section = text[text.index("## Test per scenario"):].splitlines()
    assert "| run | normal | night | cross |" in section
    assert "| culane-run | 90.00 | 25.00 | FP 7 |" in section
    assert not any(line.startswith("| tusimple-run") for line in section)  # no scenarios: no row
    assert [row["test_scenarios"]["night"]["f1"] for row in figures_record(comparison) if row["metric"] == "culane"] \
        == [0.25]
    assert "## Test per scenario" not in render_markdown(compare([records("tusimple-run")]))


def test_a_nightly_challenger_shows_the_decision_its_reason_and_every_gate() -> None:
    """The decision as the nightly records it (``tasks.champion``'s own functions): a CULane challenger better on
    val but three points down at night is kept out; a first champion was promoted with nothing to gate."""
    champion = {"normal": {"f1": 0.90, "fp": 1, "images": 4}, "night": {"f1": 0.60, "fp": 2, "images": 3},
                "cross": {"f1": None, "fp": 2, "images": 2}}
    challenger = {"normal": {"f1": 0.93, "fp": 1, "images": 4}, "night": {"f1": 0.57, "fp": 2, "images": 3},
                  "cross": {"f1": None, "fp": 2, "images": 2}}
    gates = scenario_gates(champion, challenger, margin=0.02)
    decision = gated(decide_champion(0.70, 0.72, score="F1"), gates)
    refused = records("challenger")
    refused = RunRecords(refused.name, refused.lineage, refused.events, decision_record(
        decision, "train-champion", "challenger", "F1", "test", 0.02, 0.1, gates,
        gates_summary(gates, "test", 0.02, "")))
    first = records("first")
    first = RunRecords(first.name, first.lineage, first.events, decision_record(
        decide_champion(None, 0.70, score="F1"), None, "first", "F1", "test", 0.02, 0.1, [],
        gates_summary([], "test", 0.02, "not scored: no champion yet")))
    stopped = records("stopped")  # as the nightly records a challenger whose training was stopped
    stopped = RunRecords(stopped.name, stopped.lineage, stopped.events, {
        "promoted": False, "reason": "challenger stopped was stopped at step 3 of 10 (on request): not scored",
        "champion": None, "challenger": "stopped", "gates_summary": "not scored: the challenger was stopped",
        "gates": [], "stopped": True})
    comparison = compare([records("trained-by-hand"), first, refused, stopped])
    cells = {row["run"]: (row["nightly decision"], row["release gates"]) for row in comparison.rows}
    assert cells == {"trained-by-hand": ("", ""), "first": ("promoted (no champion before)",
                                                            "not scored: no champion yet"),
                     "challenger": ("kept against train-champion",
                                    "2 of 3 passed on test (margin 0.02); failed: night F1"),
                     "stopped": ("not scored (stopped)", "not scored: the challenger was stopped")}
    text = render_markdown(comparison)
    section = text[text.index("## Nightly champion decisions"):]
    assert "### `challenger`: kept against champion `train-champion`" in section
    assert "F1 improved by +0.0200" in section and "night F1 0.6000 -> 0.5700" in section
    assert "- val F1: challenger 0.7200, champion 0.7000\n- release gates: 2 of 3 passed" in section
    assert "| night F1 | 0.6 | 0.57 | 0.03 | 0.02 | **NO** |" in section
    assert "| normal F1 | 0.9 | 0.93 | -0.03 | 0.02 | yes |" in section
    assert "| cross FP/frame | 1.0 | 1.0 | 0.0 | 0.5 | yes |" in section  # 2 FP over 2 frames; one more allowed
    assert "### `first`: promoted (no champion before)" in section and "no champion yet" in section
    assert "### `stopped`: not scored (stopped)\n\nchallenger stopped was stopped at step 3" in section
    assert "trained-by-hand" not in section
    recorded = {row["name"]: row["champion_decision"] for row in figures_record(comparison)}
    assert recorded["trained-by-hand"] is None and recorded["challenger"]["promoted"] is False
    assert [gate["figure"] for gate in recorded["challenger"]["gates"] if not gate["passed"]] == ["night F1"]
    # Runs no nightly judged: no decision columns, no section.
    plain = compare([records("a"), records("b")])
    assert "nightly decision" not in plain.rows[0] and "## Nightly" not in render_markdown(plain)
