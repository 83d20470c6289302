"""AKS as its users run it: the emulated cluster's default shape, and a spot VM taken back the AKS way.

The shape (DESIGN §6, "AKS as users run it"):
- a **system pool** without GPUs and without taints, where everything that needs no GPU lands (the Prefect
  worker's flow pods, the MPI launcher, the data Jobs);
- a **GPU pool** tainted ``sku=gpu:NoSchedule``, as Microsoft advises for GPU pools (learn.microsoft.com,
  "Use GPUs for compute-intensive workloads on AKS": ``az aks nodepool add ... --node-taints sku=gpu:NoSchedule``);
- a **spot GPU pool**, which AKS always taints ``kubernetes.azure.com/scalesetpriority=spot:NoSchedule`` and
  labels ``kubernetes.azure.com/scalesetpriority: spot`` (learn.microsoft.com, "Add an Azure Spot node pool");
- finite allocatable CPU, memory and GPUs per node: fewer GPUs than a sweep of several runs asks for.

Every node carries the labels AKS's node bootstrapping gives it: ``agentpool`` and
``kubernetes.azure.com/agentpool`` (the pool), ``kubernetes.azure.com/mode`` (system or user),
``node.kubernetes.io/instance-type`` (the VM size); GPU nodes also ``kubernetes.azure.com/accelerator: nvidia``.
Allocatable is the VM size less AKS's kube-reserved and eviction threshold (rounded; the exact reservation
differs by AKS version and does not matter to what the tests show).

Spot eviction (``preempt``): Azure posts a ``Preempt`` Scheduled Event at least 30 s before it takes the VM
(learn.microsoft.com, "Azure Metadata Service: Scheduled Events for Linux VMs"); AKS **node auto-drain** turns
it into a cordon and a drain of the node (best effort, with the taint
``remediator.kubernetes.azure.com/unschedulable``: learn.microsoft.com, "Node auto-drain"), then the VM goes
and the cloud node lifecycle controller deletes the Node (``node_lifecycle.lose``). The notice is shortened
here, as the other timings of the emulated cluster are.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import kubernetes

from tests.cluster.node_lifecycle import drain, lose

if TYPE_CHECKING:
    from tests.cluster.state import Cluster, Node

GPU_TAINT = {"key": "sku", "value": "gpu", "effect": "NoSchedule"}
SPOT_TAINT = {"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}
#: AKS node auto-drain's taint on a node it drains for a Scheduled Event.
AUTO_DRAIN_TAINT = {"key": "remediator.kubernetes.azure.com/unschedulable", "effect": "NoSchedule"}
#: What a platform block needs on such a cluster: both pools' taints tolerated (the shipped example block's).
GPU_TOLERATIONS = [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
                   {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
                    "effect": "NoSchedule"}]
#: The label every GPU node of AKS carries: the node selector of the shipped example block.
GPU_NODE_SELECTOR = {"kubernetes.azure.com/accelerator": "nvidia"}

#: VM sizes and what a node of each allocates to pods (milli-CPU, bytes, GPUs).
_SIZES = {
    "Standard_D8s_v5": {"cpu": 7_820, "memory": 27 * 2**30, "ephemeral-storage": 100 * 2**30},
    "Standard_NC24ads_A100_v4": {"cpu": 23_660, "memory": 200 * 2**30, "ephemeral-storage": 500 * 2**30,
                                 "nvidia.com/gpu": 1},
    "Standard_NC96ads_A100_v4": {"cpu": 95_000, "memory": 800 * 2**30, "ephemeral-storage": 2**40,
                                 "nvidia.com/gpu": 4},
}


def pool_node(pool: str, index: int, size: str, *, mode: str = "user", spot: bool = False,
              taints: list[dict] | None = None) -> Node:
    """One node of an AKS pool, named as AKS names VMSS nodes (``aks-<pool>-<id>-vmss<index>``)."""
    from tests.cluster.state import Node

    labels = {"agentpool": pool, "kubernetes.azure.com/agentpool": pool, "kubernetes.azure.com/mode": mode,
              "node.kubernetes.io/instance-type": size}
    capacity = dict(_SIZES[size])
    if capacity.get("nvidia.com/gpu"):
        labels.update(GPU_NODE_SELECTOR)
    if spot:
        labels["kubernetes.azure.com/scalesetpriority"] = "spot"
    return Node(f"aks-{pool}-12345678-vmss{index:06d}", labels=labels, taints=[dict(t) for t in taints or []],
                capacity=capacity)


def gpu_node(name: str, gpus: int = 8, spot: bool = False) -> Node:
    """A GPU node under a short name of the test's choosing (``gpu-a``), tainted and labelled as AKS does."""
    from tests.cluster.state import Node

    node = pool_node("gpuspot" if spot else "gpu", 0, "Standard_NC96ads_A100_v4", spot=spot,
                     taints=[GPU_TAINT, SPOT_TAINT] if spot else [GPU_TAINT])
    return Node(name, labels={k: v for k, v in node.labels.items() if k != "kubernetes.io/hostname"},
                taints=node.taints, capacity={**node.capacity, "nvidia.com/gpu": gpus})


def aks_nodes(system: int = 2, gpu: int = 1, spot: int = 1,
              gpu_size: str = "Standard_NC96ads_A100_v4") -> dict[str, Node]:
    """The default shape: ``system`` system-pool nodes, ``gpu`` nodes of a GPU pool tainted ``sku=gpu``, ``spot``
    nodes of a spot GPU pool tainted for GPUs and spot, each GPU node of ``gpu_size``."""
    nodes = [pool_node("system", i, "Standard_D8s_v5", mode="system") for i in range(system)]
    nodes += [pool_node("gpu", i, gpu_size, taints=[GPU_TAINT]) for i in range(gpu)]
    nodes += [pool_node("gpuspot", i, gpu_size, spot=True, taints=[GPU_TAINT, SPOT_TAINT]) for i in range(spot)]
    return {node.name: node for node in nodes}


def nodes_of(cluster: Cluster, pool: str) -> list[str]:
    with cluster.lock:
        return [name for name, node in cluster.nodes.items() if node.labels.get("agentpool") == pool]


def node_of(cluster: Cluster, namespace: str, pod: str) -> str:
    """The node a pod was bound to."""
    with cluster.lock:
        return cluster.objects["pods"][(namespace, pod)]["spec"]["nodeName"]


def preempt(core: kubernetes.client.CoreV1Api, cluster: Cluster, node: str, notice_s: float = 3.0) -> threading.Thread:
    """Azure takes a spot VM back: AKS node auto-drain taints, cordons and drains the node on the ``Preempt``
    event (its pods' ``emptyDir`` data goes with the VM anyway), and ``notice_s`` after the event the VM is gone.
    Runs in the background (as Azure does); the thread is returned to join."""
    with cluster.lock:
        cluster.nodes[node].taints.append(dict(AUTO_DRAIN_TAINT))

    def reclaim() -> None:
        started = time.monotonic()
        with contextlib.suppress(kubernetes.client.ApiException):  # best effort: a refusing budget loses the VM
            drain(core, cluster, node, delete_emptydir_data=True, force=True, retry_every_s=1.0, timeout_s=notice_s)
        time.sleep(max(0.0, notice_s - (time.monotonic() - started)))
        lose(cluster, node, vm_gone=True)

    thread = threading.Thread(target=reclaim, name=f"preempt-{node}", daemon=True)
    thread.start()
    return thread
