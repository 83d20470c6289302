"""The emulated cluster's API server (plain HTTP on 127.0.0.1 and HTTPS at the node address, ``emulator.py``):
it speaks the REST paths the real ``kubernetes`` client and kopf use (GET, list with label and field
selectors (``selectors.py``), watch (``watch.py``, from the watch cache of ``watch_cache.py``), POST,
PATCH, PUT, DELETE, and the discovery documents of ``discovery.py``) and is as strict as the real server
(``admission.py``): every object is checked against the published schemas and refused the way the API
server refuses it, unknown fields are dropped with a warning (or refused under
``fieldValidation=Strict``), MPIJob CRD defaults are stored; the caller is authenticated by its bearer
token (``authentication.py``) and — when RBAC is loaded — every request is authorized against the Roles
and ClusterRoles bound to its service account (``authorization.py``). Storage follows apiserver
``registry/generic/registry/store.go``: a new object
gets its system metadata and goes to its controller (``controller_manager.py``); DELETE reads its
``propagationPolicy`` (a batch/v1 Job's default is Orphan, with the API server's warning) and deletes
as the garbage collector does (``garbage_collector.py``); ``pods/log`` is the kubelet's log
(``podlogs.py``).

Updates (``updates.py``): PATCH by media type (JSON, merge, strategic merge; apply needs a field
manager; 415 for the rest and for strategic merge of custom resources), PUT with optimistic
concurrency, immutable fields refused, PVC resize only where the class allows it
(``admission.check_resize``).

Faults are queued per call type (``("POST", "mpijobs")``; ``("WATCH", "pods")`` for watches, so a
long-lived watcher never takes a fault meant for a list): 429 with Retry-After, 500, a reset before or
after the call took effect, 403. Every request is recorded with its namespace, RBAC verb and user.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import secrets
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.cluster import kueue_jobs, kueue_scheduler
from tests.cluster.admission import apply_crd_defaults, check, check_resize
from tests.cluster.apierrors import Rejection, invalid, invalid_status, not_supported, status_body
from tests.cluster.authentication import Identity, authenticate
from tests.cluster.authorization import (
    SELF_SUBJECT_ACCESS_REVIEWS,
    authorize,
    authorize_path,
    forbidden,
    self_subject_access_review,
)
from tests.cluster.controller_manager import CONTROLLERS
from tests.cluster.discovery import document, withheld_groups
from tests.cluster.disruption import evict
from tests.cluster.garbage_collector import delete, finish_deletion
from tests.cluster.job_controller import sync_job
from tests.cluster.network_policy import check_supported, enforce
from tests.cluster.node_objects import sync_node_objects
from tests.cluster.objects import RESOURCES, label_namespace, now, stamp_metadata
from tests.cluster.podlogs import PodLogEndpoint
from tests.cluster.selectors import field_selector, label_selector
from tests.cluster.state import Cluster, Fault, Request
from tests.cluster.updates import apply_patch, check_update
from tests.cluster.watch import WatchStream

_ROUTE = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log|eviction|pendingworkloads))?$")
_CUSTOM_RESOURCES = {"mpijobs", "volumesnapshots", "volumesnapshotclasses", "resourceflavors", "clusterqueues",
                     "localqueues", "workloads", "workloadpriorityclasses", "queues"}
#: An update of these may change which pods a NetworkPolicy isolates or admits (a policy, a pod's or a namespace's
#: labels): the policy plugin brings the rules up to date.
POLICY_INPUTS = {"networkpolicies", "pods", "namespaces"}
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


def _grace_period(query: dict, body: Any) -> int | None:
    """The DELETE's ``gracePeriodSeconds`` (query, or DeleteOptions body), which overrides a pod's own
    (``kubectl delete --grace-period``); None when not given."""
    given = (query.get("gracePeriodSeconds") or [None])[0]
    if given is None and isinstance(body, dict):
        given = body.get("gracePeriodSeconds")
    return None if given is None else int(given)


class Handler(WatchStream, PodLogEndpoint, BaseHTTPRequestHandler):
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
        try:
            who = authenticate(self.cluster, self.headers.get("Authorization"))
        except Rejection as rejection:
            self._send(rejection.code, rejection.body)
            return
        if parsed.path.rstrip("/") == SELF_SUBJECT_ACCESS_REVIEWS:
            try:
                review = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                review = None
            self._send(*self_subject_access_review(self.cluster, who, method, review))
            return
        withheld = withheld_groups(self.cluster)
        if method == "GET" and (found := document(parsed.path, withheld)) is not None:
            denied = authorize_path(self.cluster, who, parsed.path.rstrip("/") or "/")
            self._send(403, denied) if denied else self._send(200, found)
            return
        match = _ROUTE.match(parsed.path)
        resource = None
        if match:
            resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
        if match is None or resource not in RESOURCES or RESOURCES[resource][0] in withheld:
            self._send(404, status_body(404, "NotFound", f"the server could not find the requested resource "
                                                         f"({parsed.path})"))
            return
        namespace, name = match["ns"], match["name"]
        query = urllib.parse.parse_qs(parsed.query)
        watching = (query.get("watch") or [""])[0] in ("true", "1") and name is None
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method) or \
            ("watch" if watching else "get" if name else "list")
        cluster = self.cluster
        cluster.requests.append(Request(method, resource, namespace, name, verb, who.user))
        queue = cluster.faults.get((method if not watching else "WATCH", resource))
        fault = queue.pop(0) if queue else None
        if fault and not fault.after_effect:
            self._fault(fault, who, resource, verb, namespace)
            return
        denied = authorize(self.cluster, who, verb, resource, namespace, name)
        if denied:
            self._send(403, denied)
            return
        if watching:
            self._watch(resource, namespace, query)
            return
        try:  # a PATCH body is read by its media type (updates.apply_patch), after that is checked
            body = json.loads(raw) if raw and method != "PATCH" else None
        except json.JSONDecodeError:
            self._send(400, status_body(400, "BadRequest", "the request body is not valid JSON"))
            return
        if resource == "pods/log":
            self._pod_log(namespace, name, query)
            return
        if resource.endswith("/pendingworkloads"):
            with cluster.lock:
                summary = kueue_scheduler.pending_workloads(cluster, namespace, name or "")
            if summary is None:
                kind = resource.split("/")[0]
                self._send(404, status_body(404, "NotFound", f'{kind[:-1]} "{name}" not found',
                                            details={"name": name, "kind": kind}))
                return
            self._send(200, summary)
            return
        if resource == "pods/eviction":
            if method != "POST" or name is None:
                self._send(405, status_body(405, "MethodNotAllowed", f"{method} is not supported on pods/eviction"))
                return
            with cluster.lock:
                cluster.watch_cache.sync(cluster)
                try:
                    status, answer = evict(cluster, namespace, name, body)
                except Rejection as rejection:
                    status, answer = rejection.code, rejection.body
                cluster.watch_cache.sync(cluster)
                answer = copy.deepcopy(answer)
                cluster.changed.notify_all()
            self._send(status, answer)
            return
        if resource == "nodes" and method != "GET":
            self._send(405, status_body(405, "MethodNotAllowed", "the emulated cluster serves nodes read-only: a "
                                                                 "test changes Cluster.nodes (node_objects.py)"))
            return
        self._raw = raw
        with cluster.lock:
            if resource == "nodes":
                sync_node_objects(cluster, now())
            cluster.watch_cache.sync(cluster)  # what controllers changed gets its resourceVersion first
            try:
                status, answer, warnings = self._apply(method, resource, namespace, name, query, body)
            except Rejection as rejection:
                status, answer, warnings = rejection.code, rejection.body, []
            cluster.watch_cache.sync(cluster)
            answer = copy.deepcopy(answer)
            cluster.changed.notify_all()
        if fault and fault.after_effect:
            self._reset()
            return
        self._send(status, answer, headers=[("Warning", f'299 - {json.dumps(w)}') for w in warnings])

    def _fault(self, fault: Fault, who: Identity, resource: str, verb: str, namespace: str | None) -> None:
        if fault.hang is not None:
            fault.hang.wait()
            self._reset()
            return
        if fault.status == 0:
            self._reset()
            return
        headers = [("Retry-After", str(fault.retry_after))] if fault.retry_after is not None else None
        if fault.status == 403:
            self._send(403, forbidden(who, verb, resource, namespace, None))
            return
        reason = {429: "TooManyRequests"}.get(fault.status, "InternalError")
        self._send(fault.status, status_body(fault.status, reason, f"injected {fault.status}"), headers=headers)

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
        not_found = status_body(404, "NotFound", f'{resource}{"." + group if group else ""} "{name}" not found',
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
                metadata = body.get("metadata")
                if isinstance(metadata, dict) and not metadata.get("name") and metadata.get("generateName"):
                    # rest.BeforeCreate: the name is generateName plus five random characters
                    # (apiserver storage/names SimpleNameGenerator), before the object is validated.
                    metadata["name"] = metadata["generateName"][:58] + "".join(
                        secrets.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
            checked = check(body, (query.get("fieldValidation") or [None])[0])
            obj = checked.obj
            if resource == "networkpolicies":
                check_supported(obj)
            if obj["kind"] != kind:
                raise Rejection(400, status_body(400, "BadRequest", f"the API version in the data "
                                                                     f"({obj['apiVersion']}) does not match the "
                                                                     f"expected kind {kind}"))
            obj_key = (namespace or "", obj["metadata"]["name"])
            if namespaced and ("", namespace) not in cluster.objects["namespaces"]:
                # apiserver's NamespaceLifecycle admission plugin (plugin/pkg/admission/namespace/lifecycle):
                # creating in a namespace that does not exist is NotFound, naming the namespace.
                return 404, status_body(404, "NotFound", f'namespaces "{namespace}" not found',
                                        details={"name": namespace, "kind": "namespaces"}), []
            if obj_key in store:
                return 409, status_body(409, "AlreadyExists", f'{resource}{"." + group if group else ""} '
                                                              f'"{obj_key[1]}" already exists',
                                        details={"name": obj_key[1], "group": group, "kind": resource}), []
            apply_crd_defaults(obj)
            kueue_jobs.default_on_create(cluster, resource, obj)  # Kueue's webhooks, where it is installed
            kueue_jobs.validate(cluster, resource, obj)
            if resource == "namespaces":
                label_namespace(obj)
            stamp_metadata(cluster, obj, namespace if namespaced else None)
            store[obj_key] = obj
            CONTROLLERS.get(resource, lambda *_: None)(cluster, obj)
            if resource in kueue_jobs.KINDS:
                kueue_scheduler.cycle(cluster)  # its reconciler's watch on jobs: a Workload at once
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
                raise Rejection(409, status_body(409, "Conflict", f'Operation cannot be fulfilled on '
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
            kueue_jobs.validate(cluster, resource, checked.obj, current)
            if resource == "networkpolicies":
                check_supported(checked.obj)
            if resource == "namespaces":
                label_namespace(checked.obj)
            if resource == "persistentvolumeclaims":
                check_resize(cluster, current, checked.obj)
            cluster.version += 1
            checked.obj["metadata"]["resourceVersion"] = str(cluster.version)
            if resource == "jobs":
                # The Job controller holds the Job it syncs (its pods' callbacks): changed in place, then synced,
                # as its informer's update event makes it (pkg/controller/job updateJob; a lowered backoffLimit
                # fails a Job whose failures now exceed it).
                current.clear()
                current.update(checked.obj)
                store[key] = current
                sync_job(cluster, current)
            else:
                store[key] = checked.obj
            finish_deletion(cluster, resource, store[key])  # its last finalizer removed: it goes now
            if resource in POLICY_INPUTS:  # what the NetworkPolicy plugin watches: policies, and labels it selects by
                enforce(cluster)
            return 200, store[key], checked.warnings
        if method == "DELETE":
            obj = store.get(key)
            if obj is None:
                return 404, not_found, []
            policy, warnings = _propagation_policy(resource, query, body)
            if not delete(cluster, resource, obj, policy, _grace_period(query, body)):
                return 200, obj, warnings  # still there: being deleted (a pod's grace, a Foreground wait)
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                         "details": {"name": name, "group": group, "kind": resource,
                                     "uid": obj["metadata"]["uid"]}}, warnings
        return 405, status_body(405, "MethodNotAllowed", method), []

    def _replacement(self, resource: str, group: str, current: dict, body: Any) -> dict:
        """A PUT's object (apiserver handlers/update.go, rest.BeforeUpdate): the URL's name, the current
        resourceVersion (optimistic concurrency), uid and creation time kept when left out."""
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise Rejection(400, status_body(400, "BadRequest", "Object 'metadata' is missing in the request body"))
        name = current["metadata"]["name"]
        if body["metadata"].get("name") != name:
            raise Rejection(400, status_body(400, "BadRequest", f"the name of the object "
                                             f"({body['metadata'].get('name')}) does not match the name on the URL "
                                             f"({name})"))
        version = body["metadata"].get("resourceVersion")
        if not version:
            raise invalid_status(current["kind"], group, name, [
                invalid("metadata.resourceVersion", "0x0", "must be specified for an update")])
        if version != current["metadata"]["resourceVersion"]:
            qualified = f"{resource}.{group}" if group else resource
            raise Rejection(409, status_body(409, "Conflict", f'Operation cannot be fulfilled on {qualified} '
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
        labels = label_selector((query.get("labelSelector") or [""])[0])
        fields = field_selector(resource, (query.get("fieldSelector") or [""])[0])
        items = [copy.deepcopy(o) for (ns, _), o in store.items()
                 if (namespace is None or ns == namespace) and labels(o) and fields(o)]
        group, version, kind, _ = RESOURCES[resource]
        return {"kind": f"{kind}List", "apiVersion": f"{group}/{version}" if group else version,
                "metadata": {"resourceVersion": str(self.cluster.version)}, "items": items}


class Server(ThreadingHTTPServer):
    daemon_threads = True
