"""Why a stage's pods are not running, read from their status as the kubelet and scheduler report it (pure).

A pod that cannot pull its image, cannot be scheduled or cannot be configured never writes a log line
and its Job or MPIJob never fails: without reading the pods the stage would wait until its deadline,
hours later. Each problem below is what a user meets first on a new cluster, with what to do about it.

Sources: container waiting reasons from the kubelet (``pkg/kubelet/images/types.go``: ``ErrImagePull``,
``ImagePullBackOff``, ``InvalidImageName``; ``pkg/kubelet/kuberuntime``: ``CreateContainerConfigError``,
``CrashLoopBackOff``), the ``PodScheduled=False`` condition with reason ``Unschedulable`` that
kube-scheduler sets, the cluster autoscaler's ``TriggeredScaleUp`` event on a pod it is adding a
node for, the kubelet's ``FailedMount`` Warning on a pod whose volume cannot be set up (it stays
``ContainerCreating``: the waiting reason never says so, only the event does; pkg/kubelet/volumemanager
``WaitForAttachAndMount``), and a container terminated with reason ``OOMKilled`` (the kernel's OOM killer
in its memory cgroup, reported by the container runtime).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

IMAGE = ("check the image reference in the platform block (image for training and evaluation, data_image for "
         "the dataset stage): its registry, name and tag, that it was pushed there, and that the nodes may pull "
         "it (imagePullSecrets of the service account)")
ADVICE = {
    "ErrImagePull": IMAGE,
    "ImagePullBackOff": IMAGE,
    "InvalidImageName": "the image reference is not valid: fix image / data_image in the platform block",
    "CreateContainerConfigError": "a Secret or ConfigMap the pod refers to, or one of its keys, is missing: "
                                  "create it in the namespace",
    "CrashLoopBackOff": "the container keeps exiting right after it starts: its log says why",
    "OOMKilled": "the kernel killed the container for memory: raise limits.memory (a LimitRange of the "
                 "namespace may set one by default: kubectl describe limitrange), or, with no limit, request "
                 "memory so it lands on a node with room; or lower batch_size / the DataLoader's workers",
    # A training worker's memory is the platform block's to set (tasks.k8s.scheduling.WorkerScheduling).
    "OOMKilledWorker": "the kernel killed the worker for memory: raise worker_memory in the platform block (with "
                       "worker_qos guaranteed it is the workers' limits.memory; a LimitRange of the namespace may "
                       "set a limit by default: kubectl describe limitrange), or lower batch_size / loader_workers; "
                       "running it again as it is meets the same limit, so it is not retried",
    "NodeNotReady": "its node stopped reporting to the API server (lost, or cut off from the network), so the job "
                    "cannot go on: mpirun would wait on it for minutes. The run resumes from its last checkpoint "
                    "on the nodes that remain (kubectl describe node shows the node's state)",
    "WorkerReplaced": "the job cannot go on without it; the run resumes from its last checkpoint with a new job",
    "WorkerExited": "an MPI worker must keep sshd running for the launcher (the operator waits for every worker "
                    "and never replaces one that exited): its log says why it stopped (kubectl logs <pod>); see "
                    "docs/getting-started/cluster.md, 'What the training image must contain'",
    "ProvisioningFailed": "the storage class cannot provision the claim: check storage_class in the platform block "
                          "(kubectl get storageclass; deployments/base/storageclass-anf.yaml is an example) and "
                          "the CSI provisioner's log",
    "Unschedulable": "no node has what the pod asks for: lower gpus_per_worker or workers, or add nodes with "
                     "those resources (a cluster autoscaler needs a node pool that has them)",
}
MOUNT_OBJECT_ADVICE = ("a Secret or ConfigMap the pod mounts does not exist: create it in the namespace (an "
                       "MPIJob's <job>-ssh and <job>-config are the MPI operator's: check that it runs)")
MOUNT_VOLUME_ADVICE = ("the node cannot mount the volume: check that the ANF volume's export policy allows the "
                       "cluster's node subnet and that the nodes reach the volume's delegated subnet; the kubelet's "
                       "message above says what the NFS mount answered")
CLAIM_ADVICE = ("the pod's volume claim does not exist or is not bound: run the stage that makes the volume (or "
                "restore it), and check that the claim binds (kubectl describe pvc)")
PENDING_CLAIM_ADVICE = ("the pod's volume claim is not bound yet: check that its storage class provisions it "
                        "(kubectl describe pvc)")
TOLERATE = ("add a matching toleration to the platform block's tolerations, e.g. key sku, value gpu, effect "
            "NoSchedule for an AKS GPU pool, and key kubernetes.azure.com/scalesetpriority, value spot for a spot pool "
            "(kubectl describe node shows a node's taints)")
SELECTOR_ADVICE = ("no node has the labels the platform block's node_selector and affinity require: compare them "
                   "with kubectl get nodes --show-labels")
#: Waiting reasons that are part of a normal start.
STARTING = {"ContainerCreating", "PodInitializing"}


@dataclass(frozen=True)
class PodProblem:
    """One pod that cannot run, and why."""

    pod: str
    reason: str
    message: str
    #: The cluster autoscaler is adding a node for it.
    scaling_up: bool = False
    kind: str = "pod"
    #: Stopped by a signal or a node going away rather than by its own failure: a retry can resume.
    resumable: bool = False
    #: An elastic job's worker beyond what it needs, waiting for room: said once, never fails the stage (the job
    #: trains on the workers it has and takes this one when it is scheduled).
    optional: bool = False

    @property
    def patient(self) -> bool:
        """Waiting for room (busy GPUs, a node being added, a claim still being provisioned) resolves by
        itself on a shared cluster, so it gets the longer grace period; a bad image or config never does."""
        return self.reason == "Unschedulable"

    @property
    def family(self) -> str:
        """The kubelet alternates ErrImagePull and ImagePullBackOff for one failing pull: one problem. A worker on
        a silent node that the pod GC then replaces is one loss too: its grace runs on."""
        if self.reason in ("ErrImagePull", "ImagePullBackOff"):
            return "ImagePull"
        return "WorkerLost" if self.reason in ("NodeNotReady", "WorkerReplaced") else self.reason

    @property
    def advice(self) -> str:
        if self.reason == "Unschedulable" and "unbound immediate persistentvolumeclaims" in self.message.lower():
            return PENDING_CLAIM_ADVICE
        if self.reason == "Unschedulable" and "persistentvolumeclaim" in self.message.lower():
            return CLAIM_ADVICE
        if self.reason == "Unschedulable":
            return scheduling_advice(self.message)
        if self.reason == "FailedMount":
            missing = re.search(r'(secret|configmap) "[^"]*" not found', self.message, re.IGNORECASE)
            return MOUNT_OBJECT_ADVICE if missing else MOUNT_VOLUME_ADVICE
        return ADVICE.get(self.reason, "see kubectl describe pod for the events")

    def describe(self) -> str:
        message = f": {self.message}" if self.message else ""
        state = "is not bound" if self.kind == "persistentvolumeclaim" else "is not running"
        return f"{self.kind} {self.pod} {state} ({self.reason}{message}); {self.advice}"


#: kube-scheduler's ``FitError``: "0/N nodes are available: <count> <reason>, ... . preemption: ...".
_FIT_REASONS = re.compile(r"nodes are available: (?P<reasons>.*?)\. preemption:")
_TAINT = re.compile(r"untolerated taint \{(?P<key>[^:}]+):")


def scheduling_advice(message: str) -> str:
    """What to change for a pod no node takes, from the reasons the scheduler gave per node: a node that lacks
    what the pod asks for comes first (tolerating a taint would not give it room); then a taint the block can
    tolerate (not the node lifecycle's own ``node.kubernetes.io/*`` taints, which come and go); then the
    block's node selector or affinity."""
    found = _FIT_REASONS.search(message)
    reasons = found["reasons"].split(", ") if found else []
    short = any("Insufficient" in reason for reason in reasons)
    tainted = any((taint := _TAINT.search(reason)) and not taint["key"].strip().startswith("node.kubernetes.io/")
                  for reason in reasons)
    if short and tainted:  # which nodes lack room and which are tainted, the message does not say
        return f"{ADVICE['Unschedulable']}; or, if the nodes that have it are tainted, {TOLERATE}"
    if tainted:
        return f"the nodes that could take the pod are tainted: {TOLERATE}"
    if not short and any("didn't match Pod's node affinity/selector" in reason for reason in reasons):
        return SELECTOR_ADVICE
    return ADVICE["Unschedulable"]


def pod_problems(pods: list[dict[str, Any]], events: list[dict[str, Any]],
                 exited_workers: bool = False, replaced: frozenset[str] = frozenset(),
                 training_alive: bool = False, elastic: bool = False,
                 elastic_min_pods: int | None = None) -> list[PodProblem]:
    """The problems of ``pods`` (API dicts, camelCase), given the namespace's recent ``events``.

    ``exited_workers``: an MPIJob's worker that stopped (not evicted) is a problem too. The MPI operator
    marks the job failed only for evicted workers (``updateMPIJobStatus``); with another worker gone, a job
    waiting for its workers never starts its launcher, and a running one hangs on it. So is an MPIJob's pod
    whose node stopped reporting (``node_silent``): nothing fails the job then, and mpirun notices the lost
    daemon only when its keepalive gives up (OpenMPI 4.1: 300 s idle, then 9 probes 20 s apart) — unless
    ``training_alive`` (the launcher's log still advances: a node cut off from the control plane only, its
    ranks still talking to their peers). ``replaced``: the workers whose pod was replaced while the launcher
    ran (``ProblemClock.replacements``). ``elastic``: an elastic job goes on without a worker that was stopped
    from outside or whose node went silent, and takes its replacement back: only a worker's own failure (out of
    memory, an error exit, which would meet every worker) is its problem. ``elastic_min_pods``: the worker pods
    an elastic job trains on at least; while that many are scheduled, a worker no node has room for is
    ``optional`` (the job grows when room appears, which is what elastic training is for)."""
    pod_events = [e for e in events if (e.get("involvedObject") or {}).get("kind") == "Pod"]
    scaling = {e["involvedObject"]["name"] for e in pod_events if e.get("reason") == "TriggeredScaleUp"}
    mount_failures = failing_mounts(pod_events)
    scheduled_workers = sum(1 for pod in pods if job_role(pod) == "worker" and (pod.get("spec") or {}).get("nodeName")
                            and not pod["metadata"].get("deletionTimestamp")
                            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
    room_to_wait = elastic and elastic_min_pods is not None and scheduled_workers >= elastic_min_pods
    found = []
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue  # going away (a finished job's clean-up): not a problem of the stage
        role = job_role(pod)
        if name in replaced:
            found.append(PodProblem(name, "WorkerReplaced", "the pod its ranks ran in is gone (deleted, or removed "
                                    "with its node) and mpirun cannot use the one the operator made in its place",
                                    resumable=True))
            continue
        if exited_workers and role == "worker" and status.get("phase") in ("Succeeded", "Failed") and \
                status.get("reason") != "Evicted":
            terminated = next(((c.get("state") or {}).get("terminated") for c in status.get("containerStatuses") or []
                               if (c.get("state") or {}).get("terminated")), None) or {}
            code = terminated.get("exitCode")
            why = terminated.get("reason", status.get("phase"))
            described = f"exit code {code if code is not None else '?'} ({why})"
            if terminated.get("reason") == "OOMKilled":  # SIGKILL, but by its own memory use: a retry meets it again
                container = next((c.get("name") for c in status.get("containerStatuses") or []
                                  if ((c.get("state") or {}).get("terminated") or {}).get("reason") == "OOMKilled"),
                                 None)
                found.append(PodProblem(name, "OOMKilled", oom_message(pod, container, code)))
                continue
            # A signal (128 + n) or a node that shut down: not the worker's own failure, a retry resumes.
            resumable = (isinstance(code, int) and 128 < code <= 128 + 64) or \
                status.get("reason") in ("Shutdown", "NodeShutdown", "Terminated", "NodeLost")
            if not (elastic and resumable):
                found.append(PodProblem(name, "WorkerExited", described, resumable=resumable))
            continue
        if status.get("phase") in ("Succeeded", "Failed"):
            continue  # finished: the Job or MPIJob reports it
        if exited_workers and role and not training_alive and not (elastic and role == "worker") and \
                (silent := node_silent(pod)):
            found.append(PodProblem(name, "NodeNotReady", silent, resumable=True))
            continue
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False" and \
                    condition.get("reason") == "Unschedulable":
                found.append(PodProblem(name, "Unschedulable", condition.get("message", ""), name in scaling,
                                        optional=bool(room_to_wait and role == "worker")))
        waiting_reasons = set()
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason"):
                waiting_reasons.add(waiting["reason"])
                if waiting["reason"] not in STARTING:
                    found.append(PodProblem(name, waiting["reason"], waiting.get("message", "")))
        uid = pod["metadata"].get("uid")
        if uid in mount_failures and (not waiting_reasons or waiting_reasons <= STARTING):
            found.append(PodProblem(name, "FailedMount", mount_failures[uid].get("message", "")))
    return found


def job_role(pod: dict[str, Any]) -> str | None:
    """An MPIJob pod's role (``launcher``, ``worker``: the operator's ``training.kubeflow.org/job-role``)."""
    return (pod["metadata"].get("labels") or {}).get("training.kubeflow.org/job-role")


def node_silent(pod: dict[str, Any]) -> str | None:
    """How a running pod's node went silent, or None. The node lifecycle controller marks every pod of a node
    that stopped posting its status not Ready (``MarkPodsNotReady``: the Ready condition's status False, its
    reason left as it was, nothing else), while the pod's containers still read running and ready: the kubelet
    that would report their end is gone. The kubelet itself turns Ready False only with a reason
    (``ContainersNotReady``, ``ReadinessGatesNotReady``: pkg/kubelet/status ``GeneratePodReadyCondition``) and
    a container it reports not ready (a sidecar's failing probe, a container that stopped)."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    containers = status.get("containerStatuses") or []
    if ready.get("status") != "False" or ready.get("reason") or not containers or \
            not all((c.get("state") or {}).get("running") is not None and c.get("ready") for c in containers):
        return None
    since = f" since {ready['lastTransitionTime']}" if ready.get("lastTransitionTime") else ""
    return f"node {(pod.get('spec') or {}).get('nodeName', '?')} stopped reporting{since}"


#: The kubelet's events that follow a successful mount (volumes first, then the image, then the container).
AFTER_MOUNT = {"Pulling", "Pulled", "Created", "Started"}


def failing_mounts(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest FailedMount Warning of each pod (by uid: a pod of the same name from an earlier attempt
    is another pod) whose mounts have not succeeded since: a later Pulling/Pulled/Created/Started event
    of the same pod means the kubelet got past its volumes (a transient failure that cleared)."""
    newest: dict[str, dict[str, Any]] = {}
    progressed: dict[str, str] = {}
    for event in events:
        uid = (event.get("involvedObject") or {}).get("uid")
        if not uid:
            continue
        if event.get("reason") == "FailedMount" and event.get("type") == "Warning":
            if uid not in newest or _event_time(event) >= _event_time(newest[uid]):
                newest[uid] = event
        elif event.get("reason") in AFTER_MOUNT:
            progressed[uid] = max(progressed.get(uid, ""), _event_time(event))
    return {uid: event for uid, event in newest.items() if progressed.get(uid, "") < _event_time(event)}


def creating(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods bound to a node but not started yet: mounting their volumes or pulling their image."""
    return [pod for pod in pods if (pod.get("status") or {}).get("phase") == "Pending"
            and (pod.get("spec") or {}).get("nodeName") and not pod["metadata"].get("deletionTimestamp")]


def _event_time(event: dict[str, Any]) -> str:
    return event.get("lastTimestamp") or event.get("eventTime") or ""


def terminated_problems(pods: list[dict[str, Any]]) -> list[PodProblem]:
    """Containers of finished pods that the kernel killed for memory (``OOMKilled``): the one reason a failed
    Job's log cannot give, as the process died without a word."""
    found = []
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            for state in (container.get("state"), container.get("lastState")):
                terminated = (state or {}).get("terminated") or {}
                if terminated.get("reason") == "OOMKilled":
                    found.append(PodProblem(pod["metadata"]["name"], "OOMKilled", oom_message(
                        pod, container.get("name"), terminated.get("exitCode"))))
                    break
    return found


def oom_message(pod: dict[str, Any], container: str | None, code: Any) -> str:
    """Which memory ran out: the container's limit, or (without one) the node's — the kernel's global OOM
    killer reports OOMKilled too."""
    spec = next((c for c in (pod.get("spec") or {}).get("containers") or [] if c.get("name") == container), {})
    limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
    which = f"limits.memory {limit}" if limit else "no memory limit: the node ran out of memory"
    return f"exit code {code if code is not None else '?'} (OOMKilled; {which})"


def claim_problems(claim: str, events: list[dict[str, Any]]) -> list[PodProblem]:
    """The newest ``ProvisioningFailed`` Warning of a Pending claim (the PV controller's or the CSI
    provisioner's, e.g. ``storageclass.storage.k8s.io "x" not found``), from the namespace's events."""
    failed = [e for e in events if e.get("reason") == "ProvisioningFailed" and e.get("type") == "Warning"
              and (e.get("involvedObject") or {}).get("name") == claim]
    if not failed:
        return []
    newest = max(failed, key=_event_time)
    return [PodProblem(claim, "ProvisioningFailed", newest.get("message", ""), kind="persistentvolumeclaim")]


@dataclass
class ProblemClock:
    """When each problem was first seen, so one that lasts past a grace period fails the stage and one that
    clears (an image pull that succeeds on retry, a node the autoscaler added) does not."""

    grace_s: float
    scheduling_grace_s: float
    first_seen: dict[tuple[str, str], float]
    #: Each MPI worker as last seen: its pod's uid, and whether that pod was being stopped gracefully by a node
    #: that still reports (its ranks told to checkpoint); and the workers replaced since (``replacements``).
    workers_seen: dict[str, tuple[str, bool]] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)

    def replacements(self, pods: list[dict[str, Any]]) -> frozenset[str]:
        """The MPI workers whose pod went without its ranks being told and was replaced by another of the same
        name once the launcher had started: the MPI operator creates a deleted worker again (the pod GC removed
        it with its lost node, say), but mpirun only knows the daemons it started, so the job cannot go on — and
        may wait minutes for OpenMPI to give the old one up. A worker stopped gracefully (an eviction, a drain)
        is not one: its ranks checkpoint and the launcher ends by itself. Before the launcher's container
        starts a new worker is just part of the start."""
        launcher_started = any(job_role(pod) == "launcher" and any(
            (c.get("state") or {}).get(state) is not None for c in (pod.get("status") or {}).get("containerStatuses")
            or [] for state in ("running", "terminated")) for pod in pods)
        for pod in pods:
            if job_role(pod) != "worker":
                continue
            name, uid = pod["metadata"]["name"], pod["metadata"].get("uid", "")
            previous = self.workers_seen.get(name)
            if launcher_started and previous is not None and previous[0] != uid and not previous[1]:
                self.replaced.add(name)
            told = bool(pod["metadata"].get("deletionTimestamp")) and node_silent(pod) is None
            self.workers_seen[name] = (uid, told)
        return frozenset(self.replaced)

    def grace_for(self, problem: PodProblem) -> float:
        return self.scheduling_grace_s if problem.patient else self.grace_s

    def overdue(self, problems: list[PodProblem], now: float) -> tuple[list[PodProblem], list[PodProblem]]:
        """(new problems to report, problems past their grace period)."""
        current = {(p.pod, p.family) for p in problems}
        for key in list(self.first_seen):
            if key not in current:
                del self.first_seen[key]
        new = [p for p in problems if (p.pod, p.family) not in self.first_seen]
        for problem in new:
            self.first_seen[(problem.pod, problem.family)] = now
        late = [p for p in problems if now - self.first_seen[(p.pod, p.family)] >= self.grace_for(p)]
        return new, late


#: A ``DisruptionTarget`` condition (status True) says the pod is being stopped from outside, whatever its reason:
#: the scheduler preempting it (``PreemptionByScheduler``; ``PreemptionByKubeScheduler`` in 1.26), the eviction
#: API (a drain, an autoscaler scaling down), the taint manager (its node unreachable), the pod GC, or the
#: kubelet (``TerminationByKubelet``: node-pressure eviction, graceful node shutdown) — kubernetes.io/docs/
#: concepts/workloads/pods/disruptions, "Pod disruption conditions"; other schedulers may add their own.
DISRUPTION_TARGET = "DisruptionTarget"
#: ``status.reason`` of a pod the kubelet stopped itself on a node going away: graceful node shutdown
#: (``Terminated``, pkg/kubelet/nodeshutdown; ``Shutdown`` and ``NodeShutdown`` before Kubernetes 1.23).
STOPPED_BY_NODE = {"Terminated", "Shutdown", "NodeShutdown"}
#: An ``Evicted`` pod the node ran short for (pkg/kubelet/eviction ``nodeLowMessageFmt``); one evicted for going
#: over its own limits (an emptyDir's ``sizeLimit``, ephemeral storage) would meet them again.
NODE_PRESSURE = "The node was low on resource"
#: The container a job's pod runs its work in (``tasks.k8s.manifests``): preferred over sidecars.
MAIN_CONTAINERS = ("worker", "launcher")


@dataclass(frozen=True)
class PodEnd:
    """How one of a job's pods ended, or is ending, as its status says (pure; ``pod_ends``)."""

    name: str
    role: str | None
    #: The exit code and reason of its container that ended (OOMKilled, Error, Completed), if one did.
    exit_code: int | None
    container_reason: str | None
    #: Why it was stopped from outside (a DisruptionTarget reason or the kubelet's pod reason), if it was.
    disruption: str | None
    oom: str | None = None

    @property
    def out_of_memory(self) -> bool:
        return self.container_reason == "OOMKilled"

    def describe(self) -> str:
        """For an OOM: which pod and container ran out of which memory, and what to change."""
        advice = ADVICE["OOMKilledWorker" if self.role == "worker" else "OOMKilled"]
        return f"pod {self.name} ran out of memory: {self.oom}; {advice}"


def pod_ends(pods: list[dict[str, Any]]) -> list[PodEnd]:
    """The ends of ``pods`` (API dicts, camelCase) that say why a job failed: a container that terminated (now or
    before a restart) or a pod stopped from outside. The job's pods that still run quietly are left out."""
    found = []
    for pod in pods:
        status, name = pod.get("status") or {}, pod["metadata"]["name"]
        disrupted = next((c.get("reason") or DISRUPTION_TARGET for c in status.get("conditions") or []
                          if c.get("type") == DISRUPTION_TARGET and c.get("status") == "True"), None)
        if disrupted is None and (status.get("reason") in STOPPED_BY_NODE or (
                status.get("reason") == "Evicted" and NODE_PRESSURE in (status.get("message") or ""))):
            disrupted = status["reason"]
        # OOMKilled first, wherever it is; then the main container's end before a sidecar's (the kubelet lists
        # container statuses by name).
        endings = sorted(((container.get("name"), terminated) for container in status.get("containerStatuses") or []
                          for state in (container.get("state"), container.get("lastState"))
                          if (terminated := (state or {}).get("terminated"))),
                         key=lambda ending: (ending[1].get("reason") != "OOMKilled", ending[0] not in MAIN_CONTAINERS))
        ended = endings[0] if endings else None
        if ended is None and disrupted is None:
            continue
        container, terminated = ended or (None, {})
        reason = terminated.get("reason")
        oom = oom_message(pod, container, terminated.get("exitCode")) if reason == "OOMKilled" else None
        role = job_role(pod)
        found.append(PodEnd(name, role, terminated.get("exitCode"), reason, disrupted,
                            f"container {container}, {oom}" if oom else None))
    return found
