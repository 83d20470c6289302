"""The seeded soak (tests/soak.py) through the real Prefect Kubernetes worker on the AKS-shaped emulated cluster:
one short seed here; ``make soak SEED=<n>`` runs a longer one (``LANEFLOW_SOAK_SEEDS``, ``LANEFLOW_SOAK_RUNS``,
``LANEFLOW_SOAK_DISRUPTIONS``) and prints its table."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes
import pytest
import urllib3
from prefect import get_client

from tasks.names import run_name
from tasks.platforms.cluster.training import remove_expired
from tests.cluster import KubernetesEmulator
from tests.cluster.aks import GPU_TAINT, SPOT_TAINT, aks_nodes, pool_node, preempt
from tests.cluster.node_lifecycle import drain, lose, uncordon
from tests.cluster.state import Cluster, Fault
from tests.cluster_platform_helpers import admin_core, cluster_platform
from tests.gpu_limit import active_gpu_slots, operator_gpu_limit
from tests.soak import (
    Disruption,
    Plan,
    RunRecord,
    broken_invariants,
    plan,
    read_metrics,
    resumptions,
    run_parameters,
    table,
)
from tests.test_cluster_pipeline import needs_kubectl, rendered
from tests.test_cluster_worker import _final_state, _parameters, _start, deployed_to_pool, kubernetes_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster-worker")]
NAMESPACE = "laneflow"
#: A step event as a launcher prints it (within OpenMPI's or Gloo's rank tags).
STEP = re.compile(r'\{"event": "step", "step": (?P<step>\d+)')
#: How long a drained node stays cordoned, and how soon a lost or preempted VM is replaced in its pool.
BACK_IN_SERVICE_S = 5.0
#: How long one run may take before the seed is said to hang (its cluster described).
RUN_TIMEOUT_S = float(os.environ.get("LANEFLOW_SOAK_RUN_TIMEOUT_S", "900"))


class Disruptor:
    """Fires each disruption of a plan once, when its run's launcher first reports the disruption's step."""

    def __init__(self, plan_: Plan, cluster: Cluster, admin: kubernetes.client.CoreV1Api,
                 jobs: list[str], flow_runs: list[str]) -> None:
        self.plan, self.cluster, self.admin, self.jobs, self.flow_runs = plan_, cluster, admin, jobs, flow_runs
        self.pending = list(plan_.disruptions)
        self.fired: list[tuple[Disruption, str]] = []  # (disruption, what it did)
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.replacements = 0

    def on_line(self, cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if "-launcher-" not in pod or '"event": "step"' not in line:
            return
        run = next((index for index, job in enumerate(self.jobs) if pod.startswith(f"{job}-launcher-")), None)
        said = STEP.search(line)  # a launcher line may hold more than one rank's output
        if run is None or said is None:
            return
        step = int(said["step"])
        with self.lock:
            due = [hit for hit in self.pending if hit.run == run and hit.at_step <= step]
            for hit in due:
                self.pending.remove(hit)
        for hit in due:
            thread = threading.Thread(target=self._fire, args=(hit,), name=f"soak-{hit.kind}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=180)

    # --- the disruptions --------------------------------------------------------------------------------
    def _fire(self, hit: Disruption) -> None:
        try:
            did = self._with_retries(getattr(self, "_" + hit.kind.replace("-", "_")), hit.run)
        except Exception as exc:  # a disruption that could not be done is a soak failure, said as such
            self.errors.append(f"{hit.kind} on run {hit.run}: {type(exc).__name__}: {exc}")
            did = f"failed: {exc}"
        with self.lock:
            self.fired.append((hit, did))
        print(f"{time.strftime('%H:%M:%S')} {hit.kind} on run {hit.run} at step {hit.at_step}: {did}", flush=True)

    @staticmethod
    def _with_retries(action: Callable[[int], str], run: int, tries: int = 5) -> str:
        """An operator runs ``kubectl drain`` again when the API answered 5xx or 429 (an error burst of the soak's
        own may meet the disruption's calls too)."""
        for attempt in range(1, tries + 1):
            try:
                return action(run)
            except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError) as exc:
                status = getattr(exc, "status", None)
                if attempt == tries or (status is not None and status < 500 and status != 429):
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def _pods(self, selector: str) -> list[dict]:
        with self.cluster.lock:
            return [pod for (namespace, _), pod in self.cluster.objects["pods"].items() if namespace == NAMESPACE
                    and all(pod["metadata"].get("labels", {}).get(key) == value for key, value in
                            (part.split("=", 1) for part in selector.split(",")))
                    and pod["status"].get("phase") in ("Pending", "Running") and pod["spec"].get("nodeName")
                    and not pod["metadata"].get("deletionTimestamp")]

    def _node_of(self, selector: str) -> str | None:
        pods = self._pods(selector)
        return pods[0]["spec"]["nodeName"] if pods else None

    def _drain(self, node: str | None, what: str) -> str:
        if node is None or node not in self.cluster.nodes:
            return f"no {what} to drain"
        evicted = drain(self.admin, self.cluster, node, delete_emptydir_data=True, force=True, retry_every_s=1.0,
                        timeout_s=60)
        time.sleep(BACK_IN_SERVICE_S)
        if node in self.cluster.nodes:
            uncordon(self.cluster, node)
        return f"drained {node} ({len(evicted)} pods)"

    def _drain_flow_node(self, run: int) -> str:
        return self._drain(self._node_of(f"prefect.io/flow-run-id={self.flow_runs[run]}"), "flow pod")

    def _drain_launcher_node(self, run: int) -> str:
        return self._drain(self._node_of(f"training.kubeflow.org/job-name={self.jobs[run]},"
                                         "training.kubeflow.org/job-role=launcher"), "launcher")

    def _worker_node(self, run: int) -> str | None:
        return self._node_of(f"training.kubeflow.org/job-name={self.jobs[run]},training.kubeflow.org/job-role=worker")

    def _drain_worker_node(self, run: int) -> str:
        return self._drain(self._worker_node(run), "worker")

    def _pool_of(self, node: str) -> tuple[str, str]:
        with self.cluster.lock:
            labels = self.cluster.nodes[node].labels
            return labels["agentpool"], labels["node.kubernetes.io/instance-type"]

    def _replace_vm(self, node: str, pool: str, size: str) -> str:
        """The pool's scale set brings a new VM (of ``size``) in place of ``node`` once the Node is gone."""
        wait_until(f"node {node} to be deleted", lambda: node not in self.cluster.nodes, timeout_s=120, every_s=0.2)
        time.sleep(BACK_IN_SERVICE_S)
        self.replacements += 1
        spot = pool == "gpuspot"
        new = pool_node(pool, 100 + self.replacements, size, spot=spot,
                        taints=[GPU_TAINT, SPOT_TAINT] if spot else [GPU_TAINT])
        with self.cluster.lock:
            self.cluster.nodes[new.name] = new
        return new.name

    def _preempt_spot(self, run: int) -> str:
        node = self._worker_node(run)
        with self.cluster.lock:
            spot = [name for name, n in self.cluster.nodes.items() if n.labels.get("agentpool") == "gpuspot"]
        if node not in spot:
            node = spot[0] if spot else None
        if node is None:
            return "no spot node"
        pool = self._pool_of(node)
        preempt(self.admin, self.cluster, node, notice_s=3.0).join(timeout=120)
        return f"preempted {node}, replaced by {self._replace_vm(node, *pool)}"

    def _lose_node(self, run: int) -> str:
        node = self._worker_node(run)
        if node is None:
            return "no worker node"
        pool = self._pool_of(node)
        lose(self.cluster, node, vm_gone=True)
        return f"lost {node}, replaced by {self._replace_vm(node, *pool)}"

    def _evict_worker(self, run: int) -> str:
        pods = self._pods(f"training.kubeflow.org/job-name={self.jobs[run]},training.kubeflow.org/job-role=worker")
        if not pods:
            return "no worker"
        name = pods[0]["metadata"]["name"]
        body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=NAMESPACE))
        self.admin.create_namespaced_pod_eviction(name, NAMESPACE, body)
        return f"evicted {name}"

    def _api_errors(self, run: int) -> str:
        burst = (Fault(status=500), Fault(status=429, retry_after=1), Fault(status=0))
        for resource in ("pods", "jobs", "mpijobs"):
            self.cluster.inject("GET", resource, *burst)
        return "500, 429 and a reset on GET pods, jobs and mpijobs"


def soak(seed: int, runs: int, disruptions: int, deployed: dict, served_archive: tuple[str, str],
         folder: Path) -> tuple[Plan, list[RunRecord], list[str]]:
    """Run seed ``seed``: the plan's runs side by side from the deployment, its disruptions as they come due; the
    plan, what each run did, and the invariants it broke."""
    plan_ = plan(seed, runs, disruptions)
    emulator = KubernetesEmulator(folder / "k8s")
    log = folder / "worker.log"
    with emulator as cluster:
        # The controllers' and kubelet's periods shortened alike (node monitor, pod GC, ConfigMap sync).
        cluster.node_monitor_grace_s, cluster.node_monitor_period_s = 2.0, 0.5
        cluster.podgc_quarantine_s, cluster.podgc_period_s = 0.5, 1.0
        cluster.configmap_sync_s = 2.0
        # A GPU pool of one single-GPU node and a spot pool of two 4-GPU nodes: every 2-worker run spans both pools
        # (the scheduler's first fit), so spot preemptions and node losses hit runs, as on a cluster short of GPUs.
        cluster.nodes = {**aks_nodes(system=2, gpu=0, spot=0),
                         **{node.name: node for node in (
                             pool_node("gpu", 0, "Standard_NC24ads_A100_v4", taints=[GPU_TAINT]),
                             *(pool_node("gpuspot", index, "Standard_NC96ads_A100_v4", spot=True,
                                         taints=[GPU_TAINT, SPOT_TAINT]) for index in range(2)))}}
        cluster.load(rendered("base"))
        cluster_platform(emulator, credentials=None, namespace=NAMESPACE, termination_grace_s=20,
                         pod_problem_grace_s=10, elastic_cooldown_min_s=2, elastic_cooldown_max_s=30,
                         ).save("emu-k8s-flows", overwrite=True)
        admin = admin_core(emulator)
        records: list[RunRecord] = []
        with operator_gpu_limit(runs), kubernetes_worker(emulator, deployed, log) as worker:
            started = [_start(_parameters(served_archive, **run_parameters(kind))) for kind in plan_.runs]
            disruptor = Disruptor(plan_, cluster, admin, [run_name(run.id) for run in started],
                                  [str(run.id) for run in started])
            cluster.on_log_line = disruptor.on_line
            try:
                finals = [_final_state(run.id, log, worker, timeout_s=RUN_TIMEOUT_S) for run in started]
            except AssertionError:
                print(f"seed {seed}: a run did not end; the cluster then:\n{_describe(cluster)}")
                for hit, did in disruptor.fired:
                    print(f"  {hit.kind} on run {hit.run} at step {hit.at_step}: {did}")
                raise
            cluster.on_log_line = None
            disruptor.join()
            with get_client(sync_client=True) as client:
                attempts = [client.read_flow_run(run.id).run_count for run in started]
            slots_held = active_gpu_slots()  # while the limit is there: the operator's, set for the soak
        claim = cluster.claim_dir(NAMESPACE, "tusimple")
        for index, (kind, run, final) in enumerate(zip(plan_.runs, started, finals, strict=True)):
            hits = [f"{hit.kind}@{hit.at_step}" for hit, _ in disruptor.fired if hit.run == index]
            records.append(RunRecord(index, kind, str(run.id), final.name, final.message or "", attempts[index],
                                     hits, resumptions(read_metrics(claim / "runs" / run_name(run.id) /
                                                                    "metrics.jsonl"))))
        left_running = _still_running(cluster)
        left_after_ttl = _left_after_ttl(emulator, cluster)
        broken = broken_invariants(records, slots_held, left_running, left_after_ttl) + disruptor.errors
    print(table(plan_, records, broken))
    for hit, did in disruptor.fired:
        print(f"  {hit.kind} on run {hit.run} at step {hit.at_step}: {did}")
    return plan_, records, broken


def _describe(cluster: Cluster) -> str:
    """What ``kubectl get nodes,pods,mpijobs`` and the last events would show, for a seed that went wrong."""
    with cluster.lock:
        nodes = [f"node {name}: {'lost ' if name in cluster.lost_nodes else ''}ready={node.ready} "
                 f"cordoned={node.unschedulable}" for name, node in cluster.nodes.items()]
        pods = [f"pod {name} on {pod['spec'].get('nodeName')}: {pod['status'].get('phase')}"
                f"{' terminating' if pod['metadata'].get('deletionTimestamp') else ''}"
                f"{_container_state(cluster, namespace, name)}"
                for (namespace, name), pod in cluster.objects["pods"].items()]
        jobs = [f"mpijob {name}: " + ", ".join(f"{c['type']}={c['status']}" for c in
                                             (job.get("status") or {}).get("conditions") or [])
                for (_, name), job in cluster.objects["mpijobs"].items()]
        events = sorted(cluster.objects["events"].values(), key=lambda e: int(e["metadata"]["uid"].split("-")[1]))
        said = [f"event {e['reason']} {e['involvedObject']['name']}: {e['message'][:160]}" for e in events[-40:]]
    return "\n".join(nodes + pods + jobs + said)


def _container_state(cluster: Cluster, namespace: str, pod: str) -> str:
    container = cluster.containers.get((namespace, pod))
    return " (no container)" if container is None else "" if container.pids() else " (its processes are gone)"


def _still_running(cluster: Cluster) -> list[str]:
    """Pods still running a minute after every run ended (a flow pod exits after its run's final state, an MPIJob's
    pods go with its end): none should be."""
    def running() -> list[str]:
        with cluster.lock:
            return [name for (_, name), pod in cluster.objects["pods"].items()
                    if pod["status"].get("phase") in ("Pending", "Running")]
    with contextlib.suppress(AssertionError):
        wait_until("every pod to end", lambda: not running(), timeout_s=60, every_s=0.5)
    return running()


def _left_after_ttl(emulator: KubernetesEmulator, cluster: Cluster) -> list[str]:
    """A day later: the TTL controller removed finished Jobs, laneflow removes finished MPIJobs (with their ssh
    Secret and hostfile ConfigMap); what is left of laneflow's objects."""
    platform = cluster_platform(emulator, namespace=NAMESPACE)
    cluster.advance(platform.finished_ttl_s + 60)
    time.sleep(2)  # the TTL controller's tick
    remove_expired(platform, lambda _: None)
    def ours(kind: str, name: str, obj: dict) -> bool:  # made by laneflow, or by the operator for an MPIJob of it
        return obj["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "laneflow" or (
            kind in ("secrets", "configmaps") and name.startswith("train-"))

    with cluster.lock:
        return [f"{kind}/{name}" for kind in ("mpijobs", "jobs", "secrets", "configmaps")
                for (namespace, name), obj in cluster.objects[kind].items()
                if namespace == NAMESPACE and ours(kind, name, obj)]


@pytest.fixture(scope="module")
def deployed(prefect_server: dict, served_archive: tuple[str, str]) -> Iterator[dict[str, str]]:
    with deployed_to_pool(prefect_server, served_archive) as env:
        yield env


def _seeds() -> list[int]:
    return [int(seed) for seed in os.environ.get("LANEFLOW_SOAK_SEEDS", "").split(",") if seed.strip()]


@needs_kubectl
def test_a_short_seed_keeps_every_invariant(deployed: dict, served_archive: tuple[str, str], tmp_path: Path) -> None:
    """Two runs side by side (a plain and an elastic one) and two disruptions: a drain of the node of the plain
    run's MPI launcher (with it the flow pods there), then of the elastic run's flow pod's node (seed 4)."""
    plan_, records, broken = soak(4, 2, 2, deployed, served_archive, tmp_path)
    assert not broken, table(plan_, records, broken)


@needs_kubectl
@pytest.mark.skipif(not _seeds(), reason="make soak SEED=<n> (LANEFLOW_SOAK_SEEDS) runs the long soak")
@pytest.mark.parametrize("seed", _seeds() or [0])
def test_soak(seed: int, deployed: dict, served_archive: tuple[str, str], tmp_path: Path) -> None:
    runs = int(os.environ.get("LANEFLOW_SOAK_RUNS", "3"))
    disruptions = int(os.environ.get("LANEFLOW_SOAK_DISRUPTIONS", "5"))
    plan_, records, broken = soak(seed, runs, disruptions, deployed, served_archive, tmp_path)
    assert not broken, table(plan_, records, broken)
