"""The emulated cluster's pod network: every pod gets a network namespace of its own with an address of its own
on a bridge of this machine, as a CNI plugin (the reference ``bridge`` plugin) gives it on a node.

Why not share this machine's network: OpenMPI tells its peers apart by their IP address (its TCP transport
looks an incoming connection's peer up by address), so MPI ranks in different "pods" behind one address
hang in their first collective; and every worker's ``sshd -De`` wants port 22 to itself. With a namespace
per pod both hold as they do on a cluster: ``eth0`` with the pod IP, ``lo``, a default route via the
bridge (the node), from which a pod reaches this machine's addresses (the test HTTP servers bind
``0.0.0.0``; the bridge's address stands for the node).

Needs root and iproute2 (``ip``); util-linux ``nsenter`` enters the namespace to start the container.
"""

from __future__ import annotations

import atexit
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


class PodNetwork:
    """One bridge for this test process, and a namespace per pod on it."""

    _shared: PodNetwork | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        tag = os.getpid() % 100_000
        # A /24 of 198.18.0.0/15 (RFC 2544's benchmarking range, which no real network routes) per process,
        # so two sessions on one machine do not share a subnet and this machine's own routes are untouched.
        block = os.getpid() % 512
        self.subnet = ipaddress.ip_network(f"198.{18 + block // 256}.{block % 256}.0/24")
        self.gateway = str(self.subnet.network_address + 1)
        self.bridge = f"lfbr{tag}"
        self.prefix = f"lf{tag}"
        self._hosts = itertools.count(2)
        self._names = itertools.count(1)
        # A bridge of this name belongs to a dead process that had our PID (a session killed before exit).
        _ip("link", "del", self.bridge, check=False)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
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
