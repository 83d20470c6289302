"""Holding a volume's service level: join, renew, leave, and settle the volume on what its holders need.

The imperative shell around ``tasks.level_holds``: the record lives on the platform (which replaces it
atomically), a holder's liveness is read from the Prefect API, and the volume is moved through the
platform. Every run that may move a volume *settles* it: reads the record, drops the holds of dead runs,
and moves the volume to the level the live holders need — and reads again after each move, because a run
that joined or left during the move may want another level. Whoever moves last leaves the volume where the
record says, so overlapping joins and leaves converge instead of undoing each other.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from typing import Any

from prefect import get_client
from prefect.events import emit_event
from prefect.exceptions import ObjectNotFound

from tasks.level_holds import (
    LEVEL_ORDER,
    LevelHold,
    LevelRecord,
    describe,
    joined,
    renewed,
    retaken,
    stale,
    wanted_level,
    without,
)
from tasks.platforms.base import NoServiceLevel, Platform, ServiceLevelBusy, VolumeRef
from tasks.renewal import renew_until

_LOG = logging.getLogger("laneflow.service_level")
#: Tries one settle makes at most: each move (or refusal of one) is followed by a fresh read, so more means
#: the holders keep changing.
_SETTLE_MOVES = 8


def flow_run_ended(holder: str) -> bool:
    """True when the holder's flow run is over (any final state); False while it runs, and whenever this
    Prefect API cannot say — a run it does not know (another Prefect server's, on a cluster they share), or an
    API that does not answer: a hold is never dropped on a guess, its missing renewals time it out."""
    try:
        run_id = uuid.UUID(holder)
    except ValueError:
        return False
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
    except ObjectNotFound:
        return False
    except Exception as exc:
        _LOG.warning("could not read flow run %s to see whether it still holds its volume's level: %s", holder, exc)
        return False
    return run.state is not None and run.state.is_final()


def dead_holders(record: LevelRecord | None, keep: str | None) -> set[str]:
    """The holders of ``record`` that are gone: silent past the hold's lifetime, or their flow run ended.
    ``keep`` (the caller itself) is never counted."""
    if record is None:
        return set()
    dead = stale(record, time.time())
    dead |= {holder for holder in record.holds if holder not in dead and holder != keep and flow_run_ended(holder)}
    dead.discard(keep or "")
    return dead


def changed_level(volume: VolumeRef, before: str, after: str, why: str, record: LevelRecord | None,
                  logger: Any) -> None:
    logger.info("service level of %s: %s -> %s (%s; held by %s)", volume.name, before, after, why, describe(record))
    emit_event("laneflow.service_level.changed",
               resource={"prefect.resource.id": f"laneflow.volume.{volume.name}", "prefect.resource.name": volume.name},
               payload={"from": before, "to": after, "why": why,
                        "holders": sorted(h.run for h in (record.holds.values() if record else []))})


def settle(platform: Platform, volume: VolumeRef, why: str, logger: Any, me: str | None = None
           ) -> tuple[LevelRecord | None, str]:
    """Put the volume on the level its live holders need (home when none is left) and return the record and
    the level it is on. The holds of dead runs are dropped on the way; a record with nobody left and the
    volume home is removed (nobody has moved the volume any more)."""
    current = LEVEL_ORDER[0]
    home: str | None = None  # the volume's home level, once a record read here has said it
    for _ in range(_SETTLE_MOVES):
        # The level first: reading it waits out any operation on the volume, so the record read next is the
        # one to decide on, not one from before that operation.
        current = platform.current_service_level(volume) or current
        record = platform.level_record(volume)
        dead = dead_holders(record, keep=me)
        if dead:
            logger.warning("service level of %s: dropping the holds of %s, which ended without leaving (their flow "
                           "run is over, or they were silent past their hold's lifetime: killed)", volume.name,
                           ", ".join(sorted(record.holds[h].run for h in dead)))
            record = platform.update_level_record(volume, lambda r, dead=dead: without(r, dead))
        if record is None:
            # Forgotten by a settle that found the volume home and unheld. A move this settle decided on an
            # earlier read (another holder was still there) may have landed after that: nobody holds the volume
            # now, so it goes home — two runs leaving at once left it on Premium otherwise (soak seed 11).
            if home is None or current == home:
                return None, current
            target = home
        else:
            home = record.home
            quota_tib, ceiling = platform.service_level_limits(volume) or (0.0, LEVEL_ORDER[-1])
            target = wanted_level(record, quota_tib, ceiling) if quota_tib > 0 else record.home
            if current == target:
                if not record.holds:  # home and unheld: forget it, unless someone joined meanwhile
                    platform.update_level_record(volume, lambda r: None if r is not None and not r.holds else r)
                return record, current
        try:
            if platform.change_service_level(volume, target):
                changed_level(volume, current, target, why, record, logger)
        except ServiceLevelBusy as busy:  # another operation runs: wait for it (above) and decide again
            logger.info("service level of %s: %s; deciding again once it ends", volume.name, busy)
    raise RuntimeError(f"the service level of {volume.name} did not settle after {_SETTLE_MOVES} tries: its holders "
                       "kept changing, or the volume stayed busy; the next run that joins or leaves settles it")


class _Renewals:
    """One thread per hold this process has, renewing it every quarter of its lifetime until it leaves
    (``tasks.renewal``), and taking it again when another run dropped it for dead while this one was only cut off
    from the API (``_retake``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stops: dict[tuple[str, str], threading.Event] = {}

    def start(self, platform: Platform, volume: VolumeRef, holder: str, hold: LevelHold) -> None:
        key = (volume.name, holder)
        with self._lock:
            if key in self._stops:
                return
            stop = self._stops[key] = threading.Event()
        # In a copy of this context: the Prefect settings it holds (the API that says whether a run ended) are
        # context variables.
        threading.Thread(target=contextvars.copy_context().run,
                         args=(self._renew, platform, volume, holder, hold, key, stop), daemon=True,
                         name=f"laneflow-hold-{volume.name}").start()

    def stop(self, volume: VolumeRef, holder: str) -> None:
        with self._lock:
            stop = self._stops.pop((volume.name, holder), None)
        if stop is not None:
            stop.set()

    def _renew(self, platform: Platform, volume: VolumeRef, holder: str, hold: LevelHold, key: tuple[str, str],
               stop: threading.Event) -> None:
        heard = hold.renewed  # when a renewal last got through: how long an outage lasted
        unsettled = False  # taken again but not settled since (that settle failed): the next renewal settles

        def still_held() -> bool:
            nonlocal heard, unsettled
            record = platform.update_level_record(volume, lambda r: renewed(r, holder, time.time()))
            if record is None or holder not in record.holds:
                if stop.is_set():  # it is leaving: gone is what it wants
                    return False
                if flow_run_ended(holder):  # every settle would drop it again
                    _LOG.warning("the hold on %s's service level was dropped by another run, and this run's flow run "
                                 "is over; it no longer keeps the volume promoted", volume.name)
                    return False
                unsettled = True  # from here on, until a settle gets through: the hold may be back already
                if not _retake(platform, volume, holder, hold, stop, time.time() - heard):
                    return False
            heard = time.time()
            if unsettled:  # up to the level it needs again (a pool change: well within the hold just renewed)
                settle(platform, volume, f"{hold.run} took its dropped hold again", _LOG, me=holder)
                unsettled = False
            return True

        renew_until(stop, hold.ttl_s / 4, still_held, f"the hold on {volume.name}'s service level", _LOG)
        with self._lock:  # a later join of the same holder starts renewing again
            if self._stops.get(key) is stop:
                del self._stops[key]


def _retake(platform: Platform, volume: VolumeRef, holder: str, hold: LevelHold, stop: threading.Event,
            silent_s: float) -> bool:
    """Put back the hold another run dropped for dead (``retaken``) while this run, still training, could not
    renew it for ``silent_s``: otherwise the volume stays on, or the next settle moves it to, a level below what
    the run reads. Never once it leaves: a hold put back as ``leave`` ran is taken out again, and the volume
    settled. True when it holds the volume again."""
    def level_now() -> str:  # read only when there is no record: the volume is then on its home level
        return platform.current_service_level(volume) or LEVEL_ORDER[0]

    took = False

    def change(record: LevelRecord | None) -> LevelRecord | None:
        nonlocal took
        took = not stop.is_set()
        return retaken(record, holder, hold, time.time(), level_now) if took else record

    platform.update_level_record(volume, change)
    if stop.is_set():
        if took:  # ``leave`` read the record before this write landed: take the hold out again
            platform.update_level_record(volume, lambda r: without(r, {holder}))
            settle(platform, volume, f"{hold.run} left", _LOG)
        return False
    why = (f"its renewals could not get through for {silent_s:.0f} s, past the hold's {hold.ttl_s:.0f} s lifetime: "
           "an API outage, taken for a death" if silent_s > hold.ttl_s else
           f"{silent_s:.0f} s after its last renewal, within the hold's {hold.ttl_s:.0f} s lifetime: its flow run was "
           "read as over, or the record was edited")
    _LOG.warning("service level of %s: the hold of %s (%.1f MiB/s, %s) was dropped by another run (%s); the run still "
                 "trains, so it holds the volume's level again and settles it", volume.name, hold.run,
                 hold.mib_per_second, hold.level, why)
    return True


RENEWALS = _Renewals()


def join(platform: Platform, volume: VolumeRef, holder: str, hold: LevelHold, logger: Any
         ) -> tuple[LevelRecord, str]:
    """Hold the volume's level for ``holder`` and settle the volume on what all holders need."""
    def level_now() -> str:  # read only when there is no record: the volume is then on its home level
        return platform.current_service_level(volume) or LEVEL_ORDER[0]

    platform.update_level_record(volume, lambda r: joined(r, holder, hold, level_now))
    RENEWALS.start(platform, volume, holder, hold)
    record, level = settle(platform, volume, f"{hold.run} joined", logger, me=holder)
    if record is None:  # another run dropped this hold between our write and our read: only if it was stale
        raise RuntimeError(f"the hold of {hold.run} on {volume.name} vanished as it was made")
    return record, level


def leave(platform: Platform, volume: VolumeRef, holder: str, run: str, logger: Any) -> tuple[LevelRecord | None, str]:
    """Give up ``holder``'s hold and settle the volume: home when it was the last holder. Raises what the
    settle raises (the volume may be left where it was)."""
    RENEWALS.stop(volume, holder)
    platform.update_level_record(volume, lambda r: without(r, {holder}))
    return settle(platform, volume, f"{run} left", logger)


def leave_quietly(platform: Platform, volume: VolumeRef, holder: str, run: str, why: str, logger: Any) -> bool:
    """``leave`` on the way out of a failure, a cancellation or a crash: never raises (the run's own error must
    stay the one reported), tries three times, and says loudly what to run when the volume stays promoted.
    True when the volume is where its holders want it."""
    RENEWALS.stop(volume, holder)  # whatever happens below, this process no longer keeps the hold alive
    error: Exception | None = None
    for attempt in range(3):  # a move that outlives its wait is waited for again by the next try
        try:
            if platform.current_service_level(volume) is None:
                return True  # no service levels here
            leave(platform, volume, holder, run, logger)
            return True
        except NoServiceLevel:
            return True  # no storage with levels behind the claim: nothing was ever promoted
        except ValueError as exc:  # a configuration error: trying again changes nothing
            error = exc
            break
        except Exception as exc:
            error = exc
            time.sleep(min(30.0, 2.0 ** attempt))
    try:
        record = platform.level_record(volume)
    except Exception:
        record = None
    home = record.home if record else "its home level"
    command = platform.service_level_command(volume, home) if record else None
    logger.error("LANEFLOW COULD NOT SETTLE volume %s after %s (%s): if nobody else holds it, it stays on its higher, "
                 "costlier level until moved. Run: %s — or run the pipeline again, which settles it first (the holds "
                 "are recorded on the volume)", volume.name, why, error, command or "move it in the Azure portal")
    print(f"laneflow: volume {volume.name} is NOT back on {home}: run {command or 'a pool change in the Azure portal'}")
    return False
