"""The kubelet's container logs (kubernetes ``pkg/kubelet/kuberuntime/logs/logs.go``), as the API server's
``pods/log`` serves them: ``timestamps`` in RFC3339NanoFixed, ``sinceSeconds`` inclusive, rotation at
``log_max_bytes`` after which a plain read returns only the current file, and ``follow`` streams that
carry on across rotations (PR #115702) and end when the container exits.
"""

from __future__ import annotations

import calendar
import select
import socket
import time
from typing import TYPE_CHECKING

from tests.cluster.apierrors import status_body

if TYPE_CHECKING:
    from tests.cluster.state import Cluster, ContainerLog


def _stamp() -> str:
    """RFC3339NanoFixed, as the kubelet prefixes log lines (``pkg/kubelet/types/constants.go``)."""
    ns = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def _stamp_seconds(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + int(stamp[20:29]) / 1e9


def append_log(cluster: Cluster, log: ContainerLog, text: str) -> None:
    """A line into the container's current log file, rotating it first when it would grow past the limit."""
    size = len(text.encode())
    if log.current_bytes and log.current_bytes + size > cluster.log_max_bytes:
        log.current_from, log.current_bytes = len(log.lines), 0
        log.rotations += 1
    log.lines.append((_stamp(), text))
    log.current_bytes += size


class PodLogEndpoint:
    """The ``pods/log`` endpoint of the API server's handler (``apiserver.Handler``, into which it is mixed:
    the log is written to the handler's connection, chunk by chunk while following)."""

    cluster: Cluster

    # --- the kubelet's log endpoint ----------------------------------------------------------------
    def _client_gone(self) -> bool:
        """Whether the client closed its end (a read timeout, a follower that gave up). Go's HTTP server cancels the
        request's context then, and the kubelet's log stream ends; without this, a silent container's followers
        would pile up, one thread each, for as long as it runs."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _pod_log(self, namespace: str, name: str, query: dict) -> None:
        cluster = self.cluster

        def flag(key: str) -> bool:
            return query.get(key, ["false"])[0] == "true"

        since_s = float(query.get("sinceSeconds", ["0"])[0]) if "sinceSeconds" in query else None
        since = time.time() - since_s if since_s is not None else None
        with cluster.lock:
            pod = cluster.objects["pods"].get((namespace, name))
            log = cluster.logs.get((namespace, name))
            if pod is None:
                self._send(404, status_body(404, "NotFound", f'pods "{name}" not found'))
                return
            if log is None:
                container = (pod.get("spec", {}).get("containers") or [{"name": "main"}])[0]["name"]
                self._send(400, status_body(400, "BadRequest", f'container "{container}" in pod "{name}" is '
                                                                "waiting to start: ContainerCreating"))
                return
            start = log.current_from
            while since is not None and start < len(log.lines) and _stamp_seconds(log.lines[start][0]) < since:
                start += 1

        def render(stamp: str, text: str) -> bytes:
            return ((stamp + " " if flag("timestamps") else "") + text).encode()

        if not flag("follow"):
            with cluster.lock:
                body = b"".join(render(*line) for line in log.lines[start:])
            self._send(200, body, "text/plain")
            return
        # follow: chunked, new lines as they come, across rotations, until the container stops.
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent, position = 0, start
        try:
            while True:
                with cluster.lock:
                    if cluster.logs.get((namespace, name)) is not log:
                        break  # the container was restarted or the pod deleted
                    fresh = log.lines[position:]
                    position = len(log.lines)
                    if not fresh:
                        if not log.running:
                            break
                        cluster.changed.wait(timeout=0.5)
                if not fresh:
                    if self._client_gone():  # the API server's request context is cancelled: the stream ends
                        self.close_connection = True
                        return
                    continue
                for line in fresh:
                    if cluster.cut_streams_after_lines is not None and sent >= cluster.cut_streams_after_lines:
                        self._reset()
                        return
                    data = render(*line)
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    sent += 1
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
