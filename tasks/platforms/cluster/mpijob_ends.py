"""How an MPIJob's run ended, read from its pods, the operator's conditions and the launcher's output.

Separate from following the job (training.py) because the reading has rules of its own: a failure read from
mpirun's words alone waits for the pods' own ends (an OOM kill the kubelet reports late); a launcher removed from
outside (a drain of its node) is replaced by its launcher Job in the same MPIJob and resumes, while one that
failed on its own is the job's end, read within the Job controller's back-off, before a replacement could start
the failed training again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tasks.k8s.diagnose import job_role, node_silent, pod_ends
from tasks.launch import (
    DEADLINE,
    OUT_OF_MEMORY,
    PREEMPTED,
    REFUSED,
    START_FAILED,
    ExitReading,
    JobOutput,
    read_mpijob_failure,
)
from tasks.platforms.base import LogSink
from tasks.platforms.cluster.api import apis
from tasks.platforms.cluster.problems import list_pods

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform


#: Seconds beyond the pods' grace period that a failure read from mpirun's words alone (a rank killed by a
#: signal, a daemon lost, a daemon that failed at start) waits for the job's pods that still run to end,
#: before it is judged: the pods' own ends say more. The kernel's OOM killer is behind such words, and a worker
#: shows OOMKilled only once its container has ended: on cgroup v2 the whole container dies with the rank
#: (mpirun then loses the daemon), but the kubelet may report it after the launcher's failure; on cgroup v1
#: only the rank dies, and the container ends when the operator deletes the job's running workers
#: (cleanPodPolicy Running), within their grace period (containerd keeps the OOM as the container's reason,
#: whatever its exit code). A pod on a node that stopped reporting never ends: it is not waited for.
SETTLE_EXTRA_S = 15.0


@dataclass
class SeenPods:
    """What following an MPIJob saw of its pods that their listing at its end may no longer show: the job's end
    removes its running pods (cleanPodPolicy Running), and the pod GC those on a node that is gone."""

    #: each pod seen on a node that stopped reporting: how, by pod name
    silent: dict[str, str] = field(default_factory=dict)
    #: by launcher pod: the workers created again while it ran (``workers_replaced_under``)
    replaced: dict[str, set[str]] = field(default_factory=dict)

    def observe(self, pods: list[dict]) -> None:
        """Take what one listing of the job's pods shows."""
        self.silent.update({pod["metadata"]["name"]: how for pod in pods if (how := node_silent(pod))})
        for launcher in (pod["metadata"]["name"] for pod in pods if job_role(pod) == "launcher"):
            if found := workers_replaced_under(pods, launcher):
                self.replaced.setdefault(launcher, set()).update(found)


def read_failure(platform: ClusterPlatform, name: str, job: dict, output: JobOutput,
                  seen: SeenPods | None = None) -> tuple[ExitReading, str]:
    """How a failed MPIJob ended — from its pods' ends, the operator's reason, the launcher's exit code and
    output — and the detail a message shows (the condition and every pod that exited non-zero). A job that
    failed after some of its pods were seen on a node that stopped reporting (``seen.silent``) lost that node:
    the launcher's, say, whose pod the pod GC removed with it before it could say a word; one whose workers were
    removed and created again while its launcher ran lost them — either can resume, unless its pods say otherwise
    (out of memory) or it was refused or ran out of time."""
    seen = seen or SeenPods()
    silent = seen.silent
    core, _, _ = apis(platform)
    condition = failed_condition(job)
    reason = condition.get("reason", "")
    settle_until = time.monotonic() + platform.termination_grace_s + SETTLE_EXTRA_S
    while True:
        pods = list_pods(platform, core, f"training.kubeflow.org/job-name={name}")
        ends = pod_ends(sorted(pods, key=lambda pod: pod["metadata"].get("creationTimestamp") or ""))  # oldest first
        launchers = [end for end in ends if end.role == "launcher" and end.exit_code is not None]
        reading = read_mpijob_failure(reason, launchers[-1].exit_code if launchers else None, output.exit_lines,
                                      output.events, ends)
        from_pods = any(end.out_of_memory or end.disruption for end in ends)
        still_running = any((pod.get("status") or {}).get("phase") in ("Pending", "Running") and not node_silent(pod)
                            for pod in pods)
        if not (reading.kind in (PREEMPTED, START_FAILED) and not from_pods and still_running) \
                or time.monotonic() >= settle_until:
            break
        time.sleep(platform.poll_interval_s)
    replaced = sorted(seen.replaced.get(launchers[-1].name, set()).union(
        workers_replaced_under(pods, launchers[-1].name))) if launchers else []
    if silent and not reading.resumable and reading.kind not in (OUT_OF_MEMORY, REFUSED, DEADLINE):
        lost = ", ".join(f"{pod} ({how})" for pod, how in sorted(silent.items()))
        reading = ExitReading(False, True, f"its pods were on nodes that stopped reporting: {lost}; it failed "
                                           f"without them ({reading.reason}) and can resume", PREEMPTED)
    elif replaced and not reading.resumable and reading.kind not in (OUT_OF_MEMORY, REFUSED, DEADLINE):
        reading = ExitReading(False, True, f"its workers {', '.join(replaced)} were removed while its launcher ran "
                                           f"(a drain or scale-down of their node, an eviction, a preemption) and "
                                           f"created again by the operator; it failed without them "
                                           f"({reading.reason}) and can resume", PREEMPTED)
    elif reason.startswith("BackoffLimitExceeded") and not any(end.role == "launcher" for end in ends) and \
            not reading.resumable and reading.kind not in (OUT_OF_MEMORY, REFUSED, DEADLINE):
        # The launcher Job failed with no launcher pod left: one that ended on its own is kept (restartPolicy
        # Never, and cleanPodPolicy removes only running pods), so this one was removed from outside — evicted by a
        # drain of its node, deleted — before its end could be read (the flow that followed it may have been
        # stopped by the same drain). Its ranks were told to checkpoint: it resumes.
        reading = ExitReading(False, True, f"its launcher pod was removed before it reported its end (evicted by "
                                           f"a drain of its node, or deleted; {reading.reason}) and can resume from "
                                           "its last checkpoint", PREEMPTED)
    exited = ", ".join(f"{end.name} {end.container_reason} (exit {end.exit_code})" for end in ends if end.exit_code)
    return reading, f"{reason}: {condition.get('message', '')}; pods: {exited or 'none found'}"


def workers_replaced_under(pods: list[dict], launcher: str) -> list[str]:
    """The workers of a job that were created after its launcher pod ``launcher`` was: the operator creates every
    worker before the launcher (``getOrCreateWorker``, then the launcher Job, whose controller then creates the
    pod), and afterwards only in place of one that is gone — removed from outside while that launcher ran. Such
    a worker's own end (a DisruptionTarget) went with it, and horovodrun's words about it need not say so: an
    elastic horovodrun that tries the replacement while its sshd starts reports exit 255."""
    created = {pod["metadata"]["name"]: str(pod["metadata"].get("creationTimestamp") or "") for pod in pods}
    since = created.get(launcher)
    if not since:
        return []
    ended = [str(terminated["finishedAt"]) for pod in pods if pod["metadata"]["name"] == launcher
             for status in (pod.get("status") or {}).get("containerStatuses") or []
             if (terminated := (status.get("state") or {}).get("terminated")) and terminated.get("finishedAt")]
    until = min(ended, default="\uffff")  # a worker created after the launcher ended replaced one after it
    return sorted(name for pod in pods if job_role(pod) == "worker"
                  and since < created[(name := pod["metadata"]["name"])] <= until)


def launcher_failed_on_its_own(pods: list[dict]) -> bool:
    """Whether one of an MPIJob's launcher pods ended with a failure of its own: a non-zero exit, neither removed
    nor stopped from outside (those its launcher Job replaces, and the replacement resumes). Such a failure is
    the job's end: its launcher Job is told to start no other (training.stop_launcher_replacements), within the
    Job controller's first back-off (10 s), or it would start the failing training again, up to its
    backoffLimit (tasks.k8s.manifests.LAUNCHER_REPLACEMENTS)."""
    kept = [pod for pod in pods if not pod["metadata"].get("deletionTimestamp")]
    return any(end.role == "launcher" and end.exit_code not in (None, 0) and end.disruption is None
               for end in pod_ends(kept))


def say_launcher_replacements(pods: list[dict], seen: dict[str, bool], on_log: LogSink) -> None:
    """Say once each launcher pod that is being removed or is gone while its MPIJob runs on: the launcher Job
    starts another in its place, which resumes from the ranks' checkpoint."""
    launchers = {pod["metadata"]["name"]: pod for pod in pods if job_role(pod) == "launcher"}
    for name in launchers:
        seen.setdefault(name, False)
    for name, said in seen.items():
        pod = launchers.get(name)
        if said or (pod is not None and not pod["metadata"].get("deletionTimestamp")):
            continue
        seen[name] = True
        how = "is gone" if pod is None else f"is being stopped from outside (on node {pod['spec'].get('nodeName')})"
        on_log(f"laneflow: launcher pod {name} {how}: a drain or scale-down of its node, an eviction or a deletion. "
               f"Its ranks checkpoint; the launcher Job starts another launcher on the same workers, which resumes "
               f"from there (the MPIJob, its pods and GPUs stay)")




def mpijob_state(job: dict) -> str:
    """succeeded, failed, running, or pending (refused, waiting for its workers, or not seen by the operator)."""
    types = {c["type"] for c in (job.get("status") or {}).get("conditions", []) if c.get("status") == "True"}
    if "Succeeded" in types:
        return "succeeded"
    if "Failed" in types:
        return "failed"
    return "running" if "Running" in types else "pending"




def failed_condition(job: dict) -> dict:
    """The job's ``Failed`` condition that holds (the operator flips earlier ones to False)."""
    conditions = (job.get("status") or {}).get("conditions", [])
    return next((c for c in reversed(conditions) if c.get("type") == "Failed" and c.get("status") == "True"), {})
