"""A real MLflow tracking server for the tests: ``mlflow server`` (SQLite backend, proxied artifacts) on a free
port (of loopback, or of the pod network for pods to reach), run from its own virtualenv.

Why its own: the server is the full ``mlflow`` package, whose pins (SQLAlchemy, Flask, alembic) disagree
with Prefect's server, so laneflow's environment holds only the client (``mlflow-skinny``) and
scripts/bootstrap.sh puts the server in ``$VENV/mlflow-server``. Tests skip, naming it, when it is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from flows.local_server import free_port, is_healthy
from tasks.processes import running

#: Where scripts/bootstrap.sh creates the server's virtualenv: inside the project's ($VENV/mlflow-server).
SERVER_VENV = Path(sys.prefix) / "mlflow-server"
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MlflowServer:
    uri: str
    root: Path
    log: Path
    process: subprocess.Popen
    timeout_s: float = STARTUP_TIMEOUT_S

    def wait_until_healthy(self) -> MlflowServer:
        """Return once ``/health`` answers; raise with the log's tail if the server exits or never answers."""
        deadline = time.monotonic() + self.timeout_s
        while not is_healthy(self.uri):
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with code {self.process.returncode}; log tail:\n"
                                   f"{_log_tail(self.log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer on {self.uri} within {self.timeout_s:.0f} s; "
                                   f"log tail:\n{_log_tail(self.log)}")
            time.sleep(0.5)
        return self


def server_missing(venv: Path = SERVER_VENV) -> str | None:
    """Why no MLflow server can be started here (a skip reason), or None."""
    if not (venv / "bin" / "mlflow").is_file():
        return (f"no MLflow server virtualenv at {venv} (scripts/bootstrap.sh creates it with the full mlflow "
                "package; see its warning if it could not)")
    return None


def _log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


@contextmanager
def mlflow_server(root: Path, venv: Path = SERVER_VENV, timeout_s: float = STARTUP_TIMEOUT_S,
                  wait: bool = True, host: str = "127.0.0.1") -> Iterator[MlflowServer]:
    """``mlflow server`` with its store and artifacts under ``root``, listening on ``host`` (the pod network's
    node address for a server that emulated pods reach), healthy on entry (with ``wait=False``, still
    starting: call ``wait_until_healthy`` before use, so its start-up overlaps other work); on the way out its
    whole process group is stopped (SIGTERM, then SIGKILL after a grace period) and reaped."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(venv / "bin" / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"), "--host", host, "--port", str(port),
            "--workers", "1"]
    if host != "127.0.0.1":  # MLflow refuses Host headers outside loopback and RFC 1918 ranges (DNS rebinding
        argv += ["--allowed-hosts", f"{host},{host}:{port}"]  # guard); the pod network is in 198.18.0.0/15
    # Job execution (GenAI evaluation jobs) starts a job runner and eight huey consumers: seconds of CPU at
    # start-up on two cores, and children that outlive a SIGTERM. Nothing here uses it.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("VIRTUAL_ENV", None)  # the server's interpreter is its own venv's, whatever activated this one
    log = root / "server.log"
    with log.open("ab") as sink, running(argv, (signal.SIGTERM,), grace_s=10.0, stdout=sink,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env) as process:
        server = MlflowServer(uri=f"http://{host}:{port}", root=root, log=log, process=process,
                              timeout_s=timeout_s)
        yield server.wait_until_healthy() if wait else server
