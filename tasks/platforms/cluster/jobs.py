"""Batch Jobs on the claim: dataset preparation, file reads and writes, and the GPU stages (evaluate,
package, predict).

Separate because every stage that is not training runs the same way: a Job mounting the claim at /data,
run to completion while its pod's log is followed, adopted when a retry finds it running or finished,
replaced when it failed, deleted past its deadline; its result is the last JSON event it printed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tasks.k8s.diagnose import terminated_problems
from tasks.k8s.kueue import QUEUE_LABEL
from tasks.k8s.logs import LogCursor
from tasks.k8s.manifests import (
    MOUNT_PATH,
    render_claim_job,
    render_data_job,
    render_sources_secret,
    sources_secret_name,
)
from tasks.launch import LOG_TAIL, parse_output_line
from tasks.names import validate_name
from tasks.platforms.base import (
    LogSink,
    StageBlocked,
    StageDeadlineExceeded,
    VolumeReadFailed,
    VolumeRef,
)
from tasks.platforms.cluster.api import STRICT, apis, call, create_or_adopt, wait_deleted
from tasks.platforms.cluster.kueue import AdmissionWatch
from tasks.platforms.cluster.pod_logs import follow_log
from tasks.platforms.cluster.problems import check_pods, problem_clock
from training.data.sources import Artifact, dataset_key, validate_artifacts

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

#: Bytes per appending Job: the data travels base64-encoded as one argument (Linux caps one at 128 KiB).
APPEND_CHUNK = 64 * 1024
#: Reader Jobs one ``read_file`` runs before it calls the read failed.
READ_ATTEMPTS = 3


# --- running a Job ----------------------------------------------------------------------------------
def run_job(platform: ClusterPlatform, body: dict, log: LogSink, timeout_s: float,
            delete_after: bool = False) -> list[str]:
    """Run a batch Job to completion, streaming its pod's log. A Job of ours of the same name is adopted
    while it runs or once it succeeded, and replaced when it failed: Jobs live a day after finishing
    (``ttlSecondsAfterFinished``), and the reason to run a stage again is that its cause was fixed."""
    core, batch, _ = apis(platform)
    namespace = platform.effective_namespace()
    name = body["metadata"]["name"]
    job, created = create_or_adopt(
        platform, "jobs", lambda: batch.create_namespaced_job(namespace, body, field_validation=STRICT),
        lambda: batch.read_namespaced_job(name, namespace),
        lambda job: (job.metadata.labels or {}).get("app.kubernetes.io/managed-by") == "laneflow", name)
    if not created and job.status and job.status.failed and not job.status.succeeded:
        log(f"laneflow: job {namespace}/{name} failed in an earlier attempt; replacing it")
        delete_job(platform, batch, name, wait=True)
        call(platform, "create", "jobs", batch.create_namespaced_job, namespace, body, field_validation=STRICT)
    seen: list[str] = []
    cursor = LogCursor()

    def collect(line: str) -> None:
        seen.append(line)
        log(line)

    deadline = time.monotonic() + timeout_s
    clock = problem_clock(platform)
    # A Job under Kueue waits, suspended, for its admission: not stuck.
    admission = AdmissionWatch(platform, f"job {namespace}/{name}", lambda _: None, log) \
        if (body["metadata"].get("labels") or {}).get(QUEUE_LABEL) else None
    try:
        while True:
            job = call(platform, "get", "jobs", batch.read_namespaced_job, name, namespace)
            status = job.status
            finished = bool(status and (status.succeeded or status.failed))
            if admission is not None and not finished and (job.spec.suspend or admission.waiting):
                try:
                    waits = admission.observe(job.metadata.uid).waits
                except StageBlocked:
                    delete_after = True
                    raise
                if waits:
                    if time.monotonic() > deadline:
                        delete_after = True
                        raise StageDeadlineExceeded(f"job {namespace}/{name} was not admitted by Kueue within "
                                                    f"{timeout_s:.0f} s ({admission.said}); it was deleted")
                    time.sleep(platform.poll_interval_s)
                    continue
            if not finished:
                try:
                    check_pods(platform, core, f"job-name={name}", clock, log, "its Job was deleted")
                except StageBlocked:
                    delete_after = True  # nothing it started will run: leave nothing waiting
                    raise
            streamed = follow_log(platform, core, f"job-name={name}", cursor, collect, deadline)
            if finished:
                if status.succeeded:
                    return seen
                tail = "\n".join(seen[-LOG_TAIL:])
                pods = call(platform, "list", "pods", core.list_namespaced_pod, namespace,
                            label_selector=f"job-name={name}").items
                killed = terminated_problems([core.api_client.sanitize_for_serialization(p) for p in pods])
                if killed:  # the same limit kills it again: not worth a retry
                    raise StageBlocked(f"job {namespace}/{name} failed: "
                                       + "; ".join(p.describe() for p in killed) + f". Its log ends:\n{tail}")
                raise RuntimeError(f"job {namespace}/{name} failed; its log ends:\n{tail}")
            if time.monotonic() > deadline:
                delete_after = True  # stop what the stage started: a deadline is not retried
                raise StageDeadlineExceeded(
                    f"job {namespace}/{name} did not finish within {timeout_s:.0f} s (the stage's deadline); "
                    "it was deleted with its pod. Its log ends:\n" + "\n".join(seen[-LOG_TAIL:]))
            if not streamed:
                time.sleep(platform.poll_interval_s)
    finally:
        if delete_after:
            delete_job(platform, batch, name)


def delete_job(platform: ClusterPlatform, batch: kubernetes.client.BatchV1Api, name: str, wait: bool = False) -> None:
    """Delete a Job and its pods (``Foreground`` when waiting: the Job goes only once its pods have)."""
    namespace = platform.effective_namespace()
    try:
        call(platform, "delete", "jobs", batch.delete_namespaced_job, name, namespace,
             propagation_policy="Foreground" if wait else "Background")
    except ApiException as exc:
        if exc.status != 404:
            raise
    if wait:
        wait_deleted(platform, "jobs", lambda: batch.read_namespaced_job(name, namespace), f"job {namespace}/{name}")


def last_event(lines: list[str], kind: str | tuple[str, ...], what: str) -> dict[str, Any]:
    """The last event of ``kind`` (or of any of several kinds) a Job printed: its result."""
    kinds = (kind,) if isinstance(kind, str) else kind
    for line in reversed(lines):
        event = parse_output_line(line).event
        if event and event.get("event") in kinds:
            return dict(event)
    tail, named = "\n".join(lines[-LOG_TAIL:]), "' or '".join(kinds)
    raise RuntimeError(f"{what} finished without reporting '{named}'; its log ends:\n{tail}")


def stays_on(volume: VolumeRef, relative_path: str) -> None:
    if relative_path.startswith("/") or ".." in relative_path.split("/"):
        raise ValueError(f"path '{relative_path}' leaves volume '{volume.name}'")


# --- the dataset ------------------------------------------------------------------------------------
def prepare_dataset(platform: ClusterPlatform, volume: VolumeRef, artifacts: list[Artifact],
                    log: LogSink) -> dict[str, Any]:
    name = dataset_job_name(volume.name, artifacts)
    labels = platform.job_labels(name, {"volume": volume.name})
    put_sources(platform, render_sources_secret(name, platform.layout(), artifacts, labels))
    try:
        lines = run_job(platform, render_data_job(name, platform.layout(), volume.name, labels), log,
                        timeout_s=platform.prepare_deadline_s)
    except Exception:
        # Only when the Job is over: one still running (the flow's side failed) may not have started its pod
        # yet, and a retry adopts it and puts the Secret again. Tidying never hides the stage's own error.
        try:
            if job_ended(platform, name):
                drop_sources(platform, name)
        except Exception as cleanup:
            logging.getLogger(__name__).warning("could not remove the sources Secret of job %s: %s", name, cleanup)
        raise
    # Not on an interruption (a drain of the flow's pod): the rescheduled run adopts the Job, whose pod may not
    # have started yet, and puts the Secret again.
    drop_sources(platform, name)
    return last_event(lines, "prepared", f"dataset job {name}")


def dataset_job_name(volume: str, artifacts: list[Artifact]) -> str:
    """One Job per volume and dataset: a retry adopts it; another volume (a restore) gets its own."""
    return validate_name(f"prepare-{volume[:36].rstrip('-')}-{dataset_key(validate_artifacts(artifacts))}", "job")


#: How often the sources Secret is made again when it goes between the create's conflict and the patch.
PUT_SOURCES_TRIES = 3


def put_sources(platform: ClusterPlatform, secret: dict) -> None:
    """Create the dataset Job's sources Secret, or replace the data of ours left by an earlier try (a SAS may have
    been renewed since). The flows' account may create, patch and delete Secrets (no get or list): a Secret of
    that name that laneflow did not make is refused by the patch's test, never overwritten. Runs preparing one
    dataset on one volume share the Job and its Secret, and one whose Job has ended drops the Secret: when it goes
    between this create's conflict and its patch (404), it is created again."""
    core, _, _ = apis(platform)
    namespace, name = platform.effective_namespace(), secret["metadata"]["name"]
    ours = [{"op": "test", "path": "/metadata/labels/app.kubernetes.io~1managed-by", "value": "laneflow"},
            {"op": "replace", "path": "/data", "value": secret["data"]}]
    for attempt in range(PUT_SOURCES_TRIES):
        try:
            call(platform, "create", "secrets", core.create_namespaced_secret, namespace, secret,
                 field_validation=STRICT)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        try:
            call(platform, "patch", "secrets", core.patch_namespaced_secret, name, namespace, ours)
            return
        except ApiException as exc:
            if exc.status == 404 and attempt + 1 < PUT_SOURCES_TRIES:
                continue  # removed meanwhile by a run whose Job ended: make it again
            if exc.status != 422:
                raise
            raise FileExistsError(f"secret '{name}' already exists in namespace '{namespace}' and was not created "
                                  "by laneflow; refusing to touch it (delete it or prepare the dataset on another "
                                  "volume)") from None


def job_ended(platform: ClusterPlatform, name: str) -> bool:
    """Whether the Job is gone, being deleted, or finished: nothing of it will start a pod any more."""
    _, batch, _ = apis(platform)
    try:
        job = call(platform, "get", "jobs", batch.read_namespaced_job, name, platform.effective_namespace())
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    status = job.status
    return bool(job.metadata.deletion_timestamp or (status and (status.succeeded or status.failed)))


def drop_sources(platform: ClusterPlatform, job: str) -> None:
    """The sources Secret is needed only until the Job's pod has started: gone once the Job ended (or never ran)."""
    core, _, _ = apis(platform)
    try:
        call(platform, "delete", "secrets", core.delete_namespaced_secret, sources_secret_name(job),
             platform.effective_namespace())
    except ApiException as exc:
        if exc.status != 404:
            raise


# --- files on the claim -----------------------------------------------------------------------------
def file_job(platform: ClusterPlatform, kind: str, volume: VolumeRef, relative_path: str, script: str,
             *args: str) -> list[str]:
    """Run ``python -c script /data/<relative_path> *args`` in a throwaway Job on the claim; its log lines."""
    stays_on(volume, relative_path)
    name = f"{kind}-{hashlib.sha256(relative_path.encode()).hexdigest()[:8]}-{uuid.uuid4().hex[:8]}"
    body = render_claim_job(name, platform.layout(), volume.name,
                            ["python", "-c", script, f"{MOUNT_PATH}/{relative_path}", *args], platform.job_labels(name))
    return run_job(platform, body, lambda _: None, timeout_s=1800, delete_after=True)


def read_file(platform: ClusterPlatform, volume: VolumeRef, relative_path: str) -> bytes:
    """The file, read by a Job on the claim. The reader itself says when the file is not there (the only
    ``FileNotFoundError``); a reader that failed — an API call that kept failing, a pod that did not run —
    is tried again, and then is a ``VolumeReadFailed``: a failed read is never an absent file (a study
    journal taken for absent would be started afresh over the old one)."""
    script = ("import base64, json, os, sys\n"
              "if not os.path.isfile(sys.argv[1]):\n"
              "    print(json.dumps({'event': 'missing', 'exists': os.path.exists(sys.argv[1])}))\n"
              "    sys.exit(0)\n"
              "data = open(sys.argv[1], 'rb').read()\n"
              "print(json.dumps({'event': 'file', 'base64': base64.b64encode(data).decode()}))\n")
    failure: Exception | None = None
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            lines = file_job(platform, "read", volume, relative_path, script)
            answer = last_event(lines, ("file", "missing"), f"reader job for {relative_path}")
        except (StageBlocked, StageDeadlineExceeded) as exc:  # waited out its grace already: no quick retry
            failure = exc
            break
        except RuntimeError as exc:  # a failed Job, an API that kept failing (TransientPlatformError)
            failure = exc
            if attempt < READ_ATTEMPTS:
                time.sleep(platform.poll_interval_s * attempt)
            continue
        if answer["event"] == "missing":
            what = "is not a file" if answer.get("exists") else "does not exist"
            raise FileNotFoundError(f"{relative_path} {what} on volume '{volume.name}'")
        return base64.b64decode(answer["base64"])
    raise VolumeReadFailed(f"{relative_path} on volume '{volume.name}' could not be read ({failure}); it may well be "
                           "there, so nothing was assumed about it. Check the claim and the reader Jobs "
                           "(kubectl get jobs -l app.kubernetes.io/managed-by=laneflow), then run again")


def append_file(platform: ClusterPlatform, volume: VolumeRef, relative_path: str, data: bytes) -> None:
    script = ("import base64, json, os, sys\n"
              "os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)\n"
              "with open(sys.argv[1], 'ab') as sink:\n"
              "    sink.write(base64.b64decode(sys.argv[2]))\n"
              "    sink.flush()\n"
              "    os.fsync(sink.fileno())\n"
              "print(json.dumps({'event': 'appended', 'bytes': os.path.getsize(sys.argv[1])}))\n")
    for start in range(0, len(data), APPEND_CHUNK):
        chunk = base64.b64encode(data[start:start + APPEND_CHUNK]).decode()
        last_event(file_job(platform, "append", volume, relative_path, script, chunk), "appended",
                   f"appending job for {relative_path}")


def replace_file(platform: ClusterPlatform, volume: VolumeRef, relative_path: str, data: bytes) -> None:
    """Appended in chunks to a file of its own beside the target, then renamed over it by one more Job: a
    reader sees the old file or the new one."""
    stays_on(volume, relative_path)
    folder, _, name = relative_path.rpartition("/")
    partial = f"{folder + '/' if folder else ''}.{name}.{uuid.uuid4().hex[:8]}.partial"
    if data:
        append_file(platform, volume, partial, data)
    else:
        write_text(platform, volume, partial, "")
    script = ("import json, os, sys\n"
              "os.replace(sys.argv[1], sys.argv[2])\n"
              "print(json.dumps({'event': 'replaced', 'bytes': os.path.getsize(sys.argv[2])}))\n")
    last_event(file_job(platform, "replace", volume, partial, script, f"{MOUNT_PATH}/{relative_path}"), "replaced",
               f"replacing job for {relative_path}")


def write_text(platform: ClusterPlatform, volume: VolumeRef, relative_path: str, text: str) -> None:
    """A Job in the data image writes it onto the claim (temporary file, then rename)."""
    script = ("import os, sys\n"
              "os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)\n"
              "open(sys.argv[1] + '.tmp', 'w').write(sys.argv[2])\n"
              "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n")
    file_job(platform, "write", volume, relative_path, script, text)
