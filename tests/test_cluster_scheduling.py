"""Where the pods that need a GPU run (issues 34 and 49): the cluster block's tolerations, node selector,
affinity, priority class and requests, checked when the block is made and obeyed by the emulated
kube-scheduler's filters on the AKS-shaped cluster; and a run keeps its GPU until it has scored."""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.train import train_pipeline
from tasks.k8s.manifests import ClusterLayout, render_mpijob
from tasks.k8s.scheduling import WorkerScheduling
from tasks.platforms import StageBlocked, VolumeRef
from tasks.platforms.cluster import ClusterPlatform
from tests.cluster.aks import GPU_TOLERATIONS, aks_nodes
from tests.cluster_platform_helpers import (
    cluster_platform,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    saved,
    spec_for,
)
from tests.gpu_limit import operator_gpu_limit
from tests.test_pipeline import params_for

#: AKS: GPU pools tainted as Microsoft recommends, spot pools as AKS always taints them.
TOLERATIONS = GPU_TOLERATIONS
LAYOUT = {"namespace": "lanes", "image": "train:1", "data_image": "data:1", "storage_class": "anf",
          "snapshot_class": "snap"}


def render(scheduling: WorkerScheduling) -> dict:
    return render_mpijob("train-1", ClusterLayout(**LAYOUT, scheduling=scheduling), "data", "cpu-demo", 2,
                         "datasets/x", "runs/train-1", {}, {})


def test_scheduling_settings_go_to_the_workers_and_a_default_block_adds_none() -> None:
    plain = render(WorkerScheduling())  # (the stored MPIJob's golden file holds the whole default rendering)
    worker = plain["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert not {"tolerations", "nodeSelector", "affinity", "priorityClassName"} & set(worker)
    assert worker["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}

    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.azure.com/accelerator", "operator": "Exists"}]}]}}}
    job = render(WorkerScheduling(tolerations=TOLERATIONS, node_selector={"agentpool": "gpu"}, affinity=affinity,
                                  priority_class="training-high", cpu="7500m", memory="28Gi",
                                  quality_of_service="guaranteed"))
    replicas = job["spec"]["mpiReplicaSpecs"]
    worker, launcher = replicas["Worker"]["template"]["spec"], replicas["Launcher"]["template"]["spec"]
    assert (worker["tolerations"], worker["nodeSelector"], worker["affinity"], worker["priorityClassName"]) == (
        TOLERATIONS, {"agentpool": "gpu"}, affinity, "training-high")
    assert worker["containers"][0]["resources"] == {  # Guaranteed: limits equal to the requests
        "requests": {"cpu": "7500m", "memory": "28Gi"},
        "limits": {"nvidia.com/gpu": "1", "cpu": "7500m", "memory": "28Gi"}}
    # The launcher needs no GPU node: only the job's priority.
    assert launcher["priorityClassName"] == "training-high" and "tolerations" not in launcher
    burstable = render(WorkerScheduling(cpu="4"))["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert burstable["containers"][0]["resources"] == {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": "1"}}


@pytest.mark.parametrize(("changes", "says"), [
    ({"tolerations": [{"key": "sku", "operater": "Equal", "value": "gpu"}]}, "tolerations[0] has no field 'operater'"),
    ({"tolerations": [{"key": "sku", "operator": "Exists", "value": "gpu"}]}, "value must be empty"),
    ({"tolerations": [{"key": "sku", "value": "gpu", "effect": "NoSchedul"}]}, "effect must be one of NoSchedule"),
    ({"tolerations": [{"key": "sku", "tolerationSeconds": 30, "effect": "NoSchedule"}]}, "NoExecute effect only"),
    ({"node_selector": {"agent pool": "gpu"}}, "'agent pool' is not a valid label key"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"operator": "In", "values": ["gpu"]}]}]}}}},
     "nodeSelectorTerms[0].matchExpressions[0]: key: field required"),
    ({"affinity": {"nodeAfinity": {}}}, "affinity has no field 'nodeAfinity'"),
    ({"priority_class": "Training_High"}, "priority_class 'Training_High' is not a DNS-1123 subdomain"),
    ({"worker_qos": "guaranteed", "worker_cpu": "4"}, "needs worker_cpu and worker_memory"),
    ({"worker_memory": "lots"}, "worker_memory 'lots' is not a Kubernetes quantity"),
])
def test_a_block_with_a_scheduling_setting_the_api_server_would_refuse_is_refused_when_made(
        changes: dict, says: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ClusterPlatform(**changes)
    assert says in str(refused.value)


def test_workers_land_on_a_tainted_gpu_pool_only_with_the_blocks_tolerations(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """The AKS shape every cluster test runs on (tests/cluster/aks.py): a system pool without GPUs, a GPU pool
    tainted for GPUs, a spot GPU pool tainted for GPUs and spot. Without tolerations the workers are never
    scheduled and the stage says which taint to tolerate; with them (and the spot pool's node selector) they
    run there, the launcher on the system pool, and training ends."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    untolerated = cluster_platform(emu, tolerations=[], node_selector={}, scheduling_grace_s=2)
    handle = untolerated.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2))
    with pytest.raises(StageBlocked) as blocked:
        untolerated.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    message = str(blocked.value)
    assert "0/4 nodes are available: 2 Insufficient nvidia.com/gpu, 2 node(s) had untolerated taint {sku: gpu}" \
        in message and "add a matching toleration to the platform block's tolerations" in message, message
    cluster.wait_empty("mpijobs")  # deleted in the foreground: its pods went first

    tolerant = cluster_platform(emu, tolerations=TOLERATIONS, node_selector={"agentpool": "gpuspot"},
                                worker_cpu="1", worker_memory="1Gi")
    handle = tolerant.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2, max_steps="2"))
    outcome = tolerant.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    assert outcome.steps == outcome.total_steps == 2 and outcome.stopped is None
    # Where the scheduler put each pod, as `kubectl get events` shows it.
    assigned = {(event["involvedObject"]["name"], event["message"].rsplit(" to ", 1)[-1])
                for event in cluster.objects["events"].values()
                if event["reason"] == "Scheduled" and event["involvedObject"]["name"].startswith(handle.job_name)}
    roles = {("launcher" if "-launcher-" in pod else "worker", cluster.nodes[node].labels["agentpool"])
             for pod, node in assigned}
    assert roles == {("launcher", "system"), ("worker", "gpuspot")} and len(assigned) == 3, assigned


@pytest.mark.slow
def test_a_queued_run_does_not_take_the_gpu_a_finished_training_still_scores_on(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], emulator: tuple) -> None:
    """Two UI runs side by side on a cluster with one GPU, under a `gpu` limit of 1: the first run's scoring
    needs the GPU its training just left. Its slot is held until it has scored, so the second run's MPIJob is
    made only then, and no evaluation pod ever waits for a GPU."""
    emu, cluster = emulator
    cluster.nodes = aks_nodes(gpu=1, spot=0, gpu_size="Standard_NC24ads_A100_v4")  # one GPU in all
    name = saved(emu, "one-gpu")
    params = params_for(served_archive, platform=name, volume="side-by-side", workers=1, max_steps=1,
                        snapshot=False)
    with operator_gpu_limit(1), ThreadPoolExecutor(2) as pool:  # each thread with this test's Prefect settings
        started = [pool.submit(contextvars.copy_context().run, train_pipeline, **params) for _ in range(2)]
        runs = [run.result() for run in started]
    assert all(run["metrics"]["images"] == 3 for run in runs), runs
    waited = [event["message"] for event in cluster.objects["events"].values()
              if event["reason"] == "FailedScheduling" and event["involvedObject"]["name"].startswith("eval-")]
    assert waited == [], waited
    # The second run's MPIJob was made after the first run's evaluation pod ended.
    starts = sorted((int(event["metadata"]["uid"].removeprefix("event-")), event["involvedObject"]["name"])
                    for event in cluster.objects["events"].values() if event["reason"] == "Scheduled")
    order = [pod.split("-")[0] for _, pod in starts if pod.startswith(("eval-", "train-")) and "-launcher-" not in pod]
    assert order == ["train", "eval", "train", "eval"], starts
