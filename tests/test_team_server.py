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
from pathlib import Path

import pytest
from prefect import get_client
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from flows.local_server import free_port, server_env, start_server, start_services
from flows.serving import deployment_environment
from flows.team_server import BackendsInvalid, TeamBackends, team_backends
from tasks.processes import running, stop_process
from tests.conftest import PROJECT_ROOT
from tests.tcp_forward import Forwarder
from tests.team_servers import postgres_server, redis_server, servers_missing
from tests.test_deployments import running_worker
from tests.test_pipeline import params_for
from tests.waiting import wait_until

#: What a database or lease problem looks like in a Prefect server's log.
DATABASE_ERRORS = re.compile(r"sqlalchemy\.exc|asyncpg\.exceptions|IntegrityError|DeadlockDetected|"
                             r"lease .*not found|LeaseNotFound", re.IGNORECASE)
SWEEP = """
import json, sys
from flows.sweep import sweep
print(json.dumps([row["state"] for row in sweep(**json.loads(sys.argv[1]))]))
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


def _deployed(home: Path, env: dict[str, str], artifacts: list[dict[str, str]]) -> dict[str, str]:
    """prefect.yaml's deployments, the work pool and a 'gpu' limit of 3 applied to the team's server, as
    `laneflow deploy` applies them; the environment its worker and runs get."""
    for prefix, artifact in zip(("LANEFLOW_TRAIN", "LANEFLOW_TEST", "LANEFLOW_TEST_LABEL"), artifacts, strict=True):
        env[f"{prefix}_URL"], env[f"{prefix}_SHA256"] = artifact["url"], artifact["sha256"]
    env = deployment_environment(home / "deploy", env)
    setup = ("import json, sys\nfrom flows.serving import apply_deployments, ensure_local_setup\n"
             "ensure_local_setup(gpu_slots=3)\napply_deployments(json.loads(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", setup, json.dumps(env)], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return env


@pytest.mark.slow
def test_a_sweep_a_nightly_and_a_ui_run_side_by_side_on_two_api_replicas_outlive_a_replica_restart(
        tmp_path: Path, synthetic_archive: tuple[Path, str], synthetic_artifacts: list[dict[str, str]]) -> None:
    """PostgreSQL, Redis, two API replicas behind a round-robin balancer and one services process; the
    deployments applied through the balancer, a real process worker. A sweep of three trials (two at a time),
    a nightly retrain and a run started as from the UI go side by side under a 'gpu' limit of 3, and one
    replica is restarted while they train."""
    if missing := servers_missing():
        pytest.skip(missing)
    home, ports, balancer = tmp_path / "server", (free_port(), free_port()), free_port()
    archive, sha256 = synthetic_archive
    source = {"artifacts": [{"url": archive.as_uri(), "sha256": sha256, "kind": "archive"}]}
    small = {"source": source, "epochs": 1, "batch_size": 2, "loader_workers": 0, "workers": 1, "snapshot": False}
    with postgres_server() as database, redis_server() as redis:
        backends = TeamBackends(database.url, redis)
        replicas = [start_server(home, ports[0], backends=backends)]  # the first migrates the database
        try:
            replicas.append(start_server(home, ports[1], backends=backends))
            replicas.append(start_services(home, ports[0], backends))
            targets = [("127.0.0.1", port) for port in ports]
            with Forwarder("127.0.0.1", balancer, targets=targets):
                env = _deployed(home, {**os.environ, **server_env(home, balancer),
                                       "LANEFLOW_HOME": str(tmp_path / "laneflow")}, synthetic_artifacts)
                base = params_for(synthetic_archive, volume="team", workers=1, snapshot=False, epochs=1)
                arguments = {**json.loads(json.dumps(base, default=lambda v: v.model_dump(mode="json"))),
                             "grid": {"lr": [0.05, 0.02, 0.1]}, "max_concurrent": 2}
                output, worker_log = tmp_path / "sweep.log", tmp_path / "worker.log"
                with output.open("wb") as sink, worker_log.open("wb") as worker_sink, \
                        running_worker(env, worker_sink), \
                        running([sys.executable, "-c", SWEEP, json.dumps(arguments)], env=env, cwd=PROJECT_ROOT,
                                stdout=sink, stderr=subprocess.STDOUT) as swept, \
                        temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"],
                                            PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}), \
                        get_client(sync_client=True) as client:
                    started = [client.create_flow_run_from_deployment(
                        client.read_deployment_by_name(name).id, parameters={**small, "volume": volume})
                        for name, volume in (("nightly_retrain/nightly", "team-nightly"),
                                             ("train_pipeline/train", "team-ui"))]
                    runs = tmp_path / "laneflow" / "volumes" / "team" / "runs"

                    def a_trial_trains() -> bool:
                        assert swept.poll() is None, output.read_text()[-3000:]
                        return any('"event": "step"' in metrics.read_text() for metrics in runs.glob("*/metrics.jsonl"))

                    wait_until("a trial training", a_trial_trains, timeout_s=420)
                    # A replica restarted while trials train (an upgrade, a rescheduled pod): the other serves.
                    stop_process(replicas[0], grace_s=30)
                    replicas[0] = start_server(home, ports[0], backends=backends)
                    assert swept.wait(timeout=600) == 0, output.read_text()[-3000:]

                    def both_ended() -> list | None:
                        states = [client.read_flow_run(run.id).state for run in started]
                        return states if all(state.is_final() for state in states) else None

                    ended = wait_until("the nightly and the UI run ended", both_ended, timeout_s=600)
                    limit = client.read_global_concurrency_limit_by_name("gpu")
                    # The services ran all along: their task-run recorder put the runs' task runs in the database
                    # (from the events in Redis), as the UI shows them.
                    assert replicas[2].poll() is None, (home / "prefect" / "services.log").read_text()[-2000:]
                    wait_until("the task runs recorded", lambda: (
                        count if (count := client.request("POST", "/task_runs/count", json={}).json()) >= 50
                        else None), timeout_s=120)
            result = json.loads(output.read_text().strip().splitlines()[-1])
        finally:
            for process in reversed(replicas):
                stop_process(process, grace_s=30)
    assert result == ["Completed"] * 3, output.read_text()[-3000:]
    assert (limit.limit, limit.active_slots) == (3, 0)  # every slot handed back, across the restart
    assert [state.type.value for state in ended] == ["COMPLETED", "COMPLETED"], (
        [(state.name, state.message) for state in ended], worker_log.read_text()[-3000:])
    logs = "\n".join((home / "prefect" / name).read_text(errors="replace") for name in ("server.log", "services.log"))
    assert not DATABASE_ERRORS.findall(logs), [line for line in logs.splitlines() if DATABASE_ERRORS.search(line)][:10]


def test_the_helm_values_give_the_clusters_server_every_setting_laneflow_serve_gives_its_processes() -> None:
    """deployments/prefect-server-values.yaml (Prefect's chart) and `laneflow serve --database --redis` must run
    the same server: each setting the latter sets is in the values' environment or in a Secret they name."""
    import yaml

    path = PROJECT_ROOT / "deployments" / "prefect-server-values.yaml"
    values = yaml.safe_load(path.read_text())
    from_values = {entry["name"] for entry in values["global"]["prefect"]["env"]}
    from_secrets = set(re.findall(r"--from-literal=(PREFECT_[A-Z_]+)=", path.read_text()))
    database_secret = values["secret"]["name"] if not values["secret"]["create"] else None
    assert database_secret and "connection-string" in path.read_text()  # the chart's database URL, from a Secret
    settings = set(TeamBackends("postgresql+asyncpg://db/prefect", "redis://cache:6379/0").settings())
    assert settings - {"PREFECT_API_DATABASE_CONNECTION_URL"} <= from_values | from_secrets
    assert values["backgroundServices"]["runAsSeparateDeployment"] is True and values["server"]["replicaCount"] >= 2
