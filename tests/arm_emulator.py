"""An Azure Resource Manager + Entra ID token endpoint emulator over TLS on 127.0.0.1 (a throwaway CA from
``trustme``), for contract tests of laneflow's ANF access with the real azure-mgmt-netapp client.

It plays: OIDC discovery and the client-credentials token endpoint; ANF volumes (GET), pool changes
(POST .../poolChange answered 202 + Azure-AsyncOperation, polled to Succeeded or Failed, after which the
volume lives in the new pool) and snapshots (PUT, long-running). Faults are queued per operation name.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import urllib.parse
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme

TOKEN = "emulated-bearer-token-5f1c2d"
VOLUME = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft.NetApp/"
                    r"netAppAccounts/(?P<account>[^/]+)/capacityPools/(?P<pool>[^/]+)/volumes/(?P<volume>[^/]+)"
                    r"(?P<rest>/.*)?$")


@dataclass
class Arm:
    base: str = ""
    location: str = "westeurope"
    #: volume name -> (pool name, service level, quota bytes)
    volumes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pools: dict[str, str] = field(default_factory=dict)  # pool name -> service level
    snapshots: dict[str, dict] = field(default_factory=dict)
    operations: dict[str, dict] = field(default_factory=dict)
    faults: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # op -> statuses
    fail_operations: set[str] = field(default_factory=set)  # ops whose LRO ends Failed
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (method, path, headers)
    secrets_seen: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

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
        path = urllib.parse.urlsplit(self.path).path
        arm = self.arm
        arm.requests.append((method, path, dict(self.headers)))
        if path.endswith("/.well-known/openid-configuration"):
            tenant = path.split("/")[1]
            base = f"{arm.base}/{tenant}"
            self._send(200, {"token_endpoint": f"{base}/oauth2/v2.0/token",
                             "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
                             "issuer": f"{base}/v2.0", "device_authorization_endpoint": f"{base}/oauth2/v2.0/device",
                             "token_endpoint_auth_methods_supported": ["client_secret_post"]})
            return
        if path.endswith("/oauth2/v2.0/token"):
            form = urllib.parse.parse_qs(raw.decode())
            arm.secrets_seen.append(form.get("client_secret", [""])[0])
            self._send(200, {"token_type": "Bearer", "expires_in": 3600, "ext_expires_in": 3600,
                             "access_token": TOKEN})
            return
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(401, "AuthenticationFailed", "missing or wrong bearer token")
            return
        if path.startswith("/operations/"):
            self._operation(path.rsplit("/", 1)[-1])
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
        queued = arm.faults.get(op or "")
        if queued:
            status = queued.pop(0)
            self._error(status, "Throttled" if status == 429 else "InternalServerError", f"injected {status}",
                        {"Retry-After": "1"} if status == 429 else None)
            return
        with arm.lock:
            self._resource(method, match, rest, op, json.loads(raw) if raw else None)

    def _resource(self, method: str, match: re.Match, rest: str, op: str | None, body: Any) -> None:
        arm = self.arm
        volume = match["volume"]
        state = arm.volumes.get(volume)
        if state is None or state["pool"] != match["pool"]:
            self._error(404, "ResourceNotFound", f"volume {match['pool']}/{volume} not found")
            return
        if op == "get_volume":
            self._send(200, _volume_body(arm, match, state))
            return
        if op == "pool_change":
            target = body["newPoolResourceId"].rsplit("/", 1)[-1]
            if target not in arm.pools:
                self._error(400, "InvalidPool", f"capacity pool {target} does not exist")
                return
            self._start_operation(op, lambda: state.update(pool=target, level=arm.pools[target]))
            return
        if op == "create_snapshot":
            name = rest.rsplit("/", 1)[-1]
            snapshot = {"id": f"{match.string.split('/snapshots/')[0]}/snapshots/{name}",
                        "name": f"{match['account']}/{match['pool']}/{volume}/{name}", "location": arm.location,
                        "type": "Microsoft.NetApp/netAppAccounts/capacityPools/volumes/snapshots",
                        "properties": {"snapshotId": str(uuid.uuid4()), "provisioningState": "Succeeded"}}
            self._start_operation(op, lambda: arm.snapshots.__setitem__(name, snapshot), status=201,
                                  body=snapshot)
            return
        if op == "list_snapshots":
            self._send(200, {"value": list(arm.snapshots.values())})
            return
        if op == "get_snapshot":
            name = rest.rsplit("/", 1)[-1]
            if name in arm.snapshots:
                self._send(200, arm.snapshots[name])
            else:
                self._error(404, "ResourceNotFound", f"snapshot {name} not found")
            return
        self._error(405, "MethodNotAllowed", f"{method} {rest}")

    def _start_operation(self, op: str, effect: Any, status: int = 202, body: Any = None) -> None:
        operation = uuid.uuid4().hex
        self.arm.operations[operation] = {"op": op, "effect": effect, "polls": 0}
        self._send(status, body, {"Azure-AsyncOperation": f"{self.arm.base}/operations/{operation}",
                                  "Retry-After": "0"})

    def _operation(self, operation: str) -> None:
        record = self.arm.operations.get(operation)
        if record is None:
            self._error(404, "NotFound", "no such operation")
            return
        record["polls"] += 1
        if record["polls"] < 2:
            self._send(200, {"id": operation, "status": "InProgress"}, {"Retry-After": "0"})
            return
        if record["op"] in self.arm.fail_operations:
            self._send(200, {"id": operation, "status": "Failed", "error": {
                "code": "PoolChangeFailed", "message": "the destination pool has no room for this volume"}})
            return
        if not record.get("done"):
            record["effect"]()
            record["done"] = True
        self._send(200, {"id": operation, "status": "Succeeded"})

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
                           "provisioningState": "Succeeded"}}


class ArmEmulator:
    """``with ArmEmulator(tmp) as arm: ...``; ``ca_file`` is the CA bundle clients must trust."""

    def __init__(self, folder: Path) -> None:
        self.ca = trustme.CA()
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = folder / "arm-ca.pem"
        folder.mkdir(parents=True, exist_ok=True)
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.arm = Arm()
        handler = type("Handler", (_Handler,), {"arm": self.arm})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.arm.base = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Arm:
        self.thread.start()
        return self.arm

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
