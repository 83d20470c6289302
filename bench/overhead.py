"""Orchestration overhead: what Prefect + laneflow add around the training itself, with a warm server.

1. The demo pipeline (``train_pipeline`` on ``local``, ``cpu-demo``, horovodrun -np 2), run twice; the
   second run (dataset cached) is measured: flow wall time minus training compute (the horovodrun
   process's own wall time). Target <= 15 s.
2. Per-task overhead: a flow calling a trivial task N times vs the same N plain calls. Target <= 0.2 s.

    .venv/bin/python bench/overhead.py [--tasks 50]

Starts its own Prefect server on a free port in a temporary folder (its start-up is not measured).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path

from flows.local_server import throwaway_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=50)
    args = parser.parse_args()
    with throwaway_server("laneflow-overhead-") as home:
        pipeline_figures(home)
        per_task_figures(args.tasks)


def pipeline_figures(home: Path) -> None:
    from flows.params import DataSource
    from flows.serving import ensure_local_setup
    from flows.train import train_pipeline
    from training.data.synthetic import cached_artifacts

    ensure_local_setup()
    source = DataSource(artifacts=cached_artifacts(home / "source", train=160, val=24, test=40))
    print("baseline: the training process's own wall time (horovodrun start to exit, from its launcher record); "
          "overhead = the flow's wall time minus it")
    for attempt in ("first (cold dataset)", "second (dataset cached)"):
        started = time.perf_counter()
        result = train_pipeline(source=source, epochs=2, workers=2, volume="bench")
        wall = time.perf_counter() - started
        record = json.loads((home / "laneflow" / "volumes" / "bench" / result["run_dir"] / "launcher.json")
                            .read_text())
        training = (datetime.fromisoformat(record["finished_at"]) -
                    datetime.fromisoformat(record["started_at"])).total_seconds()
        print(f"demo pipeline, {attempt}: wall {wall:6.1f} s | training compute (horovodrun) {training:6.1f} s | "
              f"everything else {wall - training:5.1f} s", flush=True)
    print(f"pipeline overhead (warm server, cached dataset): {wall - training:.1f} s  (target <= 15 s; it includes "
          "the evaluate stage's own model run and the snapshot)")


def per_task_figures(count: int) -> None:
    from prefect import flow, task

    def work(value: int) -> int:
        return value + 1

    traced = task(work, name="noop")

    @flow(name="overhead-probe")
    def probe(n: int) -> int:
        total = 0
        for value in range(n):
            total += traced(value)
        return total

    probe(2)  # warm-up: registration of flow and task
    started = time.perf_counter()
    for value in range(count):
        work(value)
    plain = time.perf_counter() - started
    started = time.perf_counter()
    probe(count)
    orchestrated = time.perf_counter() - started
    print("baseline: the same function called plainly in a loop; per task = (flow time - plain time) / tasks")
    print(f"{count} trivial tasks: plain calls {plain * 1000:.2f} ms | in a flow {orchestrated:.2f} s | "
          f"per task {(orchestrated - plain) / count:.3f} s  (target <= 0.2 s)")


if __name__ == "__main__":
    main()
