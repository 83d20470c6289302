"""``laneflow doctor``'s reads of the queues a block names: Kueue's (its API, the LocalQueue, its ClusterQueue, the
priority class) and Run:ai's (the project's namespace, its queue); the verdicts are ``tasks/doctor_queues.py``'s."""

from __future__ import annotations

import kubernetes

from flows.doctor_reads import ask, served_check
from tasks.doctor import Check, unreadable_verdict
from tasks.doctor_queues import (
    KUEUE_API,
    KUEUE_FIX,
    RUNAI_FIX,
    RUNAI_QUEUES,
    local_queue_verdict,
    priority_class_verdict,
    runai_namespace_verdict,
    runai_queue_verdict,
)


def kueue_checks(client: kubernetes.client.ApiClient, platform: object) -> list[Check]:
    """Kueue's API served, the block's LocalQueue and its ClusterQueue active, the priority class there."""
    group, version = KUEUE_API
    served = served_check(client, "Kueue's API", group, version, "workloads", KUEUE_FIX)
    if not served.ok:
        return [served]
    custom = kubernetes.client.CustomObjectsApi(client)
    namespace, name = platform.effective_namespace(), platform.kueue_queue
    local, error = ask(lambda: custom.get_namespaced_custom_object(group, version, namespace, "localqueues", name))
    if error:
        checks = [unreadable_verdict(f"Kueue LocalQueue {namespace}/{name}", error)]
    else:
        target = ((local or {}).get("spec") or {}).get("clusterQueue")
        queue, error = ask(lambda: custom.get_cluster_custom_object(group, version, "clusterqueues", target)) \
            if target else (None, None)
        checks = [unreadable_verdict(f"Kueue ClusterQueue {target}", error) if error
                  else local_queue_verdict(namespace, name, local, queue)]
    if platform.kueue_priority_class:
        found, error = ask(lambda: custom.get_cluster_custom_object(group, version, "workloadpriorityclasses",
                                                                      platform.kueue_priority_class))
        checks.append(unreadable_verdict(f"Kueue WorkloadPriorityClass {platform.kueue_priority_class}", error)
                      if error else priority_class_verdict(platform.kueue_priority_class, found))
    return [served, *checks]


def runai_checks(client: kubernetes.client.ApiClient, project: str) -> list[Check]:
    """The project's namespace and its label; Run:ai's Queue API served and the project's queue fit to run jobs."""
    name = f"runai-{project}"
    found, error = ask(lambda: kubernetes.client.CoreV1Api(client).read_namespace(name))
    checks = [unreadable_verdict(f"Run:ai project {project}'s namespace {name}", error) if error
              else runai_namespace_verdict(project, client.sanitize_for_serialization(found) if found else None)]
    group, version, plural = RUNAI_QUEUES
    served = served_check(client, "Run:ai's scheduling API", group, version, plural, RUNAI_FIX)
    if not served.ok:
        return [*checks, served]
    listed, error = ask(lambda: kubernetes.client.CustomObjectsApi(client).list_cluster_custom_object(
        group, version, plural))
    checks.append(served)
    checks.append(unreadable_verdict(f"Run:ai queue {project}", error) if error
                  else runai_queue_verdict(project, (listed or {}).get("items") or []))
    return checks
