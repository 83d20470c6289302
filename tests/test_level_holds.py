"""Who holds a volume's service level, and the level they need together (``tasks.level_holds``, pure)."""

from __future__ import annotations

import pytest

from tasks.level_holds import LevelHold, LevelRecord, joined, renewed, stale, wanted_level, without
from tasks.service_level import MIB, ThroughputNeed, choose_service_level

#: 2 workers x 200 img/s x 256 KiB x 1.25 headroom: 125 MiB/s, which a 2 TiB volume gets on Premium (128).
NEED = ThroughputNeed(workers=2, images_per_second_per_worker=200, bytes_per_image=256 * 1024)


def hold(run: str, need: ThroughputNeed = NEED, renewed_at: float = 1000.0, quota_tib: float = 2.0) -> LevelHold:
    level = choose_service_level(need, quota_tib).level or "Standard"
    return LevelHold(run=run, mib_per_second=need.mib_per_second(), level=level, renewed=renewed_at)


def test_the_first_holder_records_home_and_later_ones_keep_it() -> None:
    first = joined(None, "run-a", hold("train-a"), current_level="Standard")
    assert first.home == "Standard" and set(first.holds) == {"run-a"}
    # The volume is on Premium by now (the first holder moved it): home stays what it was before anyone did.
    second = joined(first, "run-b", hold("train-b"), current_level="Premium")
    assert second.home == "Standard" and set(second.holds) == {"run-a", "run-b"}
    again = joined(second, "run-a", hold("train-a", renewed_at=2000.0), current_level="Premium")
    assert len(again.holds) == 2 and again.holds["run-a"].renewed == 2000.0  # a retried join replaces its own


def test_the_level_feeds_every_holder_at_once() -> None:
    one = joined(None, "run-a", hold("train-a"), "Standard")
    assert NEED.mib_per_second() == pytest.approx(125.0)
    assert wanted_level(one, quota_tib=2.0, ceiling="Ultra") == "Premium"  # 128 MiB/s >= 125
    two = joined(one, "run-b", hold("train-b"), "Premium")
    assert wanted_level(two, quota_tib=2.0, ceiling="Ultra") == "Ultra"  # 250 MiB/s: only Ultra's 256 feeds both
    # Above the ceiling together: each still gets what it was promised alone.
    assert wanted_level(two, quota_tib=2.0, ceiling="Premium") == "Premium"
    assert wanted_level(without(two, {"run-a", "run-b"}), quota_tib=2.0, ceiling="Ultra") == "Standard"


def test_the_level_never_drops_below_home() -> None:
    small = ThroughputNeed(workers=1, images_per_second_per_worker=1, bytes_per_image=MIB)
    record = joined(None, "run-a", hold("train-a", need=small), current_level="Premium")
    assert record.holds["run-a"].level == "Standard" and wanted_level(record, 2.0, "Ultra") == "Premium"


def test_a_silent_holder_is_stale_and_a_renewal_never_brings_a_dropped_hold_back() -> None:
    record = joined(joined(None, "run-a", hold("train-a", renewed_at=1000.0), "Standard"), "run-b",
                    hold("train-b", renewed_at=1500.0), "Premium")
    assert stale(record, now=1600.0, ttl_s=600.0) == set()
    assert stale(record, now=1601.0, ttl_s=600.0) == {"run-a"}  # 601 s silent
    record = renewed(record, "run-a", now=2000.0)
    assert stale(record, now=2101.0, ttl_s=600.0) == {"run-b"}  # a renewed at 2000; b silent since 1500
    dropped = without(record, {"run-a"})
    assert renewed(dropped, "run-a", now=3000.0) == dropped and renewed(None, "run-a", now=3000.0) is None


def test_the_record_survives_its_json_form() -> None:
    record = joined(None, "1b4e28ba-2fa1-11d2-883f-0016d3cca427", hold("train-a"), "Standard")
    assert LevelRecord.model_validate_json(record.model_dump_json()) == record
