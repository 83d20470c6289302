"""Voluntary disruptions on the emulated cluster as Kubernetes and the MPI operator handle them, asserted
through the real ``kubernetes`` client: the eviction subresource with PodDisruptionBudgets
(``tests/cluster/disruption.py``), the pods of a node listed as ``kubectl drain`` lists them, and the MPI
operator re-creating a deleted worker, leaving the launcher alone when a worker is evicted, and never syncing
a finished job again (``tests/cluster/mpi_operator.py``)."""

from __future__ import annotations

import os
import time
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tasks.platforms.cluster.training import mpijob_body
from tests.cluster_platform_helpers import DATA_IMAGE, client_apis, cluster_platform, spec_for
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
#: How the waits below poll: a pod or controller reacts within a second or two here.
SOON = {"timeout_s": 120, "every_s": 0.2}


def _sleeping_job(name: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"app": "sleeper"}}, "spec": {
                "restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                "containers": [{"name": "main", "image": DATA_IMAGE, "command": ["sleep", "600"]}]}}}}


def _eviction(name: str) -> kubernetes.client.V1Eviction:
    return kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=name, namespace="lanes"))


def test_the_eviction_subresource_honours_disruption_budgets_and_marks_what_it_evicts(emulator: tuple) -> None:
    emu, _ = emulator
    cluster_platform(emu)  # the images
    core, _ = client_apis(emu)
    batch, policy = kubernetes.client.BatchV1Api(core.api_client), kubernetes.client.PolicyV1Api(core.api_client)
    batch.create_namespaced_job("lanes", _sleeping_job("sleeper"))
    def sleepers() -> list:
        return core.list_namespaced_pod("lanes", label_selector="app=sleeper").items

    pod = wait_until("the Job's pod to run", lambda: next((p for p in sleepers() if p.status.phase == "Running"),
                                                          None), **SOON)
    name = pod.metadata.name
    # kubectl drain lists a node's pods by field selector.
    on_node = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={pod.spec.node_name}").items
    assert name in [p.metadata.name for p in on_node]
    with pytest.raises(ApiException) as unsupported:
        core.list_namespaced_pod("lanes", field_selector="spec.hostname=x")
    assert unsupported.value.status == 400 and "field label not supported: spec.hostname" in unsupported.value.body

    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep-one"},
              "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "sleeper"}}}}
    policy.create_namespaced_pod_disruption_budget("lanes", budget)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction(name, "lanes", _eviction(name))
    assert refused.value.status == 429, refused.value.body
    assert "Cannot evict pod as it would violate the pod's disruption budget." in refused.value.body
    assert "The disruption budget keep-one needs 1 healthy pods and has 1 currently" in refused.value.body
    policy.create_namespaced_pod_disruption_budget("lanes", {**budget, "metadata": {"name": "also-keep-one"}})
    with pytest.raises(ApiException) as two:
        core.create_namespaced_pod_eviction(name, "lanes", _eviction(name))
    assert two.value.status == 500 and "more than one PodDisruptionBudget" in two.value.body
    with pytest.raises(ApiException) as mismatch:
        core.create_namespaced_pod_eviction(name, "lanes", _eviction("another-pod"))
    assert mismatch.value.status == 400
    assert "name in URL does not match name in Eviction object" in mismatch.value.body
    assert core.read_namespaced_pod(name, "lanes").metadata.deletion_timestamp is None  # nothing was evicted

    for pdb in ("keep-one", "also-keep-one"):
        policy.delete_namespaced_pod_disruption_budget(pdb, "lanes")
    core.create_namespaced_pod_eviction(name, "lanes", _eviction(name))
    evicted = core.read_namespaced_pod(name, "lanes")
    assert evicted.metadata.deletion_timestamp is not None  # deleted gracefully: SIGTERM to PID 1 first
    assert [(c.type, c.reason, c.message) for c in evicted.status.conditions if c.type == "DisruptionTarget"] == \
        [("DisruptionTarget", "EvictionByEvictionAPI", "Eviction API: evicting")]
    wait_until("the pod to go", lambda: not sleepers(), **SOON)
    # The Job controller counts a pod deleted before it finished as failed: backoffLimit 0 ends the Job.
    job = wait_until("the Job to fail",
                     lambda: (j := batch.read_namespaced_job("sleeper", "lanes")).status.conditions and j, **SOON)
    assert [(c.type, c.reason) for c in job.status.conditions] == [("Failed", "BackoffLimitExceeded")]
    with pytest.raises(ApiException) as gone:
        core.create_namespaced_pod_eviction(name, "lanes", _eviction(name))
    assert gone.value.status == 404


def test_the_mpi_operator_recreates_a_deleted_worker_leaves_the_launcher_on_eviction_and_stops_when_finished(
        emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    body = mpijob_body(platform, spec_for(volume.name, job="ops-0123456789ab", workers=2))
    body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"] = ["sleep", "600"]
    body["spec"]["runPolicy"]["backoffLimit"] = 0  # the launcher's end ends the job: no replacement launcher
    core, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)

    def pod(name: str) -> Any:
        try:
            return core.read_namespaced_pod(name, "lanes")
        except ApiException:
            return None

    def launcher() -> Any:
        pods = core.list_namespaced_pod("lanes", label_selector="training.kubeflow.org/job-role=launcher").items
        return next((p for p in pods if p.status.phase == "Running"), None)

    def conditions() -> dict[str, tuple[str, str]]:
        job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", "ops-0123456789ab")
        return {c["type"]: (c["status"], c["reason"]) for c in job["status"].get("conditions") or []}

    running = wait_until("the launcher to run", launcher, **SOON)
    first = pod("ops-0123456789ab-worker-1")
    core.delete_namespaced_pod("ops-0123456789ab-worker-1", "lanes")
    again = wait_until("the operator to create worker-1 again",
                       lambda: (p := pod("ops-0123456789ab-worker-1")) and p.metadata.uid != first.metadata.uid
                       and p.status.phase == "Running" and p, **SOON)
    assert again.metadata.labels["training.kubeflow.org/replica-index"] == "1"

    cluster.evict("lanes", "ops-0123456789ab-worker-0")  # the kubelet, short of memory
    wait_until("the job marked evicted", lambda: conditions().get("Failed") == ("True", "MPIJobEvicted"), **SOON)
    time.sleep(1)  # time for a wrong operator to act on the launcher
    assert pod(running.metadata.name).status.phase == "Running"  # left to end on its own, as upstream does

    core.delete_namespaced_pod(running.metadata.name, "lanes", grace_period_seconds=0)  # the launcher ends
    wait_until("the job to finish", lambda: custom.get_namespaced_custom_object(
        "kubeflow.org", "v2beta1", "lanes", "mpijobs", "ops-0123456789ab")["status"].get("completionTime"), **SOON)
    wait_until("cleanPodPolicy Running to remove the running worker",
               lambda: pod("ops-0123456789ab-worker-1") is None, **SOON)
    finished = conditions()
    time.sleep(1)
    assert pod("ops-0123456789ab-worker-1") is None  # a finished job's workers are not created again
    assert conditions() == finished


def test_a_pod_on_a_lost_node_reads_running_then_not_ready_and_stays_terminating_until_its_node_is_out_of_service(
        emulator: tuple) -> None:
    """What the API shows of a node that went silent (tests/cluster/node_lifecycle.py ``lose``): its processes
    are gone but its pod still reads Running and Ready; after the node monitor grace period the pod is not Ready,
    with the node controller's NodeNotReady Warning; deleted, it stays terminating (no kubelet confirms it),
    until the node is marked out of service and the pod GC removes it."""
    from tests.cluster.node_lifecycle import lose, mark_out_of_service

    emu, cluster = emulator
    cluster_platform(emu)  # the images
    cluster.node_monitor_grace_s, cluster.podgc_period_s = 1.0, 0.5
    core, _ = client_apis(emu)
    kubernetes.client.BatchV1Api(core.api_client).create_namespaced_job("lanes", _sleeping_job("sleeper"))
    pod = wait_until("the Job's pod to run", lambda: next(
        (p for p in core.list_namespaced_pod("lanes", label_selector="app=sleeper").items
         if p.status.phase == "Running"), None), **SOON)
    name, node = pod.metadata.name, pod.spec.node_name
    pids = wait_until("the container's processes", lambda: cluster.container_pids("lanes", name), **SOON)
    lose(cluster, node, vm_gone=False)
    for pid in pids:  # every process of it is gone ...
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    read = core.read_namespaced_pod(name, "lanes")  # ... which no one has told the API
    assert read.status.phase == "Running" and read.status.container_statuses[0].state.running is not None

    def not_ready() -> object:
        conditions = core.read_namespaced_pod(name, "lanes").status.conditions or []
        return any(c.type == "Ready" and c.status == "False" for c in conditions)
    wait_until("the node controller to mark the pod not Ready", not_ready, **SOON)
    (event,) = [e for e in core.list_namespaced_event("lanes", field_selector=f"involvedObject.name={name}").items
                if e.reason == "NodeNotReady"]
    assert (event.type, event.message, event.source.component) == ("Warning", "Node is not ready", "node-controller")
    assert core.read_namespaced_pod(name, "lanes").status.phase == "Running"

    core.delete_namespaced_pod(name, "lanes")
    assert core.read_namespaced_pod(name, "lanes").metadata.deletion_timestamp is not None
    mark_out_of_service(cluster, node)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, "lanes")
        except ApiException as exc:
            return exc.status == 404
        return False
    wait_until("the pod GC to remove the pod of the out-of-service node", gone, **SOON)
