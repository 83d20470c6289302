"""What every component of the emulated cluster does to API objects: the API's resources (group, version,
kind, scope), time stamps, the system metadata the API server stamps on a new object (uid,
resourceVersion, creationTimestamp), owner references as controllers set them (apimachinery
``metav1.NewControllerRef``), events as client-go's recorder makes them, and actions a controller
schedules for later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


# resource -> (group, version, kind, namespaced)
RESOURCES: dict[str, tuple[str, str, str, bool]] = {
    "namespaces": ("", "v1", "Namespace", False),
    "nodes": ("", "v1", "Node", False),  # read-only, rendered from Cluster.nodes (node_objects.py)
    "persistentvolumes": ("", "v1", "PersistentVolume", False),
    "persistentvolumeclaims": ("", "v1", "PersistentVolumeClaim", True),
    "pods": ("", "v1", "Pod", True),
    "pods/log": ("", "v1", "Pod", True),
    "pods/eviction": ("", "v1", "Eviction", True),
    "poddisruptionbudgets": ("policy", "v1", "PodDisruptionBudget", True),
    "networkpolicies": ("networking.k8s.io", "v1", "NetworkPolicy", True),
    "events": ("", "v1", "Event", True),
    "serviceaccounts": ("", "v1", "ServiceAccount", True),
    "secrets": ("", "v1", "Secret", True),
    "configmaps": ("", "v1", "ConfigMap", True),
    "limitranges": ("", "v1", "LimitRange", True),
    "jobs": ("batch", "v1", "Job", True),
    "mpijobs": ("kubeflow.org", "v2beta1", "MPIJob", True),
    "volumesnapshots": ("snapshot.storage.k8s.io", "v1", "VolumeSnapshot", True),
    "volumesnapshotclasses": ("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass", False),
    "storageclasses": ("storage.k8s.io", "v1", "StorageClass", False),
    "leases": ("coordination.k8s.io", "v1", "Lease", True),
    # Read by laneflow doctor (the MPI operator's CRD: which fields it knows); tests/cluster/crds.py.
    "customresourcedefinitions": ("apiextensions.k8s.io", "v1", "CustomResourceDefinition", False),
    # Kueue (tests/cluster/kueue_jobs.py), served only where a test installed it (Cluster.kueue_installed).
    "resourceflavors": ("kueue.x-k8s.io", "v1beta2", "ResourceFlavor", False),
    "clusterqueues": ("kueue.x-k8s.io", "v1beta2", "ClusterQueue", False),
    "localqueues": ("kueue.x-k8s.io", "v1beta2", "LocalQueue", True),
    "workloads": ("kueue.x-k8s.io", "v1beta2", "Workload", True),
    "workloadpriorityclasses": ("kueue.x-k8s.io", "v1beta2", "WorkloadPriorityClass", False),
    "localqueues/pendingworkloads": ("visibility.kueue.x-k8s.io", "v1beta2", "PendingWorkloadsSummary", True),
    "clusterqueues/pendingworkloads": ("visibility.kueue.x-k8s.io", "v1beta2", "PendingWorkloadsSummary", False),
    # Run:ai's scheduling queues (its scheduler, open-sourced as NVIDIA's KAI Scheduler), served only where a test
    # installed Run:ai (Cluster.runai_installed): stored and validated, never acted on.
    "queues": ("scheduling.run.ai", "v2", "Queue", False),
}
#: Kueue's API groups: its CRDs and its visibility API server's aggregated API.
KUEUE_GROUPS = frozenset({"kueue.x-k8s.io", "visibility.kueue.x-k8s.io"})
RUNAI_GROUPS = frozenset({"scheduling.run.ai"})


def resource_of(kind: str) -> str:
    for resource, (_, _, known, _) in RESOURCES.items():
        if known == kind and "/" not in resource:
            return resource
    return kind.lower() + "s"


def now(later_s: float = 0.0) -> str:
    """The time in RFC 3339, as the API writes it (``later_s`` from now: a graceful deletion's
    ``deletionTimestamp`` is the moment its grace period ends, apiserver ``rest.BeforeDelete``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + later_s))


#: The label the API server gives every namespace, its own name (pkg/registry/core/namespace/strategy.go,
#: PrepareForCreate and PrepareForUpdate; GA in 1.22): what a NetworkPolicy's namespaceSelector picks one by.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def label_namespace(obj: dict) -> None:
    """What the namespace strategy does on every create and update: the name label set, whatever was sent."""
    metadata = obj["metadata"]
    metadata["labels"] = {**(metadata.get("labels") or {}), NAMESPACE_NAME_LABEL: metadata["name"]}


def stamp_metadata(cluster: Cluster, obj: dict, namespace: str | None) -> None:
    cluster.version += 1
    metadata = obj["metadata"]
    metadata.update({"uid": f"uid-{cluster.version:06d}", "resourceVersion": str(cluster.version),
                     "creationTimestamp": now()})
    if namespace:
        metadata["namespace"] = namespace
    else:
        metadata.pop("namespace", None)


def record_event(cluster: Cluster, obj: dict, kind: str, reason: str, message: str, component: str) -> None:
    """A core/v1 Event as client-go's recorder makes it (tools/record/event.go makeEvent); the same event of
    the same object again bumps ``count`` and ``lastTimestamp`` (tools/record/events_cache.go
    ``EventCorrelator``: identical events are aggregated, not repeated)."""
    metadata = obj["metadata"]
    namespace = metadata.get("namespace", "default")
    for event in cluster.objects["events"].values():
        if event["involvedObject"].get("uid") == metadata.get("uid") and event["reason"] == reason and \
                event["message"] == message[:1024] and event["type"] == kind:
            event["count"] += 1
            event["lastTimestamp"] = now()
            return
    name = f"{metadata['name']}.{time.time_ns():x}"
    event = {"apiVersion": "v1", "kind": "Event",
             "metadata": {"name": name, "namespace": namespace, "uid": f"event-{time.time_ns()}",
                          "creationTimestamp": now()},
             "involvedObject": {"kind": obj["kind"], "apiVersion": obj["apiVersion"], "name": metadata["name"],
                                "namespace": namespace, "uid": metadata.get("uid")},
             "reason": reason, "message": message[:1024], "type": kind, "source": {"component": component},
             "reportingComponent": component, "firstTimestamp": now(), "lastTimestamp": now(), "count": 1}
    cluster.objects["events"][(namespace, name)] = event


def later(cluster: Cluster, delay_s: float, action: Callable[[], None]) -> None:
    def run() -> None:
        time.sleep(delay_s)
        with cluster.lock:
            if cluster.closed:
                return
            try:
                action()
            except Exception as exc:  # kept, and raised when the emulator stops: a controller that died
                cluster.controller_errors.append(exc)  # silently left its objects waiting forever
            cluster.changed.notify_all()
    threading.Thread(target=run, daemon=True).start()


def controller_ref(owner: dict) -> dict:
    """apimachinery ``metav1.NewControllerRef``: what every controller here sets on what it creates."""
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
