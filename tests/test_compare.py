"""compare: three real local runs (1 and 2 workers on one dataset, 2 workers on another version), compared by
the flow and by ``laneflow compare``; every figure is recomputed here from the runs' own files."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.compare import RunRef, compare_runs
from flows.train import train_pipeline
from tasks.compare import CompareError, Prices
from tasks.processes import run_to_end
from tests.conftest import SMALL_SIZE
from tests.test_pipeline import params_for
from training.data.synthetic import generate, pack_archive

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compare")]

PRICES = Prices(currency="EUR", worker_hour={"local": 2.5}, tib_hour={"Premium": 0.4})
TARGET = 0.25


@pytest.fixture(scope="module")
def three_runs(prefect_server: dict, synthetic_archive: tuple[Path, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, dict]]]:
    """One worker (snapshotted) and two workers on the session's dataset; two workers on another version."""
    home = tmp_path_factory.mktemp("compare-home")
    other = tmp_path_factory.mktemp("other-version")
    generate(other / "tusimple", train=8, val=3, test=3, seed=8, width=SMALL_SIZE[0], height=SMALL_SIZE[1])
    other_archive = other / "train_set.zip"
    other_sha = pack_archive(other / "tusimple", other_archive)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LANEFLOW_HOME", str(home))
        # 20 and 10 steps (8 images, batch 2): each run is scored on val at step 8 at least.
        common = {"volume": "compare", "epochs": 5, "eval_every": 8}
        runs = {
            "one": train_pipeline(**params_for(synthetic_archive, workers=1, snapshot=True, **common)),
            "two": train_pipeline(**params_for(synthetic_archive, workers=2, snapshot=False, **common)),
            "other": train_pipeline(**params_for((other_archive, other_sha), workers=2, snapshot=False, **common)),
        }
        yield home, runs


def recomputed(home: Path, run: str) -> dict:
    """The figures of a run as docs/how-to/compare.md defines them, read straight from its files."""
    folder = home / "volumes" / "compare" / "runs" / run
    lineage = json.loads((folder / "lineage.json").read_text())
    events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    batch = lineage["parameters"]["batch_size"]
    images = seconds = stalled = 0.0
    world = last_step = 0
    for event in events:
        if event["event"] == "start":
            world, last_step = event["world_size"], event["step"]
        elif event["event"] == "step":
            window = (event["step"] - last_step) * batch * world
            last_step = event["step"]
            # The trainer's rate is over exactly the steps since its last event: its windows cover every step.
            assert math.isclose(event["img_per_s"] * event["seconds"], window, rel_tol=1e-3), event
            images += window
            seconds += event["seconds"]
            stalled += event["input_stall"] * event["seconds"]
    first = next(e for e in events if e["event"] == "start")["time"]
    wall = max(e["time"] for e in events) - first
    scores = [e for e in events if e["event"] == "val" or (e["event"] == "eval" and e.get("split") == "val")]
    reached = [e["time"] - first for e in scores if e["untimed_accuracy"] >= TARGET]
    return {"images": images, "seconds": seconds, "stall": stalled / seconds, "wall": wall, "world": world,
            "val": lineage["training"]["trainer_eval"], "test": lineage["metrics"],
            "to_target": reached[0] if reached else None, "version": lineage["dataset_version"],
            # What precision=auto became on the machine that trained (the last attempt's start), as the lineage says.
            "precision": [e for e in events if e["event"] == "start"][-1]["precision"],
            "lineage_precision": lineage["training"]["numerics"]["precision"]}


def artifact(key: str) -> object:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return max(found, key=lambda item: item.created).data


def test_the_compare_flow_publishes_figures_recomputed_from_each_runs_records(
        three_runs: tuple[Path, dict[str, dict]], monkeypatch: pytest.MonkeyPatch) -> None:
    home, runs = three_runs
    monkeypatch.setenv("LANEFLOW_HOME", str(home))
    refs = [RunRef(name=runs["one"]["snapshot"]),  # a snapshot: read from the snapshot's own copy
            RunRef(name=runs["two"]["run"], volume="compare"), RunRef(name=runs["other"]["run"], volume="compare")]
    rows = compare_runs(runs=refs, target_accuracy=TARGET, prices=PRICES)
    by_run = dict(zip(("one", "two", "other"), rows, strict=True))
    base = recomputed(home, runs["one"]["run"])
    for key, row in by_run.items():
        mine = recomputed(home, runs[key]["run"])
        throughput = mine["images"] / mine["seconds"]
        assert row["workers"] == mine["world"] == (1 if key == "one" else 2)
        assert row["images seen"] == mine["images"] == runs[key]["steps"] * 2 * mine["world"]  # batch 2, no resume
        assert row["steps"] == runs[key]["steps"] and row["training time (s)"] <= row["wall time (s)"]
        assert math.isclose(row["training time (s)"], mine["seconds"], abs_tol=0.01)
        # The table rounds img/s to 2 decimals: at a few img/s (a busy machine) that is more than 0.1 %.
        assert math.isclose(row["img/s"], throughput, rel_tol=1e-3, abs_tol=0.005 + 1e-9)
        assert math.isclose(row["img/s per worker"], throughput / mine["world"], rel_tol=1e-3, abs_tol=0.005 + 1e-9)
        assert math.isclose(row["input stall"], mine["stall"], abs_tol=1e-4)
        assert math.isclose(row["wall time (s)"], mine["wall"], abs_tol=0.1)
        assert row["val accuracy"] == round(mine["val"]["accuracy"], 4)
        assert row["val accuracy (untimed)"] == round(mine["val"]["untimed_accuracy"], 4)
        assert row["test accuracy (untimed)"] == round(mine["test"]["untimed_accuracy"], 4)
        target = row[f"time to {TARGET:g} val (s)"]
        assert target == "not reached" if mine["to_target"] is None else math.isclose(target, mine["to_target"],
                                                                                       abs_tol=0.1)
        worker_hours = mine["world"] * mine["wall"] / 3600
        assert math.isclose(row["worker-hours"], worker_hours, abs_tol=1e-5)
        assert math.isclose(row["cost"], worker_hours * 2.5, abs_tol=1e-4)  # local: no service level to bill
        # The same epochs on the same number of images: the same work, so the speed-up is elapsed time's.
        assert mine["images"] == base["images"]
        speed_up = base["wall"] / mine["wall"]
        assert math.isclose(row["speed-up"], speed_up, abs_tol=2e-3)
        assert math.isclose(row["efficiency"], speed_up / mine["world"], abs_tol=2e-3)
        throughput_ratio = throughput / (base["images"] / base["seconds"])
        assert math.isclose(row["throughput ratio (diagnostic)"], throughput_ratio, abs_tol=2e-3)
        assert row["precision"] == mine["precision"] == mine["lineage_precision"]
        assert row["preset"] == "cpu-demo" and row["platform"] == "local"
    assert by_run["one"]["comparable"] == "baseline" and by_run["two"]["comparable"] == "yes"
    other_version = recomputed(home, runs["other"]["run"])["version"]
    assert by_run["other"]["comparable"] == (f"NO: dataset version {other_version} (baseline "
                                             f"{runs['one']['snapshot']}: {base['version']})")

    table = json.loads(artifact("compare"))
    assert [row["run"] for row in table] == [row["run"] for row in rows]
    report = str(artifact("compare-report"))
    assert f"Baseline: `{runs['one']['snapshot']}`" in report and "## Not like for like" in report
    assert f"- `{runs['two']['run']}` (2 worker(s) against 1): the same work in " in report
    for chart in ("Throughput vs workers", "Val accuracy vs wall time"):
        assert f"![{chart}](data:image/png;base64," in report


def test_laneflow_compare_prints_the_table_writes_charts_and_names_what_is_missing(
        three_runs: tuple[Path, dict[str, dict]], prefect_server: dict, tmp_path: Path) -> None:
    home, runs = three_runs
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(home)}
    laneflow = str(Path(sys.executable).parent / "laneflow")
    two, one = f"compare/{runs['two']['run']}", f"local:compare/{runs['one']['run']}"
    shown = run_to_end([laneflow, "compare", two, one, "--out", str(tmp_path / "out")], 600, env=env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert f"Baseline: `{runs['one']['run']}`" in shown.stdout  # fewest workers, wherever it is named
    assert "no prices given" in shown.stdout and "| speed-up |" in shown.stdout
    for name in ("throughput.png", "accuracy.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(b"\x89PNG")
    figures = json.loads((tmp_path / "out" / "figures.json").read_text())
    assert [row["run"] for row in figures["rows"]] == [runs["two"]["run"], runs["one"]["run"]]

    missing = run_to_end([laneflow, "compare", two, "compare/train-000000000000", "--volume", "compare"], 600,
                         env=env)
    assert missing.returncode == 2
    assert "no run 'train-000000000000' with a metrics.jsonl on volume 'compare'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_missing_run_fails_the_flow_naming_it_and_publishes_nothing(
        three_runs: tuple[Path, dict[str, dict]], monkeypatch: pytest.MonkeyPatch) -> None:
    home, runs = three_runs
    monkeypatch.setenv("LANEFLOW_HOME", str(home))
    with get_client(sync_client=True) as client:
        before = len(client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["compare"]))))
    state = compare_runs(runs=[RunRef(name=runs["two"]["run"], volume="compare"), RunRef(name="no-such-snapshot")],
                         return_state=True)
    assert state.is_failed()
    with pytest.raises(CompareError, match="no-such-snapshot: no snapshot of that name on platform 'local'"):
        state.result()
    with get_client(sync_client=True) as client:
        after = len(client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["compare"]))))
    assert after == before
