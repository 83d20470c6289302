"""Following a stage's pod log through the API, resuming where it stopped.

Separate because data Jobs and MPIJob launchers are followed alike: the stream is reopened at least
every ``STREAM_WINDOW_S`` (so job state is re-read even while the log never goes quiet) and after every
cut; what a reconnect sends again is dropped by the cursor (tasks/k8s/logs.py), and lines the kubelet
rotated away meanwhile are reported as a gap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from tasks.k8s.logs import LogCursor, LogFormatError, format_timestamp
from tasks.platforms.base import LogSink
from tasks.platforms.cluster.api import call

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

#: A log stream is closed and reopened (from where it stopped) at least this often, so job state is
#: re-read even while the log never goes quiet.
STREAM_WINDOW_S = 60.0


def follow_log(platform: ClusterPlatform, core: kubernetes.client.CoreV1Api, selector: str, cursor: LogCursor,
               sink: LogSink, deadline: float) -> bool:
    """Stream the newest matching pod's log into ``sink`` from where ``cursor`` stopped.

    Returns when the stream ends (the container exited, or the connection dropped), when it has
    been quiet for a poll interval, or after ``STREAM_WINDOW_S``; False when there was no log to
    read yet. The kubelet follows the log across rotations; what a reconnect sends again is
    dropped by the cursor (tasks/k8s/logs.py).
    """
    namespace = platform.effective_namespace()
    pods = call(platform, "list", "pods", core.list_namespaced_pod, namespace, label_selector=selector).items
    if not pods:
        return False
    pod = max(pods, key=lambda p: (p.metadata.creation_timestamp is not None, p.metadata.creation_timestamp))
    try:
        response = call(platform, "get", "pods/log", core.read_namespaced_pod_log, pod.metadata.name, namespace,
                        follow=True, timestamps=True, since_seconds=cursor.since_seconds(time.time()),
                        _preload_content=False, _request_timeout=(30, platform.poll_interval_s))
    except ApiException as exc:
        if exc.status in (400, 404):  # container not started yet, or the pod is gone
            return False
        raise
    cursor.start_reading(pod.metadata.name)
    gaps_before = len(cursor.gaps)
    until = min(deadline, time.monotonic() + STREAM_WINDOW_S)
    try:
        for raw in _stream_lines(response):
            try:
                text = cursor.accept(raw, time.time())
            except LogFormatError:  # a line cut short by the end of the stream: it comes again whole
                continue
            if len(cursor.gaps) > gaps_before:
                gaps_before = len(cursor.gaps)
                after, before = (format_timestamp(stamp) for stamp in cursor.gaps[-1])
                sink(f"laneflow: the kubelet rotated pod {pod.metadata.name}'s log while laneflow "
                     f"reconnected: lines written after {after} and before {before} cannot be read from the "
                     "API; the run's metrics.jsonl on the volume keeps every training event")
            if text is not None:
                sink(text)
            if time.monotonic() > until:
                break
    except (urllib3.exceptions.HTTPError, ConnectionError):
        pass  # idle past the read timeout, or cut: the next call resumes from the cursor
    finally:
        response.close()
        response.release_conn()
    return True


def _stream_lines(response: Any) -> Iterator[str]:
    """Complete lines of a streamed HTTP response; a line cut off by the end of the stream is kept."""
    pending = b""
    for chunk in response.stream(64 * 1024, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")
