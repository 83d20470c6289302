"""Serving this machine's work: the local server's work pool, ``gpu`` limit and deployments (``laneflow deploy``),
and a process worker until Ctrl-C (``laneflow serve``). The commands' parsing is ``flows.cli``'s."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from flows.local_server import AUTH_FILE, ensure_server, server_env
from flows.team_server import TeamBackends
from tasks.processes import PREFECT_WORKER_SIGNALS, stop_process

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: The process work pool the local deployments run on (prefect.yaml).
WORK_POOL = "laneflow-local"


def local_gpu_slots() -> int:
    """What the ``gpu`` limit starts at on this machine: one slot per GPU (NVIDIA's driver lists each under
    /proc/driver/nvidia/gpus), or, without GPUs, one per CPU core — a local Horovod process trains on a core's
    share of the machine. Never fewer than the default run's workers, which would otherwise not fit."""
    from flows.params import TrainParams

    gpus = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
    return max(gpus or os.cpu_count() or 1, TrainParams.model_fields["workers"].default)


def ensure_local_setup(gpu_slots: int | None = None) -> None:
    """Platform block types (so the UI can create platforms), the process work pool and the ``gpu``
    concurrency limit: created when missing, left alone when present — at ``local_gpu_slots``; set to
    ``gpu_slots`` when given (the operator's ``--gpu-slots``)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    from flows.params import TrainParams
    from flows.train import GPU_LIMIT
    from tasks.platforms import PLATFORM_TYPES

    for platform_type in PLATFORM_TYPES:
        platform_type.register_type_and_schema()

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(WORK_POOL)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process"))
        if gpu_slots is not None:
            client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, gpu_slots)
            return
        try:
            existing = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, local_gpu_slots())
            return
        workers = TrainParams.model_fields["workers"].default
        if existing.limit < workers:  # made when a run took one slot whatever its GPUs (before GPU slots)
            print(f"laneflow: the '{GPU_LIMIT}' limit has {existing.limit} slot(s), and a run now takes one per GPU: "
                  f"a default run ({workers} workers) could never start. Set it to the GPUs runs may use: "
                  f"--gpu-slots N, or 'prefect gcl update {GPU_LIMIT} --limit N'", file=sys.stderr, flush=True)


def apply_deployments(env: dict[str, str]) -> None:
    """``prefect deploy --all`` on this project's prefect.yaml (the same command a user would type)."""
    prefect = str(Path(sys.executable).parent / "prefect")
    done = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = done.stdout[-3000:] + done.stderr[-3000:]
        raise RuntimeError(f"prefect deploy failed (exit {done.returncode}):\n{output}")


ARTIFACT_PREFIXES = ("LANEFLOW_TRAIN", "LANEFLOW_TEST", "LANEFLOW_TEST_LABEL")


def deployment_environment(home: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the deployments' dataset defaults filled in (prefect.yaml reads them at deploy time):
    the synthetic artifacts unless the environment names others, and a local dataset index listing
    them unless ``LANEFLOW_DATASET_INDEX`` names the data team's."""
    from training.data.synthetic import cached_artifacts

    env = dict(env)
    if not all(env.get(f"{prefix}_URL") and env.get(f"{prefix}_SHA256") for prefix in ARTIFACT_PREFIXES):
        synthetic = cached_artifacts(home / "source", train=160, val=24, test=40)
        for prefix, artifact in zip(ARTIFACT_PREFIXES, synthetic, strict=True):
            env.setdefault(f"{prefix}_URL", artifact["url"])
            env.setdefault(f"{prefix}_SHA256", artifact["sha256"])
    if not env.get("LANEFLOW_DATASET_INDEX"):
        env["LANEFLOW_DATASET_INDEX"] = write_local_index(home / "source" / "index.json", env).as_uri()
    return env


def write_local_index(path: Path, env: dict[str, str]) -> Path:
    """A dataset index of one version, the deployments' default artifacts (rewritten only when they change,
    so the dataset watch never sees a new version it was not given)."""
    from datetime import UTC, datetime

    from tasks.dataset_index import DatasetRelease, index_json

    artifacts = tuple({"url": env[f"{prefix}_URL"], "sha256": env[f"{prefix}_SHA256"].lower(),
                       "kind": "file" if prefix == "LANEFLOW_TEST_LABEL" else "archive"}
                      for prefix in ARTIFACT_PREFIXES)
    version = "local-" + artifacts[0]["sha256"][:12]
    if path.exists() and f'"{version}"' in path.read_text():
        return path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(index_json([DatasetRelease(version, datetime.now(UTC).replace(microsecond=0), artifacts)]))
    return path.resolve()


def deploy(env: dict[str, str], gpu_slots: int | None = None) -> list[str]:
    """Work pool, ``gpu`` limit (``ensure_local_setup``), prefect.yaml's deployments, then the alert automations,
    on the server the environment points at; the alerts applied (none without an alert block)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.alerts import apply_alerts

    os.environ.update(env)
    # Prefect read its settings when it was imported: without this, the in-process calls below would go to
    # a temporary server of their own instead of the one the environment names.
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"],
                             PREFECT_API_AUTH_STRING: env.get("PREFECT_API_AUTH_STRING")}) \
            if env.get("PREFECT_API_URL") else contextlib.nullcontext():
        ensure_local_setup(gpu_slots)
        apply_deployments(env)
        print("deployments train, nightly, dataset_watch, sweep, restore, predict applied", flush=True)
        return apply_alerts()


def deploy_command(home: Path, port: int, gpu_slots: int | None = None) -> int:
    """``laneflow deploy``: to $PREFECT_API_URL when set, else to the local server (started if needed)."""
    from flows.alerts import AlertSetupError

    home = home.resolve()
    env = {**os.environ, "LANEFLOW_HOME": os.environ.get("LANEFLOW_HOME", str(home / "home"))}
    if not os.environ.get("PREFECT_API_URL"):
        print(f"laneflow deploy: Prefect server on 127.0.0.1:{port} (first start takes a minute or two)...", flush=True)
        ensure_server(home, port)
        env.update(server_env(home, port))
    try:
        deploy(deployment_environment(home, env), gpu_slots)
    except AlertSetupError as exc:
        print(f"laneflow deploy: deployments applied, alerts not: {exc}", file=sys.stderr)
        return 2
    return 0


def serve(home: Path, port: int, gpu_slots: int | None = None, backends: TeamBackends | None = None) -> int:
    """Start (or reuse) the server, apply prefect.yaml and the alerts, and run a worker until interrupted. With
    ``backends``, a team's server: on PostgreSQL and Redis, its API and background services apart."""
    from flows.alerts import AlertSetupError

    home = home.resolve()
    on = " on PostgreSQL and Redis" if backends else ""
    print(f"laneflow serve: Prefect server{on} on 127.0.0.1:{port} (first start takes a minute or two)...",
          flush=True)
    api = ensure_server(home, port, backends=backends)
    env = deployment_environment(home, {**os.environ, **server_env(home, port),
                                        "LANEFLOW_HOME": os.environ.get("LANEFLOW_HOME", str(home / "home"))})
    try:
        deploy(env, gpu_slots)
    except AlertSetupError as exc:  # the deployments are there; the UI is still worth having
        print(f"laneflow serve: alerts not applied: {exc}", file=sys.stderr, flush=True)
    print(f"UI at {api.removesuffix('/api')}/deployments (it asks once for the server's auth string: "
          f"cat {home / 'prefect' / AUTH_FILE})")
    print(f"starting a worker on work pool '{WORK_POOL}' (Ctrl-C stops it; the server keeps running)", flush=True)
    return run_worker_until_interrupted(env, port)


def run_worker_until_interrupted(env: dict[str, str], port: int) -> int:
    """``prefect worker start`` on the local pool until Ctrl-C (or SIGTERM), then stop it for good.

    The worker runs in its own process group, so the interrupt reaches only this process; the worker then
    gets Ctrl-C as its CLI documents, a second one if its shutdown hangs (Prefect 3.9 may), and SIGKILL of
    its group after that. One line says what stopped; the server is left running for the UI.
    """
    prefect = str(Path(sys.executable).parent / "prefect")
    # Ctrl-C and SIGTERM stop this, whatever was inherited: a parent that ignored SIGINT (a script's
    # `trap '' INT`, a background job of a shell) or blocked it would leave both this and the worker deaf.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", WORK_POOL, "--type", "process"], env=env,
                              start_new_session=True)
    try:
        code = _wait_interruptibly(worker)
    except KeyboardInterrupt:
        code = None
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_process(worker, PREFECT_WORKER_SIGNALS, grace_s=20)
        signal.signal(signal.SIGINT, previous_int)
    if code is not None:  # the worker ended by itself
        print(f"laneflow serve: the worker exited with code {code}; the Prefect server keeps running on "
              f"127.0.0.1:{port}", flush=True)
        return code
    print(f"laneflow serve: worker stopped; the Prefect server keeps running on 127.0.0.1:{port} "
          "(`make stop-server` stops it)", flush=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait_interruptibly(process: subprocess.Popen) -> int:
    """``process.wait()`` in short waits. A signal may be delivered to any thread that does not block it (the
    Prefect client's log and event threads are some): the main thread, blocked in one long ``waitpid``, is then
    never interrupted and runs the Python handler only once the worker exits, so Ctrl-C would do nothing. Each
    short wait returns to the interpreter, which runs a pending handler within half a second."""
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue
