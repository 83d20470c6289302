"""An in-process Kubernetes API server on 127.0.0.1 that also plays the controllers, for contract tests.

It speaks the REST paths the real ``kubernetes`` client uses and is as strict as the real server
(``tests/cluster/admission.py``): every object is checked against the published schemas and refused the way
the API server refuses it, unknown fields are dropped with a warning (or refused under
``fieldValidation=Strict``), MPIJob CRD defaults are stored, and — when RBAC is loaded — every request
is authorized against the Roles and ClusterRoles bound to the caller's service account.

The controllers behave as their upstream source says (each model cites the file it follows):

- PVCs bind to a new PV (a folder here); a PVC restored from a VolumeSnapshot is provisioned only from
  a ready snapshot (kubernetes-csi/external-provisioner ``pkg/controller/controller.go``).
- The Job controller (kubernetes ``pkg/controller/job``): ``restartPolicy: Never`` keeps a failed pod
  and counts it; ``OnFailure`` restarts the container in place (a new, empty log) and counts restarts;
  past ``backoffLimit`` the Job fails ``BackoffLimitExceeded`` and, for ``OnFailure``, its pods are
  deleted; ``activeDeadlineSeconds`` fails it ``DeadlineExceeded``. Pods need their service account.
- The MPI operator (kubeflow/mpi-operator v0.8 ``pkg/controller/mpi_job_controller.go``,
  ``pkg/apis/kubeflow/v2beta1/default.go``, ``pkg/apis/kubeflow/validation/validation.go``): defaults in
  memory (launcher ``restartPolicy: OnFailure``), validates in the controller — a refused job gets one
  Warning event ``ValidationError`` and no condition — creates the Secret ``<job>-ssh`` (a fresh ECDSA
  P-521 key pair), the ConfigMap ``<job>-config`` (``hostfile``, ``discover_hosts.sh`` of Running
  workers), worker pods (host name ``<job>-worker-<i>`` in subdomain ``<job>``, ``K_MPI_JOB_ROLE``, the
  keys at ``sshAuthMountPath``, ``/usr/sbin/sshd -De`` when the container sets no command) and the
  launcher as a batch Job ``<job>-launcher`` (the OpenMPI ``OMPI_MCA_*`` env, the keys, the ConfigMap at
  ``/etc/mpi``; at once under ``AtStartup``, after every worker is Ready under ``WaitForWorkersReady``);
  its conditions follow the launcher Job (``BackoffLimitExceeded/<pod reason>``, ``DeadlineExceeded``)
  and evicted workers (``MPIJobEvicted``).
- The snapshot controller (kubernetes-csi/external-snapshotter v8.6 ``pkg/common-controller``): retries,
  keeps only the last error in ``status.error`` and clears it when ``readyToUse`` turns true.
- Deletion (apiserver ``registry/generic/registry/store.go``, the garbage collector): ``propagationPolicy``
  Foreground (owner readable with the ``foregroundDeletion`` finalizer until its blocking dependents are
  gone), Background, Orphan; a batch/v1 Job's default is Orphan, with the API server's warning; a pod
  whose container runs stays, ``deletionTimestamp`` set, until the kubelet stopped it. The
  TTL-after-finished controller deletes finished Jobs (``Cluster.advance`` moves its clock).
- Updates (``tests/cluster/updates.py``): PATCH by media type (JSON, merge, strategic merge; apply needs a
  field manager; 415 for the rest and for strategic merge of custom resources), PUT with optimistic
  concurrency, immutable fields refused, PVC resize only where the class allows it.
- The kubelet: volumes before the image (``FailedMount`` for a missing Secret/ConfigMap or a refused NFS
  export, retried), ``limits.memory`` as a memory cgroup (``OOMKilled``), LimitRange defaults (the
  LimitRanger admission plugin), restarts in place through ``CrashLoopBackOff``.
- The kubelet's logs (kubernetes ``pkg/kubelet/kuberuntime/logs/logs.go``): ``timestamps`` in
  RFC3339NanoFixed, ``sinceSeconds`` inclusive, rotation at ``log_max_bytes`` after which a plain read
  returns only the current file, and ``follow`` streams that carry on across rotations (PR #115702)
  and end when the container exits.

Containers really run here, through the pod runtime (``tests/cluster/runtime.py``): each container's
command, resolved against its image (read from the Dockerfile that builds it), with its env, working
directory, host name and volumes, in namespaces of its own. The MPI operator's launcher reaches its
workers' real ``sshd`` with the operator's key and runs the real ``mpirun``. Nothing here knows laneflow's
commands or paths.
Faults are queued per call type (``("POST", "mpijobs")``): 429 with Retry-After, 500, a reset before
or after the call took effect, 403. Every request is recorded with its namespace and RBAC verb.
"""

from __future__ import annotations

import base64
import calendar
import contextlib
import copy
import json
import os
import random
import re
import shutil
import string
import threading
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.cluster.admission import apply_crd_defaults, check
from tests.cluster.apierrors import Rejection, invalid, invalid_status, not_supported, required
from tests.cluster.network import PodNetwork
from tests.cluster.quantities import quantity_bytes
from tests.cluster.runtime import (
    ContainerProcess,
    ImageRegistry,
    Mount,
    configmap_bytes,
    container_env,
    container_spec,
    hosts_file,
    memory_limits_missing,
    secret_bytes,
    stage_files,
)
from tests.cluster.runtime import start as start_container
from tests.cluster.updates import apply_patch, check_update
from tests.leaks import MARKER as SESSION_MARKER

#: The emulated cluster's one node.
NODE_NAME = "emulated-node"

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# resource -> (group, version, kind, namespaced)
RESOURCES: dict[str, tuple[str, str, str, bool]] = {
    "persistentvolumes": ("", "v1", "PersistentVolume", False),
    "persistentvolumeclaims": ("", "v1", "PersistentVolumeClaim", True),
    "pods": ("", "v1", "Pod", True),
    "pods/log": ("", "v1", "Pod", True),
    "events": ("", "v1", "Event", True),
    "serviceaccounts": ("", "v1", "ServiceAccount", True),
    "secrets": ("", "v1", "Secret", True),
    "configmaps": ("", "v1", "ConfigMap", True),
    "limitranges": ("", "v1", "LimitRange", True),
    "jobs": ("batch", "v1", "Job", True),
    "mpijobs": ("kubeflow.org", "v2beta1", "MPIJob", True),
    "volumesnapshots": ("snapshot.storage.k8s.io", "v1", "VolumeSnapshot", True),
    "volumesnapshotclasses": ("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass", False),
    "storageclasses": ("storage.k8s.io", "v1", "StorageClass", False),
}
_ROUTE = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log))?$")
STORAGE_CLASS = "azure-netapp-files"
SNAPSHOT_CLASS = "csi-anf-snapclass"
OPERATOR = "mpi-job-controller"
_JOB_GROUP_LABELS = ("training.kubeflow.org/operator-name", "training.kubeflow.org/job-name",
                     "training.kubeflow.org/job-role")


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
    #: Images that exist (by reference); any other cannot be pulled.
    images: ImageRegistry = field(default_factory=lambda: ImageRegistry(PROJECT_ROOT))
    #: Each pod's network namespace and IP (from its first container start to its deletion), by (namespace, pod).
    pod_networks: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    changed: threading.Condition = field(init=False)
    initial_pv_modes: list[str] = field(default_factory=lambda: ["ReadWriteOnce"])
    #: How long a pod's image takes to pull before its container starts.
    image_pull_s: float = 0.2
    #: After a failed pull, when the kubelet reports ImagePullBackOff (10 s upstream).
    image_pull_backoff_s: float = 1.0
    #: The kubelet's first wait before restarting a crashed container, doubled per restart up to 30 times it
    #: (pkg/kubelet: 10 s, capped at MaxContainerBackOff 300 s upstream; shortened here).
    crash_backoff_s: float = 1.0
    #: Between tries of a volume that failed to mount (the volume manager's exponential back-off from 500 ms
    #: to 2 min 2 s upstream, pkg/util/goroutinemap/exponentialbackoff; fixed here).
    mount_retry_s: float = 1.0
    #: Claims (namespace, name) whose NFS export refuses this node (an ANF export policy without the node
    #: subnet): mounting them fails as mount.nfs fails, which no process here can reproduce.
    nfs_refused: set[tuple[str, str]] = field(default_factory=set)
    #: The one node's allocatable resources (bytes, milli-CPU, counts), what the scheduler fits pods into.
    node_capacity: dict[str, int] = field(default_factory=lambda: {
        "cpu": 64_000, "memory": 256 * 2**30, "ephemeral-storage": 2**40, "nvidia.com/gpu": 8})
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
    #: The caller, as an RBAC subject; requests are authorized once `load` brought RBAC objects.
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

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        for namespace in ("default", "kube-system", "kube-public"):  # what every cluster has
            self.add_namespace(namespace)
        # What an administrator applied before laneflow ran (deployments/base): the ANF classes.
        self.objects["storageclasses"][("", STORAGE_CLASS)] = {
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": STORAGE_CLASS},
            "provisioner": "csi.trident.netapp.io"}
        self.objects["volumesnapshotclasses"][("", SNAPSHOT_CLASS)] = {
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
            "metadata": {"name": SNAPSHOT_CLASS}, "driver": "csi.trident.netapp.io", "deletionPolicy": "Retain"}

    # --- for tests ----------------------------------------------------------------------------------
    def add_namespace(self, name: str) -> None:
        """A namespace an administrator created (``kubectl create namespace``)."""
        self.objects["namespaces"][("", name)] = {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "status": {"phase": "Active"}}

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
                resource = _resource_of(stored["kind"])
                namespaced = stored["kind"] not in ("ClusterRole", "ClusterRoleBinding", "Namespace",
                                                    "StorageClass", "VolumeSnapshotClass", "PersistentVolume")
                key = (stored["metadata"].get("namespace", "default") if namespaced else "",
                       stored["metadata"]["name"])
                self.objects[resource][key] = stored
                if resource in ("roles", "rolebindings", "clusterroles", "clusterrolebindings"):
                    self.rbac_enforced = True

    def advance(self, seconds: float) -> None:
        """``seconds`` pass for what has finished so far: the finish times of the Jobs that finished move back
        by that much, so the TTL-after-finished controller counts a day in a test (and a Job that finishes
        later starts its own day then)."""
        with self.lock:
            for job in self.objects["jobs"].values():
                for condition in (job.get("status") or {}).get("conditions") or []:
                    if condition.get("type") in ("Complete", "Failed") and condition.get("lastTransitionTime"):
                        stamp = calendar.timegm(time.strptime(condition["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ"))
                        condition["lastTransitionTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                        time.gmtime(stamp - seconds))
            _ttl_sweep(self)
            self.changed.notify_all()

    def events_for(self, name: str) -> list[dict]:
        return [e for e in self.objects["events"].values() if e["involvedObject"]["name"] == name]

    def evict(self, namespace: str, pod: str, message: str = "The node was low on resource: memory.") -> None:
        """The kubelet evicts a pod: its processes die, it ends Failed with reason Evicted."""
        with self.lock:
            obj = self.objects["pods"].get((namespace, pod))
            if obj is None:
                return
            obj["status"].update({"phase": "Failed", "reason": "Evicted", "message": message})
            _kill(self, namespace, pod, grace_s=0)
            _sync_owner(self, obj)

    def container_pids(self, namespace: str, pod: str) -> list[int]:
        """The processes of a pod's container (its PID namespace), for tests that kill one of them."""
        container = self.containers.get((namespace, pod))
        return container.pids() if container else []

    def permissions_used(self, namespace: str | None = None) -> set[tuple[str, str]]:
        """(verb, resource) of every request (in ``namespace``, or cluster-scoped with None and all)."""
        return {(r.verb, r.resource) for r in self.requests if namespace is None or r.namespace == namespace}


def _resource_of(kind: str) -> str:
    for resource, (_, _, known, _) in RESOURCES.items():
        if known == kind and resource != "pods/log":
            return resource
    return kind.lower() + "s"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _stamp() -> str:
    """RFC3339NanoFixed, as the kubelet prefixes log lines (``pkg/kubelet/types/constants.go``)."""
    ns = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def _stamp_seconds(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + int(stamp[20:29]) / 1e9


def _suffix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


_CUSTOM_RESOURCES = {"mpijobs", "volumesnapshots", "volumesnapshotclasses"}
#: pkg/registry/batch/job/storage/storage.go L56-57: a batch/v1 Job DELETE without a policy orphans its pods
#: (strategy.go DefaultGarbageCollectionPolicy) and says so.
JOB_DELETE_WARNING = ("child pods are preserved by default when jobs are deleted; set propagationPolicy=Background "
                      "to remove them or set propagationPolicy=Orphan to suppress this warning")
PROPAGATION_POLICIES = ["Foreground", "Background", "Orphan"]


def _propagation_policy(resource: str, query: dict, body: Any) -> tuple[str, list[str]]:
    """The DELETE's policy, from the query or a DeleteOptions body (``orphanDependents`` the old way); the
    kind's default otherwise: Orphan for batch/v1 Jobs (with a warning), Background for the rest."""
    options = body if isinstance(body, dict) else {}
    policy = (query.get("propagationPolicy") or [None])[0] or options.get("propagationPolicy")
    if policy is None and options.get("orphanDependents") is not None:
        policy = "Orphan" if options["orphanDependents"] else "Background"
    if policy is None:
        return ("Orphan", [JOB_DELETE_WARNING]) if resource == "jobs" else ("Background", [])
    if policy not in PROPAGATION_POLICIES:
        raise invalid_status("DeleteOptions", "meta.k8s.io", "", [
            not_supported("propagationPolicy", policy, PROPAGATION_POLICIES)])
    return policy, []


def _check_resize(cluster: Cluster, current: dict, changed: dict) -> None:
    """The PersistentVolumeClaimResize admission plugin (plugin/pkg/admission/storage/persistentvolume/resize):
    a larger request needs a bound, dynamically provisioned claim whose class allows expansion."""
    def size(claim: dict) -> int:
        return quantity_bytes(str(claim["spec"]["resources"]["requests"]["storage"]))
    if size(changed) <= size(current):
        return
    storage_class = cluster.objects["storageclasses"].get(("", current["spec"].get("storageClassName") or ""))
    if (current.get("status") or {}).get("phase") != "Bound" or not storage_class or \
            not storage_class.get("allowVolumeExpansion"):
        raise Rejection(403, _status_body(403, "Forbidden", f'persistentvolumeclaims "{current["metadata"]["name"]}" '
                                          "is forbidden: only dynamically provisioned pvc can be resized and the "
                                          "storageclass that provisions the pvc must support resize"))


def _status_body(code: int, reason: str, message: str, **extra: Any) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code, **extra}


def _selector_matches(labels: dict, selector: str) -> bool:
    for part in filter(None, selector.split(",")):
        key, _, value = part.partition("=")
        if labels.get(key) != value:
            return False
    return True


_EVENT_FIELDS = {"involvedObject.kind": ("involvedObject", "kind"), "involvedObject.name": ("involvedObject", "name"),
                 "involvedObject.namespace": ("involvedObject", "namespace"),
                 "involvedObject.uid": ("involvedObject", "uid"), "reason": ("reason",), "type": ("type",)}


class _Handler(BaseHTTPRequestHandler):
    cluster: Cluster
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    # --- plumbing ----------------------------------------------------------------------------------
    def _send(self, status: int, body: Any, content_type: str = "application/json",
              headers: list[tuple[str, str]] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers or []:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _reset(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(2)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        parsed = urllib.parse.urlsplit(self.path)
        match = _ROUTE.match(parsed.path)
        resource = None
        if match:
            resource = match["resource"] + ("/log" if match["sub"] else "")
        if match is None or resource not in RESOURCES:
            self._send(404, _status_body(404, "NotFound", f"the server could not find the requested resource "
                                                          f"({parsed.path})"))
            return
        namespace, name = match["ns"], match["name"]
        query = urllib.parse.parse_qs(parsed.query)
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method) or \
            ("watch" if query.get("watch") == ["true"] else "get" if name else "list")
        cluster = self.cluster
        cluster.requests.append(Request(method, resource, namespace, name, verb))
        queue = cluster.faults.get((method, resource))
        fault = queue.pop(0) if queue else None
        if fault and not fault.after_effect:
            self._fault(fault, resource, verb, namespace)
            return
        denied = self._authorize(verb, resource, namespace, name)
        if denied:
            self._send(403, denied)
            return
        try:  # a PATCH body is read by its media type (updates.apply_patch), after that is checked
            body = json.loads(raw) if raw and method != "PATCH" else None
        except json.JSONDecodeError:
            self._send(400, _status_body(400, "BadRequest", "the request body is not valid JSON"))
            return
        if resource == "pods/log":
            self._pod_log(namespace, name, query)
            return
        self._raw = raw
        with cluster.lock:
            try:
                status, answer, warnings = self._apply(method, resource, namespace, name, query, body)
            except Rejection as rejection:
                status, answer, warnings = rejection.code, rejection.body, []
            cluster.changed.notify_all()
        if fault and fault.after_effect:
            self._reset()
            return
        self._send(status, answer, headers=[("Warning", f'299 - {json.dumps(w)}') for w in warnings])

    def _fault(self, fault: Fault, resource: str, verb: str, namespace: str | None) -> None:
        if fault.hang is not None:
            fault.hang.wait()
            self._reset()
            return
        if fault.status == 0:
            self._reset()
            return
        headers = [("Retry-After", str(fault.retry_after))] if fault.retry_after is not None else None
        if fault.status == 403:
            self._send(403, self._forbidden(verb, resource, namespace, None))
            return
        reason = {429: "TooManyRequests"}.get(fault.status, "InternalError")
        self._send(fault.status, _status_body(fault.status, reason, f"injected {fault.status}"), headers=headers)

    def _forbidden(self, verb: str, resource: str, namespace: str | None, name: str | None) -> dict:
        group = RESOURCES[resource][0]
        who = f"system:serviceaccount:{self.cluster.user[0]}:{self.cluster.user[1]}"
        what = f'{resource.split("/")[0]} "{name}"' if name else resource.split("/")[0]
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        return _status_body(403, "Forbidden", f'{what} is forbidden: User "{who}" cannot {verb} resource '
                                              f'"{resource}" in API group "{group}"{where}')

    def _authorize(self, verb: str, resource: str, namespace: str | None, name: str | None) -> dict | None:
        """RBAC as kube-apiserver evaluates it: any rule of any Role/ClusterRole bound to the caller."""
        cluster = self.cluster
        if not cluster.rbac_enforced:
            return None
        group = RESOURCES[resource][0]
        sa_namespace, sa_name = cluster.user

        def bound(binding: dict) -> bool:
            return any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name
                       and s.get("namespace", binding["metadata"].get("namespace")) == sa_namespace
                       for s in binding.get("subjects") or [])

        def allows(role: dict | None) -> bool:
            for rule in (role or {}).get("rules") or []:
                if (group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", [])) and \
                        (resource in rule.get("resources", []) or "*" in rule.get("resources", [])) and \
                        (verb in rule.get("verbs", []) or "*" in rule.get("verbs", [])) and \
                        (not rule.get("resourceNames") or name in rule["resourceNames"]):
                    return True
            return False

        with cluster.lock:
            for binding in cluster.objects["clusterrolebindings"].values():
                if bound(binding) and allows(cluster.objects["clusterroles"].get(("", binding["roleRef"]["name"]))):
                    return None
            if namespace:
                for (ns, _), binding in cluster.objects["rolebindings"].items():
                    if ns != namespace or not bound(binding):
                        continue
                    ref = binding["roleRef"]
                    role = cluster.objects["roles"].get((ns, ref["name"])) if ref["kind"] == "Role" else \
                        cluster.objects["clusterroles"].get(("", ref["name"]))
                    if allows(role):
                        return None
        return self._forbidden(verb, resource, namespace, name)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    # --- semantics ---------------------------------------------------------------------------------
    def _apply(self, method: str, resource: str, namespace: str | None, name: str | None, query: dict,
               body: Any) -> tuple[int, Any, list[str]]:
        cluster = self.cluster
        group, _, kind, namespaced = RESOURCES[resource]
        store = cluster.objects[resource]
        key = (namespace or "", name or "")
        not_found = _status_body(404, "NotFound", f'{resource}{"." + group if group else ""} "{name}" not found',
                                 details={"name": name, "group": group, "kind": resource})
        if method == "GET" and name is None:
            return 200, self._list(resource, namespace, query), []
        if method == "GET":
            return (200, store[key], []) if key in store else (404, not_found, [])
        if method == "POST":
            if isinstance(body, dict):
                # apiserver handlers/create.go decodes with the endpoint's kind as the default GVK: a body
                # without apiVersion/kind is read as the resource the URL names.
                version = RESOURCES[resource][1]
                body.setdefault("apiVersion", f"{group}/{version}" if group else version)
                body.setdefault("kind", kind)
            checked = check(body, (query.get("fieldValidation") or [None])[0])
            obj = checked.obj
            if obj["kind"] != kind:
                raise Rejection(400, _status_body(400, "BadRequest", f"the API version in the data "
                                                                      f"({obj['apiVersion']}) does not match the "
                                                                      f"expected kind {kind}"))
            obj_key = (namespace or "", obj["metadata"]["name"])
            if namespaced and ("", namespace) not in cluster.objects["namespaces"]:
                # apiserver's NamespaceLifecycle admission plugin (plugin/pkg/admission/namespace/lifecycle):
                # creating in a namespace that does not exist is NotFound, naming the namespace.
                return 404, _status_body(404, "NotFound", f'namespaces "{namespace}" not found',
                                         details={"name": namespace, "kind": "namespaces"}), []
            if obj_key in store:
                return 409, _status_body(409, "AlreadyExists", f'{resource}{"." + group if group else ""} '
                                                               f'"{obj_key[1]}" already exists',
                                         details={"name": obj_key[1], "group": group, "kind": resource}), []
            apply_crd_defaults(obj)
            _stamp_metadata(cluster, obj, namespace if namespaced else None)
            store[obj_key] = obj
            _CONTROLLERS.get(resource, lambda *_: None)(cluster, obj)
            return 201, obj, checked.warnings
        if method in ("PATCH", "PUT"):
            if key not in store:
                return 404, not_found, []
            current = store[key]
            if method == "PATCH":
                changed = apply_patch(current, self.headers.get("Content-Type"), self._raw,
                                      custom=resource in _CUSTOM_RESOURCES,
                                      field_manager=(query.get("fieldManager") or [None])[0])
            else:
                changed = self._replacement(resource, group, current, body)
            precondition = (changed.get("metadata") or {}).get("resourceVersion")
            if method == "PATCH" and precondition and precondition != current["metadata"]["resourceVersion"]:
                raise Rejection(409, _status_body(409, "Conflict", f'Operation cannot be fulfilled on '
                                                  f'{resource}{"." + group if group else ""} "{name}": the object '
                                                  "has been modified; please apply your changes to the latest "
                                                  "version and try again"))
            # rest.BeforeUpdate: fields the system owns are kept from the stored object, whatever was sent.
            for system in ("creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
                changed.setdefault("metadata", {}).pop(system, None)
                if system in current["metadata"]:
                    changed["metadata"][system] = current["metadata"][system]
            # Every kind here has a status subresource: an update of the object leaves status as it was
            # (each strategy's PrepareForUpdate).
            changed.pop("status", None)
            checked = check(changed, (query.get("fieldValidation") or [None])[0], on_create=False)
            if "status" in current:
                checked.obj["status"] = copy.deepcopy(current["status"])
            check_update(current, checked.obj)
            if resource == "persistentvolumeclaims":
                _check_resize(cluster, current, checked.obj)
            cluster.version += 1
            checked.obj["metadata"]["resourceVersion"] = str(cluster.version)
            store[key] = checked.obj
            return 200, checked.obj, checked.warnings
        if method == "DELETE":
            obj = store.get(key)
            if obj is None:
                return 404, not_found, []
            policy, warnings = _propagation_policy(resource, query, body)
            if obj["metadata"].get("deletionTimestamp") or not _delete(cluster, resource, obj, policy):
                return 200, obj, warnings  # still there: being deleted (a pod's grace, a Foreground wait)
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                         "details": {"name": name, "group": group, "kind": resource,
                                     "uid": obj["metadata"]["uid"]}}, warnings
        return 405, _status_body(405, "MethodNotAllowed", method), []

    def _replacement(self, resource: str, group: str, current: dict, body: Any) -> dict:
        """A PUT's object (apiserver handlers/update.go, rest.BeforeUpdate): the URL's name, the current
        resourceVersion (optimistic concurrency), uid and creation time kept when left out."""
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise Rejection(400, _status_body(400, "BadRequest", "Object 'metadata' is missing in the request body"))
        name = current["metadata"]["name"]
        if body["metadata"].get("name") != name:
            raise Rejection(400, _status_body(400, "BadRequest", f"the name of the object "
                                              f"({body['metadata'].get('name')}) does not match the name on the URL "
                                              f"({name})"))
        version = body["metadata"].get("resourceVersion")
        if not version:
            raise invalid_status(current["kind"], group, name, [
                invalid("metadata.resourceVersion", "0x0", "must be specified for an update")])
        if version != current["metadata"]["resourceVersion"]:
            qualified = f"{resource}.{group}" if group else resource
            raise Rejection(409, _status_body(409, "Conflict", f'Operation cannot be fulfilled on {qualified} '
                                              f'"{name}": the object has been modified; please apply your changes '
                                              "to the latest version and try again"))
        replacement = copy.deepcopy(body)
        for system in ("uid", "creationTimestamp"):
            replacement["metadata"].setdefault(system, current["metadata"].get(system))
        replacement.setdefault("apiVersion", current["apiVersion"])
        replacement.setdefault("kind", current["kind"])
        return replacement

    def _list(self, resource: str, namespace: str | None, query: dict) -> dict:
        store = self.cluster.objects[resource]
        labels = query.get("labelSelector", [""])[0]
        fields = query.get("fieldSelector", [""])[0]
        wanted = []
        for part in filter(None, fields.split(",")):
            key, _, value = part.partition("=")
            if resource != "events" or key not in _EVENT_FIELDS:
                raise Rejection(400, _status_body(400, "BadRequest", f'field label not supported: {key}'))
            wanted.append((_EVENT_FIELDS[key], value))

        def field_value(obj: dict, path: tuple[str, ...]) -> Any:
            for part in path:
                obj = (obj or {}).get(part)
            return obj

        items = [copy.deepcopy(o) for (ns, _), o in store.items() if namespace is None or ns == namespace
                 if _selector_matches(o["metadata"].get("labels") or {}, labels)
                 and all(str(field_value(o, path)) == value for path, value in wanted)]
        _, version, kind, _ = RESOURCES[resource]
        api_version = f"{RESOURCES[resource][0]}/{version}" if RESOURCES[resource][0] else version
        return {"kind": f"{kind}List", "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.cluster.version)}, "items": items}

    # --- the kubelet's log endpoint ----------------------------------------------------------------
    def _pod_log(self, namespace: str, name: str, query: dict) -> None:
        cluster = self.cluster

        def flag(key: str) -> bool:
            return query.get(key, ["false"])[0] == "true"

        since_s = float(query.get("sinceSeconds", ["0"])[0]) if "sinceSeconds" in query else None
        since = time.time() - since_s if since_s is not None else None
        with cluster.lock:
            pod = cluster.objects["pods"].get((namespace, name))
            log = cluster.logs.get((namespace, name))
            if pod is None:
                self._send(404, _status_body(404, "NotFound", f'pods "{name}" not found'))
                return
            if log is None:
                container = (pod.get("spec", {}).get("containers") or [{"name": "main"}])[0]["name"]
                self._send(400, _status_body(400, "BadRequest", f'container "{container}" in pod "{name}" is '
                                                                 "waiting to start: ContainerCreating"))
                return
            start = log.current_from
            while since is not None and start < len(log.lines) and _stamp_seconds(log.lines[start][0]) < since:
                start += 1

        def render(stamp: str, text: str) -> bytes:
            return ((stamp + " " if flag("timestamps") else "") + text).encode()

        if not flag("follow"):
            with cluster.lock:
                body = b"".join(render(*line) for line in log.lines[start:])
            self._send(200, body, "text/plain")
            return
        # follow: chunked, new lines as they come, across rotations, until the container stops.
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent, position = 0, start
        try:
            while True:
                with cluster.lock:
                    if cluster.logs.get((namespace, name)) is not log:
                        break  # the container was restarted or the pod deleted
                    fresh = log.lines[position:]
                    position = len(log.lines)
                    if not fresh:
                        if not log.running:
                            break
                        cluster.changed.wait(timeout=0.5)
                        continue
                for line in fresh:
                    if cluster.cut_streams_after_lines is not None and sent >= cluster.cut_streams_after_lines:
                        self._reset()
                        return
                    data = render(*line)
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    sent += 1
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True


def _stamp_metadata(cluster: Cluster, obj: dict, namespace: str | None) -> None:
    cluster.version += 1
    metadata = obj["metadata"]
    metadata.update({"uid": f"uid-{cluster.version:06d}", "resourceVersion": str(cluster.version),
                     "creationTimestamp": _now()})
    if namespace:
        metadata["namespace"] = namespace
    else:
        metadata.pop("namespace", None)


def _record_event(cluster: Cluster, obj: dict, kind: str, reason: str, message: str, component: str) -> None:
    """A core/v1 Event as client-go's recorder makes it (tools/record/event.go makeEvent); the same event of
    the same object again bumps ``count`` and ``lastTimestamp`` (tools/record/events_cache.go
    ``EventCorrelator``: identical events are aggregated, not repeated)."""
    metadata = obj["metadata"]
    namespace = metadata.get("namespace", "default")
    for event in cluster.objects["events"].values():
        if event["involvedObject"].get("uid") == metadata.get("uid") and event["reason"] == reason and \
                event["message"] == message[:1024] and event["type"] == kind:
            event["count"] += 1
            event["lastTimestamp"] = _now()
            return
    name = f"{metadata['name']}.{time.time_ns():x}"
    event = {"apiVersion": "v1", "kind": "Event",
             "metadata": {"name": name, "namespace": namespace, "uid": f"event-{time.time_ns()}",
                          "creationTimestamp": _now()},
             "involvedObject": {"kind": obj["kind"], "apiVersion": obj["apiVersion"], "name": metadata["name"],
                                "namespace": namespace, "uid": metadata.get("uid")},
             "reason": reason, "message": message[:1024], "type": kind, "source": {"component": component},
             "reportingComponent": component, "firstTimestamp": _now(), "lastTimestamp": _now(), "count": 1}
    cluster.objects["events"][(namespace, name)] = event


# --- processes ---------------------------------------------------------------------------------------

def _append_log(cluster: Cluster, log: ContainerLog, text: str) -> None:
    """A line into the container's current log file, rotating it first when it would grow past the limit."""
    size = len(text.encode())
    if log.current_bytes and log.current_bytes + size > cluster.log_max_bytes:
        log.current_from, log.current_bytes = len(log.lines), 0
        log.rotations += 1
    log.lines.append((_stamp(), text))
    log.current_bytes += size


def _pod_network(cluster: Cluster, namespace: str, name: str) -> tuple[str, str]:
    """The pod's network namespace and IP, made when its first container starts (the CNI plugin's ADD)."""
    key = (namespace, name)
    if key not in cluster.pod_networks:
        cluster.pod_networks[key] = PodNetwork.shared().attach()
    return cluster.pod_networks[key]


def _release_network(cluster: Cluster, namespace: str, name: str) -> None:
    """The CNI plugin's DEL: the namespace's name goes at once; the kernel frees it when its last process exits."""
    network = cluster.pod_networks.pop((namespace, name), None)
    if network is not None:
        PodNetwork.detach(network[0])


def _fqdn(pod: dict) -> str | None:
    spec, namespace = pod["spec"], pod["metadata"]["namespace"]
    if not spec.get("subdomain"):
        return None
    return f"{spec.get('hostname') or pod['metadata']['name']}.{spec['subdomain']}.{namespace}.svc.cluster.local"


class MountFailure(Exception):
    """A volume the kubelet cannot set up: the pod stays ContainerCreating, a FailedMount Warning says why."""

    def __init__(self, volume: str, detail: str) -> None:
        super().__init__(f'MountVolume.SetUp failed for volume "{volume}" : {detail}')


def _mounts(cluster: Cluster, pod: dict, container: dict, folder: Path) -> list[Mount]:
    """The container's volumeMounts made concrete, as the kubelet's volume manager would. A Secret or
    ConfigMap that does not exist, or an NFS export that refuses the node, is a ``MountFailure``
    (pkg/volume/secret ``SetUpAt``: ``secret "<name>" not found``; the CSI driver's NodePublishVolume error
    for NFS) — not a CreateContainerConfigError, which is for env references."""
    namespace = pod["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"])
        if volume is None:
            raise LookupError(f'volumeMount "{mount["name"]}" names no volume of the pod')
        if mount.get("subPath"):
            raise LookupError(f'volumeMount "{mount["name"]}": subPath is not emulated')
        target, readonly = mount["mountPath"], bool(mount.get("readOnly"))
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = cluster.objects["persistentvolumeclaims"].get((namespace, claim))
            if pvc is None or (pvc.get("status") or {}).get("phase") != "Bound":
                raise LookupError(f'persistentvolumeclaim "{claim}" not found or not bound')
            readonly = readonly or bool(volume["persistentVolumeClaim"].get("readOnly"))
            if (namespace, claim) in cluster.nfs_refused:
                pv = pvc["spec"]["volumeName"]
                raise MountFailure(pv, f"rpc error: code = Internal desc = error mounting NFS volume "
                                       f"10.0.0.4:/{pv} on mountpoint /var/lib/kubelet/pods/{pod['metadata']['uid']}"
                                       f"/volumes/kubernetes.io~csi/{pv}/mount: exit status 32: mount.nfs: access "
                                       f"denied by server while mounting 10.0.0.4:/{pv}")
            mounts.append(Mount(target, cluster.claim_dir(namespace, claim), readonly))
        elif "secret" in volume or "configMap" in volume:
            kind, source = ("secrets", volume["secret"]) if "secret" in volume else ("configmaps", volume["configMap"])
            name = source.get("secretName") or source.get("name")
            obj = cluster.objects[kind].get((namespace, name))
            if obj is None:
                raise MountFailure(mount["name"], f'{kind[:-1]} "{name}" not found')
            data = secret_bytes(obj) if kind == "secrets" else configmap_bytes(obj)
            try:
                staged = stage_files(folder / "volumes" / mount["name"], data, source.get("items"),
                                     source.get("defaultMode", 0o644))
            except KeyError as exc:
                raise MountFailure(mount["name"], str(exc.args[0])) from None
            mounts.append(Mount(target, staged, readonly=True))  # the kubelet mounts these read-only
        elif "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                limit = empty.get("sizeLimit")
                mounts.append(Mount(target, tmpfs=True, tmpfs_bytes=quantity_bytes(limit) if limit else None))
            else:
                directory = folder / "empty-dirs" / mount["name"]
                directory.mkdir(parents=True, exist_ok=True)
                mounts.append(Mount(target, directory, readonly))
        else:
            raise LookupError(f'volume "{mount["name"]}": {sorted(volume)} is not emulated')
    return mounts


def _lookup_key(cluster: Cluster, namespace: str) -> Callable[[str, str, str], str | None]:
    def lookup(kind: str, name: str, key: str) -> str | None:
        obj = cluster.objects["secrets" if kind == "secret" else "configmaps"].get((namespace, name))
        if obj is None:
            return None
        data = secret_bytes(obj) if kind == "secret" else configmap_bytes(obj)
        return data[key].decode() if key in data else None
    return lookup


def _start_container(cluster: Cluster, pod: dict, on_exit: Callable[[dict], None]) -> None:
    """Mount the pod's volumes, pull its image and run its (first) container; its output becomes the pod's
    log, its exit the container's ``terminated`` state given to ``on_exit``. Volumes come first, as in the
    kubelet's SyncPod (WaitForAttachAndMount before the runtime starts anything): one that fails keeps the
    pod ContainerCreating, with a FailedMount Warning, retried. An image nobody builds fails to pull
    (ErrImagePull, a Warning event). ``limits.memory`` is a memory cgroup where this machine has one
    (``memory_limits_missing``): over it, the kernel kills and the reason is OOMKilled."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    container = pod["spec"]["containers"][0]
    if not _schedule(cluster, pod):
        return
    folder = cluster.root / "pods" / namespace / name
    try:
        mounts = _mounts(cluster, pod, container, folder)
    except MountFailure as failure:
        _record_event(cluster, pod, "Warning", "FailedMount", str(failure), "kubelet")

        def retry() -> None:
            if cluster.objects["pods"].get((namespace, name)) is pod and (namespace, name) not in cluster.containers:
                _start_container(cluster, pod, on_exit)
        _later(cluster, cluster.mount_retry_s, retry)
        return
    except LookupError as exc:
        mounts, mount_error = [], exc
    else:
        mount_error = None
    reference = container.get("image", "")
    _record_event(cluster, pod, "Normal", "Pulling", f'Pulling image "{reference}"', "kubelet")
    image = cluster.images.pull(reference)
    if image is not None:  # pkg/kubelet/images/image_manager.go EnsureImageExists
        _record_event(cluster, pod, "Normal", "Pulled", f'Successfully pulled image "{reference}" in '
                      f'{cluster.image_pull_s:.3f}s ({cluster.image_pull_s:.3f}s including waiting)', "kubelet")
    if image is None:
        # kubelet pkg/kubelet/images/image_manager.go: a failed pull is ErrImagePull with a Failed event, and
        # the next tries ImagePullBackOff with BackOff events (back-off from 10 s upstream; shortened here).
        reference = container.get("image")
        message = (f'Failed to pull image "{reference}": rpc error: code = NotFound desc = failed to '
                   f'pull and unpack image "{reference}": not found')
        _set_container_state(pod, {"waiting": {"reason": "ErrImagePull", "message": message}}, ready=False)
        _record_event(cluster, pod, "Warning", "Failed", message, "kubelet")

        def back_off() -> None:
            if cluster.objects["pods"].get((namespace, name)) is pod:
                waiting = f'Back-off pulling image "{reference}"'
                _set_container_state(pod, {"waiting": {"reason": "ImagePullBackOff", "message": waiting}}, False)
                _record_event(cluster, pod, "Normal", "BackOff", waiting, "kubelet")
        _later(cluster, cluster.image_pull_backoff_s, back_off)
        return
    netns, ip = _pod_network(cluster, namespace, name)
    hostname = pod["spec"].get("hostname") or name
    others = [(cluster.pod_networks[(ns, other)][1], fqdn) for (ns, other), obj in cluster.objects["pods"].items()
              if ns == namespace and other != name and (ns, other) in cluster.pod_networks and (fqdn := _fqdn(obj))]
    instance = f"c{pod['status'].get('containerStatuses', [{}])[0].get('restartCount', 0)}"
    try:
        if mount_error is not None:
            raise mount_error
        env = container_env(image, container, pod, hostname, ip, _lookup_key(cluster, namespace))
        env[SESSION_MARKER] = os.environ.get(SESSION_MARKER, "")  # bookkeeping of the test suite, not the pod's
        spec = container_spec(image, container, pod, sandbox=folder / instance / "fs", hostname=hostname,
                              hosts=hosts_file(ip, hostname, _fqdn(pod), others), env=env,
                              mounts=mounts, project_paths=[PROJECT_ROOT])
    except (LookupError, ValueError) as exc:
        message = f"Error: {exc}"
        _set_container_state(pod, {"waiting": {"reason": "CreateContainerConfigError", "message": message}}, False)
        _record_event(cluster, pod, "Warning", "Failed", message, "kubelet")
        return
    log = ContainerLog()
    cluster.logs[(namespace, name)] = log
    pod["status"].update({"phase": "Running", "startTime": pod["status"].get("startTime") or _now(),
                          "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": PodNetwork.shared().gateway})
    _set_container_state(pod, {"running": {"startedAt": _now()}}, ready=True)
    grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))

    def line(text: str) -> None:
        with cluster.lock:
            _append_log(cluster, log, text)
            cluster.changed.notify_all()
        if cluster.on_log_line is not None:
            cluster.on_log_line(cluster, namespace, name, text)

    def exited(code: int) -> None:
        with cluster.lock:
            log.running = False
            if cluster.containers.get((namespace, name)) is running:
                cluster.containers.pop((namespace, name))
                reason = "OOMKilled" if running.oom_killed else "Completed" if code == 0 else "Error"
                on_exit({"exitCode": code, "reason": reason, "finishedAt": _now()})
            cluster.changed.notify_all()

    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    memory = quantity_bytes(str(limit)) if limit is not None and memory_limits_missing() is None else None
    running = start_container(spec, folder / instance, netns, grace, line, exited, memory_limit=memory)
    cluster.containers[(namespace, name)] = running


def _requests(pod: dict) -> dict[str, int]:
    """What a pod asks of its node (milli-CPU, bytes, counts): requests, with limits standing in where only
    limits are set (the API server's defaulting does this, and extended resources such as GPUs are given
    as limits)."""
    total: dict[str, int] = defaultdict(int)
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        for resource, quantity in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            text = str(quantity)
            if resource == "cpu":
                total[resource] += int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)
            else:
                total[resource] += quantity_bytes(text)
    return total


def _schedule(cluster: Cluster, pod: dict) -> bool:
    """kube-scheduler's fit check against the one node: a pod whose requests do not fit beside the pods
    bound there stays Pending, PodScheduled=False/Unschedulable, with a FailedScheduling event worded as
    the scheduler words it (pkg/scheduler ``FitError.Error``: "0/1 nodes are available: 1 Insufficient
    <resource>. preemption: ..."); one that fits is bound (``spec.nodeName``). Not retried when room frees
    up (no test needs the second chance)."""
    if pod["spec"].get("nodeName"):
        return True
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes") or []:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is None:
            continue
        pvc = cluster.objects["persistentvolumeclaims"].get((namespace, claim))
        # The VolumeBinding plugin (pkg/scheduler/framework/plugins/volumebinding): a missing claim, or one
        # not bound yet, makes the pod unschedulable before any resource is looked at.
        problem = (f'persistentvolumeclaim "{claim}" not found' if pvc is None else
                   None if (pvc.get("status") or {}).get("phase") == "Bound" else
                   "pod has unbound immediate PersistentVolumeClaims")
        if problem:
            return _unschedulable(cluster, pod, f"0/1 nodes are available: {problem}. preemption: 0/1 nodes are "
                                                "available: 1 Preemption is not helpful for scheduling.")
    used: dict[str, int] = defaultdict(int)
    for other in cluster.objects["pods"].values():
        if other is not pod and other["spec"].get("nodeName") and \
                other["status"].get("phase") not in ("Succeeded", "Failed"):
            for resource, amount in _requests(other).items():
                used[resource] += amount
    short = sorted(resource for resource, amount in _requests(pod).items()
                   if used[resource] + amount > cluster.node_capacity.get(resource, 0))
    if not short:
        pod["spec"]["nodeName"] = NODE_NAME
        return True
    return _unschedulable(cluster, pod, "0/1 nodes are available: "
                          + ", ".join(f"1 Insufficient {resource}" for resource in short)
                          + ". preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.")


def _unschedulable(cluster: Cluster, pod: dict, message: str) -> bool:
    pod["status"].update({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
         "lastTransitionTime": _now()}]})
    _record_event(cluster, pod, "Warning", "FailedScheduling", message, "default-scheduler")
    return False


def _set_container_state(pod: dict, state: dict, ready: bool, restarts: int | None = None) -> None:
    container = pod["spec"]["containers"][0]
    previous = (pod["status"].get("containerStatuses") or [{}])[0]
    pod["status"]["containerStatuses"] = [{
        "name": container["name"], "image": container.get("image", ""),
        "imageID": f"{container.get('image', '')}@sha256:{'0' * 64}", "ready": ready,
        "restartCount": previous.get("restartCount", 0) if restarts is None else restarts, "state": state}]
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False",
                                    "lastTransitionTime": _now()}]


def _kill(cluster: Cluster, namespace: str, pod: str, grace_s: float | None = None,
          on_stopped: Callable[[], None] | None = None) -> None:
    """The kubelet stops the pod's container: SIGTERM, SIGKILL after the grace period (in the background,
    as a DELETE returns before the pod is gone); then ``on_stopped``, under the cluster's lock."""
    container = cluster.containers.pop((namespace, pod), None)
    log = cluster.logs.get((namespace, pod))
    if log:
        log.running = False
    if container is None:
        if on_stopped is not None:
            on_stopped()
        return
    cluster.terminating[:] = [c for c in cluster.terminating if c.process.poll() is None] + [container]

    def stop() -> None:
        container.stop(grace_s)
        if on_stopped is not None:
            with cluster.lock:
                on_stopped()
                cluster.changed.notify_all()
    threading.Thread(target=stop, daemon=True, name=f"stop-{pod}").start()


def _make_pod(cluster: Cluster, owner: dict, name: str, template: dict, extra_labels: dict) -> dict | None:
    """A pod from a template, admitted as the API server admits it: its service account must exist."""
    namespace = owner["metadata"]["namespace"]
    spec = copy.deepcopy(template.get("spec") or {})
    _limit_range_defaults(cluster, namespace, spec)
    account = spec.get("serviceAccountName", "default")
    if cluster.rbac_enforced and account != "default" and \
            (namespace, account) not in cluster.objects["serviceaccounts"]:
        component = OPERATOR if owner["kind"] == "MPIJob" else "job-controller"
        reason = "MPIJobFailed" if owner["kind"] == "MPIJob" else "FailedCreate"
        _record_event(cluster, owner, "Warning", reason,
                      f'Error creating: pods "{name}" is forbidden: error looking up service account '
                      f'{namespace}/{account}: serviceaccount "{account}" not found', component)
        return None
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace,
                        "labels": {**((template.get("metadata") or {}).get("labels") or {}), **extra_labels},
                        "ownerReferences": [_controller_ref(owner)]},
           "spec": spec, "status": {"phase": "Pending"}}
    _stamp_metadata(cluster, pod, namespace)
    _set_container_state(pod, {"waiting": {"reason": "ContainerCreating"}}, ready=False)
    cluster.objects["pods"][(namespace, name)] = pod
    return pod


def _limit_range_defaults(cluster: Cluster, namespace: str, spec: dict) -> None:
    """The LimitRanger admission plugin (plugin/pkg/admission/limitranger/admission.go
    ``defaultContainerResourceRequirements``/``mergeContainerResources``): each ``type: Container`` limit of
    the namespace's LimitRanges gives a container its ``default`` limits and ``defaultRequest`` requests for
    the resources it does not set itself."""
    for (ns, _), limit_range in cluster.objects["limitranges"].items():
        if ns != namespace:
            continue
        for item in (limit_range.get("spec") or {}).get("limits") or []:
            if item.get("type") != "Container":
                continue
            for container in spec.get("containers") or []:
                resources = container.setdefault("resources", {})
                for field_name, defaults in (("limits", item.get("default")), ("requests", item.get("defaultRequest"))):
                    for resource, quantity in (defaults or {}).items():
                        resources.setdefault(field_name, {}).setdefault(resource, quantity)


def _later(cluster: Cluster, delay_s: float, action: Callable[[], None]) -> None:
    def run() -> None:
        time.sleep(delay_s)
        with cluster.lock:
            if cluster.closed:
                return
            action()
            cluster.changed.notify_all()
    threading.Thread(target=run, daemon=True).start()


def _owner_of(cluster: Cluster, obj: dict) -> dict | None:
    for reference in obj["metadata"].get("ownerReferences") or []:
        resource = _resource_of(reference["kind"])
        owner = cluster.objects[resource].get((obj["metadata"].get("namespace", ""), reference["name"]))
        if owner and owner["metadata"]["uid"] == reference["uid"]:
            return owner
    return None


def _sync_owner(cluster: Cluster, obj: dict) -> None:
    owner = _owner_of(cluster, obj)
    if owner is None:
        return
    if owner["kind"] == "Job":
        _sync_job(cluster, owner)
    elif owner["kind"] == "MPIJob":
        _sync_mpijob(cluster, owner)


def _controller_ref(owner: dict) -> dict:
    """apimachinery ``metav1.NewControllerRef``: what every controller here sets on what it creates."""
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _dependents(cluster: Cluster, uid: str) -> list[tuple[str, dict]]:
    return [(resource, child) for resource in ("jobs", "pods", "secrets", "configmaps")
            for child in list(cluster.objects[resource].values())
            if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences") or [])]


def _delete(cluster: Cluster, resource: str, obj: dict, policy: str = "Background") -> bool:
    """Delete an object as the API server and the garbage collector do; True when it is gone at once.

    - A pod whose container runs is deleted gracefully: ``deletionTimestamp`` set, the kubelet stops the
      container (SIGTERM, SIGKILL after the grace period), then the pod goes (apiserver registry/core/pod
      ``CheckGracefulDelete``; the kubelet's status manager deletes it with grace 0).
    - ``Orphan``: the dependents lose their owner reference and stay (garbagecollector ``orphanDependents``).
    - ``Background``: the object goes at once, the garbage collector deletes its dependents after it.
    - ``Foreground``: the object stays readable with ``deletionTimestamp`` and the ``foregroundDeletion``
      finalizer while its dependents are deleted; once none with ``blockOwnerDeletion`` is left, it goes
      (apiserver registry/generic/registry/store.go ``updateForGracefulDeletionAndFinalizers``;
      garbagecollector ``processDeletingDependentsItem``, graph.go ``blockingDependents``)."""
    metadata = obj["metadata"]
    if metadata.get("deletionTimestamp"):
        return False
    key = (metadata.get("namespace", ""), metadata["name"])
    if resource == "pods" and key in cluster.containers:
        grace = float(obj["spec"].get("terminationGracePeriodSeconds", 30))
        metadata.update({"deletionTimestamp": _now(), "deletionGracePeriodSeconds": int(grace)})
        _kill(cluster, *key, on_stopped=lambda: _remove(cluster, resource, obj))
        return False
    dependents = _dependents(cluster, metadata["uid"])
    if policy == "Orphan":
        for _, child in dependents:
            child["metadata"]["ownerReferences"] = [ref for ref in child["metadata"]["ownerReferences"]
                                                    if ref.get("uid") != metadata["uid"]]
        _remove(cluster, resource, obj)
        return True
    if policy == "Foreground":
        metadata.update({"deletionTimestamp": _now(), "deletionGracePeriodSeconds": 0})
        metadata["finalizers"] = [*(metadata.get("finalizers") or []), "foregroundDeletion"]
        for child_resource, child in dependents:
            # attemptToDeleteItem: a dependent of an owner waiting for its dependents goes Foreground too.
            _delete(cluster, child_resource, child,
                    "Foreground" if _dependents(cluster, child["metadata"]["uid"]) else "Background")
        _finish_foreground(cluster)
        return cluster.objects[resource].get(key) is not obj
    _remove(cluster, resource, obj)
    for child_resource, child in dependents:
        _delete(cluster, child_resource, child, "Background")
    return True


def _remove(cluster: Cluster, resource: str, obj: dict) -> None:
    """The object leaves storage (and with it, a pod's network and logs); owners waiting on it may go."""
    namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
    if cluster.objects[resource].get((namespace, name)) is not obj:
        return
    cluster.objects[resource].pop((namespace, name))
    if resource == "mpijobs":
        cluster.operator_specs.pop((namespace, name), None)
    if resource == "pods":
        _kill(cluster, namespace, name)
        _release_network(cluster, namespace, name)
        cluster.logs.pop((namespace, name), None)
    _finish_foreground(cluster)


def _finish_foreground(cluster: Cluster) -> None:
    """Remove each object in Foreground deletion whose blocking dependents are all gone."""
    for resource in list(cluster.objects):
        for obj in list(cluster.objects[resource].values()):
            if "foregroundDeletion" not in (obj["metadata"].get("finalizers") or []):
                continue
            blocking = [child for _, child in _dependents(cluster, obj["metadata"]["uid"])
                        if any(ref.get("uid") == obj["metadata"]["uid"] and ref.get("blockOwnerDeletion")
                               for ref in child["metadata"]["ownerReferences"])]
            if not blocking:
                _remove(cluster, resource, obj)


def _ttl_sweep(cluster: Cluster) -> None:
    """The TTL-after-finished controller (pkg/controller/ttlafterfinished ``processJob``): a Job whose
    Complete or Failed condition is older than ``ttlSecondsAfterFinished`` (``jobFinishTime``: that
    condition's lastTransitionTime) is deleted, Foreground."""
    now = time.time()
    for job in list(cluster.objects["jobs"].values()):
        ttl = job["spec"].get("ttlSecondsAfterFinished")
        if ttl is None or job["metadata"].get("deletionTimestamp"):
            continue
        finished = [c for c in (job.get("status") or {}).get("conditions") or []
                    if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"]
        finish = finished and calendar.timegm(time.strptime(finished[0]["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ"))
        if finished and finish + ttl <= now:
            _delete(cluster, "jobs", job, "Foreground")


# --- PVCs and PVs --------------------------------------------------------------------------------------

def _bind_pvc(cluster: Cluster, pvc: dict) -> None:
    namespace, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
    pvc["status"] = {"phase": "Pending"}
    storage_class = pvc["spec"].get("storageClassName")
    if storage_class and ("", storage_class) not in cluster.objects["storageclasses"]:
        # kube-controller-manager's PV controller (pkg/controller/volume/persistentvolume/pv_controller.go
        # provisionClaimOperation -> findProvisionablePlugin): the class lister's NotFound, as a Warning.
        _record_event(cluster, pvc, "Warning", "ProvisioningFailed",
                      f'storageclass.storage.k8s.io "{storage_class}" not found', "persistentvolume-controller")
        return
    source = pvc["spec"].get("dataSource")
    if source and source.get("kind") == "VolumeSnapshot":
        # external-provisioner getSnapshotSource: same namespace, bound and readyToUse, big enough.
        snapshot = cluster.objects["volumesnapshots"].get((namespace, source["name"]))
        problem = None
        if snapshot is None or not (snapshot.get("status") or {}).get("boundVolumeSnapshotContentName"):
            problem = f"snapshot {source['name']} not bound"
        elif not snapshot["status"].get("readyToUse"):
            problem = f"snapshot {source['name']} is not Ready"
        else:
            requested = quantity_bytes(str(pvc["spec"]["resources"]["requests"]["storage"]))
            restore_size = quantity_bytes(str(snapshot["status"]["restoreSize"]))
            if requested < restore_size:
                problem = (f"requested volume size {requested} is less than the size {restore_size} for the source "
                           f"snapshot {source['name']}")
        if problem:
            _record_event(cluster, pvc, "Warning", "ProvisioningFailed", f"failed to provision volume with "
                          f"StorageClass \"{pvc['spec'].get('storageClassName')}\": error getting handle for "
                          f"DataSource Type VolumeSnapshot by Name {source['name']}: {problem}",
                          "csi.trident.netapp.io")
            return
    pv_name = f"pvc-{pvc['metadata']['uid']}"
    folder = cluster.root / "pv" / pv_name
    if source and source.get("kind") == "VolumeSnapshot":
        shutil.copytree(cluster.root / "snapshots" / namespace / source["name"], folder, symlinks=True)
    else:
        folder.mkdir(parents=True)
    modes = list(pvc["spec"].get("accessModes") or cluster.initial_pv_modes)
    if pvc["spec"].get("storageClassName") is None:
        modes = list(cluster.initial_pv_modes)
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": pv_name},
          "spec": {"accessModes": modes, "capacity": pvc["spec"]["resources"]["requests"],
                   "claimRef": {"namespace": namespace, "name": name, "uid": pvc["metadata"]["uid"]},
                   "persistentVolumeReclaimPolicy": "Retain",
                   "storageClassName": pvc["spec"].get("storageClassName") or STORAGE_CLASS,
                   "csi": {"driver": "csi.trident.netapp.io", "volumeHandle": pv_name}},
          "status": {"phase": "Bound"}}
    _stamp_metadata(cluster, pv, None)
    cluster.objects["persistentvolumes"][("", pv_name)] = pv
    pvc["spec"]["volumeName"] = pv_name
    pvc["status"] = {"phase": "Bound", "accessModes": modes, "capacity": pvc["spec"]["resources"]["requests"]}


# --- the Job controller ---------------------------------------------------------------------------------

def _start_job(cluster: Cluster, job: dict) -> None:
    job["status"] = {"active": 0, "failed": 0, "succeeded": 0, "startTime": _now()}
    spec = job["spec"]
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completions", 1)
    spec.setdefault("parallelism", 1)
    deadline = spec.get("activeDeadlineSeconds")
    if deadline:
        _later(cluster, float(deadline), lambda: _job_deadline(cluster, job))
    _new_job_pod(cluster, job)


def _job_pod_labels(job: dict) -> dict:
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    return {"job-name": name, "batch.kubernetes.io/job-name": name, "controller-uid": uid,
            "batch.kubernetes.io/controller-uid": uid}


def _new_job_pod(cluster: Cluster, job: dict) -> None:
    template = job["spec"]["template"]
    pod = _make_pod(cluster, job, f"{job['metadata']['name']}-{_suffix()}", template, _job_pod_labels(job))
    if pod is None:
        return
    job["status"]["active"] = 1
    namespace = job["metadata"]["namespace"]
    _later(cluster, cluster.image_pull_s, lambda: _run_job_container(cluster, job, pod, namespace))


def _run_job_container(cluster: Cluster, job: dict, pod: dict, namespace: str) -> None:
    if (namespace, pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    _start_container(cluster, pod, lambda state: _job_container_exited(cluster, job, pod, state))


def _crash_loop(cluster: Cluster, pod: dict, terminated: dict, restart: Callable[[], None]) -> int:
    """The kubelet restarts a failed container in place (restartPolicy OnFailure/Always) after a back-off:
    meanwhile it is Waiting with reason CrashLoopBackOff and a BackOff Warning is recorded
    (pkg/kubelet/kuberuntime ``doBackOff``; 10 s doubling to 300 s upstream). Returns the restart count."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    restarts = pod["status"]["containerStatuses"][0].get("restartCount", 0) + 1
    container = pod["spec"]["containers"][0]["name"]
    # The first restart is at once (no back-off entry yet), then 10 s, 20 s, ... (client-go flowcontrol.Backoff).
    delay = 0.0 if restarts == 1 else min(cluster.crash_backoff_s * 2 ** (restarts - 2), cluster.crash_backoff_s * 30)
    who = f"{name}_{namespace}({pod['metadata']['uid']})"
    if delay:
        _set_container_state(pod, {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay:g}s "
                                               f"restarting failed container={container} pod={who}"}},
                             ready=False, restarts=restarts)
        _record_event(cluster, pod, "Warning", "BackOff", f"Back-off restarting failed container {container} in "
                                                          f"pod {who}", "kubelet")
    else:
        _set_container_state(pod, {"terminated": terminated}, ready=False, restarts=restarts)
    pod["status"]["containerStatuses"][0]["lastState"] = {"terminated": terminated}

    def again() -> None:
        if cluster.objects["pods"].get((namespace, name)) is pod and (namespace, name) not in cluster.containers:
            _start_container(cluster, pod, restart)
    _later(cluster, delay, again)
    return restarts


def _job_container_exited(cluster: Cluster, job: dict, pod: dict, terminated: dict) -> None:
    namespace = pod["metadata"]["namespace"]
    if (namespace, pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    code = terminated["exitCode"]
    restart_policy = pod["spec"].get("restartPolicy", "Always")
    if code != 0 and restart_policy == "OnFailure":
        # pkg/controller/job: with OnFailure the pod's restarts count against backoffLimit.
        restarts = _crash_loop(cluster, pod, terminated, lambda again: _job_container_exited(cluster, job, pod, again))
        limit = job["spec"]["backoffLimit"]  # pastBackoffLimitOnFailure: restarts >= limit (> 0 for a limit of 0)
        if restarts >= limit if limit else restarts > 0:
            _fail_job(cluster, job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        return
    pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
    _set_container_state(pod, {"terminated": terminated}, ready=False)
    job["status"]["active"] = 0
    if code == 0:
        job["status"].update({"succeeded": 1, "completionTime": _now()})
        job["status"]["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": _now()}]
        _sync_owner(cluster, job)
        return
    job["status"]["failed"] = job["status"].get("failed", 0) + 1
    if job["status"]["failed"] > job["spec"]["backoffLimit"]:
        _fail_job(cluster, job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    else:
        _new_job_pod(cluster, job)


def _sync_job(cluster: Cluster, job: dict) -> None:
    """A pod of the Job failed without its container exiting (evicted): count it, replace it or give up."""
    uid = job["metadata"]["uid"]
    pods = [p for p in cluster.objects["pods"].values()
            if any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])]
    if job["status"].get("conditions") or any(p["status"].get("phase") in ("Pending", "Running") for p in pods):
        return
    job["status"]["failed"] = sum(1 for p in pods if p["status"].get("phase") == "Failed")
    job["status"]["active"] = 0
    if job["status"]["failed"] > job["spec"]["backoffLimit"]:
        _fail_job(cluster, job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    else:
        _new_job_pod(cluster, job)


def _fail_job(cluster: Cluster, job: dict, reason: str, message: str) -> None:
    """The Job fails; its active pods are terminated and deleted (pkg/controller/job: deleteActivePods)."""
    job["status"]["conditions"] = [{"type": "Failed", "status": "True", "reason": reason, "message": message,
                                    "lastTransitionTime": _now()}]
    job["status"]["active"] = 0
    uid = job["metadata"]["uid"]
    for pod in list(cluster.objects["pods"].values()):
        owned = any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])
        if owned and pod["status"].get("phase") in ("Pending", "Running"):
            _delete(cluster, "pods", pod)
    _sync_owner(cluster, job)


def _job_deadline(cluster: Cluster, job: dict) -> None:
    if (job["metadata"]["namespace"], job["metadata"]["name"]) in cluster.objects["jobs"] and \
            not job["status"].get("conditions"):
        _fail_job(cluster, job, "DeadlineExceeded", "Job was active longer than specified deadline")


# --- the MPI operator ---------------------------------------------------------------------------------

def _operator_defaults(spec: dict) -> dict:
    """``SetDefaults_MPIJob`` (default.go L27-80), in memory only: the operator never writes spec back."""
    spec = copy.deepcopy(spec)
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    spec.setdefault("slotsPerWorker", 1)
    spec.setdefault("sshAuthMountPath", "/root/.ssh")
    spec.setdefault("mpiImplementation", "OpenMPI")
    spec.setdefault("launcherCreationPolicy", "AtStartup")
    replicas = spec.get("mpiReplicaSpecs") or {}
    if "Launcher" in replicas:
        replicas["Launcher"].setdefault("restartPolicy", "OnFailure")
        replicas["Launcher"].setdefault("replicas", 1)
    if "Worker" in replicas:
        replicas["Worker"].setdefault("restartPolicy", "Never")
        replicas["Worker"].setdefault("replicas", 0)
    return spec


def _operator_validation(name: str, spec: dict) -> list:
    """``ValidateMPIJob`` (validation.go): the rules the controller applies before creating anything."""
    causes = []
    replicas = spec.get("mpiReplicaSpecs") or {}
    workers = replicas.get("Worker", {}).get("replicas", 0) if "Worker" in replicas else 0
    host = f"{name}-worker-{max(workers, 1) - 1}"
    problems = []
    if len(host) > 63:
        problems.append("must be no more than 63 characters")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", host):
        problems.append("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                        "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
                        "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
    if problems:
        causes.append(invalid("metadata.name", name, f"will not able to create pod and service with invalid DNS "
                                                     f"label {json.dumps(host)}: {', '.join(problems)}"))
    if spec["slotsPerWorker"] < 0:
        causes.append(invalid("spec.slotsPerWorker", spec["slotsPerWorker"], "must be greater than or equal to 0"))
    policy = spec["runPolicy"]
    if policy["cleanPodPolicy"] not in ("All", "None", "Running"):
        causes.append(not_supported("spec.runPolicy.cleanPodPolicy", policy["cleanPodPolicy"],
                                    ["All", "None", "Running"]))
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if policy.get(key) is not None and policy[key] < 0:
            causes.append(invalid(f"spec.runPolicy.{key}", policy[key], "must be greater than or equal to 0"))
    if not spec["sshAuthMountPath"]:
        causes.append(required("spec.sshAuthMountPath", "must have a mount path for SSH credentials"))
    if "Launcher" not in replicas:
        causes.append(required("spec.mpiReplicaSpecs[Launcher]", "must have Launcher replica spec"))
    for role, replica in replicas.items():
        where = f"spec.mpiReplicaSpecs[{role}]"
        if replica["restartPolicy"] not in ("Never", "OnFailure"):
            causes.append(not_supported(f"{where}.restartPolicy", replica["restartPolicy"], ["Never", "OnFailure"]))
        if not (replica.get("template") or {}).get("spec", {}).get("containers"):
            causes.append(required(f"{where}.template.spec.containers", "must define at least one container"))
    if "Launcher" in replicas and replicas["Launcher"]["replicas"] != 1:
        causes.append(invalid("spec.mpiReplicaSpecs[Launcher].replicas", replicas["Launcher"]["replicas"],
                              "must be 1"))
    if "Worker" in replicas and replicas["Worker"]["replicas"] <= 0:
        causes.append(invalid("spec.mpiReplicaSpecs[Worker].replicas", replicas["Worker"]["replicas"],
                              "must be greater than or equal to 1"))
    return causes


def _mpi_condition(job: dict, kind: str, status: str, reason: str, message: str) -> None:
    """``updateMPIJobConditions``: unchanged when equal; else replaced and appended; a terminal condition
    flips Running (and an earlier Failed) to False (mpi_job_controller_status.go)."""
    conditions = job.setdefault("status", {}).setdefault("conditions", [])
    for condition in conditions:
        if condition["type"] == kind and condition["status"] == status and condition.get("reason") == reason:
            return
    if kind in ("Succeeded", "Failed"):
        for condition in conditions:
            if condition["type"] in ("Running", "Failed") and condition["status"] == "True":
                condition["status"] = "False"
    conditions[:] = [c for c in conditions if c["type"] != kind]
    conditions.append({"type": kind, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": _now(), "lastUpdateTime": _now()})


def _start_mpijob(cluster: Cluster, job: dict) -> None:
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    spec = _operator_defaults(job.get("spec") or {})
    job["status"] = {}
    causes = _operator_validation(name, spec)
    if causes:
        texts = [c.text() for c in causes]
        aggregate = texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
        _record_event(cluster, job, "Warning", "ValidationError", f"Found validation errors: {aggregate}", OPERATOR)
        job.pop("status")
        return
    _mpi_condition(job, "Created", "True", "MPIJobCreated", f"MPIJob {namespace}/{name} is created.")
    _record_event(cluster, job, "Normal", "MPIJobCreated", f"MPIJob {namespace}/{name} is created.", OPERATOR)
    job["status"]["startTime"] = _now()
    cluster.operator_specs[(namespace, name)] = spec
    replicas = spec["mpiReplicaSpecs"]
    launcher = replicas["Launcher"]
    if (launcher["template"].get("spec") or {}).get("restartPolicy"):
        _record_event(cluster, job, "Warning", "SetPodTemplateRestartPolicy",
                      "Restart policy in pod template overridden by restart policy in replica spec", OPERATOR)
    _operator_objects(cluster, job, spec)
    base_labels = {"training.kubeflow.org/operator-name": "mpi-operator", "training.kubeflow.org/job-name": name}
    worker = replicas.get("Worker")
    for index in range(worker["replicas"] if worker else 0):
        template = _worker_template(job, spec, index)
        pod = _make_pod(cluster, job, f"{name}-worker-{index}", template, {
            **base_labels, "training.kubeflow.org/job-role": "worker",
            "training.kubeflow.org/replica-index": str(index)})
        if pod is None:
            return
        _later(cluster, cluster.image_pull_s, lambda pod=pod: _run_worker(cluster, job, pod))
    if spec["launcherCreationPolicy"] == "AtStartup":
        _create_launcher(cluster, job, spec)
    _sync_mpijob(cluster, job)


#: ``sshVolumeItems`` (mpi_job_controller.go v0.8.0 L142-155): the Secret's two keys as the three files
#: ssh expects.
SSH_ITEMS = [{"key": "ssh-privatekey", "path": "id_rsa"}, {"key": "ssh-publickey", "path": "id_rsa.pub"},
             {"key": "ssh-publickey", "path": "authorized_keys"}]


def _hostfile(job: dict, spec: dict) -> str:
    """``newConfigMap`` (L1309-1354) for OpenMPI: ``<job>-worker-<i>.<job>.<ns>.svc slots=<n>`` per worker."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    workers = spec["mpiReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    return "".join(f"{name}-worker-{i}.{name}.{namespace}.svc slots={spec['slotsPerWorker']}\n"
                   for i in range(workers))


def _discover_hosts(job: dict, running: list[str]) -> str:
    """``updateDiscoverHostsInConfigMap`` (L1357-1381): only Running workers, sorted by name."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    return "#!/bin/sh\n" + "".join(f"echo {pod}.{name}.{namespace}.svc\n" for pod in sorted(running))


def _operator_objects(cluster: Cluster, job: dict, spec: dict) -> None:
    """The ConfigMap ``<job>-config`` and the Secret ``<job>-ssh`` (``newSSHAuthSecret`` L1416-1451: a fresh
    ECDSA P-521 key, PEM "EC PRIVATE KEY", public key in authorized_keys format), owned by the job."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    owner = [_controller_ref(job)]
    key = ec.generate_private_key(ec.SECP521R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/ssh-auth",
              "metadata": {"name": f"{name}-ssh", "namespace": namespace, "labels": {"app": name},
                           "ownerReferences": owner},
              "data": {"ssh-privatekey": base64.b64encode(private).decode(),
                       "ssh-publickey": base64.b64encode(public + b"\n").decode()}}
    config = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": f"{name}-config", "namespace": namespace, "labels": {"app": name},
                           "ownerReferences": owner},
              "data": {"hostfile": _hostfile(job, spec), "discover_hosts.sh": _discover_hosts(job, [])}}
    for resource, obj in (("secrets", secret), ("configmaps", config)):
        _stamp_metadata(cluster, obj, namespace)
        cluster.objects[resource][(namespace, obj["metadata"]["name"])] = obj


def _setup_ssh(pod_spec: dict, job_name: str, spec: dict) -> None:
    """``setupSSHOnPod`` (L1764-1787): the key Secret on the first container at ``sshAuthMountPath``; mode
    0600 only at /root/.ssh."""
    secret: dict[str, Any] = {"secretName": f"{job_name}-ssh", "items": SSH_ITEMS}
    if spec["sshAuthMountPath"] == "/root/.ssh":
        secret["defaultMode"] = 0o600
    pod_spec.setdefault("volumes", []).append({"name": "ssh-auth", "secret": secret})
    pod_spec["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "ssh-auth", "mountPath": spec["sshAuthMountPath"]})


def _worker_template(job: dict, spec: dict, index: int) -> dict:
    """``newWorker`` (L1473-1525): host name and subdomain, ``K_MPI_JOB_ROLE=worker``, the replica's
    restartPolicy, ``/usr/sbin/sshd -De`` when the container sets neither command nor args, the ssh keys."""
    name = job["metadata"]["name"]
    worker = spec["mpiReplicaSpecs"]["Worker"]
    template = copy.deepcopy(worker["template"])
    pod_spec = template.setdefault("spec", {})
    pod_spec.update({"hostname": f"{name}-worker-{index}", "subdomain": name,
                     "restartPolicy": "Never" if worker["restartPolicy"] == "ExitCode" else worker["restartPolicy"]})
    container = pod_spec["containers"][0]
    container.setdefault("env", []).append({"name": "K_MPI_JOB_ROLE", "value": "worker"})
    if not container.get("command") and not container.get("args"):
        container["command"] = ["/usr/sbin/sshd", "-De"]
    _setup_ssh(pod_spec, name, spec)
    return template


def _run_worker(cluster: Cluster, job: dict, pod: dict) -> None:
    if (pod["metadata"]["namespace"], pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    _start_container(cluster, pod, lambda state: _worker_exited(cluster, pod, state))
    _sync_owner(cluster, pod)


def _worker_exited(cluster: Cluster, pod: dict, terminated: dict) -> None:
    if (pod["metadata"]["namespace"], pod["metadata"]["name"]) not in cluster.objects["pods"]:
        return
    code = terminated["exitCode"]
    if code != 0 and pod["spec"].get("restartPolicy", "Always") in ("Always", "OnFailure") and \
            pod["status"].get("phase") != "Failed":
        _crash_loop(cluster, pod, terminated, lambda again: _worker_exited(cluster, pod, again))
        _sync_owner(cluster, pod)
        return
    if pod["status"].get("phase") != "Failed":  # an eviction already set it
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
    _set_container_state(pod, {"terminated": terminated}, ready=False)
    _sync_owner(cluster, pod)


def _create_launcher(cluster: Cluster, job: dict, spec: dict) -> None:
    """``newLauncherJob``/``newLauncherPodTemplate`` (L1528-1640): a batch Job whose pod gets the replica's
    restartPolicy, host name ``<job>-launcher`` in the job's subdomain, ``K_MPI_JOB_ROLE=launcher``, the
    OpenMPI variables, empty NVIDIA variables (the launcher gets no GPU), the ssh keys and the hostfile
    ConfigMap at /etc/mpi (hostfile 0444, discover_hosts.sh 0555)."""
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]
    template = copy.deepcopy(launcher["template"])
    template.setdefault("metadata", {}).setdefault("labels", {}).update({
        "training.kubeflow.org/operator-name": "mpi-operator", "training.kubeflow.org/job-name": name,
        "training.kubeflow.org/job-role": "launcher"})
    pod_spec = template.setdefault("spec", {})
    pod_spec.update({"restartPolicy": launcher["restartPolicy"], "hostname": f"{name}-launcher", "subdomain": name})
    container = pod_spec["containers"][0]
    container.setdefault("env", []).extend([
        {"name": "K_MPI_JOB_ROLE", "value": "launcher"},
        {"name": "OMPI_MCA_orte_keep_fqdn_hostnames", "value": "true"},
        {"name": "OMPI_MCA_orte_default_hostfile", "value": "/etc/mpi/hostfile"},
        {"name": "OMPI_MCA_plm_rsh_args", "value": "-o ConnectionAttempts=10"},
        {"name": "OMPI_MCA_orte_set_default_slots", "value": str(spec["slotsPerWorker"])},
        {"name": "NVIDIA_VISIBLE_DEVICES"}, {"name": "NVIDIA_DRIVER_CAPABILITIES"}])
    _setup_ssh(pod_spec, name, spec)
    pod_spec.setdefault("volumes", []).append({"name": "mpi-job-config", "configMap": {
        "name": f"{name}-config", "items": [{"key": "hostfile", "path": "hostfile", "mode": 0o444},
                                            {"key": "discover_hosts.sh", "path": "discover_hosts.sh",
                                             "mode": 0o555}]}})
    container.setdefault("volumeMounts", []).append({"name": "mpi-job-config", "mountPath": "/etc/mpi"})
    policy = spec["runPolicy"]
    launcher_spec: dict[str, Any] = {"template": template, "podReplacementPolicy": "Failed"}
    for key in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
        if policy.get(key) is not None:
            launcher_spec[key] = policy[key]
    launcher_job = {"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": f"{name}-launcher", "namespace": namespace, "labels": {"app": name},
                                 "ownerReferences": [_controller_ref(job)]},
                    "spec": launcher_spec}
    launcher_job = check(launcher_job, "Strict").obj
    _stamp_metadata(cluster, launcher_job, namespace)
    cluster.objects["jobs"][(namespace, launcher_job["metadata"]["name"])] = launcher_job
    _start_job(cluster, launcher_job)


def _workers(cluster: Cluster, job: dict) -> list[dict]:
    uid = job["metadata"]["uid"]
    return [p for p in cluster.objects["pods"].values()
            if p["metadata"]["labels"].get("training.kubeflow.org/job-role") == "worker"
            and any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])]


def _launcher_job(cluster: Cluster, job: dict) -> dict | None:
    return cluster.objects["jobs"].get((job["metadata"]["namespace"], f"{job['metadata']['name']}-launcher"))


def _sync_mpijob(cluster: Cluster, job: dict) -> None:
    """``updateMPIJobStatus`` (L1094-1200), and the launcher's creation under WaitForWorkersReady."""
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    spec = cluster.operator_specs.get((namespace, name))
    if cluster.objects["mpijobs"].get((namespace, name)) is not job or spec is None:
        return
    workers = _workers(cluster, job)
    launcher = _launcher_job(cluster, job)
    ready = sum(1 for p in workers if (p["status"].get("conditions") or [{}])[0].get("status") == "True")
    if launcher is None and not _finished(job) and ready == len(workers):
        _create_launcher(cluster, job, spec)
        launcher = _launcher_job(cluster, job)
    launcher_running = 0
    if launcher is not None:
        conditions = {c["type"]: c for c in (launcher["status"].get("conditions") or [])}
        launcher_pods = [p for p in cluster.objects["pods"].values()
                         if p["metadata"]["labels"].get("job-name") == launcher["metadata"]["name"]]
        launcher_running = sum(1 for p in launcher_pods if p["status"].get("phase") == "Running")
        if "Complete" in conditions:
            message = f"MPIJob {namespace}/{name} successfully completed."
            job["status"].setdefault("completionTime", _now())
            if not _finished(job):
                _record_event(cluster, job, "Normal", "MPIJobSucceeded", message, OPERATOR)
            _mpi_condition(job, "Succeeded", "True", "MPIJobSucceeded", message)
        elif "Failed" in conditions:
            failed = conditions["Failed"]
            reason, message = failed.get("reason") or "MPIJobFailed", failed.get("message") or \
                f"MPIJob {namespace}/{name} has failed"
            if reason == "BackoffLimitExceeded":
                failed_pods = sorted((p for p in launcher_pods if p["status"].get("phase") == "Failed"),
                                     key=lambda p: p["metadata"]["creationTimestamp"])
                last = failed_pods[-1]["status"] if failed_pods else {}
                reason += "/" + last.get("reason", "")
                message += ": " + last.get("message", "")
            job["status"].setdefault("completionTime", _now())
            _mpi_condition(job, "Failed", "True", reason, message)
    evicted = sum(1 for p in workers if p["status"].get("phase") == "Failed" and p["status"].get("reason") == "Evicted")
    if evicted:
        message = f"{evicted}/{len(workers)} workers are evicted"
        _mpi_condition(job, "Failed", "True", "MPIJobEvicted", message)
        if launcher is not None:
            for pod in list(cluster.objects["pods"].values()):
                if pod["metadata"]["labels"].get("job-name") == launcher["metadata"]["name"]:
                    _kill(cluster, namespace, pod["metadata"]["name"])
    if not _finished(job) and launcher is not None and launcher_running >= 1 and \
            all(p["status"].get("phase") == "Running" for p in workers):
        _mpi_condition(job, "Running", "True", "MPIJobRunning", f"MPIJob {namespace}/{name} is running.")
    config = cluster.objects["configmaps"].get((namespace, f"{name}-config"))
    if config is not None:
        config["data"]["discover_hosts.sh"] = _discover_hosts(
            job, [p["metadata"]["name"] for p in workers if p["status"].get("phase") == "Running"])
    if _finished(job) and job["status"].get("completionTime") and spec["runPolicy"]["cleanPodPolicy"] in \
            ("Running", "All"):
        for pod in workers:
            if spec["runPolicy"]["cleanPodPolicy"] == "All" or pod["status"].get("phase") in ("Running", "Pending"):
                _delete(cluster, "pods", pod)


def _finished(job: dict) -> bool:
    return any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
               for c in (job.get("status") or {}).get("conditions", []))


# --- the snapshot controller ------------------------------------------------------------------------------

def _snapshot(cluster: Cluster, snapshot: dict) -> None:
    namespace, name = snapshot["metadata"]["namespace"], snapshot["metadata"]["name"]
    snapshot["status"] = {"readyToUse": False}
    attempts = {"n": 0}

    def attempt() -> None:
        if cluster.objects["volumesnapshots"].get((namespace, name)) is not snapshot:
            return
        attempts["n"] += 1
        error = _snapshot_problem(cluster, snapshot, attempts["n"])
        if error:
            # updateSnapshotErrorStatusWithEvent: the last error, with an event; retried with back-off.
            if (snapshot["status"].get("error") or {}).get("message") != error:
                snapshot["status"]["error"] = {"message": error, "time": _now()}
                _record_event(cluster, snapshot, "Warning", "SnapshotCreationFailed", error, "snapshot-controller")
            _later(cluster, 0.3, attempt)
            return
        claim = snapshot["spec"]["source"]["persistentVolumeClaimName"]
        target = cluster.root / "snapshots" / namespace / name
        shutil.copytree(cluster.claim_dir(namespace, claim), target, symlinks=True)  # the whole volume
        # restoreSize: the size the CSI driver reports for the snapshot (CreateSnapshot's size_bytes); for a
        # filesystem volume as ANF's, the source volume's size (external-snapshotter sets it from the driver).
        pv = cluster.objects["persistentvolumes"][("", cluster.objects["persistentvolumeclaims"][(namespace, claim)]
                                                   ["spec"]["volumeName"])]
        snapshot["status"] = {"readyToUse": True, "creationTime": _now(),
                              "restoreSize": pv["spec"]["capacity"]["storage"],
                              "boundVolumeSnapshotContentName": f"snapcontent-{snapshot['metadata']['uid']}"}

    _later(cluster, 0.05, attempt)


def _snapshot_problem(cluster: Cluster, snapshot: dict, attempt: int) -> str | None:
    namespace = snapshot["metadata"]["namespace"]
    if cluster.snapshot_error:
        return cluster.snapshot_error
    class_name = snapshot["spec"].get("volumeSnapshotClassName")
    if class_name and ("", class_name) not in cluster.objects["volumesnapshotclasses"]:
        return (f"Failed to get snapshot class with error volumesnapshotclass.snapshot.storage.k8s.io "
                f"\"{class_name}\" not found")
    claim = snapshot["spec"]["source"].get("persistentVolumeClaimName")
    if (namespace, claim) not in cluster.objects["persistentvolumeclaims"]:
        return f"PVC source for snapshot {namespace}/{snapshot['metadata']['name']} is missing"
    if attempt <= cluster.snapshot_conflicts:
        content = f"snapcontent-{snapshot['metadata']['uid']}"
        return (f"Failed to create snapshot: failed to add VolumeSnapshotBeingCreated annotation on the content "
                f"{content}: \"snapshot controller failed to update {content} on API server: Operation cannot be "
                f"fulfilled on volumesnapshotcontents.snapshot.storage.k8s.io \\\"{content}\\\": the object has "
                "been modified; please apply your changes to the latest version and try again\"")
    return None


_CONTROLLERS: dict[str, Callable[[Cluster, dict], None]] = {
    "persistentvolumeclaims": _bind_pvc, "jobs": _start_job, "mpijobs": _start_mpijob, "volumesnapshots": _snapshot}


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class KubernetesEmulator:
    """``with KubernetesEmulator(tmp) as cluster: ...``; ``cluster.url`` is the API server address."""

    def __init__(self, root: Path, namespaces: tuple[str, ...] = ("lanes",)) -> None:
        self.cluster = Cluster(root=root)
        for namespace in namespaces:  # created by an administrator before laneflow runs
            self.cluster.add_namespace(namespace)
        handler = type("Handler", (_Handler,), {"cluster": self.cluster})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._stopping = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="k8s-controllers")

    def _tick(self) -> None:
        """The controllers that act on time alone, once a second (the TTL-after-finished controller)."""
        while not self._stopping.wait(1.0):
            with self.cluster.lock:
                try:
                    _ttl_sweep(self.cluster)
                except Exception as exc:  # kept, and raised when the emulator stops: never lost silently
                    self.cluster.controller_errors.append(exc)
                    return
                self.cluster.changed.notify_all()

    def kubeconfig(self, namespace: str = "lanes") -> dict:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "laneflow", "user": {"token": "emulator-token"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "laneflow",
                                                              "namespace": namespace}}]}

    def __enter__(self) -> Cluster:
        self.thread.start()
        self._ticker.start()
        self.cluster.url = self.url
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._ticker.join()
        self.server.shutdown()
        self.server.server_close()
        with self.cluster.lock:
            self.cluster.closed = True
            containers = list(self.cluster.containers.values()) + self.cluster.terminating
            self.cluster.containers.clear()
            for log in self.cluster.logs.values():
                log.running = False
            self.cluster.changed.notify_all()
        for container in containers:  # the node goes away: every container is killed, and waited for
            container.stop(grace_s=0)
            if container.memory is not None:
                container.memory.remove()
        with self.cluster.lock:
            for namespace, name in list(self.cluster.pod_networks):
                _release_network(self.cluster, namespace, name)
