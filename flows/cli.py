"""``laneflow``: predict with a model, show the champion, lineage of runs and snapshots, the snapshot list,
and ``serve`` (server + deployments + worker).

    laneflow predict <image|folder|glob|video> [--model champion|RUN|SNAPSHOT|PACKAGE] [--volume V] [--out DIR]
    laneflow champion [--volume V] [--platform local]
    laneflow lineage <run-or-snapshot> [--platform local]
    laneflow compare [PLATFORM:][VOLUME/]RUN-OR-SNAPSHOT ... [--baseline R] [--target 0.9] [--prices F] [--out DIR]
    laneflow snapshots [--platform local]
    laneflow serve [--home .laneflow/serve] [--port 4200]
    laneflow deploy [--home .laneflow/serve] [--port 4200]
    laneflow stop-server [--home .laneflow/serve]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.local_server import DEFAULT_PORT, ensure_server, server_env, stop_server
from tasks.processes import PREFECT_WORKER_SIGNALS, stop_process

PROJECT_ROOT = Path(__file__).resolve().parent.parent
WORK_POOL = "laneflow-local"


def lineage_text(name: str, platform_name: str) -> str:
    """The lineage of a snapshot (from the platform) or of a run (its lineage artifact), as markdown."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from tasks.lineage import render_lineage_markdown
    from tasks.platforms import load_platform

    try:
        return render_lineage_markdown(load_platform(platform_name).find_lineage(name))
    except KeyError:
        pass
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"lineage-{name}"])),
                                      sort=ArtifactSort.CREATED_DESC, limit=1)
    if not found:
        raise LookupError(f"no snapshot on platform '{platform_name}' and no run named '{name}' "
                          "(run names look like train-1a2b3c4d5e6f; `laneflow snapshots` lists snapshots)")
    return str(found[0].data)


def local_package(model: str, volume: str, platform_name: str) -> Path:
    """The package a model name means, as a path on this machine: a package folder or archive given as a
    path, or ``champion``/a run/a snapshot resolved on a local platform's volume."""
    if Path(model).exists():
        return Path(model)
    from flows.predict import resolve_package
    from tasks.platforms import LocalPlatform, load_platform

    platform = load_platform(platform_name)
    if not isinstance(platform, LocalPlatform):
        raise LookupError(f"platform '{platform_name}' is not on this machine: run the predict flow there instead "
                          "(deployment predict, or flows.predict.predict)")
    on_volume, package = resolve_package(platform, volume, model)
    path = platform.volume_path(on_volume) / package
    if not path.exists():
        raise LookupError(f"model '{model}' resolves to {path}, which does not exist (was the run trained with "
                          "package on?)")
    return path


def compare_command(args: argparse.Namespace) -> int:
    """Print the comparison's table (and flags); ``--out`` also writes the charts and the figures."""
    import json

    from flows.compare import RunRef, chart_pngs, charts, read_all
    from tasks.compare import CompareError, Prices, compare, figures_record, render_markdown

    try:
        refs = [RunRef.parse(text, volume=args.volume, platform=args.platform) for text in args.runs]
        prices = Prices.model_validate_json(args.prices.read_text()) if args.prices else None
        comparison = compare(read_all(refs), args.target, args.baseline, prices)
    except (CompareError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a platform's own failure (a cluster unreachable): one line, not a traceback
        print(f"error: reading the runs failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(render_markdown(comparison), end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        pngs = chart_pngs(comparison)  # drawn once: the files and the report's data URIs
        for name, png in zip(("throughput.png", "accuracy.png"), pngs.values(), strict=True):
            (args.out / name).write_bytes(png)
        (args.out / "compare.md").write_text(render_markdown(comparison, charts(pngs)))
        (args.out / "figures.json").write_text(json.dumps({"rows": comparison.rows,
                                                           "figures": figures_record(comparison)}, indent=1))
        print(f"\ncharts, report and figures in {args.out}")
    return 0


def predict_command(args: argparse.Namespace) -> int:
    import logging

    import torch

    from training.package import PackageError, load_package
    from training.predict import InputError, predict

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out or Path("predictions") / time.strftime("%Y%m%d-%H%M%S")
    try:
        package = load_package(local_package(args.model, args.volume, args.platform), unpack_to=out / ".package")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        summary = predict(package, args.input, out, backend=args.backend, device=device)
    except (LookupError, PackageError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model       : {args.model} ({package.folder})")
    print(f"frames      : {summary.frames} read, {summary.predicted} predicted, {len(summary.skipped)} skipped "
          f"({summary.backend}, {summary.as_dict()['img_per_s']} img/s)")
    for item in summary.skipped:
        print(f"  skipped {item['frame']}: {item['problem']}")
    print(f"predictions : {summary.predictions}")
    print(f"overlays    : {summary.overlay}")
    return 0


def champion_command(volume: str, platform_name: str) -> int:
    from prefect.variables import Variable

    from tasks.champion import champion_variable

    record = Variable.get(champion_variable(volume), default=None)
    if not record:
        print(f"error: volume '{volume}' has no champion yet (nightly_retrain crowns one)", file=sys.stderr)
        return 1
    metrics = record.get("metrics") or {}
    try:
        package = str(local_package("champion", volume, platform_name))
    except LookupError:
        package = f"{record.get('package')} on volume {record.get('volume')}"
    print(f"champion of {volume}: {record['run']} (snapshot {record.get('snapshot') or 'none'}, dataset "
          f"{record.get('dataset_version')})")
    for label, scores in (("val", record.get("val_metrics")), ("reported", metrics)):
        if not scores:
            continue
        print(f"{label:<12}: {scores.get('untimed_accuracy', scores.get('accuracy', float('nan'))):.4f} without the "
              f"200 ms rule, {scores.get('accuracy', float('nan')):.4f} official ({scores.get('split')}, "
              f"{scores.get('images')} images){' - decided on' if label == 'val' else ''}")
    print(f"package     : {package}")
    tracked = record.get("mlflow") or {}
    if tracked.get("model_url"):
        print(f"mlflow      : {tracked['model_url']} ({tracked['model']} version {tracked['version']}, alias "
              f"{tracked['alias']}; run {tracked.get('run_url') or tracked.get('run_id')})")
    elif tracked.get("run_url") or tracked.get("run_id"):
        print(f"mlflow      : run {tracked.get('run_url') or tracked['run_id']} (not in the model registry)")
    print()
    try:
        print(lineage_text(record.get("snapshot") or record["run"], platform_name), end="")
    except LookupError as exc:
        print(f"(no lineage found: {exc})")
    return 0


def ensure_local_setup(gpu_slots: int = 1) -> None:
    """Platform block types (so the UI can create platforms), the process work pool and the ``gpu``
    concurrency limit: created when missing, left alone when present."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    from flows.train import GPU_LIMIT
    from tasks.platforms import PLATFORM_TYPES

    for platform_type in PLATFORM_TYPES:
        platform_type.register_type_and_schema()

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(WORK_POOL)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process"))
        try:
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, gpu_slots)


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


def deploy(env: dict[str, str]) -> list[str]:
    """Work pool, ``gpu`` limit, prefect.yaml's deployments, then the alert automations, on the server the
    environment points at; the alerts applied (none without an alert block)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.alerts import apply_alerts

    os.environ.update(env)
    # Prefect read its settings when it was imported: without this, the in-process calls below would go to
    # a temporary server of their own instead of the one the environment names.
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}) if env.get("PREFECT_API_URL") \
            else contextlib.nullcontext():
        ensure_local_setup()
        apply_deployments(env)
        print("deployments train, nightly, dataset_watch, sweep, restore, predict applied", flush=True)
        return apply_alerts()


def deploy_command(home: Path, port: int) -> int:
    """``laneflow deploy``: to $PREFECT_API_URL when set, else to the local server (started if needed)."""
    from flows.alerts import AlertSetupError

    home = home.resolve()
    env = {**os.environ, "LANEFLOW_HOME": os.environ.get("LANEFLOW_HOME", str(home / "home"))}
    if not os.environ.get("PREFECT_API_URL"):
        print(f"laneflow deploy: Prefect server on 127.0.0.1:{port} (first start takes a minute or two)...", flush=True)
        ensure_server(home, port)
        env.update(server_env(home, port))
    try:
        deploy(deployment_environment(home, env))
    except AlertSetupError as exc:
        print(f"laneflow deploy: deployments applied, alerts not: {exc}", file=sys.stderr)
        return 2
    return 0


def serve(home: Path, port: int) -> int:
    """Start (or reuse) the server, apply prefect.yaml and the alerts, and run a worker until interrupted."""
    from flows.alerts import AlertSetupError

    home = home.resolve()
    print(f"laneflow serve: Prefect server on 127.0.0.1:{port} (first start takes a minute or two)...", flush=True)
    api = ensure_server(home, port)
    env = deployment_environment(home, {**os.environ, **server_env(home, port),
                                        "LANEFLOW_HOME": os.environ.get("LANEFLOW_HOME", str(home / "home"))})
    try:
        deploy(env)
    except AlertSetupError as exc:  # the deployments are there; the UI is still worth having
        print(f"laneflow serve: alerts not applied: {exc}", file=sys.stderr, flush=True)
    print(f"UI at {api.removesuffix('/api')}/deployments")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="laneflow", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lineage = commands.add_parser("lineage", help="print what a run or snapshot was made from")
    lineage.add_argument("name", help="a run (train-...) or snapshot name")
    lineage.add_argument("--platform", default="local")
    snapshots = commands.add_parser("snapshots", help="list snapshots with their dataset version and accuracy")
    snapshots.add_argument("--platform", default="local")
    serve_cmd = commands.add_parser("serve", help="local server + deployments from prefect.yaml + a process worker")
    serve_cmd.add_argument("--home", type=Path, default=Path(".laneflow/serve"))
    serve_cmd.add_argument("--port", type=int, default=DEFAULT_PORT)
    deploy_cmd = commands.add_parser("deploy", help="apply prefect.yaml's deployments and the alert automations "
                                                    "($PREFECT_API_URL, else the local server)")
    deploy_cmd.add_argument("--home", type=Path, default=Path(".laneflow/serve"))
    deploy_cmd.add_argument("--port", type=int, default=DEFAULT_PORT)
    stop = commands.add_parser("stop-server", help="stop the local Prefect server started by demo or serve")
    stop.add_argument("--home", type=Path, default=Path(".laneflow/serve"))
    predict_cmd = commands.add_parser("predict", help="lanes on images or a video with a model package")
    predict_cmd.add_argument("input", help="an image, a folder, a glob (quote it) or a video file")
    predict_cmd.add_argument("--model", default="champion",
                             help="champion, a run (train-...), a snapshot, or a package folder/archive path")
    predict_cmd.add_argument("--volume", default="tusimple", help="the volume champion/run/snapshot live on")
    predict_cmd.add_argument("--platform", default="local")
    predict_cmd.add_argument("--backend", default="auto", choices=("auto", "eager", "torchscript", "onnx"),
                             help="auto: the fastest for the device (onnx on CPUs, torchscript on GPUs)")
    predict_cmd.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    predict_cmd.add_argument("--out", type=Path, default=None, help="output folder (default predictions/<time>)")
    compare_cmd = commands.add_parser("compare", help="runs and snapshots side by side: figures, scaling, cost")
    compare_cmd.add_argument("runs", nargs="+", metavar="RUN", help="[PLATFORM:][VOLUME/]NAME: a run or a snapshot")
    compare_cmd.add_argument("--volume", default="tusimple", help="the volume of runs named without one")
    compare_cmd.add_argument("--platform", default="local", help="the platform of runs named without one")
    compare_cmd.add_argument("--baseline", default=None, help="the run scaling is measured against (default: the "
                                                              "one with the fewest workers)")
    compare_cmd.add_argument("--target", type=float, default=0.9, help="val accuracy (untimed) to time")
    compare_cmd.add_argument("--prices", type=Path, default=None, help="JSON: {currency, worker_hour: {platform: "
                                                                       "price}, tib_hour: {level: price}}")
    compare_cmd.add_argument("--out", type=Path, default=None, help="folder for the charts, report and figures")
    champion = commands.add_parser("champion", help="the volume's champion: run, metrics, package, lineage")
    champion.add_argument("--volume", default="tusimple")
    champion.add_argument("--platform", default="local")
    args = parser.parse_args(argv)

    if args.command == "predict":
        return predict_command(args)
    if args.command == "champion":
        return champion_command(args.volume, args.platform)
    if args.command == "compare":
        return compare_command(args)
    if args.command == "serve":
        try:
            return serve(args.home, args.port)
        except KeyboardInterrupt:  # before the worker started (server start-up, deploy): nothing else to stop
            print("laneflow serve: interrupted before the worker started", file=sys.stderr)
            return 130
    if args.command == "deploy":
        return deploy_command(args.home, args.port)
    if args.command == "stop-server":
        stopped = stop_server(args.home)
        print("server stopped" if stopped else f"no server was started from {args.home}")
        return 0

    if args.command == "lineage":
        try:
            print(lineage_text(args.name, args.platform), end="")
        except LookupError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    from tasks.platforms import load_platform

    for ref in load_platform(args.platform).list_snapshots():
        metrics = ref.lineage.get("metrics") or {}
        print(f"{ref.name:<40} {ref.lineage.get('created_at', ''):<26} dataset {ref.lineage.get('dataset_version')} "
              f"accuracy {metrics.get('untimed_accuracy', float('nan')):.4f} "
              f"(official {metrics.get('accuracy', float('nan')):.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
