"""The pods one run makes on the cluster, as their specs (pure): rendered by the same code that makes them, so that
``laneflow doctor`` can tell where each would land before the first run does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tasks.k8s.manifests import render_data_job, render_mpijob
from tasks.platforms.cluster.gpu_jobs import render_gpu_job

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

#: Names for the rendering only: nothing is created under them.
PROBE = "laneflow-doctor"


def run_pod_specs(platform: ClusterPlatform) -> dict[str, dict[str, Any]]:
    """What each kind of a run's pods is, and its pod spec: the MPI workers and launcher (one worker's GPUs), the
    dataset Job, and the GPU Jobs after training (scoring, packaging, prediction: one spec, one GPU)."""
    layout = platform.layout()
    mpijob = render_mpijob(PROBE, layout, PROBE, "cpu-demo", layout.gpus_per_worker, "data", "runs/probe", {}, {})
    replicas = mpijob["spec"]["mpiReplicaSpecs"]
    data = render_data_job(f"{PROBE}-data", layout, PROBE, {})
    scoring = render_gpu_job(platform, f"{PROBE}-score", PROBE, PROBE, {}, ["training.evaluate"])
    return {"MPI workers": replicas["Worker"]["template"]["spec"],
            "MPI launcher": replicas["Launcher"]["template"]["spec"],
            "dataset Job": data["spec"]["template"]["spec"],
            "scoring and packaging Jobs": scoring["spec"]["template"]["spec"]}
