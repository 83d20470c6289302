"""The schemas the emulated API server holds every object to (``admission.py`` applies them):

- core kinds (PVC, PV, Job, ...) against the Kubernetes OpenAPI schemas of ``K8S_VERSION`` as packaged
  by ``kubernetes-validate`` (PyPI), in their strict form (``additionalProperties: false``) so unknown
  fields are found;
- ``MPIJob`` (kubeflow.org/v2beta1) and ``VolumeSnapshot`` / ``VolumeSnapshotClass``
  (snapshot.storage.k8s.io/v1) against schemas written here from the upstream CRDs. We do not vendor
  the CRD files; each schema below says which upstream file, version and lines it renders:
  kubeflow/mpi-operator ``manifests/base/kubeflow.org_mpijobs.yaml`` at v0.8.x (commit caa3c47,
  Apache-2.0) and kubernetes-csi/external-snapshotter ``client/config/crd/`` at v8.6.0 (commit
  78e32cd, Apache-2.0). The MPIJob CRD embeds the full PodSpec (it has no
  ``x-kubernetes-preserve-unknown-fields``), so its pod templates are checked with the same core
  PodSpec schema as a Job's.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files

import jsonschema
from referencing import Registry, Resource

from tests.cluster.kueue_schemas import KUEUE_SCHEMAS

#: The Kubernetes release whose API the emulator plays (kubernetes-validate bundles 1.25-1.37).
K8S_VERSION = "1.35.0"
_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"

#: (apiVersion, kind) -> kubernetes-validate schema file, for the core kinds the emulator serves.
CORE_SCHEMAS = {
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaim-v1.json",
    ("v1", "PersistentVolume"): "persistentvolume-v1.json",
    ("v1", "Pod"): "pod-v1.json",
    ("v1", "Event"): "event-v1.json",
    ("v1", "ServiceAccount"): "serviceaccount-v1.json",
    ("v1", "Secret"): "secret-v1.json",
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "Namespace"): "namespace-v1.json",
    ("v1", "LimitRange"): "limitrange-v1.json",
    ("batch/v1", "Job"): "job-batch-v1.json",
    ("rbac.authorization.k8s.io/v1", "Role"): "role-rbac-v1.json",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebinding-rbac-v1.json",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "clusterrole-rbac-v1.json",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "clusterrolebinding-rbac-v1.json",
    ("storage.k8s.io/v1", "StorageClass"): "storageclass-storage-v1.json",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudget-policy-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicy-networking-v1.json",
    ("policy/v1", "Eviction"): "eviction-policy-v1.json",
}


def _string_map() -> dict:
    return {"type": "object", "additionalProperties": {"type": "string"}}


# --- MPIJob kubeflow.org/v2beta1: kubeflow.org_mpijobs.yaml (caa3c47) ------------------------------
# L56-8672 ReplicaSpec: replicas (int32, no CRD default), restartPolicy (string, NO enum: the values
# are checked by the controller), template (PodTemplateSpec whose metadata keeps only the five
# fields below; spec is the full PodSpec with `required: [containers]`).
_REPLICA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1},
        "restartPolicy": {"type": "string"},
        "template": {"type": "object", "additionalProperties": False, "properties": {
            "metadata": {"type": "object", "additionalProperties": False, "properties": {
                "annotations": _string_map(), "finalizers": {"type": "array", "items": {"type": "string"}},
                "labels": _string_map(), "name": {"type": "string"}, "namespace": {"type": "string"}}},
            "spec": {"$ref": _DEFS + "io.k8s.api.core.v1.PodSpec"}}},
    },
}
_INT32 = {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
_CONDITION = {"type": "object", "required": ["status", "type"], "additionalProperties": False, "properties": {
    "type": {"type": "string"}, "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
    "reason": {"type": "string"}, "message": {"type": "string"},
    "lastUpdateTime": {"type": "string", "format": "date-time"},
    "lastTransitionTime": {"type": "string", "format": "date-time"}}}
MPIJOB_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object"},
        # spec L38-8802: `required: [mpiReplicaSpecs]`; enum only on mpiImplementation (types.go L195's
        # `Enum:` marker typo leaves launcherCreationPolicy without one).
        "spec": {"type": "object", "required": ["mpiReplicaSpecs"], "additionalProperties": False, "properties": {
            "launcherCreationPolicy": {"type": "string"},
            "mpiImplementation": {"type": "string", "enum": ["OpenMPI", "Intel", "MPICH"]},
            "mpiReplicaSpecs": {"type": "object", "additionalProperties": _REPLICA},
            "runLauncherAsWorker": {"type": "boolean"},
            "runPolicy": {"type": "object", "additionalProperties": False, "properties": {
                "activeDeadlineSeconds": {"type": "integer"}, "backoffLimit": _INT32,
                "cleanPodPolicy": {"type": "string"}, "managedBy": {"type": "string"},
                "schedulingPolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "minAvailable": _INT32, "minResources": {"type": "object"}, "priorityClass": {"type": "string"},
                    "queue": {"type": "string"}, "scheduleTimeoutSeconds": _INT32}},
                "suspend": {"type": "boolean"}, "ttlSecondsAfterFinished": _INT32}},
            "slotsPerWorker": _INT32,
            "sshAuthMountPath": {"type": "string"}}},
        # status L8803-8943 (a status subresource: ignored on create).
        "status": {"type": "object", "additionalProperties": False, "properties": {
            "conditions": {"type": "array", "items": _CONDITION},
            "replicaStatuses": {"type": "object"}, "startTime": {"type": "string"},
            "completionTime": {"type": "string"}, "lastReconcileTime": {"type": "string"}}},
    },
}
#: Defaults the API server persists from the CRD's schema (L40-8794): `default:` values.
MPIJOB_DEFAULTS = {"slotsPerWorker": 1, "runLauncherAsWorker": False, "sshAuthMountPath": "/root/.ssh",
                   "launcherCreationPolicy": "AtStartup", "mpiImplementation": "OpenMPI"}

# --- VolumeSnapshot snapshot.storage.k8s.io/v1: snapshot.storage.k8s.io_volumesnapshots.yaml (v8.6.0) -
# L62-237: root `required: [spec]`; spec `required: [source]`; the CEL rules on spec.source (L120-128)
# and spec.volumeSnapshotClassName (L144-147) are applied by `admission._snapshot_rules`.
VOLUMESNAPSHOT_SCHEMA = {
    "type": "object", "required": ["spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
        "spec": {"type": "object", "required": ["source"], "additionalProperties": False, "properties": {
            "source": {"type": "object", "additionalProperties": False, "properties": {
                "persistentVolumeClaimName": {"type": "string"},
                "volumeSnapshotContentName": {"type": "string"}}},
            "volumeSnapshotClassName": {"type": "string"}}},
        "status": {"type": "object", "additionalProperties": False, "properties": {
            "boundVolumeSnapshotContentName": {"type": "string"}, "creationTime": {"type": "string"},
            "error": {"type": "object", "additionalProperties": False, "properties": {
                "message": {"type": "string"}, "time": {"type": "string"}}},
            "readyToUse": {"type": "boolean"},
            "restoreSize": {"type": ["string", "integer"]}, "volumeGroupSnapshotName": {"type": "string"}}},
    },
}
# snapshot.storage.k8s.io_volumesnapshotclasses.yaml (v8.6.0) L49-85: cluster-scoped, no spec.
VOLUMESNAPSHOTCLASS_SCHEMA = {
    "type": "object", "required": ["deletionPolicy", "driver"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
        "deletionPolicy": {"type": "string", "enum": ["Delete", "Retain"]},
        "driver": {"type": "string"}, "parameters": _string_map(),
    },
}
#: Run:ai's Queue (NVIDIA/KAI-Scheduler deployments/kai-scheduler/crds/scheduling.run.ai_queues.yaml, v2, the only
#: version served): each resource's quota, limit and over-quota weight are numbers (GPU in device fractions, CPU
#: in millicores, memory in MB; quota -1: unlimited, limit -1: no limit), priority an integer.
_QUEUE_RESOURCE = {"type": "object", "properties": {
    "quota": {"type": "number"}, "limit": {"type": "number"}, "overQuotaWeight": {"type": "number"}}}
QUEUE_SCHEMA = {"type": "object", "properties": {
    "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
    "spec": {"type": "object", "properties": {
        "displayName": {"type": "string"}, "parentQueue": {"type": "string"}, "priority": {"type": "integer"},
        "preemptMinRuntime": {"type": "string"}, "reclaimMinRuntime": {"type": "string"},
        "resources": {"type": "object", "properties": {
            "cpu": _QUEUE_RESOURCE, "gpu": _QUEUE_RESOURCE, "memory": _QUEUE_RESOURCE}}}},
    "status": {"type": "object"}}}
CRD_SCHEMAS = {
    **KUEUE_SCHEMAS,
    ("scheduling.run.ai/v2", "Queue"): QUEUE_SCHEMA,
    ("kubeflow.org/v2beta1", "MPIJob"): MPIJOB_SCHEMA,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshot"): VOLUMESNAPSHOT_SCHEMA,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): VOLUMESNAPSHOTCLASS_SCHEMA,
}


# --- validators ---------------------------------------------------------------------------------------

@cache
def _registry() -> Registry:
    folder = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    return Resource.from_contents(definitions) @ Registry()


@cache
def schema_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    if (api_version, kind) in CRD_SCHEMAS:
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **CRD_SCHEMAS[(api_version, kind)]}
    else:
        folder = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
        schema = json.loads((folder / CORE_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def knows(api_version: str, kind: str) -> bool:
    return (api_version, kind) in CORE_SCHEMAS or (api_version, kind) in CRD_SCHEMAS
