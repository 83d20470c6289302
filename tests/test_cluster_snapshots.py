"""The cluster platform's VolumeSnapshots: an error the snapshot controller clears is waited out, one it
keeps reporting fails the wait (tasks/platforms/cluster/snapshots.py)."""

from __future__ import annotations

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
