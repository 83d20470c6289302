"""The cluster objects laneflow creates, rendered by pure functions and compared with reviewed golden files.

Regenerate after an intended change: ``LANEFLOW_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_k8s_manifests.py``
and review the diff of tests/golden/.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import yaml

from tasks.k8s.manifests import (
    ClusterLayout,
    label_value,
    object_labels,
    render_data_job,
    render_mpijob,
    render_pvc,
    render_snapshot,
    render_sources_secret,
)
from tasks.k8s.scheduling import WorkerScheduling
from tasks.names import InvalidName, validate_mpijob_name
from tests.cluster.admission import check
from tests.cluster.apierrors import Rejection
from training.data.sources import SOURCES_ENV, Artifact, artifacts_from_json

GOLDEN = Path(__file__).parent / "golden"
LAYOUT = ClusterLayout(namespace="lanes", image="registry.example.org/laneflow-train:0.1.0",
                       data_image="registry.example.org/laneflow-data:0.1.0", storage_class="azure-netapp-files",
                       snapshot_class="csi-anf-snapclass", volume_size="500Gi", gpus_per_worker=2)
RUNAI = ClusterLayout(**{**LAYOUT.__dict__, "runai_project": "perception"})
LABELS = object_labels(LAYOUT, "train-7d2eaa95c8df", {"flow-run": "7d2eaa95-c8df-43a7-b772-5e3435d03a6e"})
ARTIFACTS = [Artifact("https://mirror.example.org/tusimple/train_set.zip", "a" * 64),
             Artifact("https://mirror.example.org/tusimple/test_set.zip", "b" * 64),
             Artifact("https://mirror.example.org/tusimple/test_label.json", "c" * 64, "file")]
SETTINGS = {"epochs": "30", "batch_size": "8", "lr": "0.15", "max_steps": "0", "num_workers": "4",
            "eval_split": "val"}


def check_golden(name: str, manifest: dict) -> None:
    path = GOLDEN / f"{name}.yaml"
    rendered = yaml.safe_dump(manifest, sort_keys=True)
    if os.environ.get("LANEFLOW_UPDATE_GOLDEN"):
        path.write_text(rendered)
    assert path.is_file(), f"{path} missing: render it with LANEFLOW_UPDATE_GOLDEN=1 and review it"
    assert yaml.safe_load(path.read_text()) == json.loads(json.dumps(manifest))


def test_mpijob_matches_golden_and_runs_horovodrun_on_gpu_workers() -> None:
    job = render_mpijob("train-7d2eaa95c8df", LAYOUT, "tusimple", "tusimple", 4, "datasets/4d561454fb71df42",
                        "runs/train-7d2eaa95c8df", SETTINGS, LABELS)
    check_golden("mpijob", job)
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"][:8] == ["laneflow-launcher", "python", "-m", "training.horovodrun", "-np", "4",
                                       "--hostfile", "/etc/mpi/hostfile"]
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and job["spec"]["slotsPerWorker"] == 2
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in \
        worker["template"]["spec"]["volumes"]
    assert worker["template"]["metadata"]["labels"]["training.kubeflow.org/job-role"] == "worker"


def test_runai_variant_sets_scheduler_project_label_and_namespace() -> None:
    labels = object_labels(RUNAI, "train-1", {})
    job = render_mpijob("train-1", RUNAI, "tusimple", "tusimple", 2, "datasets/x", "runs/train-1", SETTINGS, labels)
    check_golden("mpijob-runai", job)
    assert job["metadata"]["namespace"] == "runai-perception"
    # Current Run:ai selects the project by `runai/queue`; older versions read `project`: both are set.
    assert job["metadata"]["labels"]["runai/queue"] == job["metadata"]["labels"]["project"] == "perception"
    for role in ("Launcher", "Worker"):
        template = job["spec"]["mpiReplicaSpecs"][role]["template"]
        assert template["spec"]["schedulerName"] == "runai-scheduler"
        assert template["metadata"]["labels"]["runai/queue"] == "perception"


def test_pvc_snapshot_restore_and_data_job_match_golden() -> None:
    check_golden("pvc", render_pvc("tusimple", LAYOUT, LABELS))
    check_golden("pvc-from-snapshot", render_pvc("restored", LAYOUT, LABELS, from_snapshot="tusimple-train-1"))
    check_golden("volumesnapshot", render_snapshot("tusimple-train-1", LAYOUT, "tusimple", LABELS,
                                                   {"laneflow.io/lineage": '{"run": "train-1"}'}))
    check_golden("data-job", render_data_job("prepare-7d2eaa95c8df", LAYOUT, "tusimple", LABELS))
    check_golden("data-job-sources", render_sources_secret("prepare-7d2eaa95c8df", LAYOUT, ARTIFACTS, LABELS))


def test_a_dataset_jobs_urls_reach_its_pod_from_the_secret_never_its_spec() -> None:
    """A SAS in a URL would be readable by anyone who may ``get pods`` (and kept in etcd): the Job names a Secret,
    whose data the prepare command reads from its environment."""
    sas = [Artifact("https://acct.blob.core.windows.net/data/train_set.zip?sv=2024&sig=S3CR3T%3D", "a" * 64)]
    job = render_data_job("prepare-7d2eaa95c8df", LAYOUT, "tusimple", LABELS)
    secret = render_sources_secret("prepare-7d2eaa95c8df", LAYOUT, sas, LABELS)
    assert "sig=" not in json.dumps(job) and "acct.blob" not in json.dumps(job)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (env,) = container["env"]
    reference = env["valueFrom"]["secretKeyRef"]
    assert reference["name"] == secret["metadata"]["name"] and env["name"] == SOURCES_ENV
    assert "--sources-from-env" in container["command"]
    passed = base64.b64decode(secret["data"][reference["key"]]).decode()
    assert artifacts_from_json(passed) == sas  # what the pod's prepare command reads back


def test_every_object_is_labelled_as_ours_and_names_are_checked_first() -> None:
    assert LABELS["app.kubernetes.io/managed-by"] == "laneflow"
    assert all(len(value) <= 63 for value in LABELS.values())
    assert label_value("x" * 80 + "!") == "x" * 63
    with pytest.raises(InvalidName):
        render_mpijob("Train_1", LAYOUT, "c", "tusimple", 2, "d", "r", {}, LABELS)
    with pytest.raises(InvalidName):
        render_pvc("-bad", LAYOUT, LABELS)
    with pytest.raises(ValueError, match="multiple of gpus_per_worker"):
        render_mpijob("train-1", LAYOUT, "c", "tusimple", 3, "d", "r", {}, LABELS)


def test_launcher_never_restarts_and_waits_for_ready_workers() -> None:
    job = render_mpijob("train-1", LAYOUT, "c", "tusimple", 4, "d", "r", SETTINGS, LABELS)
    # On the replica spec (the operator copies it into the pod; one in the pod template is overridden).
    assert job["spec"]["mpiReplicaSpecs"]["Launcher"]["restartPolicy"] == "Never"
    assert "restartPolicy" not in job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert job["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"


def test_an_elastic_mpijob_starts_at_once_over_the_discovery_script_with_a_replica_per_max_worker() -> None:
    spot = {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
            "effect": "NoSchedule"}
    layout = ClusterLayout(**{**LAYOUT.__dict__, "scheduling": WorkerScheduling(tolerations=[spot]),
                              "elastic_cooldown_s": (30, 600), "elastic_timeout_s": 900})
    job = render_mpijob("train-7d2eaa95c8df", layout, "tusimple", "tusimple", 4, "datasets/x",
                        "runs/train-7d2eaa95c8df", {**SETTINGS, "elastic": "1"}, LABELS, elastic=(2, 6))
    check_golden("mpijob-elastic", job)
    assert check(job, "Strict").warnings == []
    assert job["spec"]["launcherCreationPolicy"] == "AtStartup"
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3  # max_workers 6 over 2 GPUs per worker
    assert worker["template"]["spec"]["tolerations"] == [spot]
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["laneflow-launcher", "python", "-m", "training.horovodrun"] and "--hostfile" not in command
    flags = {flag: command[command.index(flag) + 1] for flag in command if flag.startswith("--") and flag != "--set"}
    assert (command[command.index("-np") + 1], flags["--min-np"], flags["--max-np"]) == ("4", "2", "6")
    assert flags["--slots-per-host"] == "2"  # the operator's discover_hosts.sh lists no slot counts
    # the operator's list, less the workers not reachable yet (training/reachable_hosts.py)
    assert flags["--host-discovery-script"] == "python -m training.reachable_hosts /etc/mpi/discover_hosts.sh"
    assert command[command.index("--blacklist-cooldown-range") + 1:][:2] == ["30", "600"]
    assert flags["--elastic-timeout"] == "900" and flags["--network-interface"] == "eth0"
    # A gang of the launcher and min_workers' pods: Run:ai (KAI-Scheduler) gangs every replica otherwise.
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2}
    runai = render_mpijob("train-1", ClusterLayout(**{**layout.__dict__, "runai_project": "perception"}), "c",
                          "tusimple", 4, "d", "r", SETTINGS, LABELS, elastic=(2, 6))
    assert runai["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2}
    assert check(runai, "Strict").warnings == []
    with pytest.raises(ValueError, match=r"elastic\.min_workers=3 is not a multiple of gpus_per_worker=2"):
        render_mpijob("train-1", layout, "c", "tusimple", 4, "d", "r", SETTINGS, LABELS, elastic=(3, 6))


@pytest.mark.parametrize("replicas", [1, 3, 8])
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("runai", [False, True])
def test_every_rendered_object_is_valid_for_the_api_server(replicas: int, gpus: int, runai: bool) -> None:
    """Held to the published schemas (core kinds: Kubernetes' OpenAPI; MPIJob and VolumeSnapshot: their
    CRDs) under fieldValidation=Strict, so an unknown or misplaced field fails here, not on a cluster."""
    layout = ClusterLayout(**{**LAYOUT.__dict__, "gpus_per_worker": gpus, "runai_project": "perception" if runai
                              else None})
    labels = object_labels(layout, "train-7d2eaa95c8df", {"flow-run": "7d2eaa95-c8df-43a7-b772-5e3435d03a6e",
                                                           "dataset-version": "015713982decdf11"})
    objects = [
        render_mpijob("train-7d2eaa95c8df", layout, "tusimple", "tusimple", replicas * gpus, "datasets/x",
                      "runs/train-7d2eaa95c8df", SETTINGS, labels),
        render_pvc("tusimple", layout, labels),
        render_pvc("restored", layout, labels, from_snapshot="tusimple-train-7d2eaa95c8df"),
        render_snapshot("tusimple-train-7d2eaa95c8df", layout, "tusimple", labels,
                        {"laneflow.io/lineage": json.dumps({"run": "train-7d2eaa95c8df", "metrics": {"accuracy": 1}})}),
        render_data_job("prepare-tusimple-4d561454fb71df42", layout, "tusimple", labels),
        render_sources_secret("prepare-tusimple-4d561454fb71df42", layout, ARTIFACTS, labels),
    ]
    for obj in objects:
        assert check(obj, "Strict").warnings == []


@pytest.mark.parametrize(("breakage", "status", "field"), [
    (lambda job: job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("name"), 422,
     "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].name"),
    (lambda job: job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"].update(completions=1), 400,
     "spec.mpiReplicaSpecs.Worker.template.spec.completions"),
    (lambda job: job["spec"].update(mpiImplementation="OpenMPI5"), 422, "spec.mpiImplementation"),
    (lambda job: job["metadata"]["labels"].update({"laneflow.io/run": "x" * 64}), 422, "metadata.labels"),
    (lambda job: job["metadata"].update(name="Train_1"), 422, "metadata.name"),
])
def test_a_broken_object_is_refused_as_the_api_server_refuses_it(breakage, status: int, field: str) -> None:
    job = render_mpijob("train-1", LAYOUT, "c", "tusimple", 4, "d", "r", SETTINGS, LABELS)
    breakage(job)
    with pytest.raises(Rejection) as refused:
        check(job, "Strict")
    assert refused.value.code == status and field in refused.value.body["message"]


def test_job_names_follow_the_mpi_operators_rule() -> None:
    assert validate_mpijob_name("train-7d2eaa95c8df", 512) == "train-7d2eaa95c8df"
    assert validate_mpijob_name("x" * 54, 10) == "x" * 54  # x...-worker-9: 63 characters
    for name, replicas, problem in [("7d2eaa95c8df", 1, "DNS-1035"), ("x" * 54, 11, "64 characters"),
                                    ("x" * 62, 1, "71 characters"), ("train.1", 1, "DNS-1123")]:
        with pytest.raises(InvalidName, match=problem):
            validate_mpijob_name(name, replicas)


def test_every_pod_runs_without_a_token_escalation_root_or_an_unconfined_seccomp_profile() -> None:
    """Nothing in laneflow's pods calls the Kubernetes API (only the flow's own pod, which the Prefect worker makes):
    no token is mounted. No container may gain privileges or run as root; only the MPI workers' sshd is root and
    keeps the runtime's default capabilities (privilege separation, port 22), and logs the launcher in as
    laneflow's user, where the launcher finds its key."""
    data = render_data_job("prepare-7d2eaa95c8df", LAYOUT, "tusimple", LABELS)["spec"]["template"]["spec"]
    replicas = render_mpijob("train-7d2eaa95c8df", LAYOUT, "tusimple", "tusimple", 4, "datasets/x", "runs/r",
                             SETTINGS, LABELS)["spec"]["mpiReplicaSpecs"]
    pods = {"data": data, "launcher": replicas["Launcher"]["template"]["spec"],
            "worker": replicas["Worker"]["template"]["spec"]}
    for role, pod in pods.items():
        assert pod["automountServiceAccountToken"] is False, role
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}, role
        (container,) = pod["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, role
        assert container["securityContext"].get("capabilities") == (
            None if role == "worker" else {"drop": ["ALL"]}), role
        user = {key: container["securityContext"].get(key) for key in ("runAsNonRoot", "runAsUser", "runAsGroup")}
        assert user == ({"runAsNonRoot": None, "runAsUser": 0, "runAsGroup": None} if role == "worker" else
                        {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 0}), role
    job = render_mpijob("train-7d2eaa95c8df", LAYOUT, "tusimple", "tusimple", 4, "datasets/x", "runs/r", SETTINGS,
                        LABELS)
    assert job["spec"]["sshAuthMountPath"] == "/home/laneflow/.ssh"
    assert pods["data"]["securityContext"] is not pods["launcher"]["securityContext"]  # no shared objects
