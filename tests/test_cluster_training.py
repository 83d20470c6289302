"""Training as an MPIJob on the emulated cluster: a crash fails it with the launcher's log and every pod's
exit code, an operator refusal fails the wait fast, events arrive once across log rotations and cut
streams, evicted workers make it resumable, and an MPIJob of that name that is not ours is refused
(tasks/platforms/cluster/training.py)."""

from __future__ import annotations

import json
import re
import time

import pytest

from tasks.platforms import ClusterPlatform, TrainingFailed, TrainingInterrupted, VolumeRef
from tasks.platforms.cluster.training import mpijob_body
from tests.cluster import Cluster
from tests.cluster_platform_helpers import (
    client_apis,
    cluster_platform,
    create_rwo_claim,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    spec_for,
)

pytestmark = pytest.mark.slow


def test_a_rank_that_crashes_fails_training_with_the_launcher_log_and_every_pod_exit_code(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """A real failure, as users meet it: a /dev/shm too small for the loader workers' shared memory (the
    worker pods' ``shm_size``). The rank crashes, mpirun names it and its exit code, the launcher's pod keeps
    its log and exit code (restartPolicy Never), and nothing is retried."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, shm_size="64Ki")
    handle = platform.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2, num_workers="2"))
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    message = str(failed.value) + "\n".join(failed.value.log_tail)
    assert "training failed with exit code 1 on rank" in message, message
    assert "shared memory" in message, message  # PyTorch's own words, from the rank's log
    # restartPolicy Never on the launcher: its failed pod stays, with its exit code; the operator's reason
    # names the launcher Job's ("BackoffLimitExceeded/<pod reason>"). That Job replaces launchers removed by a
    # drain (tasks.k8s.manifests.LAUNCHER_REPLACEMENTS), but not this one: laneflow saw it fail on its own within
    # the Job controller's back-off and told the Job to start no other.
    assert "train-0123456789ab-launcher-" in message and "Error (exit 1)" in message
    assert "BackoffLimitExceeded/" in message
    launchers = [event for event in cluster.objects["events"].values()
                 if event["reason"] == "Scheduled" and "-launcher-" in event["involvedObject"]["name"]]
    assert len(launchers) == 1, launchers
    assert all(job["spec"]["template"]["spec"]["restartPolicy"] == "Never" for job in cluster.objects["jobs"].values()
               if job["metadata"]["name"].endswith("-launcher"))


def test_operator_refusal_fails_the_wait_fast_with_its_message(emulator: tuple) -> None:
    """A job the operator refuses gets a Warning event and no condition: the wait reports it, not a timeout."""
    emu, cluster = emulator
    platform = cluster_platform(emu)
    platform.ensure_volume("data")
    spec = spec_for("data")
    body = mpijob_body(platform, spec)  # our job as an earlier version of laneflow might have sent it
    body["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    _, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)
    handle = platform.submit_training(spec)  # adopted: it carries this run's labels
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"refused MPIJob train-0123456789ab: Found validation errors: "
                                             r"spec.mpiReplicaSpecs\[Launcher\].replicas: Invalid value: 2: must be 1"):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    assert time.monotonic() - started < 60
    assert "conditions" not in (cluster.objects["mpijobs"][("lanes", "train-0123456789ab")].get("status") or {})


def test_training_events_arrive_exactly_once_across_log_rotations_and_reconnects(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    cluster.log_max_bytes = 1500  # the kubelet rotates the launcher's log several times
    cluster.cut_streams_after_lines = 9  # and every log stream is cut after 9 lines
    events: list[dict] = []
    logs: list[str] = []
    # The row-anchor model: training any registered model across pods is the same MPIJob (training.models).
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="3", log_every="1", model="ufld")
    handle = platform.submit_training(spec)
    outcome = platform.wait_for_training(handle, events.append, logs.append, timeout_s=600)
    assert outcome.steps == 6 and outcome.eval["split"] == "val"  # a gap at the end is read from the record
    saved = json.loads((cluster.claim_dir("lanes", volume.name) / spec.run_dir / "config.json").read_text())
    assert (saved["model_name"], saved["world_size"]) == ("ufld", 2)
    (launcher_log,) = [log for (_, pod), log in cluster.logs.items() if "-launcher-" in pod]
    assert launcher_log.rotations >= 2
    recorded = [json.loads(line) for line in
                (cluster.claim_dir("lanes", volume.name) / spec.run_dir / "metrics.jsonl").read_text().splitlines()]
    # Rank 0's events as the kubelet stamped them in the launcher's log (OpenMPI's tag, read independently).
    stamped = [(stamp, json.loads(match[1])) for stamp, text in launcher_log.lines
               if (match := re.match(r'^\[\d+,0\]<stdout>:(\{"event".*\})', text))]
    assert [event for _, event in stamped if event["event"] != "done"] == recorded
    # Every line at most once and in order; one is missing only where the kubelet rotated it away while the
    # platform reconnected (a new stream reads only the current file), inside a gap the platform reported.
    gaps = [(m[1], m[2]) for line in logs if (m := re.search(r"written after (\S+) and before (\S+) cannot", line))]
    expected = [event for stamp, event in stamped if not any(after < stamp < before for after, before in gaps)]
    assert events == expected
    # horovodrun --hostfile ran mpirun (OpenMPI's tags on every line), which reached both workers' sshd, logged in
    # as laneflow's user (never root: sshd allows no one else), as whom the ranks ran.
    launcher_text = "".join(text for _, text in launcher_log.lines)
    assert '[1,0]<stdout>:{"event": "step"' in launcher_text and "<stdout>:" in launcher_text
    for worker in ("train-0123456789ab-worker-0", "train-0123456789ab-worker-1"):  # deleted now (cleanPodPolicy)
        kept = cluster.root / "pods" / "lanes" / worker / "c0" / "output.log"
        assert "Accepted publickey for laneflow" in kept.read_text()
    # The launcher was created only once both workers were Ready (else horovodrun's SSH check fails).
    (job,) = cluster.objects["mpijobs"].values()
    assert job["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"


def test_evicted_workers_make_training_resumable(emulator: tuple,
                                                 prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    evicted: list[str] = []

    def evict_after_first_checkpoint(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if '"event": "checkpoint"' in line and not evicted:
            evicted.append(pod)
            cluster.evict(namespace, "train-0123456789ab-worker-0")

    cluster.on_log_line = evict_after_first_checkpoint
    spec = spec_for(volume.name, data_dir=data_dir, epochs="2", checkpoint_every="1")
    with pytest.raises(TrainingInterrupted, match="MPIJobEvicted: 1/1 workers are evicted"):
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    outcome = platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None,
                                         timeout_s=600)  # what the task's retry does: replace, resume
    assert evicted and outcome.resumed_from >= 1 and outcome.steps == 8


def test_an_mpijob_of_that_name_that_is_not_ours_is_refused(emulator: tuple) -> None:
    emu, _ = emulator
    _, custom = client_apis(emu)
    # The stranger's image exists nowhere: its pods cannot pull it and nothing runs.
    stranger = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "train-0123456789ab"},
                "spec": {"mpiReplicaSpecs": {
                    "Launcher": {"replicas": 1, "template": {"metadata": {"labels": {}}, "spec": {"containers": [
                        {"name": "l", "image": "x", "command": ["true"]}]}}},
                    "Worker": {"replicas": 1, "template": {"metadata": {"labels": {}}, "spec": {
                        "containers": [{"name": "w", "image": "x"}],
                        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}}}}}}
    create_rwo_claim(emu, "c")
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", stranger)
    with pytest.raises(FileExistsError, match="was not created by laneflow"):
        cluster_platform(emu).submit_training(spec_for("c"))
