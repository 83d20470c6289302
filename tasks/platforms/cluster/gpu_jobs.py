"""The stages that need a GPU after training — scoring, packaging, prediction, publishing a package — each as a
batch Job in the training image on the GPU pools (scheduled as the training workers are), under Kueue when the
block names a queue."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import TYPE_CHECKING, Any

from tasks.k8s.kueue import queued
from tasks.k8s.manifests import MOUNT_PATH, render_claim_job
from tasks.names import validate_name
from tasks.platforms.base import LogSink, VolumeRef, paths_in
from tasks.platforms.cluster.jobs import last_event, run_job, stays_on

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform


def render_gpu_job(platform: ClusterPlatform, name: str, claim: str, run: str, labels: dict[str, str],
                   args: list[str], gpus: int = 1, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The Job running ``python -m <args>`` in the training image on ``gpus`` GPUs, the claim at /data, ``env`` in its
    environment (pure). A Job on GPUs is scheduled as the training workers are (the block's tolerations, node
    selector, affinity, priority class and requests): on AKS the GPU pools are tainted, and a pod asking for a GPU
    without the pool's tolerations is never scheduled anywhere. ``laneflow doctor`` places it on the nodes too."""
    body = render_claim_job(validate_name(name[:63].rstrip("-"), "job"), platform.layout(), claim,
                            ["python", "-m", *args], platform.job_labels(run, labels))
    container = body["spec"]["template"]["spec"]["containers"][0]
    container["image"] = platform.image
    if gpus:  # on the GPU pools, as the training workers are: the block's tolerations, selector, priority, requests
        scheduling = platform.layout().scheduling
        container["resources"] = scheduling.resources(gpus)
        body["spec"]["template"]["spec"].update(scheduling.pod_fields())
    if env:
        container["env"] = [{"name": key, "value": value} for key, value in sorted(env.items())]
    if gpus:  # a GPU Job waits for Kueue's admission as the training does
        body = queued(body, platform.kueue_queue, platform.kueue_priority_class)
    return body


def _gpu_job(platform: ClusterPlatform, name: str, volume: VolumeRef, run: str, labels: dict[str, str],
             args: list[str], event: str, log: LogSink, timeout_s: float = 6 * 3600, gpus: int = 1,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """``render_gpu_job`` run to its end; its event."""
    body = render_gpu_job(platform, name, volume.name, run, labels, args, gpus, env)
    name = body["metadata"]["name"]
    lines = run_job(platform, body, log, timeout_s=timeout_s, delete_after=True)
    result = last_event(lines, event, f"job {name}")
    result.pop("event", None)
    return result


def evaluate(platform: ClusterPlatform, volume: VolumeRef, run_dir: str, data_dir: str, split: str,
             log: LogSink, out_dir: str | None = None) -> dict[str, Any]:
    """The evaluation Job; one scoring for another folder (``out_dir``: a nightly re-scoring its champion) is a
    Job of its own name, so two nightlies re-scoring one champion never share a Job or files."""
    run = run_dir.rstrip("/").rsplit("/", 1)[-1]
    out = ["--out", f"{MOUNT_PATH}/{out_dir}"] if out_dir else []
    for_out = f"-{hashlib.sha256(out_dir.encode()).hexdigest()[:8]}" if out_dir else ""
    return _gpu_job(platform, f"eval-{run}-{split}{for_out}", volume, run, {"split": split},
                    ["training.evaluate", "--run-dir", f"{MOUNT_PATH}/{run_dir}",
                     "--data-root", f"{MOUNT_PATH}/{data_dir}", "--split", split, *out], "eval", log)


def package_model(platform: ClusterPlatform, volume: VolumeRef, run_dir: str, data_dir: str, split: str,
                  lineage: dict[str, Any], log: LogSink) -> dict[str, Any]:
    run = run_dir.rstrip("/").rsplit("/", 1)[-1]
    summary = _gpu_job(platform, f"package-{run}", volume, run, {"step": "package"},
                       ["training.package", "--run-dir", f"{MOUNT_PATH}/{run_dir}", "--data-root",
                        f"{MOUNT_PATH}/{data_dir}", "--split", split, "--lineage", json.dumps(lineage)],
                       "packaged", log)
    return paths_in(run_dir, summary, ("package", "archive"))


def publish_package(platform: ClusterPlatform, volume: VolumeRef, package: str, tracking_uri: str, run_id: str,
                    artifact_path: str, env: dict[str, str], log: LogSink) -> dict[str, Any]:
    """The package logged to MLflow by a Job in the training image (no GPU) with the claim mounted: only a pod
    reads the claim's files, so the pod uploads them, to the tracking server as pods reach it."""
    run = package.rstrip("/").split("/")[1] if package.startswith("runs/") else "package"
    return _gpu_job(platform, f"mlflow-{run}-{run_id[:8]}", volume, run, {"step": "mlflow"},
                    ["training.publish_package", "--package", f"{MOUNT_PATH}/{package}", "--tracking-uri",
                     tracking_uri, "--run-id", run_id, "--artifact-path", artifact_path], "published", log,
                    timeout_s=3600, gpus=0, env=env)


def predict(platform: ClusterPlatform, volume: VolumeRef, package: str, inputs: str, out_dir: str, backend: str,
            log: LogSink) -> dict[str, Any]:
    for path in (package, inputs, out_dir):
        stays_on(volume, path)
    digest = hashlib.sha256(f"{package}|{inputs}|{out_dir}".encode()).hexdigest()[:8]
    summary = _gpu_job(platform, f"predict-{digest}-{uuid.uuid4().hex[:8]}", volume, f"predict-{digest}",
                       {"step": "predict"},
                       ["training.predict", "--package", f"{MOUNT_PATH}/{package}", "--input",
                        f"{MOUNT_PATH}/{inputs}", "--out", f"{MOUNT_PATH}/{out_dir}", "--backend", backend],
                       "predicted", log)
    return paths_in(out_dir, summary, ("predictions", "overlay"))

