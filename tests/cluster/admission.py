"""What the Kubernetes API server accepts, for the emulated API server (``tests/cluster``).

Every object the emulator receives is held to the published schemas (``schemas.py``: the core kinds'
OpenAPI schemas, the MPIJob and VolumeSnapshot CRDs' schemas written from their upstream files) and
answered as the real server answers (``apierrors.py``); its quantities are read as the API server reads
them (``quantities.py``).

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

And the admission plugins that read what the cluster holds: LimitRanger (a namespace's LimitRange
defaults for a pod's containers) and PersistentVolumeClaimResize (a larger claim needs a class that
allows expansion). (NamespaceLifecycle is in ``apiserver.py``; the ServiceAccount plugin in
``pod_control.py``.)
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jsonschema

from tests.cluster.apierrors import (
    Cause,
    Rejection,
    bad_request,
    invalid,
    invalid_status,
    not_supported,
    quote,
    required,
    status_body,
)
from tests.cluster.quantities import check_quantities, quantity_bytes
from tests.cluster.schemas import MPIJOB_DEFAULTS, schema_validator

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


@dataclass
class Checked:
    """An accepted object (unknown fields dropped) and the warnings the server sends with it."""

    obj: dict
    warnings: list[str] = field(default_factory=list)


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
                     f"Invalid value: {quote(error.instance)}: {name} in body must be of type "
                     f"{error.validator_value if error.validator == 'type' else 'its declared type'}: \"{kind}\"")
    if error.validator == "pattern":
        return invalid(path, error.instance, f"{name} in body should match '{error.validator_value}'")
    return invalid(path, error.instance, error.message)


def _drop(obj: dict, parent: list, key: str) -> None:
    target: Any = obj
    for part in parent:
        target = target[part]
    target.pop(key, None)


def check(obj: Any, field_validation: str | None, *, on_create: bool = True) -> Checked:
    """Accept ``obj`` as the API server would (a copy, unknown fields dropped), or raise ``Rejection``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or "apiVersion" not in obj:
        raise bad_request("Object 'Kind' is missing in the request body")
    api_version, kind = obj["apiVersion"], obj["kind"]
    group = api_version.split("/")[0] if "/" in api_version else ""
    version = api_version.split("/")[-1]
    check_quantities(obj, kind, group, version)
    obj = copy.deepcopy(obj)
    validator = schema_validator(api_version, kind)
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
                                    f"Not found: {quote(mount.get('name'))}"))
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


# --- admission plugins that read the cluster ------------------------------------------------------------

def limit_range_defaults(cluster: Cluster, namespace: str, spec: dict) -> None:
    """The LimitRanger admission plugin (plugin/pkg/admission/limitranger/admission.go
    ``defaultContainerResourceRequirements``/``mergeContainerResources``): each ``type: Container`` limit of
    the namespace's LimitRanges gives a container its ``default`` limits and ``defaultRequest`` requests for
    the resources it does not set itself."""
    for (ns, _), limit_range in cluster.objects["limitranges"].items():
        if ns != namespace:
            continue
        for item in (limit_range.get("spec") or {}).get("limits") or []:
            if item.get("type") != "Container":
                continue
            for container in spec.get("containers") or []:
                resources = container.setdefault("resources", {})
                for field_name, defaults in (("limits", item.get("default")), ("requests", item.get("defaultRequest"))):
                    for resource, quantity in (defaults or {}).items():
                        resources.setdefault(field_name, {}).setdefault(resource, quantity)


def check_resize(cluster: Cluster, current: dict, changed: dict) -> None:
    """The PersistentVolumeClaimResize admission plugin (plugin/pkg/admission/storage/persistentvolume/resize):
    a larger request needs a bound, dynamically provisioned claim whose class allows expansion."""
    def size(claim: dict) -> int:
        return quantity_bytes(str(claim["spec"]["resources"]["requests"]["storage"]))
    if size(changed) <= size(current):
        return
    storage_class = cluster.objects["storageclasses"].get(("", current["spec"].get("storageClassName") or ""))
    if (current.get("status") or {}).get("phase") != "Bound" or not storage_class or \
            not storage_class.get("allowVolumeExpansion"):
        raise Rejection(403, status_body(403, "Forbidden", f'persistentvolumeclaims "{current["metadata"]["name"]}" '
                                         "is forbidden: only dynamically provisioned pvc can be resized and the "
                                         "storageclass that provisions the pvc must support resize"))
