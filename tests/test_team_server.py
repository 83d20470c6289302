"""A team's Prefect server for real (flows/team_server.py): a real PostgreSQL and a real Redis (tests/team_servers.py),
two API replicas (``prefect server start --no-services``) behind a round-robin balancer and one process of background
services. A sweep trains its trials side by side through the balancer while one replica is restarted: every trial
and the sweep complete, the ``gpu`` slots are all handed back, and neither server log holds a database error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.local_server import free_port, server_env, start_server, start_services
from flows.team_server import BackendsInvalid, TeamBackends, team_backends
from tasks.processes import running, stop_process
from tests.conftest import PROJECT_ROOT
from tests.tcp_forward import Forwarder
from tests.team_servers import postgres_server, redis_server, servers_missing
from tests.test_pipeline import params_for

#: What a database or lease problem looks like in a Prefect server's log.
DATABASE_ERRORS = re.compile(r"sqlalchemy\.exc|asyncpg\.exceptions|IntegrityError|DeadlockDetected|"
                             r"lease .*not found|LeaseNotFound", re.IGNORECASE)
SWEEP = """
import json, sys
from prefect import get_client
from flows.serving import ensure_local_setup
from flows.sweep import sweep
ensure_local_setup(gpu_slots=2)
table = sweep(**json.loads(sys.argv[1]))
with get_client(sync_client=True) as client:
    limit = client.read_global_concurrency_limit_by_name("gpu")
print(json.dumps({"states": [row["state"] for row in table], "limit": limit.limit, "active": limit.active_slots}))
"""


def test_the_backends_come_from_flags_or_the_environment_both_or_neither_and_a_password_never_from_argv() -> None:
    assert team_backends(None, None, {}) is None
    backends = team_backends("postgresql://prefect@db:5432/prefect", "redis://cache:6379/0", {})
    assert backends.database_url == "postgresql+asyncpg://prefect@db:5432/prefect"
    assert backends.settings()["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] == "prefect_redis.lease_storage"
    from_env = team_backends(None, None, {"LANEFLOW_SERVER_DATABASE": "postgresql://u:pw@db/prefect",
                                          "LANEFLOW_SERVER_REDIS": "redis://cache:6379/1"})
    assert from_env.database_url == "postgresql+asyncpg://u:pw@db/prefect"
    with pytest.raises(BackendsInvalid, match=r"--database carries a password.*\$LANEFLOW_SERVER_DATABASE"):
        team_backends("postgresql://u:pw@db/prefect", "redis://cache:6379/0", {})
    with pytest.raises(BackendsInvalid, match=r"give --redis \(or \$LANEFLOW_SERVER_REDIS\) too"):
        team_backends("postgresql://prefect@db/prefect", None, {})
    with pytest.raises(BackendsInvalid, match="must be PostgreSQL's"):
        team_backends("mysql://db/prefect", "redis://cache:6379/0", {})
    with pytest.raises(BackendsInvalid, match="names no database"):
        team_backends("postgresql://prefect@db:5432", "redis://cache:6379/0", {})


@pytest.mark.slow
def test_a_sweep_side_by_side_on_two_api_replicas_over_postgresql_and_redis_outlives_a_replica_restart(
        tmp_path: Path, synthetic_archive: tuple[Path, str]) -> None:
    if missing := servers_missing():
        pytest.skip(missing)
    home, ports, balancer = tmp_path / "server", (free_port(), free_port()), free_port()
    with postgres_server() as database, redis_server() as redis:
        backends = TeamBackends(database.url, redis)
        replicas = [start_server(home, ports[0], backends=backends)]  # the first migrates the database
        try:
            replicas.append(start_server(home, ports[1], backends=backends))
            replicas.append(start_services(home, ports[0], backends))
            targets = [("127.0.0.1", port) for port in ports]
            with Forwarder("127.0.0.1", balancer, targets=targets):
                env = {**os.environ, **server_env(home, balancer), "LANEFLOW_HOME": str(tmp_path / "laneflow")}
                base = params_for(synthetic_archive, volume="team", workers=1, snapshot=False, epochs=2)
                arguments = {**json.loads(json.dumps(base, default=lambda v: v.model_dump(mode="json"))),
                             "grid": {"lr": [0.05, 0.02, 0.1, 0.03]}, "max_concurrent": 2}
                output = tmp_path / "sweep.log"
                with output.open("wb") as sink, running([sys.executable, "-c", SWEEP, json.dumps(arguments)],
                                                        env=env, cwd=PROJECT_ROOT, stdout=sink,
                                                        stderr=subprocess.STDOUT) as swept:
                    runs = tmp_path / "laneflow" / "volumes" / "team" / "runs"
                    deadline = time.monotonic() + 420
                    while not any('"event": "step"' in metrics.read_text() for metrics in runs.glob("*/metrics.jsonl")):
                        assert swept.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
                        time.sleep(0.5)
                    # A replica restarted while trials train (an upgrade, a rescheduled pod): the other serves.
                    stop_process(replicas[0], grace_s=30)
                    replicas[0] = start_server(home, ports[0], backends=backends)
                    assert swept.wait(timeout=480) == 0, output.read_text()[-3000:]
            result = json.loads(output.read_text().strip().splitlines()[-1])
        finally:
            for process in reversed(replicas):
                stop_process(process, grace_s=30)
    assert result == {"states": ["Completed"] * 4, "limit": 2, "active": 0}, output.read_text()[-3000:]
    logs = "\n".join((home / "prefect" / name).read_text(errors="replace") for name in ("server.log", "services.log"))
    assert not DATABASE_ERRORS.findall(logs), [line for line in logs.splitlines() if DATABASE_ERRORS.search(line)][:10]
