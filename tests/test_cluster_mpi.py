"""Horovod's MPI launch path, for real: sshd in the workers, ssh and mpirun in the launcher. A rank killed
or preempted under mpirun, a stop request heard by the wait loop, an image without the ssh client settings,
a claim mounted where the trainer does not look."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.platforms import ClusterPlatform, TrainingFailed, TrainingInterrupted, VolumeRef
from tasks.platforms.cluster.training import mpijob_body
from tests.cluster import Cluster
from tests.cluster_platform_helpers import (
    client_apis,
    cluster_platform,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    spec_for,
)
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow


def rank_pids(cluster: Cluster, pod: str) -> list[int]:
    """The trainer processes (MPI ranks) in a worker pod's container."""
    found = []
    for pid in cluster.container_pids("lanes", pod):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.train" in cmdline:
            found.append(pid)
    return found


def signal_a_rank_at_the_first_step(cluster: Cluster, worker: str, signum: int) -> list[int]:
    """Once the launcher logs the first training step, send ``signum`` to the rank in ``worker``."""
    sent: list[int] = []

    def on_line(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if "-launcher-" in pod and '"event": "step"' in line and not sent:
            pids = rank_pids(cluster, worker)
            sent.extend(pids)
            for pid in pids:
                os.kill(pid, signum)

    cluster.on_log_line = on_line
    return sent


def test_a_rank_killed_under_mpirun_fails_the_job_naming_the_rank_and_its_signal(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    killed = signal_a_rank_at_the_first_step(cluster, "train-0123456789ab-worker-1", 9)
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="50", log_every="1")
    with pytest.raises(TrainingInterrupted) as stopped:  # a killed process: the retry resumes it
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert killed, "no rank was found in worker 1"
    assert "a training process was killed by signal 9 on rank 1" in str(stopped.value), str(stopped.value)


def test_a_preempted_rank_under_mpirun_stops_the_job_resumably_and_the_retry_resumes(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """SIGTERM to one rank (a node draining): every rank checkpoints and exits 75, mpirun reports it, the
    wait says preempted; submitting again (the task's retry) replaces the job and resumes from the checkpoint."""
    _, cluster = emulator
    platform, volume, data_dir = prepared
    signalled = signal_a_rank_at_the_first_step(cluster, "train-0123456789ab-worker-1", 15)
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="3", log_every="1", checkpoint_every="1000")
    with pytest.raises(TrainingInterrupted, match="preempted: it checkpointed and can resume"):
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert signalled
    cluster.on_log_line = None
    outcome = platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None,
                                         timeout_s=600)
    assert outcome.resumed_from >= 1 and outcome.steps == 6


def test_a_stop_request_from_the_wait_loop_stops_an_mpijob_after_a_checkpoint_and_it_succeeds(
        prefect_server: dict, emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """A sweep's pruner on a cluster: the wait loop hears the first val score of a 2-worker MPIJob and leaves a
    stop request on the claim (a short Job of its own); both ranks agree to stop, rank 0 checkpoints, mpirun
    exits 0, the MPIJob succeeds, and the outcome says it stopped early and why."""
    from prefect import flow

    from tasks.pipeline import wait_for_training
    from tasks.platforms import TrainingOutcome
    from tasks.pruning import StopVerdict, judged_by

    emu, _ = emulator
    platform, volume, data_dir = prepared
    heard: list[tuple[int, float]] = []

    def judge(step: int, value: float) -> StopVerdict:
        heard.append((step, value))
        return StopVerdict("pruned by the test at the first report", "Pruned")

    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="40", log_every="1", eval_every="2")

    @flow
    def watched() -> TrainingOutcome:  # the task's logs go where a flow run's go
        platform.submit_training(spec)
        return wait_for_training(platform, spec, 600)

    with judged_by(spec.job_name, judge):
        outcome = watched()
    assert [step for step, _ in heard] == [2], heard  # asked once, at the first report
    assert outcome.stopped is not None and outcome.stopped["state"] == "Pruned", outcome
    assert outcome.stopped["reason"] == "pruned by the test at the first report"
    assert 2 < outcome.steps < outcome.total_steps == 80, outcome
    _, custom = client_apis(emu)
    job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in job["status"]["conditions"]), job["status"]
    record = platform.read_file(volume, f"{spec.run_dir}/metrics.jsonl").decode().splitlines()
    events = [json.loads(line)["event"] for line in record]
    assert events[-2:] == ["checkpoint", "stopped"] and "done" not in events, events
    with pytest.raises(FileNotFoundError):  # the run that honoured the request removed it
        platform.read_file(volume, f"{spec.run_dir}/stop-request.json")


def test_an_image_without_the_ssh_client_settings_fails_with_host_key_verification(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str], tmp_path: Path) -> None:
    """What happens with the operator and an image that does not accept the workers' fresh host keys: mpirun's
    plain ssh stops at 'Host key verification failed.' (horovodrun's own check passes: it sets
    StrictHostKeyChecking=no). The shipped image carries deployments/ssh/ssh_config.conf for this."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    dockerfile = (PROJECT_ROOT / "deployments" / "Dockerfile.train").read_text()
    without = "\n".join(line for line in dockerfile.splitlines() if "ssh_config.conf" not in line)
    assert without != dockerfile
    (tmp_path / "Dockerfile.train").write_text(without)
    platform = cluster_platform(emu, image="registry.example.org/laneflow-train:no-ssh-config")
    cluster.images.add("registry.example.org/laneflow-train:no-ssh-config", tmp_path / "Dockerfile.train")
    handle = platform.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2))
    with pytest.raises(TrainingFailed, match="Host key verification failed"):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)


def test_the_workers_see_the_claim_only_where_their_mount_path_says(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """The same job with the claim mounted at /mnt/data instead of /data: the trainer, told /data/..., finds
    no dataset there and refuses (exit 2, not retried)."""
    emu, _ = emulator
    platform, volume, data_dir = prepared
    spec = spec_for(volume.name, data_dir=data_dir, workers=2)
    body = mpijob_body(platform, spec)
    for mount in body["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMounts"]:
        if mount["mountPath"] == "/data":
            mount["mountPath"] = "/mnt/data"
    _, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert "training refused its configuration or data (exit code 2) on rank" in str(failed.value), str(failed.value)
