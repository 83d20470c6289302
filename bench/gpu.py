"""GPU training throughput of the ``tusimple`` preset: precision x memory format, one short script.

    python bench/gpu.py --json gpu.json           # on a GPU machine: well under 5 minutes
    python bench/gpu.py --dry-run                 # on CPUs: every code path, tiny sizes, under a minute

Generates a synthetic TuSimple set, builds the decoded-sample cache first (the timed loops read a warm
cache, as every epoch after the first does), then for each of fp32 / bf16 (when the GPU supports it) /
fp16 with a gradient scaler, times the trainer's own step (``training.step.train_step``: uint8 batches
moved without blocking and normalised on the device) with contiguous and channels-last tensors. Per
configuration: img/s after warm-up, the input stall (the share of wall time spent waiting for the
loader), the peak GPU memory, and the step against the GPU's own limit: the step's FLOPs (PyTorch's flop
counter) over its time, as a share of the GPU's matrix-product rate in that dtype measured in the same run
(sampled before and after the loops, the best sample counting; a share above 100 % exits 3, ``"valid": false``).
``--compile`` also times each configuration through ``torch.compile`` (and reports its compile time): the
measurement ``compile: auto`` waits for on GPUs. Prints one JSON line per configuration and a table;
``--json`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.limits import FlopsByDtype, GemmLimit, over_limit
from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.dataset import LaneDataset, make_loader
from training.model import SCNN, model_config
from training.models import get_model
from training.precision import Device, MixedPrecision
from training.step import train_step


def configurations(device: Device) -> list[tuple[str, str]]:
    precisions = ["fp32", *(["bf16"] if device.bf16 or device.type == "cpu" else []), "fp16"]
    return [(p, m) for p in precisions for m in ("contiguous", "channels_last")]


def measure(preset: str, loader, device: torch.device, precision: str, layout: str, warmup: int,
            steps: int, compiled: bool = False) -> dict:
    config = model_config(preset)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    model = SCNN(config).to(device).train()  # weights contiguous, as the trainer keeps them (Horovod)
    network = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    mixed = MixedPrecision(precision, device.type)
    criterion = get_model("scnn").criterion(config)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    done = images = 0
    waited = 0.0
    started = None
    first_step_s = None
    loss = torch.zeros(())
    while done < warmup + steps:
        fetch = time.perf_counter()
        for batch, masks, exist in loader:
            if started is not None:
                waited += time.perf_counter() - fetch
            step_started = time.perf_counter()
            loss, _ = train_step(network, batch, masks, exist, criterion, optimizer, mixed, memory_format,
                                 distributed=False)
            if first_step_s is None:  # with --compile: the compile itself
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_step_s = time.perf_counter() - step_started
            done += 1
            if done == warmup:  # kernels chosen (cudnn.benchmark), allocator warm: start the clock
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started, waited, images = time.perf_counter(), 0.0, 0
            elif started is not None:
                images += batch.shape[0]
            if done >= warmup + steps:
                break
            fetch = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {"preset": preset, "precision": precision, "memory_format": layout, "compiled": compiled,
            "first_step_s": round(first_step_s or 0.0, 2), "step_s": elapsed / max(1, steps),
            "img_per_s": round(images / elapsed, 2), "input_stall": round(waited / elapsed, 4),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            if device.type == "cuda" else None, "final_loss": round(float(loss), 4)}


def step_gflop(preset: str, device: torch.device, batch_size: int) -> float:
    """The step's GFLOP (fp32 forward and backward, PyTorch's flop counter)."""
    config = model_config(preset)
    model = SCNN(config).to(device).train()
    images = torch.randint(0, 256, (batch_size, config.input_height, config.input_width, 3), dtype=torch.uint8)
    masks = torch.randint(0, 5, (batch_size, config.input_height, config.input_width), dtype=torch.uint8)
    exist = torch.randint(0, 2, (batch_size, 4)).float()
    counter = FlopsByDtype()
    with counter:
        train_step(model, images, masks, exist, get_model("scnn").criterion(config),
                   torch.optim.SGD(model.parameters(), lr=1e-3), MixedPrecision("fp32", device.type),
                   torch.contiguous_format, distributed=False)
    return sum(counter.flops.values()) / 1e9


def gemm_limit(device: torch.device, found: Device, dry_run: bool) -> GemmLimit:
    """The device's GEMM rate per dtype, sampled before and after the timed loops (the best sample is the limit)."""
    dtypes = ("fp32", *(("bf16",) if found.bf16 or device.type == "cpu" else ()), "fp16")
    return GemmLimit(dtypes, device, (256,) if dry_run else (4096, 8192), repeats=2 if dry_run else 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compile", action="store_true", help="also time each configuration compiled")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, cpu-demo at 320x180, 1 timed step per configuration: exercises every path")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, preset, size = torch.device("cpu"), "cpu-demo", (320, 180)
        args.images, args.batch_size, args.warmup, args.steps, args.workers = 8, 2, 1, 1, 0
    elif torch.cuda.is_available():
        device, preset, size = torch.device("cuda:0"), "tusimple", (1280, 720)
        torch.backends.cudnn.benchmark = True
    else:
        print("no CUDA device: run this on a machine with a GPU, or pass --dry-run", file=sys.stderr)
        return 2
    found = Device.of(device)
    config = model_config(preset)
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "batch_size": args.batch_size, "preset": preset}
    print(json.dumps(header), flush=True)
    results = []
    limit = gemm_limit(device, found, args.dry_run)
    limit.sample()
    with tempfile.TemporaryDirectory(prefix="laneflow-gpu-") as tmp:
        root = Path(tmp) / "tusimple"
        generate(root, train=args.images, val=0, test=0, seed=0, width=size[0], height=size[1])
        preprocess(root)
        built = time.perf_counter()
        dataset = LaneDataset(root, "train", (config.input_width, config.input_height), augment=True, cache=True)
        header["cache_build_s"] = round(time.perf_counter() - built, 2)
        loader = make_loader(dataset, args.batch_size, None, args.workers, pin_memory=device.type == "cuda")
        for precision_name, layout in configurations(found):
            for compiled in (False, True) if args.compile else (False,):
                result = measure(preset, loader, device, precision_name, layout, args.warmup, args.steps, compiled)
                results.append(result)
                print(json.dumps(result), flush=True)
    limit.sample()
    header["step_gflop"] = step_gflop(preset, device, args.batch_size)
    header["gemm_tflops"] = {dtype: round(rate, 3) for dtype, rate in limit.best().items()}
    header["gemm_samples"] = limit.record()
    for result in results:
        result["tflops"] = round(header["step_gflop"] / 1000 / result["step_s"], 3)
        result["share_of_gemm"] = round(result["tflops"] / header["gemm_tflops"][result["precision"]], 3)
    fp32 = next(r["img_per_s"] for r in results if r["precision"] == "fp32" and r["memory_format"] == "contiguous"
                and not r["compiled"])
    print("\nbaseline: fp32 with the contiguous memory format: the same trainer step, loader, batch and device")
    print(f"step: {header['step_gflop']:.0f} GFLOP; GEMM rate: " + ", ".join(
        f"{d} {r:.1f} TFLOP/s" for d, r in header["gemm_tflops"].items()))
    print(f"{'precision':<10}{'memory format':<16}{'compiled':>9}{'img/s':>9}{'vs fp32':>9}{'TFLOP/s':>9}"
          f"{'of GEMM':>9}{'input stall':>13}{'peak GiB':>10}{'1st step s':>12}")
    for r in results:
        memory = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{r['precision']:<10}{r['memory_format']:<16}{'yes' if r['compiled'] else 'no':>9}"
              f"{r['img_per_s']:>9.1f}{r['img_per_s'] / fp32:>8.2f}x{r['tflops']:>9.2f}"
              f"{100 * r['share_of_gemm']:>8.0f}%"
              f"{100 * r['input_stall']:>12.1f}%{memory:>10}{r['first_step_s']:>12.1f}")
    # The dry run's tiny GEMMs measure nothing like a limit: its shares are not checked.
    problems = [] if args.dry_run else over_limit(
        {f"{r['precision']}/{r['memory_format']}{' compiled' if r['compiled'] else ''}": r["share_of_gemm"]
         for r in results}, limit)
    header["valid"], header["problems"] = not problems, problems
    if args.json:
        args.json.write_text(json.dumps({**header, "results": results}, indent=2))
    if problems:
        print("\nINVALID: a figure claims more than this GPU's limit:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
