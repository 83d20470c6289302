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
  ``DisruptionTarget`` condition (reason ``TerminationByKubelet``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import kubernetes

from tests.cluster.kubelet import set_container_state
from tests.cluster.objects import now
from tests.cluster.runtime import ContainerProcess

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


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
            threading.Thread(target=stopped, daemon=True, name=f"shutdown-{name}").start()
