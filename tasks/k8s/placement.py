"""Whether a pod can land on a node, judged as kube-scheduler's filters judge it (pure): what ``laneflow doctor``
answers "which pool would each of the run's pods land on" with, from the pods' rendered specs and the nodes as the
API serves them.

The filters modelled, each after its kube-scheduler plugin (kubernetes ``pkg/scheduler/framework/plugins``):
``NodeUnschedulable`` (a cordoned node, unless the pod tolerates ``node.kubernetes.io/unschedulable``),
``TaintToleration`` (every ``NoSchedule``/``NoExecute`` taint tolerated; core/v1 ``Toleration.ToleratesTaint``),
``NodeAffinity`` (``nodeSelector`` and the required node affinity's terms: any term, every expression of it) and
``NodeResourcesFit`` (the pod's requests — the sum over its containers, a limit standing for an unset request as
the API server defaults it — within the node's allocatable). Other pods' requests are not counted: the answer is
where a pod *can* land, on an empty node of the pool, not whether there is room at this moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from tasks.k8s.quantity import parse_quantity

UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether a pod with ``tolerations`` tolerates ``taint`` (k8s.io/api core/v1 ``Toleration.ToleratesTaint``)."""
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("key") and toleration["key"] != taint.get("key"):
            continue
        operator = toleration.get("operator") or "Equal"
        if operator == "Exists" or (operator == "Equal" and (toleration.get("value") or "") ==
                                    (taint.get("value") or "")):
            return True
    return False


def node_pool(node: Mapping[str, Any]) -> str:
    """The node's pool: AKS's agent pool label, else the node's own name."""
    labels = node.get("metadata", {}).get("labels") or {}
    return labels.get("kubernetes.azure.com/agentpool") or labels.get("agentpool") or node["metadata"]["name"]


def _expression_holds(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """One node selector requirement (k8s.io/component-helpers ``nodeaffinity``): In, NotIn, Exists, DoesNotExist,
    Gt, Lt (an integer label compared with the one value)."""
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(values) == 1:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _affinity_holds(affinity: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    return any(all(_expression_holds(expression, labels) for expression in term.get("matchExpressions") or [])
               for term in required.get("nodeSelectorTerms") or [])


def pod_requests(spec: Mapping[str, Any]) -> dict[str, Decimal]:
    """What a pod asks of a node: each resource summed over its containers (a limit where no request is set, as
    the API server defaults a request to its limit)."""
    asked: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, quantity in wanted.items():
            asked[name] = asked.get(name, Decimal(0)) + parse_quantity(str(quantity), name)
    return asked


def _shown(value: Decimal) -> str:
    return f"{value.normalize():f}"


def pod_unsuitability(node: Mapping[str, Any], spec: Mapping[str, Any]) -> str | None:
    """Why a pod of ``spec`` cannot land on ``node`` (a v1 Node as the API serves it), or None when it can."""
    tolerations = list(spec.get("tolerations") or [])
    labels = node.get("metadata", {}).get("labels") or {}
    node_spec, status = node.get("spec") or {}, node.get("status") or {}
    if node_spec.get("unschedulable") and not tolerates(tolerations, UNSCHEDULABLE_TAINT):
        return "cordoned"
    for taint in node_spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"taint {taint['key']}{value}:{taint['effect']} not tolerated"
    selector = spec.get("nodeSelector") or {}
    unmatched = {key: value for key, value in selector.items() if labels.get(key) != value}
    if unmatched:
        return "node selector " + ", ".join(f"{k}={v}" for k, v in unmatched.items()) + " not matched"
    if not _affinity_holds(spec.get("affinity"), labels):
        return "required node affinity not matched"
    allocatable = status.get("allocatable") or {}
    for name, asked in pod_requests(spec).items():
        have = parse_quantity(str(allocatable.get(name, "0")), name)
        if have < asked:
            return f"{_shown(have)} allocatable {name} per node, {_shown(asked)} asked"
    return None


def landing_pools(nodes: Iterable[Mapping[str, Any]], spec: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The pools where a pod of ``spec`` can land, and for every other pool why not (its first node's reason)."""
    fit: list[str] = []
    why: dict[str, str] = {}
    for node in nodes:
        pool, reason = node_pool(node), pod_unsuitability(node, spec)
        if reason is None:
            if pool not in fit:
                fit.append(pool)
        else:
            why.setdefault(pool, reason)
    return fit, {pool: reason for pool, reason in why.items() if pool not in fit}
