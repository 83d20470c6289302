"""Prefect server load under a sweep: the embedded SQLite server against a team's server on PostgreSQL and Redis
(flows/team_server.py: one API process beside its background services), side by side in one run.

Each backend gets a fresh server, then one real ``sweep`` flow on the local platform: ``--trials`` trials (a grid
over lr), ``--concurrent`` at once, each a ``train_pipeline`` child with its tasks, its ``gpu`` slot (a limit of
``--concurrent``), its progress artifact and logs, training a few steps on a small synthetic dataset. Figures:
the sweep's wall time, flow runs and task runs per second (counted by the server), API requests the flows made,
API errors (5xx answers and connections that failed, as the sweep's own clients saw them; Prefect's client
retries them, so they cost time, not runs) and request latency (median, p95), and the server's own errors
(tracebacks in its logs, "database is locked" among them). Baseline: SQLite; the ratio is PostgreSQL+Redis's
over it.

    .venv/bin/python bench/server_load.py [--trials 16] [--concurrent 8] [--steps 2]

Needs PostgreSQL and Redis (scripts/bootstrap.sh installs them as root); server start-up is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: A server log line that is an error of its own (not a client's 4xx).
SERVER_ERROR = re.compile(r"Traceback|database is locked|Internal Server Error|sqlalchemy\.exc|asyncpg\.exceptions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(sweep_under_load(json.loads(args.child))), flush=True)
        return
    sys.path.insert(0, str(PROJECT_ROOT))
    from tests.team_servers import servers_missing
    from training.data.synthetic import cached_artifacts

    if missing := servers_missing():
        raise SystemExit(f"server_load: {missing}")
    with tempfile.TemporaryDirectory(prefix="laneflow-server-load-") as tmp:
        artifacts = cached_artifacts(Path(tmp) / "source", train=16, val=8, test=8)
        spec = {"artifacts": artifacts, "trials": args.trials, "concurrent": args.concurrent, "steps": args.steps}
        figures = {backend: measure(backend, Path(tmp) / backend, spec) for backend in ("sqlite", "postgres+redis")}
    report(figures, args)


def measure(backend: str, home: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Start the backend's server, run the loaded sweep against it in a process of its own, stop it all."""
    from flows.local_server import free_port, server_env, start_server, start_services
    from flows.team_server import TeamBackends
    from tasks.processes import stop_process
    from tests.team_servers import postgres_server, redis_server

    port = free_port()
    with ExitStack() as stack:
        backends = None
        if backend != "sqlite":
            database = stack.enter_context(postgres_server())
            backends = TeamBackends(database.url, stack.enter_context(redis_server()))
        processes = [start_server(home, port, backends=backends)]
        stack.callback(lambda: [stop_process(p, grace_s=30) for p in reversed(processes)])
        if backends:
            processes.append(start_services(home, port, backends))
        env = {**os.environ, **server_env(home, port), "LANEFLOW_HOME": str(home / "laneflow")}
        print(f"server_load: {backend}: a sweep of {spec['trials']} trials, {spec['concurrent']} at once...",
              flush=True)
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"server_load: the sweep on {backend} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    logs = "\n".join(path.read_text(errors="replace") for path in (home / "prefect").glob("*.log"))
    figures["server_errors"] = len(SERVER_ERROR.findall(logs))
    return figures


def sweep_under_load(spec: dict[str, Any]) -> dict[str, Any]:
    """In the bench's child process, pointed at the server: the sweep, with its clients' requests counted."""
    import httpx

    from flows.serving import ensure_local_setup
    from flows.sweep import sweep

    tally = Tally()
    send, send_async = httpx.Client.send, httpx.AsyncClient.send

    def counted_send(client: Any, request: Any, **kwargs: Any) -> Any:
        with tally.request() as answered:
            return answered(send(client, request, **kwargs))

    async def counted_send_async(client: Any, request: Any, **kwargs: Any) -> Any:
        with tally.request() as answered:
            return answered(await send_async(client, request, **kwargs))

    httpx.Client.send = counted_send  # the bench's instrument: every request the flows make
    httpx.AsyncClient.send = counted_send_async
    ensure_local_setup(gpu_slots=spec["concurrent"])
    lrs = [round(0.01 + 0.005 * index, 4) for index in range(spec["trials"])]
    tally.reset()  # what the set-up asked is not the sweep's
    started = time.perf_counter()
    table = sweep(source={"artifacts": spec["artifacts"]}, epochs=1, max_steps=spec["steps"], workers=1,
                  batch_size=2, loader_workers=0, snapshot=False, package=False, volume="load",
                  grid={"lr": lrs}, max_concurrent=spec["concurrent"])
    wall = time.perf_counter() - started
    latencies = sorted(tally.latencies)
    counts = _counts()
    return {"wall_s": wall, "flow_runs": counts["flow_runs"], "task_runs": counts["task_runs"],
            "requests": len(latencies), "errors_5xx": tally.server_errors,
            "errors_connection": tally.connection_errors,
            "latency_median_ms": 1000 * statistics.median(latencies),
            "latency_p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
            "completed": sum(row["state"] == "Completed" for row in table), "trials": len(table)}


class Tally:
    """What the flows' requests met: each answer's latency, 5xx answers, connections that failed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.latencies: list[float] = []
        self.server_errors = 0
        self.connection_errors = 0

    @contextmanager
    def request(self) -> Iterator[Callable[[Any], Any]]:
        import httpx

        started = time.perf_counter()

        def answered(response: Any) -> Any:
            self.latencies.append(time.perf_counter() - started)
            self.server_errors += response.status_code >= 500
            return response
        try:
            yield answered
        except httpx.TransportError:
            self.connection_errors += 1
            raise


def _counts() -> dict[str, int]:
    """Flow and task runs the server holds (a fresh server: all of them the sweep's), by its count endpoints."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {"flow_runs": client.count_flow_runs(),
                "task_runs": int(client.request("POST", "/task_runs/count", json={}).json())}


def report(figures: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    base, team = figures["sqlite"], figures["postgres+redis"]
    print(f"\nbaseline: the embedded SQLite server; a sweep of {args.trials} trials, {args.concurrent} at once "
          f"({args.steps} training steps each); ratio = PostgreSQL+Redis / SQLite")
    rows = [("wall time (s)", "wall_s", "{:.1f}"), ("flow runs/s", None, "{:.3f}"), ("task runs/s", None, "{:.2f}"),
            ("API requests", "requests", "{:d}"), ("API 5xx answers", "errors_5xx", "{:d}"),
            ("API connections failed", "errors_connection", "{:d}"),
            ("request latency median (ms)", "latency_median_ms", "{:.1f}"),
            ("request latency p95 (ms)", "latency_p95_ms", "{:.1f}"),
            ("server log errors", "server_errors", "{:d}"), ("trials completed", "completed", "{:d}")]
    print("| figure | SQLite | PostgreSQL + Redis | ratio |\n|---|---|---|---|")
    for label, key, shape in rows:
        values = [(f["flow_runs"] / f["wall_s"]) if label == "flow runs/s" else
                  (f["task_runs"] / f["wall_s"]) if label == "task runs/s" else f[key] for f in (base, team)]
        ratio = f"{values[1] / values[0]:.2f}" if values[0] else "-"
        print(f"| {label} | {shape.format(values[0])} | {shape.format(values[1])} | {ratio} |")


if __name__ == "__main__":
    main()
