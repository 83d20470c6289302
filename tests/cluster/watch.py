"""A watch request (``?watch=true``) as the API server serves it from its watch cache (apiserver
``pkg/storage/cacher/cacher.go`` ``Watch``, ``cache_watcher.go``; ``pkg/endpoints/handlers/watch.go``):
one chunked HTTP response of newline-delimited ``{"type": ..., "object": ...}`` events.

- Without a ``resourceVersion`` (or with ``0``) the watch starts with a synthetic ADDED event for every
  object that matches, then follows changes; with one, it sends every change after it — and when that
  version is older than the cache keeps, a single ERROR event whose object is a 410 Status, ``reason:
  Expired`` (``newErrWatcher``: once the request passed authorization, a too-old version is an in-stream
  error, not an HTTP status), after which the client must list again.
- Label and field selectors filter as on a list; an object that stops matching is sent as DELETED, one
  that starts matching as ADDED (``cacheWatcher.convertToWatchEvent``; the DELETED one carries the
  object's previous content at the new resourceVersion).
- ``allowWatchBookmarks=true``: a BOOKMARK event (the kind and apiVersion, ``metadata.resourceVersion``
  only) about once a minute while nothing else is sent (``Cluster.bookmark_interval_s``), so a client can
  resume from a recent version.
- ``timeoutSeconds`` ends the stream; without it the server ends it after its own timeout
  (``Cluster.watch_timeout_s``, randomized up to twice as long as kube-apiserver's ``--min-request-timeout``
  of 1800 s is).
"""

from __future__ import annotations

import copy
import json
import random
import select
import socket
import ssl
import time
from collections.abc import Callable

from tests.cluster.apierrors import Rejection, status_body
from tests.cluster.objects import RESOURCES
from tests.cluster.selectors import field_selector, label_selector


class WatchStream:
    """The API server handler's watch endpoint (mixed into ``apiserver.Handler``)."""

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, kind: str, obj: dict) -> None:
        self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def _client_gone(self) -> bool:
        """The client closed its end (a plain socket: readable with nothing to read)."""
        connection = self.connection
        if isinstance(connection, ssl.SSLSocket):
            return False  # nothing to peek through TLS: a write fails instead
        try:
            readable, _, _ = select.select([connection], [], [], 0)
            return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _watch(self, resource: str, namespace: str | None, query: dict) -> None:
        cluster = self.cluster
        one = lambda key: (query.get(key) or [""])[0]  # noqa: E731
        try:
            labels = label_selector(one("labelSelector"))
            fields = field_selector(resource, one("fieldSelector"))
        except Rejection as rejection:
            self._send(rejection.code, rejection.body)
            return
        start = one("resourceVersion")
        if start not in ("", "0") and not start.isdigit():
            self._send(400, status_body(400, "BadRequest", f'invalid resource version "{start}"'))
            return
        group, served, kind, _ = RESOURCES[resource]
        api_version = f"{group}/{served}" if group else served

        def wanted(obj: dict | None) -> bool:
            return obj is not None and (namespace is None or obj["metadata"].get("namespace") == namespace) \
                and labels(obj) and fields(obj)

        with cluster.lock:
            cluster.watch_cache.sync(cluster)
            if start in ("", "0"):
                initial = [("ADDED", obj) for obj in cluster.watch_cache.seen.get(resource, {}).values() if wanted(obj)]
                version = cluster.version
                expired = False
            else:
                initial, version = [], int(start)
                expired = cluster.watch_cache.since(version) is None
                oldest = cluster.watch_cache.oldest
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        try:
            if expired:
                self._event("ERROR", status_body(410, "Expired", f"too old resource version: {version} ({oldest})"))
            else:
                self._follow(resource, kind, api_version, wanted, initial, version, one)
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            return

    def _follow(self, resource: str, kind: str, api_version: str, wanted: Callable[[dict | None], bool],
                initial: list[tuple[str, dict]], version: int, one: Callable[[str], str]) -> None:
        cluster = self.cluster
        for event_type, obj in initial:
            self._event(event_type, obj)
        timeout = float(one("timeoutSeconds") or cluster.watch_timeout_s * random.uniform(1, 2))
        bookmarks = one("allowWatchBookmarks") == "true"
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + cluster.bookmark_interval_s
        while time.monotonic() < deadline and not cluster.closed and not self._client_gone():
            out: list[tuple[str, dict]] = []
            with cluster.lock:
                cluster.watch_cache.sync(cluster)
                events = cluster.watch_cache.since(version)
                if events is None:  # compacted while this watch lagged behind
                    out.append(("ERROR", status_body(410, "Expired", f"too old resource version: {version} "
                                                                      f"({cluster.watch_cache.oldest})")))
                else:
                    for event in events:
                        version = event.version
                        if event.resource != resource:
                            continue
                        was, now = wanted(event.previous), event.type != "DELETED" and wanted(event.obj)
                        if now:
                            out.append(("MODIFIED" if was else "ADDED", event.obj))
                        elif was and event.type == "DELETED":
                            out.append(("DELETED", event.obj))
                        elif was:  # stopped matching: its previous content, at this event's version
                            gone = copy.deepcopy(event.previous)
                            gone["metadata"]["resourceVersion"] = str(event.version)
                            out.append(("DELETED", gone))
                    if not out:
                        cluster.changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                current = cluster.version
            for event_type, obj in out:
                self._event(event_type, obj)
            if out and out[-1][0] == "ERROR":
                return
            if time.monotonic() >= next_bookmark:
                if bookmarks:
                    self._event("BOOKMARK", {"kind": kind, "apiVersion": api_version,
                                             "metadata": {"resourceVersion": str(max(version, current))}})
                next_bookmark = time.monotonic() + cluster.bookmark_interval_s
