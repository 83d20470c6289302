"""A real PostgreSQL and a real Redis for the tests of a team's Prefect server (Debian's ``postgresql`` and
``redis-server`` packages, which scripts/bootstrap.sh installs where it may): each started on a free port of
loopback in a folder of its own, its data thrown away, and stopped — its whole process group, escalating to
SIGKILL — when the test's ``with`` ends. Tests skip, naming the package, when one is missing.

PostgreSQL refuses to run as root, so it runs as the ``postgres`` account the package creates; its folder is
that account's. Durability is off (``fsync=off``): these databases live for one test session.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flows.local_server import free_port
from tasks.processes import running

STARTUP_TIMEOUT_S = 60.0


def _postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name))
    return found[-1].parent if found else None


def servers_missing() -> str | None:
    """Why a PostgreSQL or a Redis cannot be started here (a skip reason), or None."""
    if _postgres_bin() is None:
        return "no PostgreSQL server (Debian: apt-get install postgresql; scripts/bootstrap.sh does, as root)"
    if shutil.which("redis-server") is None:
        return "no Redis server (Debian: apt-get install redis-server; scripts/bootstrap.sh does, as root)"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no 'postgres' account to run PostgreSQL as (the Debian package makes it)"
    return None


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _wait_for(port: int, process: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _accepts(port):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
            raise RuntimeError(f"{what} did not start on 127.0.0.1:{port} (exit {process.poll()}):\n{tail}")
        time.sleep(0.2)


@dataclass(frozen=True)
class Postgres:
    port: int
    database: str = "prefect"
    user: str = "laneflow"

    @property
    def url(self) -> str:
        """The asyncpg URL Prefect's ``PREFECT_API_DATABASE_CONNECTION_URL`` takes."""
        return f"postgresql+asyncpg://{self.user}@127.0.0.1:{self.port}/{self.database}"


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """A fresh PostgreSQL cluster with database ``prefect`` owned by ``laneflow`` (trust authentication on
    loopback only), stopped and deleted afterwards."""
    binaries = _postgres_bin()
    assert binaries is not None, servers_missing()
    account = pwd.getpwnam("postgres")
    folder = Path(tempfile.mkdtemp(prefix="laneflow-postgres-"))
    os.chown(folder, account.pw_uid, account.pw_gid)
    data, log, port = folder / "data", folder / "postgres.log", free_port()
    as_postgres = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups", "--"]
    try:
        subprocess.run([*as_postgres, str(binaries / "initdb"), "-D", str(data), "-U", "laneflow", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, text=True,
                       env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"})
        with log.open("wb") as sink, running(
                [*as_postgres, str(binaries / "postgres"), "-D", str(data), "-p", str(port), "-k", str(folder),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stop_signals=(signal.SIGINT,), grace_s=20, stdout=sink, stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}) as process:
            _wait_for(port, process, "PostgreSQL", log)
            subprocess.run([*as_postgres, str(binaries / "createdb"), "-h", "127.0.0.1", "-p", str(port),
                            "-U", "laneflow", "prefect"], check=True, capture_output=True, text=True)
            yield Postgres(port)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A Redis without persistence on a free port of loopback: its URL (``redis://127.0.0.1:<port>/0``)."""
    folder = Path(tempfile.mkdtemp(prefix="laneflow-redis-"))
    log, port = folder / "redis.log", free_port()
    try:
        with log.open("wb") as sink, running(
                [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", str(folder), "--protected-mode", "yes"],
                stop_signals=(signal.SIGTERM,), grace_s=10, stdout=sink, stderr=subprocess.STDOUT) as process:
            _wait_for(port, process, "Redis", log)
            yield f"redis://127.0.0.1:{port}/0"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
