"""The MPI operator (kubeflow/mpi-operator v0.8 ``pkg/controller/mpi_job_controller.go``,
``pkg/apis/kubeflow/v2beta1/default.go``, ``pkg/apis/kubeflow/validation/validation.go``): defaults in memory
(launcher ``restartPolicy: OnFailure``), validates in the controller — a refused job gets one Warning event
``ValidationError`` and no condition — creates the Secret ``<job>-ssh`` (a fresh ECDSA P-521 key pair), the
headless Service ``<job>`` (cluster DNS), the ConfigMap ``<job>-config`` (``hostfile``, ``discover_hosts.sh``
of Running workers), worker pods (host name ``<job>-worker-<i>`` in subdomain ``<job>``, ``K_MPI_JOB_ROLE``,
the keys at ``sshAuthMountPath``, ``/usr/sbin/sshd -De`` when the container sets no command) and the launcher
as a batch Job ``<job>-launcher`` (the OpenMPI ``OMPI_MCA_*`` env, the keys, the ConfigMap at ``/etc/mpi``; at
once under ``AtStartup``, after every worker is Ready under ``WaitForWorkersReady``); its conditions follow
the launcher Job (``BackoffLimitExceeded/<pod reason>``, ``DeadlineExceeded``) and evicted workers
(``MPIJobEvicted``); ``runPolicy.suspend`` as ``mpi_suspension.py`` says.

The launcher reaches its workers' real ``sshd`` with the operator's key and runs the real ``mpirun``."""

from __future__ import annotations

import base64
import copy
from typing import TYPE_CHECKING, Any

from tests.cluster.admission import check
from tests.cluster.garbage_collector import delete
from tests.cluster.job_controller import start_job
from tests.cluster.kubelet import crash_loop, set_container_state, start_container
from tests.cluster.mpi_defaults import operator_defaults, operator_validation
from tests.cluster.mpi_suspension import hold_suspended, is_suspended, resume, was_suspended
from tests.cluster.objects import controller_ref, later, now, record_event, stamp_metadata
from tests.cluster.pod_control import make_pod
from tests.cluster.state import OPERATOR

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


_JOB_GROUP_LABELS = ("training.kubeflow.org/operator-name", "training.kubeflow.org/job-name",
                     "training.kubeflow.org/job-role")


def _mpi_condition(job: dict, kind: str, status: str, reason: str, message: str) -> None:
    """``updateMPIJobConditions``: unchanged when equal; else replaced and appended; a terminal condition
    flips Running (and an earlier Failed) to False (mpi_job_controller_status.go)."""
    conditions = job.setdefault("status", {}).setdefault("conditions", [])
    for condition in conditions:
        if condition["type"] == kind and condition["status"] == status and condition.get("reason") == reason:
            return
    if kind in ("Succeeded", "Failed"):
        for condition in conditions:
            if condition["type"] in ("Running", "Failed") and condition["status"] == "True":
                condition["status"] = "False"
    conditions[:] = [c for c in conditions if c["type"] != kind]
    conditions.append({"type": kind, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": now(), "lastUpdateTime": now()})


def start_mpijob(cluster: Cluster, job: dict) -> None:
    if not cluster.mpi_operator_installed:  # the CRD alone: the object is stored, nothing acts on it
        return
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    spec = operator_defaults(job.get("spec") or {})
    job["status"] = {}
    causes = operator_validation(name, spec)
    if causes:
        texts = [c.text() for c in causes]
        aggregate = texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
        record_event(cluster, job, "Warning", "ValidationError", f"Found validation errors: {aggregate}", OPERATOR)
        job.pop("status")
        return
    # syncHandler sets Created in memory and records its event at once; the status is written only at the end of
    # a sync that got there (updateMPIJobStatus): one that fails creating a worker writes none.
    record_event(cluster, job, "Normal", "MPIJobCreated", f"MPIJob {namespace}/{name} is created.", OPERATOR)
    cluster.operator_specs[(namespace, name)] = spec
    replicas = spec["mpiReplicaSpecs"]
    launcher = replicas["Launcher"]
    if (launcher["template"].get("spec") or {}).get("restartPolicy"):
        record_event(cluster, job, "Warning", "SetPodTemplateRestartPolicy",
                     "Restart policy in pod template overridden by restart policy in replica spec", OPERATOR)
    _operator_objects(cluster, job, spec)
    if is_suspended(job):  # created suspended (Kueue's webhook): a suspended launcher Job, no workers
        _mpi_condition(job, "Created", "True", "MPIJobCreated", f"MPIJob {namespace}/{name} is created.")
        _create_launcher(cluster, job, spec)
        sync_mpijob(cluster, job)
        return
    worker = replicas.get("Worker")
    for index in range(worker["replicas"] if worker else 0):
        if not _create_worker(cluster, job, spec, index):
            job.pop("status", None)
            return
    _mpi_condition(job, "Created", "True", "MPIJobCreated", f"MPIJob {namespace}/{name} is created.")
    job["status"]["startTime"] = now()
    if spec["launcherCreationPolicy"] == "AtStartup":
        _create_launcher(cluster, job, spec)
    sync_mpijob(cluster, job)


#: ``sshVolumeItems`` (mpi_job_controller.go v0.8.0 L142-155): the Secret's two keys as the three files
#: ssh expects.
SSH_ITEMS = [{"key": "ssh-privatekey", "path": "id_rsa"}, {"key": "ssh-publickey", "path": "id_rsa.pub"},
             {"key": "ssh-publickey", "path": "authorized_keys"}]


def _hostfile(job: dict, spec: dict) -> str:
    """``newConfigMap`` (L1309-1354) for OpenMPI: ``<job>-worker-<i>.<job>.<ns>.svc slots=<n>`` per worker."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    workers = spec["mpiReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    return "".join(f"{name}-worker-{i}.{name}.{namespace}.svc slots={spec['slotsPerWorker']}\n"
                   for i in range(workers))


def _discover_hosts(job: dict, running: list[str]) -> str:
    """``updateDiscoverHostsInConfigMap`` (L1357-1381): only Running workers, sorted by name."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    return "#!/bin/sh\n" + "".join(f"echo {pod}.{name}.{namespace}.svc\n" for pod in sorted(running))


def _operator_objects(cluster: Cluster, job: dict, spec: dict) -> None:
    """The ConfigMap ``<job>-config`` and the Secret ``<job>-ssh`` (``newSSHAuthSecret`` L1416-1451: a fresh
    ECDSA P-521 key, PEM "EC PRIVATE KEY", public key in authorized_keys format), owned by the job."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    owner = [controller_ref(job)]
    key = ec.generate_private_key(ec.SECP521R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/ssh-auth",
              "metadata": {"name": f"{name}-ssh", "namespace": namespace, "labels": {"app": name},
                           "ownerReferences": owner},
              "data": {"ssh-privatekey": base64.b64encode(private).decode(),
                       "ssh-publickey": base64.b64encode(public + b"\n").decode()}}
    config = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": f"{name}-config", "namespace": namespace, "labels": {"app": name},
                           "ownerReferences": owner},
              "data": {"hostfile": _hostfile(job, spec), "discover_hosts.sh": _discover_hosts(job, [])}}
    # ``newJobService`` (L1410-1438): headless, selecting the job's pods, publishNotReadyAddresses only when the
    # launcher is also a worker; the names the hostfile lists resolve through it (tests/cluster/dns.py) once
    # each worker is Ready. Kept for cluster DNS; the emulated API server does not serve Services.
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}, "ownerReferences": owner},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": bool(spec.get("runLauncherAsWorker")),
                        "selector": {"training.kubeflow.org/operator-name": "mpi-operator",
                                     "training.kubeflow.org/job-name": name}}}
    for resource, obj in (("secrets", secret), ("configmaps", config), ("services", service)):
        stamp_metadata(cluster, obj, namespace)
        cluster.objects[resource][(namespace, obj["metadata"]["name"])] = obj


def _setup_ssh(pod_spec: dict, job_name: str, spec: dict) -> None:
    """``setupSSHOnPod`` (L1764-1787): the key Secret on the first container at ``sshAuthMountPath``; mode
    0600 only at /root/.ssh."""
    secret: dict[str, Any] = {"secretName": f"{job_name}-ssh", "items": SSH_ITEMS}
    if spec["sshAuthMountPath"] == "/root/.ssh":
        secret["defaultMode"] = 0o600
    pod_spec.setdefault("volumes", []).append({"name": "ssh-auth", "secret": secret})
    pod_spec["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "ssh-auth", "mountPath": spec["sshAuthMountPath"]})


def _worker_template(job: dict, spec: dict, index: int) -> dict:
    """``newWorker`` (L1473-1525): host name and subdomain, ``K_MPI_JOB_ROLE=worker``, the replica's
    restartPolicy, ``/usr/sbin/sshd -De`` when the container sets neither command nor args, the ssh keys."""
    name = job["metadata"]["name"]
    worker = spec["mpiReplicaSpecs"]["Worker"]
    template = copy.deepcopy(worker["template"])
    pod_spec = template.setdefault("spec", {})
    pod_spec.update({"hostname": f"{name}-worker-{index}", "subdomain": name,
                     "restartPolicy": "Never" if worker["restartPolicy"] == "ExitCode" else worker["restartPolicy"]})
    container = pod_spec["containers"][0]
    container.setdefault("env", []).append({"name": "K_MPI_JOB_ROLE", "value": "worker"})
    if not container.get("command") and not container.get("args"):
        container["command"] = ["/usr/sbin/sshd", "-De"]
    _setup_ssh(pod_spec, name, spec)
    return template


def _create_worker(cluster: Cluster, job: dict, spec: dict, index: int) -> bool:
    """Worker ``index``'s pod (``newWorker``), started once its image is pulled. When the API server refuses
    it, the operator records ``MPIJobFailed`` "worker pod created failed: <error>" (``getOrCreateWorker``
    L1024-1026) and its work queue syncs the job again after a back-off (shortened here): False then."""
    name = job["metadata"]["name"]
    pod = make_pod(cluster, job, f"{name}-worker-{index}", _worker_template(job, spec, index), {
        "training.kubeflow.org/operator-name": "mpi-operator", "training.kubeflow.org/job-name": name,
        "training.kubeflow.org/job-role": "worker", "training.kubeflow.org/replica-index": str(index)})
    if pod is None:
        later(cluster, cluster.crash_backoff_s, lambda: sync_mpijob(cluster, job))
        return False
    later(cluster, cluster.image_pull_s, lambda: _run_worker(cluster, job, pod))
    return True


def _run_worker(cluster: Cluster, job: dict, pod: dict) -> None:
    if (pod["metadata"]["namespace"], pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    start_container(cluster, pod, lambda state: _worker_exited(cluster, pod, state))
    _sync_owner(cluster, pod)


def _worker_exited(cluster: Cluster, pod: dict, terminated: dict) -> None:
    if (pod["metadata"]["namespace"], pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    code = terminated["exitCode"]
    if code != 0 and pod["spec"].get("restartPolicy", "Always") in ("Always", "OnFailure") and \
            pod["status"].get("phase") != "Failed":
        crash_loop(cluster, pod, terminated, lambda again: _worker_exited(cluster, pod, again))
        _sync_owner(cluster, pod)
        return
    if pod["status"].get("phase") != "Failed":  # an eviction already set it
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
    set_container_state(pod, {"terminated": terminated}, ready=False)
    _sync_owner(cluster, pod)


def _create_launcher(cluster: Cluster, job: dict, spec: dict) -> None:
    """``newLauncherJob``/``newLauncherPodTemplate`` (L1528-1640): a batch Job whose pod gets the replica's
    restartPolicy, host name ``<job>-launcher`` in the job's subdomain, ``K_MPI_JOB_ROLE=launcher``, the
    OpenMPI variables, empty NVIDIA variables (the launcher gets no GPU), the ssh keys and the hostfile
    ConfigMap at /etc/mpi (hostfile 0444, discover_hosts.sh 0555)."""
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]
    template = copy.deepcopy(launcher["template"])
    template.setdefault("metadata", {}).setdefault("labels", {}).update({
        "training.kubeflow.org/operator-name": "mpi-operator", "training.kubeflow.org/job-name": name,
        "training.kubeflow.org/job-role": "launcher"})
    pod_spec = template.setdefault("spec", {})
    pod_spec.update({"restartPolicy": launcher["restartPolicy"], "hostname": f"{name}-launcher", "subdomain": name})
    container = pod_spec["containers"][0]
    container.setdefault("env", []).extend([
        {"name": "K_MPI_JOB_ROLE", "value": "launcher"},
        {"name": "OMPI_MCA_orte_keep_fqdn_hostnames", "value": "true"},
        {"name": "OMPI_MCA_orte_default_hostfile", "value": "/etc/mpi/hostfile"},
        {"name": "OMPI_MCA_plm_rsh_args", "value": "-o ConnectionAttempts=10"},
        {"name": "OMPI_MCA_orte_set_default_slots", "value": str(spec["slotsPerWorker"])},
        {"name": "NVIDIA_VISIBLE_DEVICES"}, {"name": "NVIDIA_DRIVER_CAPABILITIES"}])
    _setup_ssh(pod_spec, name, spec)
    pod_spec.setdefault("volumes", []).append({"name": "mpi-job-config", "configMap": {
        "name": f"{name}-config", "items": [{"key": "hostfile", "path": "hostfile", "mode": 0o444},
                                            {"key": "discover_hosts.sh", "path": "discover_hosts.sh",
                                             "mode": 0o555}]}})
    container.setdefault("volumeMounts", []).append({"name": "mpi-job-config", "mountPath": "/etc/mpi"})
    policy = spec["runPolicy"]
    launcher_spec: dict[str, Any] = {"template": template, "podReplacementPolicy": "Failed"}
    if is_suspended(job):
        launcher_spec["suspend"] = True
    for key in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
        if policy.get(key) is not None:
            launcher_spec[key] = policy[key]
    launcher_job = {"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": f"{name}-launcher", "namespace": namespace, "labels": {"app": name},
                                 "ownerReferences": [controller_ref(job)]},
                    "spec": launcher_spec}
    launcher_job = check(launcher_job, "Strict").obj
    stamp_metadata(cluster, launcher_job, namespace)
    cluster.objects["jobs"][(namespace, launcher_job["metadata"]["name"])] = launcher_job
    start_job(cluster, launcher_job)


def _workers(cluster: Cluster, job: dict) -> list[dict]:
    uid = job["metadata"]["uid"]
    return [p for p in cluster.objects["pods"].values()
            if p["metadata"]["labels"].get("training.kubeflow.org/job-role") == "worker"
            and any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])]


def _launcher_job(cluster: Cluster, job: dict) -> dict | None:
    return cluster.objects["jobs"].get((job["metadata"]["namespace"], f"{job['metadata']['name']}-launcher"))


def sync_mpijob(cluster: Cluster, job: dict) -> None:
    """``syncHandler`` (v0.8.2 L567-760) and ``updateMPIJobStatus`` (L1094-1200): a finished job (one with a
    completionTime) is only cleaned up, never synced again; while the launcher has not finished, every worker
    pod that is gone is created again under its name (``getOrCreateWorker``: a pod still terminating is still
    there, so its replacement waits for it), and the launcher is created once every worker is Ready under
    WaitForWorkersReady."""
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    if cluster.objects["mpijobs"].get((namespace, name)) is not job or (namespace, name) not in cluster.operator_specs:
        return
    # Each sync reads the job as it is now (what Kueue injected into its templates on admission included).
    spec = cluster.operator_specs[(namespace, name)] = operator_defaults(job.get("spec") or {})
    if job["metadata"].get("deletionTimestamp"):  # L603-606: a job being deleted is left alone
        return
    if _finished(job) and job["status"].get("completionTime"):
        _clean_up_workers(cluster, job, spec)
        return
    launcher = _launcher_job(cluster, job)
    if is_suspended(job):
        hold_suspended(cluster, job, _workers(cluster, job), launcher, _mpi_condition)
        _sync_discover_hosts(cluster, job, [])
        return
    if was_suspended(job):
        resume(cluster, job, launcher, spec["mpiReplicaSpecs"]["Launcher"]["template"], _mpi_condition)
    launcher_done = launcher is not None and any(
        c["type"] in ("Complete", "Failed") and c.get("status", "True") == "True"
        for c in (launcher.get("status") or {}).get("conditions") or [])
    if not launcher_done:
        present = {p["metadata"]["labels"].get("training.kubeflow.org/replica-index") for p in _workers(cluster, job)}
        for index in range(spec["mpiReplicaSpecs"].get("Worker", {}).get("replicas", 0)):
            if str(index) not in present and not _create_worker(cluster, job, spec, index):
                return
    if not (job.get("status") or {}).get("conditions"):  # the first sync that got this far writes Created
        _mpi_condition(job, "Created", "True", "MPIJobCreated", f"MPIJob {namespace}/{name} is created.")
        job["status"].setdefault("startTime", now())
    workers = _workers(cluster, job)
    ready = sum(1 for p in workers if any(c.get("type") == "Ready" and c.get("status") == "True"
                                          for c in p["status"].get("conditions") or []))
    if launcher is None and ready == len(workers):
        _create_launcher(cluster, job, spec)
        launcher = _launcher_job(cluster, job)
    launcher_running = 0
    if launcher is not None:
        conditions = {c["type"]: c for c in (launcher["status"].get("conditions") or [])}
        launcher_pods = [p for p in cluster.objects["pods"].values()
                         if p["metadata"]["labels"].get("job-name") == launcher["metadata"]["name"]]
        launcher_running = sum(1 for p in launcher_pods if p["status"].get("phase") == "Running")
        if "Complete" in conditions:
            message = f"MPIJob {namespace}/{name} successfully completed."
            job["status"].setdefault("completionTime", now())
            if not _finished(job):
                record_event(cluster, job, "Normal", "MPIJobSucceeded", message, OPERATOR)
            _mpi_condition(job, "Succeeded", "True", "MPIJobSucceeded", message)
        elif "Failed" in conditions:
            failed = conditions["Failed"]
            reason, message = failed.get("reason") or "MPIJobFailed", failed.get("message") or \
                f"MPIJob {namespace}/{name} has failed"
            if reason == "BackoffLimitExceeded":
                failed_pods = sorted((p for p in launcher_pods if p["status"].get("phase") == "Failed"),
                                     key=lambda p: p["metadata"]["creationTimestamp"])
                last = failed_pods[-1]["status"] if failed_pods else {}
                reason += "/" + last.get("reason", "")
                message += ": " + last.get("message", "")
            job["status"].setdefault("completionTime", now())
            _mpi_condition(job, "Failed", "True", reason, message)
    evicted = sum(1 for p in workers if p["status"].get("phase") == "Failed" and p["status"].get("reason") == "Evicted")
    if evicted:
        # L1157-1162: the job is marked Failed, with no completionTime; the launcher is left to end on its own
        # (its mpirun loses the evicted worker's daemon), and the job is synced until it has.
        message = f"{evicted}/{len(workers)} workers are evicted"
        if not any(c["type"] == "Failed" and c.get("reason") == "MPIJobEvicted"
                   for c in job["status"].get("conditions") or []):
            record_event(cluster, job, "Warning", "MPIJobEvicted", message, OPERATOR)
        _mpi_condition(job, "Failed", "True", "MPIJobEvicted", message)
    if not _finished(job) and launcher is not None and launcher_running >= 1 and \
            all(p["status"].get("phase") == "Running" for p in workers):
        _mpi_condition(job, "Running", "True", "MPIJobRunning", f"MPIJob {namespace}/{name} is running.")
    _sync_discover_hosts(cluster, job, [p["metadata"]["name"] for p in workers
                                        if p["status"].get("phase") == "Running"])
    if _finished(job) and job["status"].get("completionTime"):
        _clean_up_workers(cluster, job, spec)


def _sync_discover_hosts(cluster: Cluster, job: dict, running: list[str]) -> None:
    config = cluster.objects["configmaps"].get((job["metadata"]["namespace"], f"{job['metadata']['name']}-config"))
    if config is not None:
        config["data"]["discover_hosts.sh"] = _discover_hosts(job, running)


def _clean_up_workers(cluster: Cluster, job: dict, spec: dict) -> None:
    """``cleanUpWorkerPods`` under cleanPodPolicy Running or All (``deleteWorkerPods``: Running ones, or all)."""
    policy = spec["runPolicy"]["cleanPodPolicy"]
    if policy not in ("Running", "All"):
        return
    for pod in _workers(cluster, job):
        if policy == "All" or pod["status"].get("phase") in ("Running", "Pending"):
            delete(cluster, "pods", pod)


def _finished(job: dict) -> bool:
    return any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
               for c in (job.get("status") or {}).get("conditions", []))


def _sync_owner(cluster: Cluster, obj: dict) -> None:
    """The controller of ``obj``'s owner syncs the owner, as its informer on ``obj``'s kind would make it."""
    # Imported here: the controller manager imports this module to run it.
    from tests.cluster.controller_manager import sync_owner

    sync_owner(cluster, obj)
