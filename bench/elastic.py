"""What losing a worker costs: elastic training against checkpoint-and-resubmit, in one run on this machine.

Two real runs on the local platform (``horovodrun``, ``cpu-demo``, two workers, one thread each, the same data,
epochs and batch size), in each of which one rank is SIGKILLed once training reaches step ``--lose-at``:
- ``checkpoint-and-resubmit``, a fixed-size run: the job fails and is submitted again as the task's retry does;
  it resumes from its newest checkpoint (every ``checkpoint_every`` steps and at each epoch's end), so every
  step since then is done again, and every rank starts again;
- ``elastic`` (min 1, max 2 workers): the other rank goes back to its last commit (every ``commit_every``
  steps) and trains on alone; the lost host rejoins after the platform's cooldown.

Training time lost per worker loss = the time from the kill until the run trains a step past the one it had
reached (restart or re-forming, and the steps done again; one step's normal time taken off), plus, for elastic,
the pause when the returning worker is taken in (the others wait for it to start and get their state). What the
run then trains with fewer workers is not counted: that is the capacity the lost worker took with it, the same
for both ways once it is gone (a resubmitted job also waits for its replacement on a cluster). Figures come from
the trainer's own time stamps (``metrics.jsonl``). Target: elastic loses at most 25 % of what resubmitting loses.

    .venv/bin/python bench/elastic.py [--train 400] [--epochs 2] [--lose-at 75]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tasks.platforms import LocalPlatform, TrainingInterrupted, TrainingSpec, VolumeRef
from tasks.platforms.base import ElasticWorkers
from training.data.sources import Artifact
from training.data.synthetic import cached_artifacts


def rank_pids(run_dir: Path) -> list[int]:
    """The run's training processes that horovodrun started as rank 1 (any loader workers have no rank env of
    their own to tell them apart, and the bench runs with none)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            parts = cmdline.read_bytes().split(b"\0")
            environ = (cmdline.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.train" in parts and str(run_dir).encode() in parts and b"HOROVOD_RANK=1" in environ:
            found.append(int(cmdline.parent.name))
    return found


def killer(run_dir: Path, at_step: int, killed: list[tuple[float, int]]) -> Callable[[dict], None]:
    """An event sink that SIGKILLs rank 1 once a step event reaches ``at_step`` (once): (when, the step)."""
    def on_event(event: dict) -> None:
        if event.get("event") == "step" and event["step"] >= at_step and not killed:
            pids = rank_pids(run_dir)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            if pids:
                killed.append((time.time(), int(event["step"])))
    return on_event


def run_with_a_loss(platform: LocalPlatform, spec: TrainingSpec, lose_at: int) -> tuple[tuple[float, int], int]:
    """Train ``spec`` to its end, a worker killed at ``lose_at``, resubmitting as a retry would: ((when the worker
    was killed, the step reached), attempts)."""
    run_dir = platform.inside(spec.volume, spec.run_dir)
    killed: list[tuple[float, int]] = []
    on_event, attempts = killer(run_dir, lose_at, killed), 0
    while True:
        attempts += 1
        try:
            platform.wait_for_training(platform.submit_training(spec), on_event, lambda _: None, timeout_s=3600)
            break
        except TrainingInterrupted:
            if attempts >= 3:
                raise
    if not killed:
        raise RuntimeError(f"{spec.job_name}: training ended before step {lose_at}; lower --lose-at")
    return killed[0], attempts


def time_lost(events: list[dict], killed_at: float, reached: int) -> tuple[float, float]:
    """(seconds from the kill until a step past ``reached`` was trained, less one normal step; the pause when a
    worker was taken back in, less one normal step — 0 when none was)."""
    steps = [event for event in events if event["event"] == "step"]
    normal = statistics.median(float(event["seconds"]) for event in steps if event["time"] < killed_at)
    back = next(event for event in steps if event["time"] > killed_at and event["step"] > reached)
    recovered = float(back["time"]) - killed_at - normal
    joined = next((event for event in events if event["event"] == "workers" and event.get("joined")), None)
    if joined is None:
        return recovered, 0.0
    before = max(event["time"] for event in steps if event["time"] <= joined["time"])
    after = min(event["time"] for event in steps if event["time"] > joined["time"])
    return recovered, max(0.0, float(after) - float(before) - normal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=400, help="training images (an epoch is train/4 steps)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lose-at", type=int, default=75, help="the step at which a worker is lost")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="cpu-demo's default")
    parser.add_argument("--commit-every", type=int, default=10, help="the elastic default")
    parser.add_argument("--cooldown", type=int, default=1, help="the local platform's elastic_cooldown_min_s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laneflow-bench-elastic-") as folder:
        home = Path(folder)
        os.environ["LANEFLOW_HOME"] = str(home / "laneflow")
        platform = LocalPlatform(elastic_cooldown_min_s=args.cooldown, elastic_cooldown_max_s=max(args.cooldown, 60))
        volume = platform.ensure_volume("bench")
        artifacts = [Artifact(item["url"], item["sha256"], item["kind"])
                     for item in cached_artifacts(home / "source", train=args.train, val=8, test=8)]
        data_dir = platform.prepare_dataset(volume, artifacts, lambda _: None)["dataset_dir"]
        settings = {"epochs": str(args.epochs), "batch_size": "2", "num_workers": "0", "log_every": "1",
                    "checkpoint_every": str(args.checkpoint_every)}
        print(f"{args.train} training images, {args.epochs} epoch(s), batch 2 on each of 2 workers; a worker lost at "
              f"step {args.lose_at}; checkpoints every {args.checkpoint_every} steps and at each epoch's end, "
              f"elastic commits every {args.commit_every}, cooldown from {args.cooldown} s", flush=True)
        lost: dict[str, float] = {}
        for name, extra, bounds in (
                ("checkpoint-and-resubmit", {}, None),
                ("elastic", {"elastic": "1", "commit_every": str(args.commit_every)},
                 ElasticWorkers(min_workers=1, max_workers=2, commit_every=args.commit_every))):
            job = f"bench-{name}"
            spec = TrainingSpec(job_name=job, volume=VolumeRef(name=volume.name, location=volume.location),
                                data_dir=data_dir, run_dir=f"runs/{job}", preset="cpu-demo", workers=2,
                                settings={**settings, **extra}, elastic=bounds)
            (killed_at, reached), attempts = run_with_a_loss(platform, spec, args.lose_at)
            events = [json.loads(line) for line in
                      (platform.inside(volume, spec.run_dir) / "metrics.jsonl").read_text().splitlines() if line]
            recovered, rejoin = time_lost(events, killed_at, reached)
            lost[name] = recovered + rejoin
            joins = [event for event in events if event["event"] == "workers" and event.get("joined")]
            how = ", a warm spare" if joins and all(e["joined_warm"] == e["joined"] for e in joins) else \
                (", started cold" if joins else "")
            print(f"{name:24s} lost {lost[name]:5.1f} s: back past step {reached} {recovered:5.1f} s after the kill, "
                  f"taking the worker back {rejoin:4.1f} s{how} ({attempts} attempt(s))", flush=True)
        ratio = lost["elastic"] / lost["checkpoint-and-resubmit"]
        print(f"time lost per worker loss: elastic / checkpoint-and-resubmit = {ratio:.2f}  (target <= 0.25)")


if __name__ == "__main__":
    main()
