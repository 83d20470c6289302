"""Horovod's MPI launch path, for real: sshd in the workers, ssh and mpirun in the launcher. A rank killed under
mpirun; a rank over its memory limit; a worker evicted through the API, a node drained and a node shutting
down, each of which the kubelet tells by SIGTERM to the pod's PID 1 only; a stop request heard by the wait
loop, an image without the ssh client settings, a claim mounted where the trainer does not look."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
import pytest

from tasks.platforms import ClusterPlatform, StageBlocked, TrainingFailed, TrainingInterrupted, VolumeRef
from tasks.platforms.cluster.training import mpijob_body
from tests.cluster import Cluster
from tests.cluster.aks import aks_nodes, gpu_node
from tests.cluster.node_lifecycle import DrainRefused, drain, lose, mark_out_of_service, shut_down, uncordon
from tests.cluster.runtime import memory_limits_missing
from tests.cluster_platform_helpers import (
    client_apis,
    cluster_platform,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    spec_for,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def rank_pids(cluster: Cluster, pod: str) -> list[int]:
    """The trainer processes (MPI ranks) in a worker pod's container."""
    found = []
    for pid in cluster.container_pids("lanes", pod):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.train" in cmdline:
            found.append(pid)
    return found


def signal_a_rank_at_the_first_step(cluster: Cluster, worker: str, signum: int) -> list[int]:
    """Once the launcher logs the first training step, send ``signum`` to the rank in ``worker``."""
    sent: list[int] = []

    def on_line(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if "-launcher-" in pod and '"event": "step"' in line and not sent:
            pids = rank_pids(cluster, worker)
            sent.extend(pids)
            for pid in pids:
                os.kill(pid, signum)

    cluster.on_log_line = on_line
    return sent


def test_a_rank_killed_under_mpirun_fails_the_job_naming_the_rank_and_its_signal(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    _, cluster = emulator
    platform, volume, data_dir = prepared
    killed = signal_a_rank_at_the_first_step(cluster, "train-0123456789ab-worker-1", 9)
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="50", log_every="1")
    with pytest.raises(TrainingInterrupted) as stopped:  # a killed process: the retry resumes it
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert killed, "no rank was found in worker 1"
    assert "a training process was killed by signal 9 on rank 1" in str(stopped.value), str(stopped.value)


def test_a_rank_over_its_memory_limit_is_reported_as_out_of_memory_and_not_retried(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """Guaranteed workers at 768Mi, training at ten times the preset's resolution: the first forward pass asks
    for far more at once (one activation of a 2560x1440 batch of two is 470 MB), memory no reclaim can free, so
    the kernel's OOM killer ends the rank in its container's memory cgroup — and, as the kubelet sets
    memory.oom.group (cgroup v2), the whole container with it: mpirun loses a daemon or reports the rank's
    SIGKILL. laneflow reads the worker's OOMKilled: it names the pod, its container and its limit and says what
    to change, and does not submit the job again (resuming would meet the same limit)."""
    if missing := memory_limits_missing():
        pytest.skip(missing)
    emu, cluster = emulator
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, worker_cpu="1", worker_memory="768Mi", worker_qos="guaranteed")
    spec = spec_for(volume.name, data_dir=data_dir, workers=2,
                    **{"model.input_height": "1440", "model.input_width": "2560"})
    logged: list[str] = []
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, logged.append, timeout_s=600)
    message = str(failed.value)
    assert "ran out of memory: container worker, exit code 137 (OOMKilled; limits.memory 768Mi)" in message, message
    assert "raise worker_memory in the platform block" in message, message
    assert not any("once more" in line for line in logged), logged
    launchers = {event["involvedObject"]["name"] for event in cluster.objects["events"].values()
                 if event["reason"] == "Scheduled" and "-launcher-" in event["involvedObject"]["name"]}
    assert len(launchers) == 1, launchers  # submitted once


@dataclass
class Told:
    """When each action finished (Unix seconds, for checkpoints to be compared with), and what any raised."""

    times: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def on_each_attempts_first_step(cluster: Cluster, actions: list[Callable[[], object]], nth: int = 1) -> Told:
    """At the first (or ``nth``) training step each new launcher logs, run the next of ``actions`` in a thread of
    its own, as an operator at a terminal would. Counted per launcher: a resumed attempt starts past step 1."""
    told = Told()
    seen: set[str] = set()
    steps: dict[str, int] = {}

    def on_line(cluster: Cluster, namespace: str, pod: str, line: str) -> None:
        if "-launcher-" not in pod or '"event": "step"' not in line or pod in seen or len(seen) >= len(actions):
            return
        steps[pod] = steps.get(pod, 0) + 1
        if steps[pod] < nth:
            return
        seen.add(pod)
        action = actions[len(seen) - 1]

        def act() -> None:
            try:
                action()
                told.times.append(time.time())
            except BaseException as exc:  # the test fails on it at its next check
                told.errors.append(exc)
        threading.Thread(target=act, daemon=True).start()

    cluster.on_log_line = on_line
    return told


def checkpoints_after(platform: ClusterPlatform, volume: VolumeRef, spec, moment: float) -> list[dict]:
    """The run's checkpoint and preempted events recorded after ``moment`` (Unix seconds): an epoch's end may
    checkpoint on the way; the stop ends with a checkpoint and ``preempted`` at the same step."""
    record = [json.loads(line) for line in
              platform.read_file(volume, f"{spec.run_dir}/metrics.jsonl").decode().splitlines()]
    return [event for event in record if event["event"] in ("checkpoint", "preempted") and event["time"] >= moment]


def test_a_worker_evicted_a_node_drained_and_a_node_shutting_down_each_end_in_a_checkpoint_and_the_run_completes(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """Every way the kubelet is told to stop a training pod, one per attempt of one run, on two GPU nodes and a
    system node — each time SIGTERM to the pod's PID 1 only, never to a rank:
    1. worker-1 evicted through the eviction API, first refused (429) while a disruption budget needs both
       workers, then, the budget gone, accepted;
    2. gpu-a drained as kubectl does it (cordon, then evictions; refused first without
       --delete-emptydir-data, as a worker's /dev/shm is an emptyDir);
    3. gpu-b, where the retry runs, shut down (the kubelet's graceful node shutdown: its pods stay Failed,
       reason Terminated, with a DisruptionTarget).
    Each time the ranks checkpoint after the pod was told and the wait says preempted; with gpu-a back in
    service the fourth attempt resumes there from the last checkpoint and completes."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    # A short grace: the operator re-creates the drained workers and the job's end deletes them again as they
    # start, and a PID 1 signalled before it has a handler waits out the whole grace (the kernel drops it).
    platform = cluster_platform(emu, termination_grace_s=20)
    cluster.nodes = {**aks_nodes(system=1, gpu=0, spot=0), "gpu-a": gpu_node("gpu-a"), "gpu-b": gpu_node("gpu-b")}
    # 40 steps: each stop lands within a few steps on any machine (stop checks every 5 steps at most).
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="20", log_every="1", checkpoint_every="1000")
    client = kubernetes.config.new_client_from_config_dict(emu.kubeconfig())
    core, policy = kubernetes.client.CoreV1Api(client), kubernetes.client.PolicyV1Api(client)
    policy.create_namespaced_pod_disruption_budget("lanes", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep-both-workers"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"training.kubeflow.org/job-role": "worker"}}}})
    refusals: list[str] = []

    def evict_worker_1() -> None:
        worker = f"{spec.job_name}-worker-1"
        eviction = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=worker,
                                                                                        namespace="lanes"))
        try:
            core.create_namespaced_pod_eviction(worker, "lanes", eviction)
        except kubernetes.client.ApiException as exc:
            refusals.append(f"{exc.status} {exc.body}")
        policy.delete_namespaced_pod_disruption_budget("keep-both-workers", "lanes")
        core.create_namespaced_pod_eviction(worker, "lanes", eviction)

    def drain_gpu_a() -> None:
        try:
            drain(core, cluster, "gpu-a")
        except DrainRefused as exc:
            refusals.append(str(exc))
        drain(core, cluster, "gpu-a", delete_emptydir_data=True)

    shut: list[dict] = []  # gpu-b's workers as the kubelet stopped them

    def shut_down_gpu_b() -> None:
        """The pods' objects are kept from here: the MPIJob's end may delete them (cleanPodPolicy Running) while
        the kubelet still stops them, as it may on a real node, and they are gone once it has."""
        with cluster.lock:
            shut.extend(pod for (_, name), pod in cluster.objects["pods"].items()
                        if "-worker-" in name and pod["spec"].get("nodeName") == "gpu-b")
        shut_down(cluster, "gpu-b")

    told = on_each_attempts_first_step(cluster, [evict_worker_1, drain_gpu_a, shut_down_gpu_b])
    attempts = []
    for attempt in range(3):
        with pytest.raises(TrainingInterrupted, match="preempted: it checkpointed and can resume"):
            platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
        assert not told.errors and len(told.times) == attempt + 1, told.errors
        after = checkpoints_after(platform, volume, spec, told.times[attempt])
        assert [e["event"] for e in after[-2:]] == ["checkpoint", "preempted"], after
        assert after[-2]["step"] == after[-1]["step"], after
        attempts.append(after[-1]["step"])
        if attempt == 2:
            assert len(shut) == 2, shut
            wait_until("the kubelet reports gpu-b's workers stopped", lambda: all(
                pod["status"].get("phase") == "Failed" for pod in shut), timeout_s=120, every_s=0.5)
            assert all(pod["status"]["reason"] == "Terminated" and any(
                c["type"] == "DisruptionTarget" and c["reason"] == "TerminationByKubelet"
                for c in pod["status"]["conditions"]) for pod in shut), [p["status"] for p in shut]
    assert len(refusals) == 2 and refusals[0].startswith("429 "), refusals
    assert "Cannot evict pod as it would violate the pod's disruption budget." in refusals[0]
    assert "The disruption budget keep-both-workers needs 2 healthy pods and has 2 currently" in refusals[0]
    assert refusals[1] == ("cannot drain node 'gpu-a': cannot delete Pods with local storage (use "
                           "--delete-emptydir-data to override): lanes/train-0123456789ab-worker-0, "
                           "lanes/train-0123456789ab-worker-1"), refusals
    uncordon(cluster, "gpu-a")
    outcome = platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None,
                                         timeout_s=600)
    assert attempts[0] < attempts[1] < attempts[2] == outcome.resumed_from, (attempts, outcome)
    assert outcome.steps == outcome.total_steps == 40, outcome
    # Where each attempt's workers ran, as `kubectl get events` shows it: gpu-a (twice), gpu-b, then gpu-a.
    placed = [event["message"].rsplit(" to ", 1)[-1] for event in sorted(
        cluster.objects["events"].values(), key=lambda e: int(e["metadata"]["uid"].removeprefix("event-")))
        if event["reason"] == "Scheduled" and "-worker-" in event["involvedObject"]["name"]]
    assert placed[:2] == ["gpu-a", "gpu-a"] and placed[-2:] == ["gpu-a", "gpu-a"] and "gpu-b" in placed, placed


def test_a_drain_of_the_launchers_node_replaces_the_launcher_in_the_same_mpijob_and_the_run_completes(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """Routine maintenance of the system pool (a node-image upgrade, the autoscaler's scale-down) drains the node the
    MPI launcher runs on, mid-training, on the AKS-shaped cluster (two system nodes; the workers on the GPU pool).
    The launcher's PID 1 has every rank checkpoint through mpirun; the launcher Job (the MPIJob's
    runPolicy.backoffLimit) starts another launcher on the system node that remains, which runs horovodrun on the
    same workers, and the ranks resume there from that checkpoint. One wait, one MPIJob (never deleted), the
    workers never replaced; the log says what happened."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    platform = cluster_platform(emu, termination_grace_s=20)
    # 40 steps: the stop lands within a few steps on any machine (stop checks every 5 steps at most).
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="20", log_every="1", checkpoint_every="1000")
    core, _ = client_apis(emu)  # the emulator's admin: no RBAC loaded here
    drained: list[tuple[str, float]] = []

    def drain_the_launchers_node() -> None:
        with cluster.lock:
            node = next(pod["spec"]["nodeName"] for (_, name), pod in cluster.objects["pods"].items()
                        if "-launcher-" in name)
        drained.append((node, time.time()))
        drain(core, cluster, node)

    told = on_each_attempts_first_step(cluster, [drain_the_launchers_node])
    handle = platform.submit_training(spec)
    logs: list[str] = []
    outcome = platform.wait_for_training(handle, lambda _: None, logs.append, timeout_s=600)
    assert not told.errors and drained, told.errors
    (node, moment), = drained
    record = [json.loads(line) for line in
              platform.read_file(volume, f"{spec.run_dir}/metrics.jsonl").decode().splitlines()]
    after = [event for event in record if event["event"] in ("checkpoint", "preempted", "start")
             and event["time"] >= moment]  # epochs checkpoint too (two steps each)
    stop = next(index for index, event in enumerate(after) if event["event"] == "preempted")
    assert [event["event"] for event in after[stop - 1:stop + 2]] == ["checkpoint", "preempted", "start"], after
    assert after[stop - 1]["step"] == after[stop]["step"] == after[stop + 1]["step"] == outcome.resumed_from > 0
    assert outcome.steps == outcome.total_steps == 40, outcome
    # One MPIJob all along, never deleted; its workers scheduled once each, its launcher twice, on both system nodes.
    assert [job["metadata"]["uid"] for job in cluster.objects["mpijobs"].values()] == [handle.details["uid"]]
    placed = [(event["involvedObject"]["name"], event["message"].rsplit(" to ", 1)[-1]) for event in sorted(
        cluster.objects["events"].values(), key=lambda e: int(e["metadata"]["uid"].removeprefix("event-")))
        if event["reason"] == "Scheduled" and event["involvedObject"]["name"].startswith(spec.job_name)]
    workers = [name for name, _ in placed if "-worker-" in name]
    launchers = [on for name, on in placed if "-launcher-" in name]
    assert sorted(workers) == [f"{spec.job_name}-worker-{index}" for index in (0, 1)], placed
    assert len(launchers) == 2 and launchers[0] == node != launchers[1], placed
    said = [line for line in logs if line.startswith("laneflow: launcher pod")]
    assert said and "the launcher Job starts another launcher on the same workers" in said[0], said


def test_nodes_lost_without_a_word_are_noticed_their_jobs_replaced_once_the_nodes_are_gone_and_the_run_completes(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """Nodes that vanish as power loss or a host failure leaves them: the ranks there die at once, their traffic
    is dropped without a reset (mpirun would wait minutes for OpenMPI's keepalive), the API still shows their
    pods Running. One run, on four one-GPU nodes and a system node:
    1. worker-1's node lost with its VM: once the node lifecycle controller marks the node's pods not Ready,
       then the cloud controller deletes the Node and the pod GC the pod (the operator making a new worker-1),
       the wait stops the job, resumable; the retry replaces it;
    2. the retry's worker-1 node cut off, its VM still there: stopped the same way, but now the retry cannot
       replace the job, whose deletion waits on a pod no kubelet will confirm stopped: the stage fails naming
       the node and the out-of-service taint; the administrator taints the node out of service, the pod GC
       removes the pod, and the retry runs;
    3. that attempt's launcher node lost with its VM: the pod GC removes the launcher's pod with the Node
       before any grace ends; the launcher Job replaces it (after its back-off) on the system node that remains,
       in the same MPIJob, and the new launcher's ranks resume from the last checkpoint: the run completes."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    # The controllers' periods shortened alike: the pod GC removes the first lost node's pod a second after
    # its node turned Unknown, well within the wait's grace for the pod's NodeNotReady (3 s).
    cluster.node_monitor_grace_s, cluster.node_monitor_period_s = 2.0, 0.5
    cluster.podgc_quarantine_s, cluster.podgc_period_s = 0.5, 1.0
    platform = cluster_platform(emu, termination_grace_s=2, pod_problem_grace_s=3)
    # Two system nodes: the launcher's is lost, and the last attempt's launcher needs one that is not.
    cluster.nodes = {**aks_nodes(system=2, gpu=0, spot=0),
                     **{name: gpu_node(name, gpus=1) for name in ("gpu-a", "gpu-b", "gpu-c", "gpu-d")}}
    system_node = next(iter(cluster.nodes))  # where the first launchers land (the scheduler's first fit)
    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="8", log_every="1", checkpoint_every="1")
    lost: list[str] = []

    def lose_the_launchers_node() -> None:
        (launcher,) = [pod for (_, name), pod in cluster.objects["pods"].items()
                       if "-launcher-" in name and pod["status"].get("phase") == "Running"]
        lose(cluster, launcher["spec"]["nodeName"], vm_gone=True)

    def lose_worker_1(vm_gone: bool) -> Callable[[], None]:
        def act() -> None:
            pod = cluster.objects["pods"][("lanes", f"{spec.job_name}-worker-1")]
            lost.append(pod["spec"]["nodeName"])
            lose(cluster, lost[-1], vm_gone=vm_gone)
        return act

    # At each attempt's third step: the checkpoints of the two before (each a collective of both ranks) are written.
    told = on_each_attempts_first_step(
        cluster, [lose_worker_1(vm_gone=True), lose_worker_1(vm_gone=False), lose_the_launchers_node], nth=3)
    with pytest.raises(TrainingInterrupted, match=r"train-0123456789ab-worker-1 is not running \(WorkerReplaced"):
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert lost and lost[0] not in cluster.nodes  # the cloud controller deleted it
    with pytest.raises(TrainingInterrupted) as interrupted:
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert not told.errors and len(lost) == 2, told.errors
    assert f"worker-1 is not running (NodeNotReady: node {lost[1]} stopped reporting since" in \
        str(interrupted.value), str(interrupted.value)
    with pytest.raises(StageBlocked) as blocked:
        platform.submit_training(spec)
    message = str(blocked.value)
    assert "its pod train-0123456789ab-worker-1 is still terminating" in message and \
        f"kubectl taint nodes {lost[1]} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute" in message, message
    mark_out_of_service(cluster, lost[1])
    handle = platform.submit_training(spec)
    logs: list[str] = []
    outcome = platform.wait_for_training(handle, lambda _: None, logs.append, timeout_s=600)
    assert system_node not in cluster.nodes and not told.errors and len(told.times) == 3, told
    assert outcome.resumed_from > 0 and outcome.steps == outcome.total_steps, outcome
    assert [job["metadata"]["uid"] for job in cluster.objects["mpijobs"].values()] == [handle.details["uid"]]
    assert any(line.startswith("laneflow: launcher pod") and " is gone" in line for line in logs), logs[-20:]
    placed = [event["message"].rsplit(" to ", 1)[-1] for event in sorted(
        cluster.objects["events"].values(), key=lambda e: int(e["metadata"]["uid"].removeprefix("event-")))
        if event["reason"] == "Scheduled" and "-worker-" in event["involvedObject"]["name"]]
    assert len(placed) >= 6 and not set(placed[-2:]) & set(lost), (placed, lost)  # the last attempt's two workers


def test_a_stop_request_from_the_wait_loop_stops_an_mpijob_after_a_checkpoint_and_it_succeeds(
        prefect_server: dict, emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """A sweep's pruner on a cluster: the wait loop hears the first val score of a 2-worker MPIJob and leaves a
    stop request on the claim (a short Job of its own); both ranks agree to stop, rank 0 checkpoints, mpirun
    exits 0, the MPIJob succeeds, and the outcome says it stopped early and why."""
    from prefect import flow

    from tasks.pipeline import wait_for_training
    from tasks.platforms import TrainingOutcome
    from tasks.pruning import StopVerdict, judged_by

    emu, _ = emulator
    platform, volume, data_dir = prepared
    heard: list[tuple[int, float]] = []

    def judge(step: int, value: float) -> StopVerdict:
        heard.append((step, value))
        return StopVerdict("pruned by the test at the first report", "Pruned")

    spec = spec_for(volume.name, data_dir=data_dir, workers=2, epochs="40", log_every="1", eval_every="2")

    @flow
    def watched() -> TrainingOutcome:  # the task's logs go where a flow run's go
        platform.submit_training(spec)
        return wait_for_training(platform, spec, 600)

    with judged_by(spec.job_name, judge):
        outcome = watched()
    assert [step for step, _ in heard] == [2], heard  # asked once, at the first report
    assert outcome.stopped is not None and outcome.stopped["state"] == "Pruned", outcome
    assert outcome.stopped["reason"] == "pruned by the test at the first report"
    assert 2 < outcome.steps < outcome.total_steps == 80, outcome
    _, custom = client_apis(emu)
    job = custom.get_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", spec.job_name)
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in job["status"]["conditions"]), job["status"]
    record = platform.read_file(volume, f"{spec.run_dir}/metrics.jsonl").decode().splitlines()
    events = [json.loads(line)["event"] for line in record]
    assert events[-2:] == ["checkpoint", "stopped"] and "done" not in events, events
    with pytest.raises(FileNotFoundError):  # the run that honoured the request removed it
        platform.read_file(volume, f"{spec.run_dir}/stop-request.json")


def test_an_image_without_the_ssh_client_settings_fails_with_host_key_verification(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str], tmp_path: Path) -> None:
    """What happens with the operator and an image that does not accept the workers' fresh host keys: mpirun's
    plain ssh stops at 'Host key verification failed.' (horovodrun's own check passes: it sets
    StrictHostKeyChecking=no). The shipped image carries deployments/ssh/ssh_config.conf for this."""
    emu, cluster = emulator
    _, volume, data_dir = prepared
    cluster.images.derive("registry.example.org/laneflow-train:no-ssh-config", "train",
                          ["RUN rm /etc/ssh/ssh_config.d/laneflow.conf"])
    platform = cluster_platform(emu, image="registry.example.org/laneflow-train:no-ssh-config")
    handle = platform.submit_training(spec_for(volume.name, data_dir=data_dir, workers=2))
    with pytest.raises(TrainingFailed, match="Host key verification failed"):
        platform.wait_for_training(handle, lambda _: None, lambda _: None, timeout_s=600)


def test_the_workers_see_the_claim_only_where_their_mount_path_says(
        emulator: tuple, prepared: tuple[ClusterPlatform, VolumeRef, str]) -> None:
    """The same job with the claim mounted at /mnt/data instead of /data: the trainer, told /data/..., finds
    no dataset there and refuses (exit 2, not retried)."""
    emu, _ = emulator
    platform, volume, data_dir = prepared
    spec = spec_for(volume.name, data_dir=data_dir, workers=2)
    body = mpijob_body(platform, spec)
    for mount in body["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMounts"]:
        if mount["mountPath"] == "/data":
            mount["mountPath"] = "/mnt/data"
    _, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, lambda _: None, timeout_s=600)
    assert "training refused its configuration or data (exit code 2) on rank" in str(failed.value), str(failed.value)


def test_each_worker_makes_its_own_host_keys_and_sshd_takes_the_operators_key_from_its_secret_volume(
        emulator: tuple) -> None:
    """Two workers of one job, each running laneflow-sshd from the built training image: the launcher logs in
    to both with the operator's key, which the kubelet put on a tmpfs Secret volume whose root is 1777 (sshd
    takes it only because the image says `StrictModes no`), and finds two different host keys — made when
    each worker started, never baked into the image."""
    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    lines = log_in_to_each_worker(emu, cluster, platform, volume)
    # The ranks would run as laneflow's user (uid 1000, group 0): sshd, root, logs the launcher in as it.
    assert lines.count("mode=1777 fs=tmpfs user=laneflow:1000:0") == 2, lines
    keys = [line.split()[1] for line in lines if line.startswith("ssh-ed25519 ")]
    assert len(keys) == 2 and keys[0] != keys[1], lines


def test_sshd_with_its_strict_modes_refuses_the_operators_key_on_the_kubelets_secret_volume(emulator: tuple) -> None:
    """Why the training image turns StrictModes off: with it on, sshd refuses a key in a 1777 folder."""
    emu, cluster = emulator
    image = "registry.example.org/laneflow-train:strict-modes"
    cluster.images.derive(image, "train", ["RUN sed -i '/^StrictModes no/d' /etc/ssh/sshd_config.d/laneflow.conf"])
    platform = cluster_platform(emu, image=image)
    volume = platform.ensure_volume("data")
    with pytest.raises(AssertionError, match="Permission denied"):
        log_in_to_each_worker(emu, cluster, platform, volume)


def log_in_to_each_worker(emu, cluster: Cluster, platform: ClusterPlatform, volume: VolumeRef) -> list[str]:
    """An MPIJob of two workers whose launcher logs in to each over ssh, as mpirun would, and prints the mode
    and file system of the key folder it reached, and that worker's host key: the launcher's log lines."""
    body = mpijob_body(platform, spec_for(volume.name, job="keys-0123456789ab", workers=2))
    launcher = body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    launcher["command"] = ["sh", "-c", 'for host in $(cut -d" " -f1 /etc/mpi/hostfile); do '
                                       'ssh -o ConnectionAttempts=10 "$host" '
                                       '"echo mode=\\$(stat -c %a ~/.ssh) fs=\\$(stat -f -c %T ~/.ssh) '
                                       'user=\\$(id -un):\\$(id -u):\\$(id -g); '
                                       'cat /etc/ssh/ssh_host_ed25519_key.pub" || exit 1; done']
    _, custom = client_apis(emu)
    custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", "lanes", "mpijobs", body)

    def launcher_done() -> dict | None:
        with cluster.lock:
            pods = [pod for (_, name), pod in cluster.objects["pods"].items()
                    if name.startswith("keys-0123456789ab-launcher")]
            return pods[0] if pods and pods[0]["status"].get("phase") in ("Succeeded", "Failed") else None

    pod = wait_until("the launcher finished", launcher_done, timeout_s=180, every_s=0.5)
    log = cluster.logs[("lanes", pod["metadata"]["name"])]
    lines = [text.strip() for _, text in log.lines]
    assert pod["status"]["phase"] == "Succeeded", lines
    return lines


def test_a_worker_the_launcher_cannot_reach_at_start_is_retried_once_then_named(emulator: tuple) -> None:
    """Workers whose sshd listens where the launcher does not look (port 2222): horovodrun's ssh check meets
    'Connection refused', what a worker not listening yet looks like. The platform submits the job once more
    itself; the second time it fails for good, naming ssh's words and what to check."""
    emu, cluster = emulator
    image = "registry.example.org/laneflow-train:sshd-elsewhere"
    cluster.images.derive(image, "train", ["RUN echo 'Port 2222' >> /etc/ssh/sshd_config.d/laneflow.conf"])
    platform = cluster_platform(emu, image=image)
    volume = platform.ensure_volume("data")  # no dataset: training never starts
    logged: list[str] = []
    spec = spec_for(volume.name, workers=2)
    with pytest.raises(TrainingFailed) as failed:
        platform.wait_for_training(platform.submit_training(spec), lambda _: None, logged.append, timeout_s=600)
    message = str(failed.value)
    assert "could not start on every worker" in message and "Connection refused" in message, message
    assert "and again when submitted once more" in message and "keep sshd listening" in message, message
    assert sum("submitting it once more" in line for line in logged) == 1, logged
    launchers = {event["involvedObject"]["name"] for event in cluster.objects["events"].values()
                 if event["reason"] == "Scheduled" and "-launcher-" in event["involvedObject"]["name"]}
    assert len(launchers) == 2, launchers  # the job ran twice, each time with a launcher of its own
