"""A run started from the UI on the cluster, as Prefect runs it there (issue 33): the real ``prefect worker
start --type kubernetes`` (prefect-kubernetes, with its kopf observer) polls the ``laneflow-k8s`` pool
made from deployments/kubernetes-work-pool.json and creates each flow run's Job on the emulated cluster;
the Job's pod runs ``prefect flow-run execute`` in the training image as service account
``laneflow-flows``, reaches the Prefect API over the pod network and the API server at the
``kubernetes`` Service with its projected token (in-cluster configuration, no kubeconfig), and drives the
data Job, the MPIJob and the snapshot from there. The worker authenticates with a token of its own
service account; every call of both is authorized against deployments/base as shipped.

No flow runs in the test process: the test only creates flow runs and changes their state, as the UI does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import kubernetes
import pytest
import yaml
from prefect import get_client

from tasks.processes import PREFECT_WORKER_SIGNALS, running
from tests.cluster_platform_helpers import TRAIN_IMAGE, admin_core, cluster_platform
from tests.conftest import PROJECT_ROOT, arm_with_tusimple
from tests.gpu_limit import operator_gpu_limit
from tests.tcp_forward import Forwarder
from tests.test_cluster_pipeline import flow_run_messages, granted, needs_kubectl, rendered
from tests.test_pipeline import params_for
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster-worker")]
POOL = "laneflow-k8s"
DEPLOYMENT = "train_pipeline/train-k8s"
NIGHTLY_DEPLOYMENT = "nightly_retrain/nightly-k8s"
SWEEP_DEPLOYMENT = "sweep/sweep-k8s"
PREFECT = str(Path(sys.executable).parent / "prefect")
FLOWS_ACCOUNT = "system:serviceaccount:laneflow:laneflow-flows"
WORKER_ACCOUNT = "system:serviceaccount:laneflow:prefect-worker"
#: The Secret holding the Prefect server's auth string in the flows' namespace (docs/getting-started/cluster.md).
AUTH_SECRET, AUTH_SECRET_KEY = "prefect-api-auth", "auth-string"


def _prefect(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=PROJECT_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def deployed(prefect_server: dict, served_archive: tuple[str, str]) -> Iterator[dict[str, str]]:
    with deployed_to_pool(prefect_server, served_archive) as env:
        yield env


@contextmanager
def deployed_to_pool(prefect_server: dict, served_archive: tuple[str, str]) -> Iterator[dict[str, str]]:
    """The cluster guide's commands (docs/getting-started/cluster.md): the pool from the shipped template, then the
    cluster deployments (removed again afterwards: the session's server is shared with other modules); the
    environment they were made with."""
    url, sha256 = served_archive
    env = {**os.environ, **prefect_server, "LANEFLOW_IMAGE": TRAIN_IMAGE, "LANEFLOW_PLATFORM": "emu-k8s-flows",
           "LANEFLOW_DATASET_INDEX": "https://data.example.org/tusimple/index.json",  # the nightly's default
           **{f"{prefix}_{field}": value for prefix in ("LANEFLOW_TRAIN", "LANEFLOW_TEST", "LANEFLOW_TEST_LABEL")
              for field, value in (("URL", url), ("SHA256", sha256))}}
    _prefect(["work-pool", "create", POOL, "--type", "kubernetes", "--overwrite", "--base-job-template",
              str(PROJECT_ROOT / "deployments" / "kubernetes-work-pool.json")], env)
    _prefect(["deploy", "--prefect-file", "deployments/prefect-kubernetes.yaml", "--all"], env)
    with get_client(sync_client=True) as client:  # no 02:00 nightly of its own while the tests run
        nightly = client.read_deployment_by_name(NIGHTLY_DEPLOYMENT)
        for schedule in client.read_deployment_schedules(nightly.id):
            client.update_deployment_schedule(nightly.id, schedule.id, active=False)
    yield env
    for name in (DEPLOYMENT, NIGHTLY_DEPLOYMENT, SWEEP_DEPLOYMENT):
        _prefect(["deployment", "delete", name], env)
    _prefect(["work-pool", "delete", POOL], env)


@contextmanager
def kubernetes_worker(emu, env: dict[str, str], log: Path,
                      observer_namespaces: str | None = "laneflow") -> Iterator[subprocess.Popen]:
    """``prefect worker start --type kubernetes`` as an operator runs it outside the cluster: a kubeconfig
    with a token of service account ``prefect-worker`` for the cluster's HTTPS endpoint, the observer
    namespaced to ``laneflow``, and the Prefect API at the address pods reach it at (the worker hands its
    own API URL to each flow run's Job; the server itself listens on loopback only, forwarded there while the
    worker runs: ``tests.tcp_forward``). The server's auth string reaches the flow pods from a Secret the operator
    made (docs/getting-started/cluster.md): the worker puts a reference to it into each Job, never the string."""
    from tests.cluster.network import node_address

    core = admin_core(emu)  # the operator, who may create Secrets
    auth = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": AUTH_SECRET, "namespace": "laneflow"},
            "stringData": {AUTH_SECRET_KEY: env["PREFECT_API_AUTH_STRING"]}}
    try:
        core.create_namespaced_secret("laneflow", auth)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_secret(AUTH_SECRET, "laneflow", auth)
    kubeconfig = log.parent / "worker-kubeconfig.yaml"
    kubeconfig.write_text(yaml.safe_dump(emu.kubeconfig(namespace="laneflow", secure=True,
                                                        token=emu.token("laneflow", "prefect-worker"))))
    port = env["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0]
    worker_env = {**env, "KUBECONFIG": str(kubeconfig), "PREFECT_API_URL": f"http://{node_address()}:{port}/api",
                  "PREFECT_WORKER_QUERY_SECONDS": "2",
                  "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME": AUTH_SECRET,
                  "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_KEY": AUTH_SECRET_KEY}
    if observer_namespaces is not None:
        worker_env["PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"] = observer_namespaces
    with Forwarder(node_address(), int(port)), log.open("wb") as sink, \
            running([PREFECT, "worker", "start", "--pool", POOL, "--type", "kubernetes"],
                    stop_signals=PREFECT_WORKER_SIGNALS, grace_s=20, env=worker_env, cwd=log.parent, stdout=sink,
                    stderr=subprocess.STDOUT) as worker:
        yield worker


def _parameters(served_archive: tuple[str, str], **changes: object) -> dict:
    return json.loads(json.dumps(params_for(served_archive, platform="emu-k8s-flows", volume="tusimple", **changes),
                                 default=lambda value: value.model_dump(mode="json")))


def _start(parameters: dict, job_variables: dict | None = None, deployment_name: str = DEPLOYMENT) -> object:
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(deployment_name)
        return client.create_flow_run_from_deployment(deployment.id, parameters=parameters,
                                                      job_variables=job_variables)


def _waiting(what: str, check, log: Path, timeout_s: float, every_s: float = 1.0):
    """``wait_until``, with the worker's log as it is by then when it gives up."""
    try:
        return wait_until(what, check, timeout_s=timeout_s, every_s=every_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; worker log: {log.read_text()[-3000:]}") from None


def _final_state(flow_run_id: object, log: Path, worker: subprocess.Popen, timeout_s: float = 600) -> object:
    def final() -> object:
        assert worker.poll() is None, f"the worker exited: {log.read_text()[-3000:]}"
        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
        except httpx.TransportError:  # the server restarting (the soak restarts it): ask again
            return None
        return state if state is not None and state.is_final() else None
    return _waiting("the flow run's end", final, log, timeout_s)


def _launcher_running(cluster, log: Path) -> None:
    """Until the run's MPIJob launcher runs: training has started."""
    _waiting("a running launcher", lambda: any("launcher" in name and pod["status"].get("phase") == "Running"
                                               for (_, name), pod in list(cluster.objects["pods"].items())),
             log, timeout_s=400, every_s=0.5)


def _flow_pods(cluster, flow_run_id: object) -> list[dict]:
    return [pod for pod in cluster.objects["pods"].values()
            if pod["metadata"].get("labels", {}).get("prefect.io/flow-run-id") == str(flow_run_id)]


def _running_pods(cluster) -> list[str]:
    return [name for (_, name), pod in list(cluster.objects["pods"].items())
            if pod["status"].get("phase") in ("Pending", "Running")]


def _callers(cluster, resource: str, verb: str) -> set[str]:
    return {r.user for r in cluster.requests if r.resource == resource and r.verb == verb}


@needs_kubectl
def test_a_run_from_the_deployment_runs_in_a_job_pod_and_drives_the_cluster_with_in_cluster_credentials(
        deployed: dict, served_archive: tuple[str, str], emulator: tuple, tmp_path: Path) -> None:
    emu, cluster = emulator
    base = rendered("base")
    cluster.load(base)
    cluster_platform(emu, credentials=None, namespace="laneflow").save("emu-k8s-flows", overwrite=True)
    flow_run = _start(_parameters(served_archive, snapshot=True, workers=1, max_steps=2))
    log = tmp_path / "worker.log"
    with kubernetes_worker(emu, deployed, log) as worker:
        state = _final_state(flow_run.id, log, worker)
    assert state.is_completed(), f"{state.name}: {state.message}\n{log.read_text()[-3000:]}"

    # The flow ran in the Job the worker made, in the training image, as laneflow-flows ...
    (job,) = [job for job in cluster.objects["jobs"].values()
              if job["metadata"]["labels"].get("prefect.io/flow-run-id") == str(flow_run.id)]
    spec = job["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "laneflow-flows" and spec["containers"][0]["image"] == TRAIN_IMAGE
    # The server's auth string reached the pod from the operator's Secret: it is nowhere in the Job (kept in etcd,
    # readable by anyone who may get Jobs), only a reference to the Secret is.
    assert deployed["PREFECT_API_AUTH_STRING"] not in json.dumps(job)
    # AKS workload identity's pod label survives the worker's own labels (prefect-kubernetes merges them).
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["azure.workload.identity/use"] == "true"
    assert pod_labels["prefect.io/flow-run-id"] == str(flow_run.id)
    assert {"name": "PREFECT_API_AUTH_STRING", "valueFrom": {"secretKeyRef": {
        "name": AUTH_SECRET, "key": AUTH_SECRET_KEY}}} in spec["containers"][0]["env"]
    wait_until("the flow's Job to succeed (its pod exits after the run's final state)",
               lambda: job["status"].get("succeeded") == 1, timeout_s=120, every_s=0.2)
    # ... and everything it made on the cluster it made from there, with its projected token.
    for resource in ("persistentvolumeclaims", "mpijobs", "volumesnapshots"):
        assert _callers(cluster, resource, "create") == {FLOWS_ACCOUNT}, resource
    assert _callers(cluster, "jobs", "create") == {WORKER_ACCOUNT, FLOWS_ACCOUNT}  # the flow's Job; the data Job
    # The flow run's logs show the training progress, as for a local run.
    messages = flow_run_messages(str(flow_run.id))
    assert any(message.startswith("step 2: loss") for message in messages), messages[-20:]
    assert (cluster.count("mpijobs"), cluster.count("volumesnapshots")) == (1, 1)
    # Each account used exactly its Role: the flows' the Role in deployments/workloads, the worker's its own.
    used = {account: {(r.verb, r.resource) for r in cluster.requests if r.user == account and r.namespace}
            for account in (FLOWS_ACCOUNT, WORKER_ACCOUNT)}
    # (a run that completes needs no more of the worker's Role than creating its Job and observing it)
    assert used[WORKER_ACCOUNT] == {("create", "jobs"), ("list", "jobs"), ("watch", "jobs"), ("list", "pods"),
                                    ("watch", "pods")}
    assert used[FLOWS_ACCOUNT] <= granted(base, "laneflow", role="laneflow-flows")


@needs_kubectl
def test_cancelling_from_the_ui_stops_the_flow_whose_hook_deletes_the_mpijob_and_returns_the_volume(
        deployed: dict, served_archive: tuple[str, str], tmp_path: Path) -> None:
    """Cancel while an MPIJob trains on a volume the run promoted to Premium. Prefect 3.9's ``prefect flow-run
    execute`` (the flow pod's PID 1) supervises the flow's engine process and watches the run's state
    itself (prefect/runner/_cancellation_manager.py): it stops the engine, runs the cancellation hook —
    which deletes the MPIJob (and with it the launcher and workers) and moves the volume back — and exits;
    the run ends Cancelled and nothing of it is left running. (The worker deletes the Job only for a flow
    process that does not answer.)"""
    from prefect.states import Cancelling

    from tests.cluster import KubernetesEmulator
    from tests.cluster.network import node_address
    from tests.cluster.runtime import pod_runtime_missing
    from tests.test_anf import anf_volume, on_anf

    if missing := pod_runtime_missing():
        pytest.skip(missing)
    k8s = KubernetesEmulator(tmp_path / "k8s")
    with arm_with_tusimple(tmp_path / "arm", host=node_address()) as (arm_emulator, state), k8s as cluster:
        on_anf(k8s, state)
        base = rendered("base")
        cluster.load(base)
        # The flow pod reaches Azure at the node address and trusts its CA from the block (no file in the pod).
        anf = anf_volume(arm_emulator, ca_bundle=arm_emulator.ca.cert_pem.bytes().decode())
        cluster_platform(k8s, credentials=None, namespace="laneflow", anf=anf).save("emu-k8s-flows", overwrite=True)
        flow_run = _start(_parameters(served_archive, promote=True, epochs=500))
        log = tmp_path / "worker.log"
        with kubernetes_worker(k8s, deployed, log) as worker:
            _launcher_running(cluster, log)
            assert state.volumes["tusimple"]["pool"] == "pool-premium"
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
            final = _final_state(flow_run.id, log, worker, timeout_s=300)
            wait_until("nothing of the run left running", lambda: not cluster.objects["mpijobs"] and not _running_pods(
                cluster), timeout_s=120, every_s=0.5)
        assert final.is_cancelled(), f"{final.name}: {final.message}"
        assert _callers(cluster, "mpijobs", "delete") == {FLOWS_ACCOUNT}  # the hook, in the flow's pod
        (flow_pod,) = _flow_pods(cluster, flow_run.id)
        assert flow_pod["status"]["phase"] == "Succeeded"  # `prefect flow-run execute` ended cleanly
        messages = flow_run_messages(str(flow_run.id))
        # The hook ran: it stopped the job, or found it gone (the task's own interruption deleted it first).
        assert any(re.search(r"training job train-\w+ (stopped|was not running) \(flow run cancelling\)", message)
                   for message in messages), messages[-20:]
        state.run_out()
        assert state.volumes["tusimple"]["pool"] == "pool-standard", log.read_text()[-3000:]


@needs_kubectl
def test_a_killed_flow_pod_is_marked_crashed_by_the_observer_and_a_retry_adopts_the_running_mpijob(
        deployed: dict, served_archive: tuple[str, str], emulator: tuple, tmp_path: Path) -> None:
    """The flow pod's process is killed while its MPIJob trains (as the kernel's OOM killer or a lost node
    ends it: SIGKILL, no hook runs): the Job fails, the worker's observer sees it in its watch and marks the
    run Crashed. Retrying the run from the UI starts a new Job whose flow adopts the MPIJob still training
    (named after the flow run) instead of submitting a second one, and completes. With a 'gpu' limit of
    the run's two GPUs the retry takes back the slots its killed attempt could not hand back, rather than waiting
    minutes for Prefect's lease on it to expire."""
    from prefect.states import AwaitingRetry

    emu, cluster = emulator
    cluster.load(rendered("base"))
    cluster_platform(emu, credentials=None, namespace="laneflow").save("emu-k8s-flows", overwrite=True)
    flow_run = _start(_parameters(served_archive, epochs=2, snapshot=False))
    log = tmp_path / "worker.log"
    with operator_gpu_limit(2), kubernetes_worker(emu, deployed, log) as worker:  # the run's two GPUs, no more
        _launcher_running(cluster, log)
        (mpijob,) = cluster.objects["mpijobs"].values()
        (flow_pod,) = _flow_pods(cluster, flow_run.id)
        with cluster.lock:
            container = cluster.containers[("laneflow", flow_pod["metadata"]["name"])]
        os.kill(container.init_pid(), signal.SIGKILL)  # the whole container goes with its PID 1
        crashed = _final_state(flow_run.id, log, worker, timeout_s=180)
        assert crashed.is_crashed() and "No active or succeeded pods" in crashed.message, crashed  # the observer
        assert cluster.objects["mpijobs"] and next(iter(cluster.objects["mpijobs"].values())) is mpijob  # no hook ran
        with get_client(sync_client=True) as client:  # the UI's Retry button
            client.set_flow_run_state(flow_run.id, AwaitingRetry(message="Retry from the UI"), force=True)
        wait_until("the retry to be picked up", lambda: len(_flow_pods(cluster, flow_run.id)) == 2, timeout_s=120,
                   every_s=0.5)
        final = _final_state(flow_run.id, log, worker)
    assert final.is_completed(), f"{final.name}: {final.message}\n{log.read_text()[-3000:]}"
    assert [obj["metadata"]["uid"] for obj in cluster.objects["mpijobs"].values()] == [mpijob["metadata"]["uid"]]
    messages = flow_run_messages(str(flow_run.id))
    assert any(message.startswith(f"training job {mpijob['metadata']['name']} adopted") for message in messages), \
        [message for message in messages if message.startswith("training job")]
    assert any("earlier attempt still held a 'gpu' slot" in message for message in messages), messages
    # What the observer needed beyond a completed run: reading a failed Job's pods' logs to forward them.
    used = {(r.verb, r.resource) for r in cluster.requests if r.user == WORKER_ACCOUNT}
    assert used <= granted(rendered("base"), "laneflow", role="prefect-worker")


@needs_kubectl
def test_a_run_whose_image_does_not_exist_says_so_in_its_log_and_never_starts(
        deployed: dict, served_archive: tuple[str, str], emulator: tuple, tmp_path: Path) -> None:
    """A run given an image the registry does not have (a typo in the form's job variables): its pod cannot
    pull it, and the worker's observer writes what Kubernetes says — the image named — into the run's log,
    where the UI shows it; the run stays before Running and nothing of laneflow's starts."""
    emu, cluster = emulator
    cluster.load(rendered("base"))
    cluster_platform(emu, credentials=None, namespace="laneflow").save("emu-k8s-flows", overwrite=True)
    typo = "registry.example.org/laneflow-trian:0.1.0"
    flow_run = _start(_parameters(served_archive), job_variables={"image": typo})
    log = tmp_path / "worker.log"

    def pull_error_logged() -> list[str]:
        return [message for message in flow_run_messages(str(flow_run.id)) if typo in message]
    with kubernetes_worker(emu, deployed, log):
        logged = _waiting("the image pull failure in the run's log", pull_error_logged, log, timeout_s=180)
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
            client.delete_flow_run(flow_run.id)  # no later worker of this pool meets it
    assert "Failed to pull image" in logged[0] and "not found" in logged[0], logged
    assert not state.is_running() and not state.is_final(), state
    assert not cluster.objects["persistentvolumeclaims"] and not cluster.objects["mpijobs"]


@needs_kubectl
def test_a_worker_watching_beyond_its_role_is_refused_with_403_naming_what_it_may_not_do(
        deployed: dict, emulator: tuple, tmp_path: Path) -> None:
    """The worker's Role is namespaced: started without ``..._OBSERVER_NAMESPACES`` its observer lists pods
    and Jobs cluster-wide, which the API server refuses, and the worker's log says so in its words."""
    emu, cluster = emulator
    cluster.load(rendered("base"))
    log = tmp_path / "worker.log"
    with kubernetes_worker(emu, deployed, log, observer_namespaces=None):
        _waiting("the cluster-wide list refused", lambda: 'cannot list resource "pods" in API group "" at the '
                 'cluster scope' in log.read_text(), log, timeout_s=120, every_s=0.5)
    assert f'User "{WORKER_ACCOUNT}"' in log.read_text()
    assert ("list", "pods", None) in {(r.verb, r.resource, r.namespace) for r in cluster.requests
                                      if r.user == WORKER_ACCOUNT}


def test_a_deployment_to_a_pool_that_does_not_exist_is_refused_naming_the_pool(deployed: dict,
                                                                              tmp_path: Path) -> None:
    """A typo in the pool's name (``work_pool.name`` of the deployment file): ``prefect deploy`` refuses it
    and says which pool does not exist, before any run could wait for a worker that never comes."""
    wrong = tmp_path / "prefect-kubernetes.yaml"
    wrong.write_text((PROJECT_ROOT / "deployments" / "prefect-kubernetes.yaml").read_text()
                     .replace(f"name: {POOL}", "name: laneflow-k8z"))
    done = subprocess.run([PREFECT, "--no-prompt", "deploy", "--prefect-file", str(wrong), "--all"], cwd=PROJECT_ROOT,
                          env=deployed, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "references work pool 'laneflow-k8z' which does not" in " ".join((done.stdout + done.stderr).split())
    with get_client(sync_client=True) as client:
        assert not [d for d in client.read_deployments() if d.work_pool_name == "laneflow-k8z"]


@needs_kubectl
def test_a_drain_of_the_flow_pods_node_reschedules_the_run_which_adopts_the_mpijob_still_training(
        deployed: dict, served_archive: tuple[str, str], emulator: tuple, tmp_path: Path) -> None:
    """Routine maintenance (a node-image upgrade, the autoscaler's scale-down) drains the system node the flow
    pod runs on; the launcher runs on the other one. The kubelet's SIGTERM reaches `prefect flow-run execute`,
    which reschedules the run (the worker's behaviour for a Job of backoffLimit 0); the flow leaves its MPIJob
    training, the worker starts the run again in a new pod on the node that remains, and that attempt adopts
    the MPIJob — the same one, never deleted — and completes."""
    from tests.cluster.node_lifecycle import cordon, drain

    emu, cluster = emulator
    cluster.load(rendered("base"))
    cluster_platform(emu, credentials=None, namespace="laneflow").save("emu-k8s-flows", overwrite=True)
    admin = admin_core(emu)  # who drains nodes
    flow_run = _start(_parameters(served_archive, epochs=3, snapshot=False))
    log = tmp_path / "worker.log"
    with kubernetes_worker(emu, deployed, log) as worker:
        first = _waiting("the flow pod to be scheduled", lambda: next(
            (pod for pod in _flow_pods(cluster, flow_run.id) if pod["spec"].get("nodeName")), None), log, 120, 0.2)
        node = first["spec"]["nodeName"]
        cordon(cluster, node)  # what the flow starts lands on the other system node: only the flow pod is here
        _launcher_running(cluster, log)
        (mpijob,) = cluster.objects["mpijobs"].values()
        assert drain(admin, cluster, node) == [first["metadata"]["name"]]
        final = _final_state(flow_run.id, log, worker)
    assert final.is_completed(), f"{final.name}: {final.message}\n{log.read_text()[-3000:]}"
    # The evicted pod is gone; the run's second attempt ran in a pod of its own on the node that remained.
    pods = _flow_pods(cluster, flow_run.id)
    placed = [(pod["metadata"]["name"], pod["spec"]["nodeName"]) for pod in pods]
    assert placed and all(name != first["metadata"]["name"] and on != node for name, on in placed), placed
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).run_count == 2  # rescheduled once, not retried for a failure
    # One MPIJob all along: handed over, not deleted and made again.
    assert [obj["metadata"]["uid"] for obj in cluster.objects["mpijobs"].values()] == [mpijob["metadata"]["uid"]]
    assert _callers(cluster, "mpijobs", "delete") == set()
    messages = flow_run_messages(str(flow_run.id))
    assert any(message.startswith(f"training job {mpijob['metadata']['name']} adopted") for message in messages), \
        [message for message in messages if message.startswith("training job")]
