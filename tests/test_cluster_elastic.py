"""Elastic Horovod on the emulated cluster, for real: the training image's horovodrun in the launcher pod polls the
MPI operator's ``discover_hosts.sh`` (the ConfigMap, refreshed in the pod on the kubelet's sync), reaches the
workers' real sshd over ssh and runs Gloo ranks there. A worker pod deleted through the API mid-training: the
run goes on with the other worker in the same MPIJob, the operator's replacement joins after horovodrun's
cooldown, and the run ends on two workers."""

from __future__ import annotations

import json
import threading

import kubernetes
import pytest

from tasks.platforms import ClusterPlatform, VolumeRef
from tasks.platforms.base import ElasticWorkers
from tests.cluster import Cluster
from tests.cluster_platform_helpers import (
    client_apis,
    cluster_platform,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    spec_for,
)

pytestmark = pytest.mark.slow

COMMIT_EVERY = 5


def delete_a_worker_at(cluster: Cluster, core: kubernetes.client.CoreV1Api, pod: str, step: int,
                       deleted: list[dict]) -> None:
    """Once the launcher logs a training step at ``step`` or later on two workers, delete worker pod ``pod`` as
    ``kubectl delete pod`` does (graceful), recording the step logged before and the pod's uid."""
    def on_line(cluster: Cluster, namespace: str, name: str, line: str) -> None:
        if "-launcher-" not in name or '"event": "step"' not in line or deleted:
            return
        event = json.loads(line[line.index("{"):])
        if event["step"] < step or event.get("workers") != 2:
            return
        uid = cluster.objects["pods"][("lanes", pod)]["metadata"]["uid"]
        deleted.append({"step": event["step"], "uid": uid})
        threading.Thread(target=core.delete_namespaced_pod, args=(pod, "lanes"), daemon=True).start()

    cluster.on_log_line = on_line


def test_an_elastic_job_loses_a_worker_pod_trains_on_and_takes_the_operators_replacement_back(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    emu, cluster = emulator
    cluster.configmap_sync_s = 2.0  # the kubelet's sync (1 min upstream), shortened
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, elastic_cooldown_min_s=2, elastic_cooldown_max_s=30)
    # 8 images, one per step: 4 steps an epoch on two workers, 8 on one; about 60 steps in all.
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="13", batch_size="1", log_every="2",
                    checkpoint_every="1000", elastic="1", commit_every=str(COMMIT_EVERY))
    spec = spec.model_copy(update={"elastic": ElasticWorkers(min_workers=1, max_workers=2,
                                                             commit_every=COMMIT_EVERY)})
    core, custom = client_apis(emu)
    deleted: list[dict] = []
    worker = f"{spec.job_name}-worker-1"
    delete_a_worker_at(cluster, core, worker, 12, deleted)
    events: list[dict] = []
    handle = platform.submit_training(spec)
    uid = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs",
                                              spec.job_name)["metadata"]["uid"]
    outcome = platform.wait_for_training(handle, events.append, lambda _: None, timeout_s=900)
    assert deleted, "the worker was never deleted"
    changes = [event for event in events if event["event"] == "workers"]
    assert changes and changes[0]["workers"] == 1 and changes[0]["lost"] == [f"{worker}.{spec.job_name}.lanes.svc"]
    assert any(change["workers"] == 2 and change["joined"] for change in changes[1:]), changes
    # Told to stop, the leaving rank committed with the other: nothing, at most one commit interval, is redone.
    assert changes[0]["redone_steps"] <= COMMIT_EVERY
    assert deleted[0]["step"] - changes[0]["step"] <= COMMIT_EVERY, (deleted, changes)
    steps = [event for event in events if event["event"] == "step"]
    assert {event["workers"] for event in steps} == {1, 2} and steps[-1]["workers"] == 2
    assert outcome.steps == steps[-1]["step"] and outcome.eval  # the trainer scored it
    # The same MPIJob all along, with one launcher; worker-1 is the operator's new pod of the same name.
    job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert job["metadata"]["uid"] == uid
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} >= {"Succeeded"}
    launchers = [pod for pod in core.list_namespaced_pod(
        "lanes", label_selector=f"training.kubeflow.org/job-name={spec.job_name},"
                                "training.kubeflow.org/job-role=launcher").items]
    assert len(launchers) == 1
    created = [event for event in cluster.objects["events"].values()
               if event["reason"] == "Scheduled" and event["involvedObject"]["name"] == worker]
    assert len(created) == 2, created  # the first worker-1 and its replacement
    scores = platform.evaluate(volume, spec.run_dir, data_dir, "val", lambda _: None)
    assert 0.0 <= scores["accuracy"] <= 1.0
