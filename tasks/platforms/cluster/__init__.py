"""The cluster platform: a PVC is the volume, Horovod runs as an MPIJob, snapshots are CSI VolumeSnapshots.

Every manual ``kubectl``/``runai`` step of the seed, automated and idempotent: the PVC is created RWX
or adopted (and its bound PV patched to ReadWriteMany when needed, then verified); dataset preparation,
evaluation and file reads run as Jobs on the claim; training is an MPIJob named after the flow run (a
409 adopts it when it is ours and refuses it when it is not); snapshots carry the run's lineage.

API calls retry 429 (honouring Retry-After), 5xx and connection resets themselves; a 403 fails at
once naming the verb and resource the service account lacks.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal, TypeVar

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException
from prefect_kubernetes.credentials import KubernetesCredentials
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator

from tasks.anf import AnfVolume
from tasks.k8s.diagnose import (
    PodProblem,
    ProblemClock,
    claim_problems,
    creating,
    pod_problems,
    terminated_problems,
)
from tasks.k8s.logs import LogCursor, LogFormatError, format_timestamp
from tasks.k8s.manifests import (
    MANAGED_BY,
    MOUNT_PATH,
    ClusterLayout,
    object_labels,
    render_data_job,
    render_mpijob,
    render_pvc,
    render_snapshot,
)
from tasks.k8s.quantity import larger_size, validate_size
from tasks.launch import LOG_TAIL, JobOutput, parse_output_line, read_mpijob_failure
from tasks.names import validate_name, validate_subdomain
from tasks.platforms.base import (
    EventSink,
    LogSink,
    Platform,
    SnapshotRef,
    StageBlocked,
    StageDeadlineExceeded,
    TrainingFailed,
    TrainingHandle,
    TrainingInterrupted,
    TrainingOutcome,
    TrainingSpec,
    TransientPlatformError,
    VolumeRef,
    last_attempt,
    outcome_from_events,
    paths_in,
)
from training.data.sources import Artifact, dataset_key, validate_artifacts

T = TypeVar("T")
#: laneflow's ANF snapshot names: <volume>-<run> (tasks.names.snapshot_name).
_ANF_SNAPSHOT_NAME = re.compile(r"^(?P<volume>.+)-(?P<run>[a-z]+-[0-9a-f]{12})$")
_LOG = logging.getLogger("laneflow.cluster")
MPI = ("kubeflow.org", "v2beta1", "mpijobs")
SNAPSHOTS = ("snapshot.storage.k8s.io", "v1", "volumesnapshots")
LINEAGE_ANNOTATION = "laneflow.io/lineage"
#: A log stream is closed and reopened (from where it stopped) at least this often, so job state is
#: re-read even while the log never goes quiet.
STREAM_WINDOW_S = 60.0
#: The MPI operator refuses an invalid job with a Warning event of this reason and sets no condition
#: (kubeflow/mpi-operator pkg/controller/mpi_job_controller.go, syncHandler): it never starts.
REFUSED_REASON = "ValidationError"
#: Unknown fields in what laneflow sends are refused (400), never silently dropped (the server's default).
STRICT = "Strict"


class _ClientCache:
    """One ``ApiClient`` (one connection pool) per platform instance. Prefect copies blocks (a
    transaction keeps a deep copy for its rollback hook): a copy starts with no client of its own."""

    def __init__(self) -> None:
        self.client: kubernetes.client.ApiClient | None = None

    def __deepcopy__(self, memo: dict) -> _ClientCache:
        return _ClientCache()

    def __reduce__(self) -> tuple:
        return _ClientCache, ()


class _ApiClient(kubernetes.client.ApiClient):
    """The kubernetes client, with a (connect, read) timeout for every call that sets none: a hung
    connection then fails and ``_call`` retries it, instead of blocking its task for good (a Prefect
    task timeout cannot interrupt a task in a worker thread, so laneflow's tasks set none)."""

    def __init__(self, configuration: kubernetes.client.Configuration, timeout: tuple[float, float]) -> None:
        super().__init__(configuration)
        self.default_timeout = timeout

    def call_api(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return super().call_api(*args, _request_timeout=_request_timeout or self.default_timeout, **kwargs)


#: Bytes per appending Job: the data travels base64-encoded as one argument (Linux caps one at 128 KiB).
APPEND_CHUNK = 64 * 1024


class ClusterPlatform(Platform):
    """Kubernetes: PVC volumes, Horovod MPIJobs (optionally scheduled by Run:ai), CSI VolumeSnapshots."""

    _block_type_name: ClassVar[str] = "Laneflow Cluster Platform"
    _block_type_slug: ClassVar[str] = "laneflow-cluster-platform"
    _description: ClassVar[str] = "Runs the laneflow DAG on Kubernetes: PVCs, MPIJobs, VolumeSnapshots."

    credentials: KubernetesCredentials | None = Field(
        None, description="cluster access; empty: in-cluster config, else the default kubeconfig")
    namespace: str = Field("laneflow", description="namespace for everything laneflow creates")
    storage_class: str = Field("azure-netapp-files", description="storage class of new PVCs (RWX-capable)")
    volume_size: str = Field("100Gi", description="size of new PVCs")
    snapshot_class: str = Field("csi-anf-snapclass", description="VolumeSnapshotClass")
    image: str = Field("laneflow-train:0.1.0", description="training image (torch, Horovod with NCCL, laneflow)")
    data_image: str = Field("laneflow-data:0.1.0", description="image for dataset preparation and file reads")
    gpus_per_worker: int = Field(1, ge=1, description="GPUs (and Horovod slots) per worker pod")
    shm_size: str = Field("8Gi", description="/dev/shm size of worker pods")
    service_account: str = Field("laneflow-training", description="service account of the job pods")
    runai_project: str | None = Field(None, description="schedule with Run:ai in namespace runai-<project>")
    poll_interval_s: float = Field(5.0, gt=0, description="how often job state and logs are read")
    pod_problem_grace_s: float = Field(60.0, ge=0, description="how long a stage's pod may stay unable to run (image "
                                       "pull, scheduling, configuration) before the stage fails naming why")
    scheduling_grace_s: float = Field(900.0, ge=0, description="how long a pod may wait for room on the cluster "
                                      "(GPUs busy with other jobs, a node an autoscaler adds, a claim being "
                                      "provisioned) before the stage fails naming what it asked for; with Run:ai "
                                      "its queue decides and this does not apply")
    prepare_deadline_s: float = Field(12 * 3600, gt=0, description="the dataset stage's deadline: past it the "
                                                                   "prepare Job is deleted and the stage fails")
    api_attempts: int = Field(6, ge=1, description="tries per API call on 429/5xx/connection errors")
    api_retry_delay_s: float = Field(0.5, gt=0, le=30, description="first wait before trying a failed API call "
                                                                  "again; it doubles each time, up to 30 s (a "
                                                                  "429's Retry-After wins)")
    api_timeout_s: float = Field(120.0, gt=0, description="an API call unanswered this long fails and is tried "
                                                          "again (connecting: at most 30 s)")
    snapshotter: Literal["csi", "anf"] = Field(
        "csi", description="csi: VolumeSnapshots (lineage in labels/annotations); anf: ANF snapshots through Azure "
                           "(lineage in the run's lineage.json on the volume), for volumes not snapshotted by CSI")
    anf: AnfVolume | None = Field(None, description="the Azure NetApp Files volume behind the PVC, to change its "
                                                    "service level around training")
    _clients: _ClientCache = PrivateAttr(default_factory=lambda: _ClientCache())

    # Checked when the block is made or loaded, not when a stage sends them: a typo found hours late costs
    # the stages before it (the API server would refuse the PVC or the MPIJob only then).
    @field_validator("volume_size", "shm_size")
    @classmethod
    def _sizes_are_quantities(cls, value: str, info: ValidationInfo) -> str:
        return validate_size(value, info.field_name)

    @field_validator("namespace")
    @classmethod
    def _namespace_is_a_label(cls, value: str) -> str:
        return validate_name(value, "namespace")

    @field_validator("storage_class", "snapshot_class", "service_account")
    @classmethod
    def _names_are_subdomains(cls, value: str, info: ValidationInfo) -> str:
        return validate_subdomain(value, info.field_name)

    @field_validator("runai_project")
    @classmethod
    def _project_makes_a_namespace(cls, value: str | None) -> str | None:
        if value is not None:
            validate_name(f"runai-{value}", "Run:ai project namespace")
        return value

    # --- plumbing ------------------------------------------------------------------------------------
    def layout(self) -> ClusterLayout:
        return ClusterLayout(namespace=self.namespace, image=self.image, data_image=self.data_image,
                             storage_class=self.storage_class, snapshot_class=self.snapshot_class,
                             volume_size=self.volume_size, gpus_per_worker=self.gpus_per_worker,
                             shm_size=self.shm_size, service_account=self.service_account,
                             runai_project=self.runai_project)

    def _ns(self) -> str:
        return self.layout().effective_namespace()

    def _api_client(self) -> kubernetes.client.ApiClient:
        configuration = kubernetes.client.Configuration()
        cluster = self.credentials.cluster_config if self.credentials else None
        if cluster is not None:
            kubernetes.config.load_kube_config_from_dict(cluster.config, context=cluster.context_name,
                                                         client_configuration=configuration)
        else:
            try:
                kubernetes.config.load_incluster_config(client_configuration=configuration)
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config(client_configuration=configuration)
        configuration.retries = urllib3.util.Retry(total=0, redirect=0)  # retries are ours (below), counted
        return _ApiClient(configuration, (min(30.0, self.api_timeout_s), self.api_timeout_s))

    def _apis(self) -> tuple[kubernetes.client.CoreV1Api, kubernetes.client.BatchV1Api,
                             kubernetes.client.CustomObjectsApi]:
        """The API groups laneflow calls, over one client (one connection pool) per platform instance."""
        if self._clients.client is None:
            self._clients.client = self._api_client()
        client = self._clients.client
        return (kubernetes.client.CoreV1Api(client), kubernetes.client.BatchV1Api(client),
                kubernetes.client.CustomObjectsApi(client))

    def _call(self, verb: str, resource: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One API call with retries on 429 (Retry-After), 5xx and connection errors; 403 names the permission."""
        delay = self.api_retry_delay_s
        for attempt in range(1, self.api_attempts + 1):
            try:
                return fn(*args, **kwargs)
            except ApiException as exc:
                if exc.status == 403:
                    raise PermissionError(
                        f"the service account may not '{verb}' {resource} in namespace '{self._ns()}'; grant it "
                        f"(deployments/base/rbac.yaml lists every permission laneflow needs): {_message(exc)}"
                    ) from None
                if exc.status == 404 and (missing := _missing_namespace(exc)) is not None:
                    raise NamespaceNotFound(
                        f"namespace '{missing}' does not exist on this cluster, so laneflow cannot create "
                        f"{resource} there. `kubectl apply -k deployments/base` creates namespace laneflow (the "
                        "block's default); a Run:ai project's namespace runai-<project> comes with the project, "
                        "and `kubectl apply -k deployments/runai` prepares it for laneflow; or set the block's "
                        "namespace to one that exists") from None
                if exc.status != 429 and exc.status < 500:
                    raise
                wait = _retry_after(exc) or delay
            except (urllib3.exceptions.HTTPError, ConnectionError):
                wait = delay
            if attempt == self.api_attempts:
                raise TransientPlatformError(f"{verb} {resource}: still failing after {attempt} attempts")
            time.sleep(wait)
            delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def _create_or_adopt(self, kind: str, create: Callable[[], Any], read: Callable[[], Any],
                         is_ours: Callable[[Any], bool], name: str) -> tuple[Any, bool]:
        """Create; on 409 (ours from an earlier try, or someone else's) read it and adopt or refuse."""
        try:
            return self._call("create", kind, create), True
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = self._call("get", kind, read)
        if not is_ours(existing):
            raise FileExistsError(f"{kind} '{name}' already exists in namespace '{self._ns()}' and was not created "
                                  "by laneflow for this run; refusing to touch it (choose another name)")
        return existing, False

    # --- volume --------------------------------------------------------------------------------------
    def ensure_volume(self, name: str) -> VolumeRef:
        validate_name(name, "volume")
        core, _, _ = self._apis()
        try:
            self._call("get", "persistentvolumeclaims", core.read_namespaced_persistent_volume_claim, name,
                       self._ns())
            return VolumeRef(name=name, location=f"{self._ns()}/{name}", created=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
        body = render_pvc(name, self.layout(), {**MANAGED_BY})
        _, created = self._create_or_adopt(
            "persistentvolumeclaims",
            lambda: core.create_namespaced_persistent_volume_claim(self._ns(), body, field_validation=STRICT),
            lambda: core.read_namespaced_persistent_volume_claim(name, self._ns()), lambda _: True, name)
        return VolumeRef(name=name, location=f"{self._ns()}/{name}", created=created)

    def ensure_shared_access(self, volume: VolumeRef) -> str:
        core, _, _ = self._apis()
        deadline = time.monotonic() + 600
        clock = self._problem_clock()
        while True:
            claim = self._call("get", "persistentvolumeclaims", core.read_namespaced_persistent_volume_claim,
                               volume.name, self._ns())
            if claim.spec.volume_name and (claim.status and claim.status.phase == "Bound"):
                break
            # Pending: is the provisioner refusing it (no such storage class, a restore too small, quota)?
            events = self._call("list", "events", core.list_namespaced_event, self._ns(),
                                field_selector=f"involvedObject.kind=PersistentVolumeClaim,"
                                               f"involvedObject.name={volume.name}").items
            problems = claim_problems(volume.name, [core.api_client.sanitize_for_serialization(e) for e in events])
            self._act_on(problems, clock, _LOG.warning, stopping=None)
            if time.monotonic() > deadline:
                raise StageDeadlineExceeded(f"PVC {volume.location} is not bound after 10 minutes and no event says "
                                            "why; check its storage class and provisioner")
            time.sleep(self.poll_interval_s)
        pv_name = claim.spec.volume_name
        pv = self._call("get", "persistentvolumes", core.read_persistent_volume, pv_name)
        if "ReadWriteMany" in (pv.spec.access_modes or []):
            return f"PV {pv_name} of {volume.location} is already ReadWriteMany"
        self._call("patch", "persistentvolumes", core.patch_persistent_volume, pv_name,
                   {"spec": {"accessModes": ["ReadWriteMany"]}}, field_validation=STRICT)
        pv = self._call("get", "persistentvolumes", core.read_persistent_volume, pv_name)
        if "ReadWriteMany" not in (pv.spec.access_modes or []):
            raise RuntimeError(f"patched PV {pv_name} to ReadWriteMany but it reports {pv.spec.access_modes}; "
                               "does its storage backend support RWX (ANF does)?")
        return f"PV {pv_name} of {volume.location} patched to ReadWriteMany and verified"

    # --- jobs on the claim ---------------------------------------------------------------------------
    def _run_job(self, body: dict, log: LogSink, timeout_s: float, delete_after: bool = False) -> list[str]:
        """Run a batch Job to completion, streaming its pod's log. A Job of ours of the same name is adopted
        while it runs or once it succeeded, and replaced when it failed: Jobs live a day after finishing
        (``ttlSecondsAfterFinished``), and the reason to run a stage again is that its cause was fixed."""
        core, batch, _ = self._apis()
        name = body["metadata"]["name"]
        job, created = self._create_or_adopt(
            "jobs", lambda: batch.create_namespaced_job(self._ns(), body, field_validation=STRICT),
            lambda: batch.read_namespaced_job(name, self._ns()),
            lambda job: (job.metadata.labels or {}).get("app.kubernetes.io/managed-by") == "laneflow", name)
        if not created and job.status and job.status.failed and not job.status.succeeded:
            log(f"laneflow: job {self._ns()}/{name} failed in an earlier attempt; replacing it")
            self._delete_job(batch, name, wait=True)
            self._call("create", "jobs", batch.create_namespaced_job, self._ns(), body, field_validation=STRICT)
        seen: list[str] = []
        cursor = LogCursor()

        def collect(line: str) -> None:
            seen.append(line)
            log(line)

        deadline = time.monotonic() + timeout_s
        clock = self._problem_clock()
        try:
            while True:
                job = self._call("get", "jobs", batch.read_namespaced_job, name, self._ns())
                status = job.status
                finished = bool(status and (status.succeeded or status.failed))
                if not finished:
                    try:
                        self._check_pods(core, f"job-name={name}", clock, log, "its Job was deleted")
                    except StageBlocked:
                        delete_after = True  # nothing it started will run: leave nothing waiting
                        raise
                streamed = self._follow_log(core, f"job-name={name}", cursor, collect, deadline)
                if finished:
                    if status.succeeded:
                        return seen
                    tail = "\n".join(seen[-LOG_TAIL:])
                    pods = self._call("list", "pods", core.list_namespaced_pod, self._ns(),
                                      label_selector=f"job-name={name}").items
                    killed = terminated_problems([core.api_client.sanitize_for_serialization(p) for p in pods])
                    if killed:  # the same limit kills it again: not worth a retry
                        raise StageBlocked(f"job {self._ns()}/{name} failed: "
                                           + "; ".join(p.describe() for p in killed) + f". Its log ends:\n{tail}")
                    raise RuntimeError(f"job {self._ns()}/{name} failed; its log ends:\n{tail}")
                if time.monotonic() > deadline:
                    delete_after = True  # stop what the stage started: a deadline is not retried
                    raise StageDeadlineExceeded(
                        f"job {self._ns()}/{name} did not finish within {timeout_s:.0f} s (the stage's deadline); "
                        "it was deleted with its pod. Its log ends:\n" + "\n".join(seen[-LOG_TAIL:]))
                if not streamed:
                    time.sleep(self.poll_interval_s)
        finally:
            if delete_after:
                self._delete_job(batch, name)

    def _delete_job(self, batch: kubernetes.client.BatchV1Api, name: str, wait: bool = False) -> None:
        """Delete a Job and its pods (``Foreground`` when waiting: the Job goes only once its pods have)."""
        try:
            self._call("delete", "jobs", batch.delete_namespaced_job, name, self._ns(),
                       propagation_policy="Foreground" if wait else "Background")
        except ApiException as exc:
            if exc.status != 404:
                raise
        if wait:
            self._wait_deleted("jobs", lambda: batch.read_namespaced_job(name, self._ns()), f"job {self._ns()}/{name}")

    def _wait_deleted(self, resource: str, read: Callable[[], Any], what: str) -> None:
        """Until ``read`` answers 404 (a Foreground delete ends when the object's dependents are gone)."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                self._call("get", resource, read)
            except ApiException as exc:
                if exc.status == 404:
                    return
                raise
            time.sleep(self.poll_interval_s)
        raise TimeoutError(f"{what} was not deleted within 5 minutes")

    def _follow_log(self, core: kubernetes.client.CoreV1Api, selector: str, cursor: LogCursor, sink: LogSink,
                    deadline: float) -> bool:
        """Stream the newest matching pod's log into ``sink`` from where ``cursor`` stopped.

        Returns when the stream ends (the container exited, or the connection dropped), when it has
        been quiet for a poll interval, or after ``STREAM_WINDOW_S``; False when there was no log to
        read yet. The kubelet follows the log across rotations; what a reconnect sends again is
        dropped by the cursor (tasks/k8s/logs.py).
        """
        pods = self._call("list", "pods", core.list_namespaced_pod, self._ns(), label_selector=selector).items
        if not pods:
            return False
        pod = max(pods, key=lambda p: (p.metadata.creation_timestamp is not None, p.metadata.creation_timestamp))
        try:
            response = self._call("get", "pods/log", core.read_namespaced_pod_log, pod.metadata.name, self._ns(),
                                  follow=True, timestamps=True, since_seconds=cursor.since_seconds(time.time()),
                                  _preload_content=False, _request_timeout=(30, self.poll_interval_s))
        except ApiException as exc:
            if exc.status in (400, 404):  # container not started yet, or the pod is gone
                return False
            raise
        cursor.start_reading(pod.metadata.name)
        gaps_before = len(cursor.gaps)
        until = min(deadline, time.monotonic() + STREAM_WINDOW_S)
        try:
            for raw in _stream_lines(response):
                try:
                    text = cursor.accept(raw, time.time())
                except LogFormatError:  # a line cut short by the end of the stream: it comes again whole
                    continue
                if len(cursor.gaps) > gaps_before:
                    gaps_before = len(cursor.gaps)
                    after, before = (format_timestamp(stamp) for stamp in cursor.gaps[-1])
                    sink(f"laneflow: the kubelet rotated pod {pod.metadata.name}'s log while laneflow "
                         f"reconnected: lines written after {after} and before {before} cannot be read from the "
                         "API; the run's metrics.jsonl on the volume keeps every training event")
                if text is not None:
                    sink(text)
                if time.monotonic() > until:
                    break
        except (urllib3.exceptions.HTTPError, ConnectionError):
            pass  # idle past the read timeout, or cut: the next call resumes from the cursor
        finally:
            response.close()
            response.release_conn()
        return True

    def _job_labels(self, run: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return object_labels(self.layout(), run, extra or {})

    def prepare_dataset(self, volume: VolumeRef, artifacts: list[Artifact], log: LogSink) -> dict[str, Any]:
        # One Job per volume and dataset: a retry adopts it; another volume (a restore) gets its own.
        key = dataset_key(validate_artifacts(artifacts))
        name = validate_name(f"prepare-{volume.name[:36].rstrip('-')}-{key}", "job")
        body = render_data_job(name, self.layout(), volume.name, artifacts,
                               self._job_labels(name, {"volume": volume.name}))
        lines = self._run_job(body, log, timeout_s=self.prepare_deadline_s)
        return _last_event(lines, "prepared", f"dataset job {name}")

    def _file_job(self, kind: str, volume: VolumeRef, relative_path: str, script: str, *args: str) -> list[str]:
        """Run ``python -c script /data/<relative_path> *args`` in a throwaway Job on the claim; its log lines."""
        _stays_on(volume, relative_path)
        name = f"{kind}-{hashlib.sha256(relative_path.encode()).hexdigest()[:8]}-{uuid.uuid4().hex[:8]}"
        body = render_data_job(name, self.layout(), volume.name, [], self._job_labels(name))
        body["spec"]["template"]["spec"]["containers"][0]["command"] = [
            "python", "-c", script, f"{MOUNT_PATH}/{relative_path}", *args]
        return self._run_job(body, lambda _: None, timeout_s=1800, delete_after=True)

    def read_file(self, volume: VolumeRef, relative_path: str) -> bytes:
        script = ("import base64, json, sys\n"
                  "data = open(sys.argv[1], 'rb').read()\n"
                  "print(json.dumps({'event': 'file', 'base64': base64.b64encode(data).decode()}))\n")
        try:
            lines = self._file_job("read", volume, relative_path, script)
        except RuntimeError as exc:
            raise FileNotFoundError(f"{relative_path} could not be read from volume '{volume.name}': {exc}") from None
        return base64.b64decode(_last_event(lines, "file", f"reader job for {relative_path}")["base64"])

    def append_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        script = ("import base64, json, os, sys\n"
                  "os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)\n"
                  "with open(sys.argv[1], 'ab') as sink:\n"
                  "    sink.write(base64.b64decode(sys.argv[2]))\n"
                  "    sink.flush()\n"
                  "    os.fsync(sink.fileno())\n"
                  "print(json.dumps({'event': 'appended', 'bytes': os.path.getsize(sys.argv[1])}))\n")
        for start in range(0, len(data), APPEND_CHUNK):
            chunk = base64.b64encode(data[start:start + APPEND_CHUNK]).decode()
            _last_event(self._file_job("append", volume, relative_path, script, chunk), "appended",
                        f"appending job for {relative_path}")

    # --- launcher ------------------------------------------------------------------------------------
    def _mpijob_body(self, spec: TrainingSpec) -> dict:
        labels = self._job_labels(spec.job_name, spec.labels)
        return render_mpijob(spec.job_name, self.layout(), spec.volume.name, spec.preset, spec.workers,
                             spec.data_dir, spec.run_dir, spec.settings, labels)

    def submit_training(self, spec: TrainingSpec) -> TrainingHandle:
        _, _, custom = self._apis()
        body = self._mpijob_body(spec)
        group, version, plural = MPI

        def ours(job: dict) -> bool:
            labels = job["metadata"].get("labels", {})
            return labels.get("app.kubernetes.io/managed-by") == "laneflow" and \
                labels.get("laneflow.io/run") == spec.job_name

        job, created = self._create_or_adopt(
            "mpijobs", lambda: custom.create_namespaced_custom_object(group, version, self._ns(), plural, body,
                                                                      field_validation=STRICT),
            lambda: custom.get_namespaced_custom_object(group, version, self._ns(), plural, spec.job_name),
            ours, spec.job_name)
        state = _mpijob_state(job)
        if not created and state == "failed":
            # An earlier attempt stopped (preempted, a worker lost): replace it; the trainer resumes.
            self.cancel_training(spec.job_name, spec.volume)
            self._wait_gone(custom, spec.job_name)
            job = self._call("create", "mpijobs", custom.create_namespaced_custom_object, group, version,
                             self._ns(), plural, body, field_validation=STRICT)
            created, state = True, _mpijob_state(job)
        return TrainingHandle(job_name=spec.job_name, spec=spec, state=state, adopted=not created,
                              details={"namespace": self._ns(), "uid": job["metadata"].get("uid")})

    def _wait_gone(self, custom: kubernetes.client.CustomObjectsApi, name: str) -> None:
        group, version, plural = MPI
        self._wait_deleted("mpijobs", lambda: custom.get_namespaced_custom_object(group, version, self._ns(), plural,
                                                                                 name), f"MPIJob {name}")

    def wait_for_training(self, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
                          timeout_s: float) -> TrainingOutcome:
        core, _, custom = self._apis()
        group, version, plural = MPI
        name = handle.job_name
        selector = f"training.kubeflow.org/job-name={name},training.kubeflow.org/job-role=launcher"
        started = time.monotonic()
        deadline = started + timeout_s
        output = JobOutput(on_event, on_log)
        warnings_seen: set[str] = set()
        cursor = LogCursor()
        clock = self._problem_clock()

        try:
            while True:
                job = self._call("get", "mpijobs", custom.get_namespaced_custom_object, group, version, self._ns(),
                                 plural, name)
                state = _mpijob_state(job)
                if state == "pending":  # not running yet: refused? waiting on something? (Warning events say)
                    self._check_warnings(core, job, warnings_seen, on_log)
                if state in ("pending", "running"):  # a pod that cannot run (a worker can fail alone)
                    try:
                        self._check_pods(core, f"training.kubeflow.org/job-name={name}", clock, output.feed,
                                         "the MPIJob was deleted", exited_workers=True)
                    except (StageBlocked, TrainingInterrupted):
                        self.cancel_training(name, handle.spec.volume)  # a retry submits a fresh one
                        raise
                streamed = self._follow_log(core, selector, cursor, output.feed, deadline)
                if state == "succeeded":
                    break
                if state == "failed":
                    break
                if time.monotonic() > deadline:
                    self.cancel_training(name, handle.spec.volume)
                    raise TrainingFailed(f"MPIJob {name} did not finish within {timeout_s:.0f} s; it was deleted",
                                         list(output.tail))
                if not streamed:
                    time.sleep(self.poll_interval_s)
        except (TrainingFailed, TransientPlatformError, PermissionError, StageBlocked):
            raise
        except BaseException:  # task cancelled, flow run terminated: leave nothing running
            self.cancel_training(name, handle.spec.volume)
            raise
        if state == "succeeded":
            return outcome_from_events(name, self._all_events(handle, output, cursor, on_log),
                                       time.monotonic() - started, list(output.tail))
        condition = _failed_condition(job)
        reason = condition.get("reason", "")
        detail = f"{reason}: {condition.get('message', '')}; pods: {self._pod_reasons(core, name) or 'none found'}"
        reading = read_mpijob_failure(reason, output.exit_lines, output.events)
        if reading.resumable:
            raise TrainingInterrupted(f"MPIJob {name} stopped ({reading.reason}); {detail}")
        raise TrainingFailed(f"MPIJob {name} failed ({reading.reason}); {detail}", list(output.tail))

    def _all_events(self, handle: TrainingHandle, output: JobOutput, cursor: LogCursor,
                    on_log: LogSink) -> list[dict[str, Any]]:
        """The finished run's events: as streamed, or, when lines were rotated away unread, from the run's
        own record (falling back to what was streamed if that cannot be read)."""
        if not cursor.gaps:
            return output.events
        try:
            return last_attempt(self.read_file(handle.spec.volume, f"{handle.spec.run_dir}/metrics.jsonl").decode())
        except Exception as exc:  # the training succeeded: do not fail it over its summary
            on_log(f"laneflow: could not read {handle.spec.run_dir}/metrics.jsonl after the log gap ({exc}); the "
                   "outcome is from the events streamed")
            return output.events

    def _check_warnings(self, core: kubernetes.client.CoreV1Api, job: dict, seen: set[str], on_log: LogSink) -> None:
        """Fail fast when the operator refused the job: it then only records a Warning event, no condition.

        Other Warning events of a job that is not running yet (a pod it cannot create, a template
        setting it overrides) go to the log once each.
        """
        name, uid = job["metadata"]["name"], job["metadata"].get("uid")
        found = self._call("list", "events", core.list_namespaced_event, self._ns(),
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

    def _problem_clock(self) -> ProblemClock:
        return ProblemClock(self.pod_problem_grace_s, self.scheduling_grace_s, {})

    def _check_pods(self, core: kubernetes.client.CoreV1Api, selector: str, clock: ProblemClock,
                    log: LogSink, stopping: str, exited_workers: bool = False) -> None:
        """Report a stage's pods that cannot run once each; fail the stage when one stays so past its grace."""
        pods = [core.api_client.sanitize_for_serialization(pod) for pod in
                self._call("list", "pods", core.list_namespaced_pod, self._ns(), label_selector=selector).items]
        problems = pod_problems(pods, [], exited_workers)
        events: list[dict] = []
        if any(problem.reason == "Unschedulable" for problem in problems):  # is an autoscaler adding a node?
            events += self._pod_events(core, "involvedObject.kind=Pod,reason=TriggeredScaleUp")
        if creating(pods):  # a volume that does not mount? (the pod only says ContainerCreating)
            failed = self._pod_events(core, "involvedObject.kind=Pod,reason=FailedMount")
            for name in sorted({e["involvedObject"]["name"] for e in failed}):  # did its mounts succeed since?
                events += self._pod_events(core, f"involvedObject.kind=Pod,involvedObject.name={name}")
        if events:
            problems = pod_problems(pods, events, exited_workers)
        self._act_on(problems, clock, log, stopping)

    def _pod_events(self, core: kubernetes.client.CoreV1Api, selector: str) -> list[dict]:
        return [core.api_client.sanitize_for_serialization(e) for e in
                self._call("list", "events", core.list_namespaced_event, self._ns(), field_selector=selector).items]

    def _act_on(self, problems: list[PodProblem], clock: ProblemClock, log: LogSink, stopping: str | None) -> None:
        """Say each new problem once; raise for those past their grace period (resumable ones as an
        interruption), naming what was stopped."""
        queued = self.runai_project is not None  # Run:ai's queue decides when a pod is scheduled
        new, late = clock.overdue(problems, time.monotonic())
        for problem in new:
            if queued and problem.patient:
                log(f"laneflow: {problem.describe()}; waiting for the Run:ai queue of project {self.runai_project}")
                continue
            log(f"laneflow: {problem.describe()}"
                + ("; a cluster autoscaler is adding a node for it" if problem.scaling_up else "")
                + f"; the stage fails if it lasts {clock.grace_for(problem):.0f} s")
        late = [problem for problem in late if not (queued and problem.patient)]
        if not late:
            return
        message = f"in namespace {self._ns()}: " + "; ".join(p.describe() for p in late) + \
            (f" ({stopping})" if stopping else "")
        if all(problem.resumable for problem in late):
            raise TrainingInterrupted(message)
        raise StageBlocked(message)

    def _pod_reasons(self, core: kubernetes.client.CoreV1Api, name: str) -> str:
        pods = self._call("list", "pods", core.list_namespaced_pod, self._ns(),
                          label_selector=f"training.kubeflow.org/job-name={name}").items
        reasons = []
        for pod in pods:
            for status in (pod.status.container_statuses or []) if pod.status else []:
                terminated = status.state.terminated if status.state else None
                if terminated and terminated.exit_code:
                    reasons.append(f"{pod.metadata.name} {terminated.reason} (exit {terminated.exit_code})")
        return ", ".join(reasons)

    def cancel_training(self, job_name: str, volume: VolumeRef) -> bool:
        _, _, custom = self._apis()
        group, version, plural = MPI
        try:
            self._call("delete", "mpijobs", custom.delete_namespaced_custom_object, group, version, self._ns(),
                       plural, job_name, propagation_policy="Foreground")
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _gpu_job(self, name: str, volume: VolumeRef, run: str, labels: dict[str, str], args: list[str],
                 event: str, log: LogSink, timeout_s: float = 6 * 3600) -> dict[str, Any]:
        """``python -m <args>`` as a Job in the training image on one GPU, the claim at /data; its event."""
        name = validate_name(name[:63].rstrip("-"), "job")
        body = render_data_job(name, self.layout(), volume.name, [], self._job_labels(run, labels))
        container = body["spec"]["template"]["spec"]["containers"][0]
        container["image"] = self.image
        container["command"] = ["python", "-m", *args]
        container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        lines = self._run_job(body, log, timeout_s=timeout_s, delete_after=True)
        result = _last_event(lines, event, f"job {name}")
        result.pop("event", None)
        return result

    def evaluate(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, log: LogSink) -> dict[str, Any]:
        run = run_dir.rstrip("/").rsplit("/", 1)[-1]
        return self._gpu_job(f"eval-{run}-{split}", volume, run, {"split": split},
                             ["training.evaluate", "--run-dir", f"{MOUNT_PATH}/{run_dir}",
                              "--data-root", f"{MOUNT_PATH}/{data_dir}", "--split", split], "eval", log)

    def package_model(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, lineage: dict[str, Any],
                      log: LogSink) -> dict[str, Any]:
        run = run_dir.rstrip("/").rsplit("/", 1)[-1]
        summary = self._gpu_job(f"package-{run}", volume, run, {"step": "package"},
                                ["training.package", "--run-dir", f"{MOUNT_PATH}/{run_dir}", "--data-root",
                                 f"{MOUNT_PATH}/{data_dir}", "--split", split, "--lineage", json.dumps(lineage)],
                                "packaged", log)
        return paths_in(run_dir, summary, ("package", "archive"))

    def predict(self, volume: VolumeRef, package: str, inputs: str, out_dir: str, backend: str,
                log: LogSink) -> dict[str, Any]:
        for path in (package, inputs, out_dir):
            _stays_on(volume, path)
        digest = hashlib.sha256(f"{package}|{inputs}|{out_dir}".encode()).hexdigest()[:8]
        summary = self._gpu_job(f"predict-{digest}-{uuid.uuid4().hex[:8]}", volume, f"predict-{digest}",
                                {"step": "predict"},
                                ["training.predict", "--package", f"{MOUNT_PATH}/{package}", "--input",
                                 f"{MOUNT_PATH}/{inputs}", "--out", f"{MOUNT_PATH}/{out_dir}", "--backend", backend],
                                "predicted", log)
        return paths_in(out_dir, summary, ("predictions", "overlay"))

    # --- snapshots -----------------------------------------------------------------------------------
    def _anf(self) -> AnfVolume:
        if self.anf is None:
            raise ValueError("snapshotter 'anf' needs the platform's 'anf' volume to be configured")
        return self.anf

    def write_text(self, volume: VolumeRef, relative_path: str, text: str) -> None:
        """A Job in the data image writes it onto the claim (temporary file, then rename)."""
        script = ("import os, sys\n"
                  "os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)\n"
                  "open(sys.argv[1] + '.tmp', 'w').write(sys.argv[2])\n"
                  "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n")
        self._file_job("write", volume, relative_path, script, text)

    def create_snapshot(self, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
                        lineage: dict[str, Any]) -> SnapshotRef:
        if self.snapshotter == "anf":
            # ANF snapshots carry no labels: the lineage goes into the run's record, inside the snapshot.
            # Written before the snapshot, so inside it: what it was made from, never whether it is ready
            # (that is Azure's to say: list_snapshots and find_lineage read it from the snapshot).
            record = {**lineage, "snapshot": name, "data_dir": data_dir, "run_dir": run_dir, "volume": volume.name,
                      "snapshotter": "anf"}
            self.write_text(volume, f"{run_dir}/lineage.json", json.dumps(record, sort_keys=True))
            snapshot_id = self._anf().create_snapshot(name)  # awaits Azure's long-running operation
            return SnapshotRef(name=name, volume=volume.name, ready=True, location=snapshot_id,
                               lineage={**record, "ready": True})
        _, _, custom = self._apis()
        group, version, plural = SNAPSHOTS
        labels = self._job_labels(lineage.get("run", name), {
            "flow-run": str(lineage.get("flow_run_id", "")), "dataset-version": str(lineage.get("dataset_version")),
            "code-version": str(lineage.get("code_version"))})
        record = {**lineage, "data_dir": data_dir, "run_dir": run_dir, "volume": volume.name}
        body = render_snapshot(name, self.layout(), volume.name, labels,
                               {LINEAGE_ANNOTATION: json.dumps(record, sort_keys=True)})
        snapshot, _ = self._create_or_adopt(
            "volumesnapshots",
            lambda: custom.create_namespaced_custom_object(group, version, self._ns(), plural, body,
                                                           field_validation=STRICT),
            lambda: custom.get_namespaced_custom_object(group, version, self._ns(), plural, name),
            lambda found: found["metadata"].get("labels", {}).get("laneflow.io/run") == labels["laneflow.io/run"],
            name)
        return _snapshot_ref(snapshot)

    def wait_for_snapshot(self, snapshot: SnapshotRef, timeout_s: float) -> SnapshotRef:
        """Until ``readyToUse``. ``status.error`` is only the last error the snapshot controller saw: it
        retries and clears it on success (external-snapshotter's VolumeSnapshot CRD), so an error fails
        the wait only when it is still there at the timeout."""
        if self.snapshotter == "anf":  # create_snapshot awaited the long-running operation already
            return snapshot
        _, _, custom = self._apis()
        group, version, plural = SNAPSHOTS
        deadline = time.monotonic() + timeout_s
        while True:
            found = self._call("get", "volumesnapshots", custom.get_namespaced_custom_object, group, version,
                               self._ns(), plural, snapshot.name)
            status = found.get("status") or {}
            if status.get("readyToUse"):
                return _snapshot_ref(found)
            if time.monotonic() > deadline:
                error = (status.get("error") or {}).get("message")
                if error:
                    raise RuntimeError(f"VolumeSnapshot {snapshot.name} failed: the snapshot controller still "
                                       f"reports '{error}' after {timeout_s:.0f} s")
                raise StageDeadlineExceeded(f"VolumeSnapshot {snapshot.name} not ready within {timeout_s:.0f} s")
            time.sleep(self.poll_interval_s)

    def list_snapshots(self) -> list[SnapshotRef]:
        if self.snapshotter == "anf":
            return self._anf_snapshots()
        _, _, custom = self._apis()
        group, version, plural = SNAPSHOTS
        found = self._call("list", "volumesnapshots", custom.list_namespaced_custom_object, group, version,
                           self._ns(), plural, label_selector="app.kubernetes.io/managed-by=laneflow")
        refs = [_snapshot_ref(item) for item in found.get("items", [])]
        return sorted(refs, key=lambda ref: ref.lineage.get("created_at", "") or "")

    def restore_snapshot(self, snapshot_name: str, volume_name: str) -> VolumeRef:
        core, _, _ = self._apis()
        validate_name(snapshot_name, "snapshot")
        validate_name(volume_name, "volume")
        if self.snapshotter == "anf":
            raise ValueError(f"'{snapshot_name}' is an ANF snapshot: create a volume from it in Azure (or revert the "
                             "volume) and adopt that volume; laneflow restores CSI VolumeSnapshots only")
        snapshot = self._read_snapshot(snapshot_name)  # KeyError naming it when it does not exist
        restore_size = (snapshot.get("status") or {}).get("restoreSize")
        if restore_size is None:
            raise RuntimeError(f"VolumeSnapshot {self._ns()}/{snapshot_name} is not ready to use yet (no restoreSize):"
                               " wait until its readyToUse is true, then restore again")
        # The CSI provisioner refuses a claim smaller than the snapshot: a volume grown after the block's
        # volume_size was set is restored at its own size.
        size = larger_size(self.volume_size, str(restore_size))
        body = render_pvc(volume_name, dataclasses.replace(self.layout(), volume_size=size), {**MANAGED_BY},
                          from_snapshot=snapshot_name)

        def restored_from_it(claim: Any) -> bool:
            source = claim.spec.data_source
            return bool(source and source.kind == "VolumeSnapshot" and source.name == snapshot_name)

        _, created = self._create_or_adopt(
            "persistentvolumeclaims",
            lambda: core.create_namespaced_persistent_volume_claim(self._ns(), body, field_validation=STRICT),
            lambda: core.read_namespaced_persistent_volume_claim(volume_name, self._ns()), restored_from_it,
            volume_name)
        return VolumeRef(name=volume_name, location=f"{self._ns()}/{volume_name}", created=created)

    def find_lineage(self, name: str) -> dict[str, Any]:
        if self.snapshotter == "anf":
            found = self._anf_snapshots(only=name)
            if not found:
                raise KeyError(f"no ANF snapshot named '{name}' of volume '{self._anf().volume}'")
            return found[0].lineage
        return _snapshot_ref(self._read_snapshot(name)).lineage

    def _anf_snapshots(self, only: str | None = None) -> list[SnapshotRef]:
        """ANF snapshots with their lineage: readiness and time from Azure, the record from each run's
        ``lineage.json`` on the volume (ANF snapshots carry no labels), all read by one Job."""
        snapshots = [s for s in self._anf().list_snapshots() if only is None or s.name == only]
        by_volume: dict[str, list[tuple[Any, str]]] = {}
        for snapshot in snapshots:
            match = _ANF_SNAPSHOT_NAME.match(snapshot.name)
            if match:  # laneflow's own snapshots: <volume>-<run>
                by_volume.setdefault(match["volume"], []).append((snapshot, match["run"]))
        refs = []
        for volume_name, items in by_volume.items():
            volume = VolumeRef(name=volume_name, location=f"{self._ns()}/{volume_name}")
            records = self._read_lineages(volume, [run for _, run in items])
            for snapshot, run in items:
                lineage = {**records.get(run, {}), "snapshot": snapshot.name, "ready": snapshot.ready,
                           "created_at": snapshot.created}
                refs.append(SnapshotRef(name=snapshot.name, volume=volume_name, ready=snapshot.ready,
                                        location=snapshot.id, lineage=lineage))
        return sorted(refs, key=lambda ref: ref.lineage.get("created_at") or "")

    def _read_lineages(self, volume: VolumeRef, runs: list[str]) -> dict[str, dict[str, Any]]:
        """``runs/<run>/lineage.json`` of each run that has one, by run, in one throwaway Job."""
        script = ("import json, pathlib, sys\n"
                  "root = pathlib.Path(sys.argv[1])\n"
                  "found = {run: json.loads((root / run / 'lineage.json').read_text()) for run in sys.argv[2:]\n"
                  "         if (root / run / 'lineage.json').is_file()}\n"
                  "print(json.dumps({'event': 'lineages', 'records': found}))\n")
        lines = self._file_job("lineage", volume, "runs", script, *runs)
        return _last_event(lines, "lineages", f"lineage reader of volume {volume.name}")["records"]

    def _read_snapshot(self, name: str) -> dict[str, Any]:
        _, _, custom = self._apis()
        group, version, plural = SNAPSHOTS
        try:
            return self._call("get", "volumesnapshots", custom.get_namespaced_custom_object, group, version,
                              self._ns(), plural, name)
        except ApiException as exc:
            if exc.status == 404:
                raise KeyError(f"no VolumeSnapshot named '{name}' in namespace '{self._ns()}'") from None
            raise

    # --- service level -------------------------------------------------------------------------------
    def current_service_level(self, volume: VolumeRef) -> str | None:
        return self.anf.current_level() if self.anf else None

    def change_service_level(self, volume: VolumeRef, level: str) -> bool:
        return self.anf.change_level(level) if self.anf else False

    def service_level_limits(self, volume: VolumeRef) -> tuple[float, str] | None:
        return (self.anf.locate()[2], self.anf.ceiling) if self.anf else None

    def service_level_command(self, volume: VolumeRef, level: str) -> str | None:
        return self.anf.pool_change_command(level) if self.anf else None


# --- helpers ----------------------------------------------------------------------------------------

class NamespaceNotFound(LookupError):
    """The block's namespace does not exist (the NamespaceLifecycle admission plugin's 404 on create)."""


def _status_of(exc: ApiException) -> dict[str, Any]:
    """The API server's Status body of an error, or {} when the body is not one."""
    try:
        status = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _missing_namespace(exc: ApiException) -> str | None:
    """The namespace a 404 says does not exist (``namespaces "x" not found``), or None for any other 404."""
    details = _status_of(exc).get("details") or {}
    if details.get("kind") == "namespaces" and details.get("name"):
        return str(details["name"])
    return None


def _stays_on(volume: VolumeRef, relative_path: str) -> None:
    if relative_path.startswith("/") or ".." in relative_path.split("/"):
        raise ValueError(f"path '{relative_path}' leaves volume '{volume.name}'")


def _message(exc: ApiException) -> str:
    return str(_status_of(exc).get("message", exc.reason))


def _retry_after(exc: ApiException) -> float | None:
    value = (exc.headers or {}).get("Retry-After") if exc.headers else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _stream_lines(response: Any) -> Iterator[str]:
    """Complete lines of a streamed HTTP response; a line cut off by the end of the stream is kept."""
    pending = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


def _last_event(lines: list[str], kind: str, what: str) -> dict[str, Any]:
    for line in reversed(lines):
        event = parse_output_line(line).event
        if event and event.get("event") == kind:
            return dict(event)
    tail = "\n".join(lines[-LOG_TAIL:])
    raise RuntimeError(f"{what} finished without reporting '{kind}'; its log ends:\n{tail}")


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


def _snapshot_ref(snapshot: dict) -> SnapshotRef:
    metadata = snapshot["metadata"]
    lineage = json.loads((metadata.get("annotations") or {}).get(LINEAGE_ANNOTATION, "{}"))
    lineage.setdefault("created_at", metadata.get("creationTimestamp"))
    ready = bool((snapshot.get("status") or {}).get("readyToUse"))
    lineage["ready"] = ready
    return SnapshotRef(name=metadata["name"], volume=snapshot["spec"]["source"].get("persistentVolumeClaimName", ""),
                       ready=ready, location=f"{metadata.get('namespace')}/{metadata['name']}", lineage=lineage)
