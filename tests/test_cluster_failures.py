"""Cluster failures as users meet them (issue 19), against the emulated cluster whose pods really run:
a stage run again after its cause was fixed runs again, and a stage past its deadline stops what it
started and is not retried."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tasks.k8s.diagnose import PodProblem, ProblemClock, pod_problems
from tasks.k8s.manifests import ClusterLayout, render_mpijob
from tasks.platforms import StageBlocked, StageDeadlineExceeded, TrainingFailed
from tasks.platforms.cluster import NamespaceNotFound
from tasks.retry import is_transient
from tests.cluster import KubernetesEmulator
from tests.cluster.network import node_address
from tests.cluster.runtime import memory_limits_missing
from tests.cluster_platform_helpers import DATA_IMAGE, TRAIN_IMAGE, client_apis, cluster_platform, spec_for
from tests.http_server import Fault, RunningServer
from tests.test_cluster_pipeline import needs_kubectl, rendered
from training.data.sources import Artifact


def test_a_failed_prepare_job_is_replaced_when_the_stage_runs_again_after_the_fix(
        emulator: tuple, synthetic_archive: tuple[Path, str]) -> None:
    """The troubleshooting page's advice after a failed dataset stage is "fix the cause, run again": the failed Job
    (kept a day by ttlSecondsAfterFinished) must not answer the second run with its old log."""
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
    cluster.wait_empty("jobs", "pods")


def test_a_restore_is_sized_from_its_snapshot_when_the_volume_was_grown(emulator: tuple) -> None:
    """After the troubleshooting page's advice to grow a full volume, the block's volume_size is smaller than the
    volume's snapshots; the CSI provisioner refuses a claim smaller than a snapshot's restoreSize."""
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


def test_an_image_that_cannot_be_pulled_fails_the_stage_within_the_grace_period_naming_it(
        emulator: tuple, served_archive: tuple[str, str]) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu, pod_problem_grace_s=3)
    platform = platform.model_copy(update={"data_image": "registry.example.org/laneflow-data:typo"})
    volume = platform.ensure_volume("data")
    logs: list[str] = []
    with pytest.raises(StageBlocked) as caught:
        platform.prepare_dataset(volume, [Artifact(*served_archive)], logs.append)
    message = str(caught.value)
    assert re.search(r"pod prepare-data-[0-9a-f]{16}-\w+ is not running \((ErrImagePull|ImagePullBackOff): ", message)
    assert "registry.example.org/laneflow-data:typo" in message and "data_image" in message
    assert any("the stage fails if it lasts 3 s" in line for line in logs)  # said at once, before failing
    assert not is_transient(caught.value)
    cluster.wait_empty("jobs", "pods")  # nothing left pulling


def test_workers_no_node_can_hold_fail_training_naming_the_missing_resource(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu, scheduling_grace_s=2, gpus_per_worker=16)  # a GPU node has 4
    volume = platform.ensure_volume("data")
    handle = platform.submit_training(spec_for(volume.name, workers=16))  # one worker pod of 16 GPUs
    # The two GPU nodes lack room; the system pool's two are not GPU nodes (the block's node selector).
    with pytest.raises(StageBlocked, match=r"Unschedulable: 0/4 nodes are available: 2 Insufficient "
                                           r"nvidia\.com/gpu, 2 node\(s\) didn't match Pod's node affinity/selector\."
                                           r".*lower gpus_per_worker") as caught:
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    assert "train-0123456789ab-worker-" in str(caught.value)
    cluster.wait_empty("mpijobs", "pods")
    scheduling = [e for e in cluster.objects["events"].values() if e["reason"] == "FailedScheduling"]
    assert scheduling and all(e["source"]["component"] == "default-scheduler" for e in scheduling)


def _pod(name: str, *, phase: str = "Pending", waiting: str | None = None, unschedulable: bool = False) -> dict:
    status: dict = {"phase": phase}
    if waiting:
        status["containerStatuses"] = [{"name": "main", "state": {"waiting": {"reason": waiting, "message": "m"}}}]
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
    return {"metadata": {"name": name}, "status": status}


def test_pod_problems_are_read_from_waiting_reasons_and_the_scheduling_condition() -> None:
    pods = [_pod("a", waiting="ContainerCreating"), _pod("b", waiting="ImagePullBackOff"),
            _pod("c", unschedulable=True), _pod("d", phase="Failed", waiting="CrashLoopBackOff"),
            _pod("e", unschedulable=True)]
    scale_up = {"reason": "TriggeredScaleUp", "involvedObject": {"kind": "Pod", "name": "e"}}
    problems = pod_problems(pods, [scale_up])
    assert [(p.pod, p.reason, p.scaling_up) for p in problems] == [
        ("b", "ImagePullBackOff", False), ("c", "Unschedulable", False), ("e", "Unschedulable", True)]
    assert "data_image for the dataset stage" in problems[0].describe() and "gpus_per_worker" in problems[1].describe()


def test_one_failing_pull_is_one_problem_and_a_killed_worker_is_resumable() -> None:
    clock = ProblemClock(grace_s=60, scheduling_grace_s=900, first_seen={})
    assert clock.overdue([PodProblem("a", "ErrImagePull", "")], now=0.0)[0]
    # The kubelet alternates the two reasons of one failing pull: the clock keeps running.
    assert clock.overdue([PodProblem("a", "ImagePullBackOff", "")], now=30.0) == ([], [])
    assert clock.overdue([PodProblem("a", "ErrImagePull", "")], now=61.0)[1]
    killed = {"metadata": {"name": "w", "labels": {"training.kubeflow.org/job-role": "worker"}},
              "status": {"phase": "Failed", "containerStatuses": [
                  {"state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]}}
    crashed = {**killed, "status": {"phase": "Failed", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 255, "reason": "Error"}}}]}}
    assert [p.resumable for p in pod_problems([killed, crashed], [], exited_workers=True)] == [True, False]
    assert pod_problems([killed], []) == []  # a batch Job's failed pod: its Job controller reports it
    unbound = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."}]}}
    (waiting,) = pod_problems([unbound], [])
    assert waiting.patient and "not bound yet" in waiting.describe()


def test_a_problem_fails_only_after_its_grace_and_one_that_clears_starts_over() -> None:
    clock = ProblemClock(grace_s=60, scheduling_grace_s=900, first_seen={})
    pulling, scaling = PodProblem("a", "ErrImagePull", ""), PodProblem("b", "Unschedulable", "", scaling_up=True)
    assert clock.overdue([pulling, scaling], now=0.0) == ([pulling, scaling], [])
    assert clock.overdue([pulling, scaling], now=59.0) == ([], [])
    assert clock.overdue([pulling, scaling], now=60.0) == ([], [pulling])  # the autoscaler gets longer
    assert clock.overdue([scaling], now=100.0) == ([], [])  # the pull succeeded: forgotten
    assert clock.overdue([pulling, scaling], now=101.0) == ([pulling], [])  # failing again: a new clock
    assert clock.overdue([pulling, scaling], now=900.0)[1] == [pulling, scaling]


def test_a_namespace_that_does_not_exist_is_named_with_the_manifests_that_create_it(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu, namespace="perception")
    with pytest.raises(NamespaceNotFound, match=r"namespace 'perception' does not exist .*deployments/base"
                                                r".*deployments/runai"):
        platform.ensure_volume("data")
    assert cluster.count("persistentvolumeclaims") == 0


def test_a_storage_class_that_does_not_exist_fails_the_volume_stage_naming_it(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu, storage_class="premium-anf", pod_problem_grace_s=1)
    volume = platform.ensure_volume("data")
    with pytest.raises(StageBlocked, match=r'persistentvolumeclaim data is not bound \(ProvisioningFailed: '
                                           r'storageclass\.storage\.k8s\.io "premium-anf" not found\); '
                                           r'.*storage_class'):
        platform.ensure_shared_access(volume)
    assert cluster.objects["persistentvolumeclaims"][("lanes", "data")]["status"]["phase"] == "Pending"


def test_the_emulator_refuses_quantities_the_api_server_cannot_parse(tmp_path: Path) -> None:
    """What the block's own check now prevents, refused as the API server refuses it: a core kind's bad
    quantity fails its decoding (400), the MPIJob CRD's schema pattern makes each one a 422 cause."""
    emu = KubernetesEmulator(tmp_path / "k8s")
    with emu as cluster:
        core, custom = client_apis(emu)
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
                 "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "8GB"}}}}
        with pytest.raises(ApiException) as refused:
            core.create_namespaced_persistent_volume_claim("lanes", claim)
        assert refused.value.status == 400
        assert json.loads(refused.value.body)["message"] == (
            'PersistentVolumeClaim in version "v1" cannot be handled as a PersistentVolumeClaim: quantities must '
            "match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
        layout = ClusterLayout(namespace="lanes", image=TRAIN_IMAGE, data_image=TRAIN_IMAGE,
                               storage_class="azure-netapp-files", snapshot_class="csi-anf-snapclass",
                               shm_size="Bogus_Value!")  # a layout never checked as the block is
        job = render_mpijob("train-0123456789ab", layout, "data", "cpu-demo", 1, "datasets/x", "runs/x", {}, {})
        worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
        worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1.2.3"
        with pytest.raises(ApiException) as invalid:
            custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", job)
        assert invalid.value.status == 422
        fields = {cause["field"] for cause in json.loads(invalid.value.body)["details"]["causes"]}
        prefix = "spec.mpiReplicaSpecs.Worker.template.spec"
        assert fields == {f"{prefix}.containers[0].resources.limits.nvidia.com/gpu",
                          f"{prefix}.volumes[1].emptyDir.sizeLimit"}
        assert cluster.count("persistentvolumeclaims") == 0 and cluster.count("mpijobs") == 0


@pytest.mark.parametrize(("broken", "change", "code", "said"), [
    # sshd's privilege separation directory gone: sshd exits at once, saying so.
    ("no-sshd-dir", "RUN rmdir /run/sshd", 255, "Missing privilege separation directory"),
    # the image built without the openssh-server package: the worker's PID 1 (training.mpi_entry) cannot run sshd.
    ("no-openssh-server", "RUN apt-get purge -y openssh-server", 127,
     "laneflow-worker: cannot run /usr/sbin/sshd: No such file or directory"),
])
def test_a_worker_whose_sshd_cannot_start_fails_training_naming_it_instead_of_waiting(
        emulator: tuple, broken: str, change: str, code: int, said: str) -> None:
    """A training image whose workers cannot run sshd: each worker exits at once; the operator waits for Ready
    workers before it creates the launcher, and never replaces them. The wait names the worker and its exit."""
    emu, cluster = emulator
    image = f"registry.example.org/laneflow-train:{broken}"
    cluster.images.derive(image, "train", [change])
    platform = cluster_platform(emu, image=image, pod_problem_grace_s=2)
    volume = platform.ensure_volume("data")
    handle = platform.submit_training(spec_for(volume.name, workers=2))
    # Either the operator never starts the launcher (the workers are gone before both were Ready) and
    # laneflow names the exited worker, or the launcher was created in the moment both ran and fails on
    # ssh: both end the wait at once, naming the worker's exit.
    with pytest.raises((StageBlocked, TrainingFailed), match=rf"train-0123456789ab-worker-\d.*exit (code )?{code}") \
            as caught:
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    worker_log = (cluster.root / "pods" / "lanes" / "train-0123456789ab-worker-0" / "c0" / "output.log").read_text()
    assert said in worker_log, worker_log  # what the worker itself said
    if isinstance(caught.value, StageBlocked):  # laneflow stopped the waiting job; a failed one is kept
        cluster.wait_empty("mpijobs")


def test_training_on_a_claim_that_does_not_exist_fails_naming_the_claim(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu, scheduling_grace_s=2)
    handle = platform.submit_training(spec_for("gone", workers=2))  # the volume was never made (or deleted)
    with pytest.raises(StageBlocked, match=r'Unschedulable: 0/4 nodes are available: persistentvolumeclaim "gone" '
                                           r'not found\..*the pod\'s volume claim does not exist or is not bound'):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    cluster.wait_empty("mpijobs")


def test_a_volume_the_node_cannot_mount_fails_the_stage_naming_the_mount_error(
        emulator: tuple, served_archive: tuple[str, str]) -> None:
    """An ANF export policy without the node subnet: the kubelet's NFS mount is refused, the pod stays
    ContainerCreating (no waiting reason says more) and only its FailedMount events tell why."""
    emu, cluster = emulator
    platform = cluster_platform(emu, pod_problem_grace_s=3)
    volume = platform.ensure_volume("data")
    platform.ensure_shared_access(volume)
    cluster.nfs_refused.add(("lanes", "data"))
    logs: list[str] = []
    with pytest.raises(StageBlocked) as caught:
        platform.prepare_dataset(volume, [Artifact(*served_archive)], logs.append)
    message = str(caught.value)
    assert re.search(r"pod prepare-data-[0-9a-f]{16}-\w+ is not running \(FailedMount: MountVolume\.SetUp failed "
                     r'for volume "pvc-[\w-]+" : .*access denied by server', message)
    assert "export policy" in message
    assert any("the stage fails if it lasts 3 s" in line for line in logs)
    assert not is_transient(caught.value)
    cluster.wait_empty("jobs", "pods")
    (event,) = [e for e in cluster.objects["events"].values() if e["reason"] == "FailedMount"]
    assert event["type"] == "Warning" and event["source"]["component"] == "kubelet"


def test_a_dataset_stage_killed_for_memory_is_reported_as_oomkilled_and_not_retried(
        emulator: tuple, served_archive: tuple[str, str]) -> None:
    """A namespace LimitRange gives containers without limits a default memory limit (LimitRanger); the
    dataset stage's Python outgrows it and the kernel's OOM killer ends it without a word in its log."""
    if missing := memory_limits_missing():
        pytest.skip(missing)
    emu, cluster = emulator
    cluster.load([{"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "small", "namespace": "lanes"},
                   "spec": {"limits": [{"type": "Container", "default": {"memory": "40Mi"}}]}}])
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    with pytest.raises(StageBlocked) as caught:
        platform.prepare_dataset(volume, [Artifact(*served_archive)], lambda _: None)
    message = str(caught.value)
    assert re.search(r"job lanes/prepare-data-[0-9a-f]{16} failed: pod prepare-data-[0-9a-f]{16}-\w+ is not "
                     r"running \(OOMKilled: exit code 137 \(OOMKilled; limits\.memory 40Mi\)\); .*LimitRange", message)
    assert "sigprocmask" not in message  # the pod's log is the container's output only
    assert not is_transient(caught.value)


def test_a_container_that_keeps_crashing_is_in_crashloopbackoff_as_laneflow_reads_it(emulator: tuple) -> None:
    """restartPolicy OnFailure (laneflow's pods use Never; a user's changed manifest may not): the kubelet
    waits longer before each restart, the container Waiting in CrashLoopBackOff, BackOff events counted."""
    emu, cluster = emulator
    core, _ = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    cluster_platform(emu)  # the project's images exist
    batch.create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "crashes"},
        "spec": {"backoffLimit": 6, "template": {"spec": {"restartPolicy": "OnFailure", "containers": [
            {"name": "main", "image": DATA_IMAGE, "command": ["python", "-c", "raise SystemExit(3)"]}]}}}})
    pod = _wait_for_pod(core, "job-name=crashes", lambda p: _waiting_reason(p) == "CrashLoopBackOff"
                        and p["status"]["containerStatuses"][0]["restartCount"] >= 2)
    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert re.fullmatch(r"back-off \d+s restarting failed container=main pod=crashes-\w+_lanes\(.+\)",
                        status["state"]["waiting"]["message"])
    (problem,) = pod_problems([pod], [])
    assert problem.reason == "CrashLoopBackOff" and "its log says why" in problem.describe()
    pod = _wait_for_pod(core, "job-name=crashes", lambda p: p["status"]["containerStatuses"][0]["restartCount"] >= 3)
    (backoff,) = [e for e in cluster.events_for(pod["metadata"]["name"]) if e["reason"] == "BackOff"]
    assert backoff["count"] >= 2  # one event, aggregated as the recorder does
    batch.delete_namespaced_job("crashes", "lanes", propagation_policy="Background")


def test_a_secret_volume_that_does_not_exist_keeps_the_pod_creating_with_failedmount(emulator: tuple) -> None:
    """A missing Secret in a volume is the kubelet's FailedMount (the pod waits, retried), not the
    CreateContainerConfigError of a missing env reference; created later, the pod starts."""
    emu, cluster = emulator
    core, _ = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    cluster_platform(emu)
    batch.create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "needs-keys"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "volumes": [{"name": "keys", "secret": {"secretName": "keys"}}],
            "containers": [{"name": "main", "image": DATA_IMAGE, "volumeMounts": [{"name": "keys", "mountPath": "/k"}],
                            "command": ["python", "-c", "print(open('/k/token').read())"]}]}}}})
    pod = _wait_for_pod(core, "job-name=needs-keys", lambda p: any(
        e["reason"] == "FailedMount" for e in cluster.events_for(p["metadata"]["name"])))
    assert _waiting_reason(pod) == "ContainerCreating" and pod["status"]["phase"] == "Pending"
    events = [core.api_client.sanitize_for_serialization(e) for e in
              core.list_namespaced_event("lanes", field_selector="involvedObject.kind=Pod").items]
    (problem,) = pod_problems([pod], events)
    assert problem.reason == "FailedMount"
    assert 'MountVolume.SetUp failed for volume "keys" : secret "keys" not found' in problem.message
    assert "create it in the namespace" in problem.describe()
    core.create_namespaced_secret("lanes", {"metadata": {"name": "keys"}, "stringData": {"token": "s3cret"}})
    _wait_for_pod(core, "job-name=needs-keys", lambda p: p["status"]["phase"] == "Succeeded")
    assert "s3cret" in core.read_namespaced_pod_log(pod["metadata"]["name"], "lanes")


def mpi_pod(name: str, uid: str, ready: str, state: dict, role: str = "worker") -> dict:
    return {"metadata": {"name": name, "uid": uid, "labels": {"training.kubeflow.org/job-role": role}},
            "spec": {"nodeName": "gpu-b"},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": ready, "lastTransitionTime": "2026-12-03T10:00:00Z"}],
                "containerStatuses": [{"name": role, "ready": "running" in state, "state": state}]}}


def test_an_mpi_pod_whose_node_went_silent_is_a_resumable_problem_and_a_ready_or_ended_one_is_not() -> None:
    """The node lifecycle controller's MarkPodsNotReady turns only the Ready condition False; the containers
    still read running, as no kubelet reports their end."""
    silent = mpi_pod("job-worker-1", "u1", "False", {"running": {}})
    (problem,) = pod_problems([silent], [], exited_workers=True)
    assert pod_problems([silent], [], exited_workers=True, training_alive=True) == []  # its peers still talk
    assert (problem.reason, problem.resumable) == ("NodeNotReady", True)
    assert problem.message == "node gpu-b stopped reporting since 2026-12-03T10:00:00Z", problem.message
    assert "resumes from its last checkpoint" in problem.describe()
    launcher = mpi_pod("job-launcher-x", "u2", "False", {"running": {}}, role="launcher")
    assert [p.reason for p in pod_problems([launcher], [], exited_workers=True)] == ["NodeNotReady"]
    ready = mpi_pod("job-worker-0", "u3", "True", {"running": {}})
    ended = mpi_pod("job-worker-0", "u3", "False", {"terminated": {"exitCode": 0}})
    # The kubelet's own not-Ready says why: a sidecar's failing readiness probe, say.
    probed = mpi_pod("job-worker-0", "u3", "False", {"running": {}})
    probed["status"]["conditions"][0]["reason"] = "ContainersNotReady"
    probed["status"]["containerStatuses"].append({"name": "proxy", "ready": False, "state": {"running": {}}})
    assert pod_problems([ready, ended, probed], [], exited_workers=True) == []
    assert pod_problems([silent], [], exited_workers=False) == []  # a data Job: its controller replaces it


def test_a_worker_replaced_once_the_launcher_started_is_a_resumable_problem_but_not_before() -> None:
    clock = ProblemClock(grace_s=60, scheduling_grace_s=900, first_seen={})
    running = {"running": {}}
    launcher = mpi_pod("job-launcher-x", "l", "True", running, role="launcher")
    created = {**launcher, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "launcher", "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    assert clock.replacements([mpi_pod("job-worker-1", "first", "True", running)]) == set()
    # Re-created before the launcher's container started (WaitForWorkersReady): part of the start.
    assert clock.replacements([mpi_pod("job-worker-1", "second", "True", running), created]) == set()
    assert clock.replacements([mpi_pod("job-worker-1", "second", "True", running), launcher]) == set()
    # Replaced under the launcher: for good, whatever the new pod (or the MPIJob's conditions) do next.
    assert clock.replacements([mpi_pod("job-worker-1", "third", "False", {"waiting": {}}), launcher]) == \
        {"job-worker-1"}
    assert clock.replacements([]) == {"job-worker-1"}
    (problem,) = pod_problems([mpi_pod("job-worker-1", "third", "True", running)], [], exited_workers=True,
                              replaced=clock.replacements([]))
    assert (problem.reason, problem.resumable) == ("WorkerReplaced", True)
    # One last seen being stopped gracefully (evicted, drained: its ranks were told to checkpoint) is not lost.
    stopping = mpi_pod("job-worker-0", "old", "True", running)
    assert clock.replacements([stopping, launcher]) == {"job-worker-1"}
    stopping["metadata"]["deletionTimestamp"] = "2026-12-03T10:00:30Z"
    assert clock.replacements([stopping, launcher]) == {"job-worker-1"}
    assert clock.replacements([mpi_pod("job-worker-0", "new", "True", running), launcher]) == {"job-worker-1"}


def test_a_worker_killed_for_memory_is_not_resumable() -> None:
    """Exit 137 is SIGKILL, which a preemption also sends; OOMKilled says it was the worker's own memory."""
    oom = {"metadata": {"name": "w", "labels": {"training.kubeflow.org/job-role": "worker"}},
           "status": {"phase": "Failed", "containerStatuses": [
               {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}
    (problem,) = pod_problems([oom], [], exited_workers=True)
    assert problem.reason == "OOMKilled" and not problem.resumable and "limits.memory" in problem.describe()
    assert "no memory limit: the node ran out of memory" in problem.message  # no limit: the node's memory


def _waiting_reason(pod: dict) -> str | None:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason")


def _wait_for_pod(core: kubernetes.client.CoreV1Api, selector: str, ready: Callable[[dict], bool]) -> dict:
    """The first pod of ``selector`` once ``ready`` holds for it, as the API answers it (camelCase dicts)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for pod in core.list_namespaced_pod("lanes", label_selector=selector).items:
            as_dict = core.api_client.sanitize_for_serialization(pod)
            if ready(as_dict):
                return as_dict
        time.sleep(0.2)
    raise AssertionError(f"no pod of {selector} reached the awaited state in 120 s")


def test_a_mount_failure_counts_only_for_its_own_pod_and_only_until_the_kubelet_got_past_its_volumes() -> None:
    """Events outlive pods (an hour): a FailedMount of an earlier pod of the same name, or one the kubelet
    got past (a transient failure, then the image pull began), is not a problem of the pod now."""
    def event(reason: str, uid: str, at: str, kind: str = "Normal") -> dict:
        return {"reason": reason, "type": kind, "lastTimestamp": at, "message": f"{reason} {uid}",
                "involvedObject": {"kind": "Pod", "name": "w-0", "uid": uid}}
    pod = {"metadata": {"name": "w-0", "uid": "new"}, "spec": {"nodeName": "n"},
           "status": {"phase": "Pending",
                      "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    earlier_pod = event("FailedMount", "old", "2026-12-01T10:00:00Z", "Warning")
    assert pod_problems([pod], [earlier_pod]) == []
    failing = event("FailedMount", "new", "2026-12-01T10:05:00Z", "Warning")
    (problem,) = pod_problems([pod], [earlier_pod, failing])
    assert problem.reason == "FailedMount" and problem.message == "FailedMount new"
    assert "export policy" in problem.describe()
    assert pod_problems([pod], [failing, event("Pulling", "new", "2026-12-01T10:05:03Z")]) == []


def test_an_mpijob_no_operator_answers_fails_within_the_blocks_grace_naming_what_to_check(emulator: tuple) -> None:
    """The MPIJob CRD installed but no operator running (or one watching other namespaces): the job is stored
    and nothing ever sets its status. The wait fails after operator_grace_s, not after 24 hours."""
    emu, cluster = emulator
    cluster.mpi_operator_installed = False
    platform = cluster_platform(emu, operator_grace_s=2)
    volume = platform.ensure_volume("data")
    handle = platform.submit_training(spec_for(volume.name, workers=2))
    with pytest.raises(StageBlocked) as blocked:
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    message = str(blocked.value)
    assert "got no status from the MPI operator" in message and "no operator is handling it" in message, message
    assert "watches namespace lanes" in message and "the job was deleted" in message, message
    cluster.wait_empty("mpijobs")


@needs_kubectl
def test_an_mpijob_whose_pods_the_operator_cannot_create_fails_naming_its_warning(emulator: tuple) -> None:
    """The block names a service account the namespace does not have: the ServiceAccount admission plugin
    refuses every worker, and the operator says so in a Warning ("worker pod created failed: ...") each time it
    tries again. Once that outlasts operator_grace_s the stage fails with the operator's words and the fix."""
    emu, cluster = emulator
    cluster.load(rendered("base"))  # an administrator's cluster: admission and RBAC as shipped
    platform = cluster_platform(emu, namespace="laneflow", service_account="trainer-nobody-made",
                                operator_grace_s=2)
    volume = platform.ensure_volume("data")
    logged: list[str] = []
    handle = platform.submit_training(spec_for(volume.name, workers=2))
    with pytest.raises(StageBlocked) as blocked:
        platform.wait_for_training(handle, lambda _: None, logged.append, timeout_s=600)
    message = str(blocked.value)
    assert "the MPI operator cannot create MPIJob train-0123456789ab's pods (worker pod created failed: pods " \
           '"train-0123456789ab-worker-0" is forbidden: error looking up service account ' \
           'laneflow/trainer-nobody-made: serviceaccount "trainer-nobody-made" not found' in message, message
    assert "create the service account the block names" in message, message
    assert any(line.startswith("warning from the MPI operator: MPIJobFailed: worker pod created failed")
               for line in logged), logged
    cluster.wait_empty("mpijobs")


def test_a_retry_that_finds_its_mpijob_still_being_deleted_waits_it_out_and_submits_afresh(emulator: tuple) -> None:
    """An earlier attempt deleted its MPIJob, which is still terminating (a finalizer holds it: another
    controller's clean-up). The retry must not adopt it as live — it would vanish under the wait — but wait
    until it is gone and create the job anew."""
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    spec = spec_for(volume.name, workers=2)
    first = platform.submit_training(spec)
    _, custom = client_apis(emu)
    custom.patch_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name,
                                          {"metadata": {"finalizers": ["example.org/archive-logs"]}})
    platform.cancel_training(spec.job_name, volume)  # what the earlier attempt did on its way out
    held = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert held["metadata"].get("deletionTimestamp"), held["metadata"]

    def release() -> None:  # the other controller finishes its clean-up a moment later
        time.sleep(2)
        custom.patch_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name,
                                              {"metadata": {"finalizers": None}})
    releasing = threading.Thread(target=release)
    releasing.start()
    try:
        second = platform.submit_training(spec)
    finally:
        releasing.join()
    assert not second.adopted and second.details["uid"] != first.details["uid"], (first, second)
    job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert job["metadata"]["uid"] == second.details["uid"] and not job["metadata"].get("deletionTimestamp")
    platform.cancel_training(spec.job_name, volume)
    cluster.wait_empty("mpijobs")
