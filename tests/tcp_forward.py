"""A TCP forwarder from the emulated pod network's node address to a server that listens on loopback only.

The session's Prefect server listens on 127.0.0.1, as laneflow's own local server does: never on every address of
the machine, where anyone on its network could reach it for the whole suite. Flow pods on the emulated cluster
reach it at the bridge's address (``tests.cluster.network.node_address``), through this forwarder, for as long as a
test's worker runs: what a Service in front of a server outside the cluster would be on a real one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from types import TracebackType

#: How often the accept loop looks whether it should stop (it polls rather than block for ever in accept).
ACCEPT_POLL_S = 0.2
CHUNK = 64 * 1024


class Forwarder:
    """Connections to ``listen_host:port`` are piped to ``target_host:port``; closing stops everything it opened.
    With ``targets``, a load balancer in front of several replicas: each connection goes to the next target in
    turn, and to the one after it when that one refuses (a replica restarting), as a balancer's passive health
    check does."""

    def __init__(self, listen_host: str, port: int, target_host: str = "127.0.0.1",
                 targets: list[tuple[str, int]] | None = None) -> None:
        self.listen = (listen_host, port)
        self.targets = targets or [(target_host, port)]
        self._next = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def __enter__(self) -> Forwarder:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self.listen)
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        self._start(self._accept_loop, name=f"forward-{self.listen[0]}:{self.listen[1]}")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stopping.set()
        with self._lock:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(timeout=10)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for connection in self._open:
                connection.close()
            self._open.clear()

    def _start(self, target: Callable[..., None], *args: object, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        with self._lock:
            self._threads = [*(alive for alive in self._threads if alive.is_alive()), thread]

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = self._connect()
            if upstream is None:  # every server is down (a restart): the client sees its connection closed
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            self._start(self._serve, client, upstream, name="forward")

    def _connect(self) -> socket.socket | None:
        """A connection to the next target that accepts one, round robin; None when none does."""
        for _ in range(len(self.targets)):
            target = self.targets[self._next % len(self.targets)]
            self._next += 1
            try:
                return socket.create_connection(target, timeout=10)
            except OSError:
                continue
        return None

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        """Both directions of one connection; both sockets closed once both have ended."""
        towards_server = threading.Thread(target=_copy, args=(client, upstream), daemon=True)
        towards_server.start()
        _copy(upstream, client)
        towards_server.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()


def _copy(source: socket.socket, sink: socket.socket) -> None:
    """One direction until its end; then the other side is told no more comes (a half close, as TCP has)."""
    try:
        while chunk := source.recv(CHUNK):
            sink.sendall(chunk)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
