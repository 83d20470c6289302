"""What the MPI operator answers about an MPIJob that is not running yet: nothing at all (no operator handles
it), a refusal (a Warning event, no condition), or warnings that it cannot create the job's pods that keep
recurring — each a stage that would otherwise wait for ever, failed saying what to fix."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tasks.platforms.base import LogSink, StageBlocked, TrainingFailed
from tasks.platforms.cluster.api import call

if TYPE_CHECKING:
    import kubernetes

    from tasks.platforms.cluster import ClusterPlatform

#: The MPI operator refuses an invalid job with a Warning event of this reason and sets no condition
#: (kubeflow/mpi-operator pkg/controller/mpi_job_controller.go, syncHandler): it never starts.
REFUSED_REASON = "ValidationError"
#: The operator's Warning when it cannot create a job's pods or its launcher (forbidden, quota exceeded, a
#: service account not found): ``mpiJobFailedReason`` with "worker pod created failed: <error>"; it retries,
#: so the warning repeats while the cause lasts.
CREATE_FAILED_REASON = "MPIJobFailed"

def check_operator_answers(platform: ClusterPlatform, job: dict, waited_s: float, operator_spoke: bool) -> None:
    """An MPIJob no operator handles has no status at all: past the block's ``operator_grace_s`` waiting longer
    would wait for ever. An operator that cannot create the job's pods writes no status either (``syncHandler``
    returns before ``updateMPIJobStatus``), but it says so in Warning events: those are judged instead."""
    if (job.get("status") or {}).get("conditions") or operator_spoke or waited_s <= platform.operator_grace_s:
        return
    name, namespace = job["metadata"]["name"], platform.effective_namespace()
    raise StageBlocked(
        f"MPIJob {name} got no status from the MPI operator in {waited_s:.0f} s: no operator is handling it. "
        f"Check that the MPI operator (kubeflow/mpi-operator, v2beta1 MPIJobs) is installed and running "
        f"(kubectl get pods -A -l app.kubernetes.io/name=mpi-operator), and that it watches namespace {namespace} "
        f"(its --namespace flag, when set, must name it); the job was deleted")


#: What to check for the causes the operator's create warnings name (apiserver's wording in each).
CREATE_ADVICE = (
    ("service account", "create the service account the block names (service_account; deployments/workloads)"),
    ("exceeded quota", "the namespace's ResourceQuota has no room: ask for less (workers, gpus_per_worker, "
                       "worker_cpu/worker_memory) or raise the quota"),
    ("forbidden", "an admission policy (Pod Security, a webhook) or RBAC refuses the pod: see the message"),
)


def check_warnings(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, job: dict,
                   seen: dict[str, tuple[float, int]], on_log: LogSink) -> None:
    """Fail fast when the operator refused the job: it then only records a Warning event, no condition; and
    fail when its warnings that it cannot create the job's pods outlast ``operator_grace_s`` and still recur
    (the event's count went up since laneflow first saw it: the operator tried again and failed again; one
    that stopped recurring was a moment's shortage the operator got past).

    Other Warning events of a job that is not running yet (a template setting it overrides) go to the log
    once each.
    """
    name, uid = job["metadata"]["name"], job["metadata"].get("uid")
    found = call(platform, "list", "events", core.list_namespaced_event, platform.effective_namespace(),
                 field_selector=f"involvedObject.kind=MPIJob,involvedObject.name={name},type=Warning").items
    for event in found:
        if uid and event.involved_object.uid not in (None, uid):
            continue  # about an earlier job of the same name
        if event.reason == REFUSED_REASON:
            raise TrainingFailed(f"the MPI operator refused MPIJob {name}: {event.message}")
        key = f"{event.reason}: {event.message}"
        if key not in seen:
            seen[key] = (time.monotonic(), event.count or 1)
            on_log(f"warning from the MPI operator: {key}")
        first_seen, first_count = seen[key]
        if event.reason == CREATE_FAILED_REASON and (event.count or 1) > first_count and \
                time.monotonic() - first_seen > platform.operator_grace_s:
            message = event.message or ""
            advice = next((text for words, text in CREATE_ADVICE if words in message.lower()),
                          "see the message; kubectl describe mpijob " + name)
            raise StageBlocked(f"the MPI operator cannot create MPIJob {name}'s pods ({message}; for "
                               f"{platform.operator_grace_s:.0f} s): {advice}; the job was deleted")
