"""The Job controller (kubernetes ``pkg/controller/job``): ``restartPolicy: Never`` keeps a failed pod and
counts it; ``OnFailure`` restarts the container in place (a new, empty log) and counts restarts; past
``backoffLimit`` the Job fails ``BackoffLimitExceeded`` and, for ``OnFailure``, its pods are deleted;
``activeDeadlineSeconds`` fails it ``DeadlineExceeded``. A failed or removed pod is replaced after the pod failure
back-off (10 s, doubled per failure), never for a Job being deleted (``syncJob`` calls ``manageJob`` only while
``job.DeletionTimestamp == nil``); a Job changed through the API is synced again (a lowered ``backoffLimit`` fails
it at once). Pods need their service account. ``spec.suspend`` (``set_suspended``): a suspended Job has no
pods and no ``startTime``; resumed, it starts again (pkg/controller/job ``manageJob``, ``syncJob``).
"""

from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING

from tests.cluster.garbage_collector import delete
from tests.cluster.kubelet import crash_loop, set_container_state, start_container
from tests.cluster.objects import later, now
from tests.cluster.pod_control import make_pod

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def _suffix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def start_job(cluster: Cluster, job: dict) -> None:
    spec = job["spec"]
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completions", 1)
    spec.setdefault("parallelism", 1)
    spec.setdefault("suspend", False)
    job["status"] = {"active": 0, "failed": 0, "succeeded": 0}
    if spec["suspend"]:  # "Set StartTime only if the job is not in the suspended state."
        _suspended_condition(job, "True", "JobSuspended", "Job suspended")
        return
    _start(cluster, job)


def _start(cluster: Cluster, job: dict) -> None:
    job["status"]["startTime"] = now()
    deadline = job["spec"].get("activeDeadlineSeconds")
    if deadline:
        later(cluster, float(deadline), lambda: _job_deadline(cluster, job))
    _new_job_pod(cluster, job)


def _suspended_condition(job: dict, status: str, reason: str, message: str) -> None:
    """``ensureJobConditionStatus`` for ``Suspended``: added, or its status changed in place."""
    conditions = job["status"].setdefault("conditions", [])
    found = next((c for c in conditions if c["type"] == "Suspended"), None)
    if found is None:
        conditions.append({"type": "Suspended", "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": now()})
    elif found["status"] != status:
        found.update({"status": status, "reason": reason, "message": message, "lastTransitionTime": now()})


def _finished(job: dict) -> bool:
    return any(c["type"] in ("Complete", "Failed") and c.get("status") == "True"
               for c in job["status"].get("conditions") or [])


def set_suspended(cluster: Cluster, job: dict, suspend: bool) -> None:
    """``spec.suspend`` changed (by Kueue, or the MPI operator for its launcher), as ``syncJob`` reacts to it: a
    suspended Job's active pods are deleted (their tracking finalizers removed first, so they count as neither
    failed nor succeeded) and it gets ``Suspended`` (``JobSuspended``, "Job suspended"); resumed, its
    ``startTime`` is now ("Resumed jobs will always reset StartTime to current time") and a pod is made
    (``JobResumed``, "Job resumed"). A finished Job is left alone."""
    was = bool(job["spec"].get("suspend"))
    job["spec"]["suspend"] = suspend
    if was == suspend or _finished(job):
        return
    if suspend:
        uid = job["metadata"]["uid"]
        for pod in list(cluster.objects["pods"].values()):
            owned = any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])
            if owned and pod["status"].get("phase") in ("Pending", "Running"):
                delete(cluster, "pods", pod)
        job["status"]["active"] = 0
        _suspended_condition(job, "True", "JobSuspended", "Job suspended")
        return
    _suspended_condition(job, "False", "JobResumed", "Job resumed")
    _start(cluster, job)


def _job_pod_labels(job: dict) -> dict:
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    return {"job-name": name, "batch.kubernetes.io/job-name": name, "controller-uid": uid,
            "batch.kubernetes.io/controller-uid": uid}


def _new_job_pod(cluster: Cluster, job: dict) -> None:
    if job["metadata"].get("deletionTimestamp"):  # syncJob: manageJob only for ``job.DeletionTimestamp == nil``
        return
    template = job["spec"]["template"]
    pod = make_pod(cluster, job, f"{job['metadata']['name']}-{_suffix()}", template, _job_pod_labels(job))
    if pod is None:
        return
    job["status"]["active"] = 1
    namespace = job["metadata"]["namespace"]
    later(cluster, cluster.image_pull_s, lambda: _run_job_container(cluster, job, pod, namespace))


def _run_job_container(cluster: Cluster, job: dict, pod: dict, namespace: str) -> None:
    if (namespace, pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    start_container(cluster, pod, lambda state: _job_container_exited(cluster, job, pod, state))


def _job_container_exited(cluster: Cluster, job: dict, pod: dict, terminated: dict) -> None:
    namespace = pod["metadata"]["namespace"]
    if (namespace, pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    code = terminated["exitCode"]
    if job["spec"].get("suspend"):  # deleted because the Job was suspended: counted neither way
        set_container_state(pod, {"terminated": terminated}, ready=False)
        return
    restart_policy = pod["spec"].get("restartPolicy", "Always")
    if code != 0 and restart_policy == "OnFailure":
        # pkg/controller/job: with OnFailure the pod's restarts count against backoffLimit.
        restarts = crash_loop(cluster, pod, terminated, lambda again: _job_container_exited(cluster, job, pod, again))
        limit = job["spec"]["backoffLimit"]  # pastBackoffLimitOnFailure: restarts >= limit (> 0 for a limit of 0)
        if restarts >= limit if limit else restarts > 0:
            _fail_job(cluster, job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        return
    pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
    set_container_state(pod, {"terminated": terminated}, ready=False)
    job["status"]["active"] = 0
    if code == 0:
        job["status"].update({"succeeded": 1, "completionTime": now()})
        job["status"].setdefault("conditions", []).append({"type": "Complete", "status": "True",
                                                            "lastTransitionTime": now()})
        _sync_owner(cluster, job)
        return
    job["status"]["failed"] = job["status"].get("failed", 0) + 1
    if job["status"]["failed"] > job["spec"]["backoffLimit"]:
        _fail_job(cluster, job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    else:
        _replace_after_backoff(cluster, job)


def sync_job(cluster: Cluster, job: dict) -> None:
    """A pod of the Job failed without its container exiting (evicted), or was deleted before it finished:
    count it, replace it or give up."""
    uid = job["metadata"]["uid"]
    pods = [p for p in cluster.objects["pods"].values()
            if any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])]
    if _finished(job) or job["spec"].get("suspend") or \
            any(p["status"].get("phase") in ("Pending", "Running") for p in pods):
        return
    job["status"]["failed"] = sum(1 for p in pods if p["status"].get("phase") == "Failed") + \
        cluster.lost_job_pods.get(uid, 0)
    job["status"]["active"] = 0
    if job["status"]["failed"] > job["spec"]["backoffLimit"]:
        _fail_job(cluster, job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    else:
        _replace_after_backoff(cluster, job)


#: pkg/controller/job ``MaxJobPodFailureBackOff``.
MAX_POD_FAILURE_BACKOFF_S = 600.0


def _replace_after_backoff(cluster: Cluster, job: dict) -> None:
    """A new pod once the pod failure back-off has passed (backoff_utils.go: the default back-off doubled per
    failure since the last success, up to its maximum), unless the Job has one active, has finished or is being
    deleted by then."""
    failures = max(1, job["status"].get("failed", 1))
    delay = min(cluster.job_pod_failure_backoff_s * 2 ** (failures - 1), MAX_POD_FAILURE_BACKOFF_S)
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]

    def replace() -> None:
        uid = job["metadata"]["uid"]
        active = any(p["status"].get("phase") in ("Pending", "Running") and any(
            ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])
            for p in cluster.objects["pods"].values())
        if cluster.objects["jobs"].get((namespace, name)) is job and not _finished(job) and \
                not job["spec"].get("suspend") and not active:
            _new_job_pod(cluster, job)

    later(cluster, delay, replace)


def _fail_job(cluster: Cluster, job: dict, reason: str, message: str) -> None:
    """The Job fails; its active pods are terminated and deleted (pkg/controller/job: deleteActivePods)."""
    job["status"].setdefault("conditions", []).append({"type": "Failed", "status": "True", "reason": reason,
                                                        "message": message, "lastTransitionTime": now()})
    job["status"]["active"] = 0
    uid = job["metadata"]["uid"]
    for pod in list(cluster.objects["pods"].values()):
        owned = any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])
        if owned and pod["status"].get("phase") in ("Pending", "Running"):
            delete(cluster, "pods", pod)
    _sync_owner(cluster, job)


def _job_deadline(cluster: Cluster, job: dict) -> None:
    if (job["metadata"]["namespace"], job["metadata"]["name"]) in cluster.objects["jobs"] and \
            not _finished(job) and not job["spec"].get("suspend"):
        _fail_job(cluster, job, "DeadlineExceeded", "Job was active longer than specified deadline")


def _sync_owner(cluster: Cluster, obj: dict) -> None:
    """The controller of ``obj``'s owner syncs the owner, as its informer on ``obj``'s kind would make it."""
    # Imported here: the controller manager imports this module to run it.
    from tests.cluster.controller_manager import sync_owner

    sync_owner(cluster, obj)
