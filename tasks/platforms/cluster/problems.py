"""Pods and claims that cannot run: said once each, and the stage failed once one outlasts its grace.

Separate because three concerns wait on the cluster the same way (a claim being bound, a data Job, an
MPIJob): what is wrong is read by tasks/k8s/diagnose.py; here it is read from the API, logged, and acted
on with the block's grace periods (a Run:ai project's queue, not laneflow, decides how long a pod waits).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import kubernetes

from tasks.k8s.diagnose import PodProblem, ProblemClock, creating, pod_problems
from tasks.platforms.base import LogSink, StageBlocked, TrainingInterrupted
from tasks.platforms.cluster.api import call

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform


def problem_clock(platform: ClusterPlatform) -> ProblemClock:
    """A fresh clock for one stage's wait, with the block's grace periods."""
    return ProblemClock(platform.pod_problem_grace_s, platform.scheduling_grace_s, {})


def check_pods(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, selector: str, clock: ProblemClock,
               log: LogSink, stopping: str, exited_workers: bool = False,
               training_alive: bool = False, elastic: bool = False, elastic_min_pods: int | None = None) -> list[dict]:
    """Report a stage's pods that cannot run once each; fail the stage when one stays so past its grace; the
    pods read. ``exited_workers``, ``training_alive``, ``elastic``, ``elastic_min_pods``: the pods of an MPIJob,
    whether its log still advances, whether it is elastic and the worker pods it needs (see ``pod_problems``)."""
    pods = list_pods(platform, core, selector)
    replaced = clock.replacements(pods) if exited_workers and not elastic else frozenset()
    problems = pod_problems(pods, [], exited_workers, replaced, training_alive, elastic, elastic_min_pods)
    events: list[dict] = []
    if any(problem.reason == "Unschedulable" for problem in problems):  # is an autoscaler adding a node?
        events += _pod_events(platform, core, "involvedObject.kind=Pod,reason=TriggeredScaleUp")
    if creating(pods):  # a volume that does not mount? (the pod only says ContainerCreating)
        failed = _pod_events(platform, core, "involvedObject.kind=Pod,reason=FailedMount")
        for name in sorted({e["involvedObject"]["name"] for e in failed}):  # did its mounts succeed since?
            events += _pod_events(platform, core, f"involvedObject.kind=Pod,involvedObject.name={name}")
    if events:
        problems = pod_problems(pods, events, exited_workers, replaced, training_alive, elastic, elastic_min_pods)
    act_on(platform, problems, clock, log, stopping)
    return pods


def list_pods(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, selector: str) -> list[dict]:
    """The namespace's pods ``selector`` picks, as API dicts (camelCase), which the readers here take."""
    return [core.api_client.sanitize_for_serialization(pod) for pod in
            call(platform, "list", "pods", core.list_namespaced_pod, platform.effective_namespace(),
                 label_selector=selector).items]


def _pod_events(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, selector: str) -> list[dict]:
    return [core.api_client.sanitize_for_serialization(e) for e in
            call(platform, "list", "events", core.list_namespaced_event, platform.effective_namespace(),
                 field_selector=selector).items]


def act_on(platform: ClusterPlatform, problems: list[PodProblem], clock: ProblemClock, log: LogSink,
           stopping: str | None) -> None:
    """Say each new problem once; raise for those past their grace period (resumable ones as an
    interruption), naming what was stopped."""
    queued = platform.runai_project is not None  # Run:ai's queue decides when a pod is scheduled
    new, late = clock.overdue(problems, time.monotonic())
    for problem in new:
        if problem.optional:
            log(f"laneflow: {problem.describe()}; the elastic job trains on the workers it has meanwhile and takes "
                "this one when it is scheduled")
            continue
        if queued and problem.patient:
            log(f"laneflow: {problem.describe()}; waiting for the Run:ai queue of project {platform.runai_project}")
            continue
        log(f"laneflow: {problem.describe()}"
            + ("; a cluster autoscaler is adding a node for it" if problem.scaling_up else "")
            + f"; the stage fails if it lasts {clock.grace_for(problem):.0f} s")
    late = [problem for problem in late if not (queued and problem.patient) and not problem.optional]
    if not late:
        return
    message = f"in namespace {platform.effective_namespace()}: " + "; ".join(p.describe() for p in late) + \
        (f" ({stopping})" if stopping else "")
    if all(problem.resumable for problem in late):
        raise TrainingInterrupted(message)
    raise StageBlocked(message)
