"""``laneflow doctor``'s verdicts on the queues a block names: Kueue's LocalQueue, its ClusterQueue and priority
class, and a Run:ai project's namespace and queue (pure functions, as in ``tasks/doctor.py``; the shell reads)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tasks.doctor import Check, presence_verdict

# --- Kueue -----------------------------------------------------------------------------------------------------
KUEUE_API = ("kueue.x-k8s.io", "v1beta2")
KUEUE_FIX = ("install Kueue v0.19 or later, which serves kueue.x-k8s.io/v1beta2 (kubectl apply --server-side -f "
             "https://github.com/kubernetes-sigs/kueue/releases/download/v0.19.2/manifests.yaml), or clear the "
             "block's kueue_queue")


def _condition(found: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in (found.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def local_queue_verdict(namespace: str, name: str, local: Mapping[str, Any] | None,
                        cluster_queue: Mapping[str, Any] | None) -> Check:
    """The block's LocalQueue and the ClusterQueue it points at, as the API serves them (None: not found): both
    must be ``Active`` (Kueue's controllers set it: a missing ClusterQueue, a missing ResourceFlavor, a stopped
    queue make it False with the reason)."""
    what = f"Kueue LocalQueue {namespace}/{name} admitting workloads"
    if local is None:
        return Check(what, False, "not found",
                     f"kubectl apply -k deployments/kueue (its LocalQueue laneflow; set its namespace to {namespace}), "
                     f"or set the block's kueue_queue to one of: kubectl get localqueues -n {namespace}")
    target = (local.get("spec") or {}).get("clusterQueue", "?")
    if cluster_queue is None:
        return Check(what, False, f"its ClusterQueue {target} does not exist",
                     f"create ClusterQueue {target} (deployments/kueue/queues.yaml is an example), or point the "
                     "LocalQueue at one of: kubectl get clusterqueues")
    for found, whose in ((local, f"LocalQueue {name}"), (cluster_queue, f"ClusterQueue {target}")):
        active = _condition(found, "Active")
        if active is None or active.get("status") != "True":
            why = f"{active.get('reason')}: {active.get('message')}" if active else "no Active condition yet"
            return Check(what, False, f"{whose} is not active ({why})",
                         f"kubectl describe clusterqueue {target}; its flavors must exist (kubectl get resourceflavors)"
                         " and it must not be stopped (spec.stopPolicy)")
    return Check(what, True, f"ClusterQueue {target}")


def priority_class_verdict(name: str, found: Mapping[str, Any] | None) -> Check:
    return presence_verdict(f"Kueue WorkloadPriorityClass {name}", found,
                            "kubectl apply -k deployments/kueue (laneflow-nightly, laneflow-trial), or set the "
                            "block's kueue_priority_class to one of: kubectl get workloadpriorityclasses",
                            f"value {(found or {}).get('value')}")


# --- Run:ai ----------------------------------------------------------------------------------------------------
#: Run:ai's scheduling queues (its scheduler, open-sourced as NVIDIA's KAI Scheduler: deployments/kai-scheduler/crds/
#: scheduling.run.ai_queues.yaml, cluster-scoped, v2 only). A project's pods carry ``runai/queue: <project>`` and go
#: to the queue of that name; Run:ai links the project's namespace with the same label (docs.run.ai, "Manually
#: Create Projects": ``kubectl label ns <ns> runai/queue=<project>``).
RUNAI_QUEUES = ("scheduling.run.ai", "v2", "queues")
RUNAI_QUEUE_LABEL = "runai/queue"
RUNAI_FIX = ("install Run:ai's cluster components (its scheduler serves scheduling.run.ai/v2 Queues), or clear the "
             "block's runai_project")


def runai_namespace_verdict(project: str, namespace: Mapping[str, Any] | None) -> Check:
    """The project's namespace ``runai-<project>``, linked to the project by its ``runai/queue`` label."""
    name = f"runai-{project}"
    what = f"Run:ai project {project}'s namespace {name}"
    if namespace is None:
        return Check(what, False, "not found",
                     f"create project {project} in Run:ai (it creates namespace {name}), or set the block's "
                     "runai_project to one of: kubectl get ns -l runai/queue")
    label = ((namespace.get("metadata") or {}).get("labels") or {}).get(RUNAI_QUEUE_LABEL)
    if label != project:
        return Check(what, False, f"its label {RUNAI_QUEUE_LABEL} is {label!r}, not {project!r}",
                     f"kubectl label ns {name} {RUNAI_QUEUE_LABEL}={project} --overwrite")
    return Check(what, True, f"{RUNAI_QUEUE_LABEL}={project}")


def runai_queue_verdict(project: str, queues: Iterable[Mapping[str, Any]]) -> Check:
    """The project's queue among every Queue of the cluster: it exists, its parent does, it is a leaf (only leaf
    queues run jobs) and it may have GPUs — a quota (-1: unlimited) or an over-quota limit (-1: none; 0 or unset:
    nothing beyond the quota), KAI Scheduler's docs/queues."""
    what = f"Run:ai queue {project} with GPUs for the project's jobs"
    by_name = {(q.get("metadata") or {}).get("name"): q for q in queues}
    queue = by_name.get(project)
    if queue is None:
        return Check(what, False, "no such queue",
                     f"create project {project} in Run:ai (it makes its queue), or set the block's runai_project "
                     "to one of: kubectl get queues.scheduling.run.ai")
    spec = queue.get("spec") or {}
    parent = spec.get("parentQueue")
    if parent and parent not in by_name:
        return Check(what, False, f"its parent queue {parent} does not exist",
                     f"create queue {parent} (a Run:ai department), or move project {project} under one that exists")
    children = sorted(name for name, q in by_name.items() if (q.get("spec") or {}).get("parentQueue") == project)
    if children:
        return Check(what, False, f"it is a parent queue (of {', '.join(children)}): only leaf queues run jobs",
                     "set the block's runai_project to a project, not a department")
    gpu = (spec.get("resources") or {}).get("gpu") or {}
    quota, limit = gpu.get("quota", 0), gpu.get("limit", 0)
    if quota == 0 and limit == 0:
        return Check(what, False, "GPU quota 0 and no over-quota limit: its jobs can never get a GPU",
                     f"give project {project} a GPU quota (or an over-quota limit) in Run:ai")
    shown = {-1: "unlimited", 0: "none"}
    return Check(what, True, f"GPU quota {shown.get(quota, quota)}, limit {shown.get(limit, limit)}")
