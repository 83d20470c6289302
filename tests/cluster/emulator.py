"""The emulated cluster as a test starts it: ``with KubernetesEmulator(tmp) as cluster: ...`` serves the API
server on 127.0.0.1, runs the time-driven controllers (the TTL-after-finished controller, once a second)
and, on the way out, stops every container and releases the pods' networks, as a node that goes away.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tests.cluster.apiserver import Handler, Server
from tests.cluster.kubelet import release_network
from tests.cluster.state import Cluster
from tests.cluster.ttl_controller import ttl_sweep


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
        self._stopping = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="k8s-controllers")

    def _tick(self) -> None:
        """The controllers that act on time alone, once a second (the TTL-after-finished controller)."""
        while not self._stopping.wait(1.0):
            with self.cluster.lock:
                try:
                    ttl_sweep(self.cluster)
                except Exception as exc:  # kept, and raised when the emulator stops: never lost silently
                    self.cluster.controller_errors.append(exc)
                    return
                self.cluster.changed.notify_all()

    def kubeconfig(self, namespace: str = "lanes") -> dict:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "laneflow", "user": {"token": "emulator-token"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "laneflow",
                                                              "namespace": namespace}}]}

    def __enter__(self) -> Cluster:
        self.thread.start()
        self._ticker.start()
        self.cluster.url = self.url
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._ticker.join()
        self.server.shutdown()
        self.server.server_close()
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
