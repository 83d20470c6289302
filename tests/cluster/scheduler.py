"""kube-scheduler for the emulated cluster's nodes (kubernetes ``pkg/scheduler``): a pod is bound to a node
when its claims are bound, it tolerates the node's taints, it matches its node selector and required node
affinity, and its requests fit beside the pods already there; otherwise it stays Pending,
``PodScheduled=False/Unschedulable``, with a ``FailedScheduling`` event worded as the scheduler words it.

Filter plugins followed (``pkg/scheduler/framework/plugins``): ``volumebinding``; ``tainttoleration`` (a
``NoSchedule`` or ``NoExecute`` taint the pod does not tolerate: "node(s) had untolerated taint {key:
value}"; ``PreferNoSchedule`` only scores), with the toleration matching of ``k8s.io/api/core/v1``
``Toleration.ToleratesTaint``; ``nodeaffinity`` (``nodeSelector`` and
``requiredDuringSchedulingIgnoredDuringExecution``: "node(s) didn't match Pod's node affinity/selector"),
with the operators of ``k8s.io/component-helpers/scheduling/corev1/nodeaffinity``; ``noderesources`` (fit).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from tests.cluster.objects import now, record_event
from tests.cluster.quantities import quantity_bytes

if TYPE_CHECKING:
    from tests.cluster.state import Cluster, Node


def _requests(pod: dict) -> dict[str, int]:
    """What a pod asks of its node (milli-CPU, bytes, counts): requests, with limits standing in where only
    limits are set (the API server's defaulting does this, and extended resources such as GPUs are given
    as limits)."""
    total: dict[str, int] = defaultdict(int)
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        for resource, quantity in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            text = str(quantity)
            if resource == "cpu":
                total[resource] += int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)
            else:
                total[resource] += quantity_bytes(text)
    return total


def schedule(cluster: Cluster, pod: dict) -> bool:
    """kube-scheduler's filters against every node: a pod no node takes stays Pending,
    PodScheduled=False/Unschedulable, with a FailedScheduling event worded as the scheduler words it
    (pkg/scheduler ``FitError.Error``: "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had
    untolerated taint {sku: gpu}. preemption: ..."); the first node that takes it is bound (``spec.nodeName``).
    A pod left Pending is tried again (``retry_unschedulable``)."""
    if pod["spec"].get("nodeName"):
        return True
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes") or []:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is None:
            continue
        pvc = cluster.objects["persistentvolumeclaims"].get((namespace, claim))
        # The VolumeBinding plugin (pkg/scheduler/framework/plugins/volumebinding): a missing claim, or one
        # not bound yet, makes the pod unschedulable before any resource is looked at.
        problem = (f'persistentvolumeclaim "{claim}" not found' if pvc is None else
                   None if (pvc.get("status") or {}).get("phase") == "Bound" else
                   "pod has unbound immediate PersistentVolumeClaims")
        if problem:
            total = len(cluster.nodes)
            return _unschedulable(cluster, pod, f"0/{total} nodes are available: {problem}. preemption: 0/{total} "
                                                f"nodes are available: {total} Preemption is not helpful for "
                                                "scheduling.")
    misfits: dict[str, int] = defaultdict(int)
    for node in cluster.nodes.values():
        misfit = _misfit(cluster, pod, node)
        if misfit is None:
            pod["spec"]["nodeName"] = node.name
            # pkg/scheduler/schedule_one.go: "Successfully assigned %v/%v to %v", reason Scheduled.
            record_event(cluster, pod, "Normal", "Scheduled",
                         f"Successfully assigned {namespace}/{pod['metadata']['name']} to {node.name}",
                         "default-scheduler")
            return True
        for reason in misfit:
            misfits[reason] += 1
    # FitError.Error: "<count> <reason>" for each reason, the strings sorted; then what preemption could do (one
    # sentence for all nodes here; upstream words it per node when their reasons differ).
    total = len(cluster.nodes)
    reasons = ", ".join(sorted(f"{count} {reason}" for reason, count in misfits.items()))
    preemption = "No preemption victims found for incoming pod" \
        if all(reason.startswith("Insufficient") for reason in misfits) else "Preemption is not helpful for scheduling"
    return _unschedulable(cluster, pod, f"0/{total} nodes are available: {reasons}. preemption: 0/{total} nodes are "
                                        f"available: {total} {preemption}.")


def _misfit(cluster: Cluster, pod: dict, node: Node) -> list[str] | None:
    """Why ``node`` cannot take ``pod`` (each filter that refuses it), None when it can."""
    if node.unschedulable and untolerated_taint(pod["spec"].get("tolerations") or [], [UNSCHEDULABLE_TAINT]):
        # The NodeUnschedulable plugin (pkg/scheduler/framework/plugins/nodeunschedulable), first in the default
        # profile's filters: a cordoned node, unless the pod tolerates its node.kubernetes.io/unschedulable taint.
        return ["node(s) were unschedulable"]
    if (taint := untolerated_taint(pod["spec"].get("tolerations") or [], node.taints)) is not None:
        return [f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"]
    if not matches_node(pod["spec"], node.labels, node.name):
        return ["node(s) didn't match Pod's node affinity/selector"]
    used: dict[str, int] = defaultdict(int)
    for other in cluster.objects["pods"].values():
        if other is not pod and other["spec"].get("nodeName") == node.name and \
                other["status"].get("phase") not in ("Succeeded", "Failed"):
            for resource, amount in _requests(other).items():
                used[resource] += amount
    short = sorted(resource for resource, amount in _requests(pod).items()
                   if used[resource] + amount > node.capacity.get(resource, 0))
    return [f"Insufficient {resource}" for resource in short] or None


#: The taint a cordoned node carries (the node lifecycle controller's TaintNodesByCondition).
UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def _unschedulable(cluster: Cluster, pod: dict, message: str) -> bool:
    # A condition's lastTransitionTime moves only when its status does (a pod tried again stays False).
    earlier = next((c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"
                    and c["status"] == "False"), None)
    pod["status"].update({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
         "lastTransitionTime": earlier["lastTransitionTime"] if earlier else now()}]})
    record_event(cluster, pod, "Warning", "FailedScheduling", message, "default-scheduler")
    return False


def tolerates(toleration: dict, taint: dict) -> bool:
    """``Toleration.ToleratesTaint``: an empty effect matches every effect; an empty key with ``Exists``
    matches every taint; ``Exists`` ignores the value, ``Equal`` (the default) compares it."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated_taint(tolerations: list[dict], taints: list[dict]) -> dict | None:
    """The first NoSchedule/NoExecute taint no toleration matches (the TaintToleration filter)."""
    return next((taint for taint in taints if taint.get("effect") in ("NoSchedule", "NoExecute")
                 and not any(tolerates(toleration, taint) for toleration in tolerations)), None)


def _requirement_holds(requirement: dict, labels: dict[str, str]) -> bool:
    key, operator, values = requirement["key"], requirement["operator"], requirement.get("values") or []
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    if operator in ("Gt", "Lt") and key in labels and labels[key].lstrip("-").isdigit():
        return int(labels[key]) > int(values[0]) if operator == "Gt" else int(labels[key]) < int(values[0])
    return False


def matches_node(spec: dict, labels: dict[str, str], node_name: str) -> bool:
    """The NodeAffinity filter: every ``nodeSelector`` label, and one of the required node selector terms (each
    term's expressions all hold; ``matchFields`` on ``metadata.name``); no terms at all match nothing."""
    if any(labels.get(key) != value for key, value in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if required is None:
        return True
    fields = {"metadata.name": node_name}
    return any((term.get("matchExpressions") or term.get("matchFields"))  # an empty term matches nothing
               and all(_requirement_holds(r, labels) for r in term.get("matchExpressions") or [])
               and all(_requirement_holds(r, fields) for r in term.get("matchFields") or [])
               for term in required.get("nodeSelectorTerms") or [])


def park(cluster: Cluster, pod: dict, retry: Callable[[], None]) -> None:
    """Keep a pod no node took, to be tried again by ``retry_unschedulable``."""
    meta = pod["metadata"]
    cluster.unschedulable[(meta["namespace"], meta["name"])] = (pod, retry)


def retry_unschedulable(cluster: Cluster) -> None:
    """kube-scheduler's second chance (``pkg/scheduler/backend/queue/scheduling_queue.go``): a pod it could not
    place waits in ``unschedulablePods`` until a cluster event that may make it fit (an assigned pod deleted or
    finished, a node added, uncordoned or changed: ``MoveAllToActiveOrBackoffQueue`` with the plugins' queueing
    hints), then goes back through the filters after its back-off (1 s, doubled per attempt up to 10 s), and at
    the latest after ``podMaxInUnschedulablePodsDuration`` (5 min). Here every parked pod is tried again on the
    emulator's one-second tick: a pod starts within a second of room freeing up, as upstream's hints make it
    do, and one that still fits nowhere only adds to its FailedScheduling event's count (the event recorder
    aggregates identical events). A pod that starts is a change its owner's controller hears of (its informer on
    pods), as the MPI operator lists a worker that runs now in ``discover_hosts.sh``. Called under the cluster's
    lock."""
    from tests.cluster.controller_manager import sync_owner  # the controllers import the kubelet, which imports this

    for key, (pod, retry) in list(cluster.unschedulable.items()):
        del cluster.unschedulable[key]
        if cluster.objects["pods"].get(key) is pod and not pod["metadata"].get("deletionTimestamp") \
                and not pod["spec"].get("nodeName"):
            retry()
            if pod["spec"].get("nodeName"):
                sync_owner(cluster, pod)
