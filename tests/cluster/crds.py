"""The CustomResourceDefinitions of what the emulated cluster has installed (the MPI operator's, the external
snapshotter's), served read-only as ``apiextensions.k8s.io/v1`` objects: what ``kubectl get crd <name> -o yaml``
shows, with the schema the emulator validates those objects with (tests/cluster/schemas.py, cited from each
operator's CRD). A test takes a field out of one to play an older operator's CRD. Modelled: only the objects; the
API server does not build its handlers from them (the custom kinds it serves are fixed in objects.py)."""

from __future__ import annotations

import copy
from typing import Any

from tests.cluster.schemas import CRD_SCHEMAS


def _openapi(schema: Any) -> Any:
    """A JSON schema as a CRD's structural ``openAPIV3Schema``: no ``additionalProperties: false`` (a CRD prunes
    unknown fields instead of listing what it refuses)."""
    if isinstance(schema, dict):
        return {key: _openapi(value) for key, value in schema.items()
                if not (key == "additionalProperties" and value is False)}
    if isinstance(schema, list):
        return [_openapi(item) for item in schema]
    return schema


def crd(group: str, version: str, kind: str, plural: str, namespaced: bool) -> dict:
    schema = copy.deepcopy(CRD_SCHEMAS[(f"{group}/{version}", kind)])
    names = {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()}
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "names": names, "scope": "Namespaced" if namespaced else "Cluster",
                 "versions": [{"name": version, "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": _openapi(schema)}, "subresources": {"status": {}}}]},
        "status": {"acceptedNames": names, "storedVersions": [version], "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found"},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted"}]},
    }


#: What the emulated AKS cluster has installed before laneflow runs: the MPI operator v0.6.0 and the snapshotter.
INSTALLED = (("kubeflow.org", "v2beta1", "MPIJob", "mpijobs", True),
             ("snapshot.storage.k8s.io", "v1", "VolumeSnapshot", "volumesnapshots", True),
             ("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass", "volumesnapshotclasses", False))


def installed_crds() -> list[dict]:
    return [crd(*spec) for spec in INSTALLED]
