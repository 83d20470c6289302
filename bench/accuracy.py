"""Longer CPU run: train ``cpu-demo`` on synthetic TuSimple and score the held-out test split.

Generates a synthetic set (default 400 train / 50 val / 100 test at 1280x720), prepares it, trains
with ``python -m training.train`` and reports the TuSimple metric on the test split, which training
never sees. Takes ~10 minutes on 2 CPU cores.

    .venv/bin/python bench/accuracy.py [--train 400] [--epochs 15] [--workdir .laneflow/bench-accuracy]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from training.data.preprocess import preprocess
from training.data.synthetic import generate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--val", type=int, default=50)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path(".laneflow/bench-accuracy"))
    args = parser.parse_args()
    data = args.workdir / f"synthetic-{args.seed}-{args.train}-{args.val}-{args.test}"
    if not (data / "manifest.json").exists():
        generate(data, train=args.train, val=args.val, test=args.test, seed=args.seed)
        preprocess(data)
    run_dir = args.workdir / f"run-{args.epochs}ep-{int(time.time())}"
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "training.train", "--data-root", str(data), "--run-dir", str(run_dir),
           "--preset", "cpu-demo", "--set", f"epochs={args.epochs}", "--set", "eval_split=test",
           "--set", "log_every=50"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(done.stdout)
        return done.returncode
    evaluation = json.loads((run_dir / "eval.json").read_text())
    minutes = (time.perf_counter() - started) / 60
    print(f"train images {args.train}, epochs {args.epochs}, {minutes:.1f} min on this machine")
    print(f"held-out test split ({evaluation['images']} images): accuracy {evaluation['accuracy']:.4f}, "
          f"FP {evaluation['fp']:.4f}, FN {evaluation['fn']:.4f}, {evaluation['run_time_ms']:.1f} ms/image")
    print(f"run dir: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
