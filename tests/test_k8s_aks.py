"""The emulated cluster's AKS shape (tests/cluster/aks.py) through the real ``kubernetes`` client: where pods land
on a system pool and tainted GPU and spot pools, a Pending pod that starts once room frees up (kube-scheduler's
second chance), and a spot VM taken back the AKS way (node auto-drain on Azure's Preempt, then the VM gone)."""

from __future__ import annotations

import kubernetes
import pytest

from tests.cluster.aks import AUTO_DRAIN_TAINT, GPU_TOLERATIONS, aks_nodes, nodes_of, preempt
from tests.cluster_platform_helpers import DATA_IMAGE, client_apis, cluster_platform
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
SOON = {"timeout_s": 120, "every_s": 0.2}


def _sleeper(name: str, gpus: int = 0, spot_only: bool = False) -> dict:
    spec: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                  "containers": [{"name": "main", "image": DATA_IMAGE, "command": ["sleep", "600"]}]}
    if gpus:
        spec["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
        spec["tolerations"] = GPU_TOLERATIONS
    if spot_only:
        spec["nodeSelector"] = {"kubernetes.azure.com/scalesetpriority": "spot"}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}


def _pod_of(core: kubernetes.client.CoreV1Api, job: str) -> kubernetes.client.V1Pod | None:
    return next(iter(core.list_namespaced_pod("lanes", label_selector=f"app={job}").items), None)


def _running(core: kubernetes.client.CoreV1Api, job: str) -> kubernetes.client.V1Pod | None:
    pod = _pod_of(core, job)
    return pod if pod is not None and pod.status.phase == "Running" else None


def _unschedulable(core: kubernetes.client.CoreV1Api, job: str) -> kubernetes.client.V1PodCondition | None:
    pod = _pod_of(core, job)
    return next((c for c in (pod.status.conditions or []) if c.type == "PodScheduled" and c.reason == "Unschedulable"),
                None) if pod is not None else None


def _pool(cluster, pod: kubernetes.client.V1Pod) -> str:
    return cluster.nodes[pod.spec.node_name].labels["agentpool"]


def test_pods_land_by_pool_and_a_pending_gpu_pod_starts_once_the_gpu_is_free(emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.nodes = aks_nodes(gpu=1, spot=0, gpu_size="Standard_NC24ads_A100_v4")  # one GPU in all
    cluster_platform(emu)  # the images
    core, _ = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    for job, gpus in (("plain", 0), ("first", 1)):
        batch.create_namespaced_job("lanes", _sleeper(job, gpus))
    plain = wait_until("the pod without a GPU to run", lambda: _running(core, "plain"), **SOON)
    first = wait_until("the GPU pod to run", lambda: _running(core, "first"), **SOON)
    assert (_pool(cluster, plain), _pool(cluster, first)) == ("system", "gpu")

    batch.create_namespaced_job("lanes", _sleeper("second", 1))
    waiting = wait_until("the second GPU pod to be unschedulable", lambda: _unschedulable(core, "second"), **SOON)
    assert "Insufficient nvidia.com/gpu" in waiting.message, waiting.message
    batch.delete_namespaced_job("first", "lanes", propagation_policy="Background")
    second = wait_until("the second GPU pod to run once the GPU is free", lambda: _running(core, "second"), **SOON)
    assert _pool(cluster, second) == "gpu"
    tries = [event for event in cluster.objects["events"].values()
             if event["reason"] == "FailedScheduling" and event["involvedObject"]["name"] == second.metadata.name]
    assert len(tries) == 1 and tries[0]["count"] >= 1, tries  # one event, counted per try, as the recorder does


def test_a_spot_node_preempted_is_drained_by_aks_then_gone_and_its_pod_is_evicted(emulator: tuple) -> None:
    emu, cluster = emulator
    cluster_platform(emu)  # the images
    core, _ = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    batch.create_namespaced_job("lanes", _sleeper("on-spot", 1, spot_only=True))
    pod = wait_until("the pod to run on the spot pool", lambda: _running(core, "on-spot"), **SOON)
    # The controllers' periods shortened: the node is seen silent a second after its VM went, then deleted.
    cluster.node_monitor_grace_s, cluster.node_monitor_period_s = 1.0, 0.5
    (spot,) = nodes_of(cluster, "gpuspot")
    assert pod.spec.node_name == spot
    reclaim = preempt(core, cluster, spot, notice_s=2.0)
    assert AUTO_DRAIN_TAINT in cluster.nodes[spot].taints
    wait_until("the pod to be evicted", lambda: not any(
        p.metadata.uid == pod.metadata.uid and not p.metadata.deletion_timestamp
        for p in core.list_namespaced_pod("lanes", label_selector="app=on-spot").items), **SOON)
    node = cluster.nodes.get(spot)
    assert node is None or node.unschedulable  # cordoned by the drain (or gone already)
    reclaim.join(timeout=60)
    assert not reclaim.is_alive()
    wait_until("the Node to go with its VM", lambda: spot not in cluster.nodes, **SOON)
