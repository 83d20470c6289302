"""Searching against a grid at the same trial budget (issue 20): a grid, random search and TPE with
successive-halving pruning over ``lr`` (log range) x ``batch_size`` on ``cpu-demo``, each a real ``sweep``
flow on the local platform, one after the other in one run, on the same synthetic dataset.

For each strategy: the best val accuracy (without the 200 ms rule, as sweeps rank), the training steps
and images all its trials used (the compute it spent), its wall time, and the steps (and images) it
needed to match the grid's best val accuracy (within ``--tolerance``), counted over its trials in the
order they ran. TPE without pruning is run too, to tell the sampler's share from the pruner's.
Baseline: the grid's total steps — a grid only knows its best once every cell has run. Target: TPE with
successive halving matches the grid's best with at most half of them.

    .venv/bin/python bench/sweep.py [--lrs 3] [--batch-sizes 2,4,8] [--epochs 4] [--train 48] [--eval-every 8]
                                    [--pruner successive_halving] [--skip random,tpe]

Starts its own Prefect server on a free port in a temporary folder (its start-up is not measured).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from flows.local_server import throwaway_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lrs", type=int, default=3, help="grid points on the lr range (log-spaced)")
    parser.add_argument("--lr-range", default="0.003,0.3", help="low,high of lr")
    parser.add_argument("--batch-sizes", default="2,4,8", help="batch_size choices")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per trial")
    parser.add_argument("--train", type=int, default=48, help="synthetic training images")
    parser.add_argument("--val", type=int, default=32, help="synthetic val images")
    parser.add_argument("--eval-every", type=int, default=8, help="val scores for the pruner every N steps")
    parser.add_argument("--seed", type=int, default=7, help="the samplers' seed")
    parser.add_argument("--tolerance", type=float, default=0.01, help="'matches the grid's best' within this")
    parser.add_argument("--pruner", default="successive_halving", choices=("median", "successive_halving", "hyperband"))
    parser.add_argument("--skip", default="", help="comma-separated strategies not to run (random, tpe)")
    args = parser.parse_args()
    with throwaway_server("laneflow-sweep-bench-") as home:
        compare(args, home)


def log_spaced(low: float, high: float, count: int) -> list[float]:
    if count == 1:
        return [math.sqrt(low * high)]
    return [round(low * (high / low) ** (i / (count - 1)), 6) for i in range(count)]


def used(row: dict[str, Any], unit: str) -> int:
    """A trial's training steps, or images (steps x batch size; one worker)."""
    steps = row["steps"] or 0
    return steps if unit == "steps" else steps * int(row.get("batch_size") or 0)


def spent_to_match(table: list[dict[str, Any]], target: float, unit: str = "steps") -> int | None:
    """Training steps (or images) spent, in trial order, until a finished trial scored at least ``target``."""
    spent = 0
    for row in sorted(table, key=lambda r: r["trial"]):
        spent += used(row, unit)
        if row["state"] == "Completed" and row["val accuracy"] is not None and row["val accuracy"] >= target:
            return spent
    return None


def compare(args: argparse.Namespace, home: Path) -> None:
    from flows.params import DataSource
    from flows.serving import ensure_local_setup
    from flows.sweep import sweep
    from training.data.synthetic import cached_artifacts

    ensure_local_setup()
    low, high = (float(v) for v in args.lr_range.split(","))
    batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    lrs = log_spaced(low, high, args.lrs)
    trials = len(lrs) * len(batch_sizes)
    source = DataSource(artifacts=cached_artifacts(home / "source", train=args.train, val=args.val, test=8))
    base = {"source": source, "preset": "cpu-demo", "epochs": args.epochs, "workers": 1, "loader_workers": 1,
            "snapshot": False, "package": False, "volume": "bench"}
    space = {"lr": {"low": low, "high": high, "log": True}, "batch_size": {"choices": batch_sizes}}
    strategies = [
        ("grid", {"grid": {"lr": lrs, "batch_size": batch_sizes}}),
        ("random", {"search": "random", "space": space, "trials": trials, "seed": args.seed}),
        ("tpe", {"search": "tpe", "space": space, "trials": trials, "seed": args.seed}),
        (f"tpe + {args.pruner.replace('_', ' ')}", {"search": "tpe", "space": space, "trials": trials,
                                                    "seed": args.seed, "pruner": args.pruner,
                                                    "eval_every": args.eval_every}),
    ]
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    strategies = [(name, changes) for name, changes in strategies if name not in skipped]
    print(f"{trials} trials each over lr {low}..{high} (log) x batch_size {batch_sizes}; cpu-demo, {args.epochs} "
          f"epochs of {args.train} synthetic images per trial, 1 worker, scored on {args.val} val images; "
          f"pruner judged every {args.eval_every} steps", flush=True)
    results = []
    for name, changes in strategies:
        started = time.perf_counter()
        table = sweep(**base, **changes)
        wall = time.perf_counter() - started
        results.append((name, table, wall))
        best = max((r["val accuracy"] for r in table if r["state"] == "Completed"), default=None)
        print(f"{name}: best val accuracy {best}, {sum(r['steps'] or 0 for r in table)} steps, wall {wall:.0f} s; "
              f"states {[r['state'] for r in sorted(table, key=lambda r: r['trial'])]}", flush=True)
    grid_table = results[0][1]
    grid_best = max(r["val accuracy"] for r in grid_table if r["state"] == "Completed")
    grid_steps = sum(r["steps"] or 0 for r in grid_table)
    target = grid_best - args.tolerance
    print(f"\nbaseline: the grid's {grid_steps} steps (all {trials} cells; its best val accuracy {grid_best:.4f}); "
          f"'matched' = a finished trial at >= {target:.4f}")
    grid_images = sum(used(r, "images") for r in grid_table)
    print(f"{'strategy':26} {'best val':>8} {'steps':>6} {'images':>7} {'pruned':>6} {'steps to match':>14} "
          f"{'of grid':>7} {'images to match':>15} {'of grid':>7} {'wall s':>7}")
    for name, table, wall in results:
        completed = [r for r in table if r["state"] == "Completed"]
        best = max((r["val accuracy"] for r in completed), default=float("nan"))
        steps, images = sum(used(r, "steps") for r in table), sum(used(r, "images") for r in table)
        matched, matched_images = spent_to_match(table, target), spent_to_match(table, target, "images")
        share = f"{matched / grid_steps:.2f}" if matched is not None else "-"
        image_share = f"{matched_images / grid_images:.2f}" if matched_images is not None else "-"
        print(f"{name:26} {best:8.4f} {steps:6d} {images:7d} {sum(r['state'] == 'Pruned' for r in table):6d} "
              f"{matched if matched is not None else 'never':>14} {share:>7} "
              f"{matched_images if matched_images is not None else 'never':>15} {image_share:>7} {wall:7.0f}")
    tpe_matched = spent_to_match(results[-1][1], target)
    verdict = "met" if tpe_matched is not None and tpe_matched <= grid_steps / 2 else "not met"
    if grid_best <= args.tolerance:
        verdict = "not measured: nothing in the grid learned (give the trials more epochs or images)"
    print(f"target ({results[-1][0]} matches the grid's best within half the grid's steps): {verdict}")


if __name__ == "__main__":
    main()
