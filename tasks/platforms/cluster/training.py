"""Training as an MPIJob (scheduled by Run:ai when the block names a project): submit, wait, cancel.

Separate because the MPIJob has a life of its own: named after the flow run, so a retry adopts it (or
replaces it when an earlier attempt failed); its launcher's log carries the run's events; the operator
refuses an invalid job only with a Warning event; its failure is read as resumable (preempted, a worker
lost: the task's retry resumes from the newest checkpoint) or not (tasks/platforms/cluster/mpijob_ends.py);
a launcher removed from outside (a drain of its node) is replaced in the same MPIJob by its launcher Job and
the wait follows the replacement; and anything that interrupts the wait deletes it, so nothing keeps running.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from tasks.handover import handed_over
from tasks.k8s.diagnose import node_silent
from tasks.k8s.kueue import ELASTIC_REFUSED, is_suspended, queued
from tasks.k8s.logs import LogCursor
from tasks.k8s.manifests import another_owner, render_mpijob
from tasks.launch import (
    START_FAILED,
    JobOutput,
)
from tasks.platforms.base import (
    EventSink,
    LogSink,
    NotOurJob,
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
from tasks.platforms.cluster.isolation import isolate
from tasks.platforms.cluster.kueue import AdmissionWatch
from tasks.platforms.cluster.mpijob_ends import (
    SeenPods,
    launcher_failed_on_its_own,
    mpijob_state,
    read_failure,
    say_launcher_replacements,
)
from tasks.platforms.cluster.operator_answers import check_operator_answers, check_warnings
from tasks.platforms.cluster.pod_logs import follow_log
from tasks.platforms.cluster.problems import check_pods, list_pods, problem_clock

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

MPI = ("kubeflow.org", "v2beta1", "mpijobs")


def mpijob_body(platform: ClusterPlatform, spec: TrainingSpec) -> dict:
    """The MPIJob laneflow sends for ``spec``, labelled with the run's lineage."""
    labels = platform.job_labels(spec.job_name, spec.labels)
    elastic = (spec.elastic.min_workers, spec.elastic.max_workers) if spec.elastic else None
    body = render_mpijob(spec.job_name, platform.layout(), spec.volume.name, spec.preset, spec.workers,
                         spec.data_dir, spec.run_dir, spec.settings, labels, elastic)
    return queued(body, platform.kueue_queue, platform.kueue_priority_class)


def submit(platform: ClusterPlatform, spec: TrainingSpec) -> TrainingHandle:
    if spec.elastic is not None and platform.kueue_queue:
        raise StageBlocked(f"MPIJob {spec.job_name}: {ELASTIC_REFUSED}")
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
    state = mpijob_state(job)
    other = None if created else another_owner(job, spec.labels.get("flow-run"))
    if other is not None and state not in ("succeeded", "failed") and not job["metadata"].get("deletionTimestamp"):
        raise NotOurJob(f"MPIJob {spec.job_name} is still training for flow run {other}, another run of the same "
                        "run key: this run neither adopts nor stops it. Wait for that run to end or cancel it, or "
                        "give this run another run_key")
    if other is not None:  # an earlier run of the same key left it finished: not this run's result to report
        job = _replace(platform, spec, body)
        created, state = True, mpijob_state(job)
    elif not created and (state == "failed" or job["metadata"].get("deletionTimestamp")):
        # An earlier attempt stopped (preempted, a worker lost), or its job is being deleted (a cancel, a
        # replacement that did not finish): wait it out and create it afresh; the trainer resumes.
        job = _replace(platform, spec, body)
        created, state = True, mpijob_state(job)
    isolate(platform, job)
    return TrainingHandle(job_name=spec.job_name, spec=spec, state=state, adopted=not created,
                          details={"namespace": namespace, "uid": job["metadata"].get("uid")})


def _replace(platform: ClusterPlatform, spec: TrainingSpec, body: dict) -> dict:
    """Delete the run's MPIJob, wait until it is gone, and create ``body`` in its place."""
    _, _, custom = apis(platform)
    namespace, (group, version, plural) = platform.effective_namespace(), MPI
    platform.cancel_training(spec.job_name, spec.volume)
    waiting_since = time.monotonic()
    wait_deleted(platform, "mpijobs",
                 lambda: custom.get_namespaced_custom_object(group, version, namespace, plural, spec.job_name),
                 f"MPIJob {spec.job_name}", timeout_s=300 + platform.termination_grace_s,  # its pods' grace
                 check=lambda: _check_stuck_pods(platform, spec.job_name, waiting_since))
    return call(platform, "create", "mpijobs", custom.create_namespaced_custom_object, group, version,
                namespace, plural, body, field_validation=STRICT)


def _check_stuck_pods(platform: ClusterPlatform, name: str, waiting_since: float) -> None:
    """A job's pod on a node that stopped reporting never finishes terminating: no kubelet confirms it stopped,
    so the job's Foreground deletion waits for ever — unless the Node is deleted (a cloud controller does so
    when its VM is gone; the pod GC then removes the pod) or marked out of service. The block's
    ``pod_problem_grace_s`` past the pod's grace period that is for an administrator to decide: the stage fails
    saying how.
    This wait itself gets ``pod_problem_grace_s`` too: a retry right after the node was marked out of service
    leaves the pod GC its pass (every 20 s)."""
    if time.monotonic() - waiting_since <= platform.pod_problem_grace_s:
        return
    core, _, _ = apis(platform)
    pods = list_pods(platform, core, f"training.kubeflow.org/job-name={name}")
    now = datetime.now(UTC)
    for pod in pods:
        metadata = pod["metadata"]
        if not metadata.get("deletionTimestamp") or not (silent := node_silent(pod)):
            continue
        # A graceful deletion's deletionTimestamp is when its grace period ends (apiserver rest.BeforeDelete).
        ended = datetime.fromisoformat(str(metadata["deletionTimestamp"]).replace("Z", "+00:00"))
        past = (now - ended).total_seconds()
        if past <= platform.pod_problem_grace_s:
            continue
        node = pod["spec"].get("nodeName", "?")
        raise StageBlocked(
            f"MPIJob {name} cannot be replaced: its pod {metadata['name']} is still terminating {past:.0f} s after "
            f"its grace period ended, on a node that is gone ({silent}): no kubelet will confirm it stopped, so "
            f"Kubernetes removes it only "
            f"once node {node} is deleted (a cloud controller does so when its VM no longer exists) or marked out "
            f"of service. Once you know the node is off: kubectl taint nodes {node} "
            f"node.kubernetes.io/out-of-service=nodeshutdown:NoExecute (or kubectl delete node {node}); then "
            f"retry the flow run: it resumes from its last checkpoint")


def wait(platform: ClusterPlatform, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
         timeout_s: float) -> TrainingOutcome:
    """Follow the MPIJob to its end and read how it ended. One that never reached every worker (a start-up
    race: a worker's name not in DNS yet, its sshd not listening yet) is submitted once more, right here;
    twice is a clear error."""
    started = time.monotonic()
    deadline = started + timeout_s
    resubmitted = False
    while True:
        output, cursor = JobOutput(on_event, on_log, events_from_any_rank=handle.spec.elastic is not None), LogCursor()
        seen = SeenPods()
        job = _follow(platform, handle, output, cursor, deadline, timeout_s, seen)
        output.finish()
        if not resubmitted:
            remove_expired(platform, on_log)  # once a run ends: earlier runs' finished MPIJobs past their TTL
        if mpijob_state(job) == "succeeded":
            return outcome_from_events(handle.job_name, _all_events(platform, handle, output, cursor, on_log),
                                       time.monotonic() - started, list(output.tail))
        reading, detail = read_failure(platform, handle.job_name, job, output, seen)
        if reading.kind != START_FAILED or resubmitted:
            break
        on_log(f"laneflow: MPIJob {handle.job_name} {reading.reason}; submitting it once more")
        _replace(platform, handle.spec, mpijob_body(platform, handle.spec))
        resubmitted = True
    name = handle.job_name
    if reading.kind == START_FAILED:
        raise TrainingFailed(f"MPIJob {name} {reading.reason}, and again when submitted once more; {detail}. "
                             f"{START_ADVICE}", list(output.tail))
    if reading.resumable:
        raise TrainingInterrupted(f"MPIJob {name} stopped ({reading.reason}); {detail}")
    raise TrainingFailed(f"MPIJob {name} failed ({reading.reason}); {detail}", list(output.tail))


#: What to check when the launcher cannot reach its workers twice in a row.
START_ADVICE = ("The launcher reaches each worker over ssh by its name in the MPIJob's headless Service, starts "
                "OpenMPI's orted there, and horovodrun's services then talk over ports of their own: check that the "
                "workers run and keep sshd listening (kubectl logs <job>-worker-0), that the image has the "
                "operator's ssh settings and orted on its PATH (docs/getting-started/cluster.md, 'What the training "
                "image must contain'), "
                "and that no NetworkPolicy blocks traffic between the job's pods")


def _follow(platform: ClusterPlatform, handle: TrainingHandle, output: JobOutput, cursor: LogCursor,
            deadline: float, timeout_s: float, seen: SeenPods) -> dict:
    """Stream the launcher's log into ``output`` until the MPIJob succeeds or fails; return it then. A pod that
    cannot run past its grace, the deadline, or anything that interrupts the wait deletes the job. ``seen``
    takes what each listing of the job's pods shows that its end may not (mpijob_ends.SeenPods)."""
    core, _, custom = apis(platform)
    group, version, plural = MPI
    name, owner = handle.job_name, handle.spec.labels.get("flow-run")
    selector = f"training.kubeflow.org/job-name={name},training.kubeflow.org/job-role=launcher"
    warnings_seen: dict[str, tuple[float, int]] = {}
    clock = problem_clock(platform)
    followed_since = time.monotonic()
    last_line_at = float("-inf")  # when the launcher's log last advanced
    launchers_seen: dict[str, bool] = {}  # launcher pod -> whether its removal was said
    replacements_stopped = False
    # Under Kueue the job waits, suspended, until Kueue admits it (and again after a preemption): not stuck.
    admission = AdmissionWatch(platform, f"MPIJob {name}", output.on_event, output.on_log) \
        if platform.kueue_queue else None

    def feed(text: str) -> None:
        nonlocal last_line_at
        last_line_at = time.monotonic()
        output.feed(text)

    try:
        while True:
            job = call(platform, "get", "mpijobs", custom.get_namespaced_custom_object, group, version,
                       platform.effective_namespace(), plural, name)
            state = mpijob_state(job)
            if admission is not None and state in ("pending", "running") and \
                    (is_suspended(job) or admission.waiting):
                try:
                    if admission.observe(job["metadata"]["uid"]).waits:
                        if time.monotonic() > deadline:
                            raise TrainingFailed(f"MPIJob {name} was not admitted by Kueue within {timeout_s:.0f} s "
                                                 f"({admission.said}); it was deleted", list(output.tail))
                        time.sleep(platform.poll_interval_s)
                        continue
                except (StageBlocked, TrainingFailed):
                    platform.cancel_training(name, handle.spec.volume, owner)
                    raise
            if state == "pending":  # not running yet: refused? waiting on something? (Warning events say)
                try:
                    check_warnings(platform, core, job, warnings_seen, output.on_log)
                    check_operator_answers(platform, job, time.monotonic() - followed_since, bool(warnings_seen))
                except StageBlocked:
                    platform.cancel_training(name, handle.spec.volume, owner)
                    raise
            if state in ("pending", "running"):  # a pod that cannot run (a worker can fail alone)
                try:
                    pods = check_pods(platform, core, f"training.kubeflow.org/job-name={name}", clock, output.feed,
                                      "the MPIJob was deleted", exited_workers=True,
                                      training_alive=time.monotonic() - last_line_at < platform.pod_problem_grace_s,
                                      elastic=handle.spec.elastic is not None,
                                      elastic_min_pods=handle.spec.elastic.min_workers // platform.gpus_per_worker
                                      if handle.spec.elastic else None)
                    seen.observe(pods)
                except (StageBlocked, TrainingInterrupted):
                    platform.cancel_training(name, handle.spec.volume, owner)  # a retry submits a fresh one
                    raise
                say_launcher_replacements(pods, launchers_seen, output.on_log)
                if not replacements_stopped and launcher_failed_on_its_own(pods):
                    replacements_stopped = stop_launcher_replacements(platform, name)
                    output.on_log(f"laneflow: MPIJob {name}'s launcher failed on its own: its launcher Job starts no "
                                  "other (backoffLimit 0), and the job ends failed")
            streamed = follow_log(platform, core, selector, cursor, feed, deadline)
            if state in ("succeeded", "failed"):
                return job
            if time.monotonic() > deadline:
                platform.cancel_training(name, handle.spec.volume, owner)
                raise TrainingFailed(f"MPIJob {name} did not finish within {timeout_s:.0f} s; it was deleted",
                                     list(output.tail))
            if not streamed:
                time.sleep(platform.poll_interval_s)
    except (TrainingFailed, TransientPlatformError, PermissionError, StageBlocked):
        raise
    except BaseException as exc:  # task cancelled, flow run terminated: leave nothing running ...
        if handed_over(exc):  # ... unless the run goes on in another attempt, which adopts the job
            output.on_log(f"laneflow: this flow run's process is being stopped to run again elsewhere (its pod was "
                          f"told to stop: a drain of its node); MPIJob {name} trains on, and the next attempt "
                          "adopts it (a sweep's trial: the sweep's next attempt stops it and resumes the trial from "
                          "its checkpoint)")
            raise
        platform.cancel_training(name, handle.spec.volume, owner)
        raise


def stop_launcher_replacements(platform: ClusterPlatform, name: str) -> bool:
    """Tell MPIJob ``name``'s launcher Job to replace no more launchers (``backoffLimit`` 0, a mutable field the
    operator leaves alone once the Job exists): its launcher failed on its own, so the Job fails now, the operator
    marks the MPIJob failed and removes its running workers, and its pods stay for ``kubectl logs`` until the
    block's TTL — as with no replacements at all. False when there is no such Job (any more)."""
    _, batch, _ = apis(platform)
    try:
        call(platform, "patch", "jobs", batch.patch_namespaced_job, f"{name}-launcher", platform.effective_namespace(),
             {"spec": {"backoffLimit": 0}})
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def cancel(platform: ClusterPlatform, job_name: str, volume: VolumeRef, owner: str | None = None) -> bool:
    _, _, custom = apis(platform)
    group, version, plural = MPI
    if owner is not None:
        try:
            job = call(platform, "get", "mpijobs", custom.get_namespaced_custom_object, group, version,
                       platform.effective_namespace(), plural, job_name)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        if (other := another_owner(job, owner)) is not None:
            if mpijob_state(job) in ("succeeded", "failed"):  # that run's training is over: nothing of ours to stop
                return False
            raise NotOurJob(f"MPIJob {job_name} was started by flow run {other}, not {owner} (another run of the "
                            "same run key): left running")
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


def expired(jobs: list[dict], now: datetime, ttl_s: float) -> list[str]:
    """The names of the finished MPIJobs (Succeeded or Failed, with the operator's completionTime) that
    finished more than ``ttl_s`` before ``now`` and are not being deleted already."""
    names = []
    for job in jobs:
        finished = (job.get("status") or {}).get("completionTime")
        if not finished or mpijob_state(job) not in ("succeeded", "failed") or \
                job["metadata"].get("deletionTimestamp"):
            continue
        at = datetime.strptime(finished, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        if (now - at).total_seconds() > ttl_s:
            names.append(job["metadata"]["name"])
    return sorted(names)


def remove_expired(platform: ClusterPlatform, on_log: LogSink) -> list[str]:
    """Delete laneflow's finished MPIJobs older than the block's ``finished_ttl_s`` (and with them, by their
    owner references, the ssh key Secret, the hostfile ConfigMap and what is left of their pods): the operator
    only gives the TTL to the launcher Job. A run's own job is read within seconds of its end, far inside the
    TTL (at least 10 minutes). Never fails the run: a refusal is said in the log."""
    _, _, custom = apis(platform)
    group, version, plural = MPI
    namespace = platform.effective_namespace()
    try:
        listed = call(platform, "list", "mpijobs", custom.list_namespaced_custom_object, group, version, namespace,
                      plural, label_selector="app.kubernetes.io/managed-by=laneflow")
        names = expired(listed.get("items") or [], datetime.now(UTC), platform.finished_ttl_s)
        for name in names:
            call(platform, "delete", "mpijobs", custom.delete_namespaced_custom_object, group, version, namespace,
                 plural, name, propagation_policy="Background")
    except ApiException as exc:
        advice = " (grant list and delete on mpijobs: deployments/workloads)" if exc.status == 403 else ""
        on_log(f"laneflow: could not remove finished MPIJobs older than {platform.finished_ttl_s} s: HTTP "
               f"{exc.status} {exc.reason}{advice}")
        return []
    if names:
        on_log(f"laneflow: removed {len(names)} finished MPIJob(s) older than {platform.finished_ttl_s} s: "
               f"{', '.join(names)}")
    return names
