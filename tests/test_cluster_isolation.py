"""An MPIJob's pods are reachable only from each other (issue 50): the workers' sshd and Horovod's
unauthenticated rendezvous are closed to every other pod. Against the emulated cluster, whose pod network enforces
NetworkPolicies in each pod's own network namespace (tests/cluster/network_policy.py), as AKS's network policy
plugins do; probes are real TCP connections from real pods."""

from __future__ import annotations

import socket
import time

import pytest
from kubernetes.client import BatchV1Api, NetworkingV1Api

from tasks.k8s.manifests import MPI_JOB_NAME_LABEL
from tests.cluster.objects import NAMESPACE_NAME_LABEL as NAMESPACE_NAME
from tests.cluster_platform_helpers import (
    DATA_IMAGE,
    client_apis,
    prepared_claim,  # noqa: F401  (the fixture "prepared")
    spec_for,
)

#: Connect to port 22 of argv[1] until it answers or argv[2] seconds passed; print what happened.
PROBE = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        with socket.create_connection((sys.argv[1], 22), timeout=3) as conn:
            print("open", conn.recv(64).decode(errors="replace").strip())
            break
    except OSError as exc:
        if time.monotonic() > deadline:
            print("closed", type(exc).__name__)
            break
        time.sleep(1)
"""


def probe(emu, name: str, target: str, labels: dict[str, str], patience_s: int) -> str:
    """What a pod labelled ``labels`` (a Job's) sees when it connects to ``target``:22 (its one line of output)."""
    core, _ = client_apis(emu)
    BatchV1Api(core.api_client).create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": labels}, "spec": {
            "restartPolicy": "Never", "containers": [{"name": "probe", "image": DATA_IMAGE,
                                                      "command": ["python", "-c", PROBE, target, str(patience_s)]}]}}}})
    deadline = time.monotonic() + patience_s + 180  # a liveness bound: the probe ends by itself
    while True:
        pods = core.list_namespaced_pod("lanes", label_selector=f"job-name={name}").items
        if pods and pods[0].status and pods[0].status.phase in ("Succeeded", "Failed"):
            return core.read_namespaced_pod_log(pods[0].metadata.name, "lanes").strip()
        assert time.monotonic() < deadline, f"probe {name} did not end"
        time.sleep(0.5)


def test_only_the_jobs_own_pods_reach_its_workers_and_the_policy_goes_with_the_job(emulator: tuple,
                                                                                   prepared: tuple) -> None:
    emu, cluster = emulator
    platform, volume, data_dir = prepared
    spec = spec_for(volume.name, job="train-isolated1234", data_dir=data_dir, workers=2, max_steps="100000")
    handle = platform.submit_training(spec)
    try:
        (policy,) = cluster.objects["networkpolicies"].values()
        assert policy["metadata"]["ownerReferences"][0]["uid"] == handle.details["uid"]
        deadline = time.monotonic() + 300
        while not (workers := [p for p in cluster.objects["pods"].values()
                               if p["metadata"]["labels"].get("training.kubeflow.org/job-role") == "worker"
                               and p["status"].get("podIP")]):
            assert time.monotonic() < deadline, "no worker got an address"
            time.sleep(0.5)
        target = workers[0]["status"]["podIP"]
        # A pod carrying the job's label is one of its own: it reaches the worker's sshd (and so the probe works).
        own = probe(emu, "own-probe", target, {MPI_JOB_NAME_LABEL: spec.job_name}, patience_s=120)
        assert own.startswith("open SSH-2.0-"), own
        # Any other pod of the namespace is dropped without an answer.
        stranger = probe(emu, "stranger-probe", target, {"app": "curious"}, patience_s=0)
        assert stranger == "closed TimeoutError", stranger
        # The node is always let in (the kubelet's probes): this machine is every emulated node.
        with socket.create_connection((target, 22), timeout=10) as from_node:
            assert from_node.recv(64).startswith(b"SSH-2.0-")
        assert platform.submit_training(spec).adopted  # a retry adopts the job and finds its policy in place
        assert len(cluster.objects["networkpolicies"]) == 1
    finally:
        platform.cancel_training(spec.job_name, volume)
    cluster.wait_empty("mpijobs", "networkpolicies", timeout_s=120)  # deleted with the job


def test_a_policy_changed_in_place_takes_effect_and_namespaces_are_selected_by_their_name_label(
        emulator: tuple) -> None:
    """An operator's own policy, changed by PATCH, is enforced as changed; a namespaceSelector on
    ``kubernetes.io/metadata.name`` (which the API server sets on every namespace) picks the namespace. The target
    is a plain Job's pod that listens on port 22 (no MPIJob: the emulator's rules, not laneflow's, are tested)."""
    emu, cluster = emulator
    cluster.images.add(DATA_IMAGE, "data")
    core, _ = client_apis(emu)
    assert core.read_namespace("lanes").metadata.labels[NAMESPACE_NAME] == "lanes"
    listener = ("import socket; s = socket.create_server(('', 22)); "
                "[(c.sendall(b'SSH-2.0-listener'), c.close()) for c in iter(lambda: s.accept()[0], None)]")
    BatchV1Api(core.api_client).create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "listener"},
        "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"app": "listener"}}, "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "listen", "image": DATA_IMAGE, "command": ["python", "-c", listener]}]}}}})
    deadline = time.monotonic() + 300
    while not (ips := [p["status"].get("podIP") for p in cluster.objects["pods"].values()
                       if p["metadata"]["labels"].get("app") == "listener" and p["status"].get("podIP")]):
        assert time.monotonic() < deadline, "the listener got no address"
        time.sleep(0.5)
    networking = NetworkingV1Api(core.api_client)
    admitted = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME: "lanes"}},
                "podSelector": {"matchLabels": {"app": "nobody-yet"}}}
    networking.create_namespaced_network_policy("lanes", {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "operators"},
        "spec": {"podSelector": {"matchLabels": {"app": "listener"}}, "ingress": [{"from": [admitted]}]}})
    networking.patch_namespaced_network_policy("operators", "lanes", {"spec": {"ingress": [{"from": [
        {**admitted, "podSelector": {"matchLabels": {"app": "curious"}}}]}]}})
    admitted_now = probe(emu, "curious-probe", ips[0], {"app": "curious"}, patience_s=120)
    assert admitted_now == "open SSH-2.0-listener", admitted_now
    others = probe(emu, "other-probe", ips[0], {"app": "other"}, patience_s=0)
    assert others == "closed TimeoutError", others
    BatchV1Api(core.api_client).delete_namespaced_job("listener", "lanes", propagation_policy="Background")


def test_what_the_emulator_does_not_enforce_is_refused_not_silently_ignored(emulator: tuple) -> None:
    from kubernetes.client.exceptions import ApiException

    emu, _ = emulator
    core, _ = client_apis(emu)
    networking = NetworkingV1Api(core.api_client)
    egress = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "egress"},
              "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    with pytest.raises(ApiException) as refused:
        networking.create_namespaced_network_policy("lanes", egress)
    assert refused.value.status == 422 and "does not enforce egress rules" in refused.value.body
