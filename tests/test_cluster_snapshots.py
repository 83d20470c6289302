"""The cluster platform's VolumeSnapshots: an error the snapshot controller clears is waited out, one it
keeps reporting fails the wait (tasks/platforms/cluster/snapshots.py)."""

from __future__ import annotations

import json
import threading

import pytest

from tests.cluster_platform_helpers import cluster_platform

pytestmark = pytest.mark.slow


def test_a_snapshot_error_that_clears_is_waited_out_and_one_that_persists_fails(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    cluster.snapshot_conflicts = 3  # "the object has been modified" three times, then the controller succeeds
    ref = platform.wait_for_snapshot(platform.create_snapshot(volume, "data-s1", "datasets/x", "runs/r", {"run": "r"}),
                                     timeout_s=60)
    assert ref.ready
    stored = cluster.objects["volumesnapshots"][("lanes", "data-s1")]
    assert stored["status"]["readyToUse"] is True and "error" not in stored["status"]
    assert any("the object has been modified" in e["message"] for e in cluster.events_for("data-s1"))
    cluster.snapshot_error = "Failed to check and update snapshot content: rpc error: code = Internal"
    pending = platform.create_snapshot(volume, "data-s2", "datasets/x", "runs/r", {"run": "r"})
    with pytest.raises(RuntimeError, match="still reports 'Failed to check and update snapshot content"):
        platform.wait_for_snapshot(pending, timeout_s=2)


def test_a_snapshot_of_a_volume_a_training_writes_to_meanwhile_becomes_ready_with_whole_files(
        emulator: tuple) -> None:
    """A run snapshots the volume while another run beside it writes checkpoints (a temporary file renamed
    over the last). The emulator copies the folder where the storage snapshots at one instant; a temporary
    file gone mid-copy failed the copy and the snapshot never got ready (a CI run waited 600 s). Now it is
    left out, and every checkpoint in the snapshot is whole."""
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    namespace, claim = volume.location.split("/")
    with cluster.lock:
        runs = cluster.claim_dir(namespace, claim) / "runs" / "beside"
    runs.mkdir(parents=True)
    for n in range(300):
        (runs / f"epoch-{n}.json").write_text(json.dumps({"epoch": n}))
    stop = threading.Event()

    def checkpoint() -> None:  # as training/checkpoints.py writes: a temporary file renamed over the last
        epoch = 0
        while not stop.is_set():
            temporary = runs / f".latest.{epoch}.tmp"
            temporary.write_text(json.dumps({"epoch": epoch, "weights": "w" * 4096}))
            temporary.replace(runs / "latest.json")
            epoch += 1

    writer = threading.Thread(target=checkpoint, daemon=True)
    writer.start()
    try:
        refs = [platform.wait_for_snapshot(platform.create_snapshot(volume, f"data-w{n}", "datasets/x", "runs/r",
                                                                    {"run": "r"}), timeout_s=120)
                for n in range(4)]
    finally:
        stop.set()
        writer.join()
    assert all(ref.ready for ref in refs)
    for n in range(4):
        copied = cluster.root / "snapshots" / namespace / f"data-w{n}" / "runs" / "beside"
        assert json.loads((copied / "latest.json").read_text())["weights"] == "w" * 4096
        assert len(list(copied.glob("epoch-*.json"))) == 300
