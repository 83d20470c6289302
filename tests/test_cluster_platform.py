"""Contract tests of the cluster platform: the real ``kubernetes`` client over HTTP to an emulator on
127.0.0.1 that also plays the MPI operator, the Job controller and the snapshot controller (running
the containers' commands on this machine), with faults injected per call type."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
import yaml
from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

from flows.restore import restore
from flows.train import train_pipeline
from tasks.names import InvalidName
from tasks.platforms import ClusterPlatform, TrainingSpec, VolumeRef
from tests.k8s_emulator import Cluster, Fault, KubernetesEmulator
from tests.test_pipeline import params_for

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parent / "golden"
RBAC = Path(__file__).resolve().parent.parent / "deployments" / "base" / "rbac.yaml"


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[tuple[KubernetesEmulator, Cluster]]:
    emulator = KubernetesEmulator(tmp_path / "cluster")
    with emulator as cluster:
        yield emulator, cluster


def cluster_platform(emulator: KubernetesEmulator, **changes: object) -> ClusterPlatform:
    credentials = KubernetesCredentials(cluster_config=KubernetesClusterConfig(
        config=emulator.kubeconfig(), context_name="emulator"))
    fields = {"credentials": credentials, "namespace": "lanes", "poll_interval_s": 0.3,
              "image": "registry.example.org/laneflow-train:0.1.0",
              "data_image": "registry.example.org/laneflow-data:0.1.0", **changes}
    return ClusterPlatform(**fields)


def saved(emulator: KubernetesEmulator, name: str, **changes: object) -> str:
    cluster_platform(emulator, **changes).save(name, overwrite=True)
    return name


def normalized(obj: dict, replacements: dict[str, str]) -> dict:
    """The object without what the server sets, with run-specific values replaced by placeholders."""
    clean = {key: value for key, value in obj.items() if key != "status"}
    clean["metadata"] = {k: v for k, v in obj["metadata"].items()
                         if k not in ("uid", "resourceVersion", "creationTimestamp", "annotations")}
    text = json.dumps(clean, sort_keys=True)
    for value, placeholder in replacements.items():
        text = text.replace(value, placeholder)
    return json.loads(text)


def create_rwo_claim(emulator: KubernetesEmulator, name: str) -> None:
    """A claim made by hand, ReadWriteOnce, as the seed had it."""
    core = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config_dict(emulator.kubeconfig()))
    core.create_namespaced_persistent_volume_claim("lanes", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def check_golden(name: str, manifest: dict) -> None:
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("LANEFLOW_UPDATE_GOLDEN"):
        path.write_text(yaml.safe_dump(manifest, sort_keys=True))
    assert yaml.safe_load(path.read_text()) == manifest


def rbac_permissions() -> set[tuple[str, str]]:
    granted = set()
    for document in yaml.safe_load_all(RBAC.read_text()):
        if document and document["kind"] in ("Role", "ClusterRole"):
            for rule in document["rules"]:
                granted |= {(verb, resource) for verb in rule["verbs"] for resource in rule["resources"]}
    return granted


def used_permissions(cluster: Cluster) -> set[tuple[str, str]]:
    """RBAC (verb, resource) pairs of every request the platform made."""
    verbs = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}
    return {(verbs.get(method) or ("get" if named else "list"), kind) for method, kind, named in cluster.requests}


def test_train_pipeline_runs_green_on_the_cluster_platform(prefect_server: dict, laneflow_home: Path,
                                                           synthetic_archive: tuple[Path, str], emulator: tuple
                                                           ) -> None:
    emu, cluster = emulator
    name = saved(emu, "emu-cluster")
    result = train_pipeline(params_for(synthetic_archive, platform=name, volume="tusimple"))
    assert result["metrics"]["images"] == 3 and result["steps"] == 2
    assert (cluster.count("persistentvolumeclaims"), cluster.count("mpijobs"), cluster.count("volumesnapshots")) \
        == (1, 1, 1)
    (pv,) = cluster.objects["persistentvolumes"].values()
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]

    run, flow_run = result["run"], result["flow_run_id"]
    placeholders = {flow_run: "<flow-run-id>", run: "<run>", result["dataset_version"]: "<dataset-version>",
                    result["data_dir"]: "datasets/<archive>"}
    (mpijob,) = cluster.objects["mpijobs"].values()
    check_golden("cluster-stored-mpijob", normalized(mpijob, placeholders))
    (snapshot,) = cluster.objects["volumesnapshots"].values()
    stored = normalized(snapshot, placeholders)
    stored["metadata"]["labels"].pop("laneflow.io/code-version")
    check_golden("cluster-stored-volumesnapshot", stored)
    lineage = json.loads(snapshot["metadata"]["annotations"]["laneflow.io/lineage"])
    assert lineage["run"] == run and lineage["metrics"] == result["metrics"]
    assert snapshot["status"]["readyToUse"] is True

    # RBAC grants exactly what the code uses: the run's calls, plus those of listing snapshots, cancelling,
    # and adopting a ReadWriteOnce claim (its PV patched to ReadWriteMany).
    platform = ClusterPlatform.load(name)
    assert [ref.name for ref in platform.list_snapshots()] == [result["snapshot"]]
    assert platform.find_lineage(result["snapshot"])["dataset_version"] == result["dataset_version"]
    assert platform.cancel_training(run, VolumeRef(name="tusimple", location="lanes/tusimple"))
    create_rwo_claim(emu, "legacy")
    message = platform.ensure_shared_access(platform.ensure_volume("legacy"))
    assert "patched to ReadWriteMany and verified" in message
    assert used_permissions(cluster) == rbac_permissions()

    # restore: a new claim whose dataSource is the snapshot; nothing downloaded, the snapshot's run is there.
    restored = restore(result["snapshot"], volume="restored", platform=name, changes={"max_steps": 1})
    claim = cluster.objects["persistentvolumeclaims"][("lanes", "restored")]
    assert claim["spec"]["dataSource"] == {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                                           "name": result["snapshot"]}
    assert restored["dataset_steps"] == {"downloaded": False, "extracted": False, "preprocessed": False}
    assert (cluster.claim_dir("lanes", "restored") / result["run_dir"] / "model.pt").is_file()


def test_faults_per_call_type_end_in_success_with_one_of_each(prefect_server: dict, laneflow_home: Path,
                                                              synthetic_archive: tuple[Path, str],
                                                              emulator: tuple) -> None:
    emu, cluster = emulator
    # An existing ReadWriteOnce claim, as the seed had it: adopted, and its PV patched to RWX.
    create_rwo_claim(emu, "legacy")
    cluster.requests.clear()
    reset = Fault(status=0)
    lost_answer = Fault(status=0, after_effect=True)
    throttled = Fault(status=429, retry_after=1)
    for call in [("GET", "persistentvolumeclaims"), ("POST", "mpijobs"), ("POST", "volumesnapshots"),
                 ("GET", "mpijobs"), ("PATCH", "persistentvolumes"), ("POST", "jobs"), ("GET", "pods/log")]:
        cluster.inject(*call, throttled, Fault(status=500), reset)
    cluster.inject("POST", "mpijobs", lost_answer)
    cluster.inject("POST", "volumesnapshots", lost_answer)
    name = saved(emu, "emu-faults")
    result = train_pipeline(params_for(synthetic_archive, platform=name, volume="legacy"))
    assert result["steps"] == 2
    assert (cluster.count("persistentvolumeclaims"), cluster.count("mpijobs"), cluster.count("volumesnapshots")) \
        == (1, 1, 1)
    (pv,) = cluster.objects["persistentvolumes"].values()
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not any(queue for queue in cluster.faults.values())  # every injected fault was met


def test_forbidden_is_not_retried_and_names_the_permission(prefect_server: dict, laneflow_home: Path,
                                                           synthetic_archive: tuple[Path, str],
                                                           emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.inject("PATCH", "persistentvolumes", Fault(status=403))
    create_rwo_claim(emu, "legacy")
    state = train_pipeline(params_for(synthetic_archive, platform=saved(emu, "emu-403"), volume="legacy"),
                           return_state=True)
    assert state.is_failed()
    assert "may not 'patch' persistentvolumes" in str(state.result(raise_on_failure=False))
    assert cluster.requests.count(("PATCH", "persistentvolumes", True)) == 1  # asked once, never retried
    assert cluster.count("mpijobs") == 0


def test_invalid_names_are_refused_before_any_call(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu)
    with pytest.raises(InvalidName):
        platform.ensure_volume("Bad_Name")
    with pytest.raises(InvalidName):
        platform.restore_snapshot("snap", "-restored")
    with pytest.raises(InvalidName):
        platform.restore_snapshot("Not A Snapshot", "restored")
    assert cluster.requests == []


def test_failed_mpijob_fails_the_flow_with_log_tail_and_pod_reasons(prefect_server: dict, laneflow_home: Path,
                                                                    synthetic_archive: tuple[Path, str],
                                                                    emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.fail_mpijobs = True
    state = train_pipeline(params_for(synthetic_archive, platform=saved(emu, "emu-fail"), volume="tusimple"),
                           return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "MPIJobFailed" in message and "CUDA error: out of memory" in message and "OOMKilled" in message
    assert cluster.count("volumesnapshots") == 0


def test_runai_variant_schedules_the_same_mpijob_in_the_project_namespace(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str], emulator: tuple) -> None:
    emu, cluster = emulator
    name = saved(emu, "emu-runai", runai_project="perception")
    train_pipeline(params_for(synthetic_archive, platform=name, volume="tusimple", snapshot=False))
    ((namespace, _), job), = cluster.objects["mpijobs"].items()
    assert namespace == "runai-perception" and job["metadata"]["labels"]["project"] == "perception"
    for role in ("Launcher", "Worker"):
        template = job["spec"]["mpiReplicaSpecs"][role]["template"]
        assert template["spec"]["schedulerName"] == "runai-scheduler"
        assert template["metadata"]["labels"]["project"] == "perception"
    assert list(cluster.objects["persistentvolumeclaims"]) == [("runai-perception", "tusimple")]


def test_an_mpijob_of_that_name_that_is_not_ours_is_refused(emulator: tuple) -> None:
    emu, cluster = emulator
    custom = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config_dict(emu.kubeconfig()))
    cluster.fail_mpijobs = True  # the stranger's job must not really run anything here
    stranger = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "train-0123456789ab"},
                "spec": {"mpiReplicaSpecs": {
                    "Launcher": {"replicas": 1, "template": {"metadata": {"labels": {}}, "spec": {"containers": [
                        {"name": "l", "image": "x", "command": ["true"]}]}}},
                    "Worker": {"replicas": 1, "template": {"metadata": {"labels": {}}, "spec": {
                        "containers": [{"name": "w", "image": "x"}],
                        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}}}}}}
    create_rwo_claim(emu, "c")
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", stranger)
    spec = TrainingSpec(job_name="train-0123456789ab", volume=VolumeRef(name="c", location="lanes/c"),
                        data_dir="datasets/x", run_dir="runs/train-0123456789ab", preset="cpu-demo", workers=1)
    with pytest.raises(FileExistsError, match="was not created by laneflow"):
        cluster_platform(emu).submit_training(spec)
