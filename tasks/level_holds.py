"""Who holds a promoted volume's service level, and which level they need together (pure).

A volume's level is shared by every run that reads it. Runs do not own it: each run that trains on a
promoted volume *holds* it (joins before it trains, leaves when it ends), the level is chosen for what all
holders read together, and the volume returns home only when the last holder has left. The record of the
holds is kept where the platform can replace it atomically (``Platform.update_level_record``); this module
only decides what the record becomes.

A holder is a Prefect flow run. It is taken for dead, and its hold dropped, when its flow run has ended
(Crashed, Cancelled, Failed, Completed: it left without saying so) or when it has not renewed its hold
within the lifetime the hold states (a process killed outright leaves its flow run Running for good: only
the missing renewals tell). A holder taken for dead that was only cut off (its renewals could not get through:
an API outage) takes its hold again once one does, for as long as it still trains (``retaken``).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field

from tasks.service_level import SERVICE_LEVELS, choose_level_for

LEVEL_ORDER = [name for name, _ in SERVICE_LEVELS]


class LevelHold(BaseModel):
    """One run's claim on a volume's level: what it reads, and when it last said it is alive."""

    run: str = Field(description="the run's name (train-…), for people reading the record")
    mib_per_second: float = Field(ge=0, description="what the run reads while it trains")
    level: str = Field(description="the level this run alone would need (its home level when none fits)")
    renewed: float = Field(description="when the holder last renewed its hold (Unix time)")
    ttl_s: float = Field(gt=0, description="how long the hold lasts without a renewal: the holder renews it every "
                                           "quarter of this, and says so here for every reader of the record")


class LevelRecord(BaseModel):
    """A volume's home level and who holds it above that; no record: nobody has moved the volume."""

    home: str = Field(description="the level the volume returns to when nobody holds it")
    holds: dict[str, LevelHold] = Field(default_factory=dict, description="flow run id -> its hold")


def joined(record: LevelRecord | None, holder: str, hold: LevelHold, current_level: Callable[[], str]) -> LevelRecord:
    """The record with ``holder``'s hold (replacing an earlier one of its own: a retried join). The first
    holder records the volume's present level as home, read only once the record was found missing (so after
    the last holder of a record that was just removed had taken the volume home); later ones keep the home
    already recorded."""
    home = record.home if record is not None else current_level()
    holds = dict(record.holds) if record is not None else {}
    holds[holder] = hold
    return LevelRecord(home=home, holds=holds)


def renewed(record: LevelRecord | None, holder: str, now: float) -> LevelRecord | None:
    """The record with ``holder``'s renewal time moved to ``now``; unchanged when it holds nothing (it left,
    or another run dropped it for dead: a renewal alone never brings a dropped hold back, ``retaken`` does)."""
    if record is None or holder not in record.holds:
        return record
    return _with_renewal(record, holder, now)


def retaken(record: LevelRecord | None, holder: str, hold: LevelHold, now: float,
            current_level: Callable[[], str]) -> LevelRecord:
    """The record with ``holder``'s hold back as it was first taken, renewed ``now``: for a run that still trains
    but whose hold another run dropped for dead because its renewals could not get through within the hold's
    lifetime (an API outage, not a death). ``renewed`` never does this, so without it the volume stays below
    what the run needs, or the next settle moves it there. A hold still in the record is only renewed."""
    if record is not None and holder in record.holds:
        return _with_renewal(record, holder, now)
    return joined(record, holder, hold.model_copy(update={"renewed": now}), current_level)


def _with_renewal(record: LevelRecord, holder: str, now: float) -> LevelRecord:
    holds = {**record.holds, holder: record.holds[holder].model_copy(update={"renewed": now})}
    return record.model_copy(update={"holds": holds})


def without(record: LevelRecord | None, holders: set[str]) -> LevelRecord | None:
    """The record without the holds of ``holders`` (who left, or were found dead)."""
    if record is None:
        return None
    return record.model_copy(update={"holds": {k: v for k, v in record.holds.items() if k not in holders}})


def stale(record: LevelRecord | None, now: float) -> set[str]:
    """Holders that have not renewed their hold within its own lifetime."""
    if record is None:
        return set()
    return {holder for holder, hold in record.holds.items() if now - hold.renewed > hold.ttl_s}


def wanted_level(record: LevelRecord, quota_tib: float, ceiling: str) -> str:
    """The level the volume should be on for its holders: the cheapest one that feeds all of them at once
    (their reads add up on one volume), never below what any of them was promised alone, never above the
    ceiling (a cost guard), never below home. When no level within the ceiling feeds them all, the ceiling:
    the most they may have."""
    if not record.holds:
        return record.home
    together = choose_level_for(sum(hold.mib_per_second for hold in record.holds.values()), quota_tib, ceiling)
    wanted = max([*(hold.level for hold in record.holds.values()), together.level or ceiling], key=LEVEL_ORDER.index)
    capped = min(wanted, ceiling, key=LEVEL_ORDER.index)  # the ceiling is a cost guard, whoever promised more
    return max(record.home, capped, key=LEVEL_ORDER.index)


def describe(record: LevelRecord | None) -> str:
    """The holds in a line, for logs."""
    if record is None or not record.holds:
        return "nobody"
    return ", ".join(f"{hold.run} ({hold.mib_per_second:.1f} MiB/s)" for hold in record.holds.values())
