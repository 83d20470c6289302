"""Start, or reuse, the local Prefect server the embedded platform reports to (SQLite, 127.0.0.1).

Prefect's ephemeral in-process server takes over a minute to start on two busy cores and is gone
when the process ends; one long-lived local server is faster after the first start and keeps the
UI's history. Its state lives in ``<home>/prefect`` and its log in ``<home>/prefect/server.log``.

It accepts only those who know its auth string: whoever reaches the port (another user of a shared machine, a web
page in the developer's browser, by a cross-origin request or DNS rebinding) could otherwise create a deployment
whose pull step the worker runs as the user, or read stored secrets. The string is made once per home
(``<home>/prefect/auth``, mode 0600) and given to every client laneflow starts (``PREFECT_API_AUTH_STRING``); the
UI asks for it once. CORS grants only the server's own origin and CSRF protection is on. A server found on the port
is reused only if it refuses a request without the string and accepts one with it.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flows.team_server import REDIS_LEASE_STORAGE, TeamBackends
from tasks.processes import group_alive, stop_group, stop_process

DEFAULT_PORT = 4200
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now (for throwaway servers: tests, benches)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api"


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


#: Prefect's server keeps concurrency leases in memory by default: a restart (an upgrade) forgets every lease,
#: so slots held by runs in flight are never given back (their release names a lease the server no longer
#: knows) and a deployment-limited run whose lease renewal fails is terminated (prefect.flow_engine keeps the
#: deployment concurrency lease with ``raise_on_lease_renewal_failure=True``). The filesystem storage Prefect
#: ships keeps them under ``$PREFECT_HOME/concurrency_leases``, beside the SQLite database, across restarts.
LEASE_STORAGE = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}


AUTH_FILE = "auth"


class ServerNotOurs(RuntimeError):
    """Something answers on the port as a Prefect server, but not as the one this home started."""


def auth_string(home: Path) -> str:
    """This home's server auth string, made on first use (``<home>/prefect/auth``, readable by its owner only)."""
    folder = home.resolve() / "prefect"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / AUTH_FILE
    if not path.exists():
        fd, staged = tempfile.mkstemp(dir=folder, prefix=".auth-")  # 0600; linked into place whole, or not at all
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(staged, path)
        except FileExistsError:  # another laneflow process made it first: theirs is the one
            pass
        finally:
            os.unlink(staged)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return path.read_text().strip()


def own_origins(port: int) -> str:
    """The origins the UI is served from (CORS grants these only)."""
    return f"http://127.0.0.1:{port},http://localhost:{port}"


def server_env(home: Path, port: int) -> dict[str, str]:
    """Environment for anything that talks to this server: where it is and its auth string (clients on this
    machine reach it at 127.0.0.1 wherever it listens). No setting of the server's own: a Kubernetes worker hands
    every setting it has to the flow pods it creates."""
    return {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": api_url(port),
        "PREFECT_API_AUTH_STRING": auth_string(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api_url(port),
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "INFO"),
    }


def server_process_env(home: Path, port: int, host: str = "127.0.0.1",
                       backends: TeamBackends | None = None) -> dict[str, str]:
    """The server process's own settings on top: where it listens (``host``; 0.0.0.0: every address of this
    machine, for clients elsewhere — pods of a cluster on this machine), who it lets in, where it keeps leases
    and, for a team's server, its database and Redis (``flows.team_server``)."""
    return {
        **server_env(home, port),
        **LEASE_STORAGE,
        **(backends.settings() if backends else {}),
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_API_AUTH_STRING": auth_string(home),
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": own_origins(port),
        "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
    }


def start_server(home: Path, port: int, timeout_s: float = STARTUP_TIMEOUT_S,
                 host: str = "127.0.0.1", backends: TeamBackends | None = None) -> subprocess.Popen:
    """Start ``prefect server start`` in its own session (it outlives this process) and wait until it is
    healthy; it listens at ``host`` (see ``server_env``). With ``backends``, a team's API process: on PostgreSQL and
    Redis, without the background services (``start_services`` runs them once, beside any number of these)."""
    url = api_url(port)
    home = home.resolve()
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    log_path = home / "prefect" / "server.log"
    prefect = str(Path(sys.executable).parent / "prefect")
    with log_path.open("ab") as log:
        process = subprocess.Popen([prefect, "server", "start", "--host", host, "--port", str(port),
                                    *(["--no-services"] if backends else [])],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **server_process_env(home, port, host, backends)},
                                   start_new_session=True)
    (home / "prefect" / "server.pid").write_text(f"{process.pid}\n")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_healthy(url):
            return process
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"the Prefect server exited with code {process.returncode} (port {port} busy?). "
                               "Log tail:\n" + "\n".join(tail))
        time.sleep(1.0)
    stop_process(process, grace_s=30)
    raise RuntimeError(f"the Prefect server did not answer on {url} within {timeout_s:.0f} s; see {log_path}")


#: Where laneflow records the pid of a team server's background-services process.
SERVICES_PID = "background-services.pid"
#: How long a just-started services process is watched for an exit at start (Redis or the database unreachable).
SERVICES_SETTLE_S = 3.0


def start_services(home: Path, port: int, backends: TeamBackends) -> subprocess.Popen:
    """A team's background services (``prefect server services start``: scheduler, late runs, triggers, the
    event persister...) in one process of its own session, on the same backends as its API processes; its log
    ``<home>/prefect/services.log``. Prefect runs them once per server, however many API replicas it has."""
    home = home.resolve()
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    prefect = str(Path(sys.executable).parent / "prefect")
    with (home / "prefect" / "services.log").open("ab") as log:
        process = subprocess.Popen([prefect, "server", "services", "start"], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, **server_process_env(home, port, backends=backends)})
    # Not services.pid: Prefect's own CLI keeps that one in PREFECT_HOME and refuses to start when it names a
    # live process — this one, were it ours.
    (home / "prefect" / SERVICES_PID).write_text(f"{process.pid}\n")
    try:  # one that cannot reach its backends ends at once: said here, not found missing later
        code = process.wait(timeout=SERVICES_SETTLE_S)
    except subprocess.TimeoutExpired:
        return process
    tail = (home / "prefect" / "services.log").read_text(errors="replace").splitlines()[-20:]
    raise RuntimeError(f"the Prefect background services exited with code {code} at start; log tail:\n"
                       + "\n".join(tail))


def services_running(home: Path) -> bool:
    """Whether the background services this home started still run (their pid file names a live one)."""
    try:
        pid = int((home.resolve() / "prefect" / SERVICES_PID).read_text())
    except (OSError, ValueError):
        return False
    return _is_prefect_server(pid) and group_alive(pid)


def ensure_server(home: Path, port: int = DEFAULT_PORT, timeout_s: float = STARTUP_TIMEOUT_S,
                  backends: TeamBackends | None = None) -> str:
    """The API URL of a healthy local server on ``port``: reused if one answers, started (detached) if not — with
    ``backends``, a team's API process and its background services."""
    url = api_url(port)
    if not is_healthy(url):
        start_server(home, port, timeout_s, backends=backends)  # migrates the database first
        if backends and not services_running(home):
            start_services(home, port, backends)
        return url
    check_ours(url, home, port)
    storage = lease_storage_of(url, auth_string(home))
    if backends and storage != REDIS_LEASE_STORAGE:
        raise ServerNotOurs(f"the Prefect server on 127.0.0.1:{port} runs on SQLite, not on the database and Redis "
                            f"asked for: stop it first ('laneflow stop-server --home {home}'), or use another --port")
    if backends and not services_running(home):
        start_services(home, port, backends)
    if storage not in (None, LEASE_STORAGE["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"], REDIS_LEASE_STORAGE):
        print(f"laneflow: the Prefect server on 127.0.0.1:{port} keeps concurrency leases in {storage}: restarting it "
              "would leak the 'gpu' slots of runs in flight and abort a running nightly. Restart it once, while "
              f"nothing runs: 'laneflow stop-server --home {home}', then this command again.", file=sys.stderr,
              flush=True)
    return url


def auth_header(auth: str | None) -> dict[str, str]:
    """The header Prefect's client sends for an auth string (HTTP Basic of the string itself)."""
    return {"Authorization": f"Basic {base64.b64encode(auth.encode()).decode()}"} if auth is not None else {}


def _get_status(url: str, auth: str | None) -> int | None:
    """The HTTP status of a GET (with the auth string, or without any); None when nothing answers."""
    headers = auth_header(auth)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, urllib.error.URLError):
        return None


def check_ours(url: str, home: Path, port: int) -> None:
    """Reuse the server on the port only if it is this home's: it refuses a request without the auth string and
    accepts one with it. Anything else is named, with what to do (ServerNotOurs)."""
    probe = f"{url}/admin/version"
    if _get_status(probe, None) == 200:
        raise ServerNotOurs(
            f"a Prefect server on 127.0.0.1:{port} accepts requests from anyone (it was started without an auth "
            "string: by hand, or by a laneflow before this one): laneflow does not use it, since whoever reaches the "
            f"port could run code as you through it. Stop it ('laneflow stop-server --home {home}' if it is this "
            "home's, else the process on the port), then run this command again; or use another --port")
    if _get_status(probe, auth_string(home)) != 200:
        raise ServerNotOurs(
            f"a Prefect server on 127.0.0.1:{port} does not know this home's auth string ({home}/prefect/auth): it "
            "belongs to another home or user. Use another --port, or the --home that started it")


def lease_storage_of(url: str, auth: str | None = None) -> str | None:
    """The concurrency lease storage module a running server uses (``GET /admin/settings``), None if unknown."""
    headers = auth_header(auth)
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/admin/settings", headers=headers),
                                    timeout=5) as response:
            settings = json.load(response)
    except (OSError, ValueError, urllib.error.URLError):
        return None
    storage = ((settings.get("server") or {}).get("concurrency") or {}).get("lease_storage")
    return str(storage) if storage else None


def stop_server(home: Path, grace_s: float = 30.0) -> bool:
    """Stop the server started from ``home`` (its pid files: the server, and a team's services) and wait until
    their process groups are gone (SIGKILL after ``grace_s``); False when none was running."""
    stopped = False
    for name in (SERVICES_PID, "server.pid"):  # a team's services first: they act on what the API holds
        pid = take_pid_file(home.resolve() / "prefect" / name)
        if pid is None or not _is_prefect_server(pid) or not group_alive(pid):
            continue
        stop_group(pid, (signal.SIGTERM,), grace_s)
        stopped = True
    return stopped


def take_pid_file(pid_file: Path) -> int | None:
    """The pid a file records, the file removed (whatever it held: a stop is asked once); None without one."""
    try:
        return int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    finally:
        pid_file.unlink(missing_ok=True)


def _is_prefect_server(pid: int) -> bool:
    """The recorded pid still is a ``prefect server start`` (pids get reused after a reboot)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"server" in cmdline and any(part.endswith(b"prefect") for part in cmdline)


def ui_url(api: str, flow_run_id: str) -> str:
    """The UI page of a flow run, from the API URL."""
    return f"{api.removesuffix('/api')}/runs/flow-run/{flow_run_id}"


@contextmanager
def throwaway_server(prefix: str) -> Iterator[Path]:
    """A Prefect server of its own in a temporary folder, this process's environment pointed at it (and
    ``LANEFLOW_HOME`` inside it), stopped with everything in it afterwards: for benches and scripts that
    must not touch the user's server. Yields the folder."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        home, port = Path(tmp), free_port()
        server = start_server(home, port)
        try:
            os.environ.update(server_env(home, port))
            os.environ["LANEFLOW_HOME"] = str(home / "laneflow")
            yield home
        finally:
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=30)  # what the client still holds goes out before the server stops
            EventsWorker.drain_all(timeout=30)
            stop_process(server, grace_s=30)
