"""The TTL-after-finished controller (kubernetes ``pkg/controller/ttlafterfinished``): it deletes finished
Jobs once their ``ttlSecondsAfterFinished`` has passed (``Cluster.advance`` moves its clock); the emulator
runs it once a second.
"""

from __future__ import annotations

import calendar
import time
from typing import TYPE_CHECKING

from tests.cluster.garbage_collector import delete

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def ttl_sweep(cluster: Cluster) -> None:
    """The TTL-after-finished controller (pkg/controller/ttlafterfinished ``processJob``): a Job whose
    Complete or Failed condition is older than ``ttlSecondsAfterFinished`` (``jobFinishTime``: that
    condition's lastTransitionTime) is deleted, Foreground."""
    now = time.time()
    for job in list(cluster.objects["jobs"].values()):
        ttl = job["spec"].get("ttlSecondsAfterFinished")
        if ttl is None or job["metadata"].get("deletionTimestamp"):
            continue
        finished = [c for c in (job.get("status") or {}).get("conditions") or []
                    if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"]
        finish = finished and calendar.timegm(time.strptime(finished[0]["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ"))
        if finished and finish + ttl <= now:
            delete(cluster, "jobs", job, "Foreground")
