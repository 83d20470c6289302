"""Kueue (kubernetes-sigs/kueue, v0.19 and later), pure: how a job is put under a LocalQueue and how its
Workload reads — whether it waits, why, where in the queue, whether it was preempted — as a line a user can act on.

Kueue manages a job that carries the label ``kueue.x-k8s.io/queue-name`` (its ``manageJobsWithoutQueueName`` is
off by default). The job is created suspended (MPIJob ``runPolicy.suspend``, Job ``spec.suspend``; Kueue's webhook
would set it too), Kueue makes a Workload of it (owned by the job, labelled ``kueue.x-k8s.io/job-uid``), admits
all its pod sets at once when its ClusterQueue has quota, and unsuspends it with each pod set's ResourceFlavor
(node labels into the pods' nodeSelector, its tolerations added). A Workload preempted by a higher-priority one
is ``Evicted`` (reason ``Preempted``): the job is suspended again, its pods removed, and it waits for quota as
before. The Workload's ``QuotaReserved`` condition says why it waits (``Pending``: no room, with the flavors it
tried; ``Inadmissible``: no such LocalQueue, an inactive ClusterQueue).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: Kueue's visibility API (an aggregated API server Kueue ships; v1beta2 since v0.15).
VISIBILITY = ("visibility.kueue.x-k8s.io", "v1beta2")
WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")

#: Why an elastic run is refused under Kueue.
ELASTIC_REFUSED = ("an elastic run cannot train under Kueue: Kueue admits an MPIJob only with every worker it "
                   "asks for (it has no partial admission for MPIJobs, and refuses its elastic-job annotation on "
                   "them), so the run would wait for max_workers and never start on fewer, nor take workers back "
                   "as elastic training does. Run it on a platform block without kueue_queue (e.g. one for the spot "
                   "pool), or drop `elastic` to queue it as a fixed-size run")


def kueue_labels(queue: str | None, priority_class: str | None) -> dict[str, str]:
    """The labels that put a job under Kueue (none without a queue)."""
    if not queue:
        return {}
    return {QUEUE_LABEL: queue, **({PRIORITY_LABEL: priority_class} if priority_class else {})}


def queued(body: dict[str, Any], queue: str | None, priority_class: str | None) -> dict[str, Any]:
    """``body`` (an MPIJob or a batch Job) under Kueue: labelled for the queue and created suspended, so nothing
    of it starts before Kueue admits it; unchanged without a queue."""
    if not queue:
        return body
    queued_body = copy.deepcopy(body)
    queued_body["metadata"].setdefault("labels", {}).update(kueue_labels(queue, priority_class))
    spec = queued_body["spec"]
    if queued_body["kind"] == "MPIJob":
        spec.setdefault("runPolicy", {})["suspend"] = True
    else:
        spec["suspend"] = True
    return queued_body


def is_suspended(job: dict[str, Any]) -> bool:
    spec = job.get("spec") or {}
    if job.get("kind") == "MPIJob":
        return bool((spec.get("runPolicy") or {}).get("suspend"))
    return bool(spec.get("suspend"))


@dataclass(frozen=True)
class Admission:
    """Where a job stands with Kueue: ``waiting`` (for quota, or for a queue that is missing or inactive),
    ``preempted`` (evicted and waiting again), ``admitted``, or ``unseen`` (no Workload yet); and the line that
    says so."""

    state: str
    message: str
    reason: str = ""

    @property
    def waits(self) -> bool:
        return self.state in ("waiting", "preempted", "unseen")


def _condition(workload: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def read_admission(workload: dict[str, Any] | None, queue: str, position: dict[str, Any] | None = None
                   ) -> Admission:
    """How ``workload`` (None: Kueue made none yet) stands, with its place in the queue from the visibility API
    (``positionInLocalQueue``/``positionInClusterQueue``, 0-based) when known."""
    if workload is None:
        return Admission("unseen", f"waiting for Kueue to take the job into LocalQueue {queue} (no Workload yet)")
    reserved = _condition(workload, "QuotaReserved") or {}
    evicted = _condition(workload, "Evicted") or {}
    if (workload.get("status") or {}).get("admission") and reserved.get("status") == "True":
        if evicted.get("status") == "True":  # evicted, its pods still stopping: the quota is still held
            return Admission("preempted", f"preempted by Kueue, stopping: {evicted.get('message', '')}",
                             evicted.get("reason", ""))
        cluster_queue = workload["status"]["admission"].get("clusterQueue", "")
        return Admission("admitted", f"admitted by Kueue (ClusterQueue {cluster_queue})")
    where = ""
    if position is not None:
        where = (f", position {int(position.get('positionInLocalQueue', 0)) + 1} in LocalQueue {queue} and "
                 f"{int(position.get('positionInClusterQueue', 0)) + 1} in its ClusterQueue")
    why = reserved.get("message") or "not admitted yet"
    requeued = _condition(workload, "Requeued") or {}
    if requeued.get("reason") == "Preempted" and requeued.get("status") == "True":
        return Admission("preempted", f"preempted by Kueue and waiting to be admitted again{where}: {why}",
                         reserved.get("reason", ""))
    return Admission("waiting", f"waiting for Kueue to admit it{where}: {why}", reserved.get("reason", ""))
