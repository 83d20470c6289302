"""One training step of a preset against this machine's own limit, for every precision and memory format.

In one run, on this machine:

1. its GEMM rate per dtype: ``torch.mm`` of large square matrices in fp32 and bf16, best of several — the
   most FLOP/s this machine's matrix units give PyTorch;
2. the step's FLOPs (forward and backward), by PyTorch's flop counter's formulas, and the share of them each
   dtype computed: under bf16 every convolution and matrix product should be bf16 (an fp32 share is a
   silent fallback in the hot loop);
3. each precision x memory format: ms/step (the trainer's own step, ``training.step.train_step``), the
   achieved TFLOP/s and its share of that dtype's GEMM rate, and the ratio to fp32/contiguous;
4. what ``precision: auto`` / ``memory_format: auto`` resolve to here (the trainer's own calibration) and
   that step's ratio to fp32/contiguous (target >= 3x on CPUs with native bf16);
5. the profiler's top ops of the ``auto`` step;
6. laneflow's message passing against the textbook per-slice loop, in the ``auto`` numerics (target >= 1.0x).

    .venv/bin/python bench/train_step.py [--preset tusimple] [--batch-size 2] [--steps 4] [--skip-loop]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.limits import FlopsByDtype, gemm_tflops, timed
from training.calibration import calibrate, step_seconds
from training.cpu_features import this_cpu
from training.model import MessagePassing
from training.models import get_model
from training.precision import Device, MixedPrecision, label, resolve
from training.step import train_step

COMBOS = [(p, f) for p in ("fp32", "bf16") for f in ("contiguous", "channels_last")]


def batch_for(settings, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    height, width = settings.input_height, settings.input_width
    return (torch.randint(0, 256, (batch_size, height, width, 3), dtype=torch.uint8),
            torch.randint(0, 5, (batch_size, height, width), dtype=torch.uint8),
            torch.randint(0, 2, (batch_size, 4)).float())


def step_flops(lane_model, settings, combo: tuple[str, str], batch_size: int) -> dict[str, int]:
    """One training step's FLOPs in ``combo``, by dtype."""
    network = lane_model.network(settings).train()
    optimizer = torch.optim.SGD(network.parameters(), lr=1e-3)
    counter = FlopsByDtype()
    images, masks, exist = batch_for(settings, batch_size)
    layout = torch.channels_last if combo[1] == "channels_last" else torch.contiguous_format
    with counter:
        train_step(network, images, masks, exist, lane_model.criterion(settings, check_finite=False), optimizer,
                   MixedPrecision(combo[0], "cpu"), layout, distributed=False)
    return dict(counter.flops)


def top_ops(lane_model, settings, combo: tuple[str, str], batch_size: int, count: int = 8) -> str:
    network = lane_model.network(settings).train()
    optimizer = torch.optim.SGD(network.parameters(), lr=1e-3)
    criterion = lane_model.criterion(settings, check_finite=False)
    images, masks, exist = batch_for(settings, batch_size)
    layout = torch.channels_last if combo[1] == "channels_last" else torch.contiguous_format
    mixed = MixedPrecision(combo[0], "cpu")
    train_step(network, images, masks, exist, criterion, optimizer, mixed, layout, distributed=False)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_step(network, images, masks, exist, criterion, optimizer, mixed, layout, distributed=False)
    return profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=count, max_name_column_width=40)


class LoopMessagePassing(nn.Module):
    """Per-slice message passing with a Python list and torch.cat (the common implementation)."""

    def __init__(self, original: MessagePassing):
        super().__init__()
        self.direction = original.direction
        self.weight = original.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vertical = self.direction in ("down", "up")
        dim = 2 if vertical else 3
        slices = [x.narrow(dim, i, 1) for i in range(x.shape[dim])]
        if self.direction in ("up", "left"):
            slices = slices[::-1]
        padding = (0, self.weight.shape[3] // 2) if vertical else (self.weight.shape[2] // 2, 0)
        out = [slices[0]]
        for current in slices[1:]:
            out.append(current + F.relu(F.conv2d(out[-1], self.weight, padding=padding)))
        if self.direction in ("up", "left"):
            out = out[::-1]
        return torch.cat(out, dim=dim)


def loop_comparison(lane_model, settings, combo: tuple[str, str], batch_size: int, steps: int) -> tuple[float, float]:
    """(textbook loop, laneflow) seconds per step of SCNN in ``combo``: best of 2 alternating rounds each."""
    ours = lane_model.network(settings)
    baseline = copy.deepcopy(ours)
    baseline.message_passing = nn.Sequential(*(LoopMessagePassing(m) for m in baseline.message_passing))
    probe = torch.randn(1, 3, settings.input_height, settings.input_width)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(probe)[0], baseline.eval()(probe)[0], rtol=1e-4, atol=1e-4)
    images, masks, exist = batch_for(settings, batch_size)
    layout = torch.channels_last if combo[1] == "channels_last" else torch.contiguous_format
    criterion = lane_model.criterion(settings, check_finite=False)

    def median_step(network: nn.Module) -> float:
        network.train()
        optimizer = torch.optim.SGD(network.parameters(), lr=1e-3, momentum=0.9)
        mixed = MixedPrecision(combo[0], "cpu")
        times = [timed(lambda: train_step(network, images, masks, exist, criterion, optimizer, mixed, layout,
                                           distributed=False)) for _ in range(steps + 1)]
        return statistics.median(times[1:])

    rounds = [(median_step(baseline), median_step(ours)) for _ in range(2)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tusimple")
    parser.add_argument("--model", default="scnn")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    parser.add_argument("--skip-loop", action="store_true", help="leave out the message-passing comparison")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cpu = this_cpu()
    lane_model = get_model(args.model)
    settings = lane_model.settings(args.preset)
    threads = torch.get_num_threads()
    print(f"{args.model} preset {args.preset} at {settings.input_width}x{settings.input_height}, batch "
          f"{args.batch_size}, {threads} threads; CPU {cpu.model}, native bf16: "
          f"{', '.join(cpu.native_bf16) or 'none (bf16 is emulated)'}; torch {torch.__version__}", flush=True)

    measured = {dtype: gemm_tflops(dtype) for dtype in ("fp32", "bf16")}
    gemm = {dtype: rate for dtype, (rate, _) in measured.items()}
    print("GEMM rate (torch.mm, best over n = 2048, 3072, 4096): " + ", ".join(
        f"{d} {rate:.2f} TFLOP/s (n={n})" for d, (rate, n) in measured.items()), flush=True)
    flops = {combo: step_flops(lane_model, settings, combo, args.batch_size) for combo in COMBOS}
    total = sum(flops[COMBOS[0]].values())
    print(f"step FLOPs (forward + backward, PyTorch's flop counter): {total / 1e9:.0f} GFLOP", flush=True)

    # Configurations take turns step by step, so the machine's drift falls on all of them; the better of two
    # rounds counts.
    rounds = [step_seconds(lane_model, settings, COMBOS, args.batch_size, timed=args.steps) for _ in range(2)]
    seconds = {combo: min(r[combo] for r in rounds) for combo in COMBOS}
    base = seconds[("fp32", "contiguous")]
    print(f"\n{'precision, memory format':<28}{'ms/step':>9}{'vs fp32':>9}{'TFLOP/s':>9}{'of GEMM':>9}"
          f"{'  FLOPs in bf16':>15}")
    rows = []
    for combo in COMBOS:
        achieved = total / seconds[combo] / 1e12
        share = achieved / gemm[combo[0]]
        in_bf16 = flops[combo].get("bfloat16", 0) / max(1, sum(flops[combo].values()))
        rows.append({"precision": combo[0], "memory_format": combo[1], "ms_per_step": round(seconds[combo] * 1000, 1),
                     "vs_fp32": round(base / seconds[combo], 2), "tflops": round(achieved, 3),
                     "share_of_gemm": round(share, 3), "flops_in_bf16": round(in_bf16, 4)})
        print(f"{label(combo):<28}{seconds[combo] * 1000:>9.0f}{base / seconds[combo]:>8.2f}x{achieved:>9.2f}"
              f"{100 * share:>8.0f}%{100 * in_bf16:>14.1f}%")

    auto = resolve("auto", "auto", Device.of(torch.device("cpu"), cpu),
                   lambda candidates: calibrate(cpu, lane_model, settings, args.batch_size, candidates))
    chosen = (auto.precision, auto.memory_format)
    ratio = base / seconds[chosen]
    print(f"\nauto resolves to {label(chosen)} ({auto.reason})")
    print(f"auto step vs fp32/contiguous: {ratio:.2f}x (target >= 3x on CPUs with native bf16); "
          f"{100 * total / seconds[chosen] / 1e12 / gemm[auto.precision]:.0f}% of this machine's "
          f"{auto.precision} GEMM rate")
    print(f"\nprofiler's top ops of the auto step ({label(chosen)}), by self CPU time:")
    print(top_ops(lane_model, settings, chosen, args.batch_size))
    loop = None
    if not args.skip_loop and args.model == "scnn":
        loop_s, ours_s = loop_comparison(lane_model, settings, chosen, args.batch_size, args.steps)
        loop = {"loop_ms": round(loop_s * 1000, 1), "ours_ms": round(ours_s * 1000, 1)}
        print(f"message passing in {label(chosen)}: per-slice loop {loop_s * 1000:.0f} ms/step, laneflow's op "
              f"{ours_s * 1000:.0f} ms/step: {loop_s / ours_s:.2f}x (target >= 1.0x)")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "model": args.model, "batch": args.batch_size,
                                         "threads": threads, "cpu": cpu.model, "native_bf16": cpu.native_bf16,
                                         "gemm_tflops": gemm, "step_gflop": total / 1e9, "rows": rows,
                                         "auto": label(chosen), "auto_vs_fp32": round(ratio, 2),
                                         "message_passing": loop}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
