"""A sweep names what it ranked by as the trials' benchmark does: CULane's val F1, TuSimple's val accuracy
without the 200 ms rule. The words alone, then a real two-trial sweep on served CULane-format data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.params import TrainParams
from flows.sweep import PRUNED, ranking_words, sweep
from tests.http_server import FileServer
from tests.test_pipeline import served_culane
from tests.test_reports import culane_evaluation

TUSIMPLE_VAL = {"split": "val", "accuracy": 0.5, "untimed_accuracy": 0.9}


def test_a_culane_sweep_says_it_ranked_by_val_f1_and_a_tusimple_sweep_by_untimed_accuracy() -> None:
    culane = [{"state": "Completed", "metrics": {**culane_evaluation(), "split": "val"}}]
    words = ranking_words(culane, {"test accuracy": 0.6667, "test official accuracy": 0.6667})
    assert words.startswith("ranked by val F1 (CULane's official metric at IoU 0.5")
    assert "once: F1 0.6667 — " in words and "TuSimple" not in words and "200 ms" not in words
    # Every trial pruned: what they were stopped at still says which benchmark it is.
    pruned = [{"state": PRUNED, "val": [{"split": "val", "metric": "culane", "accuracy": 0.2}]}]
    assert ranking_words(pruned, None).startswith("ranked by val F1") and "once —" in ranking_words(pruned, None)
    tusimple = ranking_words([{"state": "Completed", "metrics": TUSIMPLE_VAL}],
                             {"test accuracy": 0.9, "test official accuracy": 0.5})
    assert tusimple.startswith("ranked by val accuracy (TuSimple's label_data_0531, held out from training) "
                               "without the 200 ms run-time rule") and "once: 0.9 (official 0.5) — " in tusimple


@pytest.mark.slow
def test_a_culane_sweeps_leaderboard_is_ranked_by_val_f1(
        prefect_server: dict, laneflow_home: Path, file_server: FileServer, tmp_path: Path) -> None:
    base = TrainParams(source=served_culane(file_server, tmp_path), epochs=1, batch_size=2, workers=1,
                       loader_workers=0, volume="culane-sweep", snapshot=False, package=False)
    table = sweep(**base.flow_parameters(), grid={"lr": [0.05, 0.02]})
    assert [row["state"] for row in table] == ["Completed", "Completed"]
    assert table[0]["test accuracy"] is not None and table[1]["test accuracy"] is None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-leaderboard"])))
    newest = max(found, key=lambda artifact: artifact.created)
    assert [row["run"] for row in json.loads(newest.data)] == [row["run"] for row in table]
    assert "ranked by val F1 (CULane's official metric" in newest.description
    assert f"once: F1 {table[0]['test accuracy']} — " in newest.description and "TuSimple" not in newest.description
