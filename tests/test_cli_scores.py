"""`laneflow snapshots` and `laneflow champion` name a run's score as its benchmark does: CULane's F1, TuSimple's
accuracy with and without the 200 ms rule (real snapshots on the local platform, a real champion variable)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.variables import Variable

from flows.cli import main
from tasks.champion import champion_variable
from tasks.platforms import LocalPlatform
from tests.test_reports import culane_evaluation

TUSIMPLE = {"split": "test", "accuracy": 0.5, "untimed_accuracy": 0.9, "fp": 0.1, "fn": 0.2, "images": 40}


def snapshot_of(platform: LocalPlatform, name: str, dataset: str, metrics: dict) -> None:
    """A snapshot of a finished run (its data and run folders copied) whose lineage records ``metrics``."""
    volume = platform.ensure_volume("scores")
    for folder in ("datasets/d1", f"runs/{name}"):
        platform.write_text(volume, f"{folder}/note.txt", "kept\n")
    platform.create_snapshot(volume, name, "datasets/d1", f"runs/{name}",
                             {"run": name, "dataset": dataset, "dataset_version": "dv1", "metrics": metrics})


def test_snapshots_shows_a_culane_runs_f1_and_a_tusimple_runs_accuracy(
        prefect_server: dict, laneflow_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    platform = LocalPlatform()
    snapshot_of(platform, "culane-run", "culane", culane_evaluation())
    snapshot_of(platform, "tusimple-run", "tusimple", TUSIMPLE)
    assert main(["snapshots"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["culane-run"].endswith(f"dataset culane dv1 F1 {20 / 30:.4f} (official, IoU 0.5)")
    assert "accuracy" not in lines["culane-run"] and "200 ms" not in lines["culane-run"]
    assert lines["tusimple-run"].endswith("dataset tusimple dv1 accuracy 0.9000 without the 200 ms rule, "
                                          "0.5000 official")


def test_champion_shows_a_culane_champions_f1_on_val_and_test(
        prefect_server: dict, laneflow_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    val = {**culane_evaluation(), "split": "val"}
    record = {"run": "train-0123456789ab", "volume": "culane-cli", "snapshot": None, "dataset_version": "dv1",
              "metrics": culane_evaluation(), "val_metrics": val, "package": None, "mlflow": None}
    Variable.set(champion_variable("culane-cli"), record, overwrite=True)
    try:
        assert main(["champion", "--volume", "culane-cli"]) == 0
    finally:
        Variable.unset(champion_variable("culane-cli"))
    out = capsys.readouterr().out
    assert f"val         : F1 {20 / 30:.4f} (official, IoU 0.5) (val, 9 images) - decided on" in out
    assert f"reported    : F1 {20 / 30:.4f} (official, IoU 0.5) (test, 9 images)" in out
    assert "200 ms" not in out
