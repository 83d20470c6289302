"""Cluster DNS, as CoreDNS's ``kubernetes`` plugin answers it from Services and their EndpointSlices: a real
DNS server over UDP that the pods' own resolver (glibc, in the image) asks, through the ``kube-dns`` Service's
address (``CLUSTER_DNS``), which each pod's ``/etc/resolv.conf`` names, as the kubelet writes it.

What is answered (the Kubernetes DNS specification, kubernetes/dns ``docs/specification.md`` 2.3 and 2.4):

- ``<service>.<ns>.svc.cluster.local``: a ClusterIP Service's address; for a headless one (``clusterIP:
  None``), the addresses of its ready endpoints;
- ``<hostname>.<service>.<ns>.svc.cluster.local``: the ready endpoint of a headless Service whose pod has that
  ``spec.hostname`` and ``spec.subdomain`` equal to the Service's name, the names the MPI operator's hostfile
  lists for its workers.

An endpoint is ready when its pod has an IP, has not ended, is Ready, and is not being deleted, unless the
Service sets ``publishNotReadyAddresses`` (discovery/v1 ``EndpointConditions.ready``: "ready should never be
true for terminating endpoints, except when ... the associated Service has set the publishNotReadyAddresses
flag"; the EndpointSlice controller leaves pods without an IP and ended pods out). So a worker's name
resolves only once the kubelet has reported it Ready, and stops resolving once it is told to stop — where a
static hosts file would have answered at once and for ever.

Any other name in ``cluster.local`` does not exist (NXDOMAIN, authoritative); a name outside it would be
forwarded upstream, which nothing here can reach: SERVFAIL, as CoreDNS's ``forward`` answers then. The wire
format is RFC 1035's (4.1); records carry CoreDNS's default TTL of 5 s.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import TYPE_CHECKING

from tests.cluster.selectors import label_selector_object

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

#: The ``kube-dns`` Service's ClusterIP, kubeadm's default (the tenth address of 10.96.0.0/12), which the
#: kubelet's ``clusterDNS`` names; kube-proxy sends its port 53 to CoreDNS (here: ``PodNetwork.route_dns``).
CLUSTER_DNS = "10.96.0.10"
DOMAIN = "cluster.local"
TTL_S = 5

_A, _AAAA, _IN = 1, 28, 1
NOERROR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 2, 3, 4


def resolv_conf(namespace: str) -> str:
    """The kubelet's ``/etc/resolv.conf`` for a ``dnsPolicy: ClusterFirst`` pod (pkg/kubelet/network/dns/dns.go
    ``GetPodDNS``: the cluster DNS, the namespace's search path, ``ndots:5``)."""
    return (f"search {namespace}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}\n"
            f"nameserver {CLUSTER_DNS}\noptions ndots:5\n")


def _endpoint_ready(pod: dict, service: dict) -> bool:
    status = pod.get("status") or {}
    if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
        return False
    if service["spec"].get("publishNotReadyAddresses"):
        return True
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return ready and not pod["metadata"].get("deletionTimestamp")


def addresses(cluster: Cluster, name: str) -> list[str] | None:
    """The A records of ``name`` (fully qualified, no trailing dot, lower case) on ``cluster``; None when the
    name does not exist. Call with ``cluster.lock`` held."""
    suffix = f".svc.{DOMAIN}"
    if not name.endswith(suffix):
        return None
    labels = name.removesuffix(suffix).split(".")
    if len(labels) not in (2, 3):
        return None
    *hostname, service_name, namespace = labels
    service = cluster.objects["services"].get((namespace, service_name))
    if service is None:
        return None
    spec = service["spec"]
    if spec.get("clusterIP") not in (None, "", "None"):
        return None if hostname else [spec["clusterIP"]]
    selector = spec.get("selector") or {}  # a Service without one has no EndpointSlices made for it
    selects = label_selector_object({"matchLabels": selector})
    ready = [pod for (ns, _), pod in cluster.objects["pods"].items()
             if ns == namespace and selector and selects(pod) and _endpoint_ready(pod, service)]
    if hostname:
        ready = [pod for pod in ready if pod["spec"].get("hostname") == hostname[0]
                 and pod["spec"].get("subdomain") == service_name]
    return sorted(pod["status"]["podIP"] for pod in ready) or None


def _question(query: bytes) -> tuple[str, int, int, int]:
    """(name, type, class, offset past the question) of a query's first question."""
    labels, offset = [], 12
    while True:
        length = query[offset]
        if length == 0:
            offset += 1
            break
        if length & 0xC0:
            raise ValueError("a compressed name in a question")
        labels.append(query[offset + 1:offset + 1 + length].decode("ascii"))
        offset += 1 + length
    qtype, qclass = struct.unpack("!HH", query[offset:offset + 4])
    return ".".join(labels).lower(), qtype, qclass, offset + 4


def reply(cluster: Cluster, query: bytes) -> bytes | None:
    """The response to one query message (RFC 1035 4.1), or None for a message that is not a query."""
    if len(query) < 12:
        return None
    ident, flags, questions = struct.unpack("!HHH", query[:6])
    if flags & 0x8000:  # a response, not a query
        return None
    opcode, recursion_desired = (flags >> 11) & 0xF, flags & 0x0100
    try:
        if opcode != 0 or questions != 1:
            raise NotImplementedError
        name, qtype, qclass, end = _question(query)
    except (NotImplementedError, ValueError, IndexError, struct.error, UnicodeDecodeError):
        return struct.pack("!HHHHHH", ident, 0x8000 | (opcode << 11) | recursion_desired | 0x80 | NOTIMP,
                           0, 0, 0, 0)
    ours = name == DOMAIN or name.endswith("." + DOMAIN)
    answers: list[str] = []
    if not ours:
        rcode = SERVFAIL
    else:
        with cluster.lock:
            found = addresses(cluster, name)
        rcode = NXDOMAIN if found is None and name != DOMAIN else NOERROR
        if found and qtype == _A and qclass == _IN:
            answers = found
    authoritative = 0x0400 if ours else 0
    header = struct.pack("!HHHHHH", ident, 0x8000 | authoritative | recursion_desired | 0x80 | rcode,
                         1, len(answers), 0, 0)
    records = b"".join(struct.pack("!HHHIH", 0xC00C, _A, _IN, TTL_S, 4) + socket.inet_aton(address)
                       for address in answers)  # 0xC00C: the name, as in the question (offset 12)
    return header + query[12:end] + records


class ClusterDNS:
    """The server: one UDP socket on this machine's pod-network address, answering from ``cluster`` until
    closed."""

    def __init__(self, cluster: Cluster, address: str) -> None:
        self.cluster = cluster
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((address, 0))
        self.socket.settimeout(0.5)  # how soon ``close`` is heard
        self.address: tuple[str, int] = self.socket.getsockname()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="cluster-dns")
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                query, sender = self.socket.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                answer = reply(self.cluster, query)
                if answer is not None:
                    self.socket.sendto(answer, sender)
            except Exception as exc:  # kept, and raised when the emulator stops; the next query is answered
                with self.cluster.lock:
                    self.cluster.controller_errors.append(exc)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self.socket.close()
