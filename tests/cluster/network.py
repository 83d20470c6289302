"""The emulated cluster's pod network: every pod gets a network namespace of its own with an address of its own
on a bridge of this machine, as a CNI plugin (the reference ``bridge`` plugin) gives it on a node.

Why not share this machine's network: OpenMPI tells its peers apart by their IP address (its TCP transport
looks an incoming connection's peer up by address), so MPI ranks in different "pods" behind one address
hang in their first collective; and every worker's ``sshd -De`` wants port 22 to itself. With a namespace
per pod both hold as they do on a cluster: ``eth0`` with the pod IP, ``lo``, a default route via the
bridge (the node), from which a pod reaches this machine's addresses (the test HTTP servers bind
``0.0.0.0``; the bridge's address stands for the node).

Needs root and iproute2 (``ip``); util-linux ``nsenter`` enters the namespace to start the container;
``iptables`` routes the ``kubernetes`` Service's address to the emulated API server (``route_service``).
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import itertools
import os
import subprocess
import threading


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


#: Held while a process picks its subnet and puts it on its bridge.
_CLAIM_LOCK = "/run/laneflow-pod-network.lock"
#: RFC 2544's benchmarking range, which no real network routes: this machine's own routes are untouched.
_RANGE = ipaddress.ip_network("198.18.0.0/15")


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 of ``_RANGE`` that no interface of this machine is on, trying from ``seed`` on."""
    taken = set()
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines():
        address = ipaddress.ip_interface(line.split()[3])
        if address.ip in _RANGE:
            taken.add(ipaddress.ip_network(f"{address.ip}/24", strict=False))
    blocks = list(_RANGE.subnets(new_prefix=24))
    for step in range(len(blocks)):
        block = blocks[(seed + step) % len(blocks)]
        if block not in taken:
            return block
    raise RuntimeError(f"every /24 of {_RANGE} is on an interface already: no subnet left for a pod network")


class PodNetwork:
    """One bridge for this test process, and a namespace per pod on it."""

    _shared: PodNetwork | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        tag = os.getpid() % 100_000
        self.bridge = f"lfbr{tag}"
        self.prefix = f"lf{tag}"
        self._hosts = itertools.count(2)
        self._names = itertools.count(1)
        # Choosing a subnet and claiming it on the bridge is one step for every process on this machine (the
        # suite's xdist workers start side by side), so no two bridges ever get the same subnet.
        with open(_CLAIM_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # A bridge of this name belongs to a dead process that had our PID (a session killed before exit).
            _ip("link", "del", self.bridge, check=False)
            self.subnet = _free_subnet(os.getpid())
            self.gateway = str(self.subnet.network_address + 1)
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            # The first ``ip netns add`` on a machine makes /run/netns a shared mount point; two at once can
            # stack two mounts there. One made (and removed) under the lock leaves later ones nothing to race.
            _ip("netns", "add", f"{self.prefix}-0")
            self.detach(f"{self.prefix}-0")
        _ip("link", "set", self.bridge, "up")
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> PodNetwork:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def attach(self) -> tuple[str, str]:
        """A new pod's network namespace, configured: (namespace name, pod IP)."""
        with self._lock:
            number = next(self._names)
            host = next(self._hosts)
            if host >= self.subnet.num_addresses - 1:
                raise RuntimeError(f"the emulated pod network {self.subnet} has no address left for another pod")
            address = str(self.subnet.network_address + host)
        namespace, host_side, pod_side = f"{self.prefix}-{number}", f"{self.prefix}h{number}", f"{self.prefix}c{number}"
        _ip("netns", "add", namespace)
        _ip("link", "add", host_side, "type", "veth", "peer", "name", pod_side)
        _ip("link", "set", host_side, "master", self.bridge, "up")
        _ip("link", "set", pod_side, "netns", namespace)
        inside = ("-n", namespace)
        _ip(*inside, "link", "set", pod_side, "name", "eth0")
        _ip(*inside, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "route", "add", "default", "via", self.gateway)
        return namespace, address

    @staticmethod
    def route_service(namespace: str, service: tuple[str, int], endpoint: tuple[str, int],
                      protocol: str = "tcp") -> None:
        """Connections from the pod to a Service's ClusterIP and port go to its endpoint, as kube-proxy's
        iptables mode makes them go (pkg/proxy/iptables: ``KUBE-SERVICES`` → ``KUBE-SVC-*`` → a ``KUBE-SEP-*``
        DNAT to the endpoint). Here the rule is in the pod's own namespace, so each test process's emulator
        routes its pods to its own API server (TCP) and its own cluster DNS (UDP)."""
        _ip("netns", "exec", namespace, "iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-d", f"{service[0]}/32",
            "-p", protocol, "--dport", str(service[1]), "-j", "DNAT",
            "--to-destination", f"{endpoint[0]}:{endpoint[1]}")

    def cut(self, namespace: str) -> None:
        """The pod's link to the bridge goes down: what reaches its address is dropped without a word (no
        reset, no ICMP), as for a node that lost power, and nothing it sends leaves."""
        host_side = namespace.replace(f"{self.prefix}-", f"{self.prefix}h", 1)
        _ip("link", "set", host_side, "down")

    @staticmethod
    def detach(namespace: str) -> None:
        """Remove a pod's namespace (its veth pair goes with it) once nothing runs in it."""
        _ip("netns", "del", namespace, check=False)

    def close(self) -> None:
        for name in _ip("netns", "list", check=False).stdout.split():
            if name.startswith(f"{self.prefix}-"):
                self.detach(name)
        _ip("link", "del", self.bridge, check=False)


def node_address() -> str:
    """The address pods reach this machine at (the bridge's): where test servers for pods are found."""
    return PodNetwork.shared().gateway
