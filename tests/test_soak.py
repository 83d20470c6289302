"""The seeded soak (tests/soak.py) through the real Prefect Kubernetes worker on the AKS-shaped emulated cluster:
one short seed here; ``make soak SEED=<n>`` runs a longer one (``LANEFLOW_SOAK_SEEDS``, ``LANEFLOW_SOAK_RUNS``,
``LANEFLOW_SOAK_DISRUPTIONS``) and prints its table."""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from uuid import UUID

import kubernetes
import optuna
import pytest
import urllib3
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from prefect import get_client
from prefect.variables import Variable

from flows.study import journal_path
from tasks.champion import champion_variable
from tasks.platforms.cluster.training import remove_expired
from tests.azure import Arm
from tests.cluster import KubernetesEmulator
from tests.cluster.aks import GPU_TAINT, SPOT_TAINT, aks_nodes, pool_node, preempt
from tests.cluster.network import node_address
from tests.cluster.node_lifecycle import drain, lose, uncordon
from tests.cluster.state import Cluster, Fault
from tests.cluster_platform_helpers import admin_core, cluster_platform
from tests.conftest import SessionServer, arm_with_tusimple
from tests.gpu_limit import active_gpu_slots, operator_gpu_limit
from tests.soak import (
    STUDY,
    Disruption,
    Plan,
    RunRecord,
    broken_invariants,
    deployment_of,
    plan,
    read_metrics,
    resumptions,
    run_parameters,
    table,
)
from tests.test_anf import anf_volume, level_record, on_anf
from tests.test_cluster_pipeline import needs_kubectl, rendered
from tests.test_cluster_worker import _final_state, _parameters, _start, deployed_to_pool, kubernetes_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster-worker")]
NAMESPACE = "laneflow"
#: Where the soak's ANF volume lives when no run has it promoted (arm_with_tusimple).
HOME_POOL = "pool-standard"
#: A step event as a launcher prints it (within OpenMPI's or Gloo's rank tags).
STEP = re.compile(r'\{"event": "step", "step": (?P<step>\d+)')
#: How long a drained node stays cordoned, and how soon a lost or preempted VM is replaced in its pool.
BACK_IN_SERVICE_S = 5.0
#: ``anf-slow``: how long each pool change Azure accepts takes, for how long (well within the block's wait for one).
ANF_SLOW_S, ANF_TROUBLE_S = 8.0, 60.0
#: How long one run may take before the seed is said to hang (its cluster described).
RUN_TIMEOUT_S = float(os.environ.get("LANEFLOW_SOAK_RUN_TIMEOUT_S", "900"))
#: The short seed's runs take about 2 minutes: they are said to hang well within the suite's 600 s per test, so that
#: a hang shows the cluster and the training pods' logs rather than a bare pytest timeout.
SHORT_SEED_RUN_TIMEOUT_S = 420.0
#: How much of each MPI pod's log a hang shows.
LOG_TAIL_LINES = 25


class Disruptor:
    """Fires each disruption of a plan once, when a training of its run (a sweep's trial, a nightly's challenger)
    first reports the disruption's step."""

    def __init__(self, plan_: Plan, cluster: Cluster, admin: kubernetes.client.CoreV1Api, flow_runs: list[str],
                 server: SessionServer, arm: Arm) -> None:
        self.plan, self.cluster, self.admin, self.flow_runs = plan_, cluster, admin, flow_runs
        self.server, self.arm, self.anf_quick_s = server, arm, arm.operation_s
        self.pending = list(plan_.disruptions)
        self.fired: list[tuple[Disruption, str]] = []  # (disruption, what it did)
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.replacements = 0
        #: Each training flow run (the ``laneflow.io/flow-run`` label of its pods) -> the index of its soak run.
        self.run_of: dict[str, int | None] = {str(run): index for index, run in enumerate(flow_runs)}
        self.resolving: set[str] = set()
        #: The MPIJobs each run has trained with so far; its last one is where a disruption of it lands.
        self.trainings: dict[int, list[str]] = {index: [] for index in range(len(flow_runs))}
        self.context = contextvars.copy_context()  # Prefect's settings (the API URL), for the threads it starts

    def on_line(self, cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if "-launcher-" not in pod or '"event": "step"' not in line:
            return
        said = STEP.search(line)  # a launcher line may hold more than one rank's output
        with cluster.lock:
            labels = (cluster.objects["pods"].get((namespace, pod)) or {}).get("metadata", {}).get("labels", {})
        job, flow_run = labels.get("training.kubeflow.org/job-name"), labels.get("laneflow.io/flow-run")
        if said is None or job is None or flow_run is None:
            return
        run = self._run_of(flow_run)
        if run is None:
            return
        step = int(said["step"])
        with self.lock:
            if job not in self.trainings[run]:
                self.trainings[run].append(job)
            due = [hit for hit in self.pending if hit.run == run and hit.at_step <= step]
            for hit in due:
                self.pending.remove(hit)
        for hit in due:
            self._start(self._fire, hit, name=f"soak-{hit.kind}")

    def _start(self, target: Callable, *args: object, name: str) -> None:
        thread = threading.Thread(target=self.context.copy().run, args=(target, *args), name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _run_of(self, flow_run: str) -> int | None:
        """The soak run a training flow run belongs to: itself, or the sweep or nightly it is a child of (asked of
        Prefect once, in a thread of its own: the caller is a container's output)."""
        with self.lock:
            if flow_run in self.run_of:
                return self.run_of[flow_run]
            if flow_run in self.resolving:
                return None
            self.resolving.add(flow_run)
        self._start(self._resolve, flow_run, name="soak-resolve")
        return None

    def _resolve(self, flow_run: str) -> None:
        try:
            with get_client(sync_client=True) as client:
                current = flow_run
                while current not in self.run_of:
                    parent = client.read_flow_run(UUID(current)).parent_task_run_id
                    if parent is None:
                        break
                    current = str(client.read_task_run(parent).flow_run_id)
            with self.lock:
                self.run_of[flow_run] = self.run_of.get(current)
        except Exception:  # the server restarting, say: the run's next step line asks again
            pass
        finally:
            with self.lock:
                self.resolving.discard(flow_run)

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

    def _training(self, run: int) -> str:
        with self.lock:
            return self.trainings[run][-1]

    def _drain_launcher_node(self, run: int) -> str:
        return self._drain(self._node_of(f"training.kubeflow.org/job-name={self._training(run)},"
                                         "training.kubeflow.org/job-role=launcher"), "launcher")

    def _worker_node(self, run: int) -> str | None:
        return self._node_of(f"training.kubeflow.org/job-name={self._training(run)},"
                             "training.kubeflow.org/job-role=worker")

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
        pods = self._pods(f"training.kubeflow.org/job-name={self._training(run)},"
                          "training.kubeflow.org/job-role=worker")
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

    def _restart_server(self, run: int) -> str:
        started = time.monotonic()
        self.server.restart()
        return f"Prefect server restarted ({time.monotonic() - started:.0f} s down)"

    def _anf_slow(self, run: int) -> str:
        """Azure takes ANF_SLOW_S for each pool change accepted in the next ANF_TROUBLE_S, then is quick again."""
        with self.arm.lock:
            self.arm.operation_s = ANF_SLOW_S
        self._start(self._anf_recovers, name="soak-anf-recovers")
        return f"pool changes take {ANF_SLOW_S:.0f} s for {ANF_TROUBLE_S:.0f} s"

    def _anf_recovers(self) -> None:
        time.sleep(ANF_TROUBLE_S)
        with self.arm.lock:
            self.arm.operation_s = self.anf_quick_s

    def _anf_errors(self, run: int) -> str:
        with self.arm.lock:
            self.arm.faults["pool_change"] += [500, 429, 503]
        return "the next pool changes answered 500, 429 and 503"


def soak(seed: int, runs: int, disruptions: int, deployed: dict, served_archive: tuple[str, str],
         server: SessionServer, folder: Path, run_timeout_s: float = RUN_TIMEOUT_S
         ) -> tuple[Plan, list[RunRecord], list[str]]:
    """Run seed ``seed``: the plan's runs side by side from the deployments, its disruptions as they come due; the
    plan, what each run did, and the invariants it broke."""
    plan_ = plan(seed, runs, disruptions)
    emulator = KubernetesEmulator(folder / "k8s")
    log = folder / "worker.log"
    # Azure at the pod network's node address (flow pods reach it there), trusted from the block's CA.
    with arm_with_tusimple(folder / "arm", host=node_address()) as (arm_emulator, arm), emulator as cluster:
        on_anf(emulator, arm)
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
        anf = anf_volume(arm_emulator, ca_bundle=arm_emulator.ca.cert_pem.bytes().decode())
        # The pods' grace covers what a drained elastic worker needs: up to five steps to its next stop check (an
        # elastic run checks every fifth step) and a checkpoint. A CPU step of this model takes 7-15 s on two busy
        # cores: 60 s was short when both of a run's workers sat on the drained node (exit 255, twice in three
        # tries under load), and a grace that is not needed costs nothing.
        cluster_platform(emulator, credentials=None, namespace=NAMESPACE, termination_grace_s=150,
                         pod_problem_grace_s=10, elastic_cooldown_min_s=2, elastic_cooldown_max_s=30, anf=anf,
                         ).save("emu-k8s-flows", overwrite=True)
        admin = admin_core(emulator)
        # A fresh cluster is a fresh world: no champion crowned on an earlier seed's (gone) volume.
        Variable.unset(champion_variable("tusimple"))
        records: list[RunRecord] = []
        # Every run side by side: a 'gpu' slot for each GPU each run may train on (an elastic run's max_workers).
        gpus = sum((training.get("elastic") or {}).get("max_workers", training["workers"])
                   for training, _ in map(run_parameters, plan_.runs))
        with operator_gpu_limit(gpus), kubernetes_worker(emulator, deployed, log) as worker:
            started = [_start({**_parameters(served_archive, **training), **own}, deployment_name=deployment_of(kind))
                       for kind in plan_.runs for training, own in [run_parameters(kind)]]
            disruptor = Disruptor(plan_, cluster, admin, [str(run.id) for run in started], server, arm)
            cluster.on_log_line = disruptor.on_line
            try:
                finals = [_final_state(run.id, log, worker, timeout_s=run_timeout_s) for run in started]
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
            trainings = disruptor.trainings[index]
            records.append(RunRecord(index, kind, str(run.id), final.name, final.message or "", attempts[index],
                                     hits, [resumed for training in trainings for resumed in
                                            resumptions(read_metrics(claim / "runs" / training / "metrics.jsonl"))],
                                     trainings))
        left_running = _still_running(cluster)
        volumes_away = _volumes_away(emulator, arm)
        left_after_ttl = _left_after_ttl(emulator, cluster)
        studies = [] if "sweep" not in plan_.runs else _unreadable_studies(claim / journal_path(STUDY), STUDY)
        broken = broken_invariants(records, slots_held, left_running, left_after_ttl, volumes_away, studies
                                   ) + disruptor.errors
        if broken:  # what the MPI pods said, kept on disk after their pods went: why a run failed as it did
            print(_mpi_pod_outputs(cluster))
    print(table(plan_, records, broken))
    for hit, did in disruptor.fired:
        print(f"  {hit.kind} on run {hit.run} at step {hit.at_step}: {did}")
    return plan_, records, broken


def _volumes_away(emulator: KubernetesEmulator, arm: Arm) -> list[str]:
    """ANF volumes not on their home pool, or with a level still held, once Azure ran out what it had accepted."""
    arm.run_out()
    with arm.lock:
        away = [f"{name} on {volume['pool']}" for name, volume in arm.volumes.items() if volume["pool"] != HOME_POOL]
    held = level_record(emulator, "tusimple", NAMESPACE)
    return away + ([f"tusimple still holds {held.model_dump_json()}"] if held is not None else [])


def _unreadable_studies(journal: Path, study: str) -> list[str]:
    """The sweep's study as stock Optuna reads it: unreadable, or with a trial still running, is a broken study."""
    try:
        trials = optuna.load_study(study_name=study, storage=JournalStorage(JournalFileBackend(str(journal)))
                                   ).get_trials(deepcopy=False)
    except Exception as exc:
        return [f"{journal.name}: {type(exc).__name__}: {exc}"]
    running = [trial.number for trial in trials if trial.state == optuna.trial.TrialState.RUNNING]
    return [f"{journal.name}: trial(s) {running} still RUNNING"] if running else []


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
        logs = [f"--- log of {name} ---\n" + "\n".join(text[:300] for _, text in log.lines[-LOG_TAIL_LINES:])
                for (_, name), log in cluster.logs.items() if "-launcher-" in name or "-worker-" in name]
    return "\n".join(nodes + pods + jobs + said + logs)


def _mpi_pod_outputs(cluster: Cluster) -> str:
    """The last lines of every launcher's and worker's containers, from the runtime's files (the pods' logs go
    with the pods)."""
    tails = []
    for output in sorted((cluster.root / "pods" / NAMESPACE).glob("*/c*/output.log")):
        pod = output.parent.parent.name
        if "-launcher-" in pod or "-worker-" in pod:
            lines = output.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            tails.append(f"--- {pod}/{output.parent.name} ---\n" + "\n".join(line[:300] for line in lines))
    return "\n".join(tails)


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
def test_a_short_seed_keeps_every_invariant(deployed: dict, served_archive: tuple[str, str],
                                            session_server: SessionServer, tmp_path: Path) -> None:
    """Two runs side by side (an elastic and a one-worker one), each promoting the shared ANF volume, and two
    disruptions: a drain of the node of one of the elastic run's workers, then of the node of the other run's MPI
    launcher (seed 4)."""
    plan_, records, broken = soak(4, 2, 2, deployed, served_archive, session_server, tmp_path,
                                  run_timeout_s=SHORT_SEED_RUN_TIMEOUT_S)
    assert not broken, table(plan_, records, broken)


@needs_kubectl
@pytest.mark.skipif(not _seeds(), reason="make soak SEED=<n> (LANEFLOW_SOAK_SEEDS) runs the long soak")
@pytest.mark.parametrize("seed", _seeds() or [0])
def test_soak(seed: int, deployed: dict, served_archive: tuple[str, str], session_server: SessionServer,
              tmp_path: Path) -> None:
    runs = int(os.environ.get("LANEFLOW_SOAK_RUNS", "3"))
    disruptions = int(os.environ.get("LANEFLOW_SOAK_DISRUPTIONS", "5"))
    plan_, records, broken = soak(seed, runs, disruptions, deployed, served_archive, session_server, tmp_path)
    assert not broken, table(plan_, records, broken)
