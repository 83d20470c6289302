"""The emulated cluster DNS, asked over UDP as a pod's resolver asks it: an MPI worker's name resolves only
while the worker is a ready endpoint of its job's headless Service (not before the kubelet reports it Ready,
not once it is told to stop), and the answers are well-formed DNS (RFC 1035) for what glibc sends."""

from __future__ import annotations

import socket
import struct

from tests.cluster.dns import NOERROR, NXDOMAIN, SERVFAIL
from tests.cluster.objects import now

A, AAAA = 1, 28


def query(server: tuple[str, int], name: str, qtype: int = A, ident: int = 0x2A2A) -> tuple[int, list[str], bool]:
    """(rcode, A addresses, authoritative) for ``name``, asked as a stub resolver asks: one question,
    recursion desired."""
    question = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    message = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(10)
        client.sendto(message, server)
        answer = client.recv(512)
    got_ident, flags, questions, count = struct.unpack("!HHHH", answer[:8])
    assert got_ident == ident and flags & 0x8000 and flags & 0x0080 and questions == 1
    offset = 12 + len(question) + 4
    assert answer[12:offset] == message[12:]  # the question, echoed
    addresses = []
    for _ in range(count):
        pointer, rtype, rclass, _ttl, length = struct.unpack("!HHHIH", answer[offset:offset + 12])
        assert (pointer, rtype, rclass, length) == (0xC00C, A, 1, 4)
        addresses.append(socket.inet_ntoa(answer[offset + 12:offset + 16]))
        offset += 16
    return flags & 0xF, addresses, bool(flags & 0x0400)


def worker(name: str, index: int, ip: str | None, ready: bool) -> dict:
    status: dict = {"phase": "Running" if ip else "Pending",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-worker-{index}", "namespace": "lanes",
                         "labels": {"training.kubeflow.org/operator-name": "mpi-operator",
                                    "training.kubeflow.org/job-name": name}},
            "spec": {"hostname": f"{name}-worker-{index}", "subdomain": name}, "status": status}


def test_a_worker_resolves_only_while_it_is_a_ready_endpoint_of_its_jobs_headless_service(emulator: tuple) -> None:
    emu, cluster = emulator
    server = emu.dns.address
    fqdn = "job-worker-{}.job.lanes.svc.cluster.local"
    with cluster.lock:
        cluster.objects["services"][("lanes", "job")] = {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "job", "namespace": "lanes"},
            "spec": {"clusterIP": "None", "selector": {"training.kubeflow.org/operator-name": "mpi-operator",
                                                       "training.kubeflow.org/job-name": "job"}}}
        pods = [worker("job", 0, "198.18.7.2", ready=True), worker("job", 1, None, ready=False)]
        for pod in pods:
            cluster.objects["pods"][("lanes", pod["metadata"]["name"])] = pod

    assert query(server, fqdn.format(0)) == (NOERROR, ["198.18.7.2"], True)
    assert query(server, fqdn.format(1)) == (NXDOMAIN, [], True)  # no IP yet: not an endpoint
    with cluster.lock:  # started, not yet reported Ready
        pods[1]["status"].update({"phase": "Running", "podIP": "198.18.7.3"})
    assert query(server, fqdn.format(1))[0] == NXDOMAIN
    with cluster.lock:
        pods[1]["status"]["conditions"][0]["status"] = "True"
    assert query(server, fqdn.format(1)) == (NOERROR, ["198.18.7.3"], True)
    # The Service's own name: every ready endpoint. AAAA of a name that exists: no records, no error.
    assert query(server, "job.lanes.svc.cluster.local") == (NOERROR, ["198.18.7.2", "198.18.7.3"], True)
    assert query(server, fqdn.format(1), qtype=AAAA) == (NOERROR, [], True)

    with cluster.lock:  # told to stop: a terminating endpoint is not ready, whatever the pod's condition says
        pods[0]["metadata"]["deletionTimestamp"] = now()
    assert query(server, fqdn.format(0))[0] == NXDOMAIN
    with cluster.lock:  # the Service, with the pod: gone with its MPIJob
        del cluster.objects["services"][("lanes", "job")]
    assert query(server, fqdn.format(1))[0] == NXDOMAIN
    # The search path's first tries, and a name of another namespace, do not exist; one outside the cluster
    # would be forwarded upstream, which no pod here can reach.
    assert query(server, "job-worker-1.job.lanes.svc.lanes.svc.cluster.local")[0] == NXDOMAIN
    assert query(server, "pypi.org") == (SERVFAIL, [], False)


def test_a_service_that_publishes_not_ready_addresses_resolves_a_worker_before_it_is_ready(emulator: tuple) -> None:
    """The MPI operator sets publishNotReadyAddresses when the launcher is also a worker (newService), so that
    the launcher's name resolves before it is Ready."""
    emu, cluster = emulator
    with cluster.lock:
        cluster.objects["services"][("lanes", "job")] = {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "job", "namespace": "lanes"},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"training.kubeflow.org/job-name": "job"}}}
        pod = worker("job", 0, "198.18.7.9", ready=False)
        cluster.objects["pods"][("lanes", pod["metadata"]["name"])] = pod
    assert query(emu.dns.address, "job-worker-0.job.lanes.svc.cluster.local") == (NOERROR, ["198.18.7.9"], True)
