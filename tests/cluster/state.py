"""The emulated cluster's state, shared by its components: every stored object, the pods' containers, logs
and networks, the images that exist, the faults queued for the API server and the requests it served, and
the knobs tests turn (back-off times, the node's capacity, refused NFS exports, snapshot failures).
``Cluster`` is also what a test holds: it loads manifests as an administrator would, evicts pods, moves the
TTL controller's clock and waits for objects to go.
"""

from __future__ import annotations

import calendar
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trustme

from tests.cluster.admission import check
from tests.cluster.images import ImageRegistry
from tests.cluster.objects import NAMESPACE_NAME_LABEL, RESOURCES, resource_of
from tests.cluster.runtime import ContainerProcess
from tests.cluster.watch_cache import WatchCache

#: The one node of a permissive single-node cluster (``single_node``): a test that needs it says why.
NODE_NAME = "emulated-node"

@dataclass
class Node:
    """A node as the scheduler sees it: its labels (the kubelet's well-known ones, and a pool's), its taints
    (``spec.taints``, e.g. an AKS GPU pool's ``sku=gpu:NoSchedule``) and its allocatable resources (bytes,
    milli-CPU, counts)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=lambda: {
        "cpu": 64_000, "memory": 256 * 2**30, "ephemeral-storage": 2**40, "nvidia.com/gpu": 8})
    #: ``spec.unschedulable``: cordoned (``kubectl cordon``/``drain``); node_lifecycle.py.
    unschedulable: bool = False
    #: Its Ready condition: False once the node lifecycle controller found it silent (node_lifecycle.lose).
    ready: bool = True

    def __post_init__(self) -> None:
        self.labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       **self.labels}

#: The kinds stored without a namespace: RBAC's cluster kinds and every cluster-scoped kind the API serves.
CLUSTER_SCOPED_KINDS = frozenset({"ClusterRole", "ClusterRoleBinding"}
                                 | {kind for resource, (_, _, kind, namespaced) in RESOURCES.items()
                                    if not namespaced and "/" not in resource})


#: What an administrator installed before laneflow ran (deployments/base): the ANF storage and snapshot
#: classes, and the MPI operator (its controller's name, the component of its events).
STORAGE_CLASS = "azure-netapp-files"
SNAPSHOT_CLASS = "csi-anf-snapclass"
OPERATOR = "mpi-job-controller"


def single_node() -> dict[str, Node]:
    """One untainted node with room for anything: only for a test that says why the AKS shape does not fit it."""
    return {NODE_NAME: Node(NODE_NAME)}


def _aks_nodes() -> dict[str, Node]:
    from tests.cluster.aks import aks_nodes  # aks.py builds on Node

    return aks_nodes()


@dataclass
class Fault:
    status: int = 500  # 0: reset the connection
    retry_after: int | None = None
    after_effect: bool = False  # reset after the call took effect (the client never hears the answer)
    # Never answer until this is set, then drop the connection. Not an apiserver behaviour (its own
    # --request-timeout ends a slow call with 504 after 60 s): a network path or proxy that swallows the
    # request, which only a client-side timeout ends.
    hang: threading.Event | None = None


@dataclass(frozen=True)
class Request:
    method: str
    resource: str
    namespace: str | None
    name: str | None
    verb: str
    user: str = ""


@dataclass
class ContainerLog:
    """One container instance's log as the kubelet keeps it: files rotated at a size, newest current."""

    lines: list[tuple[str, str]] = field(default_factory=list)  # (RFC3339NanoFixed stamp, text)
    current_from: int = 0  # index of the first line of the current file
    current_bytes: int = 0
    rotations: int = 0
    running: bool = True


@dataclass
class Cluster:
    root: Path
    objects: dict[str, dict[tuple[str, str], dict]] = field(default_factory=lambda: defaultdict(dict))
    faults: dict[tuple[str, str], list[Fault]] = field(default_factory=lambda: defaultdict(list))
    requests: list[Request] = field(default_factory=list)
    logs: dict[tuple[str, str], ContainerLog] = field(default_factory=dict)
    #: The running container of each pod, by (namespace, pod).
    containers: dict[tuple[str, str], ContainerProcess] = field(default_factory=dict)
    #: Containers being stopped (in their grace period), so the node's shutdown can finish them.
    terminating: list[ContainerProcess] = field(default_factory=list)
    #: The kubelet's own stop of a pod in progress (its node's graceful shutdown), by (namespace, pod): a DELETE
    #: meanwhile removes the pod once that stop is done, not before (the kubelet confirms it then).
    kubelet_stops: dict[tuple[str, str], threading.Thread] = field(default_factory=dict)
    #: Images that exist (by reference); any other cannot be pulled.
    images: ImageRegistry = field(default_factory=ImageRegistry)
    #: Each pod's network namespace and IP (from its first container start to its deletion), by (namespace, pod).
    pod_networks: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    #: Network namespaces whose ``INPUT`` jumps to a NetworkPolicy chain, and the rules written there
    #: (network_policy.py; none: every policy that selected the pod has gone).
    policy_chains: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Objects marked for deletion that wait for their finalizers: (resource, namespace, name) -> policy.
    pending_deletions: dict[tuple[str, str, str], str] = field(default_factory=dict)
    #: Whether the MPI operator runs: without it an MPIJob is stored and nothing ever acts on it.
    mpi_operator_installed: bool = True
    #: When each Lease was last renewed by its holder (operator_lease.py), by (namespace, name).
    lease_renewed_at: dict[tuple[str, str], float] = field(default_factory=dict)
    #: Pods of each Job (by uid) removed before they finished: the Job controller counts them as failed.
    lost_job_pods: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.RLock = field(default_factory=threading.RLock)
    changed: threading.Condition = field(init=False)
    initial_pv_modes: list[str] = field(default_factory=lambda: ["ReadWriteOnce"])
    #: How long a pod's image takes to pull before its container starts.
    image_pull_s: float = 0.2
    #: After a failed pull, when the kubelet reports ImagePullBackOff (10 s upstream).
    image_pull_backoff_s: float = 1.0
    #: The Job controller's wait before it replaces a failed (or removed) pod, doubled per failure up to 10 minutes
    #: (pkg/controller/job: DefaultJobPodFailureBackOff 10 s, MaxJobPodFailureBackOff 10 min): upstream's.
    job_pod_failure_backoff_s: float = 10.0
    #: The kubelet's first wait before restarting a crashed container, doubled per restart up to 30 times it
    #: (pkg/kubelet: 10 s, capped at MaxContainerBackOff 300 s upstream; shortened here).
    crash_backoff_s: float = 1.0
    #: Between tries of a volume that failed to mount (the volume manager's exponential back-off from 500 ms
    #: to 2 min 2 s upstream, pkg/util/goroutinemap/exponentialbackoff; fixed here).
    mount_retry_s: float = 1.0
    #: Claims (namespace, name) whose NFS export refuses this node (an ANF export policy without the node
    #: subnet): mounting them fails as mount.nfs fails, which no process here can reproduce.
    nfs_refused: set[tuple[str, str]] = field(default_factory=set)
    #: The nodes the scheduler binds pods to, by name; every pod runs on this machine whichever it is bound to.
    #: AKS-shaped by default (tests/cluster/aks.py): a system pool, a tainted GPU pool, a tainted spot GPU pool.
    nodes: dict[str, Node] = field(default_factory=lambda: _aks_nodes())
    #: Pods no node took, by (namespace, pod): the pod and how to try it again (scheduler.retry_unschedulable).
    unschedulable: dict[tuple[str, str], tuple[dict, Callable[[], None]]] = field(default_factory=dict)
    #: Nodes whose kubelet is gone (node_lifecycle.lose): their pods' statuses stay as they were, and a pod
    #: deleted there stays, terminating, until it is force-deleted or the pod GC removes it.
    lost_nodes: set[str] = field(default_factory=set)
    #: API groups taken off the cluster, as on one without that CRD (no MPI operator, no external-snapshotter):
    #: discovery does not list them and their resources' paths answer 404 (tests/cluster/discovery.py).
    withheld_groups: set[str] = field(default_factory=set)
    #: Kueue (v0.19.2: tests/cluster/kueue_jobs.py, kueue_scheduler.py) installed: its CRDs and visibility API
    #: served, its webhooks and controllers acting on jobs labelled with a queue. Off, as on AKS by default.
    kueue_installed: bool = False
    #: Run:ai's Queue CRD (scheduling.run.ai/v2) served: a cluster with Run:ai (or KAI Scheduler) installed.
    runai_installed: bool = False
    #: The node lifecycle controller's --node-monitor-grace-period (50 s since 1.32, 40 s before; shortened
    #: by tests): how long a node may go without a heartbeat before it is Unknown and its pods not Ready.
    node_monitor_grace_s: float = 50.0
    #: The cloud node lifecycle controller's --node-monitor-period (5 s): how soon it deletes a NotReady node
    #: whose VM is gone.
    node_monitor_period_s: float = 5.0
    #: The pod GC's quarantine before it force-deletes the pods of a node that no longer exists (40 s), and
    #: its period (gcCheckPeriod, 20 s), which also paces removing terminating pods of an out-of-service node.
    podgc_quarantine_s: float = 40.0
    podgc_period_s: float = 20.0
    #: How soon a changed ConfigMap reaches the files of the pods that mount it: the kubelet's pod sync
    #: (--sync-frequency, 1 min upstream) plus its ConfigMap cache's propagation; a fixed period here.
    configmap_sync_s: float = 60.0
    #: The kubelet's containerLogMaxSize (10 MiB by default upstream).
    log_max_bytes: int = 10 * 1024 * 1024
    #: Cut every follow stream after this many lines (a dropped connection), when set.
    cut_streams_after_lines: int | None = None
    #: The snapshot controller's first N attempts per snapshot fail with an update conflict.
    snapshot_conflicts: int = 0
    #: Snapshots never become ready: every attempt fails with this error.
    snapshot_error: str | None = None
    #: Called with (cluster, namespace, pod, line) for each log line; tests use it to evict, say.
    on_log_line: Callable[[Cluster, str, str, str], None] | None = None
    #: The Azure NetApp Files backend of Trident, when a test connects one: called with (claim namespace, claim
    #: name, PV name, bytes) as Trident provisions a claim, it makes (or, for an imported volume, finds) the ANF
    #: volume and returns its resource id, which the PV then carries as ``internalID`` (pv_binder).
    anf_backend: Callable[[str, str, str, int], str] | None = None
    #: Who the test's own kubeconfig token (authentication.KUBECONFIG_TOKEN) authenticates as; requests are
    #: authorized once `load` brought RBAC objects.
    user: tuple[str, str] = ("laneflow", "laneflow-flows")
    rbac_enforced: bool = False
    #: The MPI operator's in-memory view of each MPIJob (defaulted spec), by (namespace, name).
    operator_specs: dict[tuple[str, str], dict] = field(default_factory=dict)
    #: Set when the emulator stops: nothing scheduled for later (retries, restarts) runs after that.
    closed: bool = False
    #: Exceptions of the time-driven controllers, raised when the emulator stops.
    controller_errors: list[BaseException] = field(default_factory=list)
    version: int = 0
    url: str = ""
    #: Every change as an event with its resourceVersion, what watches are served from.
    watch_cache: WatchCache = field(default_factory=WatchCache)
    #: How often a watch that asked for bookmarks gets one (about a minute upstream).
    bookmark_interval_s: float = 60.0
    #: When the server ends a watch that set no timeoutSeconds (--min-request-timeout, 1800 s upstream).
    watch_timeout_s: float = 1800.0
    #: Service-account tokens issued (authentication.issue_token), by token.
    tokens: dict = field(default_factory=dict)
    #: The cluster's CA (kube-apiserver's serving certificate is issued by it; pods get it as ``ca.crt``).
    ca: trustme.CA = field(default_factory=trustme.CA)
    #: Where pods reach the API server: the ``kubernetes`` Service's endpoint (node address, HTTPS port), set
    #: by the emulator once it listens there.
    service_endpoint: tuple[str, int] | None = None
    #: Where pods reach cluster DNS (tests/cluster/dns.py): the server's address and UDP port, set by the emulator.
    dns_endpoint: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        for namespace in ("default", "kube-system", "kube-public"):  # what every cluster has
            self.add_namespace(namespace)
        from tests.cluster.crds import installed_crds  # schemas.py imports the lot: not at module level

        for definition in installed_crds():  # the operators installed on the cluster (their CRDs)
            self.objects["customresourcedefinitions"][("", definition["metadata"]["name"])] = definition
        # What an administrator applied before laneflow ran (deployments/base): the ANF classes.
        self.objects["storageclasses"][("", STORAGE_CLASS)] = {
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": STORAGE_CLASS},
            "provisioner": "csi.trident.netapp.io"}
        self.objects["volumesnapshotclasses"][("", SNAPSHOT_CLASS)] = {
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
            "metadata": {"name": SNAPSHOT_CLASS}, "driver": "csi.trident.netapp.io", "deletionPolicy": "Retain"}

    # --- for tests ----------------------------------------------------------------------------------
    def add_namespace(self, name: str) -> None:
        """A namespace an administrator created (``kubectl create namespace``), with what the controllers add
        to every namespace: the ``default`` ServiceAccount (pkg/controller/serviceaccount) and the cluster's
        CA as ConfigMap ``kube-root-ca.crt`` (pkg/controller/certificates/rootcacertpublisher)."""
        self.objects["namespaces"][("", name)] = {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {NAMESPACE_NAME_LABEL: name}},
            "status": {"phase": "Active"}}
        self.objects["serviceaccounts"][(name, "default")] = {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}}
        self.objects["configmaps"][(name, "kube-root-ca.crt")] = {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {
                "name": "kube-root-ca.crt", "namespace": name,
                "annotations": {"kubernetes.io/description": "Contains a CA bundle that can be used to verify the "
                                "kube-apiserver when using internal endpoints such as the internal service IP or "
                                "kubernetes.default.svc. No other usage is guaranteed across distributions of "
                                "Kubernetes clusters."}},
            "data": {"ca.crt": self.ca.cert_pem.bytes().decode()}}

    def claim_dir(self, namespace: str, claim: str) -> Path:
        pvc = self.objects["persistentvolumeclaims"][(namespace, claim)]
        return self.root / "pv" / pvc["spec"]["volumeName"]

    def inject(self, method: str, kind: str, *faults: Fault) -> None:
        self.faults[(method, kind)].extend(faults)

    def count(self, kind: str) -> int:
        return len(self.objects[kind])

    def wait_empty(self, *resources: str, timeout_s: float = 60) -> None:
        """Until none of ``resources`` is left: a deleted pod goes once its container stopped (its grace
        period), an owner deleted Foreground once its pods did. Fails naming what is left."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while any(self.objects[resource] for resource in resources):
                left = {resource: sorted(name for _, name in self.objects[resource]) for resource in resources}
                assert time.monotonic() < deadline, f"still there after {timeout_s:.0f} s: {left}"
                self.changed.wait(0.2)

    def load(self, documents: list[dict]) -> None:
        """Apply manifests as an administrator would (``kubectl apply``): validated, stored; RBAC from now on
        once they bring any RBAC object."""
        with self.lock:
            for document in documents:
                stored = check(document, "Strict").obj
                if stored["kind"] == "Namespace":
                    self.add_namespace(stored["metadata"]["name"])
                resource = resource_of(stored["kind"])
                namespaced = stored["kind"] not in CLUSTER_SCOPED_KINDS
                key = (stored["metadata"].get("namespace", "default") if namespaced else "",
                       stored["metadata"]["name"])
                self.objects[resource][key] = stored
                if resource in ("roles", "rolebindings", "clusterroles", "clusterrolebindings"):
                    self.rbac_enforced = True

    def advance(self, seconds: float) -> None:
        """``seconds`` pass for what has finished so far: the finish times of the Jobs and MPIJobs that finished
        move back by that much, so the TTL-after-finished controller (and laneflow) counts a day in a test (and
        one that finishes later starts its own day then)."""
        # Imported here: the controllers import this module (the state they act on).
        from tests.cluster.ttl_controller import ttl_sweep

        def earlier(stamp: str) -> str:
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(
                calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) - seconds))

        with self.lock:
            for job in self.objects["jobs"].values():
                for condition in (job.get("status") or {}).get("conditions") or []:
                    if condition.get("type") in ("Complete", "Failed") and condition.get("lastTransitionTime"):
                        condition["lastTransitionTime"] = earlier(condition["lastTransitionTime"])
            for mpijob in self.objects["mpijobs"].values():
                status = mpijob.get("status") or {}
                if status.get("completionTime"):
                    status["completionTime"] = earlier(status["completionTime"])
            ttl_sweep(self)
            self.changed.notify_all()

    def events_for(self, name: str) -> list[dict]:
        return [e for e in self.objects["events"].values() if e["involvedObject"]["name"] == name]

    def evict(self, namespace: str, pod: str, message: str = "The node was low on resource: memory.") -> None:
        """The kubelet evicts a pod: its processes die, it ends Failed with reason Evicted."""
        # Imported here: the kubelet and the controllers import this module (the state they act on).
        from tests.cluster.controller_manager import sync_owner
        from tests.cluster.kubelet import kill

        with self.lock:
            obj = self.objects["pods"].get((namespace, pod))
            if obj is None:
                return
            obj["status"].update({"phase": "Failed", "reason": "Evicted", "message": message})
            kill(self, namespace, pod, grace_s=0)
            sync_owner(self, obj)

    def container_pids(self, namespace: str, pod: str) -> list[int]:
        """The processes of a pod's container (its PID namespace), for tests that kill one of them."""
        container = self.containers.get((namespace, pod))
        return container.pids() if container else []

    def permissions_used(self, namespace: str | None = None) -> set[tuple[str, str]]:
        """(verb, resource) of every request (in ``namespace``, or cluster-scoped with None and all)."""
        return {(r.verb, r.resource) for r in self.requests if namespace is None or r.namespace == namespace}
