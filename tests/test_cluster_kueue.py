"""laneflow under Kueue on the emulated cluster (tests/cluster/kueue_*.py plays Kueue v0.19.2): a run's MPIJob and
GPU Jobs are created suspended in the block's LocalQueue; while Kueue holds one back the run says why — Kueue's own
message and the place in the queue — in its log and its progress artifact, for as long as its timeout allows, and
trains once admitted; preempted by a higher-priority job it waits to be admitted again and resumes from its
checkpoint; an elastic run, which Kueue cannot admit on fewer workers, is refused up front."""

from __future__ import annotations

import contextvars
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kubernetes
import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName

from flows.train import train_pipeline
from tasks.k8s.kueue import ELASTIC_REFUSED
from tasks.platforms import ClusterPlatform, VolumeRef
from tasks.platforms.base import ElasticWorkers, StageBlocked
from tests.cluster import Cluster
from tests.cluster_platform_helpers import (
    DATA_IMAGE,
    client_apis,
    cluster_platform,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    saved,
    spec_for,
)
from tests.test_cluster_pipeline import flow_run_messages, granted, rendered
from tests.test_kueue import kueue_queues, until
from tests.test_pipeline import params_for

pytestmark = pytest.mark.slow


def with_gpus(cluster: Cluster, on_demand: int) -> None:
    """An admin gives the ClusterQueue ``on_demand`` GPUs of the on-demand flavor (kubectl apply)."""
    (queue,) = [d for d in kueue_queues(on_demand, 0) if d["kind"] == "ClusterQueue"]
    cluster.load([queue])


def test_a_run_under_kueue_says_why_it_waits_in_its_log_and_artifact_and_trains_once_its_queue_has_room(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], emulator: tuple) -> None:
    """The queue has no GPU: the run's MPIJob waits suspended, its pods not even made, past the block's
    scheduling grace (a wait for Kueue is not a stuck stage), the run's log and progress artifact saying Kueue's
    reason; an admin gives the queue a GPU and the run trains, scores (its GPU Job queued too) and completes,
    every call authorized by deployments/base and deployments/kueue."""
    emu, cluster = emulator
    cluster.kueue_installed = True
    base, queues = rendered("base"), kueue_queues(0, 0, namespace="laneflow", rbac=True)
    cluster.load(base + queues)
    name = saved(emu, "emu-kueue", namespace="laneflow", kueue_queue="laneflow",
                 kueue_priority_class="laneflow-trial", scheduling_grace_s=2, operator_grace_s=30)
    # A timeout of its own: a run left queued by a failing assertion ends rather than outlive the test.
    params = params_for(served_archive, platform=name, volume="queued", snapshot=False, workers=1, max_steps=1,
                        timeout_minutes=8)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(contextvars.copy_context().run,
                              train_pipeline.with_options(flow_run_name="queued-run"), **params)

        def waiting_said() -> str | None:
            assert not running.done(), running.result()
            with get_client(sync_client=True) as client:
                found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                    like_="progress-")))
            return next((a.description for a in found if "Kueue" in (a.description or "")), None)

        described = until("the artifact saying why", waiting_said, timeout_s=300)
        time.sleep(4)  # past the block's scheduling grace: still waiting, not failed
        assert not running.done()
        with cluster.lock:
            assert not [p for p in cluster.objects["pods"].values()
                        if p["metadata"]["labels"].get("training.kubeflow.org/job-role") == "worker"]
        with_gpus(cluster, 1)
        result = running.result(timeout=600)
    expected = ("waiting for Kueue to admit it, position 1 in LocalQueue laneflow and 1 in its ClusterQueue: "
                "couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in flavor "
                "gpu-on-demand, 1 more needed, insufficient unused quota for nvidia.com/gpu in flavor gpu-spot, 1 "
                "more needed")
    assert described.endswith(expected), described
    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["queued-run"])))
    messages = flow_run_messages(str(flow_run.id))
    assert expected in messages, messages[-20:]
    assert result["metrics"]["images"] == 3
    # Both the MPIJob and the scoring Job went through the queue (the Job, deleted once it ended, took its Workload
    # with it), and ran on the flavor's nodes.
    admitted = {(e["involvedObject"]["kind"], e["involvedObject"]["name"].split("-")[0])
                for e in cluster.objects["events"].values()
                if e["reason"] == "Started" and e["message"] == "Admitted by clusterQueue laneflow"}
    assert admitted == {("MPIJob", "train"), ("Job", "eval")}, admitted
    (workload,) = cluster.objects["workloads"].values()  # the MPIJob's, kept with it
    assert any(c["type"] == "Finished" and c["status"] == "True" for c in workload["status"]["conditions"])
    placed = {e["involvedObject"]["name"]: e["message"].rsplit(" to ", 1)[-1]
              for e in cluster.objects["events"].values() if e["reason"] == "Scheduled"}
    workers = [pod for pod in placed if "-worker-" in pod]
    assert workers and all(cluster.nodes[placed[pod]].labels["agentpool"] == "gpu" for pod in workers), placed
    assert cluster.permissions_used("laneflow") <= granted(base, "laneflow") | granted(
        queues, "laneflow", role="laneflow-kueue")


def test_a_run_preempted_by_a_higher_priority_job_waits_for_kueue_and_resumes_from_its_checkpoint(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """A trial trains on the queue's one GPU; a nightly's Job of higher priority arrives. Kueue preempts the trial
    (its MPIJob suspended, its pods removed: the ranks checkpoint as on any stop), the wait says so and waits; the
    nightly's Job runs, and once it is done Kueue admits the trial again and it trains on from its checkpoint."""
    emu, cluster = emulator
    cluster.kueue_installed = True
    cluster.load(kueue_queues(1, 0))
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, kueue_queue="laneflow", kueue_priority_class="laneflow-trial")
    spec = spec_for(volume.name, data_dir=data_dir, workers=1, epochs="4", batch_size="1", log_every="1",
                    checkpoint_every="2")
    core, _ = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    nightly: list[int] = []

    def nightly_arrives(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if nightly or "-launcher-" not in pod or '"event": "step"' not in line:
            return
        event, _ = json.JSONDecoder().raw_decode(line, line.index("{"))  # the line may go on after the event
        if event["step"] >= 4:
            nightly.append(1)
            threading.Thread(target=batch.create_namespaced_job, daemon=True, args=("lanes", {
                "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "nightly", "labels": {
                    "kueue.x-k8s.io/queue-name": "laneflow", "kueue.x-k8s.io/priority-class": "laneflow-nightly"}},
                "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
                    {"name": "main", "image": DATA_IMAGE, "command": ["python", "-c", "import time; time.sleep(3)"],
                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}})).start()

    cluster.on_log_line = nightly_arrives
    events: list[dict] = []
    outcome = platform.wait_for_training(platform.submit_training(spec), events.append, lambda _: None,
                                         timeout_s=420)
    assert nightly, "the trial never reached step 4"
    said = [e for e in events if e["event"] == "queued"]
    preempted = [e for e in said if e["state"] == "preempted"]
    assert preempted and "Preempted to accommodate a workload" in preempted[0]["message"] and \
        "due to prioritization in the ClusterQueue" in preempted[0]["message"], said
    assert said[-1]["state"] == "admitted", said
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed"] and starts[1]["step"] >= 2, starts
    assert outcome.steps == outcome.total_steps
    assert batch.read_namespaced_job("nightly", "lanes").status.succeeded == 1


def test_an_elastic_run_two_schedulers_and_a_cluster_without_kueue_are_each_refused_saying_why(emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.kueue_installed = True
    platform = cluster_platform(emu, kueue_queue="laneflow")
    elastic = spec_for("data", workers=1).model_copy(update={"elastic": ElasticWorkers(min_workers=1, max_workers=2)})
    with pytest.raises(StageBlocked) as refused:
        platform.submit_training(elastic)
    assert ELASTIC_REFUSED in str(refused.value)
    assert not cluster.objects["mpijobs"]
    # A block that names a queue on a cluster without Kueue: said as such, and nothing left suspended.
    cluster.kueue_installed = False
    handle = platform.submit_training(spec_for("data", workers=1))
    with pytest.raises(StageBlocked, match=r"serves no kueue.x-k8s.io/v1beta2 Workloads: install Kueue v0.19"):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=60)
    cluster.wait_empty("mpijobs", timeout_s=60)  # deleted: Kueue would never admit it here
    with pytest.raises(ValueError, match="runai_project and kueue_queue are both set"):
        cluster_platform(emu, kueue_queue="laneflow", runai_project="perception")
    with pytest.raises(ValueError, match="kueue_priority_class is set without kueue_queue"):
        cluster_platform(emu, kueue_priority_class="laneflow-nightly")
