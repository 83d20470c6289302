"""What losing a worker costs: elastic training against checkpoint-and-resubmit, in one run on this machine.

Four real runs on the local platform (``horovodrun``, ``cpu-demo``, two workers, one thread each), the same
training in each (same data, epochs, batch size):
- ``fixed``: a fixed-size run, undisturbed (the baseline of the next);
- ``fixed, worker lost``: the same, with one rank SIGKILLed at step ``--lose-at``: the job fails, and is
  submitted again as a retry does, resuming from its newest checkpoint (every ``checkpoint_every`` steps and at
  each epoch's end) — everything since then is done again, and every rank starts again;
- ``elastic``: an elastic run (min 1, max 2 workers), undisturbed (the baseline of the next);
- ``elastic, worker lost``: the same, with one rank SIGKILLed at the same step: the other goes back to its last
  commit (every ``commit_every`` steps) and trains on alone until the lost host's cooldown passes and it rejoins.

Time lost per worker loss = the disturbed run's wall time (submit to the end of training, both attempts and the
gap between them for the resubmission) minus its own undisturbed baseline's. It counts the work done again, the
restart or the re-forming of the job, and, for elastic, the training done on one worker instead of two until the
lost one is back — here at once, after the platform's cooldown; on a cluster the resubmission also waits for
its pods to be scheduled and their images, which this machine cannot show. Target: elastic loses at most 25 %
of what resubmitting loses.

    .venv/bin/python bench/elastic.py [--train 400] [--epochs 2] [--lose-at 45]
"""

from __future__ import annotations

import argparse
import os
import signal
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


def killer(run_dir: Path, at_step: int, killed: list[int]) -> Callable[[dict], None]:
    """An event sink that SIGKILLs rank 1 once a step event reaches ``at_step`` (once)."""
    def on_event(event: dict) -> None:
        if event.get("event") == "step" and event["step"] >= at_step and not killed:
            for pid in rank_pids(run_dir):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return on_event


def timed_run(platform: LocalPlatform, spec: TrainingSpec, lose_at: int | None) -> tuple[float, int]:
    """(wall seconds from the first submit to the end of training, attempts)."""
    run_dir = platform.inside(spec.volume, spec.run_dir)
    killed: list[int] = []
    on_event = killer(run_dir, lose_at, killed) if lose_at is not None else (lambda _: None)
    started, attempts = time.perf_counter(), 0
    while True:
        attempts += 1
        try:
            platform.wait_for_training(platform.submit_training(spec), on_event, lambda _: None, timeout_s=3600)
            break
        except TrainingInterrupted:
            if attempts >= 3:
                raise
    if lose_at is not None and not killed:
        raise RuntimeError(f"{spec.job_name}: training ended before step {lose_at}; lower --lose-at")
    return time.perf_counter() - started, attempts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=400, help="training images (an epoch is train/4 steps)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lose-at", type=int, default=45, help="the step at which a worker is lost")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--commit-every", type=int, default=10)
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
        elastic = {"elastic": "1", "commit_every": str(args.commit_every)}
        print(f"{args.train} training images, {args.epochs} epoch(s), batch 2 on each of 2 workers; a worker lost at "
              f"step {args.lose_at}; checkpoints every {args.checkpoint_every} steps and at each epoch's end, "
              f"elastic commits every {args.commit_every}, cooldown from {args.cooldown} s", flush=True)
        walls: dict[str, float] = {}
        for name, extra, bounds, lose_at in (
                ("fixed", {}, None, None), ("fixed, worker lost", {}, None, args.lose_at),
                ("elastic", elastic, ElasticWorkers(min_workers=1, max_workers=2,
                                                    commit_every=args.commit_every), None),
                ("elastic, worker lost", elastic, ElasticWorkers(min_workers=1, max_workers=2,
                                                                 commit_every=args.commit_every), args.lose_at)):
            job = "bench-" + name.replace(", ", "-").replace(" ", "-")
            spec = TrainingSpec(job_name=job, volume=VolumeRef(name=volume.name, location=volume.location),
                                data_dir=data_dir, run_dir=f"runs/{job}", preset="cpu-demo", workers=2,
                                settings={**settings, **extra}, elastic=bounds)
            walls[name], attempts = timed_run(platform, spec, lose_at)
            print(f"{name:22s} wall {walls[name]:7.1f} s  ({attempts} attempt(s))", flush=True)
        resubmit = walls["fixed, worker lost"] - walls["fixed"]
        elastic_lost = walls["elastic, worker lost"] - walls["elastic"]
        print(f"time lost per worker loss: checkpoint-and-resubmit {resubmit:.1f} s, elastic {elastic_lost:.1f} s")
        if resubmit > 0:
            print(f"elastic / resubmit: {elastic_lost / resubmit:.2f}  (target <= 0.25)")
        else:
            print("resubmitting lost no time in this run (the machine's speed varied more than the loss cost); "
                  "run it again")


if __name__ == "__main__":
    main()
