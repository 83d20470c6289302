"""``laneflow compare`` shows the nightly's champion decision on a run that was its challenger, read from the
run's own folder (no MLflow): two real CULane nightlies, the second refused for falling behind at night, then
the comparison of both; and a decision file that is not one is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect.variables import Variable

from flows.cli import main
from flows.compare import RunRef, read_run_records
from flows.nightly import nightly_retrain
from flows.params import TrainParams
from tasks.champion import DECISION_FILE, champion_variable
from tasks.compare import CompareError
from tests.http_server import FileServer
from tests.test_pipeline import served_culane
from tests.test_tracking import better_at_night

pytestmark = pytest.mark.slow


def test_compare_shows_the_nightlys_decision_and_every_gate_of_a_culane_challenger(
        prefect_server: dict, laneflow_home: Path, file_server: FileServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As tests/test_tracking.py's gate test, without MLflow: the champion's record is edited into a model better
    at night and no better anywhere else, so the challenger wins on val and is refused by the night gate."""
    volume, variable = "culane-compare", champion_variable("culane-compare")
    source = served_culane(file_server, tmp_path)
    base = {"epochs": 1, "batch_size": 2, "workers": 1, "loader_workers": 0, "volume": volume, "snapshot": False,
            "package": False}
    try:
        first = nightly_retrain(**TrainParams(source=source, **base).flow_parameters())
        record = Variable.get(variable)
        Variable.set(variable, better_at_night(record), overwrite=True)
        second = nightly_retrain(**TrainParams(source=source, **base).flow_parameters(), min_improvement=-0.5)
    finally:
        Variable.unset(variable)
    assert first["promoted"] and not second["promoted"]
    runs = [first["challenger"]["run"], second["challenger"]["run"]]
    assert main(["compare", *(f"{volume}/{run}" for run in runs), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {runs[1]} |"))  # the main table's
    assert f"| kept against {runs[0]} |" in row and row.endswith("; failed: night F1 |")
    section = out[out.index("## Nightly champion decisions"):]
    assert f"### `{runs[0]}`: promoted (no champion before)" in section and "not scored: no champion yet" in section
    assert f"### `{runs[1]}`: kept against champion `{runs[0]}`" in section
    assert second["reason"] in section  # the nightly's own words
    night = next(gate for gate in second["gates"] if gate["figure"] == "night F1")
    assert (f"| night F1 | {night['champion']} | {night['challenger']} | {night['worse by']} | {night['margin']} "
            "| **NO** |") in section
    assert len([line for line in section.splitlines() if line.startswith("| ") and "F1 |" in line]) == len(
        [gate for gate in second["gates"] if gate["figure"].endswith(" F1")])  # every scenario's gate is a row
    figures = {row["run"]: row for row in json.loads((tmp_path / "out" / "figures.json").read_text())["figures"]}
    assert figures[runs[1]]["champion_decision"]["gates"] == second["gates"]
    assert figures[runs[0]]["champion_decision"]["promoted"] is True


def test_a_decision_file_that_is_not_one_is_named(prefect_server: dict, laneflow_home: Path) -> None:
    folder = laneflow_home / "volumes" / "v" / "runs" / "train-0123456789ab"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    (folder / "lineage.json").write_text(json.dumps({"run": "train-0123456789ab", "parameters": {"batch_size": 2}}))
    ref = RunRef(name="train-0123456789ab", volume="v")
    assert read_run_records(ref).decision is None  # no nightly judged it
    (folder / DECISION_FILE).write_text("{half")
    with pytest.raises(CompareError, match=f"runs/train-0123456789ab/{DECISION_FILE} is not JSON .*remove it"):
        read_run_records(ref)
    (folder / DECISION_FILE).write_text(json.dumps({"reason": "edited"}))
    with pytest.raises(CompareError, match="is not a nightly's decision"):
        read_run_records(ref)
