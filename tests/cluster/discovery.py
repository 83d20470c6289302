"""The API server's discovery documents (apimachinery ``pkg/apis/meta/v1/types.go`` ``APIVersions``,
``APIGroupList``, ``APIResourceList``; apiserver ``pkg/endpoints/discovery``): what a client that finds
resources by itself (kopf, in the Prefect Kubernetes worker's observer; kubectl) reads first. Built from
the resources the emulator serves (``objects.RESOURCES``), with the verbs the real endpoints have and a
``status`` subresource where the kind has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.cluster.objects import KUEUE_GROUPS, RESOURCES, RUNAI_GROUPS

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

#: What every served resource answers (apiserver ``endpoints/installer.go`` for a standard REST storage).
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
#: Kinds whose REST storage has a status subresource here (batch, core and the CRDs' ``subresources.status``).
_WITH_STATUS = {"Pod", "PersistentVolume", "PersistentVolumeClaim", "Job", "MPIJob", "VolumeSnapshot", "ClusterQueue",
                "LocalQueue", "Workload"}
#: kube-apiserver's own version (/version), the minor laneflow is tested against.
VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "gitCommit": "emulated", "gitTreeState": "clean",
           "buildDate": "2025-04-23T00:00:00Z", "goVersion": "go1.24.2", "compiler": "gc", "platform": "linux/amd64"}


def _group_versions(withheld: frozenset[str] = frozenset()) -> dict[str, str]:
    return {group: version for group, version, _, _ in RESOURCES.values() if group and group not in withheld}


def withheld_groups(cluster: Cluster) -> frozenset[str]:
    """The API groups a test took off the cluster (``cluster.withheld_groups.add("kubeflow.org")``): as on a cluster
    without that CRD (no MPI operator, no external-snapshotter), discovery does not list them and their resources'
    paths are 404."""
    return (frozenset(cluster.withheld_groups) | (frozenset() if cluster.kueue_installed else KUEUE_GROUPS)
            | (frozenset() if cluster.runai_installed else RUNAI_GROUPS))


def _resources(group: str, version: str) -> list[dict]:
    listed = []
    for resource, (owner, served, kind, namespaced) in RESOURCES.items():
        if (owner, served) != (group, version):
            continue
        if resource == "pods/log":
            listed.append({"name": resource, "singularName": "", "namespaced": True, "kind": "Pod", "verbs": ["get"]})
            continue
        if resource.endswith("/pendingworkloads"):  # the visibility API server's read-only subresource
            listed.append({"name": resource, "singularName": "", "namespaced": namespaced, "kind": kind,
                           "verbs": ["get"]})
            continue
        if resource == "pods/eviction":  # discovery lists it with policy/v1's kind (EvictionREST.GroupVersionKind)
            listed.append({"name": resource, "singularName": "", "namespaced": True, "group": "policy",
                           "version": "v1", "kind": "Eviction", "verbs": ["create"]})
            continue
        listed.append({"name": resource, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                       "verbs": _VERBS})
        if kind in _WITH_STATUS:
            listed.append({"name": f"{resource}/status", "singularName": "", "namespaced": namespaced, "kind": kind,
                           "verbs": ["get", "patch", "update"]})
    return sorted(listed, key=lambda item: item["name"])


def document(path: str, withheld: frozenset[str] = frozenset()) -> dict | None:
    """The discovery document at ``path``, or None when the path is not one (``withheld`` groups are not served)."""
    path = path.rstrip("/") or "/"
    if path == "/version":
        return VERSION
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "10.96.0.1:443"}]}
    if path == "/api/v1":
        return {"kind": "APIResourceList", "groupVersion": "v1", "resources": _resources("", "v1")}
    groups = _group_versions(withheld)
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": group, "versions": [{"groupVersion": f"{group}/{version}", "version": version}],
             "preferredVersion": {"groupVersion": f"{group}/{version}", "version": version}}
            for group, version in sorted(groups.items())]}
    parts = path.split("/")
    if len(parts) == 3 and parts[1] == "apis" and parts[2] in groups:
        version = groups[parts[2]]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": parts[2],
                "versions": [{"groupVersion": f"{parts[2]}/{version}", "version": version}],
                "preferredVersion": {"groupVersion": f"{parts[2]}/{version}", "version": version}}
    if len(parts) == 4 and parts[1] == "apis" and groups.get(parts[2]) == parts[3]:
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{parts[2]}/{parts[3]}",
                "resources": _resources(parts[2], parts[3])}
    return None
