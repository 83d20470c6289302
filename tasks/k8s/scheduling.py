"""Where training workers may run and what they reserve: tolerations, a node selector, affinity, a priority
class and CPU/memory requests (pure; the cluster block's scheduling fields, applied by ``manifests``).

Why: GPU node pools are tainted so that other pods stay off them — AKS recommends ``sku=gpu:NoSchedule`` for
GPU pools, and taints every spot pool ``kubernetes.azure.com/scalesetpriority=spot:NoSchedule`` — so a
worker without the matching tolerations is never scheduled there. A worker without requests is
``BestEffort``, the first pod the kubelet evicts under memory pressure.

Everything is checked when the block is made, as the API server would check it when the MPIJob arrives
(``fieldValidation=Strict`` and ``pkg/apis/core/validation``), so a typo fails at once, not at the training
stage: every field name and type against the ``kubernetes`` client's models (generated from the API's
published OpenAPI document), plus the value rules the API server applies to tolerations
(``ValidateTolerations``), node selector labels (``ValidateLabels``) and resources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import kubernetes.client.models as k8s_models

from tasks.k8s.quantity import parse_quantity, validate_size
from tasks.names import validate_subdomain

_LIST = re.compile(r"^(?:list|List)\[(?P<item>.+)\]$")
_DICT = re.compile(r"^(?:dict\(str, |Dict\[str, )(?P<value>.+)[)\]]$")
#: A label key: an optional DNS subdomain prefix and a name of at most 63 characters; a value: at most 63
#: characters, alphanumeric at both ends (k8s.io/apimachinery ``validation.IsQualifiedName``/``IsValidLabelValue``).
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
QualityOfService = Literal["burstable", "guaranteed"]


def check_fields(value: Any, type_name: str, where: str) -> None:
    """Refuse what the API server refuses under strict field validation: an unknown field, a value of the wrong
    type, a required field left out — by the ``kubernetes`` client's model ``type_name`` (e.g. ``V1Toleration``)."""
    if type_name in ("object", "float", "bool") and not (type_name == "bool" and not isinstance(value, bool)):
        return
    if type_name == "bool":
        raise ValueError(f"{where} must be true or false, not {value!r}")
    if type_name == "str":
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, not {value!r}")
        return
    if type_name == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where} must be a whole number, not {value!r}")
        return
    if listed := _LIST.match(type_name):
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, not {value!r}")
        for index, item in enumerate(value):
            check_fields(item, listed["item"], f"{where}[{index}]")
        return
    if mapped := _DICT.match(type_name):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, not {value!r}")
        for key, item in value.items():
            check_fields(item, mapped["value"], f"{where}.{key}")
        return
    model = getattr(k8s_models, type_name)
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping ({type_name}), not {value!r}")
    known = {wire: python for python, wire in model.attribute_map.items()}
    if unknown := sorted(set(value) - set(known)):
        raise ValueError(f"{where} has no field {unknown[0]!r}; a {type_name.removeprefix('V1')} has "
                         f"{', '.join(sorted(known))}")
    for wire, item in value.items():
        check_fields(item, model.openapi_types[known[wire]], f"{where}.{wire}")
    try:  # the client's own checks: required fields, enums it knows
        model(**{known[wire]: item for wire, item in value.items()})
    except ValueError as exc:
        errors = getattr(exc, "errors", None)  # a pydantic model's: one line per field
        said = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg'].lower()}" for error in errors()) \
            if callable(errors) else str(exc)
        raise ValueError(f"{where}: {said}") from None


def check_tolerations(tolerations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tolerations as the API server accepts them (``ValidateTolerations``)."""
    check_fields(tolerations, "list[V1Toleration]", "tolerations")
    for index, toleration in enumerate(tolerations):
        where, operator = f"tolerations[{index}]", toleration.get("operator", "Equal")
        if operator not in ("Equal", "Exists"):
            raise ValueError(f"{where}.operator must be Equal or Exists, not {operator!r}")
        if operator == "Exists" and toleration.get("value"):
            raise ValueError(f"{where}: a value must be empty when the operator is Exists")
        if not toleration.get("key") and operator != "Exists":
            raise ValueError(f"{where}: without a key the operator must be Exists (to tolerate every taint)")
        if toleration.get("key"):
            check_label_key(toleration["key"], f"{where}.key")
        if toleration.get("value") and not _LABEL_VALUE.match(toleration["value"]):
            raise ValueError(f"{where}.value {toleration['value']!r} is not a valid label value")
        effect = toleration.get("effect", "")
        if effect not in TAINT_EFFECTS:
            raise ValueError(f"{where}.effect must be one of NoSchedule, PreferNoSchedule, NoExecute (or empty for "
                             f"all), not {effect!r}")
        if toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
            raise ValueError(f"{where}: tolerationSeconds applies to the NoExecute effect only")
    return tolerations


def check_label_key(key: str, where: str) -> str:
    """A label key: ``[prefix/]name`` (a DNS subdomain prefix; a name of at most 63 characters)."""
    prefix, _, name = key.rpartition("/")
    if prefix:
        validate_subdomain(prefix, f"{where} prefix")
    if not _LABEL_NAME.match(name):
        raise ValueError(f"{where} {key!r} is not a valid label key: at most 63 characters of letters, digits, "
                         "'-', '_' and '.', starting and ending with a letter or digit, after an optional DNS prefix/")
    return key


def check_node_selector(selector: dict[str, str]) -> dict[str, str]:
    check_fields(selector, "dict(str, str)", "node_selector")
    for key, value in selector.items():
        check_label_key(key, "node_selector key")
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"node_selector value {value!r} of {key!r} is not a valid label value")
    return selector


def check_affinity(affinity: dict[str, Any] | None) -> dict[str, Any] | None:
    if affinity is not None:
        check_fields(affinity, "V1Affinity", "affinity")
    return affinity


@dataclass(frozen=True)
class WorkerScheduling:
    """The scheduling of the pods that need a GPU node (an MPIJob's workers), from the cluster block."""

    tolerations: list[dict[str, Any]] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    affinity: dict[str, Any] | None = None
    priority_class: str | None = None
    cpu: str | None = None
    memory: str | None = None
    #: ``guaranteed``: limits equal to the requests (the last pods evicted); ``burstable``: requests only.
    quality_of_service: QualityOfService = "burstable"

    def __post_init__(self) -> None:
        check_tolerations(self.tolerations)
        check_node_selector(self.node_selector)
        check_affinity(self.affinity)
        if self.priority_class is not None:
            validate_subdomain(self.priority_class, "priority_class")
        if self.cpu is not None and parse_quantity(self.cpu, "worker_cpu") <= 0:
            raise ValueError(f"worker_cpu {self.cpu!r} must be more than 0 (e.g. 4 or 3500m)")
        if self.memory is not None:
            validate_size(self.memory, "worker_memory")
        if self.quality_of_service == "guaranteed" and not (self.cpu and self.memory):
            raise ValueError("worker_qos guaranteed needs worker_cpu and worker_memory: a Guaranteed pod's limits "
                             "equal its requests for both")

    def resources(self, gpus: int) -> dict[str, dict[str, str]]:
        """The worker container's resources: its GPUs, and the CPU and memory it reserves."""
        requests = {name: value for name, value in (("cpu", self.cpu), ("memory", self.memory)) if value}
        limits = {"nvidia.com/gpu": str(gpus), **(requests if self.quality_of_service == "guaranteed" else {})}
        return {"limits": limits, **({"requests": requests} if requests else {})}

    def pod_fields(self) -> dict[str, Any]:
        """What the worker pod spec gains: only the settings that are set, so a default block renders as before."""
        fields: dict[str, Any] = {}
        if self.tolerations:
            fields["tolerations"] = [dict(toleration) for toleration in self.tolerations]
        if self.node_selector:
            fields["nodeSelector"] = dict(self.node_selector)
        if self.affinity:
            fields["affinity"] = self.affinity
        if self.priority_class:
            fields["priorityClassName"] = self.priority_class
        return fields
