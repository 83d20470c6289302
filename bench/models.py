"""SCNN against the row-anchor detector (``ufld``), side by side in one run on this machine: parameters,
inference images/s of each model's deployable module at the same input size (batch 1 and 8), and training on
synthetic TuSimple to a fixed val accuracy — the steps and seconds each needs.

    .venv/bin/python bench/models.py [--size 800x288] [--target 0.6] [--max-steps 600]
    make bench-models

Inference: random weights (speed does not depend on them), uint8 BGR batches through the module a package
exports (normalisation and, for ufld, its decoding inside), eager PyTorch in fp32 without gradients; warmed up,
img/s the median over rounds. Training: ``python -m training.train`` with the ``cpu-demo`` preset of each model
(its own input size), scored on val every ``--eval-every`` steps, one process; "reached" is the first val score
at or over the target without the 200 ms rule, seconds from the run's start event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.model import count_parameters
from training.models import get_model

MODELS = ("scnn", "ufld")


def inference(name: str, width: int, height: int, batch: int, rounds: int = 3, batches: int = 3) -> float:
    """img/s of model ``name``'s deployable module at ``width`` x ``height`` (its ``tusimple`` preset's network)."""
    model = get_model(name)
    settings = model.settings("tusimple", input_width=width, input_height=height)
    torch.manual_seed(0)
    deployed = model.deployed(model.network(settings).eval()).eval()
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (batch, height, width, 3), dtype=np.uint8))
    with torch.no_grad():
        deployed(images)  # warm-up
        per_round = []
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(batches):
                deployed(images)
            per_round.append(batch * batches / (time.perf_counter() - started))
    return statistics.median(per_round)


def parameters(name: str, width: int, height: int) -> int:
    model = get_model(name)
    return count_parameters(model.network(model.settings("tusimple", input_width=width, input_height=height)))


def train_to(name: str, data: Path, workdir: Path, target: float, max_steps: int, eval_every: int) -> dict:
    """Train ``name`` (cpu-demo) until the end of ``max_steps``; when its val score first reached ``target``."""
    run_dir = workdir / f"{name}-{int(time.time())}"
    cmd = [sys.executable, "-m", "training.train", "--data-root", str(data), "--run-dir", str(run_dir),
           "--preset", "cpu-demo", "--set", f"model={name}", "--set", f"max_steps={max_steps}",
           "--set", "epochs=1000", "--set", f"eval_every={eval_every}", "--set", "log_every=50",
           "--set", "num_workers=0"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"training {name} failed: {done.stderr[-2000:]}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next(event["time"] for event in events if event["event"] == "start")
    scores = [event for event in events if event["event"] in ("val", "eval")]
    reached = next((event for event in scores if event.get("untimed_accuracy", event["accuracy"]) >= target), None)
    best = max(event.get("untimed_accuracy", event["accuracy"]) for event in scores)
    return {"steps": reached["step"] if reached else None,
            "seconds": round(reached["time"] - start, 1) if reached else None, "best": round(best, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="800x288", help="inference input size, WIDTHxHEIGHT (UFLD's and CULane's)")
    parser.add_argument("--target", type=float, default=0.6, help="val accuracy (untimed) to train to")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=Path(".laneflow/bench-models"))
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    width, height = (int(value) for value in args.size.split("x"))
    figures: dict[str, dict] = {}
    for name in MODELS:
        figures[name] = {"parameters": parameters(name, width, height),
                         "img_per_s_batch_1": round(inference(name, width, height, 1), 2),
                         "img_per_s_batch_8": round(inference(name, width, height, 8), 2)}
    if not args.skip_training:
        data = args.workdir / "synthetic-200-30"
        if not (data / "manifest.json").exists():
            generate(data, train=200, val=30, test=10, seed=5)
            preprocess(data)
        for name in MODELS:
            figures[name]["training"] = train_to(name, data, args.workdir, args.target, args.max_steps,
                                                 args.eval_every)
    base = figures["scnn"]
    print(f"# Models on this machine ({torch.get_num_threads()} threads), inference at {width}x{height}")
    print("| model | parameters | img/s batch 1 | img/s batch 8 | x SCNN (batch 8) | steps to val "
          f"{args.target:g} | seconds to it | best val |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in figures.items():
        trained = row.get("training") or {}
        print(f"| {name} | {row['parameters']:,} | {row['img_per_s_batch_1']:.2f} | {row['img_per_s_batch_8']:.2f} | "
              f"{row['img_per_s_batch_8'] / base['img_per_s_batch_8']:.1f} | {trained.get('steps', '—')} | "
              f"{trained.get('seconds', '—')} | {trained.get('best', '—')} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
