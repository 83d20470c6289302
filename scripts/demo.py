"""The local demo: the whole ``train_pipeline`` on this machine, reported to a local Prefect server.

Starts (or reuses) a Prefect server on 127.0.0.1, makes synthetic TuSimple artifacts offline (train_set.zip,
test_set.zip, test_label.json, as the benchmark ships them), and runs
``train_pipeline`` on the ``local`` platform with the ``cpu-demo`` preset: prepare -> horovodrun -np 2
-> evaluate -> snapshot -> artifacts. Ends by printing the run's UI address and its metrics. Run it
again and the dataset stage is a cache hit. Run through ``make demo``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows.local_server import DEFAULT_PORT, ensure_server, server_env, ui_url
from training.data.synthetic import cached_artifacts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(".laneflow/demo"))
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--train", type=int, default=160)
    parser.add_argument("--val", type=int, default=24)
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="horovodrun -np")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()

    print(f"laneflow demo: Prefect server on 127.0.0.1:{args.port} (first start takes a minute or two)...",
          flush=True)
    api = ensure_server(workdir, args.port)
    os.environ.update(server_env(workdir, args.port))
    os.environ.setdefault("LANEFLOW_HOME", str(workdir / "home"))

    # Prefect reads its settings when first imported: only now, with the server's address in place.
    from flows.cli import ensure_local_setup
    from flows.params import DataSource, TrainParams
    from flows.train import train_pipeline

    # As the benchmark ships TuSimple: train_set.zip, test_set.zip and test_label.json (made offline).
    artifacts = cached_artifacts(workdir / "source", args.train, args.val, args.test, args.seed)
    ensure_local_setup()  # one training at a time on this machine (the `gpu` limit), a process work pool
    params = TrainParams(source=DataSource(artifacts=artifacts), preset="cpu-demo", epochs=args.epochs,
                         workers=args.workers, volume="demo")
    state = train_pipeline(params, return_state=True)
    result = state.result(raise_on_failure=False)
    flow_run_id = state.state_details.flow_run_id
    print()
    print(f"flow run        : {state.name}  {ui_url(api, str(flow_run_id))}")
    if not state.is_completed():
        print(f"error           : {result}")
        return 1
    metrics = result["metrics"]
    print(f"run             : {result['run']} (volume {result['volume']}, snapshot {result['snapshot']})")
    print(f"dataset version : {result['dataset_version']}")
    print(f"training        : {result['steps']} steps")
    print(f"{metrics['split']:<5} metrics   : accuracy {metrics['accuracy']:.4f}, FP {metrics['fp']:.4f}, "
          f"FN {metrics['fn']:.4f} on {metrics['images']} images")
    print(f"lineage         : LANEFLOW_HOME={os.environ['LANEFLOW_HOME']} PREFECT_API_URL={api} "
          f".venv/bin/laneflow lineage {result['snapshot'] or result['run']}")
    print(f"Prefect UI      : {api.removesuffix('/api')}  (the server keeps running; `make stop-server` stops it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
