"""``laneflow run`` and ``laneflow sweep``: a flow run of a deployment with typed parameters, followed in the
terminal, ending with its summary.

The run is the deployment's, as one started from the UI: its defaults with the ``--set`` values over them, and
the server refuses what the UI's form would (the deployments enforce their parameter schema), naming the field.
Without ``$PREFECT_API_URL`` it goes to the local server of ``--home`` (started, and prefect.yaml deployed, when
needed). A process work pool with no worker online gets one for the run's length, as ``laneflow serve`` would
run it. Ctrl-C asks whether to cancel the run or detach from it; detached, the run goes on (and the worker
this command started, until ``laneflow stop-server`` stops it with the server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from flows.local_server import AUTH_FILE, ServerNotOurs, ensure_server, server_env, take_pid_file, ui_url
from flows.params import TrainParams
from flows.run_progress import (
    OverrideError,
    Progress,
    advance,
    metrics_summary,
    parse_overrides,
    render,
    unknown_parameters,
)
from flows.serving import PROJECT_ROOT, deploy, deployment_environment
from tasks.processes import PREFECT_WORKER_SIGNALS, group_alive, stop_group, stop_process

#: What each command starts unless ``--deployment`` names another (prefect.yaml's local deployments).
DEFAULT_DEPLOYMENT = {"run": "train_pipeline/train", "sweep": "sweep/sweep"}
#: Where a worker this command left running (a detached run's) is recorded, in the server's home.
WORKER_PID = "worker.pid"
POLL_S = 1.0
#: A run no worker has picked up this long gets a worker of this command's own.
PICKUP_GRACE_S = 30.0


class Detach(BaseException):
    """SIGTERM or SIGHUP while following (a closed terminal, a stopped job): leave the run going, lose nothing."""


def _detach(signum: int, frame: object) -> None:
    raise Detach


def _hear_the_user() -> None:
    """Ctrl-C asks, SIGTERM and SIGHUP detach — whatever was inherited: a parent that ignored SIGINT (a script's
    `trap '' INT`, a test runner's worker) or blocked it would otherwise leave this command deaf to Ctrl-C."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _detach)
    signal.signal(signal.SIGHUP, _detach)


def command(kind: str, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Start the run, follow it, print its summary; the exit code says how it ended (0 completed, 1 not)."""
    _hear_the_user()
    name = f"laneflow {kind}"
    try:
        overrides = parse_overrides(args.set or [])
    except OverrideError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    home = args.home.resolve()
    env = dict(os.environ)
    local = not env.get("PREFECT_API_URL")
    if local:
        print(f"{name}: Prefect server on 127.0.0.1:{args.port} (first start takes a minute or two)...", file=out,
              flush=True)
        try:
            ensure_server(home, args.port)
        except ServerNotOurs as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        env.update(server_env(home, args.port))
        env.setdefault("LANEFLOW_HOME", str(home / "home"))
    with _settings(env):
        return _start_and_follow(name, args.deployment or DEFAULT_DEPLOYMENT[kind], overrides, home, env, local, out)


@contextlib.contextmanager
def _settings(env: dict[str, str]) -> Iterator[None]:
    """Prefect read its settings when it was imported: the client must use the server chosen here."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    os.environ.update(env)
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"],
                             PREFECT_API_AUTH_STRING: env.get("PREFECT_API_AUTH_STRING")}):
        yield


def _flow_parameters(deployment_name: str) -> list[str]:
    """The parameters this laneflow's flow of ``deployment_name`` (``<flow>/<deployment>``) takes."""
    import inspect

    from flows.nightly import nightly_retrain
    from flows.sweep import sweep
    from flows.train import train_pipeline

    flows = {"train_pipeline": train_pipeline, "sweep": sweep, "nightly_retrain": nightly_retrain}
    flow = flows.get(deployment_name.split("/", 1)[0])
    return list(inspect.signature(flow.fn).parameters) if flow is not None else []


def _start_and_follow(name: str, deployment_name: str, overrides: dict[str, Any], home: Path, env: dict[str, str],
                      local: bool, out: TextIO) -> int:
    import httpx
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(deployment_name)
        except ObjectNotFound:
            if not local:
                print(f"{name}: no deployment {deployment_name!r} on {env['PREFECT_API_URL']}: apply prefect.yaml "
                      "there first (laneflow deploy)", file=sys.stderr)
                return 2
            print(f"{name}: applying prefect.yaml's deployments to the local server...", file=out, flush=True)
            deploy(deployment_environment(home, env))
            deployment = client.read_deployment_by_name(deployment_name)
        current = frozenset(TrainParams.model_fields) | frozenset(_flow_parameters(deployment_name))
        why = unknown_parameters(overrides, deployment.parameter_openapi_schema, current)
        known = (deployment.parameter_openapi_schema or {}).get("properties") or {}
        if why and local and any(key in current and key not in known for key in overrides):  # ours to update
            print(f"{name}: {why.split(':', 1)[0]}; applying prefect.yaml's deployments again...", file=out,
                  flush=True)
            deploy(deployment_environment(home, env))
            deployment = client.read_deployment_by_name(deployment_name)
            why = unknown_parameters(overrides, deployment.parameter_openapi_schema, current)
        if why:
            print(f"{name}: {why}", file=sys.stderr)
            return 2
        try:
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=overrides)
        except httpx.HTTPStatusError as exc:  # the deployment's parameter schema refused a value
            detail = exc.response.text
            with contextlib.suppress(ValueError):
                detail = exc.response.json().get("detail", detail)
            print(f"{name}: the server refused the run's parameters: {detail}", file=sys.stderr)
            return 2
        api = env["PREFECT_API_URL"]
        print(f"{name}: flow run {flow_run.name} of {deployment_name}: {ui_url(api, str(flow_run.id))}", file=out,
              flush=True)
        pool = deployment.work_pool_name
        started: list[subprocess.Popen] = []
        asked: set[bool] = set()

        def serve_it(force: bool) -> None:
            """A worker of our own for a process pool with none online (``force``: a run nobody has picked up
            for PICKUP_GRACE_S, whatever the pool's list says: a worker stopped a moment ago looks online)."""
            if started or force in asked:
                return
            asked.add(force)
            if (worker := _worker_for(client, pool, env, home, name, out, force)) is not None:
                started.append(worker)

        serve_it(force=False)
        detached = False
        try:
            final, detached = _follow(client, flow_run.id, out, serve_it)
        finally:
            for worker in started:
                if detached:
                    (home / WORKER_PID).write_text(str(worker.pid))
                    print(f"{name}: the worker on pool {deployment.work_pool_name!r} (pid {worker.pid}) keeps "
                          f"running it; `laneflow stop-server --home {home}` stops it with the server", file=out)
                else:
                    stop_process(worker, PREFECT_WORKER_SIGNALS, grace_s=20)
        if detached:
            print(f"{name}: detached; the run goes on: {ui_url(api, str(flow_run.id))}", file=out)
            return 0
        prefix = (f"LANEFLOW_HOME={env['LANEFLOW_HOME']} PREFECT_API_URL={api} PREFECT_API_AUTH_STRING=$(cat "
                  f"{home / 'prefect' / AUTH_FILE}) .venv/bin/" if local else "")
        _summary(client, final, api, out, prefix)
        return 0 if final.state is not None and final.state.is_completed() else 1


def _worker_for(client: Any, pool: str | None, env: dict[str, str], home: Path, name: str, out: TextIO,
                force: bool = False) -> subprocess.Popen | None:
    """A worker for a process pool nobody serves now (started here, in its own session, logging to the home);
    None when one is online (unless ``force``), or for other pools, whose workers run where their
    infrastructure is."""
    from prefect.client.schemas.objects import WorkerStatus

    if pool is None:
        return None
    if not force and any(worker.status == WorkerStatus.ONLINE for worker in client.read_workers_for_work_pool(pool)):
        return None
    if client.read_work_pool(pool).type != "process":
        if not force:
            print(f"{name}: no worker is online on work pool {pool!r}: the run waits until one polls it", file=out)
        return None
    home.mkdir(parents=True, exist_ok=True)
    prefect = str(Path(sys.executable).parent / "prefect")
    print(f"{name}: starting a worker on work pool {pool!r} for this run (its log: {home / 'worker.log'})", file=out,
          flush=True)
    with (home / "worker.log").open("ab") as log:
        # Asks for runs every 2 s (Prefect's default is 10 s): the run this command made starts at once.
        return subprocess.Popen([prefect, "worker", "start", "--pool", pool, "--type", "process"],
                                env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"},
                                cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _follow(client: Any, flow_run_id: Any, out: TextIO, serve_it: Callable[[bool], None]) -> tuple[Any, bool]:
    """Poll the run until it ends, showing its progress; (the run as it ended, whether the user detached).
    A run still waiting for a worker after PICKUP_GRACE_S gets one (``serve_it(True)``)."""
    progress, seen, shown = Progress(), 0, ""
    tty = out.isatty()
    waiting_since = time.monotonic()
    while True:
        try:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.name not in ("Scheduled", "Late"):
                waiting_since = time.monotonic()
            elif time.monotonic() - waiting_since > PICKUP_GRACE_S:
                serve_it(True)
            lines, seen = _new_log_lines(client, flow_run_id, seen)
            state = run.state.name if run.state else "Pending"
            progress = advance(progress, state, _running_tasks(client, flow_run_id), lines)
            line = render(progress)
            if line != shown:
                print(f"\r{line:<120}" if tty else line, end="" if tty else "\n", file=out, flush=True)
                shown = line
            if run.state is not None and run.state.is_final():
                if tty:
                    print(file=out)
                return run, False
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            try:
                cancel = _ask_to_cancel(out)
            except Detach:
                cancel = False
            if cancel:
                from prefect.states import Cancelling

                client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled from laneflow's command line"),
                                          force=True)
                print("cancelling the run...", file=out, flush=True)
                continue
            return client.read_flow_run(flow_run_id), True
        except Detach:
            return client.read_flow_run(flow_run_id), True


def _ask_to_cancel(out: TextIO) -> bool:
    """Ctrl-C's question; an answer that is not 'c' (or no answer: a closed input, another Ctrl-C) detaches,
    which loses nothing."""
    print("\nCtrl-C: [c]ancel the run, or [d]etach and leave it running? [c/d] ", end="", file=out, flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    return answer.strip().lower() in ("c", "cancel")


def _new_log_lines(client: Any, flow_run_id: Any, seen: int) -> tuple[list[str], int]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                            sort=LogSort.TIMESTAMP_ASC, offset=seen, limit=200)
    return [log.message for log in logs], seen + len(logs)


def _running_tasks(client: Any, flow_run_id: Any) -> list[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    running = [task for task in task_runs if task.state is not None and task.state.is_running()]
    return [task.name for task in sorted(running, key=lambda task: str(task.start_time))]


def _summary(client: Any, run: Any, api: str, out: TextIO, lineage_prefix: str = "") -> None:
    """What ``make demo`` prints of a finished run: its state and page, the run, its metrics (or a sweep's
    leaderboard) and how to see its lineage (``lineage_prefix``: the environment that command needs)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    print(f"flow run        : {run.state.name if run.state else 'unknown'}  {ui_url(api, str(run.id))}", file=out)
    if run.state is not None and not run.state.is_completed() and run.state.message:
        print(f"error           : {run.state.message[:2000]}", file=out)
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
        any_=[run.id])))
    for artifact in sorted(artifacts, key=lambda a: str(a.key)):
        key, rows = str(artifact.key or ""), artifact.data
        if isinstance(rows, str):
            with contextlib.suppress(ValueError):
                rows = json.loads(rows)
        if key.startswith("metrics-") and isinstance(rows, list):
            print(f"run             : {key.removeprefix('metrics-')}", file=out)
            for line in metrics_summary(rows):
                print(f"  {line}", file=out)
            print(f"lineage         : {lineage_prefix}laneflow lineage {key.removeprefix('metrics-')}", file=out)
        elif key == "sweep-leaderboard" and isinstance(rows, list):
            print("leaderboard     :", file=out)
            for row in rows:
                print("  " + ", ".join(f"{name} {value}" for name, value in row.items()), file=out)
    print(f"Prefect UI      : {api.removesuffix('/api')}", file=out)


def stop_detached_worker(home: Path, grace_s: float = 20.0) -> bool:
    """Stop the worker a detached ``laneflow run``/``sweep`` left running for ``home`` (its pid file); False
    when there is none (or the pid is no longer a Prefect worker)."""
    pid = take_pid_file(home.resolve() / WORKER_PID)
    if pid is None:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if b"worker" not in cmdline or not group_alive(pid):
        return False
    stop_group(pid, PREFECT_WORKER_SIGNALS, grace_s)
    return True
