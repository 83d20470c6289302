"""The emulated cluster as a test starts it: ``with KubernetesEmulator(tmp) as cluster: ...`` serves the API
server twice — plain HTTP on 127.0.0.1 for the test's own clients (``url``, ``kubeconfig()``), and HTTPS
with a certificate of the cluster's CA at the node address, where pods reach it as the ``kubernetes``
Service (10.96.0.1:443, ``network.PodNetwork.route_service``) and where a client outside the pods may
connect as to a real cluster's endpoint (``secure_url``, ``kubeconfig(token=..., secure=True)``) — runs
the time-driven controllers (the TTL-after-finished controller, once a second) and, on the way out, stops
every container and releases the pods' networks, as a node that goes away.
"""

from __future__ import annotations

import base64
import ssl
import threading
from pathlib import Path

from tests.cluster.apiserver import Handler, Server
from tests.cluster.authentication import KUBECONFIG_TOKEN, issue_token
from tests.cluster.dns import ClusterDNS
from tests.cluster.kubelet import release_network
from tests.cluster.kueue_scheduler import cycle as kueue_cycle
from tests.cluster.network import node_address
from tests.cluster.operator_lease import renew_leader_lease
from tests.cluster.runtime import KUBERNETES_SERVICE
from tests.cluster.scheduler import retry_unschedulable
from tests.cluster.state import Cluster
from tests.cluster.ttl_controller import ttl_sweep

#: The names and addresses kube-apiserver's serving certificate carries (kubeadm's ``apiserver`` certificate:
#: the Service's DNS names and ClusterIP), plus the node address the emulator listens at.
_SERVING_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
                  KUBERNETES_SERVICE[0])


class KubernetesEmulator:
    """``with KubernetesEmulator(tmp) as cluster: ...``; ``cluster.url`` is the API server address."""

    def __init__(self, root: Path, namespaces: tuple[str, ...] = ("lanes",)) -> None:
        self.cluster = Cluster(root=root)
        for namespace in namespaces:  # created by an administrator before laneflow runs
            self.cluster.add_namespace(namespace)
        handler = type("Handler", (Handler,), {"cluster": self.cluster})
        self.server = Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        address = node_address()
        self.secure_server = Server((address, 0), handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.cluster.ca.issue_cert(*_SERVING_NAMES, address).configure_cert(context)
        self.secure_server.socket = context.wrap_socket(self.secure_server.socket, server_side=True)
        self.cluster.service_endpoint = (address, self.secure_server.server_address[1])
        self.secure_url = f"https://{address}:{self.secure_server.server_address[1]}"
        self.secure_thread = threading.Thread(target=self.secure_server.serve_forever, daemon=True)
        self.dns = ClusterDNS(self.cluster, address)
        self.cluster.dns_endpoint = self.dns.address
        self._stopping = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="k8s-controllers")

    def _tick(self) -> None:
        """The controllers that act on time alone, once a second: the TTL-after-finished controller, the
        scheduler's second try of the pods it could not place, the MPI operator's leader lease, and Kueue's
        controllers and scheduler (where it is installed)."""
        while not self._stopping.wait(1.0):
            with self.cluster.lock:
                try:
                    ttl_sweep(self.cluster)
                    retry_unschedulable(self.cluster)
                    renew_leader_lease(self.cluster)
                    kueue_cycle(self.cluster)
                except Exception as exc:  # kept, and raised when the emulator stops: never lost silently
                    self.cluster.controller_errors.append(exc)
                    return
                self.cluster.changed.notify_all()

    def token(self, namespace: str, account: str, seconds: int = 3600) -> str:
        """A token for a service account (``kubectl create token <account> -n <namespace>``)."""
        with self.cluster.lock:
            return issue_token(self.cluster, namespace, account, seconds=seconds)

    def kubeconfig(self, namespace: str = "lanes", token: str = KUBECONFIG_TOKEN, secure: bool = False) -> dict:
        """A kubeconfig for this cluster: by default the test's own (plain HTTP on 127.0.0.1, as ``Cluster.user``);
        ``secure`` for the HTTPS endpoint at the node address, trusting the cluster's CA."""
        cluster = {"server": self.url}
        if secure:
            cluster = {"server": self.secure_url, "certificate-authority-data":
                       base64.b64encode(self.cluster.ca.cert_pem.bytes()).decode()}
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": cluster}],
                "users": [{"name": "laneflow", "user": {"token": token}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "laneflow",
                                                              "namespace": namespace}}]}

    def __enter__(self) -> Cluster:
        with self.cluster.lock:  # an installed operator has taken its lease before anyone looks
            renew_leader_lease(self.cluster)
        self.thread.start()
        self.secure_thread.start()
        self._ticker.start()
        self.cluster.url = self.url
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._ticker.join()
        for server in (self.server, self.secure_server):
            server.shutdown()
            server.server_close()
        self.dns.close()
        with self.cluster.lock:
            self.cluster.closed = True
            containers = list(self.cluster.containers.values()) + self.cluster.terminating
            self.cluster.containers.clear()
            for log in self.cluster.logs.values():
                log.running = False
            self.cluster.changed.notify_all()
        for container in containers:  # the node goes away: every container is killed, and waited for
            container.stop(grace_s=0)
            if container.memory is not None:
                container.memory.remove()
        with self.cluster.lock:
            for namespace, name in list(self.cluster.pod_networks):
                release_network(self.cluster, namespace, name)
            errors = list(self.cluster.controller_errors)
        if errors and exc[0] is None:  # a controller or the DNS server failed while the test ran
            raise RuntimeError(f"the emulated cluster's background work failed: {errors!r}") from errors[0]
