"""Kueue's scheduler and queue controllers (kubernetes-sigs/kueue v0.19.2, commit 8eab687), run once a second by
the emulator's ticker and after each queued job is created (``cycle``):

* order (``pkg/cache/queue/cluster_queue.go``): a ClusterQueue's pending Workloads by priority, then creation
  time; ``StrictFIFO`` stops at a head that does not fit, ``BestEffortFIFO`` (the default) goes on;
* quota (``pkg/scheduler/flavorassigner``): every pod set's requests (requests, else limits, per container,
  times ``count``) must be covered by the ClusterQueue's resource groups; a group's flavors are tried in order
  and the first with room is taken; room is the flavor's nominal quota less what admitted Workloads use, plus
  what the cohort's other queues leave unused (up to their ``lendingLimit``, within this queue's
  ``borrowingLimit``); all pod sets are admitted at once or none;
* the messages a pending Workload gets (``QuotaReserved`` False, reason ``Pending``, with the default feature
  gates): "couldn't assign flavors to pod set <ps>: insufficient unused quota for <r> in flavor <f>, <n> more
  needed" (reasons sorted, joined by ", "), "resource <r> unavailable in ClusterQueue", "LocalQueue <lq>
  doesn't exist" (reason ``Inadmissible``), "workload namespace doesn't match ClusterQueue selector";
* admission: ``QuotaReserved`` ("Quota reserved in ClusterQueue <cq>") and ``Admitted`` ("The workload is
  admitted"), ``status.admission`` with each pod set's flavors, usage and count;
* preemption within a ClusterQueue (``preemption.withinClusterQueue: LowerPriority``): candidates of lower
  priority, lowest first and then the most recently admitted, taken until the preemptor fits and then given
  back while it still fits (``classicalPreemptions``); each is ``Evicted`` and ``Preempted`` with "Preempted to
  accommodate a workload (UID: <uid>, JobUID: <uid>) due to prioritization in the ClusterQueue; preemptor
  path: /<cq>; preemptee path: /<cq>", and the preemptor waits with ". Pending the preemption of <n>
  workload(s)";
* the ``Active`` conditions and counts of ClusterQueues and LocalQueues, and the visibility API's pending
  workloads with their positions (``pkg/visibility/storage``).

Not modelled: fair sharing, reclaim within a cohort, flavor fungibility beyond "first flavor with room", node
taints of flavors, admission checks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from tests.cluster.kueue_jobs import (
    JOB_UID_LABEL,
    condition,
    create_workload,
    has,
    job_active,
    job_finished,
    queued_jobs,
    start,
    stop,
    workload_of,
)
from tests.cluster.kueue_quota import Usage, assign, show, usage
from tests.cluster.objects import now, record_event
from tests.cluster.selectors import label_selector_object

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

def _queue_of(cluster: Cluster, workload: dict) -> tuple[dict | None, str | None]:
    """The Workload's ClusterQueue, or None and why it cannot be admitted (``getQueueBlocker``)."""
    namespace = workload["metadata"]["namespace"]
    local = cluster.objects["localqueues"].get((namespace, workload["spec"]["queueName"]))
    if local is None:
        return None, f"LocalQueue {workload['spec']['queueName']} doesn't exist"
    name = local["spec"]["clusterQueue"]
    queue = cluster.objects["clusterqueues"].get(("", name))
    if queue is None:
        return None, f"ClusterQueue {name} doesn't exist"
    if _missing_flavors(cluster, queue):
        return None, f"ClusterQueue {name} is inactive"
    return queue, None


def _missing_flavors(cluster: Cluster, queue: dict) -> list[str]:
    return sorted({flavor["name"] for group in queue["spec"].get("resourceGroups") or []
                   for flavor in group["flavors"] if ("", flavor["name"]) not in cluster.objects["resourceflavors"]})


def _usage_by_queue(cluster: Cluster) -> dict[str, Usage]:
    """What the admitted Workloads use, by ClusterQueue (an empty usage for a queue with none)."""
    by_queue: dict[str, list[dict]] = defaultdict(list)
    for workload in _admitted(cluster):
        by_queue[workload["status"]["admission"]["clusterQueue"]].append(workload)
    used: dict[str, Usage] = defaultdict(dict)
    used.update({queue: usage(workloads) for queue, workloads in by_queue.items()})
    return used


def _admitted(cluster: Cluster) -> list[dict]:
    return [w for w in cluster.objects["workloads"].values()
            if (w.get("status") or {}).get("admission") and not has(w, "Finished")]


def _owner(cluster: Cluster, workload: dict) -> tuple[str, dict] | None:
    uid = (workload["metadata"].get("labels") or {}).get(JOB_UID_LABEL)
    return next(((resource, job) for resource, job in queued_jobs(cluster) if job["metadata"]["uid"] == uid), None)


def _pending(workload: dict) -> bool:
    return not (workload.get("status") or {}).get("admission") and not has(workload, "Finished")


def _order(workloads: list[dict]) -> list[dict]:
    return sorted(workloads, key=lambda w: (-w["spec"].get("priority", 0), w["metadata"]["creationTimestamp"],
                                            w["metadata"]["uid"]))


def _victims(cluster: Cluster, queue: dict, workload: dict, used_by: dict[str, Usage]) -> list[dict]:
    """``classicalPreemptions`` within the ClusterQueue: the fewest lower-priority Workloads whose quota lets
    ``workload`` in, or none when even all of them would not."""
    policy = (queue["spec"].get("preemption") or {}).get("withinClusterQueue", "Never")
    if policy == "Never":
        return []
    name, priority = queue["metadata"]["name"], workload["spec"].get("priority", 0)
    candidates = [w for w in _admitted(cluster) if w["status"]["admission"]["clusterQueue"] == name
                  and not has(w, "Evicted") and (w["spec"].get("priority", 0) < priority or (
                      policy == "LowerOrNewerEqualPriority" and w["spec"].get("priority", 0) == priority
                      and w["metadata"]["creationTimestamp"] > workload["metadata"]["creationTimestamp"]))]
    candidates.sort(key=lambda w: (w["spec"].get("priority", 0),
                                   _negated(_reserved_at(w))))

    def fits(without: list[dict]) -> bool:
        remaining = {**used_by, name: usage([w for w in _admitted(cluster)
                                               if w["status"]["admission"]["clusterQueue"] == name
                                               and w not in without])}
        return assign(cluster, queue, workload, remaining)[0] is not None

    chosen: list[dict] = []
    for candidate in candidates:
        chosen.append(candidate)
        if fits(chosen):
            break
    else:
        return []
    for candidate in reversed(chosen[:-1]):  # given back while it still fits: the minimal set
        if fits([w for w in chosen if w is not candidate]):
            chosen.remove(candidate)
    return chosen


def _reserved_at(workload: dict) -> str:
    return next((c["lastTransitionTime"] for c in workload["status"].get("conditions") or []
                 if c["type"] == "QuotaReserved"), "")


def _negated(stamp: str) -> tuple[int, ...]:
    """A time stamp that sorts the most recent first."""
    return tuple(-ord(character) for character in stamp)


def _evict(cluster: Cluster, workload: dict, preemptor: dict, path: str) -> None:
    owner = _owner(cluster, preemptor)
    job_uid = owner[1]["metadata"]["uid"] if owner else ""
    message = (f"Preempted to accommodate a workload (UID: {preemptor['metadata']['uid']}, JobUID: {job_uid}) due "
               f"to prioritization in the ClusterQueue; preemptor path: {path}; preemptee path: {path}")
    condition(workload, "Evicted", "True", "Preempted", message)
    condition(workload, "Preempted", "True", "InClusterQueue", message)
    record_event(cluster, workload, "Normal", "Preempted", message, "kueue-admission")
    victim = _owner(cluster, workload)
    if victim is not None:
        stop(cluster, victim[0], victim[1], workload, message)


def _admit(cluster: Cluster, queue: dict, workload: dict, assignments: list[dict]) -> None:
    name = queue["metadata"]["name"]
    workload["status"]["admission"] = {"clusterQueue": name, "podSetAssignments": assignments}
    for kind in ("Evicted", "Preempted"):
        found = next((c for c in workload["status"].get("conditions") or [] if c["type"] == kind), None)
        if found and found["status"] == "True":
            condition(workload, kind, "False", "QuotaReserved", "Previously: " + found["message"])
    condition(workload, "QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {name}")
    condition(workload, "Admitted", "True", "Admitted", "The workload is admitted")
    record_event(cluster, workload, "Normal", "Admitted", f"Admitted by ClusterQueue {name}, wait time since "
                                                          "reservation was 0s", "kueue-admission")
    owner = _owner(cluster, workload)
    if owner is not None:
        flavors = {a["name"]: cluster.objects["resourceflavors"].get(("", next(iter(a["flavors"].values()), "")))
                   for a in assignments}
        start(cluster, owner[0], owner[1], workload, {k: v for k, v in flavors.items() if v}, name)


def _reconcile_jobs(cluster: Cluster) -> None:
    """The job reconciler's part: Workloads made, finished, requeued once their evicted job stopped."""
    for resource, job in queued_jobs(cluster):
        workload = workload_of(cluster, job)
        if workload is None:
            if job_finished(resource, job) is None and not job["metadata"].get("deletionTimestamp"):
                create_workload(cluster, resource, job)
            continue
        ended = job_finished(resource, job)
        if ended is not None and not has(workload, "Finished"):
            condition(workload, "Finished", "True", ended[0], ended[1])
        if has(workload, "Evicted") and workload["status"].get("admission") and not job_active(cluster, job):
            message = next(c["message"] for c in workload["status"]["conditions"] if c["type"] == "Evicted")
            reason = next(c["reason"] for c in workload["status"]["conditions"] if c["type"] == "Evicted")
            condition(workload, "Requeued", "True" if reason == "Preempted" else "False", reason, message)
            condition(workload, "QuotaReserved", "False", "Pending", message)
            condition(workload, "Admitted", "False", "NoReservation", "The workload has no reservation")
            workload["status"].pop("admission")


def cycle(cluster: Cluster) -> None:
    """One pass of Kueue's controllers and scheduler (call with the cluster's lock held)."""
    if not cluster.kueue_installed:
        return
    _reconcile_jobs(cluster)
    for queue in sorted(cluster.objects["clusterqueues"].values(), key=lambda q: q["metadata"]["name"]):
        _schedule(cluster, queue)
    for workload in cluster.objects["workloads"].values():
        if _pending(workload):
            _, blocker = _queue_of(cluster, workload)
            if blocker:
                condition(workload, "QuotaReserved", "False", "Inadmissible", blocker)
    _queue_statuses(cluster)


def _schedule(cluster: Cluster, queue: dict) -> None:
    name = queue["metadata"]["name"]
    selector = queue["spec"].get("namespaceSelector")
    for workload in _order([w for w in cluster.objects["workloads"].values() if _pending(w)
                            and _queue_of(cluster, w)[0] is queue]):
        used_by = _usage_by_queue(cluster)
        namespace = cluster.objects["namespaces"].get(("", workload["metadata"]["namespace"])) or {"metadata": {}}
        if selector is None or not label_selector_object(selector)(namespace):
            condition(workload, "QuotaReserved", "False", "Inadmissible",
                      "workload namespace doesn't match ClusterQueue selector")
            continue
        assignments, message = assign(cluster, queue, workload, used_by)
        if assignments is not None:
            _admit(cluster, queue, workload, assignments)
            continue
        pending_victims = [w for w in _admitted(cluster) if has(w, "Evicted")
                           and w["status"]["admission"]["clusterQueue"] == name]
        victims = pending_victims or _victims(cluster, queue, workload, used_by)
        for victim in victims:
            if not has(victim, "Evicted"):
                _evict(cluster, victim, workload, f"/{name}")
        if victims:
            message += f". Pending the preemption of {len(victims)} workload(s)"
        condition(workload, "QuotaReserved", "False", "Pending", message)
        if queue["spec"].get("queueingStrategy") == "StrictFIFO":
            break


def _queue_statuses(cluster: Cluster) -> None:
    """``Active`` and the counts of every ClusterQueue and LocalQueue."""
    admitted = _admitted(cluster)
    for queue in cluster.objects["clusterqueues"].values():
        name = queue["metadata"]["name"]
        missing = _missing_flavors(cluster, queue)
        mine = [w for w in admitted if w["status"]["admission"]["clusterQueue"] == name]
        waiting = [w for w in cluster.objects["workloads"].values() if _pending(w)
                   and _queue_of(cluster, w)[0] is queue]
        status = queue.setdefault("status", {})
        status.update({"pendingWorkloads": len(waiting), "admittedWorkloads": len(mine),
                       "reservingWorkloads": len(mine), "flavorsUsage": [
                           {"name": flavor, "resources": [{"name": resource, "total": show(resource, amount)}
                                                          for (f, resource), amount in usage(mine).items()
                                                          if f == flavor]}
                           for flavor in sorted({f for f, _ in usage(mine)})]})
        condition(queue, "Active", "False" if missing else "True", "FlavorNotFound" if missing else "Ready",
                  f"Can't admit new workloads: references missing ResourceFlavor(s): {','.join(missing)}."
                  if missing else "Can admit new workloads")
    for (namespace, name), local in cluster.objects["localqueues"].items():
        queue = cluster.objects["clusterqueues"].get(("", local["spec"]["clusterQueue"]))
        ours = [w for w in cluster.objects["workloads"].values()
                if w["metadata"]["namespace"] == namespace and w["spec"]["queueName"] == name]
        local.setdefault("status", {}).update({
            "pendingWorkloads": sum(1 for w in ours if _pending(w)),
            "admittedWorkloads": sum(1 for w in ours if w in admitted),
            "reservingWorkloads": sum(1 for w in ours if w in admitted)})
        if queue is None:
            condition(local, "Active", "False", "ClusterQueueDoesNotExist", "Can't submit new workloads to "
                                                                           "clusterQueue")
        else:
            condition(local, "Active", "True", "Ready", "Can submit new workloads to localQueue")


def pending_workloads(cluster: Cluster, namespace: str | None, queue: str) -> dict | None:
    """The visibility API's ``PendingWorkloadsSummary`` of a LocalQueue (``namespace``) or a ClusterQueue (None):
    pending Workloads in the queue's order with their 0-based positions; None when there is no such queue."""
    if namespace is None:
        if ("", queue) not in cluster.objects["clusterqueues"]:
            return None
        cluster_queue = queue
    else:
        local = cluster.objects["localqueues"].get((namespace, queue))
        if local is None:
            return None
        cluster_queue = local["spec"]["clusterQueue"]
    members = _order([w for w in cluster.objects["workloads"].values() if _pending(w) and (
        (q := cluster.objects["localqueues"].get((w["metadata"]["namespace"], w["spec"]["queueName"]))) is not None
        and q["spec"]["clusterQueue"] == cluster_queue)])
    positions: dict[tuple[str, str], int] = defaultdict(int)
    items = []
    for index, workload in enumerate(members):
        local_key = (workload["metadata"]["namespace"], workload["spec"]["queueName"])
        shown = ("name", "namespace", "creationTimestamp", "ownerReferences")
        item = {"metadata": {key: workload["metadata"][key] for key in shown if key in workload["metadata"]},
                "priority": workload["spec"].get("priority", 0), "localQueueName": local_key[1],
                "positionInClusterQueue": index, "positionInLocalQueue": positions[local_key]}
        positions[local_key] += 1
        if namespace is None or local_key == (namespace, queue):
            items.append(item)
    return {"kind": "PendingWorkloadsSummary", "apiVersion": "visibility.kueue.x-k8s.io/v1beta2",
            "metadata": {"creationTimestamp": now()}, "items": items}
