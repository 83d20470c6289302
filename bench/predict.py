"""Inference speed of a model package's three backends — eager PyTorch, TorchScript, ONNX Runtime — for
both presets, side by side in one run, with their ratios to eager.

    .venv/bin/python bench/predict.py                 # this machine's CPUs
    python bench/predict.py --device cuda --json out.json

The models have random weights (speed does not depend on them); inputs are uint8 BGR batches at each
preset's input size, through the same deployable module a package exports. Each backend is warmed up,
then timed over whole batches; img/s is the median over rounds. ``laneflow predict`` picks its default
backend per device from these figures (``training.predict.FASTEST_BACKEND``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.model import SCNN, model_config
from training.package import BACKENDS, export_models, open_backend, runs_on_gpu

#: (batch, rounds, batches per round) per preset and device kind: enough work to time, little enough for CPUs.
WORKLOAD = {("cpu-demo", "cpu"): (8, 5, 4), ("tusimple", "cpu"): (2, 3, 2),
            ("cpu-demo", "cuda"): (32, 3, 10), ("tusimple", "cuda"): (8, 3, 5)}


def measure(preset: str, device: str) -> tuple[dict[str, float], dict[str, str]]:
    """img/s per backend, and where each backend actually ran (torch device or ONNX Runtime provider)."""
    config = model_config(preset)
    torch.manual_seed(0)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    batch, rounds, batches = WORKLOAD[(preset, kind)]
    images = np.random.default_rng(0).integers(0, 256, (batch, config.input_height, config.input_width, 3),
                                               dtype=np.uint8)
    speeds, runs_on = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        export_models(SCNN(config), config, Path(folder))
        for name in BACKENDS:
            run = open_backend(Path(folder), config, name, device)
            runs_on[name] = run.runs_on
            run(images)  # warm-up: kernels chosen, graphs built
            run(images)
            per_round = []
            for _ in range(rounds):
                started = time.perf_counter()
                for _ in range(batches):
                    run(images)  # returns numpy: the device work is finished when it returns
                per_round.append(batch * batches / (time.perf_counter() - started))
            speeds[name] = statistics.median(per_round)
    return speeds, runs_on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--presets", nargs="+", default=["cpu-demo", "tusimple"])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    results, where = {}, {}
    on_gpu = args.device.startswith("cuda")
    print(f"baseline: eager PyTorch on {args.device}; each row says where it really ran")
    for preset in args.presets:
        speeds, runs_on = measure(preset, args.device)
        results[preset], where[preset] = speeds, runs_on
        eager = speeds["eager"]
        print(f"{preset:<9} ({args.device})")
        for name, value in speeds.items():
            fell_back = on_gpu and not runs_on_gpu(runs_on[name])
            note = "  ON THE CPU: not a GPU figure" if fell_back else ""
            print(f"  {name:<12} {value:8.1f} img/s   {value / eager:5.2f}x eager   ran on {runs_on[name]}{note}")
        comparable = {n: v for n, v in speeds.items() if not on_gpu or runs_on_gpu(runs_on[n])}
        print(f"  fastest      {max(comparable, key=comparable.get)}")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "img_per_s": results, "ran_on": where}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
