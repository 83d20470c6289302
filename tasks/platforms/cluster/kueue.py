"""Why a job laneflow put under Kueue waits, read from the cluster while it waits (the reading itself is
``tasks.k8s.kueue``'s): its Workload's conditions and, where Kueue's visibility API answers, its place in the
queue. Said in the run's log and as a ``queued`` event (the progress artifact's description) each time it changes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from tasks.k8s.kueue import JOB_UID_LABEL, VISIBILITY, WORKLOADS, Admission, read_admission
from tasks.platforms.base import EventSink, LogSink, StageBlocked
from tasks.platforms.cluster.api import apis, call, get_path

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform


def workload_of(platform: ClusterPlatform, job_uid: str) -> dict[str, Any] | None:
    """The Workload Kueue made of the job with uid ``job_uid`` (it labels it so), None before it made one."""
    _, _, custom = apis(platform)
    group, version, plural = WORKLOADS
    try:
        found = call(platform, "list", "workloads", custom.list_namespaced_custom_object, group, version,
                     platform.effective_namespace(), plural,
                     label_selector=f"{JOB_UID_LABEL}={job_uid}").get("items") or []
    except ApiException as exc:
        if exc.status == 404:  # no such API: Kueue is not installed, or too old to serve v1beta2
            raise StageBlocked(f"the block names Kueue LocalQueue {platform.kueue_queue}, but the cluster serves no "
                               f"{group}/{version} Workloads: install Kueue v0.19 or later (kubectl get crd "
                               "workloads.kueue.x-k8s.io), or clear kueue_queue; the job was deleted") from None
        raise
    return found[0] if found else None


def queue_position(platform: ClusterPlatform, workload: str) -> dict[str, Any] | None:
    """The Workload's entry in its LocalQueue's pending workloads (Kueue's visibility API), None when it is not
    pending or the API does not answer (not installed, not permitted: the position is a courtesy)."""
    client = apis(platform)[2].api_client
    group, version = VISIBILITY
    path = (f"/apis/{group}/{version}/namespaces/{platform.effective_namespace()}/localqueues/"
            f"{platform.kueue_queue}/pendingworkloads")
    try:
        summary = get_path(client, path)
    except Exception:  # a courtesy: whatever keeps it from answering (404, 403, a timeout) never stops the wait
        return None
    return next((item for item in (summary or {}).get("items") or []
                 if (item.get("metadata") or {}).get("name") == workload), None)


class AdmissionWatch:
    """Follows one job's admission while it waits: says each new reading once (log and ``queued`` event) and
    fails the stage when Kueue never takes the job in (no Workload within the block's ``operator_grace_s``)."""

    def __init__(self, platform: ClusterPlatform, what: str, on_event: EventSink, on_log: LogSink) -> None:
        self.platform, self.what, self.on_event, self.on_log = platform, what, on_event, on_log
        self.said = ""
        self.unseen_since: float | None = None
        #: The last reading was a wait: the next one (admitted) is said too.
        self.waiting = False

    def observe(self, job_uid: str) -> Admission:
        """Read the job's admission now, and say it when it changed."""
        workload = workload_of(self.platform, job_uid)
        position = None
        if workload is not None and not (workload.get("status") or {}).get("admission"):
            position = queue_position(self.platform, workload["metadata"]["name"])
        reading = read_admission(workload, self.platform.kueue_queue or "", position)
        if reading.state == "unseen":
            self._check_taken_in()
        else:
            self.unseen_since = None
        self.waiting = reading.waits
        if reading.message != self.said:
            self.said = reading.message
            self.on_log(f"laneflow: {self.what}: {reading.message}")
            self.on_event({"event": "queued", "state": reading.state, "message": reading.message,
                           "reason": reading.reason, "queue": self.platform.kueue_queue,
                           **({"position": position.get("positionInLocalQueue")} if position else {})})
        return reading

    def _check_taken_in(self) -> None:
        now = time.monotonic()
        if self.unseen_since is None:
            self.unseen_since = now
            return
        if now - self.unseen_since <= self.platform.operator_grace_s:
            return
        priority = self.platform.kueue_priority_class
        raise StageBlocked(
            f"{self.what} is suspended for Kueue, but Kueue made no Workload of it in "
            f"{now - self.unseen_since:.0f} s: check that Kueue is installed and manages this kind of job "
            f"(its Configuration's integrations.frameworks lists kubeflow.org/mpijob and batch/job), that "
            f"namespace {self.platform.effective_namespace()} is one it manages (managedJobsNamespaceSelector)"
            + (f", and that WorkloadPriorityClass {priority} exists (kubectl get workloadpriorityclasses)"
               if priority else "")
            + "; the job was deleted")
