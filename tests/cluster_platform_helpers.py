"""What the cluster platform's tests share: a platform block on the emulated cluster (tests.cluster) whose
images exist there, a plain client to arrange the cluster with, a claim made by hand, a training spec, and
the ``prepared`` fixture (a claim with the synthetic dataset on it: a test module that imports
``prepared_claim`` gets it under that name)."""

from __future__ import annotations

import kubernetes
import pytest
from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

from tasks.platforms import ClusterPlatform, TrainingSpec, VolumeRef
from tests.cluster import KubernetesEmulator
from tests.cluster.aks import GPU_NODE_SELECTOR, GPU_TOLERATIONS
from training.data.sources import Artifact

TRAIN_IMAGE = "registry.example.org/laneflow-train:0.1.0"
DATA_IMAGE = "registry.example.org/laneflow-data:0.1.0"


def cluster_platform(emulator: KubernetesEmulator, **changes: object) -> ClusterPlatform:
    """A platform block on the emulator; the images it names exist there, built from the project's
    Dockerfiles (any other image fails to pull). An image given in ``changes`` must have been added to the
    emulator's registry already."""
    credentials = KubernetesCredentials(cluster_config=KubernetesClusterConfig(
        config=emulator.kubeconfig(), context_name="emulator"))
    # Kubernetes' default grace period rather than the block's 120 s: ranks on this machine checkpoint within
    # seconds, and a pod deleted in the instant its PID 1 starts (before it has a handler, the kernel drops
    # the SIGTERM) waits out the whole grace, as on a real node.
    # The cluster is AKS-shaped (tests/cluster/aks.py): the block tolerates its GPU and spot pools' taints and
    # selects GPU nodes, as the shipped example block does.
    fields = {"credentials": credentials, "namespace": "lanes", "poll_interval_s": 0.3, "termination_grace_s": 30,
              "image": TRAIN_IMAGE, "data_image": DATA_IMAGE, "tolerations": GPU_TOLERATIONS,
              "node_selector": GPU_NODE_SELECTOR, **changes}
    for field, default, image in (("image", TRAIN_IMAGE, "train"), ("data_image", DATA_IMAGE, "data")):
        if fields[field] == default:
            emulator.cluster.images.add(default, image)
    return ClusterPlatform(**fields)


def saved(emulator: KubernetesEmulator, name: str, **changes: object) -> str:
    cluster_platform(emulator, **changes).save(name, overwrite=True)
    return name


def client_apis(emulator: KubernetesEmulator) -> tuple[kubernetes.client.CoreV1Api, kubernetes.client.CustomObjectsApi]:
    client = kubernetes.config.new_client_from_config_dict(emulator.kubeconfig())
    return kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)


def create_rwo_claim(emulator: KubernetesEmulator, name: str, namespace: str = "lanes") -> None:
    """A claim made by hand, ReadWriteOnce, as the seed had it."""
    core, _ = client_apis(emulator)
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def spec_for(volume: str, job: str = "train-0123456789ab", data_dir: str = "datasets/none", workers: int = 1,
             **settings: str) -> TrainingSpec:
    return TrainingSpec(job_name=job, volume=VolumeRef(name=volume, location=f"lanes/{volume}"), data_dir=data_dir,
                        run_dir=f"runs/{job}", preset="cpu-demo", workers=workers,
                        settings={"epochs": "1", "batch_size": "2", "num_workers": "0", **settings})


@pytest.fixture(name="prepared")
def prepared_claim(emulator: tuple, served_archive: tuple[str, str]) -> tuple[ClusterPlatform, VolumeRef, str]:
    """A claim with the synthetic dataset prepared on it (by the platform's own dataset Job, over HTTP)."""
    emu, _ = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    url, sha256 = served_archive
    summary = platform.prepare_dataset(volume, [Artifact(url, sha256)], lambda _: None)
    return platform, volume, summary["dataset_dir"]


def admin_core(emulator: KubernetesEmulator) -> kubernetes.client.CoreV1Api:
    """A client with the cluster's ``cluster-admin`` role (kube-apiserver's bootstrap ClusterRole: every verb on
    every resource; plugin/pkg/auth/authorizer/rbac/bootstrappolicy ``ClusterRoles``), as the operator who drains
    a node has it, for a cluster whose RBAC is enforced."""
    admin = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "cluster-admin"},
             "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "node-maintainer"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
               "subjects": [{"kind": "ServiceAccount", "name": "node-maintainer", "namespace": "kube-system"}]}
    emulator.cluster.load([admin, binding])
    config = emulator.kubeconfig(token=emulator.token("kube-system", "node-maintainer"))
    return kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config_dict(config))
