"""One sweep per study: a searching sweep holds its kept study for as long as it runs.

Two sweeps appending to one Optuna journal corrupt it silently (Optuna replays a trial's id from its position
in the file, so one sweep's scores land on the other's trials). So the sweep that opens a kept study first
records itself as its holder, in a record the platform replaces atomically (``update_volume_record``: a
``flock``-ed file on the local platform, a PV annotation written with a resourceVersion precondition on a
cluster), renews it while it runs and removes it when it ends. Another sweep is refused at once, naming the
holder, or waits for it when asked to.

A holder that died is recognised: its process is gone (the record names its host, pid and the process's
start time; on the same host that is checked directly: a killed sweep), its flow run has ended (the Prefect
API says so: a cancelled or crashed sweep), or it has not renewed within its lifetime (a pod on another
node that died, another Prefect server's run). Before
every write to the journal the holder confirms it still holds the study, so a sweep that was taken for dead
(its renewals lost for a whole lifetime) stops instead of interleaving its appends with its successor's.

Pure rules first (``StudyHolder``, ``claimed``, ``released``); the shell that talks to the platform after.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tasks.holding import flow_run_ended
from tasks.platforms.base import Platform, VolumeRef
from tasks.renewal import renew_until

_LOG = logging.getLogger("laneflow.study")
#: How long a holder's claim lasts without renewal; it renews every quarter of that.
HOLD_TTL_S = 300.0


class StudyBusy(RuntimeError):
    """Another live sweep holds the study."""


class StudyLost(RuntimeError):
    """This sweep's hold on its study was taken over (it was taken for dead): it must not write any more."""


class StudyHolder(BaseModel):
    """Who holds a study: the sweep's flow run (id and name), since when, and its last renewal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep: str = Field(min_length=1, description="the holding sweep's flow run id")
    name: str = Field(description="the holding sweep's flow run name")
    since: float
    renewed: float
    ttl_s: float = Field(gt=0)
    host: str = ""
    pid: int = 0
    #: The process's start time as /proc says it (clock ticks since boot): a pid reused later is another process.
    process_start: str = ""

    def stale(self, now: float) -> bool:
        return now - self.renewed > self.ttl_s

    def describe(self) -> str:
        started = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"sweep {self.name} (flow run {self.sweep}, holding it since {started})"


def record_key(study: str) -> str:
    """The volume record that names a study's holder."""
    return f"study.{study}"


def parse_holder(raw: str | None) -> StudyHolder | None:
    """The holder a record names (None: nobody). A record that is not one is an error naming what to do."""
    if raw is None:
        return None
    try:
        return StudyHolder.model_validate_json(raw)
    except ValueError:
        raise ValueError(f"the study's holder record is not laneflow's ({raw[:200]!r}); if no sweep of this study "
                         "runs, remove it (kubectl annotate pvc <claim> laneflow.io/study.<study>- on a cluster, or "
                         "delete .laneflow/records/study.<study>.json on a local volume)") from None


def claimed(current: StudyHolder | None, me: StudyHolder, now: float, gone: Callable[[StudyHolder], bool]
            ) -> StudyHolder:
    """Who holds the study after ``me`` asks for it: ``me`` (renewed) when it is free, already mine, or held
    by a sweep that is silent past its lifetime or ``gone`` (its process or flow run ended); else ``current``."""
    if current is None or current.sweep == me.sweep:
        return me if current is None else me.model_copy(update={"since": current.since, "renewed": now})
    if current.stale(now) or gone(current):
        return me
    return current


def released(current: StudyHolder | None, sweep: str) -> StudyHolder | None:
    """The record once ``sweep`` lets go: gone if it was the holder, untouched if another sweep holds it."""
    return None if current is not None and current.sweep == sweep else current


# --- the shell: the record on the platform --------------------------------------------------------------

def process_start(pid: int) -> str:
    """The start time of process ``pid`` (field 22 of /proc/<pid>/stat), "" when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # after the command, which may hold spaces: fields 3.. of stat


def holder_gone(holder: StudyHolder) -> bool:
    """The holder's sweep is over: its process is gone (when it ran on this host), or its flow run ended."""
    here = holder.host and holder.host == socket.gethostname() and holder.pid
    if here and process_start(holder.pid) != holder.process_start:
        return True
    return flow_run_ended(holder.sweep)


class StudyLease:
    """This sweep's hold on a study, renewed in the background until ``release``."""

    def __init__(self, platform: Platform, volume: VolumeRef, study: str, me: StudyHolder,
                 took_over_from: StudyHolder | None = None) -> None:
        self.platform, self.volume, self.study, self.me = platform, volume, study, me
        #: The sweep this one found dead and took the study from (None: the study was free): what that sweep's
        #: process left behind (its trials' runs, their slots) is for this one to clean up.
        self.took_over_from = took_over_from
        self._stop = threading.Event()
        self._lost: StudyHolder | None = None
        self._thread = threading.Thread(target=self._renew_until_released, daemon=True,
                                        name=f"laneflow-study-{study}")

    def start(self) -> None:
        self._thread.start()

    def _update(self) -> StudyHolder | None:
        """Renew, or learn who took the study over; the holder the record names afterwards."""
        def change(raw: str | None) -> str | None:
            current = parse_holder(raw)
            if current is not None and current.sweep != self.me.sweep:
                return raw  # taken over: leave the new holder's record alone
            return claimed(current, self.me, time.time(), lambda _: False).model_dump_json()

        return parse_holder(self.platform.update_volume_record(self.volume, record_key(self.study), change))

    def confirm(self) -> None:
        """Renew the hold now, or raise ``StudyLost`` if another sweep holds the study (before a write)."""
        if self._lost is None:
            holder = self._update()
            if holder is None or holder.sweep != self.me.sweep:
                self._lost = holder
        if self._lost is not None or self._stop.is_set():
            who = self._lost.describe() if self._lost else "nobody (it was released)"
            raise StudyLost(f"study {self.study!r} is now held by {who}: this sweep was taken for dead and writes "
                            "nothing more to it")

    def _renew_until_released(self) -> None:
        def still_held() -> bool:
            holder = self._update()
            if holder is None or holder.sweep != self.me.sweep:
                self._lost = holder
                _LOG.warning("study %s was taken over by %s: this sweep writes nothing more to it", self.study,
                             holder.describe() if holder else "nobody")
                return False
            return True

        renew_until(self._stop, self.me.ttl_s / 4, still_held, f"this sweep's hold on study {self.study}", _LOG)

    def release(self) -> None:
        """Stop renewing and remove the record if it is still this sweep's. Never raises: a record left behind
        times out (``ttl_s``), and the sweep's ended flow run frees it at once for the next one."""
        self._stop.set()
        try:
            self.platform.update_volume_record(
                self.volume, record_key(self.study),
                lambda raw: None if (h := parse_holder(raw)) is not None and h.sweep == self.me.sweep else raw)
        except Exception as exc:
            _LOG.warning("could not release study %s (%s): the next sweep of it takes it over once this sweep's "
                         "run has ended or its hold timed out", self.study, exc)


def _ask(platform: Platform, volume: VolumeRef, study: str, me: StudyHolder, gone: Callable[[StudyHolder], bool]
         ) -> tuple[StudyHolder, StudyHolder | None]:
    """(the holder after ``me`` asked, the holder before it), in one atomic update of the record."""
    before: list[StudyHolder | None] = [None]

    def change(raw: str | None) -> str | None:
        now = time.time()
        before[0] = current = parse_holder(raw)
        holder = claimed(current, me.model_copy(update={"since": now, "renewed": now}), now, gone)
        return raw if holder is current else holder.model_dump_json()

    after = parse_holder(platform.update_volume_record(volume, record_key(study), change))
    if after is None:
        raise RuntimeError(f"the record of who holds study {study!r} vanished while it was written")
    return after, before[0]


@contextmanager
def holding_study(platform: Platform, volume: VolumeRef, study: str, sweep: str, sweep_name: str, wait: bool,
                  log: Callable[[str], None], ttl_s: float = HOLD_TTL_S,
                  gone: Callable[[StudyHolder], bool] = holder_gone) -> Iterator[StudyLease]:
    """Hold ``study`` (on ``volume``) for the block: taken at once when free or its holder is gone; when a live
    sweep holds it, ``StudyBusy`` naming that sweep, or with ``wait`` a wait until it lets go."""
    now = time.time()
    me = StudyHolder(sweep=sweep, name=sweep_name, since=now, renewed=now, ttl_s=ttl_s, host=socket.gethostname(),
                     pid=os.getpid(), process_start=process_start(os.getpid()))
    announced = None
    while True:
        holder, before = _ask(platform, volume, study, me, gone)
        if holder.sweep == sweep:
            break
        if not wait:
            raise StudyBusy(f"study {study!r} on volume '{volume.name}' is held by {holder.describe()}: two sweeps "
                            "on one study would corrupt it. Wait for that sweep to end (or cancel it), run this one "
                            "with wait_for_study=true to queue behind it, or name another study")
        if announced != holder.sweep:
            log(f"study {study!r} is held by {holder.describe()}: waiting for it to end")
            announced = holder.sweep
        time.sleep(min(10.0, ttl_s / 4))
    took_over = before if before is not None and before.sweep != sweep else None
    if took_over is not None:
        log(f"study {study!r} was held by {took_over.describe()}, which is gone: this sweep takes it over")
    lease = StudyLease(platform, volume, study, holder, took_over)
    lease.start()
    try:
        yield lease
    finally:
        lease.release()
