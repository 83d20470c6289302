"""An in-process Kubernetes API emulator on 127.0.0.1 for contract tests of the cluster platform.

It speaks the real REST paths the ``kubernetes`` client uses, and plays the controllers too:
- PVCs bind to a new PV (a folder on this machine); a PVC with a VolumeSnapshot dataSource starts as a
  copy of the snapshot;
- batch Jobs and MPIJobs run their container's command on this machine, with ``/data`` mapped to the
  claim's folder and ``horovodrun --hostfile`` turned into ``horovodrun -H localhost:N --gloo``; their
  output becomes the pod's log; conditions follow the process (Created, Running, Succeeded/Failed);
- VolumeSnapshots copy the claim's folder and turn ``readyToUse``.
Faults are queued per call type (``("POST", "mpijobs")``): 429 with Retry-After, 500, a connection
reset before or after the call took effect, 403. Every request is recorded.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROUTES = [
    (re.compile(r"^/api/v1/persistentvolumes(?:/(?P<name>[^/]+))?$"), "persistentvolumes", False),
    (re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/persistentvolumeclaims(?:/(?P<name>[^/]+))?$"),
     "persistentvolumeclaims", True),
    (re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$"), "pods/log", True),
    (re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+))?$"), "pods", True),
    (re.compile(r"^/apis/batch/v1/namespaces/(?P<ns>[^/]+)/jobs(?:/(?P<name>[^/]+))?$"), "jobs", True),
    (re.compile(r"^/apis/kubeflow.org/v2beta1/namespaces/(?P<ns>[^/]+)/mpijobs(?:/(?P<name>[^/]+))?$"),
     "mpijobs", True),
    (re.compile(r"^/apis/snapshot.storage.k8s.io/v1/namespaces/(?P<ns>[^/]+)/volumesnapshots"
                r"(?:/(?P<name>[^/]+))?$"), "volumesnapshots", True),
]


@dataclass
class Fault:
    status: int = 500  # 0: reset the connection
    retry_after: int | None = None
    after_effect: bool = False  # reset after the call took effect (the client never hears the answer)


@dataclass
class Cluster:
    root: Path
    objects: dict[str, dict[tuple[str, str], dict]] = field(default_factory=lambda: defaultdict(dict))
    faults: dict[tuple[str, str], list[Fault]] = field(default_factory=lambda: defaultdict(list))
    requests: list[tuple[str, str, bool]] = field(default_factory=list)  # (method, kind, names an object)
    logs: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    processes: dict[tuple[str, str], subprocess.Popen] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    initial_pv_modes: list[str] = field(default_factory=lambda: ["ReadWriteOnce"])
    fail_mpijobs: bool = False  # MPIJob launchers exit 1 at once, workers report OOMKilled
    version: int = 0

    def claim_dir(self, namespace: str, claim: str) -> Path:
        pvc = self.objects["persistentvolumeclaims"][(namespace, claim)]
        return self.root / "pv" / pvc["spec"]["volumeName"]

    def inject(self, method: str, kind: str, *faults: Fault) -> None:
        self.faults[(method, kind)].extend(faults)

    def count(self, kind: str) -> int:
        return len(self.objects[kind])


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _merge(target: dict, patch: dict) -> dict:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
    return target


class _Handler(BaseHTTPRequestHandler):
    cluster: Cluster
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    # --- plumbing ----------------------------------------------------------------------------------
    def _send(self, status: int, body: Any, content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                          "reason": reason, "code": code})

    def _reset(self) -> None:
        self.close_connection = True
        self.connection.shutdown(2)

    def _route(self) -> tuple[str, str | None, str | None, dict[str, list[str]]] | None:
        parsed = urllib.parse.urlsplit(self.path)
        for pattern, kind, _ in ROUTES:
            match = pattern.match(parsed.path)
            if match:
                groups = match.groupdict()
                return kind, groups.get("ns"), groups.get("name"), urllib.parse.parse_qs(parsed.query)
        return None

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        route = self._route()
        if route is None:
            self._status(404, "NotFound", f"no route for {self.path}")
            return
        kind, namespace, name, query = route
        cluster = self.cluster
        cluster.requests.append((method, kind, name is not None))
        queue = cluster.faults.get((method, kind))
        fault = queue.pop(0) if queue else None
        if fault and not fault.after_effect:
            if fault.status == 0:
                self._reset()
                return
            headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else None
            reason = {403: "Forbidden", 429: "TooManyRequests"}.get(fault.status, "InternalError")
            message = (f'{kind} is forbidden: User "system:serviceaccount:lanes:laneflow" cannot {method.lower()} '
                       f'resource "{kind}"' if fault.status == 403 else f"injected {fault.status}")
            data = json.dumps({"kind": "Status", "status": "Failure", "message": message, "reason": reason,
                               "code": fault.status}).encode()
            self._send(fault.status, data, headers=headers)
            return
        body = json.loads(raw) if raw else None
        with cluster.lock:
            status, answer, content_type = self._apply(method, kind, namespace, name, query, body)
        if fault and fault.after_effect:
            self._reset()
            return
        self._send(status, answer, content_type)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    # --- semantics ---------------------------------------------------------------------------------
    def _apply(self, method: str, kind: str, namespace: str | None, name: str | None, query: dict,
               body: Any) -> tuple[int, Any, str]:
        cluster = self.cluster
        store = cluster.objects[kind]
        key = (namespace or "", name or "")
        if kind == "pods/log":
            lines = cluster.logs.get((namespace, name))
            if lines is None:
                return 404, _status_body(404, "NotFound", f'pods "{name}" not found'), "application/json"
            return 200, "".join(lines).encode(), "text/plain"
        if method == "GET" and name is None:
            selector = dict(part.split("=", 1) for part in query.get("labelSelector", [""])[0].split(",") if part)
            items = [o for (ns, _), o in store.items() if ns == (namespace or "")
                     and all(o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
            return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items}, "application/json"
        if method == "GET":
            if key not in store:
                return 404, _status_body(404, "NotFound", f'{kind} "{name}" not found'), "application/json"
            return 200, store[key], "application/json"
        if method == "POST":
            obj = copy.deepcopy(body)
            obj_key = (namespace or "", obj["metadata"]["name"])
            if obj_key in store:
                return 409, _status_body(409, "AlreadyExists", f'{kind} "{obj_key[1]}" already exists'), \
                    "application/json"
            cluster.version += 1
            obj["metadata"].update({"namespace": namespace, "uid": f"uid-{cluster.version}",
                                    "resourceVersion": str(cluster.version), "creationTimestamp": _now()})
            if namespace is None:
                obj["metadata"].pop("namespace")
            store[obj_key] = obj
            _controllers[kind](cluster, obj)
            return 201, obj, "application/json"
        if method == "PATCH":
            if key not in store:
                return 404, _status_body(404, "NotFound", f'{kind} "{name}" not found'), "application/json"
            if isinstance(body, list):
                raise NotImplementedError("JSON patch is not used by laneflow")
            _merge(store[key], body)
            cluster.version += 1
            store[key]["metadata"]["resourceVersion"] = str(cluster.version)
            return 200, store[key], "application/json"
        if method == "DELETE":
            obj = store.pop(key, None)
            if obj is None:
                return 404, _status_body(404, "NotFound", f'{kind} "{name}" not found'), "application/json"
            process = cluster.processes.pop((namespace, name), None)
            if process and process.poll() is None:
                process.kill()
            return 200, _status_body(200, "", "deleted") | {"status": "Success"}, "application/json"
        return 405, _status_body(405, "MethodNotAllowed", method), "application/json"


def _status_body(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}


# --- controllers -----------------------------------------------------------------------------------

def _bind_pvc(cluster: Cluster, pvc: dict) -> None:
    namespace, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
    pv_name = f"pvc-{pvc['metadata']['uid']}"
    folder = cluster.root / "pv" / pv_name
    source = pvc["spec"].get("dataSource")
    if source and source.get("kind") == "VolumeSnapshot":
        shutil.copytree(cluster.root / "snapshots" / namespace / source["name"], folder, symlinks=True)
    else:
        folder.mkdir(parents=True)
    modes = list(pvc["spec"].get("accessModes") or cluster.initial_pv_modes)
    cluster.objects["persistentvolumes"][("", pv_name)] = {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": pv_name, "resourceVersion": "1", "uid": f"uid-{pv_name}"},
        "spec": {"accessModes": modes, "capacity": pvc["spec"]["resources"]["requests"],
                 "claimRef": {"namespace": namespace, "name": name},
                 "storageClassName": pvc["spec"].get("storageClassName"), "csi": {"driver": "csi.trident.netapp.io",
                                                                                  "volumeHandle": pv_name}},
        "status": {"phase": "Bound"}}
    pvc["spec"]["volumeName"] = pv_name
    pvc["status"] = {"phase": "Bound", "accessModes": modes}


def _container_status(name: str, image: str, code: int, reason: str) -> dict:
    return {"name": name, "image": image, "imageID": f"{image}@sha256:{'0' * 64}", "ready": False,
            "restartCount": 0, "state": {"terminated": {"exitCode": code, "reason": reason}}}


def _container_command(cluster: Cluster, namespace: str, command: list[str], claim: str | None) -> list[str]:
    """The container's command as it runs here: /data is the claim's folder, horovodrun uses Gloo on localhost."""
    data = str(cluster.claim_dir(namespace, claim)) if claim else "/nonexistent"
    argv = [arg.replace("/data", data, 1) if arg.startswith("/data") else arg for arg in command]
    if argv[0] == "horovodrun" and "--hostfile" in argv:
        at = argv.index("--hostfile")
        np_ = argv[argv.index("-np") + 1]
        argv[at:at + 2] = ["-H", f"localhost:{np_}", "--gloo"]
    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / arg) if arg in ("horovodrun", "python") else arg for arg in argv]


def _run_pod(cluster: Cluster, obj: dict, namespace: str, pod: str, labels: dict, command: list[str],
             claim: str | None, on_exit: Any) -> None:
    cluster.objects["pods"][(namespace, pod)] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": namespace, "labels": labels},
        "status": {"phase": "Running", "containerStatuses": []}}
    cluster.logs[(namespace, pod)] = []
    name = obj["metadata"]["name"]
    if cluster.fail_mpijobs and obj["kind"] == "MPIJob":
        argv = [sys.executable, "-c", "import sys; print('Traceback: CUDA error: out of memory', flush=True); "
                                      "sys.exit(1)"]
    else:
        argv = _container_command(cluster, namespace, command, claim)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    cluster.processes[(namespace, name)] = process

    def pump() -> None:
        for line in process.stdout:
            with cluster.lock:
                cluster.logs[(namespace, pod)].append(line)
        code = process.wait()
        with cluster.lock:
            pod_obj = cluster.objects["pods"].get((namespace, pod))
            if pod_obj:
                pod_obj["status"] = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
                    _container_status("main", "emulated", code, "Completed" if code == 0 else "Error")]}
            on_exit(code)

    threading.Thread(target=pump, daemon=True).start()


def _condition(obj: dict, kind: str, reason: str = "", message: str = "") -> None:
    conditions = obj.setdefault("status", {}).setdefault("conditions", [])
    for condition in conditions:
        condition["status"] = "False" if condition["type"] in ("Running",) and kind != "Running" else \
            condition["status"]
    conditions.append({"type": kind, "status": "True", "reason": reason, "message": message,
                       "lastTransitionTime": _now()})


def _start_job(cluster: Cluster, job: dict) -> None:
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    claim = next((v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", [])
                  if "persistentVolumeClaim" in v), None)
    job["status"] = {"active": 1, "startTime": _now()}

    def done(code: int) -> None:
        if (namespace, name) not in cluster.objects["jobs"]:
            return
        job["status"] = {"succeeded": 1} if code == 0 else {"failed": 1}
        job["status"]["conditions"] = [{"type": "Complete" if code == 0 else "Failed", "status": "True",
                                        "reason": "" if code == 0 else "BackoffLimitExceeded"}]

    _run_pod(cluster, job, namespace, f"{name}-pod", {**job["spec"]["template"]["metadata"].get("labels", {}),
                                                      "job-name": name},
             container["command"], claim, done)


def _start_mpijob(cluster: Cluster, job: dict) -> None:
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    replicas = job["spec"]["mpiReplicaSpecs"]
    launcher = replicas["Launcher"]["template"]
    worker = replicas["Worker"]["template"]
    claim = next(v["persistentVolumeClaim"]["claimName"] for v in worker["spec"]["volumes"]
                 if "persistentVolumeClaim" in v)
    _condition(job, "Created", "MPIJobCreated")
    _condition(job, "Running", "MPIJobRunning")
    for index in range(replicas["Worker"]["replicas"]):
        cluster.objects["pods"][(namespace, f"{name}-worker-{index}")] = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": f"{name}-worker-{index}", "namespace": namespace,
                "labels": {**worker["metadata"]["labels"], "training.kubeflow.org/job-name": name}},
            "status": {"phase": "Running"}}

    def done(code: int) -> None:
        if (namespace, name) not in cluster.objects["mpijobs"]:
            return
        if code == 0:
            _condition(job, "Succeeded", "MPIJobSucceeded", f"MPIJob {namespace}/{name} successfully completed.")
        else:
            _condition(job, "Failed", "MPIJobFailed", f"MPIJob {namespace}/{name} has failed")
            for index in range(replicas["Worker"]["replicas"]):
                pod = cluster.objects["pods"].get((namespace, f"{name}-worker-{index}"))
                if pod:
                    pod["status"] = {"phase": "Failed", "containerStatuses": [_container_status(
                        "worker", "emulated", 137 if index == 0 else 1, "OOMKilled" if index == 0 else "Error")]}

    _run_pod(cluster, job, namespace, f"{name}-launcher", {**launcher["metadata"]["labels"],
                                                          "training.kubeflow.org/job-name": name},
             launcher["spec"]["containers"][0]["command"], claim, done)


def _snapshot(cluster: Cluster, snapshot: dict) -> None:
    namespace, name = snapshot["metadata"]["namespace"], snapshot["metadata"]["name"]
    claim = snapshot["spec"]["source"]["persistentVolumeClaimName"]
    if (namespace, claim) not in cluster.objects["persistentvolumeclaims"]:
        snapshot["status"] = {"readyToUse": False, "error": {"message": f'PVC "{claim}" not found',
                                                             "time": _now()}}
        return
    target = cluster.root / "snapshots" / namespace / name
    shutil.copytree(cluster.claim_dir(namespace, claim), target, symlinks=True,
                    ignore=shutil.ignore_patterns("cache"))
    snapshot["status"] = {"readyToUse": True, "creationTime": _now(), "restoreSize": "1Gi",
                          "boundVolumeSnapshotContentName": f"snapcontent-{snapshot['metadata']['uid']}"}


_controllers = defaultdict(lambda: lambda cluster, obj: None, {
    "persistentvolumeclaims": _bind_pvc, "jobs": _start_job, "mpijobs": _start_mpijob, "volumesnapshots": _snapshot})


class KubernetesEmulator:
    """``with KubernetesEmulator(tmp) as cluster: ...``; ``cluster.url`` is the API server address."""

    def __init__(self, root: Path) -> None:
        self.cluster = Cluster(root=root)
        handler = type("Handler", (_Handler,), {"cluster": self.cluster})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def kubeconfig(self, namespace: str = "lanes") -> dict:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "laneflow", "user": {"token": "emulator-token"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "laneflow",
                                                              "namespace": namespace}}]}

    def __enter__(self) -> Cluster:
        self.thread.start()
        self.cluster.url = self.url  # type: ignore[attr-defined]
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        for process in self.cluster.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, 9)
