"""The MPI operator's ``runPolicy.suspend`` (kubeflow/mpi-operator v0.8.2, commit caa3c47,
``pkg/controller/mpi_job_controller.go`` syncHandler and ``mpi_job_controller_status.go``), what Kueue drives an
MPIJob by: a suspended MPIJob has its Service, ConfigMap and Secret, and a launcher Job created suspended
(``newLauncherJob``: ``if isMPIJobSuspended(mpiJob) { job.Spec.Suspend = ptr.To(true) }``), but no worker
pods — running ones are deleted (``cleanUpWorkerPods``) and a running launcher Job is suspended, so the Job
controller deletes its pod. Conditions: ``Suspended`` True (``MPIJobSuspended``, "MPIJob suspended") and
``Running`` False (``MPIJobSuspended``, "MPIJob <ns>/<name> is suspended."); ``startTime`` is left as it is.
Resumed: the launcher Job's ``startTime`` is cleared, its scheduling directives (labels and annotations merged;
nodeSelector, tolerations and schedulingGates replaced) are copied from the MPIJob's launcher template, it is
unsuspended; workers are made again; ``Suspended`` False (``MPIJobResumed``, "MPIJob resumed") and ``startTime``
is now. As upstream, ``WaitForWorkersReady`` is not looked at again on resume (mpi-operator issue #615).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.cluster.garbage_collector import delete
from tests.cluster.job_controller import set_suspended
from tests.cluster.objects import now, record_event
from tests.cluster.state import OPERATOR

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.cluster.state import Cluster


def is_suspended(job: dict) -> bool:
    return bool(((job.get("spec") or {}).get("runPolicy") or {}).get("suspend"))


def was_suspended(job: dict) -> bool:
    return any(c["type"] == "Suspended" and c["status"] == "True"
               for c in (job.get("status") or {}).get("conditions") or [])


def hold_suspended(cluster: Cluster, job: dict, workers: list[dict], launcher: dict | None,
                   condition: Callable[[dict, str, str, str, str], None]) -> None:
    """A sync of a suspended MPIJob: its running workers deleted, its launcher Job suspended, the conditions
    and the event (when ``Suspended`` turns True)."""
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    for pod in workers:  # deleteWorkerPods: Pending and Running always; finished ones too unless policy Running
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if pod["status"].get("phase") in ("Pending", "Running") or \
                cluster.operator_specs[(namespace, name)]["runPolicy"]["cleanPodPolicy"] != "Running":
            delete(cluster, "pods", pod)
    if launcher is not None and not launcher["spec"].get("suspend"):
        set_suspended(cluster, launcher, True)
    if not was_suspended(job):
        record_event(cluster, job, "Normal", "MPIJobSuspended", "MPIJob suspended", OPERATOR)
    condition(job, "Suspended", "True", "MPIJobSuspended", "MPIJob suspended")
    condition(job, "Running", "False", "MPIJobSuspended", f"MPIJob {namespace}/{name} is suspended.")


def resume(cluster: Cluster, job: dict, launcher: dict | None, launcher_template: dict,
           condition: Callable[[dict, str, str, str, str], None]) -> None:
    """The sync that finds a once-suspended MPIJob unsuspended: the launcher Job follows it, with the MPIJob's
    launcher scheduling directives (what Kueue injected on admission); the job's startTime is now."""
    if launcher is not None and launcher["spec"].get("suspend"):
        launcher["status"].pop("startTime", None)
        pod_template = launcher["spec"]["template"]
        metadata = pod_template.setdefault("metadata", {})
        wanted = launcher_template.get("metadata") or {}
        for key in ("labels", "annotations"):
            metadata.setdefault(key, {}).update(wanted.get(key) or {})
        wanted_spec = launcher_template.get("spec") or {}
        for key in ("nodeSelector", "tolerations", "schedulingGates"):
            if wanted_spec.get(key):
                pod_template["spec"][key] = wanted_spec[key]
            else:
                pod_template["spec"].pop(key, None)
        set_suspended(cluster, launcher, False)
    record_event(cluster, job, "Normal", "MPIJobResumed", "MPIJob resumed", OPERATOR)
    condition(job, "Suspended", "False", "MPIJobResumed", "MPIJob resumed")
    job["status"]["startTime"] = now()
