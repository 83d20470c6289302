"""``laneflow doctor``: reads what a platform block needs (the cluster with the block's own credentials, or this
machine) and prints one line per check. The reading is here; every verdict is a pure function of
``tasks/doctor.py``.

On a cluster, in order: the API server answers with the block's credentials (nothing else is asked when it does
not); every verb laneflow uses is granted to the block's identity (one SelfSubjectAccessReview each, for the
permissions the shipped RBAC manifests list); the MPI operator's API is served, its CRD knows every field
laneflow sets (an older operator's would drop them) and its controller runs (its leader Lease renewed); with CSI
snapshots, the snapshot API is served; the block's storage class (ANF's provisioner when the block moves ANF
service levels) and snapshot class exist; a node pool takes the training
workers (taints tolerated, node selector matched, GPUs enough), and each kind of a run's pods (workers, launcher,
dataset Job, scoring Jobs) lands on some pool; with a Kueue LocalQueue, Kueue's API served, the
queue and its ClusterQueue active and the priority class there; with a Run:ai project, its namespace labelled for
it and its queue (existing, a leaf, with GPUs). The CRD, the lease, the classes, the nodes, Kueue's queues, the
namespace and Run:ai's queues are reads the flows never need: ``deployments/doctor`` grants them, read-only. With ANF
settings, each configured capacity pool is listed with the block's Azure credentials, and with ``--volume`` the
claim's ANF volume is found in one of them. With ``--pull-images``, a
probe Job per image shows whether the nodes can pull it. Then the Kubernetes work pool, when it exists or is
named: a worker online. Locally: Horovod's build, free disk where the volumes live. Both: the Prefect server.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import time
from pathlib import Path

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from flows.doctor_queues import kueue_checks, runai_checks
from flows.doctor_reads import ask, error_text, first_line, served_check
from flows.local_server import DEFAULT_PORT, api_url, is_healthy
from tasks.doctor import (
    ANF_ROLE_FIX,
    CLUSTER_WORK_POOL,
    MPI_OPERATOR_FIX,
    MPIJOB_CRD,
    OPERATOR_LEASE,
    SNAPSHOT_API_FIX,
    Check,
    Permission,
    anf_verdict,
    anf_volume_verdict,
    disk_verdict,
    exit_code,
    gpu_pool_check_name,
    gpu_pool_verdict,
    horovod_verdict,
    image_verdict,
    mpijob_crd_verdict,
    operator_lease_verdict,
    permissions_verdict,
    placement_verdict,
    pull_state,
    reachable_verdict,
    required_permissions,
    server_verdict,
    shipped_rbac,
    snapshot_class_verdict,
    storage_class_verdict,
    unreadable_verdict,
    work_pool_verdict,
)

#: ``--volume`` asks for a claim's ANF volume: only a cluster block with ANF settings has one to find.
VOLUME_NEEDS_ANF = Check("--volume: a claim's Azure NetApp Files volume", False,
                         "the block is not a cluster block with anf settings, so it has no ANF volume to find",
                         "name a cluster block whose anf field is set (--platform), or leave out --volume")
#: Below this much free space where the local platform keeps its volumes, a dataset and a few runs do not fit.
MIN_FREE_BYTES = 10 * 2**30


# --- the cluster -----------------------------------------------------------------------------------------------
def cluster_checks(platform: object, pull_images: bool = False, volume: str | None = None) -> list[Check]:
    """The cluster platform's checks, read with the client the block itself makes (its credentials, else in-cluster
    config, else the default kubeconfig)."""
    from tasks.platforms.cluster.api import api_client

    try:
        client = api_client(platform)
    except (kubernetes.config.ConfigException, OSError, ValueError) as exc:
        return [reachable_verdict("(none)", None, error_text(exc))]
    server = client.configuration.host
    try:
        version = kubernetes.client.VersionApi(client).get_code()
        first = reachable_verdict(server, {"gitVersion": version.git_version}, None)
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        return [reachable_verdict(server, None, error_text(exc))]
    checks = [first, permission_check(client, platform)]
    mpi_api = served_check(client, "the MPI operator's API", "kubeflow.org", "v2beta1", "mpijobs", MPI_OPERATOR_FIX)
    checks.append(mpi_api)
    if mpi_api.ok:
        checks.append(mpijob_crd_check(client))
        checks.append(operator_check(client))
    snapshot_api = None
    if platform.snapshotter == "csi":
        snapshot_api = served_check(client, "the snapshot API", "snapshot.storage.k8s.io", "v1", "volumesnapshots",
                                    SNAPSHOT_API_FIX)
        checks.append(snapshot_api)
    checks.append(storage_class_check(client, platform))
    if snapshot_api is not None and snapshot_api.ok:  # without the API, its class cannot be read (nor be)
        checks.append(snapshot_class_check(client, platform))
    checks += node_checks(client, platform)
    if platform.kueue_queue:
        checks += kueue_checks(client, platform)
    if platform.runai_project:
        checks += runai_checks(client, platform.runai_project)
    if platform.anf is not None:
        checks.append(anf_check(platform.anf))
    if volume:
        checks.append(anf_volume_check(platform, volume) if platform.anf is not None else VOLUME_NEEDS_ANF)
    if pull_images:
        checks += image_checks(client, platform)
    return checks


def image_checks(client: kubernetes.client.ApiClient, platform: object, timeout_s: float = 600) -> list[Check]:
    """Each image of the block pulled by a node, through a probe Job (``render_pull_probe``) deleted afterwards."""
    from tasks.k8s.manifests import MANAGED_BY, render_pull_probe

    batch, core = kubernetes.client.BatchV1Api(client), kubernetes.client.CoreV1Api(client)
    namespace = platform.effective_namespace()
    checks = []
    for image in dict.fromkeys([platform.data_image, platform.image]):
        name = f"laneflow-doctor-pull-{secrets.token_hex(4)}"
        probe = render_pull_probe(name, platform.layout(), image, {**MANAGED_BY, "laneflow.io/doctor": "pull"})
        try:
            batch.create_namespaced_job(namespace, probe)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            checks.append(image_verdict(image, False, f"cannot start a pull probe: {error_text(exc)}"))
            continue
        pulled, detail = None, ""
        try:
            deadline = time.monotonic() + timeout_s
            while pulled is None and time.monotonic() < deadline:
                pods = core.list_namespaced_pod(namespace, label_selector=f"job-name={name}")
                for pod in client.sanitize_for_serialization(pods)["items"]:
                    pulled, detail = pull_state(pod)
                    if pulled is not None:
                        break
                else:
                    time.sleep(1.0)
            if pulled is None:
                detail = f"not pulled within {timeout_s:.0f} s (kubectl get events -n {namespace})"
        finally:
            with contextlib.suppress(ApiException, urllib3.exceptions.HTTPError, OSError):
                batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        checks.append(image_verdict(image, pulled, detail))
    return checks


def anf_check(anf: object) -> Check:
    """List the volumes of each configured capacity pool (``Volumes_List``: the role's volumes/read, nothing more)."""
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError, ResourceNotFoundError

    pools: dict[str, tuple[str, int | None]] = {}
    try:
        client = anf._client()
        for level, pool_id in anf.pool_ids.items():
            name = anf.pool_name(pool_id)
            try:
                pools[level] = (name, len(list(client.volumes.list(anf.resource_group, anf.account, name))))
            except ResourceNotFoundError:
                pools[level] = (name, None)
    except ClientAuthenticationError as exc:
        return anf_verdict(anf.account, pools, f"the credentials were refused: {first_line(exc)}", 401)
    except HttpResponseError as exc:
        return anf_verdict(anf.account, pools, f"{exc.status_code} {first_line(exc)}", exc.status_code)
    except Exception as exc:  # no Azure at the endpoint, a bad CA bundle, an incomplete block: the answer to report
        return anf_verdict(anf.account, pools, error_text(exc))
    return anf_verdict(anf.account, pools)


def anf_volume_check(platform: object, claim: str) -> Check:
    """The claim's PV names its ANF volume (Trident's internalID); the volume is looked up in the block's pools
    (Volumes_Get, the role's volumes/read): what a run's promotion, demotion and ANF snapshot act on."""
    from tasks.anf import AnfError
    from tasks.platforms.base import VolumeRef
    from tasks.platforms.cluster.volumes import NotOnAnf, VolumeNotBound, anf_volume_of

    namespace = platform.effective_namespace()
    where = f"{namespace}/{claim}"
    try:
        bound = anf_volume_of(platform, VolumeRef(name=claim, location=where))
        pool, level, quota_tib = bound.locate()
    except ApiException as exc:
        if exc.status == 404:
            return anf_volume_verdict(where, None, "no such claim",
                                      f"kubectl get pvc -n {namespace}: name a claim a run made (its volume parameter)")
        return anf_volume_verdict(where, None, error_text(exc), "the claim's namespace and the flows' Role")
    except (NotOnAnf, VolumeNotBound, AnfError, PermissionError) as exc:
        return anf_volume_verdict(where, None, str(exc), "the block's anf fields, or the claim's storage class "
                                                         "(a Trident azure-netapp-files class)")
    except Exception as exc:  # the Azure SDK's errors (refused credentials, no Azure there): the answer to report
        return anf_volume_verdict(where, None, error_text(exc), ANF_ROLE_FIX)
    return anf_volume_verdict(where, (bound.volume, pool, level, quota_tib))


def operator_check(client: kubernetes.client.ApiClient) -> Check:
    """The MPI operator's leader Lease (GET leases/mpi-operator in its namespace)."""
    namespace, name = OPERATOR_LEASE
    found, error = ask(lambda: kubernetes.client.CoordinationV1Api(client).read_namespaced_lease(name, namespace))
    return operator_lease_verdict(client.sanitize_for_serialization(found) if found else None, time.time(), error)


def mpijob_crd_check(client: kubernetes.client.ApiClient) -> Check:
    """The MPIJob CRD (GET customresourcedefinitions/mpijobs.kubeflow.org): the operator's release, by its fields."""
    found, error = ask(lambda: kubernetes.client.ApiextensionsV1Api(client).read_custom_resource_definition(
        MPIJOB_CRD))
    if error:
        return unreadable_verdict(f"the MPI operator's CRD {MPIJOB_CRD}", error)
    return mpijob_crd_verdict(client.sanitize_for_serialization(found) if found else None)


def storage_class_check(client: kubernetes.client.ApiClient, platform: object) -> Check:
    """The block's StorageClass (GET storageclasses/<name>, cluster-scoped)."""
    found, error = ask(lambda: kubernetes.client.StorageV1Api(client).read_storage_class(platform.storage_class))
    if error:
        return unreadable_verdict(f"storage class {platform.storage_class}", error)
    return storage_class_verdict(platform.storage_class, client.sanitize_for_serialization(found) if found else None,
                                 anf=platform.anf is not None)


def snapshot_class_check(client: kubernetes.client.ApiClient, platform: object) -> Check:
    """The block's VolumeSnapshotClass (cluster-scoped custom object)."""
    found, error = ask(lambda: kubernetes.client.CustomObjectsApi(client).get_cluster_custom_object(
        "snapshot.storage.k8s.io", "v1", "volumesnapshotclasses", platform.snapshot_class))
    if error:
        return unreadable_verdict(f"volume snapshot class {platform.snapshot_class}", error)
    return snapshot_class_verdict(platform.snapshot_class, found)


def node_checks(client: kubernetes.client.ApiClient, platform: object) -> list[Check]:
    """The nodes (list nodes) against the workers' tolerations, node selector and GPUs; then each kind of a run's
    pods, rendered as the platform renders them, placed on the pools where the scheduler could put it."""
    from tasks.platforms.cluster.run_pods import run_pod_specs

    found, error = ask(lambda: kubernetes.client.CoreV1Api(client).list_node())
    if error:
        return [unreadable_verdict(gpu_pool_check_name(platform.gpus_per_worker), error)]
    nodes = client.sanitize_for_serialization(found)["items"] if found else []
    kueue = bool(platform.kueue_queue)
    return [gpu_pool_verdict(nodes, platform.tolerations, platform.node_selector, platform.gpus_per_worker, kueue),
            placement_verdict(nodes, run_pod_specs(platform), kueue)]


def permission_check(client: kubernetes.client.ApiClient, platform: object) -> Check:
    """One SelfSubjectAccessReview per permission the shipped manifests grant laneflow's flows."""
    namespace = platform.effective_namespace()
    needed = required_permissions(shipped_rbac(bool(platform.adopt_claims), kueue=bool(platform.kueue_queue)),
                                  namespace)
    authorization = kubernetes.client.AuthorizationV1Api(client)
    answers: list[tuple[Permission, bool]] = []
    for permission in needed:
        resource, _, subresource = permission.resource.partition("/")
        review = kubernetes.client.V1SelfSubjectAccessReview(spec=kubernetes.client.V1SelfSubjectAccessReviewSpec(
            resource_attributes=kubernetes.client.V1ResourceAttributes(
                group=permission.group, resource=resource, subresource=subresource or None, verb=permission.verb,
                namespace=permission.namespace)))
        try:
            answer = authorization.create_self_subject_access_review(review)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            return Check(f"every verb laneflow uses granted (namespace {namespace})", False,
                         f"cannot ask the API server (SelfSubjectAccessReview): {error_text(exc)}",
                         "the block's identity must be authenticated (the bootstrap ClusterRole system:basic-user "
                         "lets every authenticated user ask)")
        answers.append((permission, bool(answer.status and answer.status.allowed)))
    return permissions_verdict(answers, f"the block's identity (namespace {namespace})",
                               runai=platform.runai_project is not None)


# --- this machine ----------------------------------------------------------------------------------------------
def local_checks(platform: object) -> list[Check]:
    return [horovod_check(), disk_check(platform.home_dir())]


def horovod_check() -> Check:
    try:
        from training.horovodrun import recorded_build

        return horovod_verdict(recorded_build(), None)
    except Exception as exc:  # an import or extension failure is the answer to report
        return horovod_verdict(None, error_text(exc))


def disk_check(home: Path, min_free_bytes: int = MIN_FREE_BYTES) -> Check:
    existing = home
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return disk_verdict(str(home), shutil.disk_usage(existing).free, min_free_bytes)


def work_pool_check(name: str, required: bool) -> Check | None:
    """The work pool ``name`` and its workers, as the Prefect server reports them; None when the pool does not exist
    and was not asked for (flows may run where they are started, driving the cluster from there)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            return work_pool_verdict(name, None, False, []) if required else None
        workers = [(worker.name, str(getattr(worker.status, "value", worker.status)))
                   for worker in client.read_workers_for_work_pool(name)]
    return work_pool_verdict(name, pool.type, bool(pool.is_paused), workers)


def server_check() -> Check:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or api_url(DEFAULT_PORT)
    return server_verdict(url, None if is_healthy(url) else "no answer at /health")


# --- the command -----------------------------------------------------------------------------------------------
def run_checks(platform_name: str, work_pool: str | None = None, pull_images: bool = False,
               volume: str | None = None) -> list[Check]:
    """Every check for the platform block ``platform_name`` (and, on a cluster, the work pool ``work_pool``, else
    the shipped deployments' pool when it exists; with ANF, the ANF volume of the claim ``volume``)."""
    from tasks.platforms import DEFAULT_PLATFORM, ClusterPlatform, LocalPlatform, load_platform

    checks = [server_check()]
    try:
        if not checks[0].ok:  # blocks live on the server (Prefect would start a throwaway one, without them)
            if platform_name != DEFAULT_PLATFORM:
                raise LookupError("cannot be read while the Prefect server does not answer")
            platform = LocalPlatform()
        else:
            platform = load_platform(platform_name)
    except (ValueError, LookupError, RuntimeError, OSError) as exc:
        return [*checks, Check(f"platform block {platform_name}", False, str(exc),
                               "save the block first (docs/getting-started/cluster.md), or pass --platform")]
    if isinstance(platform, ClusterPlatform):
        checks += cluster_checks(platform, pull_images, volume)
        pool = work_pool_check(work_pool or CLUSTER_WORK_POOL, required=work_pool is not None)
        return checks + ([pool] if pool is not None else [])
    return checks + local_checks(platform) + ([VOLUME_NEEDS_ANF] if volume else [])


def doctor_command(platform_name: str, as_json: bool, work_pool: str | None = None, pull_images: bool = False,
                   volume: str | None = None) -> int:
    checks = run_checks(platform_name, work_pool, pull_images, volume)
    if as_json:
        print(json.dumps([check.as_dict() for check in checks], indent=2))
    else:
        for check in checks:
            print(check.line())
    return exit_code(checks)
