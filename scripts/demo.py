"""The local demo: the whole ``train_pipeline`` on this machine, reported to a local Prefect server.

Starts (or reuses) a Prefect server on 127.0.0.1, makes synthetic TuSimple artifacts offline (train_set.zip,
test_set.zip, test_label.json, as the benchmark ships them; with ``--dataset culane``, CULane's archives, and the
run ends printing F1 per scenario), and runs
``train_pipeline`` on the ``local`` platform with the ``cpu-demo`` preset: prepare -> horovodrun -np 2
-> evaluate -> package -> snapshot -> artifacts. Ends by printing the run's UI address, its metrics and
its model package, then runs ``laneflow predict`` with that package on a short synthetic video and scores
the prediction lines against the video's ground truth. Run it again and the dataset stage is a cache
hit. Run through ``make demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from flows.local_server import AUTH_FILE, DEFAULT_PORT, ServerNotOurs, ensure_server, server_env, ui_url
from training.data.synthetic import cached_artifacts
from training.data.synthetic_culane import cached_artifacts as culane_artifacts

#: Frames of the demo's short video (the first test images).
VIDEO_FRAMES = 12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(".laneflow/demo"))
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--train", type=int, default=160)
    parser.add_argument("--val", type=int, default=24)
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, help="default: 4 on TuSimple; 12 on CULane, whose 30-pixel IoU "
                                                   "asks more of a model than TuSimple's 20-pixel distance")
    parser.add_argument("--workers", type=int, default=2, help="horovodrun -np")
    parser.add_argument("--dataset", choices=("tusimple", "culane"), default="tusimple",
                        help="which benchmark's format the synthetic data takes")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    args.epochs = args.epochs or (12 if args.dataset == "culane" else 4)

    print(f"laneflow demo: Prefect server on 127.0.0.1:{args.port} (first start takes a minute or two)...",
          flush=True)
    try:
        api = ensure_server(workdir, args.port)
    except ServerNotOurs as exc:
        print(f"laneflow demo: {exc}", file=sys.stderr)
        return 2
    os.environ.update(server_env(workdir, args.port))
    os.environ.setdefault("LANEFLOW_HOME", str(workdir / "home"))

    # Prefect reads its settings when first imported: only now, with the server's address in place.
    from flows.params import DataSource
    from flows.serving import ensure_local_setup
    from flows.train import train_pipeline

    # As the benchmark ships it (made offline): TuSimple's train_set.zip, test_set.zip and test_label.json, or
    # CULane's archive per driver folder, its labels' and its lists'.
    make = culane_artifacts if args.dataset == "culane" else cached_artifacts
    artifacts = make(workdir / "source", args.train, args.val, args.test, args.seed)
    ensure_local_setup()  # one training at a time on this machine (the `gpu` limit), a process work pool
    volume_name = "demo" if args.dataset == "tusimple" else f"demo-{args.dataset}"
    state = train_pipeline(source=DataSource(artifacts=artifacts), preset="cpu-demo", epochs=args.epochs,
                           workers=args.workers, volume=volume_name, return_state=True)
    result = state.result(raise_on_failure=False)
    flow_run_id = state.state_details.flow_run_id
    print()
    print(f"flow run        : {state.name}  {ui_url(api, str(flow_run_id))}")
    if not state.is_completed():
        print(f"error           : {result}")
        return 1
    metrics = result["metrics"]
    volume = Path(os.environ["LANEFLOW_HOME"]) / "volumes" / result["volume"]
    print(f"run             : {result['run']} (volume {result['volume']}, snapshot {result['snapshot']})")
    print(f"dataset version : {result['dataset_version']}")
    print(f"training        : {result['steps']} steps")
    if metrics.get("metric") == "culane":
        print_culane_figures(metrics)
        print(f"model package   : {volume / result['package']}  (and {volume / result['package']}.tar.gz)")
        print(f"Prefect UI      : {api.removesuffix('/api')}  (sign in with the string in "
              f"{workdir / 'prefect' / AUTH_FILE}; the server keeps running; `make stop-server` stops it)")
        return 0
    print(f"{metrics['split']:<5} metrics   : accuracy {metrics['untimed_accuracy']:.4f} ({metrics['accuracy']:.4f} "
          f"official: {metrics['over_time_limit']} of {metrics['images']} images over 200 ms), "
          f"FP {metrics['untimed_fp']:.4f}, FN {metrics['untimed_fn']:.4f}")
    print(f"model package   : {volume / result['package']}  (and {volume / result['package']}.tar.gz)")
    print(f"lineage         : LANEFLOW_HOME={os.environ['LANEFLOW_HOME']} PREFECT_API_URL={api} "
          f"PREFECT_API_AUTH_STRING=$(cat {workdir / 'prefect' / AUTH_FILE}) "
          f".venv/bin/laneflow lineage {result['snapshot'] or result['run']}")
    code = predict_on_video(workdir, volume, result)
    print(f"Prefect UI      : {api.removesuffix('/api')}  (sign in with the string in "
          f"{workdir / 'prefect' / AUTH_FILE}; the server keeps running; `make stop-server` stops it)")
    return code


def print_culane_figures(metrics: dict) -> None:
    """The official CULane figures of the evaluation, per scenario (F1 at IoU 0.5; the crossroads' false
    positives, as they have no lanes)."""
    counts = metrics["counts"]
    print(f"{metrics['split']:<5} metrics   : F1 {percent(counts['f1'])} (precision {percent(counts['precision'])}, "
          f"recall {percent(counts['recall'])}; TP {counts['tp']}, FP {counts['fp']}, FN {counts['fn']}) over "
          f"{counts['images']} frames")
    for name, figures in metrics.get("scenarios", {}).items():
        figure = f"FP {figures['fp']}" if name == "cross" else f"F1 {percent(figures['f1'])}"
        print(f"  {name:<13} : {figure}  ({figures['images']} frames)")


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}"


def predict_on_video(workdir: Path, volume: Path, result: dict) -> int:
    """`laneflow predict` on a short video of the first test frames; its lines scored against the frames'
    ground truth, beside the evaluation stage's score of the same frames."""
    from training.data.synthetic import labelled_video
    from training.metric import parse_ground_truth, score_files, score_predictions

    data_root = volume / result["data_dir"]
    video = workdir / "video" / "drive.avi"
    truth = labelled_video(data_root, "test_label.json", video, count=VIDEO_FRAMES)
    out = workdir / "predictions" / result["run"]
    command = [str(Path(sys.executable).parent / "laneflow"), "predict", str(video), "--model", result["run"],
               "--volume", result["volume"], "--out", str(out)]
    print(f"predict         : {' '.join(command[1:])}")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"error           : laneflow predict failed:\n{done.stderr[-2000:]}")
        return 1
    video_score = score_files(out / "predictions.json", truth)
    # The evaluation stage's own prediction lines for those frames (the video's frames are those images).
    frames = [json.loads(line)["raw_file"] for line in
              (data_root / "test_label.json").read_text().splitlines()[:VIDEO_FRAMES]]
    stage_lines = [line for line in (volume / result["run_dir"] / "predictions_test.json").read_text().splitlines()
                   if json.loads(line)["raw_file"] in frames]
    stage_truth = {name: record for name, record in
                   parse_ground_truth((data_root / "test_label.json").read_text().splitlines()).items()
                   if name in frames}
    stage_score = score_predictions(stage_lines, stage_truth)
    print(f"overlay video   : {out / (video.stem + '.overlay.mp4')}  (prediction lines: {out / 'predictions.json'})")
    print(f"video accuracy  : {video_score.untimed.accuracy:.4f} on its {video_score.images} frames; the evaluation "
          f"stage on the same frames: {stage_score.untimed.accuracy:.4f}")
    return 0 if video_score.untimed == stage_score.untimed else 1


if __name__ == "__main__":
    sys.exit(main())
