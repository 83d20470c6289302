"""What happens to a node and its pods when it is taken out of service: cordon, drain, graceful shutdown.

- ``cordon``/``uncordon``: ``spec.unschedulable`` (``kubectl cordon``); the scheduler's NodeUnschedulable filter
  then keeps new pods off it (``scheduler.py``). Nodes are not served by the emulated API, so this sets the
  node's state directly, which is all ``kubectl cordon``'s PATCH changes.
- ``drain``: what ``kubectl drain --ignore-daemonsets`` does after cordoning (k8s.io/kubectl ``pkg/drain``
  ``filters.go``): list the node's pods (``fieldSelector spec.nodeName=<node>``), skip mirror and DaemonSet
  pods, refuse the whole drain when a pod has an ``emptyDir`` (local storage: an MPI worker's ``/dev/shm``)
  unless ``--delete-emptydir-data`` is given, or has no controller unless ``--force``; then evict each through
  the eviction subresource (``disruption.py``), again every 5 s while a disruption budget refuses (429) —
  here through the real ``kubernetes`` client, as kubectl goes through the API.
- ``shut_down``: the kubelet's graceful node shutdown (``pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go``
  ``processShutdownEvent``): the node goes NotReady (the node lifecycle controller then taints it
  ``node.kubernetes.io/not-ready:NoSchedule``), and every pod on it is stopped — SIGTERM to its PID 1, SIGKILL
  after ``min(its grace period, shutdownGracePeriod - shutdownGracePeriodCriticalPods)`` — and stays, Failed,
  with reason ``Terminated``, message ``Pod was terminated in response to imminent node shutdown.`` and the
  ``DisruptionTarget`` condition (reason ``TerminationByKubelet``). A pod deleted meanwhile (its job ended) is
  removed once the kubelet has stopped it, as the kubelet confirms a deletion only then.
- ``lose``: the node is gone without a word — power lost, a host failure, a VM deleted without notice, or cut
  off from the network. Every process on it dies at once and its pods' traffic is dropped silently (no reset
  reaches a peer, so an open connection to them just hangs). Its kubelet posts nothing more: the API still
  shows its pods Running. After ``node_monitor_grace_s`` the node lifecycle controller
  (``pkg/controller/nodelifecycle`` ``tryUpdateNodeHealth``, ``doNoScheduleTaintingPass``,
  ``doNoExecuteTaintingPass``) marks it Unknown (``NodeStatusUnknown``, "Kubelet stopped posting node
  status.") and taints it ``node.kubernetes.io/unreachable`` (NoSchedule, NoExecute), and ``MarkPodsNotReady``
  (``pkg/controller/util/node/controller_utils.go``) sets each of its pods' Ready condition False, with a
  Warning ``NodeNotReady`` "Node is not ready" from the node-controller. A pod deleted there stays, terminating,
  as no kubelet confirms it stopped. When its VM is gone, the cloud node lifecycle controller
  (k8s.io/cloud-provider ``controllers/nodelifecycle`` ``MonitorNodes``, every ``node_monitor_period_s``)
  deletes the Node ("DeletingNode"), and the pod GC (``pkg/controller/podgc`` ``gcOrphaned``) force-deletes
  its pods after ``podgc_quarantine_s``: phase Failed, ``DisruptionTarget`` ``DeletionByPodGC`` "PodGC: node
  no longer exists". When the VM is still there (cut off), nothing removes them until an administrator marks
  the node out of service (``mark_out_of_service``: the taint ``node.kubernetes.io/out-of-service``, after
  which ``gcTerminating`` force-deletes its terminating pods) or deletes it. The taint manager's eviction
  after the 300 s the DefaultTolerationSeconds admission plugin gives every pod is not modelled.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import kubernetes

from tests.cluster.kubelet import set_container_state
from tests.cluster.objects import later, now, record_event
from tests.cluster.runtime import ContainerProcess

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
UNREACHABLE = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


def cordon(cluster: Cluster, node: str) -> None:
    with cluster.lock:
        cluster.nodes[node].unschedulable = True


def uncordon(cluster: Cluster, node: str) -> None:
    with cluster.lock:
        cluster.nodes[node].unschedulable = False
        cluster.nodes[node].taints = [t for t in cluster.nodes[node].taints if t != NOT_READY_TAINT]


class DrainRefused(RuntimeError):
    """kubectl drain's filters refused some pods: nothing was evicted."""


def drain(core: kubernetes.client.CoreV1Api, cluster: Cluster, node: str, *, delete_emptydir_data: bool = False,
          force: bool = False, retry_every_s: float = 5.0, timeout_s: float = 300.0) -> list[str]:
    """``kubectl drain <node> --ignore-daemonsets [--delete-emptydir-data] [--force]``: cordon, then evict every
    pod on it through the API; the pods evicted."""
    cordon(cluster, node)
    pods = [pod for pod in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
            if not any(o.kind == "DaemonSet" for o in pod.metadata.owner_references or [])
            and "kubernetes.io/config.mirror" not in (pod.metadata.annotations or {})
            and pod.status.phase not in ("Succeeded", "Failed")]
    local = [f"{p.metadata.namespace}/{p.metadata.name}" for p in pods
             if any(v.empty_dir is not None for v in p.spec.volumes or [])]
    unmanaged = [f"{p.metadata.namespace}/{p.metadata.name}" for p in pods
                 if not any(o.controller for o in p.metadata.owner_references or [])]
    refusals = ([f"cannot delete Pods with local storage (use --delete-emptydir-data to override): "
                 f"{', '.join(local)}"] if local and not delete_emptydir_data else []) + \
        ([f"cannot delete Pods that declare no controller (use --force to override): {', '.join(unmanaged)}"]
         if unmanaged and not force else [])
    if refusals:
        raise DrainRefused(f"cannot drain node {node!r}: " + "; ".join(refusals))
    evicted = []
    deadline = time.monotonic() + timeout_s
    for pod in pods:
        body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(
            name=pod.metadata.name, namespace=pod.metadata.namespace))
        while True:
            try:
                core.create_namespaced_pod_eviction(pod.metadata.name, pod.metadata.namespace, body)
                evicted.append(pod.metadata.name)
                break
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    break
                if exc.status != 429 or time.monotonic() > deadline:
                    raise
                time.sleep(retry_every_s)
    return evicted


def shut_down(cluster: Cluster, node: str, shutdown_grace_s: float = 30.0, critical_grace_s: float = 0.0) -> None:
    """The node's kubelet sees the machine shut down (see the module docstring); the pods stop in the
    background, as the kubelet's own shutdown inhibitor holds the machine meanwhile."""
    # Imported here: the controller manager imports the controllers, which import the kubelet.
    from tests.cluster.controller_manager import sync_owner

    with cluster.lock:
        if NOT_READY_TAINT not in cluster.nodes[node].taints:
            cluster.nodes[node].taints.append(dict(NOT_READY_TAINT))
        for (namespace, name), pod in list(cluster.objects["pods"].items()):
            if pod["spec"].get("nodeName") != node or pod["status"].get("phase") in ("Succeeded", "Failed"):
                continue
            grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)),
                        shutdown_grace_s - critical_grace_s)
            container = cluster.containers.pop((namespace, name), None)
            if log := cluster.logs.get((namespace, name)):
                log.running = False

            def stopped(pod: dict = pod, container: ContainerProcess | None = container, grace: float = grace) -> None:
                if container is not None:
                    container.stop(grace)
                with cluster.lock:
                    pod["status"].update({"phase": "Failed", "reason": "Terminated", "message": SHUTDOWN_MESSAGE})
                    if container is not None:
                        code = ContainerProcess.exit_code(container.process.returncode)
                        set_container_state(pod, {"terminated": {
                            "exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": now()}},
                            ready=False)
                    conditions = [c for c in pod["status"].get("conditions") or [] if c["type"] != "DisruptionTarget"]
                    pod["status"]["conditions"] = [*conditions, {
                        "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                        "message": SHUTDOWN_MESSAGE, "lastTransitionTime": now()}]
                    sync_owner(cluster, pod)
                    cluster.changed.notify_all()

            if container is not None:
                cluster.terminating[:] = [c for c in cluster.terminating if c.process.poll() is None] + [container]
            stop = cluster.kubelet_stops[(namespace, name)] = threading.Thread(target=stopped, daemon=True,
                                                                                name=f"shutdown-{name}")
            stop.start()


def lose(cluster: Cluster, node: str, vm_gone: bool = True) -> None:
    """The node goes without a word (see the module docstring); ``vm_gone``: its VM no longer exists (so the
    cloud node lifecycle controller deletes the Node), else it is only cut off."""
    from tests.cluster.network import PodNetwork

    with cluster.lock:
        cluster.lost_nodes.add(node)
        stopped = []
        for key, pod in cluster.objects["pods"].items():
            if pod["spec"].get("nodeName") != node:
                continue
            if key in cluster.pod_networks:
                PodNetwork.shared().cut(cluster.pod_networks[key][0])  # first: no reset leaves as they die
            if (container := cluster.containers.pop(key, None)) is not None:
                stopped.append(container)
            if log := cluster.logs.get(key):
                log.running = False  # a follower's stream from its kubelet breaks off
    for container in stopped:  # SIGKILL to everything at once, no status written: the kubelet died with them
        container.stop(grace_s=0)
    later(cluster, cluster.node_monitor_grace_s, lambda: _unknown(cluster, node, vm_gone))


def _unknown(cluster: Cluster, node: str, vm_gone: bool) -> None:
    """The node lifecycle controller past the grace period: the node Unknown and tainted, its pods not Ready."""
    if node not in cluster.nodes:
        return
    cluster.nodes[node].ready = False
    record_event(cluster, _node_object(node), "Normal", "NodeNotReady", f"Node {node} status is now: NodeNotReady",
                 "node-controller")
    for effect in ("NoSchedule", "NoExecute"):
        if not any(t["key"] == UNREACHABLE and t["effect"] == effect for t in cluster.nodes[node].taints):
            cluster.nodes[node].taints.append({"key": UNREACHABLE, "effect": effect, "timeAdded": now()})
    for pod in cluster.objects["pods"].values():
        if pod["spec"].get("nodeName") != node:
            continue
        ready = next((c for c in pod["status"].get("conditions") or [] if c.get("type") == "Ready"), None)
        if ready is None or ready.get("status") == "False":
            continue  # MarkPodsNotReady: no change, no event
        ready.update({"status": "False", "lastTransitionTime": now()})
        record_event(cluster, pod, "Warning", "NodeNotReady", "Node is not ready", "node-controller")
    if vm_gone:
        later(cluster, cluster.node_monitor_period_s, lambda: _delete_node(cluster, node))


def _delete_node(cluster: Cluster, node: str) -> None:
    """The cloud node lifecycle controller: a NotReady node whose instance is gone is deleted; the pod GC then
    finds its pods orphaned."""
    if cluster.nodes.pop(node, None) is None:
        return
    record_event(cluster, _node_object(node), "Normal", "DeletingNode",
                 f"Deleting node {node} because it does not exist in the cloud provider",
                 "cloud-node-lifecycle-controller")
    later(cluster, cluster.podgc_quarantine_s, lambda: _collect(cluster, node, "DeletionByPodGC",
                                                                "PodGC: node no longer exists"))


def mark_out_of_service(cluster: Cluster, node: str) -> None:
    """``kubectl taint nodes <node> node.kubernetes.io/out-of-service=nodeshutdown:NoExecute``: an administrator
    says the node is off; the pod GC's next pass (``gcTerminating``) force-deletes its terminating pods."""
    with cluster.lock:
        cluster.nodes[node].taints.append({"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"})

    def collect() -> None:  # gcTerminating, every period while the node is there, not Ready, with the taint's key
        if node in cluster.nodes and not cluster.nodes[node].ready and \
                any(t["key"] == OUT_OF_SERVICE for t in cluster.nodes[node].taints):
            _collect(cluster, node, None, None, terminating_only=True)
            later(cluster, cluster.podgc_period_s, collect)
    later(cluster, cluster.podgc_period_s, collect)


def _collect(cluster: Cluster, node: str, reason: str | None, message: str | None,
             terminating_only: bool = False) -> None:
    """The pod GC's ``markFailedAndDeletePod[WithCondition]``: phase Failed (and a DisruptionTarget, when it
    gives one) for a pod not finished, then a delete with grace 0."""
    from tests.cluster.garbage_collector import delete

    for pod in list(cluster.objects["pods"].values()):
        if pod["spec"].get("nodeName") != node or (terminating_only and not pod["metadata"].get("deletionTimestamp")):
            continue
        if pod["status"].get("phase") not in ("Succeeded", "Failed"):
            pod["status"]["phase"] = "Failed"
            if reason is not None:
                pod["status"]["conditions"] = [*(pod["status"].get("conditions") or []), {
                    "type": "DisruptionTarget", "status": "True", "reason": reason, "message": message,
                    "lastTransitionTime": now()}]
        delete(cluster, "pods", pod, grace_s=0)


def _node_object(node: str) -> dict:
    """What an event about a node refers to (nodes are not served by the emulated API)."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "namespace": "default", "uid": node}}
