"""Kubernetes objects the cluster platform creates, rendered by pure functions (DESIGN §6).

Each function returns a plain dict, exactly what is sent to the API server, so the objects can be
reviewed as golden files and compared in tests. Names are validated (DNS-1123) before anything is
rendered; every object carries ``app.kubernetes.io/managed-by: laneflow`` and the flow run's labels.
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass, field
from typing import Any

from tasks.k8s.scheduling import WorkerScheduling
from tasks.launch import HOROVODRUN_MODULE, ElasticLaunch, elastic_horovodrun_args, prepare_args, trainer_args
from tasks.names import validate_mpijob_name, validate_name
from training.data.sources import SOURCES_ENV, Artifact, sources_json

MANAGED_BY = {"app.kubernetes.io/managed-by": "laneflow"}
MOUNT_PATH = "/data"
MPI_HOSTFILE = "/etc/mpi/hostfile"
#: The MPI operator's script of the job's Running workers, in the same ConfigMap (v2beta1
#: ``updateDiscoverHostsInConfigMap``): one ``echo <worker>.<job>.<ns>.svc`` per worker, no slot counts.
MPI_DISCOVER_HOSTS = "/etc/mpi/discover_hosts.sh"
#: What horovodrun polls instead: the operator's list less the workers it cannot reach yet (Running is not Ready:
#: a worker's name resolves once it is Ready, and horovodrun told of it earlier loses the whole job;
#: training/reachable_hosts.py). horovodrun runs the script through a shell (horovod ``safe_shell_exec``).
REACHABLE_HOSTS = f"python -m training.reachable_hosts {MPI_DISCOVER_HOSTS}"
#: The network interface of a pod (the CNI's): elastic horovodrun is told it, so it needs no second host to
#: find a common one at start (horovod ``runner/gloo_run.py`` ``_get_min_start_hosts``).
POD_INTERFACE = "eth0"
RUNAI_SCHEDULER = "runai-scheduler"
#: Run:ai selects the project (its queue) by this label; ``project`` is the key older versions read.
RUNAI_QUEUE_LABEL = "runai/queue"
RUNAI_LEGACY_PROJECT_LABEL = "project"
SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
LABEL_VALUE_MAX = 63


@dataclass(frozen=True)
class ClusterLayout:
    """Where and how training runs on the cluster (the cluster platform block's fields, minus credentials)."""

    namespace: str
    image: str
    data_image: str
    storage_class: str
    snapshot_class: str
    volume_size: str = "100Gi"
    gpus_per_worker: int = 1
    shm_size: str = "8Gi"
    service_account: str = "laneflow-training"
    runai_project: str | None = None
    extra_labels: dict[str, str] = field(default_factory=dict)
    #: Where the workers (the pods that need a GPU node) may run and what they reserve.
    scheduling: WorkerScheduling = field(default_factory=WorkerScheduling)
    #: The MPI pods' terminationGracePeriodSeconds: from the kubelet's SIGTERM to its SIGKILL, the time the
    #: ranks have to reach their next stop check and write a checkpoint.
    termination_grace_s: int = 120
    #: How long a finished Job or MPIJob is kept (its logs, its pods' ends) before it is removed.
    finished_ttl_s: int = 86400
    #: Elastic runs: how long a failed worker host is left out before horovodrun tries it again (the shortest
    #: time, doubled with each failure, and the longest), and how long it waits for enough workers.
    elastic_cooldown_s: tuple[int, int] = (30, 600)
    elastic_timeout_s: int = 600

    def effective_namespace(self) -> str:
        """Run:ai schedules only in ``runai-<project>``."""
        return f"runai-{self.runai_project}" if self.runai_project else self.namespace


def label_value(value: str) -> str:
    """A label value: at most 63 characters of ``[A-Za-z0-9._-]``, starting and ending alphanumeric."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in value)[:LABEL_VALUE_MAX]
    return cleaned.strip("._-")


def object_labels(layout: ClusterLayout, run: str, labels: dict[str, str]) -> dict[str, str]:
    """Labels every object of a run carries: ours, the run's lineage labels, and the Run:ai project."""
    merged = {**MANAGED_BY, "laneflow.io/run": label_value(run), **layout.extra_labels}
    merged.update({f"laneflow.io/{key}": label_value(value) for key, value in labels.items()})
    if layout.runai_project:
        merged[RUNAI_QUEUE_LABEL] = layout.runai_project
        merged[RUNAI_LEGACY_PROJECT_LABEL] = layout.runai_project
    return merged


def another_owner(obj: dict, owner: str | None) -> str | None:
    """The flow run that made ``obj`` (its ``laneflow.io/flow-run`` label) when that is not ``owner``; None when it is
    ``owner``'s, or there is nobody to compare."""
    made_by = (obj["metadata"].get("labels") or {}).get("laneflow.io/flow-run")
    return made_by if owner is not None and made_by and made_by != label_value(owner) else None


def render_pvc(name: str, layout: ClusterLayout, labels: dict[str, str], from_snapshot: str | None = None) -> dict:
    """A ReadWriteMany claim; restored from a VolumeSnapshot when ``from_snapshot`` is given."""
    validate_name(name, "volume")
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "storageClassName": layout.storage_class,
                            "resources": {"requests": {"storage": layout.volume_size}}}
    if from_snapshot:
        spec["dataSource"] = {"apiGroup": SNAPSHOT_GROUP, "kind": "VolumeSnapshot",
                              "name": validate_name(from_snapshot, "snapshot")}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": layout.effective_namespace(), "labels": labels},
            "spec": spec}


def _volume_mounts(claim: str, shm_size: str | None) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    mounts = [{"name": "data", "mountPath": MOUNT_PATH}]
    if shm_size:  # NCCL and DataLoader workers share tensors through /dev/shm; the default 64 MiB is too small
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


#: Every pod laneflow makes: no service-account token (nothing in a data, scoring or training pod calls the API;
#: only the flow's own pod does, and the Prefect worker makes that one) and the runtime's default seccomp profile.
POD_SECURITY: dict[str, Any] = {"automountServiceAccountToken": False,
                                "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}
#: The user every laneflow process runs as: the images' ``laneflow`` (uid 1000), with group 0 as its primary group
#: (not root's privileges: a group). A new ANF volume's root directory is ``0770`` root:root (Azure NetApp Files,
#: "Configure Unix permissions": the default), and fsGroup is not applied to NFS volumes, so group 0 is what lets
#: a non-root pod write there. The MPI workers' ranks run as this user too: sshd logs the launcher in as it.
LANEFLOW_UID = 1000
LANEFLOW_HOME = "/home/laneflow"
#: A container that needs no privilege (the dataset stage, scoring, packaging, the MPI launcher's ssh client and
#: mpirun): laneflow's user, never root (the kubelet refuses to start it as root), no escalation, no capabilities.
UNPRIVILEGED: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": LANEFLOW_UID, "runAsGroup": 0,
                                "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
#: The MPI workers run sshd as root (it switches to the logged-in user, laneflow, for the ranks): the runtime's
#: default capabilities, no escalation through setuid programs.
SSHD: dict[str, Any] = {"runAsUser": 0, "allowPrivilegeEscalation": False}


def _pod_spec(layout: ClusterLayout, container: dict, volumes: list[dict], restart: str | None = None) -> dict:
    container = {**container, "securityContext": copy.deepcopy(container.get("securityContext", UNPRIVILEGED))}
    spec: dict[str, Any] = {"serviceAccountName": layout.service_account, "containers": [container],
                            "volumes": volumes, **copy.deepcopy(POD_SECURITY)}
    if restart:
        spec["restartPolicy"] = restart
    if layout.runai_project:
        spec["schedulerName"] = RUNAI_SCHEDULER
    return spec


def render_claim_job(name: str, layout: ClusterLayout, claim: str, command: list[str], labels: dict[str, str],
                     env: list[dict] | None = None) -> dict:
    """A batch Job running ``command`` once in the data image with the claim at /data: the dataset stage, a file
    read or write, and (in the training image, on GPUs) evaluation, packaging and prediction."""
    validate_name(name, "job")
    volumes, mounts = _volume_mounts(claim, None)
    container: dict[str, Any] = {"name": "prepare", "image": layout.data_image, "command": command,
                                 "volumeMounts": mounts}
    if env:
        container["env"] = env
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": layout.effective_namespace(), "labels": labels},
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": layout.finished_ttl_s,
                     "template": {"metadata": {"labels": labels},
                                  "spec": _pod_spec(layout, container, volumes, restart="Never")}}}


#: The key of a sources Secret (``render_sources_secret``) that holds the artifacts.
SOURCES_KEY = "sources"


#: How long a pull probe (``render_pull_probe``) may run before the Job controller stops it: a multi-GB image over a
#: slow link still gets there, a stuck probe does not stay.
PULL_PROBE_DEADLINE_S = 900


def render_pull_probe(name: str, layout: ClusterLayout, image: str, labels: dict[str, str]) -> dict:
    """A Job whose one pod only starts ``image`` (``true``, as laneflow's user): the kubelet pulls it with the nodes'
    own registry credentials, as for a run's pods. No GPU, no claim, no service-account token, so it lands on the
    system pool and can touch nothing; ``laneflow doctor --pull-images`` reads its pod's state and deletes it."""
    validate_name(name, "job")
    container = {"name": "pull", "image": image, "command": ["true"]}
    spec = _pod_spec(layout, container, [], restart="Never")
    spec["automountServiceAccountToken"] = False
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": layout.effective_namespace(), "labels": labels},
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": 60, "activeDeadlineSeconds": PULL_PROBE_DEADLINE_S,
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}


def sources_secret_name(job: str) -> str:
    """The Secret a dataset Job reads its artifacts from: named after the Job, so a retry finds its own."""
    return f"{validate_name(job, 'job')}-sources"


def render_sources_secret(job: str, layout: ClusterLayout, artifacts: list[Artifact],
                          labels: dict[str, str]) -> dict:
    """The dataset's artifacts for the Job ``job``, kept out of its pod spec: a URL may carry a credential (an
    Azure SAS, a presigned signature), and a pod spec is readable by anyone who may ``get pods``. Base64 ``data``,
    as the API server returns a Secret (``stringData`` is write-only and merged into it)."""
    encoded = base64.b64encode(sources_json(artifacts).encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": sources_secret_name(job), "namespace": layout.effective_namespace(),
                         "labels": labels},
            "data": {SOURCES_KEY: encoded}}


def render_data_job(name: str, layout: ClusterLayout, claim: str, labels: dict[str, str]) -> dict:
    """The dataset stage as a Job: the same prepare code as the local platform on the claim; the artifacts come
    from the Secret ``sources_secret_name(name)`` into its environment, never its command."""
    env = [{"name": SOURCES_ENV,
            "valueFrom": {"secretKeyRef": {"name": sources_secret_name(name), "key": SOURCES_KEY}}}]
    return render_claim_job(name, layout, claim, ["python", *prepare_args(MOUNT_PATH)], labels, env=env)


#: The MPIJob's ``runPolicy.backoffLimit``, which the operator gives its launcher Job (mpi_job_controller.go
#: ``newLauncherJob``; no podFailurePolicy): how many launcher pods the Job controller replaces in one MPIJob. A
#: launcher removed from outside (a drain or scale-down of its node, an eviction) has its ranks checkpoint; its
#: replacement runs horovodrun again on the same workers, which resumes there, so routine maintenance of the
#: system pool costs no pods, no GPUs and no new MPIJob. A launcher that ends on its own (training failed) is
#: seen by laneflow within the Job controller's first back-off (10 s), and its launcher Job told to replace no
#: more (tasks/platforms/cluster/training.py stop_launcher_replacements): replacements are for removals, not for
#: retrying a failure.
LAUNCHER_REPLACEMENTS = 3
#: Each MPI worker's command, a console script of the training image (training.mpi_entry.worker_main): the
#: worker's own host key, then sshd under a PID 1 that passes the kubelet's SIGTERM on to the ranks.
WORKER_COMMAND = "laneflow-sshd"
#: Before the launcher's horovodrun (training.mpi_entry.launcher_main): PID 1 that turns the kubelet's SIGTERM
#: into SIGUSR1 to mpirun, which forwards it to every rank.
LAUNCHER_ENTRY = ["laneflow-launcher"]
#: The launcher's horovodrun: how Horovod was built is answered from the training image's record (its build
#: records it), not by importing torch in a forked process at every launch, seconds before any rank runs.
HOROVODRUN = ["python", *HOROVODRUN_MODULE]


def render_mpijob(name: str, layout: ClusterLayout, claim: str, preset: str, workers: int, data_dir: str,
                  run_dir: str, settings: dict[str, str], labels: dict[str, str],
                  elastic: tuple[int, int] | None = None) -> dict:
    """The Horovod MPIJob (kubeflow.org/v2beta1): a launcher running horovodrun, GPU workers, the claim mounted.

    Two settings differ from the operator's defaults (kubeflow/mpi-operator
    ``pkg/apis/kubeflow/v2beta1/default.go`` and ``pkg/controller/mpi_job_controller.go``):
    - the Launcher replica's ``restartPolicy: Never``: the default ``OnFailure`` restarts horovodrun in
      place and, at the backoff limit, the Job controller deletes the pod with the log that says why
      training failed. It is set on the replica spec, which the operator copies into the pod (a
      restartPolicy in the pod template is overridden, with a Warning event);
    - ``launcherCreationPolicy: WaitForWorkersReady``: the default ``AtStartup`` starts horovodrun while
      workers may still be pulling a multi-GB image, and its SSH attempts fail the job.
    Both pods run under ``training.mpi_entry`` as PID 1, with the block's grace period, so that a pod told to
    stop (drain, eviction, node shutdown) has its ranks checkpoint first.

    ``elastic`` (min_workers, max_workers): elastic Horovod over the operator's ``discover_hosts.sh``, with a
    worker replica for each of ``max_workers`` (the ones that cannot be scheduled yet join when they can) and
    ``launcherCreationPolicy: AtStartup`` — waiting for every worker to be Ready would wait for all of them,
    and horovodrun itself waits for ``workers`` of them. Its gang is the launcher and ``min_workers``' pods
    (``runPolicy.schedulingPolicy.minAvailable``): a gang scheduler otherwise waits for every replica at once.
    Run:ai's (NVIDIA KAI-Scheduler) reads it as the PodGroup's minMember, else it sums every replica
    (``pkg/podgrouper/podgrouper/plugins/kubeflow/distributed_common.go``), and reclaims pods beyond it one by
    one (``plugins/proportion``); the MPI operator's own gang scheduling reads it too.
    """
    gpus = layout.gpus_per_worker
    for count, what in ((workers, "workers"), *(zip(elastic, ("elastic.min_workers", "elastic.max_workers"),
                                                     strict=True) if elastic else ())):
        if count % gpus:
            raise ValueError(f"{what}={count} is not a multiple of gpus_per_worker={gpus}")
    replicas = (elastic[1] if elastic else workers) // gpus
    validate_mpijob_name(name, replicas)
    trainer = ["python", *trainer_args(preset, settings, f"{MOUNT_PATH}/{data_dir}", f"{MOUNT_PATH}/{run_dir}")]
    if elastic:
        launch = ElasticLaunch(REACHABLE_HOSTS, gpus, layout.elastic_cooldown_s, layout.elastic_timeout_s,
                               POD_INTERFACE)
        command = [*LAUNCHER_ENTRY, *HOROVODRUN, *elastic_horovodrun_args(workers, *elastic, launch), *trainer]
    else:
        command = [*LAUNCHER_ENTRY, *HOROVODRUN, "-np", str(workers), "--hostfile", MPI_HOSTFILE, *trainer]
    volumes, mounts = _volume_mounts(claim, layout.shm_size)
    launcher = {"name": "launcher", "image": layout.image, "command": command,
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}}}
    # Not the operator's default `/usr/sbin/sshd -De`: the image keeps no host keys (every worker of every job
    # would share them), and laneflow-sshd makes the worker's own; and sshd as PID 1 would take the ranks with it
    # on the kubelet's SIGTERM, unsaved.
    worker = {"name": "worker", "image": layout.image, "command": [WORKER_COMMAND], "volumeMounts": mounts,
              "resources": layout.scheduling.resources(layout.gpus_per_worker), "securityContext": SSHD}
    scheduling = layout.scheduling.pod_fields()  # tolerations, nodeSelector, affinity, priority: the workers'
    launcher_priority = {key: value for key, value in scheduling.items() if key == "priorityClassName"}
    grace = {"terminationGracePeriodSeconds": layout.termination_grace_s}
    role_labels = {role: {**labels, "training.kubeflow.org/job-role": role} for role in ("launcher", "worker")}
    return {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": name, "namespace": layout.effective_namespace(), "labels": labels},
        "spec": {
            "slotsPerWorker": layout.gpus_per_worker,
            # The operator gives ttlSecondsAfterFinished to the launcher Job only (mpi_job_controller.go
            # newLauncherJob); the MPIJob itself, its ssh Secret and its ConfigMap stay until laneflow removes
            # them (training.remove_expired).
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": LAUNCHER_REPLACEMENTS,
                          "ttlSecondsAfterFinished": layout.finished_ttl_s,
                          **({"schedulingPolicy": {"minAvailable": 1 + elastic[0] // gpus}} if elastic else {})},
            "mpiImplementation": "OpenMPI",
            # The key pair where laneflow's user finds it: the launcher's ssh runs as that user, and each
            # worker's sshd reads the user's authorized_keys there (the operator mounts the Secret at this path
            # in both, mode 0644 off /root/.ssh: mpi_job_controller.go setupSSHOnPod).
            "sshAuthMountPath": f"{LANEFLOW_HOME}/.ssh",
            "launcherCreationPolicy": "AtStartup" if elastic else "WaitForWorkersReady",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never", "template": {
                    "metadata": {"labels": role_labels["launcher"]},
                    "spec": {**_pod_spec(layout, launcher, []), **launcher_priority, **grace}}},
                "Worker": {"replicas": replicas, "restartPolicy": "Never", "template": {
                    "metadata": {"labels": role_labels["worker"]},
                    "spec": {**_pod_spec(layout, worker, volumes), **scheduling, **grace}}},
            },
        },
    }


#: The label the MPI operator gives the launcher and every worker of an MPIJob (mpi-operator v2
#: ``pkg/controller/mpi_job_controller.go`` ``labelMPIJobName``): what the job's NetworkPolicy selects by.
MPI_JOB_NAME_LABEL = "training.kubeflow.org/job-name"


def render_network_policy(job: dict, labels: dict[str, str]) -> dict:
    """Only the MPIJob's own pods may connect to its pods: the workers' sshd and the ranks' Gloo and MPI ports
    (Horovod's rendezvous is unauthenticated) are closed to every other pod of the cluster. Owned by the MPIJob
    (deleted with it) and named after its uid, so a replaced job never finds its predecessor's policy."""
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    suffix = "".join(ch for ch in uid.lower() if ch.isalnum())[-8:]
    own_pods = {"matchLabels": {MPI_JOB_NAME_LABEL: name}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-{suffix}", "namespace": job["metadata"]["namespace"], "labels": labels,
                         "ownerReferences": [{"apiVersion": job["apiVersion"], "kind": job["kind"], "name": name,
                                              "uid": uid}]},
            "spec": {"podSelector": own_pods, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": own_pods}]}]}}


def render_snapshot(name: str, layout: ClusterLayout, claim: str, labels: dict[str, str],
                    annotations: dict[str, str]) -> dict:
    """A CSI VolumeSnapshot of the claim; lineage too long for labels goes into annotations."""
    validate_name(name, "snapshot")
    return {"apiVersion": f"{SNAPSHOT_GROUP}/v1", "kind": "VolumeSnapshot",
            "metadata": {"name": name, "namespace": layout.effective_namespace(), "labels": labels,
                         "annotations": annotations},
            "spec": {"volumeSnapshotClassName": layout.snapshot_class,
                     "source": {"persistentVolumeClaimName": claim}}}
