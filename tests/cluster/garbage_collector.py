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
from tests.cluster.objects import now

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def _dependents(cluster: Cluster, uid: str) -> list[tuple[str, dict]]:
    return [(resource, child) for resource in ("jobs", "pods", "secrets", "configmaps")
            for child in list(cluster.objects[resource].values())
            if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences") or [])]


def delete(cluster: Cluster, resource: str, obj: dict, policy: str = "Background") -> bool:
    """Delete an object as the API server and the garbage collector do; True when it is gone at once.

    - A pod whose container runs is deleted gracefully: ``deletionTimestamp`` set, the kubelet stops the
      container (SIGTERM, SIGKILL after the grace period), then the pod goes (apiserver registry/core/pod
      ``CheckGracefulDelete``; the kubelet's status manager deletes it with grace 0).
    - ``Orphan``: the dependents lose their owner reference and stay (garbagecollector ``orphanDependents``).
    - ``Background``: the object goes at once, the garbage collector deletes its dependents after it.
    - ``Foreground``: the object stays readable with ``deletionTimestamp`` and the ``foregroundDeletion``
      finalizer while its dependents are deleted; once none with ``blockOwnerDeletion`` is left, it goes
      (apiserver registry/generic/registry/store.go ``updateForGracefulDeletionAndFinalizers``;
      garbagecollector ``processDeletingDependentsItem``, graph.go ``blockingDependents``)."""
    metadata = obj["metadata"]
    if metadata.get("deletionTimestamp"):
        return False
    key = (metadata.get("namespace", ""), metadata["name"])
    if resource == "pods" and key in cluster.containers:
        grace = float(obj["spec"].get("terminationGracePeriodSeconds", 30))
        metadata.update({"deletionTimestamp": now(), "deletionGracePeriodSeconds": int(grace)})
        kill(cluster, *key, on_stopped=lambda: _remove(cluster, resource, obj))
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


def _remove(cluster: Cluster, resource: str, obj: dict) -> None:
    """The object leaves storage (and with it, a pod's network and logs); owners waiting on it may go."""
    namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
    if cluster.objects[resource].get((namespace, name)) is not obj:
        return
    cluster.objects[resource].pop((namespace, name))
    if resource == "mpijobs":
        cluster.operator_specs.pop((namespace, name), None)
    if resource == "pods":
        kill(cluster, namespace, name)
        release_network(cluster, namespace, name)
        cluster.logs.pop((namespace, name), None)
    _finish_foreground(cluster)


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
