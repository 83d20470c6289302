"""laneflow's command line: start and follow runs and sweeps, predict with a model, the champion, lineage of runs
and snapshots, the snapshots, comparisons, and the local server (serve, deploy, stop-server).

    laneflow run [--set KEY=VALUE]... [--deployment train_pipeline/train] [--home .laneflow/serve] [--port 4200]
    laneflow sweep [--set KEY=VALUE]... [--deployment sweep/sweep] [--home .laneflow/serve] [--port 4200]
    laneflow predict <image|folder|glob|video> [--model champion|RUN|SNAPSHOT|PACKAGE] [--volume V] [--out DIR]
    laneflow champion [--volume V] [--platform local]
    laneflow lineage <run-or-snapshot> [--platform local]
    laneflow compare [PLATFORM:][VOLUME/]RUN-OR-SNAPSHOT ... [--baseline R] [--target 0.9] [--prices F] [--out DIR]
    laneflow snapshots [--platform local]
    laneflow serve [--home .laneflow/serve] [--port 4200] [--gpu-slots N] [--database URL --redis URL]
    laneflow deploy [--home .laneflow/serve] [--port 4200] [--gpu-slots N]
    laneflow stop-server [--home .laneflow/serve]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flows.local_server import DEFAULT_PORT, ServerNotOurs, stop_server
from flows.serving import deploy_command, serve
from flows.team_server import BackendsInvalid, team_backends

#: What ``laneflow --help`` says first (plain text: argparse prints it as it is).
DESCRIPTION = ("laneflow: lane-detection training as Prefect flows. Start and follow training runs and sweeps, "
               "predict with a model, show a volume's champion, the lineage of runs and snapshots, compare runs, "
               "and run the local Prefect server with laneflow's deployments and a worker.")

def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1, refused with what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


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
    from tasks.compare import CompareError, Prices, compare
    from tasks.compare_report import figures_record, render_markdown

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
        summary = predict(package, args.input, out, backend=args.backend, device=device, label_format=args.format)
    except (LookupError, PackageError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model       : {args.model} ({package.folder})")
    print(f"frames      : {summary.frames} read, {summary.predicted} predicted, {len(summary.skipped)} skipped "
          f"({summary.backend}, {summary.as_dict()['img_per_s']} img/s)")
    for item in summary.skipped:
        print(f"  skipped {item['frame']}: {item['problem']}")
    written = "CULane .lines.txt" if summary.label_format == "culane" else "TuSimple lines"
    print(f"predictions : {summary.predictions} ({written})")
    print(f"overlays    : {summary.overlay}")
    return 0


def champion_command(volume: str, platform_name: str) -> int:
    from prefect.variables import Variable

    from tasks.champion import champion_variable, score_summary

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
        print(f"{label:<12}: {score_summary(scores)} ({scores.get('split')}, {scores.get('images')} images)"
              f"{' - decided on' if label == 'val' else ''}")
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


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, each with its help (a test holds every option to having one)."""
    parser = argparse.ArgumentParser(prog="laneflow", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")

    def platform_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--platform", default="local",
                         help="the platform block to read from (default: local, this machine's volumes)")

    def server_options(sub: argparse.ArgumentParser, port: bool = True) -> None:
        sub.add_argument("--home", type=Path, default=Path(".laneflow/serve"),
                         help="the local server's home: its database, auth string and the runs' volumes "
                              "(default: .laneflow/serve)")
        if port:
            sub.add_argument("--port", type=int, default=DEFAULT_PORT,
                             help=f"the local server's port on 127.0.0.1 (default: {DEFAULT_PORT})")

    for kind, summary, default in (("run", "start a training pipeline run and follow it to its summary",
                                    "train_pipeline/train"),
                                   ("sweep", "start a sweep (a grid, or an Optuna search) and follow it to its "
                                             "leaderboard", "sweep/sweep")):
        start = command(kind, summary)
        start.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="a parameter over the deployment's default, as the UI's form takes it (repeat it): "
                                "epochs=2, lr=0.02, package=false, grid='{\"lr\": [0.02, 0.05]}'; JSON where it "
                                "reads as JSON, else text (docs/reference/parameters.md lists them)")
        start.add_argument("--deployment", default=None,
                           help=f"the deployment to run (default: {default}, on the local server; with "
                                "$PREFECT_API_URL set, on that server, e.g. train_pipeline/train-k8s)")
        server_options(start)
    lineage = command("lineage", "print what a run or snapshot was made from")
    lineage.add_argument("name", help="a run (train-...) or snapshot name")
    platform_option(lineage)
    snapshots = command("snapshots", "list snapshots with their dataset version and accuracy")
    platform_option(snapshots)
    for sub in (command("serve", "local server, the deployments of prefect.yaml and a process worker until Ctrl-C"),
                command("deploy", "apply prefect.yaml's deployments and the alert automations ($PREFECT_API_URL, "
                                  "else the local server)")):
        server_options(sub)
        sub.add_argument("--gpu-slots", type=positive_int, default=None, metavar="N",
                         help="set the 'gpu' concurrency limit to N, the GPUs runs may train on together (each run "
                              "takes one slot per GPU; default: left as it is, created at this machine's GPUs, "
                              "or CPU cores without GPUs)")
        if sub.prog.endswith(" serve"):
            sub.add_argument("--database", default=None, metavar="URL",
                             help="a team's server: PostgreSQL for its database, e.g. postgresql://prefect@db:5432/"
                                  "prefect (with a password: $LANEFLOW_SERVER_DATABASE instead); needs --redis")
            sub.add_argument("--redis", default=None, metavar="URL",
                             help="a team's server: Redis for its events, ordering and concurrency leases, e.g. "
                                  "redis://cache:6379/0 ($LANEFLOW_SERVER_REDIS); needs --database")
    server_options(command("stop-server", "stop the local Prefect server started by demo or serve"), port=False)
    predict_cmd = command("predict", "lanes on images or a video with a model package")
    predict_cmd.add_argument("input", help="an image, a folder, a glob (quote it) or a video file")
    predict_cmd.add_argument("--model", default="champion",
                             help="champion, a run (train-...), a snapshot, or a package folder/archive path")
    predict_cmd.add_argument("--volume", default="tusimple", help="the volume champion/run/snapshot live on")
    platform_option(predict_cmd)
    predict_cmd.add_argument("--backend", default="auto", choices=("auto", "eager", "torchscript", "onnx"),
                             help="auto: the fastest for the device (onnx on CPUs, torchscript on GPUs)")
    predict_cmd.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    predict_cmd.add_argument("--out", type=Path, default=None, help="output folder (default predictions/<time>)")
    predict_cmd.add_argument("--format", default="auto", choices=("auto", "tusimple", "culane"),
                             help="auto: the format of the dataset the model was evaluated on")
    compare_cmd = command("compare", "runs and snapshots side by side: figures, scaling, cost")
    compare_cmd.add_argument("runs", nargs="+", metavar="RUN", help="[PLATFORM:][VOLUME/]NAME: a run or a snapshot")
    compare_cmd.add_argument("--volume", default="tusimple", help="the volume of runs named without one")
    compare_cmd.add_argument("--platform", default="local", help="the platform of runs named without one")
    compare_cmd.add_argument("--baseline", default=None, help="the run scaling is measured against (default: the "
                                                              "one with the fewest workers)")
    compare_cmd.add_argument("--target", type=float, default=0.9, help="val accuracy (untimed) to time")
    compare_cmd.add_argument("--prices", type=Path, default=None, help="JSON: {currency, worker_hour: {platform: "
                                                                       "price}, tib_hour: {level: price}}")
    compare_cmd.add_argument("--out", type=Path, default=None, help="folder for the charts, report and figures")
    champion = command("champion", "the volume's champion: run, metrics, package, lineage")
    champion.add_argument("--volume", default="tusimple", help="the volume whose champion to show "
                                                               "(default: tusimple)")
    platform_option(champion)
    doctor = command("doctor", "check that a platform is ready for laneflow: the cluster's API, permissions and "
                               "operators, or this machine's Horovod, disk and server; one line per check")
    doctor.add_argument("--platform", default="local",
                        help="the platform block to check (default: local, this machine)")
    doctor.add_argument("--json", action="store_true",
                        help="print the checks as a JSON list of {check, ok, detail, fix} (for CI)")
    doctor.add_argument("--work-pool", default=None,
                        help="on a cluster, the Kubernetes work pool whose worker to check (default: laneflow-k8s, "
                             "when it exists)")
    doctor.add_argument("--pull-images", action="store_true",
                        help="on a cluster, also start a short Job per image of the block to see that the nodes can "
                             "pull it (minutes for a multi-GB image the first time)")
    doctor.add_argument("--volume", default=None,
                        help="on a cluster with ANF settings, a claim (a run's volume parameter) whose Azure NetApp "
                             "Files volume must be found in one of the block's capacity pools")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.command == "predict":
        return predict_command(args)
    if args.command == "champion":
        return champion_command(args.volume, args.platform)
    if args.command == "compare":
        return compare_command(args)
    if args.command == "serve":
        try:
            return serve(args.home, args.port, args.gpu_slots, team_backends(args.database, args.redis))
        except BackendsInvalid as exc:
            print(f"laneflow serve: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before the worker started (server start-up, deploy): nothing else to stop
            print("laneflow serve: interrupted before the worker started", file=sys.stderr)
            return 130
        except ServerNotOurs as exc:
            print(f"laneflow serve: {exc}", file=sys.stderr)
            return 2
    if args.command == "deploy":
        try:
            return deploy_command(args.home, args.port, args.gpu_slots)
        except ServerNotOurs as exc:
            print(f"laneflow deploy: {exc}", file=sys.stderr)
            return 2
    if args.command in ("run", "sweep"):
        from flows.run_command import command as start_command

        return start_command(args.command, args)
    if args.command == "stop-server":
        from flows.run_command import stop_detached_worker

        if stop_detached_worker(args.home):
            print("the worker a detached run left running stopped")
        stopped = stop_server(args.home)
        print("server stopped" if stopped else f"no server was started from {args.home}")
        return 0

    if args.command == "doctor":
        from flows.doctor import doctor_command

        return doctor_command(args.platform, args.json, args.work_pool, args.pull_images, args.volume)
    if args.command == "lineage":
        try:
            print(lineage_text(args.name, args.platform), end="")
        except LookupError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    from tasks.champion import score_summary
    from tasks.lineage import dataset_label
    from tasks.platforms import load_platform

    for ref in load_platform(args.platform).list_snapshots():
        print(f"{ref.name:<40} {ref.lineage.get('created_at', ''):<26} dataset {dataset_label(ref.lineage)} "
              f"{score_summary(ref.lineage.get('metrics') or {})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
