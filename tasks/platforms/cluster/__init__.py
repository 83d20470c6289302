"""The cluster platform: a PVC is the volume, Horovod runs as an MPIJob, snapshots are CSI VolumeSnapshots.

Every manual ``kubectl``/``runai`` step of the seed, automated and idempotent: the PVC is created RWX
or adopted (and its bound PV patched to ReadWriteMany when needed, then verified); dataset preparation,
evaluation and file reads run as Jobs on the claim; training is an MPIJob named after the flow run (a
409 adopts it when it is ours and refuses it when it is not); snapshots carry the run's lineage.

API calls retry 429 (honouring Retry-After), 5xx and connection resets themselves; a 403 fails at
once naming the verb and resource the service account lacks.

This module is the Prefect block: its fields, their validation, and the ``Platform`` operations, each
handed to the module of its concern:

- ``api``: the client, the call wrapper with retries, create-or-adopt
- ``volumes``: the PVC and shared (ReadWriteMany) access to it
- ``jobs``: batch Jobs on the claim: dataset preparation, file I/O, evaluate, package, predict
- ``training``: the MPIJob: submit, wait (events, logs, failures), cancel
- ``snapshots``: CSI VolumeSnapshots or ANF snapshots, with lineage; restore
- ``problems`` and ``pod_logs``: what the stages share while they wait (pods that cannot run, log following)

The service level is that of the claim's own ANF volume (``volumes.anf_volume_of`` reads it from the PV; a
``tasks.anf.AnfVolume`` bound to it does the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from prefect_kubernetes.credentials import KubernetesCredentials
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from tasks.anf import AnfVolume
from tasks.k8s.manifests import ClusterLayout, object_labels
from tasks.k8s.quantity import validate_size
from tasks.k8s.scheduling import QualityOfService, WorkerScheduling
from tasks.level_holds import LevelRecord
from tasks.names import validate_name, validate_subdomain
from tasks.platforms.base import (
    EventSink,
    LogSink,
    Platform,
    SnapshotRef,
    TrainingHandle,
    TrainingOutcome,
    TrainingSpec,
    VolumeRef,
    check_cooldown,
)
from tasks.platforms.cluster import gpu_jobs, jobs, snapshots, training, volumes
from tasks.platforms.cluster.api import NamespaceNotFound, _ClientCache
from training.data.sources import Artifact

__all__ = ["ClusterPlatform", "NamespaceNotFound"]


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
    kueue_queue: str | None = Field(None, description="Kueue LocalQueue for every MPIJob and GPU Job: created "
                                    "suspended, they wait for Kueue to admit them (quota, priority, preemption), "
                                    "and the run's log says why while they wait (deployments/kueue)")
    kueue_priority_class: str | None = Field(None, description="Kueue WorkloadPriorityClass of those jobs, e.g. "
                                             "laneflow-nightly (with kueue_queue)")
    poll_interval_s: float = Field(5.0, gt=0, description="how often job state and logs are read")
    pod_problem_grace_s: float = Field(60.0, ge=0, description="how long a stage's pod may stay unable to run (image "
                                       "pull, scheduling, configuration) before the stage fails naming why")
    scheduling_grace_s: float = Field(900.0, ge=0, description="how long a pod may wait for room on the cluster "
                                      "(GPUs busy with other jobs, a node an autoscaler adds, a claim being "
                                      "provisioned) before the stage fails naming what it asked for; with Run:ai "
                                      "its queue decides and this does not apply")
    finished_ttl_s: int = Field(86400, ge=600, le=2**31 - 1, description="how long finished Jobs and MPIJobs (their "
                                "logs, their pods' ends, the MPIJob's ssh key Secret) are kept before they are "
                                "removed; at least 10 minutes, so a run never loses a job it is still reading")
    operator_grace_s: float = Field(120.0, gt=0, description="how long an MPIJob may go without any status from the "
                                    "MPI operator (none installed, or it watches other namespaces), or keep getting "
                                    "its warnings that it cannot create the job's pods, before the stage fails "
                                    "naming why")
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
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="tolerations of the training workers (the pods that need a GPU node), as "
        "in a pod spec: e.g. {\"key\": \"sku\", \"operator\": \"Equal\", \"value\": \"gpu\", \"effect\": "
        "\"NoSchedule\"} for an AKS GPU pool, and key kubernetes.azure.com/scalesetpriority, value spot for a spot "
        "pool")
    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels the training workers "
                                          "require, e.g. {\"agentpool\": \"gpu\"}")
    affinity: dict[str, Any] | None = Field(None, description="affinity of the training workers, as in a pod spec "
                                            "(nodeAffinity, podAffinity, podAntiAffinity)")
    priority_class: str | None = Field(None, description="PriorityClass of the training pods (launcher and workers)")
    worker_cpu: str | None = Field(None, description="CPU each training worker requests, e.g. 8 or 7500m (none: "
                                   "BestEffort, the first evicted under pressure)")
    worker_memory: str | None = Field(None, description="memory each training worker requests, e.g. 32Gi")
    termination_grace_s: int = Field(
        120, ge=1, le=86400, description="seconds a training pod that is told to stop (drain, eviction, spot "
        "removal, node shutdown) has to checkpoint before it is killed: its terminationGracePeriodSeconds. Azure "
        "gives a spot VM 30 s notice, and a node's shutdownGracePeriod caps it on shutdown")
    worker_qos: QualityOfService = Field("burstable", description="burstable: requests only; guaranteed: limits "
                                         "equal to the requests (the last pods evicted; needs worker_cpu and "
                                         "worker_memory)")
    elastic_cooldown_min_s: int = Field(30, ge=1, le=3600, description="elastic runs: the shortest time a worker "
                                        "that failed (its pod gone) is left out before horovodrun tries it again; it "
                                        "doubles with each failure of the same worker, while its replacement waits "
                                        "for a node")
    elastic_cooldown_max_s: int = Field(600, ge=1, le=3600, description="elastic runs: the longest such time")
    elastic_timeout_s: int = Field(600, ge=1, description="elastic runs: how long horovodrun waits for "
                                                          "min_workers workers before the run fails")
    anf: AnfVolume | None = Field(None, description="the Azure NetApp Files account and pools of the claims' volumes, "
                                                    "to change their service level around training (each claim's "
                                                    "own volume is read from its PV)")
    adopt_claims: list[str] = Field(default_factory=list, description="claims made without laneflow (a hand-made "
                                    "ReadWriteOnce claim, as the seed had) that runs may use by name: patched to "
                                    "ReadWriteMany, written, snapshotted. Any other claim laneflow did not create is "
                                    "refused, so a mistyped name never takes over another team's volume")
    _clients: _ClientCache = PrivateAttr(default_factory=lambda: _ClientCache())
    #: Each claim's ANF volume, by its Azure resource id (volumes.anf_volume_of).
    _anf_volumes: dict[str, AnfVolume] = PrivateAttr(default_factory=dict)

    # Checked when the block is made or loaded, not when a stage sends them: a typo found hours late costs
    # the stages before it (the API server would refuse the PVC or the MPIJob only then).
    @field_validator("volume_size", "shm_size")
    @classmethod
    def _sizes_are_quantities(cls, value: str, info: ValidationInfo) -> str:
        return validate_size(value, info.field_name)

    @model_validator(mode="after")
    def _scheduling_is_valid(self) -> ClusterPlatform:
        self.scheduling()  # refuses what the API server would refuse in the MPIJob, naming the field
        check_cooldown(self.elastic_cooldown_min_s, self.elastic_cooldown_max_s)
        return self

    @field_validator("namespace")
    @classmethod
    def _namespace_is_a_label(cls, value: str) -> str:
        return validate_name(value, "namespace")

    @field_validator("storage_class", "snapshot_class", "service_account")
    @classmethod
    def _names_are_subdomains(cls, value: str, info: ValidationInfo) -> str:
        return validate_subdomain(value, info.field_name)

    @model_validator(mode="after")
    def _one_scheduler(self) -> ClusterPlatform:
        if self.kueue_queue and self.runai_project:
            raise ValueError("runai_project and kueue_queue are both set: Run:ai's scheduler and Kueue would each "
                             "decide when a job runs; set one of them")
        if self.kueue_priority_class and not self.kueue_queue:
            raise ValueError("kueue_priority_class is set without kueue_queue: name the LocalQueue the jobs go to")
        for field, value in (("kueue_queue", self.kueue_queue), ("kueue_priority_class", self.kueue_priority_class)):
            if value is not None:
                validate_subdomain(value, field)
                if len(value) > 63:  # it goes into a label of each job, whose values hold 63 characters
                    raise ValueError(f"{field} {value!r} is {len(value)} characters: a label value holds at most 63")
        return self

    @field_validator("runai_project")
    @classmethod
    def _project_makes_a_namespace(cls, value: str | None) -> str | None:
        if value is not None:
            validate_name(f"runai-{value}", "Run:ai project namespace")
        return value

    # --- what the concerns share ----------------------------------------------------------------------
    def layout(self) -> ClusterLayout:
        return ClusterLayout(namespace=self.namespace, image=self.image, data_image=self.data_image,
                             storage_class=self.storage_class, snapshot_class=self.snapshot_class,
                             volume_size=self.volume_size, gpus_per_worker=self.gpus_per_worker,
                             shm_size=self.shm_size, service_account=self.service_account,
                             runai_project=self.runai_project, scheduling=self.scheduling(),
                             termination_grace_s=self.termination_grace_s, finished_ttl_s=self.finished_ttl_s,
                             elastic_cooldown_s=(self.elastic_cooldown_min_s, self.elastic_cooldown_max_s),
                             elastic_timeout_s=self.elastic_timeout_s)

    def scheduling(self) -> WorkerScheduling:
        """Where the training workers may run and what they reserve."""
        return WorkerScheduling(tolerations=self.tolerations, node_selector=self.node_selector,
                                affinity=self.affinity, priority_class=self.priority_class, cpu=self.worker_cpu,
                                memory=self.worker_memory, quality_of_service=self.worker_qos)

    def effective_namespace(self) -> str:
        """Where laneflow's objects live: the block's namespace, or runai-<project> under Run:ai."""
        return self.layout().effective_namespace()

    def job_labels(self, run: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Labels of an object laneflow makes for ``run`` (managed-by, the run, Run:ai's queue)."""
        return object_labels(self.layout(), run, extra or {})

    # --- volume --------------------------------------------------------------------------------------
    def ensure_volume(self, name: str) -> VolumeRef:
        return volumes.ensure_volume(self, name)

    def ensure_shared_access(self, volume: VolumeRef) -> str:
        return volumes.ensure_shared_access(self, volume)

    # --- jobs on the claim ---------------------------------------------------------------------------
    def prepare_dataset(self, volume: VolumeRef, artifacts: list[Artifact], log: LogSink) -> dict[str, Any]:
        return jobs.prepare_dataset(self, volume, artifacts, log)

    def read_file(self, volume: VolumeRef, relative_path: str) -> bytes:
        return jobs.read_file(self, volume, relative_path)

    def write_text(self, volume: VolumeRef, relative_path: str, text: str) -> None:
        jobs.write_text(self, volume, relative_path, text)

    def append_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        jobs.append_file(self, volume, relative_path, data)

    def replace_file(self, volume: VolumeRef, relative_path: str, data: bytes) -> None:
        jobs.replace_file(self, volume, relative_path, data)

    def update_volume_record(self, volume: VolumeRef, key: str,
                             change: Callable[[str | None], str | None]) -> str | None:
        return volumes.update_volume_record(self, volume, key, change)

    def evaluate(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, log: LogSink,
                 out_dir: str | None = None) -> dict[str, Any]:
        return gpu_jobs.evaluate(self, volume, run_dir, data_dir, split, log, out_dir)

    def package_model(self, volume: VolumeRef, run_dir: str, data_dir: str, split: str, lineage: dict[str, Any],
                      log: LogSink) -> dict[str, Any]:
        return gpu_jobs.package_model(self, volume, run_dir, data_dir, split, lineage, log)

    def predict(self, volume: VolumeRef, package: str, inputs: str, out_dir: str, backend: str,
                log: LogSink) -> dict[str, Any]:
        return gpu_jobs.predict(self, volume, package, inputs, out_dir, backend, log)

    def publish_package(self, volume: VolumeRef, package: str, tracking_uri: str, run_id: str, artifact_path: str,
                        env: dict[str, str], log: LogSink) -> dict[str, Any]:
        return gpu_jobs.publish_package(self, volume, package, tracking_uri, run_id, artifact_path, env, log)

    # --- launcher ------------------------------------------------------------------------------------
    def submit_training(self, spec: TrainingSpec) -> TrainingHandle:
        return training.submit(self, spec)

    def wait_for_training(self, handle: TrainingHandle, on_event: EventSink, on_log: LogSink,
                          timeout_s: float) -> TrainingOutcome:
        return training.wait(self, handle, on_event, on_log, timeout_s)

    def cancel_training(self, job_name: str, volume: VolumeRef, owner: str | None = None) -> bool:
        return training.cancel(self, job_name, volume, owner)

    # --- snapshots -----------------------------------------------------------------------------------
    def create_snapshot(self, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
                        lineage: dict[str, Any]) -> SnapshotRef:
        return snapshots.create(self, volume, name, data_dir, run_dir, lineage)

    def wait_for_snapshot(self, snapshot: SnapshotRef, timeout_s: float) -> SnapshotRef:
        return snapshots.wait(self, snapshot, timeout_s)

    def list_snapshots(self) -> list[SnapshotRef]:
        return snapshots.list_all(self)

    def restore_snapshot(self, snapshot_name: str, volume_name: str) -> VolumeRef:
        return snapshots.restore(self, snapshot_name, volume_name)

    def find_lineage(self, name: str) -> dict[str, Any]:
        return snapshots.find_lineage(self, name)

    # --- service level (the claim's own ANF volume, when the block names an ANF account) --------------
    def current_service_level(self, volume: VolumeRef) -> str | None:
        return volumes.anf_volume_of(self, volume).current_level() if self.anf else None

    def change_service_level(self, volume: VolumeRef, level: str) -> bool:
        return volumes.anf_volume_of(self, volume).change_level(level) if self.anf else False

    def service_level_limits(self, volume: VolumeRef) -> tuple[float, str] | None:
        return (volumes.anf_volume_of(self, volume).locate()[2], self.anf.ceiling) if self.anf else None

    def service_level_command(self, volume: VolumeRef, level: str) -> str | None:
        return volumes.anf_volume_of(self, volume).pool_change_command(level) if self.anf else None

    def update_level_record(self, volume: VolumeRef,
                            change: Callable[[LevelRecord | None], LevelRecord | None]) -> LevelRecord | None:
        return volumes.update_level_record(self, volume, change)

    def level_hold_ttl_s(self, volume: VolumeRef) -> float:
        return self.anf.hold_ttl_s if self.anf else super().level_hold_ttl_s(volume)
