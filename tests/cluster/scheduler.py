"""kube-scheduler for the emulated cluster's one node (kubernetes ``pkg/scheduler``): a pod is bound to the
node when its claims are bound and its requests fit beside the pods already there; otherwise it stays
Pending, ``PodScheduled=False/Unschedulable``, with a ``FailedScheduling`` event worded as the scheduler
words it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from tests.cluster.objects import now, record_event
from tests.cluster.quantities import quantity_bytes
from tests.cluster.state import NODE_NAME

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


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
    """kube-scheduler's fit check against the one node: a pod whose requests do not fit beside the pods
    bound there stays Pending, PodScheduled=False/Unschedulable, with a FailedScheduling event worded as
    the scheduler words it (pkg/scheduler ``FitError.Error``: "0/1 nodes are available: 1 Insufficient
    <resource>. preemption: ..."); one that fits is bound (``spec.nodeName``). Not retried when room frees
    up (no test needs the second chance)."""
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
            return _unschedulable(cluster, pod, f"0/1 nodes are available: {problem}. preemption: 0/1 nodes are "
                                                "available: 1 Preemption is not helpful for scheduling.")
    used: dict[str, int] = defaultdict(int)
    for other in cluster.objects["pods"].values():
        if other is not pod and other["spec"].get("nodeName") and \
                other["status"].get("phase") not in ("Succeeded", "Failed"):
            for resource, amount in _requests(other).items():
                used[resource] += amount
    short = sorted(resource for resource, amount in _requests(pod).items()
                   if used[resource] + amount > cluster.node_capacity.get(resource, 0))
    if not short:
        pod["spec"]["nodeName"] = NODE_NAME
        return True
    return _unschedulable(cluster, pod, "0/1 nodes are available: "
                          + ", ".join(f"1 Insufficient {resource}" for resource in short)
                          + ". preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.")


def _unschedulable(cluster: Cluster, pod: dict, message: str) -> bool:
    pod["status"].update({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
         "lastTransitionTime": now()}]})
    record_event(cluster, pod, "Warning", "FailedScheduling", message, "default-scheduler")
    return False
