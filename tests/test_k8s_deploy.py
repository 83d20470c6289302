"""What ships for clusters: the kustomize base renders, RBAC is least privilege, the work pool template
fits Prefect's kubernetes worker; and, given a real cluster, the same flow runs there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import PROJECT_ROOT

BASE = PROJECT_ROOT / "deployments" / "base"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (scripts/bootstrap.sh installs it as root)")
def test_kustomize_base_renders_every_object_in_the_namespace() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, check=True).stdout
    objects = [doc for doc in yaml.safe_load_all(rendered) if doc]
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    assert kinds == ["ClusterRole/laneflow-volumes", "ClusterRoleBinding/laneflow-volumes", "Namespace/laneflow",
                     "Role/laneflow-flows", "RoleBinding/laneflow-flows", "ServiceAccount/laneflow-flows",
                     "ServiceAccount/laneflow-training", "StorageClass/azure-netapp-files",
                     "VolumeSnapshotClass/csi-anf-snapclass"]
    namespaced = [o for o in objects if o["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    assert all(o["metadata"]["namespace"] == "laneflow" for o in namespaced)
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "laneflow-flows", "namespace": "laneflow"}]
    assert all(o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "laneflow" for o in objects)


def test_rbac_grants_no_wildcards_and_nothing_cluster_wide_but_volumes() -> None:
    for document in yaml.safe_load_all((BASE / "rbac.yaml").read_text()):
        for rule in (document or {}).get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            if document["kind"] == "ClusterRole":
                assert rule["resources"] == ["persistentvolumes"] and sorted(rule["verbs"]) == ["get", "patch"]


def test_kubernetes_work_pool_template_fits_the_worker() -> None:
    from prefect_kubernetes.worker import KubernetesWorker

    ours = json.loads((PROJECT_ROOT / "deployments" / "kubernetes-work-pool.json").read_text())
    default = KubernetesWorker.get_default_base_job_template()
    assert set(ours["variables"]["properties"]) == set(default["variables"]["properties"])
    assert ours["job_configuration"] == default["job_configuration"]
    defaults = {key: value.get("default") for key, value in ours["variables"]["properties"].items()}
    assert defaults["namespace"] == "laneflow" and defaults["service_account_name"] == "laneflow-flows"


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
    result = train_pipeline(params)
    assert result["snapshot"] and 0.0 <= result["metrics"]["accuracy"] <= 1.0
