"""Horovod scaling on this machine: ``horovodrun -np 2`` (one thread each) against two baselines, same
per-process batch.

Runs the real trainer (``cpu-demo``) on a synthetic set and compares the aggregate img/s the trainer
reports after its warm-up steps. Baselines, both printed:
- ``-np 1`` with one thread: the same process as each of the two ranks, so the ratio is Horovod's scaling;
- ``-np 1`` with as many threads as the machine has cores: what a user who never heard of Horovod gets
  from the same cores, so the ratio is what running two processes actually buys on this machine.
Also runs two unconnected single-process trainers side by side: their sum is what the machine itself
allows (shared memory bandwidth), so the gap between it and ``-np 2`` is what Horovod's communication costs.

This machine's speed drifts by +-20% from minute to minute, so one set of runs proves little: the bench
interleaves ``--rounds`` rounds and reports every round's ratios and their medians.

    .venv/bin/python bench/scaling.py [--steps 30] [--batch-size 8] [--rounds 3]
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
from pathlib import Path

from tasks.processes import run_to_end
from training.data.preprocess import preprocess
from training.data.synthetic import generate

BIN = Path(sys.executable).parent


def trainer_cmd(data: Path, run_dir: Path, steps: int, batch_size: int) -> list[str]:
    return [sys.executable, "-m", "training.train", "--data-root", str(data), "--run-dir", str(run_dir),
            "--preset", "cpu-demo", "--set", f"batch_size={batch_size}", "--set", "num_workers=0",
            "--set", f"max_steps={steps}", "--set", "epochs=1000", "--set", "log_every=10",
            "--set", "checkpoint_every=100000", "--set", "eval_split=test"]


CORES = os.cpu_count() or 1


def env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


def steady_rate(stdout: str) -> float:
    rates = [json.loads(re.sub(r"^\[\d+\]<stdout>:", "", line))["img_per_s"]
             for line in stdout.splitlines() if '"event": "step"' in line]
    steady = rates[1:]  # the first window includes start-up
    return sum(steady) / len(steady)


def images_per_second(data: Path, run_dir: Path, processes: int, steps: int, batch_size: int,
                      threads: int = 1) -> float:
    cmd = [str(BIN / "horovodrun"), "-np", str(processes), "-H", f"localhost:{processes}", "--gloo",
           *trainer_cmd(data, run_dir, steps, batch_size)]
    done = run_to_end(cmd, 1800, env=env(threads))
    if done.returncode != 0:
        raise SystemExit(f"horovodrun -np {processes} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return steady_rate(done.stdout)


def independent_pair(data: Path, tmp: Path, steps: int, batch_size: int) -> float:
    """Two unconnected single-process trainers at once: the machine's own ceiling for this workload."""
    runs = [subprocess.Popen(trainer_cmd(data, tmp / f"alone{i}", steps, batch_size), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env(1)) for i in range(2)]
    return sum(steady_rate(run.communicate(timeout=1800)[0]) for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("baselines: horovodrun -np 1 with 1 thread (each rank's own process alone: Horovod's scaling) and "
          f"-np 1 with {CORES} threads (one process using every core: what two processes buy over one)")
    print(f"cpu-demo, batch {args.batch_size} per process, 1 thread per rank, {args.steps} steps, "
          f"{args.rounds} interleaved rounds, {CORES} cores")
    ratios, against_all_cores, ceilings = [], [], []
    with tempfile.TemporaryDirectory(prefix="laneflow-scaling-") as tmp:
        data = Path(tmp) / "tusimple"
        generate(data, train=2 * args.batch_size * args.steps, val=0, test=8, seed=0)
        preprocess(data)
        for round_no in range(1, args.rounds + 1):
            work = Path(tmp) / f"round{round_no}"
            one = images_per_second(data, work / "np1", 1, args.steps, args.batch_size)
            all_cores = images_per_second(data, work / "np1-all", 1, args.steps, args.batch_size, threads=CORES)
            two = images_per_second(data, work / "np2", 2, args.steps, args.batch_size)
            ceiling = independent_pair(data, work, args.steps, args.batch_size)
            ratios.append(two / one)
            against_all_cores.append(two / all_cores)
            ceilings.append(ceiling / one)
            print(f"round {round_no}: -np 1 x1 thread {one:6.1f} img/s | -np 1 x{CORES} threads {all_cores:6.1f} img/s "
                  f"| -np 2 {two:6.1f} img/s | ratio {two / one:.2f}x (vs 1 thread), {two / all_cores:.2f}x (vs "
                  f"{CORES} threads) | two independent trainers {ceiling:6.1f} img/s = {ceiling / one:.2f}x",
                  flush=True)
    print(f"median ratio -np 2 / -np 1 (1 thread)   : {statistics.median(ratios):.2f}x  (target >= 1.8x)")
    print(f"median ratio -np 2 / -np 1 ({CORES} threads)  : {statistics.median(against_all_cores):.2f}x  "
          "(what a second process buys over one process on every core)")
    print(f"median machine ceiling                 : {statistics.median(ceilings):.2f}x  "
          "(two unconnected trainers, no communication at all)")


if __name__ == "__main__":
    main()
