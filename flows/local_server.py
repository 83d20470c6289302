"""Start, or reuse, the local Prefect server the embedded platform reports to (SQLite, 127.0.0.1).

Prefect's ephemeral in-process server takes over a minute to start on two busy cores and is gone
when the process ends; one long-lived local server is faster after the first start and keeps the
UI's history. Its state lives in ``<home>/prefect`` and its log in ``<home>/prefect/server.log``.
"""

from __future__ import annotations

import json
import os
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


def server_env(home: Path, port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """Environment for anything that talks to (or is) this server; ``host`` is the address it listens at
    (0.0.0.0: every address of this machine, for clients elsewhere — pods of a cluster on this machine)."""
    return {
        **LEASE_STORAGE,
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": api_url(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": api_url(port),
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "INFO"),
    }


def start_server(home: Path, port: int, timeout_s: float = STARTUP_TIMEOUT_S,
                 host: str = "127.0.0.1") -> subprocess.Popen:
    """Start ``prefect server start`` in its own session (it outlives this process) and wait until it is
    healthy; it listens at ``host`` (see ``server_env``)."""
    url = api_url(port)
    home = home.resolve()
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    log_path = home / "prefect" / "server.log"
    prefect = str(Path(sys.executable).parent / "prefect")
    with log_path.open("ab") as log:
        process = subprocess.Popen([prefect, "server", "start", "--host", host, "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **server_env(home, port, host)}, start_new_session=True)
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


def ensure_server(home: Path, port: int = DEFAULT_PORT, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """The API URL of a healthy local server on ``port``: reused if one answers, started (detached) if not."""
    url = api_url(port)
    if not is_healthy(url):
        start_server(home, port, timeout_s)
    elif (storage := lease_storage_of(url)) not in (None, LEASE_STORAGE["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"]):
        print(f"laneflow: the Prefect server on 127.0.0.1:{port} keeps concurrency leases in {storage}: restarting it "
              "would leak the 'gpu' slots of runs in flight and abort a running nightly. Restart it once, while "
              f"nothing runs: 'laneflow stop-server --home {home}', then this command again.", file=sys.stderr,
              flush=True)
    return url


def lease_storage_of(url: str) -> str | None:
    """The concurrency lease storage module a running server uses (``GET /admin/settings``), None if unknown."""
    try:
        with urllib.request.urlopen(f"{url}/admin/settings", timeout=5) as response:
            settings = json.load(response)
    except (OSError, ValueError, urllib.error.URLError):
        return None
    storage = ((settings.get("server") or {}).get("concurrency") or {}).get("lease_storage")
    return str(storage) if storage else None


def stop_server(home: Path, grace_s: float = 30.0) -> bool:
    """Stop the server started from ``home`` (its pid file) and wait until its process group is gone
    (SIGKILL after ``grace_s``); False when none was running."""
    pid_file = home.resolve() / "prefect" / "server.pid"
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return False
    finally:
        pid_file.unlink(missing_ok=True)
    if not _is_prefect_server(pid) or not group_alive(pid):
        return False
    stop_group(pid, (signal.SIGTERM,), grace_s)
    return True


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
