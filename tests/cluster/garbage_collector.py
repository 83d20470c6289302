"""Deletion as the API server and the garbage collector do it (apiserver
``registry/generic/registry/store.go``, kubernetes ``pkg/controller/garbagecollector``): ``propagationPolicy``
Foreground (owner readable with the ``foregroundDeletion`` finalizer until its blocking dependents are
gone), Background, Orphan; a pod whose container runs stays, ``deletionTimestamp`` set, until the kubelet
stopped it. (A batch/v1 Job's default policy, Orphan with the API server's warning, is read in
``apiserver.py``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.cluster.kubelet import kill, release_network
from tests.cluster.network_policy import enforce
from tests.cluster.objects import now

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def _dependents(cluster: Cluster, uid: str) -> list[tuple[str, dict]]:
    return [(resource, child) for resource in ("jobs", "pods", "secrets", "configmaps", "services",
                                                    "networkpolicies", "workloads")
            for child in list(cluster.objects[resource].values())
            if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences") or [])]


def delete(cluster: Cluster, resource: str, obj: dict, policy: str = "Background",
           grace_s: int | None = None) -> bool:
    """Delete an object as the API server and the garbage collector do; True when it is gone at once.

    - A pod whose container runs is deleted gracefully: ``deletionTimestamp`` set, the kubelet stops the
      container (SIGTERM, SIGKILL after the grace period: the pod's, or the request's ``grace_s``), then the
      pod goes (apiserver registry/core/pod ``CheckGracefulDelete``; the kubelet's status manager deletes it
      with grace 0), and its controller hears of it (a controller's informer sees the pod's DELETE).
    - ``Orphan``: the dependents lose their owner reference and stay (garbagecollector ``orphanDependents``).
    - ``Background``: the object goes at once, the garbage collector deletes its dependents after it.
    - ``Foreground``: the object stays readable with ``deletionTimestamp`` and the ``foregroundDeletion``
      finalizer while its dependents are deleted; once none with ``blockOwnerDeletion`` is left, it goes
      (apiserver registry/generic/registry/store.go ``updateForGracefulDeletionAndFinalizers``;
      garbagecollector ``processDeletingDependentsItem``, graph.go ``blockingDependents``)."""
    metadata = obj["metadata"]
    if metadata.get("deletionTimestamp"):
        if resource == "pods" and grace_s == 0 and not metadata.get("finalizers"):
            # A force delete (kubectl delete --grace-period=0 --force; the pod GC) cuts a graceful one short
            # (registry/core/pod/strategy.go ``CheckGracefulDelete``): the pod goes now, whatever runs.
            _remove(cluster, resource, obj)
            return True
        return False
    key = (metadata.get("namespace", ""), metadata["name"])
    if resource == "pods" and grace_s != 0 and obj["spec"].get("nodeName") in cluster.lost_nodes and \
            obj["status"].get("phase") not in ("Succeeded", "Failed"):
        # No kubelet confirms the pod stopped (its status manager's delete with grace 0 never comes): it stays,
        # terminating, until it is force-deleted or the pod GC removes it (node_lifecycle.py).
        grace = int(obj["spec"].get("terminationGracePeriodSeconds", 30) if grace_s is None else grace_s)
        metadata.update({"deletionTimestamp": now(grace), "deletionGracePeriodSeconds": grace})
        return False
    if resource == "pods" and key in cluster.containers:
        grace = float(obj["spec"].get("terminationGracePeriodSeconds", 30) if grace_s is None else grace_s)
        metadata.update({"deletionTimestamp": now(grace), "deletionGracePeriodSeconds": int(grace)})
        # Only a kubelet confirms the stop: on a node lost meanwhile the pod stays (node_lifecycle.lose).
        kill(cluster, *key, grace_s=grace, on_stopped=lambda: None if obj["spec"].get("nodeName") in
             cluster.lost_nodes else _remove(cluster, resource, obj))
        return False
    if metadata.get("finalizers"):
        # registry/generic/registry/store.go ``updateForGracefulDeletionAndFinalizers``: an object with
        # finalizers is only marked; the update that removes the last one deletes it (``finish_deletion``).
        # (A running pod's graceful deletion above comes first; no pod here carries finalizers.)
        metadata.update({"deletionTimestamp": now(), "deletionGracePeriodSeconds": 0})
        cluster.pending_deletions[(resource, *key)] = policy
        return False
    dependents = _dependents(cluster, metadata["uid"])
    if policy == "Orphan":
        for _, child in dependents:
            child["metadata"]["ownerReferences"] = [ref for ref in child["metadata"]["ownerReferences"]
                                                    if ref.get("uid") != metadata["uid"]]
        _remove(cluster, resource, obj)
        return True
    if policy == "Foreground":
        metadata.update({"deletionTimestamp": now(), "deletionGracePeriodSeconds": 0})
        metadata["finalizers"] = [*(metadata.get("finalizers") or []), "foregroundDeletion"]
        for child_resource, child in dependents:
            # attemptToDeleteItem: a dependent of an owner waiting for its dependents goes Foreground too.
            delete(cluster, child_resource, child,
                   "Foreground" if _dependents(cluster, child["metadata"]["uid"]) else "Background")
        _finish_foreground(cluster)
        return cluster.objects[resource].get(key) is not obj
    _remove(cluster, resource, obj)
    for child_resource, child in dependents:
        delete(cluster, child_resource, child, "Background")
    return True


def finish_deletion(cluster: Cluster, resource: str, obj: dict) -> bool:
    """After an update: an object marked for deletion whose finalizers are all gone is deleted now (store.go
    ``Update``: ``ShouldDeleteDuringUpdate``), with the policy its DELETE asked for; True when it went."""
    metadata = obj["metadata"]
    key = (resource, metadata.get("namespace", ""), metadata["name"])
    if not metadata.get("deletionTimestamp") or metadata.get("finalizers") or key not in cluster.pending_deletions:
        return False
    policy = cluster.pending_deletions.pop(key)
    metadata.pop("deletionTimestamp")
    metadata.pop("deletionGracePeriodSeconds", None)
    return delete(cluster, resource, obj, policy)


def _remove(cluster: Cluster, resource: str, obj: dict) -> None:
    """The object leaves storage (and with it, a pod's network and logs); owners waiting on it may go."""
    namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
    if cluster.objects[resource].get((namespace, name)) is not obj:
        return
    cluster.objects[resource].pop((namespace, name))
    if resource == "mpijobs":
        cluster.operator_specs.pop((namespace, name), None)
    if resource == "networkpolicies":
        enforce(cluster)
    if resource == "pods":
        kill(cluster, namespace, name)
        release_network(cluster, namespace, name)
        cluster.logs.pop((namespace, name), None)
    _finish_foreground(cluster)
    if resource == "pods":
        # Imported here: the controller manager imports the controllers, which import this module.
        from tests.cluster.controller_manager import sync_owner

        if obj["status"].get("phase") != "Succeeded":
            # pkg/controller/job ``trackJobStatusAndRemoveFinalizers``: a Job's pod deleted before it finished
            # counts as failed, and so does a Failed one removed (the pod GC's, say): its finalizer kept it until
            # counted (Job tracking with finalizers, GA in 1.26). A Job counts the pods it still has besides.
            for reference in obj["metadata"].get("ownerReferences") or []:
                if reference.get("kind") == "Job":
                    cluster.lost_job_pods[reference["uid"]] += 1
        sync_owner(cluster, obj)


def _finish_foreground(cluster: Cluster) -> None:
    """Remove each object in Foreground deletion whose blocking dependents are all gone."""
    for resource in list(cluster.objects):
        for obj in list(cluster.objects[resource].values()):
            if "foregroundDeletion" not in (obj["metadata"].get("finalizers") or []):
                continue
            blocking = [child for _, child in _dependents(cluster, obj["metadata"]["uid"])
                        if any(ref.get("uid") == obj["metadata"]["uid"] and ref.get("blockOwnerDeletion")
                               for ref in child["metadata"]["ownerReferences"])]
            if not blocking:
                _remove(cluster, resource, obj)
