"""Cluster failures as users meet them (issue 19), against the emulated cluster whose pods really run:
a stage run again after its cause was fixed runs again, and a stage past its deadline stops what it
started and is not retried."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.platforms import StageDeadlineExceeded
from tasks.retry import is_transient
from tests.cluster.network import node_address
from tests.cluster.runtime import pod_runtime_missing
from tests.http_server import Fault, RunningServer
from tests.k8s_emulator import Cluster, KubernetesEmulator
from tests.test_cluster_platform import cluster_platform
from training.data.sources import Artifact


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[tuple[KubernetesEmulator, Cluster]]:
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    emulator = KubernetesEmulator(tmp_path / "cluster")
    with emulator as cluster:
        yield emulator, cluster


def test_a_failed_prepare_job_is_replaced_when_the_stage_runs_again_after_the_fix(
        emulator: tuple, synthetic_archive: tuple[Path, str]) -> None:
    """README's advice after a failed dataset stage is "fix the cause, run again": the failed Job (kept a
    day by ttlSecondsAfterFinished) must not answer the second run with its old log."""
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    archive, sha256 = synthetic_archive
    logs: list[str] = []
    with RunningServer(host=node_address()) as server:  # the mirror does not have the file yet: 404
        artifact = Artifact(server.url(archive.name), sha256)
        with pytest.raises(RuntimeError, match="failed; its log ends"):
            platform.prepare_dataset(volume, [artifact], logs.append)
        server.files[archive.name] = archive.read_bytes()  # the cause is fixed
        summary = platform.prepare_dataset(volume, [artifact], logs.append)
    assert summary["dataset_dir"].startswith("datasets/")
    dataset = cluster.claim_dir("lanes", volume.name) / summary["dataset_dir"]
    assert (dataset / "seg_label" / "list" / "train_gt.txt").exists()
    assert any("failed in an earlier attempt; replacing it" in line for line in logs)
    (job,) = cluster.objects["jobs"].values()  # the replacement, succeeded
    assert job["status"].get("succeeded") == 1


def test_a_stage_past_its_deadline_deletes_its_job_and_is_not_retried(
        emulator: tuple, synthetic_archive: tuple[Path, str]) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu, prepare_deadline_s=8)
    volume = platform.ensure_volume("data")
    archive, sha256 = synthetic_archive
    with RunningServer(host=node_address()) as server:
        server.files[archive.name] = archive.read_bytes()
        server.faults.append(Fault("slow", delay=60))  # the download crawls: 64 KiB a minute
        with pytest.raises(StageDeadlineExceeded, match=r"did not finish within 8 s .*it was deleted") as caught:
            platform.prepare_dataset(volume, [Artifact(server.url(archive.name), sha256)], lambda _: None)
    assert not is_transient(caught.value)  # the task's retry policy does not run it again for as long
    assert cluster.count("jobs") == 0 and cluster.count("pods") == 0


def test_a_restore_is_sized_from_its_snapshot_when_the_volume_was_grown(emulator: tuple) -> None:
    """After README's advice to grow a full volume, the block's volume_size is smaller than the volume's
    snapshots; the CSI provisioner refuses a claim smaller than a snapshot's restoreSize."""
    emu, cluster = emulator
    grown = cluster_platform(emu, volume_size="3Gi")
    volume = grown.ensure_volume("data")
    (cluster.claim_dir("lanes", "data") / "runs").mkdir()
    (cluster.claim_dir("lanes", "data") / "runs" / "model.pt").write_bytes(b"weights")
    snapshot = grown.wait_for_snapshot(grown.create_snapshot(volume, "data-train-0123456789ab", "datasets/x",
                                                             "runs", {"run": "train-0123456789ab"}), timeout_s=60)
    platform = cluster_platform(emu, volume_size="1Gi")  # the block as it was before the volume grew
    restored = platform.restore_snapshot(snapshot.name, "restored")
    platform.ensure_shared_access(restored)  # waits until the claim is bound
    claim = cluster.objects["persistentvolumeclaims"][("lanes", "restored")]
    assert claim["status"]["phase"] == "Bound" and claim["status"]["capacity"]["storage"] == "3Gi"
    assert (cluster.claim_dir("lanes", "restored") / "runs" / "model.pt").read_bytes() == b"weights"
    assert not [e for e in cluster.events_for("restored") if e["reason"] == "ProvisioningFailed"]
