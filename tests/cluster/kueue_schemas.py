"""Kueue's CRDs (kubernetes-sigs/kueue v0.19.2, commit 8eab687, ``config/components/crd/bases``), storage
version ``kueue.x-k8s.io/v1beta2``: what the emulator checks of the fields it models (required fields, types
and enums of ``apis/kueue/v1beta2/*_types.go``); the fields it does not model are kept as sent."""

from __future__ import annotations

_META = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
_QUANTITY = {"type": ["string", "integer", "number"]}
_TOLERATION = {"type": "object", "properties": {
    "key": {"type": "string"}, "operator": {"type": "string", "enum": ["Exists", "Equal"]},
    "value": {"type": "string"}, "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
    "tolerationSeconds": {"type": "integer"}}}
_CONDITIONS = {"type": "array", "items": {"type": "object", "required": ["type", "status"]}}

#: resourceflavor_types.go: nodeLabels (at most 8), nodeTaints, tolerations (at most 8 each).
RESOURCEFLAVOR_SCHEMA = {"type": "object", "properties": {**_META, "spec": {"type": "object", "properties": {
    "nodeLabels": {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 8},
    "nodeTaints": {"type": "array", "maxItems": 8, "items": {"type": "object", "required": ["key", "effect"]}},
    "tolerations": {"type": "array", "maxItems": 8, "items": _TOLERATION},
    "topologyName": {"type": "string"}}}}}

_FLAVOR_QUOTAS = {"type": "object", "required": ["name", "resources"], "properties": {
    "name": {"type": "string"},
    "resources": {"type": "array", "minItems": 1, "maxItems": 64, "items": {
        "type": "object", "required": ["name", "nominalQuota"], "properties": {
            "name": {"type": "string"}, "nominalQuota": _QUANTITY, "borrowingLimit": _QUANTITY,
            "lendingLimit": _QUANTITY}}}}}
#: clusterqueue_types.go: resourceGroups (at most 16; coveredResources at most 64, flavors at most 64).
CLUSTERQUEUE_SCHEMA = {"type": "object", "properties": {**_META, "spec": {"type": "object", "properties": {
    "resourceGroups": {"type": "array", "maxItems": 16, "items": {
        "type": "object", "required": ["coveredResources", "flavors"], "properties": {
            "coveredResources": {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "string"}},
            "flavors": {"type": "array", "minItems": 1, "maxItems": 64, "items": _FLAVOR_QUOTAS}}}},
    "cohortName": {"type": "string"},
    "queueingStrategy": {"type": "string", "enum": ["StrictFIFO", "BestEffortFIFO"]},
    "namespaceSelector": {"type": "object"},
    "preemption": {"type": "object", "properties": {
        "withinClusterQueue": {"type": "string", "enum": ["Never", "LowerPriority", "LowerOrNewerEqualPriority"]},
        "reclaimWithinCohort": {"type": "string", "enum": ["Never", "LowerPriority", "Any"]}}},
    "stopPolicy": {"type": "string", "enum": ["None", "Hold", "HoldAndDrain"]}}},
    "status": {"type": "object"}}}

#: localqueue_types.go: clusterQueue is required and immutable.
LOCALQUEUE_SCHEMA = {"type": "object", "properties": {**_META, "spec": {
    "type": "object", "required": ["clusterQueue"], "properties": {
        "clusterQueue": {"type": "string", "maxLength": 253},
        "stopPolicy": {"type": "string", "enum": ["None", "Hold", "HoldAndDrain"]}}},
    "status": {"type": "object"}}}

#: workloadpriorityclass_types.go: value is required.
WORKLOADPRIORITYCLASS_SCHEMA = {"type": "object", "required": ["value"], "properties": {
    **_META, "value": {"type": "integer"}, "description": {"type": "string"}}}

#: workload_types.go: podSets (1 to 8, each with a name, a count and a pod template), queueName.
WORKLOAD_SCHEMA = {"type": "object", "properties": {**_META, "spec": {"type": "object", "properties": {
    "podSets": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
        "type": "object", "required": ["name", "count", "template"], "properties": {
            "name": {"type": "string"}, "count": {"type": "integer", "minimum": 0},
            "minCount": {"type": "integer", "minimum": 1}, "template": {"type": "object"}}}},
    "queueName": {"type": "string"}, "priority": {"type": "integer"},
    "priorityClassRef": {"type": "object"}, "active": {"type": "boolean"}}},
    "status": {"type": "object", "properties": {"conditions": _CONDITIONS, "admission": {"type": "object"}}}}}

KUEUE_SCHEMAS = {
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): RESOURCEFLAVOR_SCHEMA,
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): CLUSTERQUEUE_SCHEMA,
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): LOCALQUEUE_SCHEMA,
    ("kueue.x-k8s.io/v1beta2", "Workload"): WORKLOAD_SCHEMA,
    ("kueue.x-k8s.io/v1beta2", "WorkloadPriorityClass"): WORKLOADPRIORITYCLASS_SCHEMA,
}
