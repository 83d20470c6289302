"""``restore``: a new volume from a snapshot, then ``train_pipeline`` on it with the snapshot's parameters.

The restored volume already holds the dataset (so nothing is downloaded) and the snapshot's run; the
new run trains with the parameters recorded in the snapshot's lineage, changed by ``changes``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as current_run

from flows.params import params_from_record
from flows.train import train_pipeline
from tasks.names import run_name, validate_name
from tasks.pipeline import restore_volume
from tasks.platforms import load_platform


@flow(name="restore")
def restore(snapshot: str, volume: str | None = None, platform: str = "local",
            changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore ``snapshot`` into ``volume`` (default: one named after this flow run) and train on it."""
    validate_name(snapshot, "snapshot")
    target = validate_name(volume, "volume") if volume else run_name(current_run.id, prefix="restore")
    chosen = load_platform(platform)
    lineage = chosen.find_lineage(snapshot)
    params = params_from_record(lineage["parameters"], **{**(changes or {}), "volume": target, "platform": platform})
    restore_volume(chosen, snapshot, target)
    get_run_logger().info("training on restored volume %s with the parameters of %s (dataset %s)", target,
                          lineage["run"], lineage.get("dataset_version"))
    return train_pipeline(**params.flow_parameters())
