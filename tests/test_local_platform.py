"""The local platform's side effects: process groups, timeouts, snapshots, restores, saved blocks."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.platforms import LocalPlatform, TrainingFailed, TrainingSpec, VolumeRef, load_platform
from tasks.processes import group_alive
from training.data.sources import Artifact

pytestmark = pytest.mark.slow


@pytest.fixture
def prepared(laneflow_home: Path,
             synthetic_archive: tuple[Path, str]) -> Iterator[tuple[LocalPlatform, VolumeRef, str]]:
    platform = LocalPlatform()
    volume = platform.ensure_volume("unit")
    summary = platform.prepare_dataset(volume, [Artifact(synthetic_archive[0].as_uri(), synthetic_archive[1])],
                                       lambda _: None)
    yield platform, volume, summary["dataset_dir"]
    # A test that failed half-way leaves its 500-epoch training running: stopped here, not at the end of the
    # session (the leak check still names it), so it takes no CPU from the tests after it.
    for record in Path(volume.location).glob("runs/*/launcher.json"):
        platform.cancel_training(record.parent.name, volume)


def long_spec(volume: VolumeRef, data_dir: str, name: str) -> TrainingSpec:
    return TrainingSpec(job_name=name, volume=volume, data_dir=data_dir, run_dir=f"runs/{name}", preset="cpu-demo",
                        workers=2, settings={"epochs": "500", "batch_size": "2", "num_workers": "0"})


def wait_for_start(run_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").is_file() and '"start"' in (run_dir / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)


def test_cancel_stops_the_whole_process_group(prepared: tuple) -> None:
    platform, volume, data_dir = prepared
    spec = long_spec(volume, data_dir, "train-cancel")
    handle = platform.submit_training(spec)
    assert platform.submit_training(spec).adopted  # a second submit adopts the running job
    run_dir = Path(volume.location) / spec.run_dir
    wait_for_start(run_dir)
    pgid = handle.details["pgid"]
    assert group_alive(pgid)
    assert platform.cancel_training(spec.job_name, volume)
    assert not group_alive(pgid)
    assert json.loads((run_dir / "launcher.json").read_text())["reason"] == "cancelled"
    assert not platform.cancel_training(spec.job_name, volume)  # nothing left to stop


def test_training_timeout_fails_for_good_and_leaves_nothing_running(prepared: tuple) -> None:
    platform, volume, data_dir = prepared
    spec = long_spec(volume, data_dir, "train-timeout")
    handle = platform.submit_training(spec)
    # Started before the 5 s begin: on a loaded machine starting Horovod and torch alone takes longer.
    wait_for_start(Path(volume.location) / spec.run_dir)
    events: list[dict] = []
    with pytest.raises(TrainingFailed, match="did not finish within 5 s"):
        platform.wait_for_training(handle, events.append, lambda _: None, timeout_s=5)
    assert not group_alive(handle.details["pgid"])
    assert any(event["event"] == "start" for event in events)


def test_an_interrupted_wait_stops_the_job(prepared: tuple) -> None:
    """What a cancelled or killed flow run does to its training: KeyboardInterrupt stands in for the signal."""
    platform, volume, data_dir = prepared
    spec = long_spec(volume, data_dir, "train-interrupt")
    handle = platform.submit_training(spec)

    def interrupt(event: dict) -> None:
        if event["event"] == "start":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        platform.wait_for_training(handle, interrupt, lambda _: None, timeout_s=300)
    assert not group_alive(handle.details["pgid"])


def test_snapshot_links_immutable_files_copies_the_rest_and_is_adopted_on_retry(prepared: tuple) -> None:
    platform, volume, data_dir = prepared
    run_dir = Path(volume.location) / "runs" / "train-snap"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "model.pt").write_bytes(b"weights")
    (run_dir / "metrics.jsonl").write_text('{"event": "done"}\n')
    (Path(volume.location) / data_dir / "cache").mkdir(exist_ok=True)
    (Path(volume.location) / data_dir / "cache" / "big.bin").write_bytes(b"x" * 100)

    ref = platform.create_snapshot(volume, "unit-train-snap", data_dir, "runs/train-snap",
                                   {"run": "train-snap", "dataset_version": "aaaa"})
    content = Path(ref.location) / "content"
    assert ref.ready and ref.lineage["run"] == "train-snap" and ref.lineage["content"]["linked"] > 0
    images = list((content / data_dir).rglob("*.jpg"))
    assert images and all(image.stat().st_nlink >= 2 for image in images)  # hard links, no copies
    copied = content / "runs" / "train-snap" / "metrics.jsonl"
    assert copied.stat().st_nlink == 1  # a copy: the run may append to its own file later
    assert copied.stat().st_mode & 0o222 == 0  # read-only
    assert not (content / data_dir / "cache").exists()  # regenerable caches stay out

    (run_dir / "metrics.jsonl").write_text("changed afterwards\n")
    assert copied.read_text() == '{"event": "done"}\n'
    again = platform.create_snapshot(volume, "unit-train-snap", data_dir, "runs/train-snap",
                                     {"run": "other", "dataset_version": "aaaa"})
    assert again.lineage["run"] == "train-snap"  # adopted, not overwritten
    # The same name for a run on other data (a run key reused after a new drop) is not this run's snapshot.
    with pytest.raises(FileExistsError, match="already exists with dataset version aaaa, but this run trained on "
                                              "version bbbb"):
        platform.create_snapshot(volume, "unit-train-snap", data_dir, "runs/train-snap",
                                 {"run": "train-snap", "dataset_version": "bbbb"})
    assert [s.name for s in platform.list_snapshots()] == ["unit-train-snap"]

    restored = platform.restore_snapshot("unit-train-snap", "unit-copy")
    assert restored.created and (Path(restored.location) / "runs" / "train-snap" / "model.pt").read_bytes() == \
        b"weights"
    assert os.access(Path(restored.location) / "runs" / "train-snap" / "metrics.jsonl", os.W_OK)
    assert not platform.restore_snapshot("unit-train-snap", "unit-copy").created
    with pytest.raises(FileExistsError, match="choose a new volume name"):
        platform.restore_snapshot("unit-train-snap", "unit")
    with pytest.raises(KeyError, match="known: unit-train-snap"):
        platform.restore_snapshot("missing", "elsewhere")


def test_files_outside_the_volume_are_refused(prepared: tuple) -> None:
    platform, volume, _ = prepared
    with pytest.raises(ValueError, match="leaves volume"):
        platform.read_file(volume, "../../etc/passwd")
    with pytest.raises(FileNotFoundError, match="does not exist on volume 'unit'"):
        platform.read_file(volume, "runs/none/metrics.jsonl")


def test_platforms_load_by_block_name(prefect_server: dict, tmp_path: Path) -> None:
    LocalPlatform(home=str(tmp_path / "elsewhere")).save("unit-saved", overwrite=True)
    loaded = load_platform("unit-saved")
    assert isinstance(loaded, LocalPlatform) and loaded.home_dir() == tmp_path / "elsewhere"
    assert isinstance(load_platform("laneflow-local-platform/unit-saved"), LocalPlatform)
    assert isinstance(load_platform("local"), LocalPlatform)  # works with nothing saved
    with pytest.raises(ValueError, match="no platform block named 'nowhere'"):
        load_platform("nowhere")


def test_concurrent_submits_start_one_job(prepared: tuple) -> None:
    platform, volume, data_dir = prepared
    spec = long_spec(volume, data_dir, "train-race")
    handles: list = []
    threads = [threading.Thread(target=lambda: handles.append(platform.submit_training(spec))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(handle.adopted for handle in handles) == [False, True, True, True]
    assert platform.cancel_training(spec.job_name, volume)
