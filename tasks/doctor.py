"""``laneflow doctor``'s verdicts: pure functions over what ``flows/doctor.py`` read from the cluster and this machine.

Each verdict is one ``Check``: what was checked, whether it holds, what is wrong and the command or block field that
fixes it. Nothing here calls an API, so each can be tested on its own; the shell reads, these judge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tasks.k8s.placement import landing_pools, pod_requests

#: The RBAC manifests whose Roles and ClusterRoles list every call the cluster platform makes (the tests of
#: tests/test_cluster_pipeline.py hold the code to them): the namespaced Role, the cluster-scoped read of PVs,
#: and the opt-in patch of hand-made claims' PVs (needed only when the block adopts claims).
DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"
RBAC_FILES = ("workloads/rbac.yaml", "base/rbac.yaml")
ADOPT_RBAC_FILE = "rwo-claims/rbac.yaml"
#: What the flows read of Kueue when the block names a LocalQueue (its Workloads, the queue's pending list).
KUEUE_RBAC_FILE = "kueue/rbac.yaml"
#: The storage provisioner of Azure NetApp Files volumes (NetApp Trident's CSI driver).
ANF_PROVISIONER = "csi.trident.netapp.io"
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    check: str
    ok: bool
    detail: str = ""
    fix: str = ""

    def line(self) -> str:
        if self.ok:
            return f"✔ {self.check}" + (f" ({self.detail})" if self.detail else "")
        return f"✘ {self.check}: {self.detail} — {self.fix}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Permission:
    """One verb on one resource (``resource/subresource``) of one API group; ``namespace`` None: cluster scope."""

    group: str
    resource: str
    verb: str
    namespace: str | None

    def text(self) -> str:
        qualified = f"{self.resource}.{self.group}" if self.group else self.resource
        return f"{self.verb} {qualified}" + (f" in {self.namespace}" if self.namespace else " (cluster)")


# --- what laneflow needs ---------------------------------------------------------------------------------------
def required_permissions(documents: Iterable[Mapping[str, Any]], namespace: str) -> list[Permission]:
    """Every (group, resource, verb) the Roles (in ``namespace``) and ClusterRoles (cluster scope) of ``documents``
    grant: what the cluster platform calls, as the shipped manifests list it."""
    needed: dict[Permission, None] = {}
    for doc in documents:
        if doc.get("kind") not in ("Role", "ClusterRole"):
            continue
        scope = namespace if doc["kind"] == "Role" else None
        for rule in doc.get("rules") or []:
            for group in rule.get("apiGroups") or [""]:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        needed[Permission(group, resource, verb, scope)] = None
    return list(needed)


def shipped_rbac(adopts_claims: bool, deployments: Path = DEPLOYMENTS, kueue: bool = False) -> list[dict[str, Any]]:
    """The shipped RBAC documents laneflow's flows need (with deployments/rwo-claims when the block adopts claims,
    deployments/kueue's Role when it names a Kueue LocalQueue)."""
    files = RBAC_FILES + ((ADOPT_RBAC_FILE,) if adopts_claims else ()) + ((KUEUE_RBAC_FILE,) if kueue else ())
    return [doc for name in files for doc in yaml.safe_load_all((deployments / name).read_text()) if doc]


# --- the cluster -----------------------------------------------------------------------------------------------
def reachable_verdict(server: str, version: Mapping[str, Any] | None, error: str | None) -> Check:
    what = f"Kubernetes API server {server} reachable with the block's credentials"
    if version is not None and error is None:
        return Check(what, True, f"Kubernetes {version.get('gitVersion', '?')}")
    return Check(what, False, error or "no answer",
                 "the block's credentials (KubernetesCredentials.cluster_config: kubeconfig and context), or, "
                 "empty, the in-cluster service account / ~/.kube/config; `kubectl --context <context> version` "
                 "must answer")


def permissions_verdict(answers: Iterable[tuple[Permission, bool]], identity: str, runai: bool) -> Check:
    """``answers``: each permission and whether a SelfSubjectAccessReview allowed it to the block's identity."""
    answers = list(answers)
    missing = [permission for permission, allowed in answers if not allowed]
    what = f"every verb laneflow uses granted to {identity}"
    if not missing:
        return Check(what, True, f"{len(answers)} verbs")
    if all(permission.group.endswith("kueue.x-k8s.io") for permission in missing):
        return Check(what, False, "denied: " + ", ".join(p.text() for p in missing),
                     "kubectl apply -k deployments/kueue (its Role laneflow-kueue; set its namespace to the block's): "
                     "deployments/kueue/rbac.yaml lists what the flows read of Kueue")
    apply = "kubectl apply -k deployments/runai (in the project's namespace)" if runai else \
        "kubectl apply -k deployments/base"
    return Check(what, False, "denied: " + ", ".join(p.text() for p in missing),
                 f"{apply}; deployments/workloads/rbac.yaml and deployments/base/rbac.yaml list every permission "
                 "(deployments/rwo-claims for adopt_claims, deployments/kueue for kueue_queue)")


def api_served_verdict(what: str, group_version: str, resource: str, served: Iterable[str] | None,
                       fix: str) -> Check:
    """``served``: the resources API discovery lists for ``group_version``; None when it is not served at all."""
    check = f"{what} ({resource}.{group_version}) served"
    if served is None:
        return Check(check, False, f"the API server does not serve {group_version}", fix)
    if resource not in set(served):
        return Check(check, False, f"{group_version} is served without {resource}", fix)
    return Check(check, True)


MPI_OPERATOR_FIX = ("install the MPI operator v0.5 or later (its CRD kubeflow.org/v2beta1 MPIJob): kubectl apply "
                    "--server-side -f https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.6.0/deploy/"
                    "v2beta1/mpi-operator.yaml")
#: The MPIJob fields laneflow sets, with the MPI operator release whose CRD first has each (kubeflow/mpi-operator
#: deploy/v2beta1/mpi-operator.yaml at each tag). An older operator's CRD serves v2beta1 all the same, and its
#: structural schema drops the fields it lacks without a word: the launcher would start before its workers.
MPIJOB_FIELDS: dict[str, str] = {
    "spec.slotsPerWorker": "v0.3.0", "spec.mpiImplementation": "v0.3.0", "spec.sshAuthMountPath": "v0.3.0",
    "spec.runPolicy.cleanPodPolicy": "v0.3.0", "spec.runPolicy.backoffLimit": "v0.3.0",
    "spec.runPolicy.ttlSecondsAfterFinished": "v0.3.0",
    "spec.runPolicy.schedulingPolicy.minAvailable": "v0.4.0",  # elastic runs
    "spec.runPolicy.suspend": "v0.4.0",  # under Kueue
    "spec.launcherCreationPolicy": "v0.5.0",
}
MPIJOB_CRD = "mpijobs.kubeflow.org"


def _schema_has(schema: Mapping[str, Any], path: str) -> bool:
    node = schema
    for part in path.split("."):
        node = (node.get("properties") or {}).get(part)
        if not isinstance(node, Mapping):
            return False
    return True


def mpijob_crd_verdict(crd: Mapping[str, Any] | None, version: str = "v2beta1") -> Check:
    """The MPI operator's CRD (as the API serves it) knows every field laneflow sets in ``version``."""
    what = f"the MPI operator's CRD {MPIJOB_CRD} has every field laneflow sets"
    served = next((v for v in ((crd or {}).get("spec") or {}).get("versions") or [] if v.get("name") == version), None)
    if served is None:
        return Check(what, False, f"no {version} version in the CRD", MPI_OPERATOR_FIX)
    schema = (served.get("schema") or {}).get("openAPIV3Schema") or {}
    missing = [path for path in MPIJOB_FIELDS if not _schema_has(schema, path)]
    if missing:
        newest = max((MPIJOB_FIELDS[path] for path in missing), key=lambda tag: tuple(map(int, tag[1:].split("."))))
        return Check(what, False, f"it lacks {', '.join(missing)}: an MPI operator older than {newest}, whose API "
                                  "server would drop them without a word", MPI_OPERATOR_FIX)
    return Check(what, True, "v0.5.0 or later")


SNAPSHOT_API_FIX = ("install the external-snapshotter's CRDs and snapshot controller (kubernetes-csi/"
                    "external-snapshotter: client/config/crd and deploy/kubernetes/snapshot-controller); AKS "
                    "ships them")


#: What applying deployments/doctor grants (read-only): the cluster-scoped reads of the next three checks.
DOCTOR_READS_FIX = ("kubectl apply -k deployments/doctor (read-only: lets laneflow doctor read storage classes, "
                    "snapshot classes, nodes, the MPI operator's CRD and lease, Kueue's queues and priority classes, "
                    "namespaces and Run:ai's queues), or run laneflow doctor as a user who may")


def unreadable_verdict(what: str, error: str) -> Check:
    """A check whose object the block's identity may not read (403) or the API would not give: not a pass."""
    forbidden = error.startswith("403")
    return Check(what, False, f"cannot read it: {error}",
                 DOCTOR_READS_FIX if forbidden else "check the API server's health (kubectl get --raw /readyz)")


#: The MPI operator's leader election Lease (kubeflow/mpi-operator cmd/mpi-operator/app/server.go: a LeaseLock named
#: mpi-operator in --lock-namespace, default mpi-operator; lease 15 s, renewed every 3 s while the controller runs).
OPERATOR_LEASE = ("mpi-operator", "mpi-operator")


def operator_lease_verdict(lease: Mapping[str, Any] | None, now: float, error: str | None = None) -> Check:
    """Whether the MPI operator's controller runs: its leader Lease held and renewed within twice its duration (a
    controller that stopped leaves the Lease with an old ``renewTime``); ``lease`` None: there is none."""
    namespace, name = OPERATOR_LEASE
    what = f"the MPI operator's controller running (its leader lease {namespace}/{name})"
    logs = f"kubectl -n {namespace} get pods; kubectl -n {namespace} logs deploy/mpi-operator"
    if error is not None:
        return unreadable_verdict(what, error)
    if lease is None:
        return Check(what, False, "no such lease: the operator has never run here, or runs with another "
                                  "--lock-namespace", f"{logs}; or {MPI_OPERATOR_FIX}")
    spec = lease.get("spec") or {}
    holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
    if not holder or not renewed:
        return Check(what, False, "the lease has no holder: the operator lost its leadership", logs)
    age = now - datetime.fromisoformat(str(renewed).replace("Z", "+00:00")).timestamp()
    duration = int(spec.get("leaseDurationSeconds") or 15)
    who = str(holder).split("_")[0]
    if age > 2 * duration:
        return Check(what, False, f"its leader {who} last renewed it {age:.0f} s ago ({duration} s lease): the "
                                  "controller is not running, and MPIJobs would be stored with nothing acting on them",
                     logs)
    return Check(what, True, f"leader {who}, renewed {max(age, 0):.0f} s ago")


def storage_class_verdict(name: str, found: Mapping[str, Any] | None, anf: bool) -> Check:
    """The block's StorageClass exists; with ANF settings on the block, its provisioner is ANF's (Trident)."""
    what = f"storage class {name}"
    if found is None:
        return Check(what, False, "not found",
                     "kubectl apply -f deployments/base/storageclass-anf.yaml, or set the block's storage_class to "
                     "an existing RWX-capable class (kubectl get storageclass)")
    provisioner = found.get("provisioner", "")
    if anf and provisioner != ANF_PROVISIONER:
        return Check(what, False, f"its provisioner is {provisioner}, not Azure NetApp Files' {ANF_PROVISIONER} "
                                  "(the block's anf settings change its volumes' service level)",
                     "set the block's storage_class to a Trident ANF class (deployments/base/storageclass-anf.yaml)"
                     ", or clear the block's anf field")
    return Check(what, True, f"provisioner {provisioner}")


def presence_verdict(what: str, found: Mapping[str, Any] | None, fix: str, shown: str) -> Check:
    """An object the block names: there (with ``shown``, a field of it worth a look) or not found (with ``fix``)."""
    return Check(what, True, shown) if found is not None else Check(what, False, "not found", fix)


def snapshot_class_verdict(name: str, found: Mapping[str, Any] | None) -> Check:
    return presence_verdict(f"volume snapshot class {name}", found,
                            "kubectl apply -f deployments/base/volumesnapshotclass.yaml, or set the block's "
                            "snapshot_class (kubectl get volumesnapshotclass)",
                            f"driver {(found or {}).get('driver', '?')}")


# --- GPU nodes and where each pod lands -------------------------------------------------------------------------
def gpu_pool_check_name(gpus_per_worker: int) -> str:
    return f"a node pool for training workers ({gpus_per_worker} {GPU} each)"


#: With Kueue, a GPU pod's placement is finished at admission: the flavor Kueue admits it to adds its node labels
#: and tolerations (the Kueue lines check the queue and its flavors), so the block need not carry them.
KUEUE_PLACES = "Kueue's flavors add their node labels and tolerations at admission"


def as_a_flavor_may_place(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with what a Kueue flavor may add at admission taken as given: every taint tolerated, any node
    labels. What is left to judge — GPUs, CPU, memory per node, cordons — no flavor changes."""
    return {**spec, "tolerations": [{"operator": "Exists"}], "nodeSelector": {}, "affinity": None}


def gpu_pool_verdict(nodes: Iterable[Mapping[str, Any]], tolerations: Iterable[Mapping[str, Any]],
                     node_selector: Mapping[str, str], gpus_per_worker: int, kueue: bool = False) -> Check:
    """A node pool where the training workers fit: taints tolerated, node selector matched, enough GPUs; otherwise
    each pool seen and why it is unsuitable — except under Kueue, whose flavors complete the placement."""
    worker = {"tolerations": list(tolerations), "nodeSelector": dict(node_selector),
              "containers": [{"resources": {"limits": {GPU: str(gpus_per_worker)}}}]}
    fit, why = landing_pools(nodes, worker)
    what = gpu_pool_check_name(gpus_per_worker)
    if fit:
        return Check(what, True, "pools " + ", ".join(fit))
    seen = "; ".join(f"{pool}: {reason}" for pool, reason in why.items()) or "no nodes"
    if kueue and landing_pools(nodes, as_a_flavor_may_place(worker))[0]:
        return Check(what, True, f"none by the block's own fields ({seen}); {KUEUE_PLACES}")
    return Check(what, False, seen, "the block's tolerations, node_selector or gpus_per_worker, or a GPU pool "
                                    "(az aks nodepool add --node-taints sku=gpu:NoSchedule ...)")


PLACEMENT_CHECK = "where each of a run's pods can land"
#: The GPU pods (MPI workers, the Jobs after training) are placed by the block's scheduling fields.
GPU_PODS_FIX = ("the block's tolerations, node_selector, affinity, worker_cpu, worker_memory or gpus_per_worker, "
                "or a GPU pool they fit")
#: Pods that ask for no GPU get none of the block's scheduling fields (those are the GPU pods'): they need a pool
#: without taints, which AKS's system pool is unless it was made system-only.
PLAIN_PODS_FIX = ("a pool without taints for the pods that ask for no GPU (an AKS system pool made with "
                  "--node-taints CriticalAddonsOnly=true:NoSchedule takes none of them): az aks nodepool add "
                  "--mode User ... without --node-taints")


def placement_verdict(nodes: Iterable[Mapping[str, Any]], pods: Mapping[str, Mapping[str, Any]],
                      kueue: bool = False) -> Check:
    """Which pools each of a run's pods (its rendered pod spec, by what it is) can land on; ✘ naming a pod that fits
    no pool and why each pool refuses it. With Kueue, a GPU pod that fits no pool by its own spec is left to the
    flavor Kueue admits it to (which adds node labels and tolerations no spec here has yet)."""
    nodes = list(nodes)
    landed, stranded, fixes = [], [], []
    for what, spec in pods.items():
        fit, why = landing_pools(nodes, spec)
        if fit:
            landed.append(f"{what} → {', '.join(fit)}")
            continue
        on_gpus = bool(pod_requests(spec).get(GPU))
        if kueue and on_gpus and landing_pools(nodes, as_a_flavor_may_place(spec))[0]:
            landed.append(f"{what} → by Kueue's flavor")
            continue
        reasons = "; ".join(f"{pool}: {reason}" for pool, reason in why.items()) or "no nodes"
        stranded.append(f"{what} fits no pool ({reasons})")
        fix = GPU_PODS_FIX if on_gpus else PLAIN_PODS_FIX
        fixes += [fix] if fix not in fixes else []
    note = f" ({KUEUE_PLACES})" if kueue else ""
    if stranded:
        return Check(PLACEMENT_CHECK, False, "; ".join(stranded) + note, "; ".join(fixes))
    return Check(PLACEMENT_CHECK, True, "; ".join(landed) + note)


# --- this machine ----------------------------------------------------------------------------------------------
def horovod_verdict(built: Mapping[str, bool] | None, error: str | None) -> Check:
    what = "Horovod built with Gloo and MPI"
    if built is None:
        return Check(what, False, error or "Horovod could not be imported",
                     "make install (pip install horovod with HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1)")
    lacking = [name for name, key in (("Gloo", "gloo"), ("MPI", "mpi")) if not built.get(key)]
    if lacking:
        return Check(what, False, "built without " + " and ".join(lacking),
                     "reinstall Horovod: HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 pip install --no-cache-dir "
                     "--force-reinstall horovod (make install does)")
    return Check(what, True)


def disk_verdict(path: str, free_bytes: int, min_free_bytes: int) -> Check:
    what = f"free disk at {path}"
    gib = free_bytes / 2**30
    if free_bytes < min_free_bytes:
        return Check(what, False, f"{gib:.1f} GiB free, {min_free_bytes / 2**30:.0f} GiB wanted",
                     "free space there, or set the local block's home (or $LANEFLOW_HOME) to a larger disk")
    return Check(what, True, f"{gib:.1f} GiB free")


def server_verdict(url: str, error: str | None) -> Check:
    what = f"Prefect server {url} reachable"
    if error is None:
        return Check(what, True)
    return Check(what, False, error, "laneflow serve (the local server), or set PREFECT_API_URL to your server")


# --- Azure NetApp Files, images, the work pool ------------------------------------------------------------------
ANF_ROLE_FIX = ("assign the role deployments/azure/laneflow-anf-role.json to the block's identity (its client_id, "
                "or the workload identity) on the NetApp account's resource group")


def anf_verdict(account: str, pools: Mapping[str, tuple[str, int | None]], error: str | None = None,
                status: int | None = None) -> Check:
    """The block's capacity pools reachable with its credentials: ``pools`` maps each level to (pool name, the
    number of volumes listed in it, None when Azure says the pool does not exist); ``error``/``status``: what
    stopped the reading."""
    what = f"Azure NetApp Files account {account}: its capacity pools readable with the block's credentials"
    if error is not None:
        if status in (401, 403):
            return Check(what, False, error, ANF_ROLE_FIX)
        return Check(what, False, error, "the block's anf fields: tenant_id, client_id and client_secret (or the "
                                         "workload identity), arm_endpoint, ca_bundle")
    missing = [f"{level} pool {name}" for level, (name, count) in pools.items() if count is None]
    if missing:
        return Check(what, False, "not found: " + ", ".join(missing),
                     "set the block's anf.pool_ids to the account's capacity pools (az netappfiles pool list)")
    return Check(what, True, ", ".join(f"{level} {name}: {count} volumes" for level, (name, count) in pools.items()))


def anf_volume_verdict(where: str, located: tuple[str, str, str, float] | None, error: str | None = None,
                       fix: str = "") -> Check:
    """The ANF volume behind a claim (``where``: namespace/claim), found in one of the block's pools: ``located`` is
    (ANF volume, pool, service level, quota in TiB); ``error`` and ``fix`` what kept it from being found."""
    what = f"Azure NetApp Files volume of claim {where} in one of the block's pools"
    if located is None:
        return Check(what, False, error or "not found", fix)
    volume, pool, level, quota_tib = located
    return Check(what, True, f"{volume} in {pool}, {level}, {quota_tib:g} TiB")


#: A container waiting for these never gets its image (kubelet pkg/kubelet/images: ErrImagePull, then
#: ImagePullBackOff; InvalidImageName for a reference it cannot parse; ErrImageNeverPull under pullPolicy Never).
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


def pull_state(pod: Mapping[str, Any]) -> tuple[bool | None, str]:
    """From a pull probe's pod (as the API serves it): True once its container started or ended (the image is on the
    node), False when the kubelet gave up on the pull for now (with its reason and message), None while pending."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Running", "Succeeded"):
        return True, ""
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if "running" in state or "terminated" in state:
            return True, ""
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in PULL_FAILURES:
            return False, f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return None, ""


def image_verdict(image: str, pulled: bool | None, detail: str) -> Check:
    what = f"image {image} pullable by the nodes"
    if pulled:
        return Check(what, True)
    return Check(what, False, detail or "not pulled in time",
                 "push the image (make image; docs/getting-started/images.md) and let the nodes read the registry "
                 "(az aks update --attach-acr <registry>), or set the block's image/data_image")


#: The Kubernetes work pool the shipped cluster deployments use (deployments/prefect-kubernetes.yaml).
CLUSTER_WORK_POOL = "laneflow-k8s"


def work_pool_verdict(name: str, pool_type: str | None, paused: bool, workers: Iterable[tuple[str, str]]) -> Check:
    """The work pool the flow runs go to exists, is a Kubernetes pool, is not paused and has a worker ONLINE;
    ``pool_type`` None: no such pool; ``workers``: (name, status) as the server reports them."""
    what = f"work pool {name} with a worker online"
    if pool_type is None:
        return Check(what, False, "no such work pool",
                     f"prefect work-pool create {name} --type kubernetes --base-job-template "
                     "deployments/kubernetes-work-pool.json (docs/getting-started/cluster.md)")
    if pool_type != "kubernetes":
        return Check(what, False, f"a {pool_type} pool, not a kubernetes one: its flow runs would not run in the "
                                  "cluster", "pass --work-pool with the Kubernetes pool's name")
    if paused:
        return Check(what, False, "the pool is paused: no worker takes its runs", f"prefect work-pool resume {name}")
    workers = list(workers)
    online = [worker for worker, status in workers if status == "ONLINE"]
    if not online:
        seen = ", ".join(f"{worker} {status.lower()}" for worker, status in workers) or "none has ever polled it"
        return Check(what, False, f"no worker online ({seen})",
                     "start the Prefect Kubernetes worker in the cluster as service account prefect-worker "
                     f"(prefect worker start --pool {name} --type kubernetes; docs/getting-started/cluster.md)")
    return Check(what, True, "workers " + ", ".join(online))


def exit_code(checks: Iterable[Check]) -> int:
    return 0 if all(check.ok for check in checks) else 1
