"""Voluntary disruptions as Kubernetes runs them: the eviction subresource and PodDisruptionBudgets.

- ``POST pods/<name>/eviction`` (kubernetes ``pkg/registry/core/pod/storage/eviction.go`` ``EvictionREST.Create``):
  the body is a policy/v1 ``Eviction`` naming the pod (400 when the names differ); a pod that is Pending,
  terminal or already being deleted is deleted without looking at budgets (``canIgnorePDB``); a budget whose
  selector is empty (``{}``) covers every pod of its namespace, a null one none (policy/v1); more than one
  budget matching the pod is a 500 ``This pod has more than one PodDisruptionBudget, which the eviction
  subresource does not support.``; a budget that allows no disruption is a 429 ``Cannot evict pod as it
  would violate the pod's disruption budget.`` with a ``DisruptionBudget`` cause naming what it needs
  (``checkAndDecrement``), which ``kubectl drain`` retries every 5 s; else the budget's
  ``disruptionsAllowed`` goes down by one, the pod is recorded in its ``disruptedPods`` and deleted
  gracefully (its own grace period, or the Eviction's ``deleteOptions.gracePeriodSeconds``), after the
  ``DisruptionTarget`` condition (reason ``EvictionByEvictionAPI``, "Eviction API: evicting") is put on it
  (``addConditionAndDeletePod``, Kubernetes 1.26+; PodDisruptionConditions is GA since 1.31). The answer is
  201 with a ``Success`` Status.
- A budget's status, as the disruption controller keeps it (``pkg/controller/disruption/disruption.go``
  ``trySync``): an integer ``minAvailable`` needs that many healthy pods of those the selector matches
  (``getExpectedPodCount``: the matched pods are the expected count); ``currentHealthy`` counts the Ready
  ones not being deleted nor recorded as disrupted (``countHealthyPods``); ``disruptionsAllowed`` is
  ``currentHealthy - desiredHealthy``, never below 0. ``maxUnavailable`` and percentages need the scale of the
  pods' controller, which an MPIJob does not have (no scale subresource): the controller fails safe, 0
  disruptions allowed (``failSafe``). Computed when an eviction reads it, which is what a controller that is
  never behind would have written.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from tests.cluster.admission import check
from tests.cluster.apierrors import Rejection, status_body
from tests.cluster.garbage_collector import delete
from tests.cluster.objects import now
from tests.cluster.selectors import label_selector_object

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

SUCCESS = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
VIOLATES = "Cannot evict pod as it would violate the pod's disruption budget."


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions") or [])


def budgets_for(cluster: Cluster, pod: dict) -> list[dict]:
    """The budgets of the pod's namespace whose selector matches it."""
    namespace = pod["metadata"]["namespace"]
    return [pdb for (ns, _), pdb in sorted(cluster.objects["poddisruptionbudgets"].items())
            if ns == namespace and _selects(pdb, pod)]


def _selects(pdb: dict, pod: dict) -> bool:
    """policy/v1: a null selector selects no pod, an empty one ({}) every pod of the namespace."""
    selector = pdb["spec"].get("selector")
    return selector is not None and label_selector_object(selector)(pod)


def budget_status(cluster: Cluster, pdb: dict) -> dict:
    """The disruption controller's status of ``pdb`` now (see the module docstring)."""
    namespace = pdb["metadata"]["namespace"]
    pods = [p for (ns, _), p in cluster.objects["pods"].items() if ns == namespace and _selects(pdb, p)]
    disrupted = {name: when for name, when in ((pdb.get("status") or {}).get("disruptedPods") or {}).items()
                 if (namespace, name) in cluster.objects["pods"]}
    healthy = sum(1 for p in pods if _ready(p) and not p["metadata"].get("deletionTimestamp")
                  and p["metadata"]["name"] not in disrupted)
    minimum = pdb["spec"].get("minAvailable")
    if isinstance(minimum, int) and "maxUnavailable" not in pdb["spec"]:
        desired, allowed = minimum, max(0, healthy - minimum)
    else:  # failSafe: the expected count needs a scale subresource the pods' controller does not have
        desired, allowed = 0, 0
    status = {"observedGeneration": pdb["metadata"].get("generation", 1), "disruptionsAllowed": allowed,
              "currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": len(pods),
              "disruptedPods": disrupted,
              "conditions": [{"type": "DisruptionAllowed", "status": "True" if allowed else "False",
                              "reason": "SufficientPods" if allowed else "InsufficientPods",
                              "message": "", "lastTransitionTime": now(),
                              "observedGeneration": pdb["metadata"].get("generation", 1)}]}
    pdb["status"] = status
    return status


def evict(cluster: Cluster, namespace: str, name: str, body: Any) -> tuple[int, dict]:
    """``POST pods/<name>/eviction``: the answer's code and body (see the module docstring)."""
    if isinstance(body, dict):  # decoded with the endpoint's kind as the default (EvictionREST.GroupVersionKind)
        body.setdefault("apiVersion", "policy/v1")
        body.setdefault("kind", "Eviction")
    eviction = check(body, "Strict").obj
    if eviction["kind"] != "Eviction":
        raise Rejection(400, status_body(400, "BadRequest", f"not a Eviction object: {eviction['kind']}"))
    if (eviction.get("metadata") or {}).get("name") != name:
        raise Rejection(400, status_body(400, "BadRequest", "name in URL does not match name in Eviction object"))
    pod = cluster.objects["pods"].get((namespace, name))
    if pod is None:
        return 404, status_body(404, "NotFound", f'pods "{name}" not found',
                                details={"name": name, "kind": "pods"})
    options = eviction.get("deleteOptions") or {}
    grace = options.get("gracePeriodSeconds")
    phase = pod["status"].get("phase")
    if phase in ("Pending", "Succeeded", "Failed") or pod["metadata"].get("deletionTimestamp"):  # canIgnorePDB
        _mark_and_delete(cluster, pod, grace)
        return 201, copy.deepcopy(SUCCESS)
    budgets = budgets_for(cluster, pod)
    if len(budgets) > 1:
        return 500, {**status_body(500, "", "This pod has more than one PodDisruptionBudget, which the eviction "
                                            "subresource does not support."), "reason": ""}
    if budgets:
        pdb = budgets[0]
        status = budget_status(cluster, pdb)
        unready_but_covered = not _ready(pod) and status["currentHealthy"] >= status["desiredHealthy"] > 0
        if not unready_but_covered:
            if status["disruptionsAllowed"] == 0:
                cause = (f"The disruption budget {pdb['metadata']['name']} needs {status['desiredHealthy']} "
                         f"healthy pods and has {status['currentHealthy']} currently")
                return 429, status_body(429, "TooManyRequests", VIOLATES, details={
                    "causes": [{"reason": "DisruptionBudget", "message": cause}], "retryAfterSeconds": 0})
            status["disruptionsAllowed"] -= 1
            status["disruptedPods"][name] = now()
    _mark_and_delete(cluster, pod, grace)
    return 201, copy.deepcopy(SUCCESS)


def _mark_and_delete(cluster: Cluster, pod: dict, grace: int | None) -> None:
    """``addConditionAndDeletePod``, on both ways out (a budget checked or not): DisruptionTarget, then the
    graceful delete."""
    conditions = [c for c in pod["status"].get("conditions") or [] if c.get("type") != "DisruptionTarget"]
    pod["status"]["conditions"] = [*conditions, {"type": "DisruptionTarget", "status": "True",
                                                 "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting",
                                                 "lastTransitionTime": now()}]
    delete(cluster, "pods", pod, grace_s=grace)
