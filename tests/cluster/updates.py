"""How the Kubernetes API server changes an existing object, for the emulated API server (``tests/cluster``):
PATCH by media type, and the fields an update may not change.

PATCH (apiserver ``pkg/endpoints/handlers/patch.go`` ``PatchResource``, ``installer.go``; apimachinery
``pkg/types/patch.go``):

- built-in kinds accept ``application/json-patch+json`` (RFC 6902: a list of operations),
  ``application/merge-patch+json`` (RFC 7386: maps merged, ``null`` deletes, lists replaced),
  ``application/strategic-merge-patch+json`` (lists merged the way each field's OpenAPI
  ``x-kubernetes-patch-strategy`` / ``x-kubernetes-patch-merge-key`` says) and
  ``application/apply-patch+yaml`` (server-side apply; ``fieldManager`` required). Custom resources
  (apiextensions-apiserver ``customresource_handler.go``) accept the same but strategic merge. Anything
  else is 415 ``UnsupportedMediaType`` naming what is accepted (``handlers/negotiation/errors.go``).
- Server-side apply is modelled as a strategic merge of the applied configuration, without field
  ownership or conflicts: nothing laneflow does applies.

Updates (kubernetes ``pkg/apis/core/validation/validation.go``, ``pkg/apis/batch/validation``,
apimachinery ``pkg/api/validation/objectmeta.go``; external-snapshotter's VolumeSnapshot CRD CEL rules):
metadata name/namespace/uid/creationTimestamp are immutable; a PVC's spec is immutable but for
``resources.requests`` (never below what it was) and ``volumeAttributesClassName``, ``volumeName`` may be
set once; a PV's volume source and ``volumeMode`` are immutable (its access modes are not — the seed's
``kubectl patch pv`` to ReadWriteMany is allowed); a Job's template, selector, completions (outside
elastic indexed jobs), completion mode, failure/success policies and ``managedBy`` are immutable; a
VolumeSnapshot's source names are immutable.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib.resources import files
from typing import Any

from tests.cluster.apierrors import Cause, Rejection, bad_request, invalid, invalid_status
from tests.cluster.quantities import quantity_value
from tests.cluster.schemas import K8S_VERSION

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
BUILT_IN_PATCH_TYPES = [JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH]
CUSTOM_PATCH_TYPES = [JSON_PATCH, MERGE_PATCH, APPLY_PATCH]
IMMUTABLE = "field is immutable"

#: (apiVersion, kind) of the built-in kinds -> their OpenAPI definition (for strategic merge).
_DEFINITIONS = {
    ("v1", "PersistentVolumeClaim"): "io.k8s.api.core.v1.PersistentVolumeClaim",
    ("v1", "PersistentVolume"): "io.k8s.api.core.v1.PersistentVolume",
    ("v1", "Pod"): "io.k8s.api.core.v1.Pod",
    ("v1", "Secret"): "io.k8s.api.core.v1.Secret",
    ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap",
    ("v1", "ServiceAccount"): "io.k8s.api.core.v1.ServiceAccount",
    ("v1", "Event"): "io.k8s.api.core.v1.Event",
    ("v1", "Namespace"): "io.k8s.api.core.v1.Namespace",
    ("v1", "LimitRange"): "io.k8s.api.core.v1.LimitRange",
    ("batch/v1", "Job"): "io.k8s.api.batch.v1.Job",
    ("storage.k8s.io/v1", "StorageClass"): "io.k8s.api.storage.v1.StorageClass",
    ("networking.k8s.io/v1", "NetworkPolicy"): "io.k8s.api.networking.v1.NetworkPolicy",
}


def unsupported_media_type(accepted: list[str]) -> Rejection:
    return Rejection(415, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": "the body of the request was in an unknown format - accepted media types "
                                      "include: " + ", ".join(accepted),
                           "reason": "UnsupportedMediaType", "code": 415})


def apply_patch(current: dict, content_type: str | None, raw: bytes, *, custom: bool,
                field_manager: str | None) -> dict:
    """``current`` with the patch applied as the API server applies a PATCH of that media type."""
    media = (content_type or "").split(";")[0].strip().lower()
    accepted = CUSTOM_PATCH_TYPES if custom else BUILT_IN_PATCH_TYPES
    if media not in accepted:
        raise unsupported_media_type(accepted)
    if media == APPLY_PATCH and not field_manager:
        raise Rejection(422, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
                                         "is required for apply patch", "reason": "Invalid",
                              "details": {"group": "meta.k8s.io", "kind": "PatchOptions", "causes": [
                                  {"reason": "FieldValueRequired", "message": "Required value: is required for "
                                                                              "apply patch",
                                   "field": "fieldManager"}]}, "code": 422})
    try:
        patch = json.loads(raw) if raw else None  # JSON is YAML: the client sends apply bodies as JSON
    except json.JSONDecodeError as exc:
        raise bad_request(f"error decoding patch: {exc}") from None
    if media == JSON_PATCH:
        if not isinstance(patch, list):
            raise bad_request(f"json: cannot unmarshal {_json_type(patch)} into Go value of type jsonpatch.Patch")
        return json_patch(current, patch)
    if not isinstance(patch, dict):
        raise bad_request(f"json: cannot unmarshal {_json_type(patch)} into Go value of type map[string]interface {{}}")
    if media == MERGE_PATCH or custom:
        return merge_patch(current, patch)
    definition = _DEFINITIONS.get((current.get("apiVersion"), current.get("kind")))
    return strategic_merge(current, patch, _definition(definition) if definition else {})


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "bool", type(None): "null"}.get(type(value), "number")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON Merge Patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(document: dict, operations: list) -> dict:
    """RFC 6902 JSON Patch (add, remove, replace, move, copy, test); a failing operation refuses the whole
    patch, as evanphx/json-patch does for the API server (422 here, with its error)."""
    result = copy.deepcopy(document)
    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise bad_request("the JSON patch is invalid: each operation needs 'op' and 'path'")
        op, path = operation["op"], operation["path"]
        try:
            if op == "add":
                result = _pointer_set(result, path, copy.deepcopy(operation["value"]), insert=True)
            elif op == "remove":
                result = _pointer_remove(result, path)
            elif op == "replace":
                _pointer_get(result, path)
                result = _pointer_set(result, path, copy.deepcopy(operation["value"]), insert=False)
            elif op in ("move", "copy"):
                value = copy.deepcopy(_pointer_get(result, operation["from"]))
                if op == "move":
                    result = _pointer_remove(result, operation["from"])
                result = _pointer_set(result, path, value, insert=True)
            elif op == "test":
                if _pointer_get(result, path) != operation["value"]:
                    raise LookupError(f"testing value {path} failed")
            else:
                raise bad_request(f"Unexpected kind: {op}")
        except (LookupError, IndexError, ValueError, TypeError) as exc:
            raise Rejection(422, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": f"the server rejected our request due to an error in our request: "
                                             f"{exc}", "reason": "Invalid", "code": 422}) from None
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {path}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _pointer_get(document: Any, path: str) -> Any:
    for part in _pointer(path):
        document = document[int(part)] if isinstance(document, list) else document[part]
    return document


def _pointer_set(document: Any, path: str, value: Any, *, insert: bool) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _pointer_get(document, "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts[:-1])) \
        if len(parts) > 1 else document
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if insert:
            if index > len(parent):
                raise IndexError(f"add operation does not apply: index {index} out of bounds")
            parent.insert(index, value)
        else:
            parent[index] = value
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise LookupError(f"doc is missing path: {path}")
    return document


def _pointer_remove(document: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _pointer_get(document, "/" + "/".join(parts[:-1])) if len(parts) > 1 else document
    last = parts[-1]
    if isinstance(parent, list):
        parent.pop(int(last))
    else:
        del parent[last]
    return document


@cache
def _all_definitions() -> dict:
    folder = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local"
    return json.loads((folder / "_definitions.json").read_text())["$defs"]


def _definition(name: str) -> dict:
    return _all_definitions()[name]


def _resolve(schema: dict) -> dict:
    reference = schema.get("$ref") or next((s.get("$ref") for s in schema.get("allOf") or [] if "$ref" in s), None)
    return _definition(reference.rsplit("/", 1)[-1]) if reference else schema


def strategic_merge(target: Any, patch: Any, schema: dict) -> Any:
    """Strategic merge (apimachinery ``pkg/util/strategicpatch``): maps merge and ``null`` deletes; a list
    whose field says ``x-kubernetes-patch-strategy: merge`` merges its items by the merge key (``$patch:
    delete`` removes one) or, for scalars, keeps the union; any other list is replaced."""
    schema = _resolve(schema)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    properties = schema.get("properties") or {}
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {key: copy.deepcopy(value) for key, value in patch.items() if key != "$patch"}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):  # only the order of a merged list: kept as it merges
            continue
        if key.startswith("$"):
            raise bad_request(f"strategic merge directive {key} is not modelled by the emulator "
                              "(tests/cluster/updates.py); the real API server applies it")
        field_schema = properties.get(key) or {}
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and "merge" in str(field_schema.get("x-kubernetes-patch-strategy", "")):
            result[key] = _merge_list(result.get(key) or [], value, field_schema)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value, field_schema)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(current: list, patch: list, schema: dict) -> list:
    key = schema.get("x-kubernetes-patch-merge-key")
    if key is None:  # a list of scalars (finalizers): the union, in order
        return list(current) + [item for item in patch if item not in current]
    items_schema = schema.get("items") or {}
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {key}")
        position = next((i for i, existing in enumerate(merged) if existing.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if position is not None:
                merged.pop(position)
            continue
        if "$patch" in item:
            raise bad_request(f"strategic merge directive $patch: {item['$patch']} in a list item is not modelled "
                              "by the emulator (tests/cluster/updates.py)")
        if position is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[position] = strategic_merge(merged[position], item, items_schema)
    return merged


# --- what an update may not change -------------------------------------------------------------------

def forbidden(path: str, detail: str) -> Cause:
    return Cause("FieldValueForbidden", path, f"Forbidden: {detail}")


def _diff(old: Any, new: Any) -> str:
    """Stands in for the ``cmp.Diff`` the API server appends (its exact layout is Go's, not worth copying)."""
    return f"  - {json.dumps(old, sort_keys=True)}\n  + {json.dumps(new, sort_keys=True)}"


def immutable_changes(old: dict, new: dict) -> list[Cause]:
    """The causes an update of ``old`` to ``new`` is refused for (empty when it may be made)."""
    causes = []
    for field in ("name", "namespace", "uid"):
        if old["metadata"].get(field) != new["metadata"].get(field):
            causes.append(invalid(f"metadata.{field}", new["metadata"].get(field), IMMUTABLE))
    kind, old_spec, new_spec = old.get("kind"), old.get("spec") or {}, new.get("spec") or {}
    if kind == "PersistentVolumeClaim":
        causes += _claim_changes(old_spec, new_spec)
    elif kind == "PersistentVolume":
        sources = {key for key in (*old_spec, *new_spec) if key not in _PV_SPEC_FIELDS}
        old_source = {key: old_spec[key] for key in sources if key in old_spec}
        new_source = {key: new_spec[key] for key in sources if key in new_spec}
        if old_source != new_source:
            causes.append(forbidden("spec.persistentvolumesource", "spec.persistentvolumesource is immutable after "
                                                                   f"creation\n{_diff(old_source, new_source)}"))
        if old_spec.get("volumeMode") != new_spec.get("volumeMode"):
            causes.append(invalid("volumeMode", new_spec.get("volumeMode"), IMMUTABLE))
    elif kind == "Job":
        for field in ("template", "selector", "completionMode", "podFailurePolicy", "backoffLimitPerIndex",
                      "managedBy", "successPolicy"):
            if old_spec.get(field) != new_spec.get(field):
                causes.append(invalid(f"spec.{field}", new_spec.get(field), IMMUTABLE))
        elastic = new_spec.get("completionMode") == "Indexed" and \
            new_spec.get("completions") == new_spec.get("parallelism")
        if old_spec.get("completions") != new_spec.get("completions") and not elastic:
            causes.append(invalid("spec.completions", new_spec.get("completions"), IMMUTABLE))
    elif kind == "VolumeSnapshot":
        old_source, new_source = old_spec.get("source") or {}, new_spec.get("source") or {}
        for field in ("persistentVolumeClaimName", "volumeSnapshotContentName"):
            if field in old_source and old_source.get(field) != new_source.get(field):
                causes.append(invalid(f"spec.source.{field}", new_source.get(field), f"{field} is immutable"))
    return causes


#: PersistentVolumeSpec's fields that are not its volume source (``PersistentVolumeSource`` is inlined).
_PV_SPEC_FIELDS = {"accessModes", "capacity", "claimRef", "mountOptions", "nodeAffinity",
                   "persistentVolumeReclaimPolicy", "storageClassName", "volumeAttributesClassName", "volumeMode"}


def _claim_changes(old_spec: dict, new_spec: dict) -> list[Cause]:
    causes = []
    comparable_old = {k: v for k, v in old_spec.items() if k not in ("resources", "volumeAttributesClassName")}
    comparable_new = {k: v for k, v in new_spec.items() if k not in ("resources", "volumeAttributesClassName")}
    if not old_spec.get("volumeName"):  # set once, by the binder
        comparable_new.pop("volumeName", None)
    old_limits = (old_spec.get("resources") or {}).get("limits")
    requests_changed = (old_spec.get("resources") or {}).get("requests") != (new_spec.get("resources") or {}).get(
        "requests")
    unbound = not old_spec.get("volumeName")  # requests may change only for bound claims
    if comparable_old != comparable_new or old_limits != (new_spec.get("resources") or {}).get("limits") or \
            (unbound and requests_changed):
        causes.append(forbidden("spec", "spec is immutable after creation except resources.requests and "
                                        f"volumeAttributesClassName for bound claims\n"
                                        f"{_diff(comparable_old, comparable_new)}"))
    old_size = ((old_spec.get("resources") or {}).get("requests") or {}).get("storage")
    new_size = ((new_spec.get("resources") or {}).get("requests") or {}).get("storage")
    if old_size is not None and new_size is not None and \
            (quantity_value(str(new_size))[0] or 0) < (quantity_value(str(old_size))[0] or 0):
        causes.append(Cause("FieldValueForbidden", "spec.resources.requests.storage",
                            "Forbidden: field can not be less than previous value"))
    return causes


def check_update(old: dict, new: dict) -> None:
    """Refuse an update as the API server's update validation refuses it (422 Invalid)."""
    causes = immutable_changes(old, new)
    if causes:
        api_version = old.get("apiVersion", "")
        group = api_version.split("/")[0] if "/" in api_version else ""
        raise invalid_status(old["kind"], group, old["metadata"]["name"], causes)
