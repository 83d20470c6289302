"""GPU throughput of the ``tusimple`` preset: img/s in fp32 and with AMP (bf16), and the input stall.

For a lent accelerator (the project never needs one). Generates a synthetic set, feeds it through the
real input pipeline (pinned memory, loader workers) and times training steps on ``cuda:0``.

    python bench/gpu.py [--images 256] [--batch-size 16] [--steps 30] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.dataset import LaneDataset, make_loader, normalize
from training.model import SCNN, SCNNLoss, model_config


def measure(model: SCNN, loader, steps: int, amp: bool, device: torch.device) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    criterion = SCNNLoss()
    done = waited = images = 0
    started = None
    while done < steps:
        fetch = time.perf_counter()
        for batch, masks, exist in loader:
            if started is not None:
                waited += time.perf_counter() - fetch
            batch = normalize(batch.to(device, non_blocking=True))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                logits, existence = model(batch)
            loss, _ = criterion(logits.float(), existence.float(), masks.to(device), exist.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            done += 1
            if done == 5:  # warm-up steps excluded
                torch.cuda.synchronize()
                started, waited, images = time.perf_counter(), 0.0, 0
            elif started is not None:
                images += batch.shape[0]
            if done >= steps:
                break
            fetch = time.perf_counter()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {"amp": amp, "img_per_s": images / elapsed, "input_stall": waited / elapsed,
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a machine with a GPU")
    device = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    config = model_config("tusimple")
    with tempfile.TemporaryDirectory(prefix="laneflow-gpu-") as tmp:
        root = Path(tmp) / "tusimple"
        generate(root, train=args.images, val=0, test=0, seed=0)
        preprocess(root)
        dataset = LaneDataset(root, "train", (config.input_width, config.input_height), augment=True)
        loader = make_loader(dataset, args.batch_size, None, args.workers, pin_memory=True)
        for amp in (False, True):
            torch.manual_seed(0)
            model = SCNN(config).to(device).train()
            print(json.dumps({"device": torch.cuda.get_device_name(0), "batch_size": args.batch_size,
                              **measure(model, loader, args.steps, amp, device)}))


if __name__ == "__main__":
    main()
