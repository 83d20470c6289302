"""The local Prefect server laneflow starts lets in only those who know its home's auth string: the real server
(the session's, started by ``flows.local_server.start_server``), asked over HTTP as a browser or another user would."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flows.local_server import AUTH_FILE, ServerNotOurs, auth_header, auth_string, ensure_server
from tests.conftest import PROJECT_ROOT
from tests.http_server import RunningServer


def _request(url: str, method: str = "GET", headers: dict[str, str] | None = None,
             body: bytes | None = None) -> tuple[int, dict[str, str]]:
    """(status, response headers) of one request."""
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_the_server_refuses_a_request_without_its_auth_string_and_grants_no_other_origin(
        prefect_server: dict, session_server) -> None:
    api, auth = prefect_server["PREFECT_API_URL"], prefect_server["PREFECT_API_AUTH_STRING"]
    port = api.rsplit(":", 1)[1].split("/")[0]
    # The string is this home's, in a file only its owner reads.
    path = session_server.home / "prefect" / AUTH_FILE
    assert path.read_text().strip() == auth and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _request(f"{api}/admin/version")[0] == 401
    assert _request(f"{api}/admin/version", headers=auth_header("a guess"))[0] == 401
    assert _request(f"{api}/admin/version", headers=auth_header(auth))[0] == 200
    assert _request(f"{api}/health")[0] == 200  # probes need nothing (Kubernetes' liveness, laneflow's own wait)
    # A web page elsewhere (a cross-origin request from the developer's browser) gets no CORS grant; the UI's own
    # origin does.
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    _, foreign = _request(f"{api}/flows/filter", "OPTIONS", {"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in {key.lower() for key in foreign}, foreign
    _, own = _request(f"{api}/flows/filter", "OPTIONS", {"Origin": f"http://127.0.0.1:{port}", **preflight})
    assert own.get("access-control-allow-origin") == f"http://127.0.0.1:{port}", own
    # A state-changing request needs the server's CSRF token too, even with the auth string.
    status, _ = _request(f"{api}/flows/filter", "POST", {**auth_header(auth), "Content-Type": "application/json"},
                         json.dumps({}).encode())
    assert status == 403


def test_a_server_on_the_port_is_reused_only_when_it_proves_it_is_this_homes(
        prefect_server: dict, session_server, tmp_path: Path) -> None:
    port = int(prefect_server["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    assert ensure_server(session_server.home, port) == f"http://127.0.0.1:{port}/api"  # ours: reused
    with pytest.raises(ServerNotOurs, match=rf"on 127.0.0.1:{port} does not know this home's auth string"):
        ensure_server(tmp_path / "another-home", port)
    assert auth_string(tmp_path / "another-home") != prefect_server["PREFECT_API_AUTH_STRING"]
    # A server that answers anyone (started by hand, or by an older laneflow without an auth string).
    with RunningServer() as open_server:
        open_server.files.update({"api/health": b"true", "api/admin/version": b'"3.9.1"'})
        with pytest.raises(ServerNotOurs, match="accepts requests from anyone") as refused:
            ensure_server(tmp_path / "home", open_server.port)
        assert f"laneflow stop-server --home {tmp_path / 'home'}" in str(refused.value)
        assert [request["path"] for request in open_server.requests] == ["api/health", "api/admin/version"]
        # What `make serve` says then: the reason, once, and nothing started.
        laneflow = str(Path(sys.executable).parent / "laneflow")
        said = subprocess.run([laneflow, "serve", "--home", str(tmp_path / "home"), "--port", str(open_server.port)],
                              capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT,
                              env={key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")})
    assert said.returncode == 2, said.stdout + said.stderr
    assert "laneflow serve: a Prefect server on 127.0.0.1" in said.stderr
    assert "accepts requests from anyone" in said.stderr
    assert "Traceback" not in said.stderr


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 and IPv6 addresses a socket listens at on ``port`` (what ``ss -ltn`` shows), from /proc/net."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, local_port = local.split(":")
            if state == "0A" and int(local_port, 16) == port:  # TCP_LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[index:index + 4][::-1] for index in range(0, len(raw), 4))  # host byte order
                found.add(".".join(str(byte) for byte in words) if width == 8 else words.hex())
    return found


def test_the_test_sessions_server_listens_on_loopback_only(prefect_server: dict) -> None:
    """Nobody on this machine's networks reaches the suite's server; pods reach it through a forwarder on the
    emulated bridge, only while a test's Kubernetes worker runs (tests.tcp_forward)."""
    port = int(prefect_server["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    assert _listening_addresses(port) == {"127.0.0.1"}
