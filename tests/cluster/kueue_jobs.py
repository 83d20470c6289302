"""Kueue's job integration (kubernetes-sigs/kueue v0.19.2, commit 8eab687) for the two kinds laneflow creates,
``kubeflow.org/mpijob`` and ``batch/job``, as far as the emulator plays it (``Cluster.kueue_installed``):

* the mutating webhooks (``pkg/controller/jobs/mpijob/mpijob_webhook.go``, ``job/job_webhook.go``,
  ``jobframework/defaults.go``): a job created with the queue label ``kueue.x-k8s.io/queue-name`` is stored
  suspended (``runPolicy.suspend`` / ``spec.suspend``); ``manageJobsWithoutQueueName`` is false (the default), so
  a job without the label is left alone;
* the validating webhooks (``jobframework/validation.go``): the queue name must be a DNS-1123 subdomain, is
  immutable while the job runs, and a priority class cannot be added to a running job; the elastic-job
  annotation is refused on an MPIJob (Kueue's elastic jobs are Job and Ray kinds only);
* the job reconciler (``jobframework/reconciler.go``): a Workload per queued job, named as
  ``GetWorkloadNameForOwnerWithGVK`` names it (``<kind>-<name>-<sha1(kind, group, name, uid)[:5]>``), its pod
  sets the job's (MPIJob: ``launcher``, ``worker``; Job: ``main``), its priority the WorkloadPriorityClass the
  ``kueue.x-k8s.io/priority-class`` label names (no such class: no Workload, retried); on admission the job is
  unsuspended with each pod set's flavor (``nodeLabels`` into ``nodeSelector``, ``tolerations`` appended, the
  ``kueue.x-k8s.io/podset`` and queue labels); evicted, it is suspended with its templates restored, and once
  none of its pods is active the Workload is requeued (``Requeued``, ``QuotaReserved`` False); finished, the
  Workload is ``Finished`` and its quota free.

Not modelled: admission checks, topology-aware scheduling, ``waitForPodsReady``, MultiKueue, Workload
finalizers (a Workload goes with its job through the garbage collector), PriorityClass-based priorities.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import TYPE_CHECKING, Any

from tests.cluster.apierrors import Cause, Rejection, invalid
from tests.cluster.job_controller import set_suspended
from tests.cluster.objects import controller_ref, now, record_event, stamp_metadata

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
KUEUE = "kueue-manager"
#: The kinds integrated here: resource -> (kind, group, webhook names (mutating, validating)).
KINDS = {"mpijobs": ("MPIJob", "kubeflow.org", "vmpijob.kb.io"), "jobs": ("Job", "batch", "vjob.kb.io")}
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# --- webhooks ------------------------------------------------------------------------------------------

def is_suspended(resource: str, job: dict) -> bool:
    spec = job.get("spec") or {}
    return bool((spec.get("runPolicy") or {}).get("suspend") if resource == "mpijobs" else spec.get("suspend"))


def _set_suspend(resource: str, job: dict, suspend: bool) -> None:
    if resource == "mpijobs":
        job.setdefault("spec", {}).setdefault("runPolicy", {})["suspend"] = suspend
    else:
        job.setdefault("spec", {})["suspend"] = suspend


def default_on_create(cluster: Cluster, resource: str, job: dict) -> None:
    """The mutating webhook: a job with a queue name is stored suspended (``ApplyDefaultForSuspend``)."""
    if cluster.kueue_installed and resource in KINDS and (job["metadata"].get("labels") or {}).get(QUEUE_LABEL):
        _set_suspend(resource, job, True)


def _denied(resource: str, job: dict, causes: list[Cause]) -> Rejection:
    """A validating webhook's denial as the API server relays it: the webhook's 422 with its name in front."""
    kind, group, webhook = KINDS[resource]
    texts = [cause.text() for cause in causes]
    aggregate = texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
    message = (f'admission webhook "{webhook}" denied the request: {kind}.{group} '
               f'"{job["metadata"]["name"]}" is invalid: {aggregate}')
    return Rejection(422, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": "Invalid", "code": 422,
                           "details": {"name": job["metadata"]["name"], "group": group, "kind": kind, "causes": [
                               {"reason": c.reason, "message": c.message, "field": c.field} for c in causes]}})


def validate(cluster: Cluster, resource: str, job: dict, old: dict | None = None) -> None:
    """The validating webhook (``ValidateJobOnCreate``/``ValidateJobOnUpdate``); raises the API server's
    refusal."""
    if not cluster.kueue_installed or resource not in KINDS:
        return
    labels = job["metadata"].get("labels") or {}
    causes: list[Cause] = []
    queue = labels.get(QUEUE_LABEL)
    if queue and not _SUBDOMAIN.match(queue):
        causes.append(invalid(f"metadata.labels[{QUEUE_LABEL}]", queue,
                              "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                              "'-' or '.', and must start and end with an alphanumeric character"))
    if resource == "mpijobs" and ELASTIC_ANNOTATION in (job["metadata"].get("annotations") or {}):
        causes.append(invalid(f"metadata.annotations[{ELASTIC_ANNOTATION}]",
                              job["metadata"]["annotations"][ELASTIC_ANNOTATION],
                              'elastic job is not supported for "kubeflow.org/v2beta1, Kind=MPIJob"'))
    if old is not None and not is_suspended(resource, job):
        before = old["metadata"].get("labels") or {}
        if before.get(QUEUE_LABEL) != queue:
            causes.append(invalid(f"metadata.labels[{QUEUE_LABEL}]", queue or "", "field is immutable"))
        if PRIORITY_LABEL in labels and PRIORITY_LABEL not in before:
            causes.append(Cause("FieldValueInvalid", f"metadata.labels[{PRIORITY_LABEL}]",
                                "WorkloadPriorityClass cannot be added to a non-suspended workload"))
    if causes:
        raise _denied(resource, job, causes)


# --- the Workload of a job -----------------------------------------------------------------------------

def workload_name(kind: str, group: str, name: str, uid: str) -> str:
    """``GetWorkloadNameForOwnerWithGVK`` (jobframework/workload_names.go): the owner's kind and name, cut to
    leave room for a dash and five hex digits of the SHA-1 of kind, group, name and uid."""
    digest = hashlib.sha1(f"{kind}\n{group}\n{name}\n{uid}".encode()).hexdigest()[:5]
    return f"{f'{kind.lower()}-{name}'[:253 - 6]}-{digest}"


def pod_sets(resource: str, job: dict) -> list[dict]:
    """The job's pod sets (MPIJob ``PodSets``: launcher then worker, count = replicas; Job: one ``main`` of
    min(parallelism, completions)), their templates as the job has them."""
    spec = job["spec"]
    if resource == "mpijobs":
        replicas = spec.get("mpiReplicaSpecs") or {}
        return [{"name": role.lower(), "count": int(replicas[role].get("replicas", 1)),
                 "template": copy.deepcopy(replicas[role]["template"])}
                for role in ("Launcher", "Worker") if role in replicas]
    count = min(int(spec.get("parallelism", 1)), int(spec.get("completions", spec.get("parallelism", 1))))
    return [{"name": "main", "count": count, "template": copy.deepcopy(spec["template"])}]


def pod_templates(resource: str, job: dict) -> dict[str, dict]:
    """The job's pod templates by pod set name, in place (what admission changes and eviction restores)."""
    if resource == "mpijobs":
        replicas = job["spec"].get("mpiReplicaSpecs") or {}
        return {role.lower(): replicas[role]["template"] for role in ("Launcher", "Worker") if role in replicas}
    return {"main": job["spec"]["template"]}


def workload_of(cluster: Cluster, job: dict) -> dict | None:
    uid = job["metadata"]["uid"]
    return next((w for (namespace, _), w in cluster.objects["workloads"].items()
                 if namespace == job["metadata"]["namespace"]
                 and (w["metadata"].get("labels") or {}).get(JOB_UID_LABEL) == uid), None)


def create_workload(cluster: Cluster, resource: str, job: dict) -> dict | None:
    """The job's Workload (``ConstructWorkload``); None while the WorkloadPriorityClass it names does not exist
    (the reconciler's error, retried)."""
    kind, group, _ = KINDS[resource]
    metadata = job["metadata"]
    labels = metadata.get("labels") or {}
    priority, reference = 0, None
    if labels.get(PRIORITY_LABEL):
        found = cluster.objects["workloadpriorityclasses"].get(("", labels[PRIORITY_LABEL]))
        if found is None:
            return None
        priority = int(found["value"])
        reference = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": labels[PRIORITY_LABEL]}
    name = workload_name(kind, group, metadata["name"], metadata["uid"])
    workload = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"name": name, "namespace": metadata["namespace"],
                             "labels": {JOB_UID_LABEL: metadata["uid"]}, "ownerReferences": [controller_ref(job)]},
                "spec": {"podSets": pod_sets(resource, job), "queueName": labels[QUEUE_LABEL], "priority": priority,
                         "active": True, **({"priorityClassRef": reference} if reference else {})},
                "status": {}}
    stamp_metadata(cluster, workload, metadata["namespace"])
    cluster.objects["workloads"][(metadata["namespace"], name)] = workload
    record_event(cluster, job, "Normal", "CreatedWorkload", f"Created Workload: {metadata['namespace']}/{name}",
                 KUEUE)
    return workload


def condition(workload: dict, kind: str, status: str, reason: str, message: str) -> None:
    """``apimeta.SetStatusCondition``: the transition time changes only with the status."""
    conditions = workload.setdefault("status", {}).setdefault("conditions", [])
    found = next((c for c in conditions if c["type"] == kind), None)
    if found is None:
        conditions.append({"type": kind, "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": now()})
        return
    if found["status"] != status:
        found["lastTransitionTime"] = now()
    found.update({"status": status, "reason": reason, "message": message})


def has(workload: dict, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in (workload.get("status") or {}).get("conditions")
               or [])


# --- what admission and eviction do to the job ---------------------------------------------------------

def start(cluster: Cluster, resource: str, job: dict, workload: dict, flavors: dict[str, dict],
          cluster_queue: str) -> None:
    """``startJob`` with ``RunWithPodSetsInfo``: each pod set's template gets its flavor's node labels and
    tolerations and Kueue's labels, the job is unsuspended and its controller syncs it."""
    for podset, template in pod_templates(resource, job).items():
        flavor = (flavors.get(podset) or {}).get("spec") or {}
        spec = template.setdefault("spec", {})
        if flavor.get("nodeLabels"):
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **flavor["nodeLabels"]}
        for toleration in flavor.get("tolerations") or []:
            if toleration not in (spec.get("tolerations") or []):
                spec.setdefault("tolerations", []).append(copy.deepcopy(toleration))
        metadata = template.setdefault("metadata", {})
        metadata.setdefault("labels", {}).update({
            "kueue.x-k8s.io/podset": podset, "kueue.x-k8s.io/local-queue-name": workload["spec"]["queueName"],
            "kueue.x-k8s.io/cluster-queue-name": cluster_queue})
        metadata.setdefault("annotations", {})["kueue.x-k8s.io/workload"] = workload["metadata"]["name"]
    record_event(cluster, job, "Normal", "Started", f"Admitted by clusterQueue {cluster_queue}", KUEUE)
    _suspend(cluster, resource, job, False)


def stop(cluster: Cluster, resource: str, job: dict, workload: dict, message: str) -> None:
    """``stopJob``: suspended, its templates as the Workload's pod sets recorded them (``RestorePodSetsInfo``)."""
    originals = {podset["name"]: podset["template"] for podset in workload["spec"]["podSets"]}
    for podset, template in pod_templates(resource, job).items():
        if podset in originals:
            template.clear()
            template.update(copy.deepcopy(originals[podset]))
    record_event(cluster, job, "Normal", "Stopped", message, KUEUE)
    _suspend(cluster, resource, job, True)


def _suspend(cluster: Cluster, resource: str, job: dict, suspend: bool) -> None:
    if resource == "jobs":
        set_suspended(cluster, job, suspend)
        return
    from tests.cluster.mpi_operator import sync_mpijob  # the operator imports the Job controller, as this does

    _set_suspend(resource, job, suspend)
    sync_mpijob(cluster, job)


def job_active(cluster: Cluster, job: dict) -> bool:
    """Whether a pod of the job is still there and not finished (``IsActive``: an MPIJob's replicas' active
    counts; a Job's ``status.active``): an evicted Workload is requeued only once nothing of it runs."""
    uids = {job["metadata"]["uid"]}
    uids |= {j["metadata"]["uid"] for j in cluster.objects["jobs"].values()
             if any(r.get("uid") == job["metadata"]["uid"] for r in j["metadata"].get("ownerReferences") or [])}
    return any(pod["status"].get("phase") in ("Pending", "Running") and any(
        reference.get("uid") in uids for reference in pod["metadata"].get("ownerReferences") or [])
        for pod in cluster.objects["pods"].values())


def job_finished(resource: str, job: dict) -> tuple[str, str] | None:
    """(reason, message) of the job's end for the Workload's ``Finished`` condition, None while it runs."""
    wanted = {"mpijobs": {"Succeeded": "Succeeded", "Failed": "Failed"},
              "jobs": {"Complete": "Succeeded", "Failed": "Failed"}}[resource]
    for found in (job.get("status") or {}).get("conditions") or []:
        if found["type"] in wanted and found.get("status") == "True":
            return wanted[found["type"]], found.get("message") or ""
    return None


def queued_jobs(cluster: Cluster) -> list[tuple[str, dict]]:
    """Every job Kueue manages: those with a queue name, not owned by another job (an MPIJob's launcher Job)."""
    found: list[tuple[str, Any]] = []
    for resource in KINDS:
        for job in cluster.objects[resource].values():
            if (job["metadata"].get("labels") or {}).get(QUEUE_LABEL) and not job["metadata"].get("ownerReferences"):
                found.append((resource, job))
    return found
