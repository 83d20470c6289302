"""An Azure Resource Manager emulator over TLS on 127.0.0.1 (a throwaway CA from ``trustme``), with the Entra ID
token endpoint its clients ask first (``entra.py``), for contract tests of laneflow's ANF access with the
real azure-mgmt-netapp client.

It follows the Microsoft.NetApp REST spec (Azure/azure-rest-api-specs
``specification/netapp/resource-manager/Microsoft.NetApp/NetApp/stable/2026-08-01/netapp.json``, the
api-version azure-mgmt-netapp 18.0.0 defaults to) and what the real service answers:

- ``Volumes_PoolChange``: ``POST .../volumes/{v}/poolChange`` with a required ``newPoolResourceId``;
  ``202`` with ``Location`` (spec; ``...&operationResultResponseType=Location``, as in the spec's
  ``examples/Volumes_PoolChange.json``) and ``Azure-AsyncOperation`` — real ANF sends both (Microsoft's
  ANF docs, ``azure-netapp-files/configure-customer-managed-keys.md``), both at
  ``/subscriptions/{sub}/providers/Microsoft.NetApp/locations/{location}/operationResults/{id}``;
- ``Snapshots_Create``: ``PUT .../snapshots/{s}`` with a required ``location``; ``201`` with the
  Snapshot (``provisioningState: Creating``) and the same two headers; final state via Location;
- the operation resource: the Azure-AsyncOperation URL answers ``200`` with ``{id, name, status,
  startTime, endTime, percentComplete, properties, error}`` (ARM RPC ``async-api-reference.md``);
  the Location URL answers ``202`` while running, then the final result (the Snapshot for a create,
  nothing for a pool change), or the error. An operation ends on Azure's clock (``operation_s`` after
  it was accepted), whether anyone polls it or not: a client that stops waiting does not stop the move;
- errors as ``{"error": {"code", "message"}}`` (common-types v6 ``ErrorResponse``); a missing
  ``api-version`` is refused as ARM refuses it; a pool change while another runs on the volume is
  ``409 RequestConflict`` (see ``_resource``);
- ``Arm.levels`` records when each level change took effect on Azure's clock, for tests that ask which
  level a volume was on while a run trained.

Every request is also recorded as the RBAC action ARM checks for it (``Arm.actions``), so tests can
hold the custom role in ``deployments/azure`` to what the code really calls. Faults are queued per
operation name; ``fail_operations`` makes an operation's long-running part end Failed.
"""

from __future__ import annotations

import json
import math
import re
import ssl
import threading
import time
import urllib.parse
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme

from tests.azure.entra import TOKEN, entra_answer

API_VERSION = "2026-08-01"
PROVIDER = "Microsoft.NetApp"
VOLUME = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft.NetApp/"
                    r"netAppAccounts/(?P<account>[^/]+)/capacityPools/(?P<pool>[^/]+)/volumes/(?P<volume>[^/]+)"
                    r"(?P<rest>/.*)?$")
POOL_VOLUMES = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft.NetApp/"
                          r"netAppAccounts/(?P<account>[^/]+)/capacityPools/(?P<pool>[^/]+)/volumes$")
OPERATION = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/Microsoft.NetApp/locations/(?P<location>[^/]+)/"
                       r"operationResults/(?P<id>[^/]+)$")
#: The RBAC action ARM authorizes each operation with (Azure permissions for Storage, Microsoft.NetApp).
ACTIONS = {
    "get_volume": f"{PROVIDER}/netAppAccounts/capacityPools/volumes/read",
    "list_volumes": f"{PROVIDER}/netAppAccounts/capacityPools/volumes/read",
    "pool_change": f"{PROVIDER}/netAppAccounts/capacityPools/volumes/poolChange/action",
    "create_snapshot": f"{PROVIDER}/netAppAccounts/capacityPools/volumes/snapshots/write",
    "get_snapshot": f"{PROVIDER}/netAppAccounts/capacityPools/volumes/snapshots/read",
    "list_snapshots": f"{PROVIDER}/netAppAccounts/capacityPools/volumes/snapshots/read",
    "operation_result": f"{PROVIDER}/locations/operationresults/read",
}


@dataclass
class Arm:
    base: str = ""
    location: str = "westeurope"
    #: volume name -> {"pool", "level", "quota"}
    volumes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pools: dict[str, str] = field(default_factory=dict)  # pool name -> service level
    snapshots: dict[str, dict] = field(default_factory=dict)
    operations: dict[str, dict] = field(default_factory=dict)
    faults: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # op -> statuses
    fail_operations: set[str] = field(default_factory=set)  # ops whose LRO ends Failed
    #: How long a long-running operation runs on Azure's side, from its acceptance; ``math.inf``: until
    #: ``run_out`` (a move that outlasts every wait of laneflow's however slow the machine is).
    operation_s: float = 0.2
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (method, path, headers)
    actions: list[str] = field(default_factory=list)  # the RBAC action of each ARM request
    secrets_seen: list[str] = field(default_factory=list)
    #: Every level change as Azure made it: (Unix time it took effect, volume, new level).
    levels: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def advance(self) -> None:
        """Operations whose time has come end now (their effect applied), polled or not."""
        with self.lock:
            for record in self.operations.values():
                if "outcome" not in record and time.monotonic() >= record["due"]:
                    if record["op"] in self.fail_operations:
                        record["outcome"] = ("Failed", None)
                    else:
                        record["outcome"] = ("Succeeded", record["effect"](record["due_at"]))

    def run_out(self) -> None:
        """Let every accepted operation reach its end (what Azure does while nobody looks), for assertions.
        An operation accepted with ``operation_s = math.inf`` (one that outlasts whatever laneflow waits, on any
        machine's speed) ends now."""
        with self.lock:
            for record in self.operations.values():
                if "outcome" not in record and math.isinf(record["due"]):
                    record["due"], record["due_at"] = time.monotonic(), time.time()
        pending = [r["due"] for r in self.operations.values() if "outcome" not in r]
        if pending:
            time.sleep(max(0.0, max(pending) - time.monotonic()))
        self.advance()

    def pool_of(self, volume: str) -> str:
        return self.volumes[volume]["pool"]


class _Handler(BaseHTTPRequestHandler):
    arm: Arm
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        self._send(status, {"error": {"code": code, "message": message}}, headers)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        parts = urllib.parse.urlsplit(self.path)
        path, query = parts.path, urllib.parse.parse_qs(parts.query)
        arm = self.arm
        arm.requests.append((method, path, dict(self.headers)))
        arm.advance()
        answer = entra_answer(arm.base, path, raw, arm.secrets_seen)
        if answer is not None:
            self._send(200, answer)
            return
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(401, "AuthenticationFailed", "missing or wrong bearer token")
            return
        if not query.get("api-version"):
            self._error(400, "MissingApiVersionParameter", "The api-version query parameter (?api-version=) is "
                                                           "required for all requests.")
            return
        if query["api-version"][0] != API_VERSION:
            # ARM refuses a version the provider does not register for the type; this emulator knows the
            # one spec it was written from, so any other is refused rather than answered by the wrong rules.
            self._error(400, "NoRegisteredProviderFound",
                        f"No registered resource provider found for location '{arm.location}' and API version "
                        f"'{query['api-version'][0]}' for type 'netAppAccounts'. The supported api-versions are "
                        f"'{API_VERSION}'.")
            return
        operation = OPERATION.match(path)
        if operation and method == "GET":
            arm.actions.append(ACTIONS["operation_result"])
            with arm.lock:
                self._operation(operation["id"], query.get("operationResultResponseType") == ["Location"])
            return
        listing = POOL_VOLUMES.match(path)
        if listing and method == "GET":
            # Volumes_List: GET .../capacityPools/{pool}/volumes -> VolumeList {value: [Volume]}.
            arm.actions.append(ACTIONS["list_volumes"])
            if listing["pool"] not in arm.pools:
                self._error(404, "ResourceNotFound", f"capacity pool {listing['pool']} not found")
                return
            with arm.lock:
                volumes = [_volume_body(arm, VOLUME.match(f"{path}/{name}"), state)
                           for name, state in arm.volumes.items() if state["pool"] == listing["pool"]]
            self._send(200, {"value": volumes})
            return
        match = VOLUME.match(path)
        if not match:
            self._error(404, "NotFound", f"no route {path}")
            return
        rest = match["rest"] or ""
        op = {("GET", ""): "get_volume", ("POST", "/poolChange"): "pool_change"}.get((method, rest))
        if op is None and rest.startswith("/snapshots/"):
            op = "create_snapshot" if method == "PUT" else "get_snapshot"
        if op is None and rest == "/snapshots" and method == "GET":
            op = "list_snapshots"
        if op is None:
            self._error(405, "MethodNotAllowed", f"{method} {rest}")
            return
        arm.actions.append(ACTIONS[op])
        queued = arm.faults.get(op)
        if queued:
            status = queued.pop(0)
            self._error(status, "Throttled" if status == 429 else "InternalServerError", f"injected {status}",
                        {"Retry-After": "1"} if status == 429 else None)
            return
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            self._error(400, "InvalidRequestContent", "The request content was invalid and could not be deserialized.")
            return
        with arm.lock:
            self._resource(match, rest, op, body)

    def _resource(self, match: re.Match, rest: str, op: str, body: Any) -> None:
        arm = self.arm
        volume = match["volume"]
        state = arm.volumes.get(volume)
        if state is None or state["pool"] != match["pool"]:
            self._error(404, "ResourceNotFound", f"The Resource 'Microsoft.NetApp/netAppAccounts/{match['account']}/"
                                                 f"capacityPools/{match['pool']}/volumes/{volume}' under resource "
                                                 f"group '{match['rg']}' was not found.")
            return
        if op == "get_volume":
            self._send(200, _volume_body(arm, match, state))
            return
        if op == "pool_change":
            target_id = (body or {}).get("newPoolResourceId")
            if not isinstance(target_id, str):  # PoolChangeRequest: `required: [newPoolResourceId]`
                self._error(400, "InvalidRequestContent", "newPoolResourceId is required")
                return
            target = target_id.rstrip("/").rsplit("/", 1)[-1]
            account = re.search(r"/netAppAccounts/([^/]+)/capacityPools/", target_id, re.IGNORECASE)
            if account is None or account[1].lower() != match["account"].lower():
                # Microsoft Learn, "Dynamically change the service level of a volume": the destination pool
                # must be in the same NetApp account. (The rule is documented; this error's wording is ours.)
                self._error(400, "InvalidPoolChange", "The destination capacity pool must be in the same NetApp "
                                                      f"account as the volume ('{match['account']}')")
                return
            if target not in arm.pools:
                self._error(400, "InvalidPool", f"capacity pool {target} does not exist")
                return
            if _moving(arm, volume):
                # A volume whose provisioning state is not terminal cannot be modified: ARM answers 409
                # RequestConflict ("Cannot modify resource with id '…' because the resource entity provisioning
                # state is not terminal. Please wait for the provisioning state to become terminal"), as real
                # ANF answered an operation on a volume mid-PATCH (hashicorp/go-azure-sdk#889). That a second
                # poolChange meets the same gate is our assumption: no published source shows that case.
                self._error(409, "RequestConflict", f"Cannot modify resource with id '{match.string.split('/pool')[0]}"
                            "' because the resource entity provisioning state is not terminal. Please wait for the "
                            "provisioning state to become terminal and then retry the request.")
                return
            resource = match.string.split("/poolChange")[0]

            def moved(at: float) -> None:
                state.update(pool=target, level=arm.pools[target])
                arm.levels.append((at, volume, arm.pools[target]))

            self._start_operation(match["sub"], op, resource, "POOLCHANGE", moved, status=202)
            return
        name = rest.rsplit("/", 1)[-1]
        resource_id = f"{match.string.split('/snapshots')[0]}/snapshots/{name}"
        if op == "create_snapshot":
            if not isinstance(body, dict) or not body.get("location"):  # Snapshot: `required: [location]`
                self._error(400, "InvalidRequestContent", "location is required")
                return
            snapshot = {"id": resource_id, "name": f"{match['account']}/{match['pool']}/{volume}/{name}",
                        "location": arm.location,
                        "type": "Microsoft.NetApp/netAppAccounts/capacityPools/volumes/snapshots",
                        "properties": {"snapshotId": str(uuid.uuid4()), "provisioningState": "Creating",
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}

            def created(_at: float) -> dict:
                done = {**snapshot, "properties": {**snapshot["properties"], "provisioningState": "Succeeded"}}
                arm.snapshots[name] = done
                return done

            # The resource exists from the PUT on, provisioningState Creating until its operation ends
            # (ARM RPC: a PUT's long-running operation drives the resource's provisioningState).
            arm.snapshots[name] = snapshot
            self._start_operation(match["sub"], op, resource_id, "CREATE", created, status=201, body=snapshot)
            return
        of_volume = {key: snapshot for key, snapshot in arm.snapshots.items()
                     if f"/volumes/{volume}/snapshots/" in snapshot["id"]}
        if op == "list_snapshots":
            self._send(200, {"value": list(of_volume.values())})
            return
        if name in of_volume:
            self._send(200, of_volume[name])
        else:
            self._error(404, "ResourceNotFound", f"snapshot {name} not found")

    def _start_operation(self, subscription: str, op: str, resource: str, action: str, effect: Any,
                         status: int, body: Any = None) -> None:
        operation = str(uuid.uuid4())
        url = (f"{self.arm.base}/subscriptions/{subscription}/providers/{PROVIDER}/locations/{self.arm.location}/"
               f"operationResults/{operation}?api-version={API_VERSION}")
        self.arm.operations[operation] = {"op": op, "effect": effect, "polls": 0, "resource": resource,
                                          "action": action, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                          "due": time.monotonic() + self.arm.operation_s,
                                          "due_at": time.time() + self.arm.operation_s}
        self._send(status, body, {"Azure-AsyncOperation": url,
                                  "Location": f"{url}&operationResultResponseType=Location"})

    def _operation(self, operation: str, as_location: bool) -> None:
        record = self.arm.operations.get(operation)
        if record is None:
            self._error(404, "NotFound", f"operation {operation} not found")
            return
        record["polls"] += 1
        status, result = record.get("outcome", ("InProgress", None))
        error = {"code": "PoolChangeFailed" if record["op"] == "pool_change" else "SnapshotFailed",
                 "message": "the destination pool has no room for this volume" if record["op"] == "pool_change"
                 else "the volume is busy"}
        if as_location:
            if status == "InProgress":
                self._send(202, None, {"Location": self.path})
            elif status == "Failed":
                self._send(400, {"error": error})
            else:
                self._send(200, result)
            return
        location = self.path.split("?")[0]
        body = {"id": location, "name": operation, "status": status, "startTime": record["started"],
                "percentComplete": 100.0 if status != "InProgress" else 50.0,
                "properties": {"resourceName": record["resource"], "action": record["action"]}}
        if status != "InProgress":
            body["endTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ")
        if status == "Failed":
            body["error"] = error
        self._send(200, body)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


def _volume_body(arm: Arm, match: re.Match, state: dict) -> dict:
    pool_id = match.string.split("/volumes/")[0].rsplit("/", 1)[0] + f"/{state['pool']}"
    return {"id": f"{pool_id}/volumes/{match['volume']}", "name": f"{match['account']}/{state['pool']}/"
            f"{match['volume']}", "type": "Microsoft.NetApp/netAppAccounts/capacityPools/volumes",
            "location": arm.location,
            "properties": {"serviceLevel": state["level"], "usageThreshold": state["quota"],
                           "creationToken": match["volume"], "subnetId": "/subscriptions/x/subnets/anf",
                           # ARM RPC (resource-provider contract): a resource reports a non-terminal
                           # provisioningState while an operation on it runs. That a volume says "Updating"
                           # during a pool change is our assumption, not read from the NetApp spec.
                           "provisioningState": "Updating" if _moving(arm, match["volume"]) else "Succeeded"}}


def _moving(arm: Arm, volume: str) -> bool:
    return any(r["op"] == "pool_change" and "outcome" not in r and f"/volumes/{volume}" in r["resource"]
               for r in arm.operations.values())


class ArmEmulator:
    """``with ArmEmulator(tmp) as arm: ...``; ``ca_file`` is the CA bundle clients must trust."""

    def __init__(self, folder: Path, host: str = "127.0.0.1") -> None:
        """``host``: the address to listen at (the pod network's node address for clients in pods)."""
        self.ca = trustme.CA()
        cert = self.ca.issue_cert(host, "localhost")
        self.ca_file = folder / "arm-ca.pem"
        folder.mkdir(parents=True, exist_ok=True)
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.arm = Arm()
        handler = type("Handler", (_Handler,), {"arm": self.arm})
        self.server = ThreadingHTTPServer((host, 0), handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.arm.base = f"https://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Arm:
        self.thread.start()
        return self.arm

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
