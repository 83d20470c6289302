"""``sweep``: many ``train_pipeline`` child flow runs over a grid or a list of parameter sets.

Children run concurrently, but training itself holds a slot of the ``gpu`` concurrency limit, so at
most ``max_concurrent`` train at once (the sweep sets that limit). The dataset is prepared once, before
the children start, so they all find it cached. Ends with a leaderboard table artifact.
"""

from __future__ import annotations

from typing import Annotated, Any

from prefect import flow, get_client, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as current_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from flows.params import TrainParams, expand_sweep, takes_train_params
from flows.train import GPU_LIMIT, train_pipeline
from tasks.champion import selection_accuracy
from tasks.pipeline import ensure_dataset_volume, prepare_dataset
from tasks.platforms import load_platform

MAX_CHILDREN_IN_FLIGHT = 16


@task(name="sweep_run", task_run_name="sweep-run-{index}", cache_policy=NO_CACHE)
def run_child(params: TrainParams, index: int, sweep_name: str) -> dict[str, Any]:
    """One child flow run; its failure becomes a leaderboard row, not the sweep's failure."""
    state = train_pipeline.with_options(flow_run_name=f"{sweep_name}-{index}")(**params.flow_parameters(),
                                                                                return_state=True)
    result = state.result(raise_on_failure=False)
    row = {"index": index, "state": state.name, "flow_run_id": str(state.state_details.flow_run_id)}
    if state.is_completed():
        return {**row, **result}
    return {**row, "error": str(result)[:500]}


def leaderboard(rows: list[dict[str, Any]], varied: list[str], param_sets: list[TrainParams]) -> list[dict]:
    """Best accuracy first; failed runs last."""
    table = []
    for row in rows:
        params = param_sets[row["index"]]
        metrics = row.get("metrics", {})
        table.append({"rank": 0, "run": row.get("run", "-"), "state": row["state"],
                      **{key: getattr(params, key) for key in varied},
                      # Ranked without the 200 ms run-time rule (tasks.champion.selection_accuracy).
                      "accuracy": round(selection_accuracy(metrics), 4) if metrics else None,
                      "official accuracy": round(metrics["accuracy"], 4) if metrics else None,
                      "images over 200 ms": metrics.get("over_time_limit") if metrics else None,
                      "fp": round(metrics.get("untimed_fp", metrics["fp"]), 4) if metrics else None,
                      "fn": round(metrics.get("untimed_fn", metrics["fn"]), 4) if metrics else None})
    table.sort(key=lambda r: (r["accuracy"] is None, -(r["accuracy"] or 0.0)))
    for rank, entry in enumerate(table, 1):
        entry["rank"] = rank
    return table


@flow(name="sweep", task_runner=ThreadPoolTaskRunner(max_workers=MAX_CHILDREN_IN_FLIGHT))
@takes_train_params
def sweep(params: TrainParams, grid: dict[str, list[Any]] | None = None, runs: list[dict[str, Any]] | None = None,
          max_concurrent: Annotated[int, Field(ge=1)] = 1) -> list[dict[str, Any]]:
    """Train every parameter set (grid product, then listed runs) on the base parameters; rank them by accuracy.

    Args:
        grid: parameter name -> values; every combination is one run, e.g. {"lr": [0.02, 0.05]}
        runs: further runs, each a dict of the parameters it changes, e.g. [{"lr": 0.1, "batch_size": 4}]
        max_concurrent: at most this many runs train at once (the 'gpu' concurrency limit)
    """
    logger = get_run_logger()
    param_sets = expand_sweep(params, grid or {}, runs or [])
    varied = sorted({key for key in TrainParams.model_fields if key != "source"
                     and len({repr(getattr(p, key)) for p in param_sets}) > 1})
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, max_concurrent)
    logger.info("sweep of %d runs varying %s; at most %d training at once (limit '%s')", len(param_sets),
                ", ".join(varied) or "nothing", max_concurrent, GPU_LIMIT)
    # Prepare each distinct dataset once, so concurrent children never download the same artifacts.
    datasets = {(p.platform, p.volume, tuple(p.source.to_artifacts())) for p in param_sets}
    for platform_name, volume_name, artifacts in sorted(datasets, key=repr):
        platform = load_platform(platform_name)
        prepare_dataset(platform, ensure_dataset_volume(platform, volume_name), list(artifacts))
    futures = [run_child.submit(params, index, current_run.name) for index, params in enumerate(param_sets)]
    rows = [future.result() for future in futures]
    table = leaderboard(rows, varied, param_sets)
    create_table_artifact(table=table, key="sweep-leaderboard", description=f"sweep {current_run.name}: "
                          f"{sum(r['state'] == 'Completed' for r in rows)} of {len(rows)} runs completed; ranked by "
                          "TuSimple accuracy without the 200 ms run-time rule (the official score beside it)")
    return table
