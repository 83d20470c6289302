"""Accuracy at equal steps: bf16 + channels-last against fp32 + contiguous, over several seeds, on this CPU.

Trains the recipe of ``tests/test_learning.py`` (synthetic TuSimple, 64 train / 16 val at 640x360,
``cpu-demo``, 10 epochs of batch 4: 160 steps) once per seed in each numeric setting and scores val. The
spread of fp32's val accuracy from seed to seed is the noise any change of numerics must be judged
against; the test's tolerance comes from these figures (docs/performance.md).

    .venv/bin/python bench/precision_parity.py [--seeds 0 1 2] [--workdir .laneflow/bench-parity]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.data.preprocess import preprocess
from training.data.synthetic import generate

SETTINGS = {"fp32/contiguous": ("fp32", "contiguous"), "bf16/channels_last": ("bf16", "channels_last")}


def train(data: Path, run_dir: Path, seed: int, precision: str, layout: str) -> dict:
    cmd = [sys.executable, "-m", "training.train", "--data-root", str(data), "--run-dir", str(run_dir),
           "--preset", "cpu-demo", "--set", "epochs=10", "--set", "batch_size=4", "--set", "log_every=40",
           "--set", f"seed={seed}", "--set", f"precision={precision}", "--set", f"memory_format={layout}",
           "--set", "eval_split=val"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if done.returncode != 0:
        raise SystemExit(f"training failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "eval.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workdir", type=Path, default=Path(".laneflow/bench-parity"))
    args = parser.parse_args(argv)
    data = args.workdir / "tusimple"
    if not (data / "manifest.json").exists():
        generate(data, train=64, val=16, test=0, seed=5, width=640, height=360)
        preprocess(data, workers=1)
    accuracy: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for seed in args.seeds:
        for name, (precision, layout) in SETTINGS.items():
            result = train(data, args.workdir / f"run-{name.replace('/', '-')}-{seed}", seed, precision, layout)
            accuracy[name].append(result["accuracy"])
            print(f"seed {seed} {name:<20} val accuracy {result['accuracy']:.4f} (FP {result['fp']:.4f}, "
                  f"FN {result['fn']:.4f})", flush=True)
    fp32, bf16 = accuracy["fp32/contiguous"], accuracy["bf16/channels_last"]
    gaps = [abs(a - b) for a, b in zip(fp32, bf16, strict=True)]
    print(f"\nfp32/contiguous    : mean {statistics.mean(fp32):.4f}, seed-to-seed range {max(fp32) - min(fp32):.4f}")
    print(f"bf16/channels_last : mean {statistics.mean(bf16):.4f}, seed-to-seed range {max(bf16) - min(bf16):.4f}")
    print(f"same seed, |bf16 - fp32|: largest {max(gaps):.4f}, mean {statistics.mean(gaps):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
