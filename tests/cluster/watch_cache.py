"""The API server's watch cache (apiserver ``pkg/storage/cacher``): every change to a stored object is an
event with a resourceVersion of its own, kept in a bounded window, and a watch is served from it.

The emulator's controllers change stored objects in place, as etcd never sees; ``sync`` is the etcd
write those changes stand for: it compares the store with the last state it saw and, for each object
that changed, came or went, gives it the next resourceVersion and records an ADDED, MODIFIED or DELETED
event (an object stamped by an API write keeps the version it was given). Every API request syncs
first, so a GET, a list and a watch all agree on versions.

Events older than the window are gone, as after etcd compaction: a watch from a resourceVersion before
the window gets one ERROR event with a 410 Status (``too old resource version``) and must list again.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tests.cluster.objects import RESOURCES

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

#: The window's size: the watch cache's upper bound per resource is 100 * 1024 events
#: (cacher/watch_cache.go ``defaultUpperBoundCapacity``); one window for all resources here, as small as a
#: test needs it to be (``Cluster.watch_cache.compact`` drops it at once).
DEFAULT_CAPACITY = 5_000


@dataclass(frozen=True)
class WatchEvent:
    version: int
    resource: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict
    previous: dict | None  # the object before a MODIFIED or DELETED (a selector may have matched only that)


@dataclass
class WatchCache:
    capacity: int = DEFAULT_CAPACITY
    events: deque[WatchEvent] = field(default_factory=deque)
    #: The oldest resourceVersion a watch may still start from (everything after it is in ``events``).
    oldest: int = 0
    seen: dict[str, dict[tuple[str, str], dict]] = field(default_factory=dict)

    def sync(self, cluster: Cluster) -> None:
        """Record what changed in the store since the last sync (under the cluster's lock)."""
        stamped: list[tuple[int, str, tuple[str, str], dict]] = []
        unstamped: list[tuple[str, tuple[str, str], dict]] = []
        gone: list[tuple[str, tuple[str, str], dict]] = []
        latest = self.events[-1].version if self.events else self.oldest
        for resource in RESOURCES:
            if "/" in resource:
                continue
            store, seen = cluster.objects.get(resource, {}), self.seen.setdefault(resource, {})
            for key, obj in store.items():
                before = seen.get(key)
                if before is not None and before == obj:
                    continue
                version = (obj.get("metadata") or {}).get("resourceVersion")
                fresh = before is None or version != before["metadata"].get("resourceVersion")
                if fresh and version and version.isdigit() and int(version) > latest:
                    stamped.append((int(version), resource, key, obj))
                else:
                    unstamped.append((resource, key, obj))
            gone.extend((resource, key, before) for key, before in seen.items() if key not in store)
        for version, resource, key, obj in sorted(stamped, key=lambda item: item[0]):
            self._record(cluster, version, resource, key, obj)
        for resource, key, obj in unstamped:
            cluster.version += 1
            obj.setdefault("metadata", {})["resourceVersion"] = str(cluster.version)
            self._record(cluster, cluster.version, resource, key, obj)
        for resource, key, before in gone:
            cluster.version += 1
            last = copy.deepcopy(before)
            last["metadata"]["resourceVersion"] = str(cluster.version)
            del self.seen[resource][key]
            self._append(WatchEvent(cluster.version, resource, "DELETED", last, before))

    def _record(self, cluster: Cluster, version: int, resource: str, key: tuple[str, str], obj: dict) -> None:
        cluster.version = max(cluster.version, version)
        before = self.seen[resource].get(key)
        now = copy.deepcopy(obj)
        self.seen[resource][key] = now
        self._append(WatchEvent(version, resource, "ADDED" if before is None else "MODIFIED", now, before))

    def _append(self, event: WatchEvent) -> None:
        self.events.append(event)
        while len(self.events) > self.capacity:
            self.oldest = self.events.popleft().version

    def since(self, version: int) -> list[WatchEvent] | None:
        """Events after ``version``, or None when some of them are no longer kept (410 Gone)."""
        if version < self.oldest:
            return None
        newer = []
        for event in reversed(self.events):
            if event.version <= version:
                break
            newer.append(event)
        return newer[::-1]

    def compact(self, cluster: Cluster) -> None:
        """Forget every event so far (etcd compaction): watches from an older version get 410."""
        self.sync(cluster)
        self.events.clear()
        self.oldest = cluster.version
