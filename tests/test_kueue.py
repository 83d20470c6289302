"""The emulated Kueue (tests/cluster/kueue_*.py), through the real ``kubernetes`` client, against what
kubernetes-sigs/kueue v0.19.2 does: a queued job is stored suspended and gets a Workload named by Kueue's rule
(re-derived here from jobframework/workload_names.go); it waits with Kueue's own message while its ClusterQueue has
no room and runs, on its flavor's nodes, once it has; the webhooks refuse what Kueue's refuse; the visibility API
gives each pending Workload's position."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tasks.platforms.cluster.api import get_path
from tests.cluster_platform_helpers import DATA_IMAGE, client_apis, cluster_platform
from tests.test_cluster_pipeline import rendered

pytestmark = pytest.mark.slow


def kueue_queues(gpus_on_demand: int, gpus_spot: int, namespace: str = "lanes", rbac: bool = False) -> list[dict]:
    """The shipped example queues (deployments/kueue) with these GPU quotas, as an admin applies them: the
    LocalQueue (and with ``rbac`` the Role laneflow's flows get) in ``namespace``."""
    documents = [copy.deepcopy(d) for d in rendered("kueue") if rbac or d["kind"] not in ("Role", "RoleBinding")]
    for document in documents:
        if document["kind"] == "ClusterQueue":
            gpu_group = document["spec"]["resourceGroups"][1]
            gpu_group["flavors"][0]["resources"][0]["nominalQuota"] = gpus_on_demand
            gpu_group["flavors"][1]["resources"][0]["nominalQuota"] = gpus_spot
        if document["kind"] in ("LocalQueue", "Role", "RoleBinding"):
            document["metadata"]["namespace"] = namespace
    return documents


def gpu_job(name: str, command: str, **labels: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "laneflow", **labels}},
            "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "main", "image": DATA_IMAGE, "command": ["python", "-c", command],
                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


def until(what: str, check: Callable[[], object], timeout_s: float = 60) -> object:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.2)
    return found


def workload(custom: kubernetes.client.CustomObjectsApi, job_uid: str) -> dict | None:
    items = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "lanes", "workloads",
                                                 label_selector=f"kueue.x-k8s.io/job-uid={job_uid}")["items"]
    return items[0] if items else None


def reserved(found: dict) -> dict:
    return next(c for c in found["status"]["conditions"] if c["type"] == "QuotaReserved")


def test_a_queued_job_waits_suspended_with_kueues_message_and_runs_on_its_flavor_once_the_queue_has_room(
        emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.kueue_installed = True
    cluster_platform(emu)  # the project's images exist
    cluster.load(kueue_queues(gpus_on_demand=0, gpus_spot=0))
    core, custom = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    created = batch.create_namespaced_job("lanes", gpu_job("scores", "print('scored')"))
    assert created.spec.suspend is True  # Kueue's webhook suspended it
    uid = created.metadata.uid
    found = until("a Workload", lambda: workload(custom, uid))
    # jobframework/workload_names.go: "<kind>-<name>-" and the first 5 hex digits of SHA-1 over kind, group,
    # name and uid, one per line.
    digest = hashlib.sha1("\n".join(["Job", "batch", "scores", uid]).encode()).hexdigest()
    assert found["metadata"]["name"] == f"job-scores-{digest[:5]}"
    assert found["spec"]["podSets"][0]["name"] == "main" and found["spec"]["podSets"][0]["count"] == 1
    pending = until("Kueue's verdict", lambda: (w := workload(custom, uid)) and reserved(w).get("reason") and w)
    assert reserved(pending)["status"] == "False" and reserved(pending)["reason"] == "Pending"
    assert reserved(pending)["message"] == (
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor "
        "gpu-on-demand, 1 more needed, insufficient unused quota for nvidia.com/gpu in flavor gpu-spot, 1 more "
        "needed")
    assert not core.list_namespaced_pod("lanes", label_selector="job-name=scores").items

    queue = custom.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", "laneflow")
    groups = queue["spec"]["resourceGroups"]
    groups[1]["flavors"][1]["resources"][0]["nominalQuota"] = 2  # spot GPUs for the queue (an admin's change)
    custom.patch_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", "laneflow",
                                       {"spec": {"resourceGroups": groups}})
    done = until("the job's end", lambda: (j := batch.read_namespaced_job("scores", "lanes")).status.succeeded and j,
                 timeout_s=120)
    assert done.spec.suspend is False
    template = done.spec.template.spec
    assert template.node_selector == {"agentpool": "gpuspot"}  # the spot flavor: on-demand has no room
    assert {(t.key, t.value) for t in template.tolerations} == {
        ("sku", "gpu"), ("kubernetes.azure.com/scalesetpriority", "spot")}
    (pod,) = core.list_namespaced_pod("lanes", label_selector="job-name=scores").items
    assert cluster.nodes[pod.spec.node_name].labels["agentpool"] == "gpuspot"
    assert core.read_namespaced_pod_log(pod.metadata.name, "lanes").strip() == "scored"
    ended = until("Finished", lambda: any(c["type"] == "Finished" and c["status"] == "True"
                                          for c in workload(custom, uid)["status"]["conditions"]))
    assert ended
    queue = until("the queue's count", lambda: (q := custom.get_cluster_custom_object(
        "kueue.x-k8s.io", "v1beta2", "clusterqueues", "laneflow")).get("status", {}).get("admittedWorkloads") == 0
        and q)
    assert any(c["type"] == "Active" and c["status"] == "True" for c in queue["status"]["conditions"])


def test_kueues_webhooks_refuse_a_queue_change_of_a_running_job_and_an_elastic_mpijob(emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.kueue_installed = True
    cluster_platform(emu)
    cluster.load(kueue_queues(gpus_on_demand=1, gpus_spot=0))
    core, custom = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    batch.create_namespaced_job("lanes", gpu_job("runs", "import time; time.sleep(30)"))
    until("admitted", lambda: batch.read_namespaced_job("runs", "lanes").spec.suspend is False)
    with pytest.raises(ApiException) as refused:
        batch.patch_namespaced_job("runs", "lanes", {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "other"}}})
    assert refused.value.status == 422
    assert json.loads(refused.value.body)["message"] == (
        'admission webhook "vjob.kb.io" denied the request: Job.batch "runs" is invalid: '
        'metadata.labels[kueue.x-k8s.io/queue-name]: Invalid value: "other": field is immutable')
    mpijob = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {
        "name": "grows", "labels": {"kueue.x-k8s.io/queue-name": "laneflow"},
        "annotations": {"kueue.x-k8s.io/elastic-job": "true"}},
        "spec": {"mpiReplicaSpecs": {"Launcher": {"replicas": 1, "template": {"spec": {"containers": [
            {"name": "l", "image": DATA_IMAGE}]}}}}}}
    with pytest.raises(ApiException) as elastic:
        custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", mpijob)
    assert elastic.value.status == 422
    assert json.loads(elastic.value.body)["message"].endswith(
        'metadata.annotations[kueue.x-k8s.io/elastic-job]: Invalid value: "true": elastic job is not supported for '
        '"kubeflow.org/v2beta1, Kind=MPIJob"')
    batch.delete_namespaced_job("runs", "lanes", propagation_policy="Background")


def test_the_visibility_api_gives_pending_workloads_their_places_by_priority_and_is_absent_without_kueue(
        emulator: tuple) -> None:
    emu, cluster = emulator
    cluster_platform(emu)
    core, _ = client_apis(emu)
    client = core.api_client
    path = "/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/lanes/localqueues/laneflow/pendingworkloads"
    with pytest.raises(ApiException) as absent:
        get_path(client, path)
    assert absent.value.status == 404  # no Kueue on the cluster: no such API
    cluster.kueue_installed = True
    cluster.load(kueue_queues(gpus_on_demand=0, gpus_spot=0))
    batch = kubernetes.client.BatchV1Api(client)
    batch.create_namespaced_job("lanes", gpu_job("first", "pass",
                                                 **{"kueue.x-k8s.io/priority-class": "laneflow-trial"}))
    time.sleep(1.1)  # a later creation time (the API's stamps are whole seconds)
    batch.create_namespaced_job("lanes", gpu_job("second", "pass"))
    batch.create_namespaced_job("lanes", gpu_job("nightly", "pass",
                                                 **{"kueue.x-k8s.io/priority-class": "laneflow-nightly"}))

    def summary() -> dict | None:
        found = get_path(client, path)
        return found if len(found["items"]) == 3 else None

    items = until("three pending", summary)["items"]
    assert [(item["metadata"]["name"].rsplit("-", 1)[0], item["priority"], item["positionInLocalQueue"],
             item["positionInClusterQueue"]) for item in items] == [
        ("job-nightly", 1000, 0, 0), ("job-first", 100, 1, 1), ("job-second", 0, 2, 2)]
