"""Elastic Horovod on the emulated cluster, for real: the training image's horovodrun in the launcher pod polls the
MPI operator's ``discover_hosts.sh`` (the ConfigMap, refreshed in the pod on the kubelet's sync), reaches the
workers' real sshd over ssh and runs Gloo ranks there. A worker pod deleted through the API mid-training: the
run goes on with the other worker in the same MPIJob, the operator's replacement joins after horovodrun's
cooldown, and the run ends on two workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import kubernetes
import pytest

from tasks.platforms import ClusterPlatform, TrainingFailed, TrainingSpec, VolumeRef
from tasks.platforms.base import ElasticWorkers, StageDeadlineExceeded
from tests.cluster import Cluster
from tests.cluster.aks import aks_nodes, gpu_node
from tests.cluster_platform_helpers import (
    client_apis,
    cluster_platform,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    spec_for,
)

pytestmark = pytest.mark.slow

COMMIT_EVERY = 5
#: horovodrun's shortest cooldown of a host that failed (the block's elastic_cooldown_min_s), in these tests.
COOLDOWN_MIN_S = 2


def elastic_spec(volume: str, data_dir: str, workers: int, epochs: int, log_every: int) -> TrainingSpec:
    """An elastic run of 1 to 2 workers starting with ``workers``, one image a step, committing every
    ``COMMIT_EVERY`` steps, no periodic checkpoint."""
    spec = spec_for(volume, data_dir=data_dir, workers=workers, epochs=str(epochs), batch_size="1",
                    log_every=str(log_every), checkpoint_every="1000", elastic="1", commit_every=str(COMMIT_EVERY))
    return spec.model_copy(update={"elastic": ElasticWorkers(min_workers=1, max_workers=2, commit_every=COMMIT_EVERY)})


def ranks_on(cluster: Cluster, pod: str) -> list[int]:
    """The training ranks running in ``pod``'s container."""
    found = []
    for pid in cluster.container_pids("lanes", pod):
        try:
            if b"training.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # gone meanwhile
            continue
    return found


def launcher_log(cluster: Cluster, job: str, lines: int = 60) -> str:
    """The last lines the launcher logged, with the kubelet's stamps: what horovodrun did, for a failing test."""
    logs = [log for (namespace, name), log in cluster.logs.items()
            if namespace == "lanes" and name.startswith(f"{job}-launcher-")]
    return "\n".join(f"{stamp} {text[:300]}" for log in logs for stamp, text in log.lines[-lines:])


def wait_saying_why(platform: ClusterPlatform, handle: object, cluster: Cluster, spec: TrainingSpec,
                    on_event: Callable[[dict], None], on_log: Callable[[str], None], said: list[str]) -> object:
    """``wait_for_training`` within the test's own timeout (pytest's 600 s), so that a run that never ends fails
    saying what the launcher and the test's hold did — a pytest timeout says only where the test waited."""
    try:
        return platform.wait_for_training(handle, on_event, on_log, timeout_s=420)
    except (TrainingFailed, StageDeadlineExceeded) as exc:
        raise AssertionError(f"{exc}\nhold: {said}\n{launcher_log(cluster, spec.job_name)}") from exc


def slow_until(cluster: Cluster, pod: str, done: Callable[[], bool], said: list[str],
               longest_s: float = 180.0) -> None:
    """Slow ``pod``'s training ranks to a twentieth of their pace — stopped (SIGSTOP) 0.95 s of every second —
    until ``done()`` (or ``longest_s``), so that the run cannot end before a newcomer could join, however fast
    this machine trains (one worker trains ~20 steps a second here; slowed, about one, whatever the machine).
    The ranks still run a little every second: horovodrun's driver tells rank 0 of an added host once, when the
    host is listed or its cooldown ends (horovod 0.28.1 runner/elastic/driver.py ``_notify_workers_host_changes``;
    a notice that fails is not sent again), and rank 0 held stopped through that moment was seen to miss it
    here and end the run on one worker. Returns at once; a thread lets go, and stops once the ranks are gone
    (their PIDs are never signalled after). What it did goes to ``said``, for a failing test's message."""
    held, since = ranks_on(cluster, pod), time.monotonic()
    said.append(f"{time.strftime('%H:%M:%S')} slowing ranks {held} of {pod}")

    def still_held() -> list[int]:
        return [pid for pid in held if pid in ranks_on(cluster, pod)]

    def slow() -> None:
        try:
            while (alive := still_held()) and not done() and time.monotonic() - since < longest_s:
                for pid in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                time.sleep(0.95)
                for pid in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                time.sleep(0.05)
            said.append(f"{time.strftime('%H:%M:%S')} let go of {held} (done: {done()})")
        except Exception as error:  # a thread's error, said in the test's message
            said.append(f"{time.strftime('%H:%M:%S')} {error}")
        finally:
            for pid in still_held():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    threading.Thread(target=slow, daemon=True).start()


def rank_started_in(cluster: Cluster, pod: str, not_uid: str | None = None) -> Callable[[], bool]:
    """Whether horovodrun has started a rank in ``pod`` (one whose uid is not ``not_uid``): it does that only
    once every rank there was has stopped training to take the newcomer in, so the run cannot end before it."""
    def started() -> bool:
        found = cluster.objects["pods"].get(("lanes", pod))
        return bool(found and found["metadata"]["uid"] != not_uid and ranks_on(cluster, pod))
    return started


def delete_a_worker_at(cluster: Cluster, core: kubernetes.client.CoreV1Api, pod: str, step: int,
                       deleted: list[dict], hold: str | None = None, said: list[str] | None = None) -> None:
    """Once the launcher logs a training step at ``step`` or later on two workers, delete worker pod ``pod`` as
    ``kubectl delete pod`` does (graceful), recording the step logged before and the pod's uid. With ``hold`` (the
    other worker), once the launcher says the run goes on without ``pod``, that worker's ranks are slowed until
    horovodrun starts a rank in the operator's replacement (``slow_until``): the replacement has the same name,
    and horovodrun takes it once the failed host's cooldown is over (at most three times the block's minimum the
    first time: horovod runner/elastic/discovery.py ``_set_cooldown_period``, min * 2 + U(0, min))."""
    slowed: list[bool] = []

    def on_line(cluster: Cluster, namespace: str, name: str, line: str) -> None:
        if "-launcher-" not in name:
            return
        if deleted and hold and not slowed and '"event": "workers"' in line:
            slowed.append(True)
            slow_until(cluster, hold, rank_started_in(cluster, pod, not_uid=deleted[0]["uid"]),
                       said if said is not None else [])
            return
        if '"event": "step"' not in line or deleted:
            return
        event = json.loads(line[line.index("{"):])
        if event["step"] < step or event.get("workers") != 2:
            return
        uid = cluster.objects["pods"][("lanes", pod)]["metadata"]["uid"]
        deleted.append({"step": event["step"], "uid": uid})
        threading.Thread(target=core.delete_namespaced_pod, args=(pod, "lanes"), daemon=True).start()

    cluster.on_log_line = on_line


def test_an_elastic_job_loses_a_worker_pod_trains_on_and_takes_the_operators_replacement_back(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    emu, cluster = emulator
    cluster.configmap_sync_s = 2.0  # the kubelet's sync (1 min upstream), shortened
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, elastic_cooldown_min_s=COOLDOWN_MIN_S, elastic_cooldown_max_s=30)
    # 8 images, one per step: 4 steps an epoch on two workers, 8 on one; about 35 steps in all.
    spec = elastic_spec(volume.name, data_dir, workers=2, epochs=8, log_every=2)
    core, custom = client_apis(emu)
    deleted: list[dict] = []
    worker = f"{spec.job_name}-worker-1"
    said: list[str] = []
    delete_a_worker_at(cluster, core, worker, 12, deleted, hold=f"{spec.job_name}-worker-0", said=said)
    events: list[dict] = []
    handle = platform.submit_training(spec)
    uid = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs",
                                              spec.job_name)["metadata"]["uid"]
    outcome = wait_saying_why(platform, handle, cluster, spec, events.append, lambda _: None, said)
    assert deleted, "the worker was never deleted"
    changes = [event for event in events if event["event"] == "workers"]
    assert changes and changes[0]["workers"] == 1 and changes[0]["lost"] == [f"{worker}.{spec.job_name}.lanes.svc"]
    rejoined = [change for change in changes[1:] if change["workers"] == 2 and change["joined"]]
    assert rejoined, f"{changes}\n{said}\n{launcher_log(cluster, spec.job_name)}"
    # It trained on alone: steps were made between the worker leaving and its replacement joining (the step events,
    # every log_every steps, may fall on either side of so short a stretch).
    assert rejoined[0]["step"] > changes[0]["step"], changes
    # Told to stop, the leaving rank committed with the other: nothing, at most one commit interval, is redone.
    assert changes[0]["redone_steps"] <= COMMIT_EVERY
    assert deleted[0]["step"] - changes[0]["step"] <= COMMIT_EVERY, (deleted, changes)
    steps = [event for event in events if event["event"] == "step"]
    assert steps[-1]["workers"] == 2
    assert outcome.steps == steps[-1]["step"] and outcome.eval  # the trainer scored it
    # The same MPIJob all along, with one launcher; worker-1 is the operator's new pod of the same name.
    job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert job["metadata"]["uid"] == uid
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} >= {"Succeeded"}
    launchers = [pod for pod in core.list_namespaced_pod(
        "lanes", label_selector=f"training.kubeflow.org/job-name={spec.job_name},"
                                "training.kubeflow.org/job-role=launcher").items]
    assert len(launchers) == 1
    created = [event for event in cluster.objects["events"].values()
               if event["reason"] == "Scheduled" and event["involvedObject"]["name"] == worker]
    assert len(created) == 2, created  # the first worker-1 and its replacement
    scores = platform.evaluate(volume, spec.run_dir, data_dir, "val", lambda _: None)
    assert 0.0 <= scores["accuracy"] <= 1.0


def test_an_elastic_job_short_of_gpus_trains_on_min_workers_past_the_grace_and_grows_when_room_appears(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """min 1, max 2 workers on an AKS-shaped cluster with one GPU: one worker stays Pending (Insufficient
    nvidia.com/gpu) well past `scheduling_grace_s`, and the job trains on the other all the same — a worker
    waiting for room is what elastic training is for, not a stuck stage. Then the pool grows by a node: the
    scheduler places the waiting worker there, and the run takes it and ends on two workers."""
    emu, cluster = emulator
    cluster.configmap_sync_s = 2.0  # the kubelet's sync (1 min upstream), shortened
    cluster.nodes = aks_nodes(gpu=1, spot=0, gpu_size="Standard_NC24ads_A100_v4")  # one GPU
    _, volume, data_dir = prepared
    grace_s = 2
    platform = cluster_platform(emu, scheduling_grace_s=grace_s, elastic_cooldown_min_s=2, elastic_cooldown_max_s=30)
    spec = elastic_spec(volume.name, data_dir, workers=1, epochs=8, log_every=2)
    grown: list[str] = []  # the worker that waited for room
    held: list[str] = []  # what the hold did, for a failing test's message
    started = time.monotonic()
    workers = [f"{spec.job_name}-worker-{index}" for index in (0, 1)]

    def grow_the_pool(cluster: Cluster, namespace: str, name: str, line: str) -> None:
        """Once it has trained on one worker for well past the grace, a second GPU node joins the pool, while the
        rank is slowed until horovodrun has started a rank in the other worker, placed there. Which worker got
        the one GPU is the scheduler's choice (either, here as on a real cluster)."""
        if grown or "-launcher-" not in name or '"event": "step"' not in line or \
                time.monotonic() - started <= 3 * grace_s:
            return
        running = [pod for pod in workers if ranks_on(cluster, pod)]
        if len(running) != 1:
            return
        (waiting,) = set(workers) - set(running)
        grown.append(waiting)
        slow_until(cluster, running[0], rank_started_in(cluster, waiting), said=held)
        with cluster.lock:
            cluster.nodes["gpu-b"] = gpu_node("gpu-b", gpus=1)

    cluster.on_log_line = grow_the_pool
    events: list[dict] = []
    logs: list[str] = []
    outcome = wait_saying_why(platform, platform.submit_training(spec), cluster, spec, events.append, logs.append,
                              held)
    assert grown, "training never started on one worker"
    (waiting,) = grown
    said = [line for line in logs if f"{waiting} is not running (Unschedulable" in line]
    assert said and "trains on the workers it has meanwhile" in said[0], said
    steps = [event for event in events if event["event"] == "step"]
    placed = {event["involvedObject"]["name"]: event["message"].rsplit(" to ", 1)[-1]
              for event in cluster.objects["events"].values() if event["reason"] == "Scheduled"}
    assert steps[0]["workers"] == 1 and steps[-1]["workers"] == 2, (placed, steps)
    assert outcome.steps == outcome.total_steps and outcome.stopped is None
    assert placed[waiting] == "gpu-b", placed


def test_an_elastic_launcher_stopped_mid_run_has_every_rank_checkpoint_and_its_replacement_resumes_there(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """The launcher's pod deleted gracefully mid-run, as a drain of the system pool deletes it (the workers on the
    GPU pool left alone). An elastic horovodrun runs no mpirun to pass the stop on, and stopping it would end its
    ssh sessions and the ranks with them, unsaved: the launcher's PID 1 asks the ranks on every worker, over ssh,
    to checkpoint and stop first — a durable checkpoint at the step the ranks stopped at. The launcher Job starts
    another launcher in the same MPIJob, whose horovodrun resumes from that checkpoint on the same workers, and
    the one wait ends with the run complete."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, elastic_cooldown_min_s=2, elastic_cooldown_max_s=30)
    spec = elastic_spec(volume.name, data_dir, workers=2, epochs=6, log_every=1)
    core, _ = client_apis(emu)
    deleted: list[tuple[int, float]] = []

    def delete_the_launcher(cluster: Cluster, namespace: str, name: str, line: str) -> None:
        if deleted or "-launcher-" not in name or '"event": "step"' not in line:
            return
        event = json.loads(line[line.index("{"):])
        if event["step"] >= 8 and event.get("workers") == 2:
            deleted.append((event["step"], time.time()))
            threading.Thread(target=core.delete_namespaced_pod, args=(name, namespace), daemon=True).start()

    cluster.on_log_line = delete_the_launcher
    handle = platform.submit_training(spec)
    logs: list[str] = []
    outcome = wait_saying_why(platform, handle, cluster, spec, lambda _: None, logs.append, [])
    assert deleted, "the launcher was never deleted"
    record = [json.loads(line) for line in
              platform.read_file(volume, f"{spec.run_dir}/metrics.jsonl").decode().splitlines()]
    after = [event for event in record if event["event"] in ("checkpoint", "preempted", "start")
             and event["time"] >= deleted[0][1]]
    stop = next(index for index, event in enumerate(after) if event["event"] == "preempted")
    assert [event["event"] for event in after[stop - 1:stop + 2]] == ["checkpoint", "preempted", "start"], after
    assert after[stop - 1]["step"] == after[stop]["step"] == after[stop + 1]["step"] >= deleted[0][0], after
    assert outcome.resumed_from == after[stop]["step"] and outcome.steps == outcome.total_steps, outcome
    assert [job["metadata"]["uid"] for job in cluster.objects["mpijobs"].values()] == [handle.details["uid"]]
    assert any(line.startswith("laneflow: launcher pod") for line in logs), logs[-20:]
