"""Training as an MPIJob (scheduled by Run:ai when the block names a project): submit, wait, cancel.

Separate because the MPIJob has a life of its own: named after the flow run, so a retry adopts it (or
replaces it when an earlier attempt failed); its launcher's log carries the run's events; the operator
refuses an invalid job only with a Warning event; its failure is read as resumable (preempted, a worker
lost: the task's retry resumes from the newest checkpoint) or not; and anything that interrupts the wait
deletes it, so nothing keeps running.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tasks.k8s.logs import LogCursor
from tasks.k8s.manifests import render_mpijob
from tasks.launch import JobOutput, read_mpijob_failure
from tasks.platforms.base import (
    EventSink,
    LogSink,
    StageBlocked,
    TrainingFailed,
    TrainingHandle,
    TrainingInterrupted,
    TrainingOutcome,
    TrainingSpec,
    TransientPlatformError,
    VolumeRef,
    last_attempt,
    outcome_from_events,
)
from tasks.platforms.cluster.api import STRICT, apis, call, create_or_adopt, wait_deleted
from tasks.platforms.cluster.pod_logs import follow_log
from tasks.platforms.cluster.problems import check_pods, problem_clock

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

MPI = ("kubeflow.org", "v2beta1", "mpijobs")
#: The MPI operator refuses an invalid job with a Warning event of this reason and sets no condition
#: (kubeflow/mpi-operator pkg/controller/mpi_job_controller.go, syncHandler): it never starts.
REFUSED_REASON = "ValidationError"


def mpijob_body(platform: ClusterPlatform, spec: TrainingSpec) -> dict:
    """The MPIJob laneflow sends for ``spec``, labelled with the run's lineage."""
    labels = platform.job_labels(spec.job_name, spec.labels)
    return render_mpijob(spec.job_name, platform.layout(), spec.volume.name, spec.preset, spec.workers,
                         spec.data_dir, spec.run_dir, spec.settings, labels)


def submit(platform: ClusterPlatform, spec: TrainingSpec) -> TrainingHandle:
    _, _, custom = apis(platform)
    namespace = platform.effective_namespace()
    body = mpijob_body(platform, spec)
    group, version, plural = MPI

    def ours(job: dict) -> bool:
        labels = job["metadata"].get("labels", {})
        return labels.get("app.kubernetes.io/managed-by") == "laneflow" and \
            labels.get("laneflow.io/run") == spec.job_name

    job, created = create_or_adopt(
        platform, "mpijobs",
        lambda: custom.create_namespaced_custom_object(group, version, namespace, plural, body,
                                                       field_validation=STRICT),
        lambda: custom.get_namespaced_custom_object(group, version, namespace, plural, spec.job_name),
        ours, spec.job_name)
    state = _mpijob_state(job)
    if not created and state == "failed":
        # An earlier attempt stopped (preempted, a worker lost): replace it; the trainer resumes.
        platform.cancel_training(spec.job_name, spec.volume)
        wait_deleted(platform, "mpijobs",
                     lambda: custom.get_namespaced_custom_object(group, version, namespace, plural, spec.job_name),
                     f"MPIJob {spec.job_name}")
        job = call(platform, "create", "mpijobs", custom.create_namespaced_custom_object, group, version,
                   namespace, plural, body, field_validation=STRICT)
        created, state = True, _mpijob_state(job)
    return TrainingHandle(job_name=spec.job_name, spec=spec, state=state, adopted=not created,
                          details={"namespace": namespace, "uid": job["metadata"].get("uid")})


def wait(platform: ClusterPlatform, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
         timeout_s: float) -> TrainingOutcome:
    core, _, custom = apis(platform)
    group, version, plural = MPI
    name = handle.job_name
    selector = f"training.kubeflow.org/job-name={name},training.kubeflow.org/job-role=launcher"
    started = time.monotonic()
    deadline = started + timeout_s
    output = JobOutput(on_event, on_log)
    warnings_seen: set[str] = set()
    cursor = LogCursor()
    clock = problem_clock(platform)

    try:
        while True:
            job = call(platform, "get", "mpijobs", custom.get_namespaced_custom_object, group, version,
                       platform.effective_namespace(), plural, name)
            state = _mpijob_state(job)
            if state == "pending":  # not running yet: refused? waiting on something? (Warning events say)
                _check_warnings(platform, core, job, warnings_seen, on_log)
            if state in ("pending", "running"):  # a pod that cannot run (a worker can fail alone)
                try:
                    check_pods(platform, core, f"training.kubeflow.org/job-name={name}", clock, output.feed,
                               "the MPIJob was deleted", exited_workers=True)
                except (StageBlocked, TrainingInterrupted):
                    platform.cancel_training(name, handle.spec.volume)  # a retry submits a fresh one
                    raise
            streamed = follow_log(platform, core, selector, cursor, output.feed, deadline)
            if state == "succeeded":
                break
            if state == "failed":
                break
            if time.monotonic() > deadline:
                platform.cancel_training(name, handle.spec.volume)
                raise TrainingFailed(f"MPIJob {name} did not finish within {timeout_s:.0f} s; it was deleted",
                                     list(output.tail))
            if not streamed:
                time.sleep(platform.poll_interval_s)
    except (TrainingFailed, TransientPlatformError, PermissionError, StageBlocked):
        raise
    except BaseException:  # task cancelled, flow run terminated: leave nothing running
        platform.cancel_training(name, handle.spec.volume)
        raise
    if state == "succeeded":
        return outcome_from_events(name, _all_events(platform, handle, output, cursor, on_log),
                                   time.monotonic() - started, list(output.tail))
    condition = _failed_condition(job)
    reason = condition.get("reason", "")
    detail = f"{reason}: {condition.get('message', '')}; pods: {_pod_reasons(platform, core, name) or 'none found'}"
    reading = read_mpijob_failure(reason, output.exit_lines, output.events)
    if reading.resumable:
        raise TrainingInterrupted(f"MPIJob {name} stopped ({reading.reason}); {detail}")
    raise TrainingFailed(f"MPIJob {name} failed ({reading.reason}); {detail}", list(output.tail))


def cancel(platform: ClusterPlatform, job_name: str, volume: VolumeRef) -> bool:
    _, _, custom = apis(platform)
    group, version, plural = MPI
    try:
        call(platform, "delete", "mpijobs", custom.delete_namespaced_custom_object, group, version,
             platform.effective_namespace(), plural, job_name, propagation_policy="Foreground")
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _all_events(platform: ClusterPlatform, handle: TrainingHandle, output: JobOutput, cursor: LogCursor,
                on_log: LogSink) -> list[dict[str, Any]]:
    """The finished run's events: as streamed, or, when lines were rotated away unread, from the run's
    own record (falling back to what was streamed if that cannot be read)."""
    if not cursor.gaps:
        return output.events
    try:
        return last_attempt(platform.read_file(handle.spec.volume, f"{handle.spec.run_dir}/metrics.jsonl").decode())
    except Exception as exc:  # the training succeeded: do not fail it over its summary
        on_log(f"laneflow: could not read {handle.spec.run_dir}/metrics.jsonl after the log gap ({exc}); the "
               "outcome is from the events streamed")
        return output.events


def _check_warnings(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, job: dict, seen: set[str],
                    on_log: LogSink) -> None:
    """Fail fast when the operator refused the job: it then only records a Warning event, no condition.

    Other Warning events of a job that is not running yet (a pod it cannot create, a template
    setting it overrides) go to the log once each.
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
            seen.add(key)
            on_log(f"warning from the MPI operator: {key}")


def _pod_reasons(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, name: str) -> str:
    """The job's containers that exited non-zero, with their reason and exit code."""
    pods = call(platform, "list", "pods", core.list_namespaced_pod, platform.effective_namespace(),
                label_selector=f"training.kubeflow.org/job-name={name}").items
    reasons = []
    for pod in pods:
        for status in (pod.status.container_statuses or []) if pod.status else []:
            terminated = status.state.terminated if status.state else None
            if terminated and terminated.exit_code:
                reasons.append(f"{pod.metadata.name} {terminated.reason} (exit {terminated.exit_code})")
    return ", ".join(reasons)


def _mpijob_state(job: dict) -> str:
    """succeeded, failed, running, or pending (refused, waiting for its workers, or not seen by the operator)."""
    types = {c["type"] for c in (job.get("status") or {}).get("conditions", []) if c.get("status") == "True"}
    if "Succeeded" in types:
        return "succeeded"
    if "Failed" in types:
        return "failed"
    return "running" if "Running" in types else "pending"


def _failed_condition(job: dict) -> dict:
    """The job's ``Failed`` condition that holds (the operator flips earlier ones to False)."""
    conditions = (job.get("status") or {}).get("conditions", [])
    return next((c for c in reversed(conditions) if c.get("type") == "Failed" and c.get("status") == "True"), {})
