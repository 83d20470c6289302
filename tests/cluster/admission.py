"""What the Kubernetes API server accepts, for the emulated API server (``tests/cluster``).

Every object the emulator receives is held to the published schemas and answered as the real server
answers:

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

Answers, as the API server gives them (kubernetes/apimachinery v0.36 ``pkg/api/errors/errors.go``
``NewInvalid``, ``pkg/util/validation/field/errors.go``; apiserver ``pkg/endpoints/handlers/rest.go``):

- unknown fields: with ``fieldValidation=Strict`` a 400 ``... cannot be handled as a <Kind>: strict
  decoding error: unknown field "spec.foo"``; otherwise (``Warn``, the default since 1.23, what the
  Python client gets when it sends nothing) the fields are dropped and named in ``Warning: 299``
  headers;
- anything else invalid: a 422 ``Invalid`` Status whose causes name each field.

Beyond the OpenAPI schemas, the checks the API server's Go validation adds that laneflow's objects
can trip are modelled: object names, label keys and values, annotation size, container and volume
names, a Job's pod restart policy and name length, a PVC's access modes, storage request and data
source, and the VolumeSnapshot CRD's CEL rules.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cache
from importlib.resources import files
from typing import Any

import jsonschema
from referencing import Registry, Resource

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
# and spec.volumeSnapshotClassName (L144-147) are applied by `_snapshot_rules` below.
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
CRD_SCHEMAS = {
    ("kubeflow.org/v2beta1", "MPIJob"): MPIJOB_SCHEMA,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshot"): VOLUMESNAPSHOT_SCHEMA,
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): VOLUMESNAPSHOTCLASS_SCHEMA,
}


# --- answers -----------------------------------------------------------------------------------------

@dataclass
class Rejection(Exception):
    """The API server's refusal: an HTTP status and its Status body."""

    code: int
    body: dict

    def __str__(self) -> str:
        return f"{self.code} {self.body.get('reason')}: {self.body.get('message')}"


@dataclass
class Cause:
    """One field error: apimachinery's ``field.Error`` as it appears in a Status's ``details.causes``."""

    reason: str   # FieldValueRequired, FieldValueInvalid, ...
    field: str
    message: str  # the error body without the field: 'Required value', 'Invalid value: "x": ...'

    def text(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass
class Checked:
    """An accepted object (unknown fields dropped) and the warnings the server sends with it."""

    obj: dict
    warnings: list[str] = field(default_factory=list)


def _quote(value: Any) -> str:
    """How field errors print a value: strings quoted, numbers and bools plain, the rest as JSON."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def required(path: str, detail: str = "") -> Cause:
    return Cause("FieldValueRequired", path, "Required value" + (f": {detail}" if detail else ""))


def invalid(path: str, value: Any, detail: str) -> Cause:
    return Cause("FieldValueInvalid", path, f"Invalid value: {_quote(value)}: {detail}")


def not_supported(path: str, value: Any, supported: list[str]) -> Cause:
    options = ", ".join(json.dumps(option) for option in supported)
    return Cause("FieldValueNotSupported", path, f"Unsupported value: {_quote(value)}: supported values: {options}")


def invalid_status(kind: str, group: str, name: str, causes: list[Cause]) -> Rejection:
    """422 Invalid, as ``errors.NewInvalid`` renders it."""
    qualified = f"{kind}.{group}" if group else kind
    texts = [cause.text() for cause in causes]
    aggregate = texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
    return Rejection(422, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"{qualified} {json.dumps(name)} is invalid: {aggregate}", "reason": "Invalid",
        "details": {"name": name, "group": group, "kind": kind,
                    "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]},
        "code": 422})


def bad_request(message: str) -> Rejection:
    return Rejection(400, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": "BadRequest", "code": 400})


# --- schemas -----------------------------------------------------------------------------------------

@cache
def _registry() -> Registry:
    folder = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    return Resource.from_contents(definitions) @ Registry()


@cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    if (api_version, kind) in CRD_SCHEMAS:
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **CRD_SCHEMAS[(api_version, kind)]}
    else:
        folder = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
        schema = json.loads((folder / CORE_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def knows(api_version: str, kind: str) -> bool:
    return (api_version, kind) in CORE_SCHEMAS or (api_version, kind) in CRD_SCHEMAS


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _unknown_fields(errors: list[jsonschema.ValidationError]) -> list[tuple[list, str]]:
    found = []
    for error in errors:
        if error.validator == "additionalProperties" and error.validator_value is False:
            known = set(error.schema.get("properties", {}))
            for key in error.instance:
                if key not in known:
                    found.append((list(error.absolute_path), key))
    return found


def _schema_cause(error: jsonschema.ValidationError) -> Cause:
    path = _path(error.absolute_path)
    name = str(error.absolute_path[-1]) if error.absolute_path else "body"
    if error.validator == "required":
        missing = error.message.split("'")[1]
        return required(f"{path}.{missing}" if path else missing)
    if error.validator == "enum":
        return not_supported(path, error.instance, [str(v) for v in error.validator_value if v is not None])
    if error.validator in ("type", "oneOf", "anyOf"):
        kind = type(error.instance).__name__
        return Cause("FieldValueTypeInvalid", path,
                     f"Invalid value: {_quote(error.instance)}: {name} in body must be of type "
                     f"{error.validator_value if error.validator == 'type' else 'its declared type'}: \"{kind}\"")
    if error.validator == "pattern":
        return invalid(path, error.instance, f"{name} in body should match '{error.validator_value}'")
    return invalid(path, error.instance, error.message)


def _drop(obj: dict, parent: list, key: str) -> None:
    target: Any = obj
    for part in parent:
        target = target[part]
    target.pop(key, None)


# --- quantities ----------------------------------------------------------------------------------------
# apimachinery pkg/api/resource/quantity.go: ``splitRE`` and the errors ParseQuantity returns; suffix.go: the
# suffixes it knows. Core kinds decode quantities in Go, so a bad one fails the whole request with 400;
# a CRD (MPIJob) has controller-gen's pattern for resource.Quantity in its schema, so it is a 422 cause.
QUANTITY_SPLIT = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
FORMAT_WRONG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "": 1,
                     "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6,
                     "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
CRD_QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
                        r"(\.[0-9]*)?)|(\.[0-9]+))))?$")


def quantity_value(text: str) -> tuple[Decimal | None, str | None]:
    """(value, None) of a quantity as ParseQuantity reads it, or (None, the error it returns)."""
    match = QUANTITY_SPLIT.match(text)
    if match is None:
        return None, FORMAT_WRONG
    number, suffix = match.groups()
    if number.count(".") > 1 or number.lstrip("+-") in ("", "."):
        return None, "unable to parse numeric part of quantity"
    if suffix in QUANTITY_SUFFIXES:
        return Decimal(number) * Decimal(QUANTITY_SUFFIXES[suffix]), None
    exponent = re.fullmatch(r"[eE]([+-]?[0-9]+)", suffix)
    if exponent is None:
        return None, "unable to parse quantity's suffix"
    return Decimal(number) * Decimal(10) ** int(exponent[1]), None


def _pod_spec_paths(obj: dict) -> list[tuple[str, dict]]:
    """(path, pod spec) of every pod spec an object carries."""
    spec = obj.get("spec") or {}
    kind = obj["kind"]
    if kind == "Pod":
        return [("spec", spec)]
    if kind == "Job":
        return [("spec.template.spec", (spec.get("template") or {}).get("spec") or {})]
    if kind == "MPIJob":
        return [(f"spec.mpiReplicaSpecs.{role}.template.spec",
                 ((replica or {}).get("template") or {}).get("spec") or {})
                for role, replica in (spec.get("mpiReplicaSpecs") or {}).items()]
    return []


def _quantities(obj: dict) -> list[tuple[str, Any]]:
    """(path, value) of every quantity field laneflow's kinds carry."""
    found: list[tuple[str, Any]] = []
    if obj["kind"] == "PersistentVolumeClaim":
        resources = (obj.get("spec") or {}).get("resources") or {}
        for part in ("requests", "limits"):
            found += [(f"spec.resources.{part}.{name}", value) for name, value in (resources.get(part) or {}).items()]
    for path, pod in _pod_spec_paths(obj):
        for group in ("initContainers", "containers"):
            for index, container in enumerate(pod.get(group) or []):
                resources = container.get("resources") or {}
                for part in ("requests", "limits"):
                    found += [(f"{path}.{group}[{index}].resources.{part}.{name}", value)
                              for name, value in (resources.get(part) or {}).items()]
        for index, volume in enumerate(pod.get("volumes") or []):
            limit = (volume.get("emptyDir") or {}).get("sizeLimit")
            if limit is not None:
                found.append((f"{path}.volumes[{index}].emptyDir.sizeLimit", limit))
    return found


def _check_quantities(obj: dict, kind: str, group: str, version: str) -> None:
    bad = [(path, value, quantity_value(str(value))[1]) for path, value in _quantities(obj)
           if not isinstance(value, int | float) and quantity_value(str(value))[1]]
    if not bad:
        return
    if kind == "MPIJob":
        name = (obj.get("metadata") or {}).get("name", "")
        raise invalid_status(kind, group, name, [invalid(path, value, f"{path} in body should match "
                                                                     f"'{CRD_QUANTITY_PATTERN}'")
                                                 for path, value, _ in bad])
    raise bad_request(f'{kind} in version "{version}" cannot be handled as a {kind}: {bad[0][2]}')


def check(obj: Any, field_validation: str | None, *, on_create: bool = True) -> Checked:
    """Accept ``obj`` as the API server would (a copy, unknown fields dropped), or raise ``Rejection``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or "apiVersion" not in obj:
        raise bad_request("Object 'Kind' is missing in the request body")
    api_version, kind = obj["apiVersion"], obj["kind"]
    group = api_version.split("/")[0] if "/" in api_version else ""
    version = api_version.split("/")[-1]
    _check_quantities(obj, kind, group, version)
    obj = copy.deepcopy(obj)
    validator = _validator(api_version, kind)
    errors = list(validator.iter_errors(obj))
    unknown = _unknown_fields(errors)
    warnings = [f'unknown field "{_path([*parent, key])}"' for parent, key in unknown]
    if unknown and field_validation == "Strict":
        raise bad_request(f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: '
                          + ", ".join(warnings))
    for parent, key in sorted(unknown, key=lambda item: -len(item[0])):
        _drop(obj, parent, key)
    if field_validation == "Ignore":
        warnings = []
    if on_create:
        obj.pop("status", None)  # every kind here has a status subresource: status is not set on create
    errors = list(validator.iter_errors(obj))
    causes = [_schema_cause(e) for e in errors if e.validator != "additionalProperties"]
    if not causes:
        causes = _semantic_checks(obj)
    if causes:
        name = (obj.get("metadata") or {}).get("name", "")
        raise invalid_status(kind, group, name, causes)
    return Checked(obj, warnings)


# --- what Go validation adds (kubernetes/kubernetes pkg/apis/core/validation, pkg/apis/batch/validation) -

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
SUBDOMAIN_MESSAGE = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                     "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                     "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
LABEL_MESSAGE = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
                 "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation "
                 "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
LABEL_VALUE_MESSAGE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                       "and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                       "'12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
MAX_ANNOTATIONS_BYTES = 256 * 1024
PVC_ACCESS_MODES = ["ReadOnlyMany", "ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]


def _labels(labels: dict | None, path: str) -> list[Cause]:
    causes = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix))) or len(name) > 63 \
                or not _QUALIFIED_NAME.match(name):
            causes.append(invalid(path, key, "name part must consist of alphanumeric characters, '-', '_' or '.', "
                                             "and must start and end with an alphanumeric character"))
        if len(value) > 63:
            causes.append(invalid(f"{path}", value, "must be no more than 63 characters"))
        elif not _LABEL_VALUE.match(value):
            causes.append(invalid(f"{path}", value, LABEL_VALUE_MESSAGE))
    return causes


def _metadata(metadata: dict, path: str = "metadata", *, named: bool = True) -> list[Cause]:
    causes: list[Cause] = []
    name = metadata.get("name")
    if named:
        if not name and not metadata.get("generateName"):
            causes.append(required(f"{path}.name", "name or generateName is required"))
        elif name and (len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name)):
            causes.append(invalid(f"{path}.name", name, SUBDOMAIN_MESSAGE))
    causes += _labels(metadata.get("labels"), f"{path}.labels")
    size = sum(len(k) + len(v) for k, v in (metadata.get("annotations") or {}).items())
    if size > MAX_ANNOTATIONS_BYTES:
        causes.append(Cause("FieldValueTooLong", f"{path}.annotations",
                            f"Too long: may not be more than {MAX_ANNOTATIONS_BYTES} bytes"))
    return causes


def _pod_spec(spec: dict, path: str) -> list[Cause]:
    causes: list[Cause] = []
    volumes = set()
    for index, volume in enumerate(spec.get("volumes") or []):
        if not _DNS1123_LABEL.match(volume.get("name", "")):
            causes.append(invalid(f"{path}.volumes[{index}].name", volume.get("name", ""), LABEL_MESSAGE))
        volumes.add(volume.get("name"))
    for index, container in enumerate(spec.get("containers") or []):
        where = f"{path}.containers[{index}]"
        if not _DNS1123_LABEL.match(container.get("name", "")):
            causes.append(invalid(f"{where}.name", container.get("name", ""), LABEL_MESSAGE))
        if not container.get("image"):
            causes.append(required(f"{where}.image"))
        for mount_index, mount in enumerate(container.get("volumeMounts") or []):
            if mount.get("name") not in volumes:
                causes.append(Cause("FieldValueNotFound", f"{where}.volumeMounts[{mount_index}].name",
                                    f"Not found: {_quote(mount.get('name'))}"))
    return causes


def _semantic_checks(obj: dict) -> list[Cause]:
    kind = obj["kind"]
    metadata = obj.get("metadata") or {}
    causes = _metadata(metadata)
    spec = obj.get("spec") or {}
    if kind == "PersistentVolumeClaim":
        modes = spec.get("accessModes") or []
        if not modes:
            causes.append(required("spec.accessModes", "at least 1 access mode is required"))
        causes += [not_supported("spec.accessModes", mode, PVC_ACCESS_MODES) for mode in modes
                   if mode not in PVC_ACCESS_MODES]
        if "storage" not in ((spec.get("resources") or {}).get("requests") or {}):
            causes.append(required("spec.resources[storage]"))
        source = spec.get("dataSource")
        if source:
            if not source.get("name"):
                causes.append(required("spec.dataSource.name"))
            if not source.get("kind"):
                causes.append(required("spec.dataSource.kind"))
            elif not source.get("apiGroup") and source["kind"] != "PersistentVolumeClaim":
                causes.append(invalid("spec.dataSource", source["kind"],
                                      "must be 'PersistentVolumeClaim' when referencing the default apiGroup"))
    elif kind == "Job":
        template = spec.get("template") or {}
        name = metadata.get("name", "")
        # The Job controller labels its pods with the job's name (batch.kubernetes.io/job-name), so a
        # name over 63 characters cannot become a label value (pkg/apis/batch/validation).
        if len(name) > 63:
            causes.append(invalid("spec.template.labels", name, "must be no more than 63 characters"))
        causes += _labels((template.get("metadata") or {}).get("labels"), "spec.template.metadata.labels")
        pod = template.get("spec") or {}
        restart = pod.get("restartPolicy", "Always")
        if restart not in ("OnFailure", "Never"):
            causes.append(not_supported("spec.template.spec.restartPolicy", restart, ["OnFailure", "Never"]))
        causes += _pod_spec(pod, "spec.template.spec")
        if spec.get("backoffLimit", 0) < 0:
            causes.append(invalid("spec.backoffLimit", spec["backoffLimit"], "must be greater than or equal to 0"))
    elif kind == "MPIJob":
        for role, replica in (spec.get("mpiReplicaSpecs") or {}).items():
            template = replica.get("template") or {}
            causes += _labels((template.get("metadata") or {}).get("labels"),
                              f"spec.mpiReplicaSpecs[{role}].template.metadata.labels")
    elif kind == "VolumeSnapshot":
        causes += _snapshot_rules(spec)
    return causes


def _snapshot_rules(spec: dict) -> list[Cause]:
    """The VolumeSnapshot CRD's CEL rules on create, as Kubernetes >= 1.35 prints them (scalars show their
    value, objects none): volumesnapshots.yaml L120-128 and L144-147."""
    causes = []
    source = spec.get("source") or {}
    if ("persistentVolumeClaimName" in source) == ("volumeSnapshotContentName" in source):
        causes.append(Cause("FieldValueInvalid", "spec.source", "Invalid value: exactly one of "
                            "volumeSnapshotContentName and persistentVolumeClaimName must be set"))
    if spec.get("volumeSnapshotClassName") == "":
        causes.append(invalid("spec.volumeSnapshotClassName", "",
                              "volumeSnapshotClassName must not be the empty string when set"))
    return causes


def apply_crd_defaults(obj: dict) -> None:
    """Defaults the API server stores for an MPIJob (the CRD schema's ``default:`` values)."""
    if obj["kind"] != "MPIJob":
        return
    spec = obj.setdefault("spec", {})
    for key, value in MPIJOB_DEFAULTS.items():
        spec.setdefault(key, value)
    if "runPolicy" in spec:
        spec["runPolicy"].setdefault("suspend", False)
