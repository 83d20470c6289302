"""One training step of a preset against this machine's own limit, for every precision and memory format.

In one run, on this machine:

1. its GEMM rate per dtype: ``torch.mm`` of large square matrices in fp32 and bf16, best of several — the
   most FLOP/s this machine's matrix units give PyTorch;
2. the step's FLOPs (forward and backward), by PyTorch's flop counter's formulas, and the share of them each
   dtype computed: under bf16 every convolution and matrix product should be bf16 (an fp32 share is a
   silent fallback in the hot loop);
3. each precision x memory format: ms/step (the trainer's own step, ``training.step.train_step``; the
   configurations take turns, each one's best turn of two rounds counting), the achieved TFLOP/s and its
   share of that dtype's GEMM rate, and the ratio to fp32/contiguous;
4. what ``precision: auto`` / ``memory_format: auto`` resolve to here (the trainer's own calibration) and
   that step's ratio to fp32/contiguous (target >= 3x on CPUs with native bf16);
5. the profiler's top ops of the ``auto`` step;
6. laneflow's message passing against the textbook per-slice loop, in the ``auto`` numerics (target >= 1.0x);
7. with ``--compile``: the ``auto`` step through ``torch.compile`` (the trainer's own ``compiled``), its cold
   compile time (a fresh inductor cache), compiled ms/step against eager's (taking turns step by step, at the
   batch the preset trains with) and the steps after which compiling pays, against the preset's typical run
   (``TYPICAL_RUNS``).

The GEMM rate is sampled before the steps, after each round and after the compiled steps; the best sample is the
limit. A share above 100 % cannot be true (a step is no faster than a plain matrix product): the bench prints why,
marks the JSON ``"valid": false`` and exits 3.

    .venv/bin/python bench/train_step.py [--preset tusimple] [--batch-size 2] [--steps 4] [--skip-loop] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.limits import FlopsByDtype, GemmLimit, over_limit, timed
from training.calibration import calibrate, step_seconds
from training.config import TRAIN_PRESETS
from training.cpu_features import CPUINFO_ENV, this_cpu
from training.model import MessagePassing
from training.models import get_model
from training.precision import Device, MixedPrecision, label, resolve
from training.run_parts import compiled
from training.step import train_step

COMBOS = [(p, f) for p in ("fp32", "bf16") for f in ("contiguous", "channels_last")]
#: The training images a typical run of each preset goes through per epoch: the demo's synthetic set
#: (scripts/demo.py, 160 images) and TuSimple's training split (3,268 images; CULane's 88,880). With the preset's
#: epochs and batch size they give the steps a compile is paid back over.
TYPICAL_RUNS = {"cpu-demo": 160, "tusimple": 3268, "culane": 88880}


def typical_steps(preset: str) -> int:
    """A single worker's steps in a typical run of ``preset``."""
    config = TRAIN_PRESETS[preset]
    return config.epochs * math.ceil(TYPICAL_RUNS[preset] / config.batch_size)


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


def top_ops(lane_model, settings, combo: tuple[str, str], batch_size: int,
            count: int = 8) -> tuple[str, list[dict]]:
    """The profiler's top ops of one step by self CPU time: its table, and each op's share of the step."""
    network = lane_model.network(settings).train()
    optimizer = torch.optim.SGD(network.parameters(), lr=1e-3)
    criterion = lane_model.criterion(settings, check_finite=False)
    images, masks, exist = batch_for(settings, batch_size)
    layout = torch.channels_last if combo[1] == "channels_last" else torch.contiguous_format
    mixed = MixedPrecision(combo[0], "cpu")
    train_step(network, images, masks, exist, criterion, optimizer, mixed, layout, distributed=False)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_step(network, images, masks, exist, criterion, optimizer, mixed, layout, distributed=False)
    averages = profile.key_averages()
    total = sum(event.self_cpu_time_total for event in averages) or 1
    ranked = sorted(averages, key=lambda event: event.self_cpu_time_total, reverse=True)[:count]
    return (averages.table(sort_by="self_cpu_time_total", row_limit=count, max_name_column_width=40),
            [{"name": event.key, "self_cpu_share": round(event.self_cpu_time_total / total, 4), "calls": event.count}
             for event in ranked])


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


def compile_comparison(lane_model, settings, combo: tuple[str, str], batch_size: int, steps: int,
                       preset: str) -> dict:
    """The ``combo`` step compiled (the trainer's ``compiled``: inductor, eager's random numbers) against eager.

    Cold: a fresh inductor cache, as a machine's first compiled run pays it (a warm cache cuts it several-fold).
    The compile time is what the first two compiled steps took beyond two steady compiled steps (a graph that
    recompiles on its second step is counted too). Then eager and compiled take turns step by step, at least 8
    times; each side's best turn counts."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    images, masks, exist = batch_for(settings, batch_size)
    layout = torch.channels_last if combo[1] == "channels_last" else torch.contiguous_format
    criterion = lane_model.criterion(settings, check_finite=False)

    def runner(network: nn.Module, forward: nn.Module):
        optimizer = torch.optim.SGD(network.parameters(), lr=1e-3, momentum=0.9)
        mixed = MixedPrecision(combo[0], "cpu")
        return lambda: train_step(forward, images, masks, exist, criterion, optimizer, mixed, layout,
                                  distributed=False)

    eager_network = lane_model.network(settings).train()
    compiled_network = lane_model.network(settings).train()
    eager = runner(eager_network, eager_network)
    with tempfile.TemporaryDirectory(prefix="laneflow-inductor-") as cache, temporary_cache_dir(cache):
        torch._dynamo.reset()
        step = runner(compiled_network, compiled(compiled_network))
        eager()  # kernels chosen, allocator warm
        first = [timed(step) for _ in range(2)]
        turns = [(timed(eager), timed(step)) for _ in range(max(steps, 8))]
    # The best of each: on a machine others load in bursts (a step 2-10x slower for seconds), the fastest of several
    # turns is the step itself, and both sides had the same chances.
    eager_s = min(t[0] for t in turns)
    compiled_s = min(t[1] for t in turns)
    compile_s = max(0.0, sum(first) - 2 * compiled_s)
    gain = eager_s - compiled_s
    break_even = math.ceil(compile_s / gain) if gain > 0 else None
    run_steps = typical_steps(preset) if preset in TYPICAL_RUNS else None
    return {"numerics": label(combo), "batch": batch_size, "compile_s": round(compile_s, 1),
            "eager_ms": round(eager_s * 1000, 1), "compiled_ms": round(compiled_s * 1000, 1),
            "speedup": round(eager_s / compiled_s, 3),
            "break_even_steps": break_even, "typical_run_steps": run_steps,
            "pays": bool(break_even is not None and run_steps is not None and break_even < run_steps),
            "net_s_over_typical_run": round(run_steps * gain - compile_s, 1) if run_steps else None}


def print_compile(figures: dict, preset: str) -> None:
    run = figures["typical_run_steps"]
    print(f"\ntorch.compile of the {figures['numerics']} step at batch {figures['batch']} (cold inductor cache): "
          f"compile {figures['compile_s']:.0f} s; compiled {figures['compiled_ms']:.0f} ms/step against eager "
          f"{figures['eager_ms']:.0f} ms ({figures['speedup']:.2f}x)")
    if figures["break_even_steps"] is None:
        print("  the compiled step is no faster: compiling never pays back")
    else:
        print(f"  pays back after {figures['break_even_steps']} steps"
              + (f"; a typical {preset} run is {run} steps: {'pays' if figures['pays'] else 'does not pay'} "
                 f"({figures['net_s_over_typical_run']:+.0f} s net)" if run else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tusimple")
    parser.add_argument("--model", default="scnn")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    parser.add_argument("--skip-loop", action="store_true", help="leave out the message-passing comparison")
    parser.add_argument("--compile", action="store_true",
                        help="also time the auto step through torch.compile (minutes: a cold compile)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    load_before = os.getloadavg()
    if os.environ.get(CPUINFO_ENV):
        raise SystemExit(f"unset {CPUINFO_ENV}: the bench measures this machine, and would record it as another CPU")
    cpu = this_cpu()
    lane_model = get_model(args.model)
    settings = lane_model.settings(args.preset)
    threads = torch.get_num_threads()
    print(f"{args.model} preset {args.preset} at {settings.input_width}x{settings.input_height}, batch "
          f"{args.batch_size}, {threads} threads; CPU {cpu.model}, native bf16: "
          f"{', '.join(cpu.native_bf16) or 'none (bf16 is emulated)'}; torch {torch.__version__}; load average "
          f"{load_before[0]:.2f}", flush=True)

    limit = GemmLimit(("fp32", "bf16"))
    limit.sample()  # and again after each round of steps (and the compiled steps): the best sample is the limit
    flops = {combo: step_flops(lane_model, settings, combo, args.batch_size) for combo in COMBOS}
    total = sum(flops[COMBOS[0]].values())
    print(f"step FLOPs (forward + backward, PyTorch's flop counter): {total / 1e9:.0f} GFLOP", flush=True)

    # Configurations take turns step by step, so the machine's drift falls on all of them; each one's best turn of
    # two rounds counts: on a machine others load in bursts (a step 2-10x slower for seconds at a time) the fastest
    # turn is the step itself, as the best GEMM sample is the limit.
    rounds = []
    for _ in range(2):
        rounds.append(step_seconds(lane_model, settings, COMBOS, args.batch_size, timed=args.steps, summary=min))
        limit.sample()
    seconds = {combo: min(r[combo] for r in rounds) for combo in COMBOS}
    base = seconds[("fp32", "contiguous")]

    auto = resolve("auto", "auto", Device.of(torch.device("cpu"), cpu),
                   lambda candidates: calibrate(cpu, lane_model, settings, args.batch_size, candidates))
    chosen = (auto.precision, auto.memory_format)
    compile_figures = None
    if args.compile:
        # At the batch the preset trains with: the steps a run pays the compile back over are steps of that batch.
        compile_batch = TRAIN_PRESETS[args.preset].batch_size if args.preset in TRAIN_PRESETS else args.batch_size
        compile_figures = compile_comparison(lane_model, settings, chosen, compile_batch, args.steps, args.preset)
        limit.sample()
    gemm = limit.best()
    print(f"GEMM rate (torch.mm, best over n = 2048, 3072, 4096, sampled before, between and after the steps): "
          f"{limit.describe()}", flush=True)

    print(f"\n{'precision, memory format':<28}{'ms/step':>9}{'vs fp32':>9}{'TFLOP/s':>9}{'of GEMM':>9}"
          f"{'  FLOPs in bf16':>15}")
    rows = []
    for combo in COMBOS:
        achieved = total / seconds[combo] / 1e12
        share = achieved / gemm[combo[0]]
        in_bf16 = flops[combo].get("bfloat16", 0) / max(1, sum(flops[combo].values()))
        rows.append({"precision": combo[0], "memory_format": combo[1], "ms_per_step": round(seconds[combo] * 1000, 1),
                     "vs_fp32": round(base / seconds[combo], 2), "tflops": round(achieved, 3),
                     "share_of_gemm": round(share, 3), "flops_in_bf16": round(in_bf16, 4), "gflop": total / 1e9})
        print(f"{label(combo):<28}{seconds[combo] * 1000:>9.0f}{base / seconds[combo]:>8.2f}x{achieved:>9.2f}"
              f"{100 * share:>8.0f}%{100 * in_bf16:>14.1f}%")
    shares = {label((r["precision"], r["memory_format"])): r["share_of_gemm"] for r in rows}

    ratio = base / seconds[chosen]
    print(f"\nauto resolves to {label(chosen)} ({auto.reason})")
    print(f"auto step vs fp32/contiguous: {ratio:.2f}x (target >= 3x on CPUs with native bf16); "
          f"{100 * total / seconds[chosen] / 1e12 / gemm[auto.precision]:.0f}% of this machine's "
          f"{auto.precision} GEMM rate")
    if compile_figures:  # the step's FLOPs scale with its batch
        compile_gflop = total / 1e9 * compile_figures["batch"] / args.batch_size
        compile_figures["share_of_gemm"] = round(
            compile_gflop / compile_figures["compiled_ms"] / gemm[auto.precision], 3)  # GFLOP/ms = TFLOP/s
        shares[f"{label(chosen)} compiled"] = compile_figures["share_of_gemm"]
        print_compile(compile_figures, args.preset)
    print(f"\nprofiler's top ops of the auto step ({label(chosen)}), by self CPU time:")
    table, ops = top_ops(lane_model, settings, chosen, args.batch_size)
    print(table)
    loop = None
    if not args.skip_loop and args.model == "scnn":
        loop_s, ours_s = loop_comparison(lane_model, settings, chosen, args.batch_size, args.steps)
        loop = {"loop_ms": round(loop_s * 1000, 1), "ours_ms": round(ours_s * 1000, 1)}
        print(f"message passing in {label(chosen)}: per-slice loop {loop_s * 1000:.0f} ms/step, laneflow's op "
              f"{ours_s * 1000:.0f} ms/step: {loop_s / ours_s:.2f}x (target >= 1.0x)")
    problems = over_limit(shares, limit)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 minute)")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
            "preset": args.preset, "model": args.model, "batch": args.batch_size, "threads": threads, "cpu": cpu.model,
            "native_bf16": cpu.native_bf16, "load_average_before": load_before, "load_average_after": load_after,
            "gemm_tflops": {d: round(r, 3) for d, r in gemm.items()}, "gemm_samples": limit.record(),
            "step_gflop": total / 1e9, "rows": rows, "auto": label(chosen), "auto_reason": auto.reason,
            "auto_vs_fp32": round(ratio, 2), "top_ops": ops, "message_passing": loop, "compile": compile_figures,
            "valid": not problems, "problems": problems}, indent=2))
    if problems:
        print("\nINVALID: a figure claims more than this machine's limit:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
