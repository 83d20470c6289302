"""One preparer at a time: an exclusive ``flock`` on a lock file of the volume.

Two preparations of one dataset on one volume at once (the nightly and a run started from the UI on a new
drop) would append to one ``.part`` download and share one staging folder; a partial folder could be renamed
over a complete one with its "extracted" marker. Under these locks the second preparer waits, saying once for
whom, and then finds the dataset ready. The lock belongs to the open file: a preparer that dies, however it
dies, releases it with its descriptor, and nothing stale is left to clean up.

Lock files live under ``<volume>/.laneflow/locks/`` and are never deleted (deleting a lock file another
process has open would let two holders in).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

log = logging.getLogger("laneflow.data.lock")

LOCKS_DIR = ".laneflow/locks"
#: A file system that cannot lock (an NFS mount whose lock manager is unreachable, say) answers these.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


def lock_file(volume: Path, kind: str, name: str) -> Path:
    """The lock file of ``kind`` ("dataset", "download") and ``name`` on ``volume``."""
    return Path(volume) / LOCKS_DIR / f"{kind}-{name}.lock"


def describe_holder(path: Path) -> str:
    """Who holds ``path``, as its holder wrote it down when it took the lock."""
    try:
        holder = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        holder = None
    if not isinstance(holder, dict):
        return "another process (it has not said who it is yet)"
    run = f", flow run {holder['flow_run']}" if holder.get("flow_run") else ""
    return (f"{holder.get('what', 'a preparation')} (pid {holder.get('pid')} on {holder.get('host')}{run}, "
            f"since {holder.get('since')})")


def _take(handle: IO[str], path: Path, what: str) -> None:
    """Block until ``handle`` holds the lock; one log line first when someone else holds it."""
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    log.info("%s waits for the other preparation to finish: %s holds %s", what, describe_holder(path), path)
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)


def _write_holder(handle: IO[str], what: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"what": what, "pid": os.getpid(), "host": socket.gethostname(),
                             "flow_run": os.environ.get("PREFECT__FLOW_RUN_ID"),
                             "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    handle.flush()


@contextmanager
def holding(path: Path, what: str) -> Iterator[None]:
    """Hold the exclusive lock ``path`` for ``what`` (a phrase naming this preparer's work) while inside.

    A file system without locks is said in a warning and the work goes on unlocked: the cluster platform
    already runs one preparation Job per volume and dataset, and failing there would help nobody."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            _take(handle, path, what)
            locked = True
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            log.warning("%s goes on without a lock: %s cannot be locked (%s); another preparation of it at the "
                        "same time could leave it incomplete", what, path, exc)
            locked = False
        if locked:
            _write_holder(handle, what)
        try:
            yield
        finally:
            if locked:  # the next waiter must not name a holder that has gone
                handle.seek(0)
                handle.truncate()
    # Closing the file released the lock (as the end of the process would have).
