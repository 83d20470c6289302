"""Who holds a volume's service level, and the level they need together (``tasks.level_holds``, pure)."""

from __future__ import annotations

import pytest

from tasks.level_holds import LevelHold, LevelRecord, joined, renewed, retaken, stale, wanted_level, without
from tasks.service_level import MIB, ThroughputNeed, choose_service_level

#: 2 workers x 200 img/s x 256 KiB x 1.25 headroom: 125 MiB/s, which a 2 TiB volume gets on Premium (128).
NEED = ThroughputNeed(workers=2, images_per_second_per_worker=200, bytes_per_image=256 * 1024)


def hold(run: str, need: ThroughputNeed = NEED, renewed_at: float = 1000.0, quota_tib: float = 2.0,
         ttl_s: float = 600.0) -> LevelHold:
    level = choose_service_level(need, quota_tib).level or "Ultra"
    return LevelHold(run=run, mib_per_second=need.mib_per_second(), level=level, renewed=renewed_at, ttl_s=ttl_s)


def on(level: str):
    """The volume's present level, as ``joined`` asks for it (only when there is no record)."""
    return lambda: level


def test_the_first_holder_records_home_and_later_ones_keep_it() -> None:
    first = joined(None, "run-a", hold("train-a"), on("Standard"))
    assert first.home == "Standard" and set(first.holds) == {"run-a"}
    # The volume is on Premium by now (the first holder moved it): home stays what it was before anyone did.
    second = joined(first, "run-b", hold("train-b"), on("Premium"))
    assert second.home == "Standard" and set(second.holds) == {"run-a", "run-b"}
    again = joined(second, "run-a", hold("train-a", renewed_at=2000.0), on("Premium"))
    assert len(again.holds) == 2 and again.holds["run-a"].renewed == 2000.0  # a retried join replaces its own


def test_the_level_feeds_every_holder_at_once() -> None:
    one = joined(None, "run-a", hold("train-a"), on("Standard"))
    assert NEED.mib_per_second() == pytest.approx(125.0)
    assert wanted_level(one, quota_tib=2.0, ceiling="Ultra") == "Premium"  # 128 MiB/s >= 125
    two = joined(one, "run-b", hold("train-b"), on("Premium"))
    assert wanted_level(two, quota_tib=2.0, ceiling="Ultra") == "Ultra"  # 250 MiB/s: only Ultra's 256 feeds both
    assert wanted_level(two, quota_tib=2.0, ceiling="Premium") == "Premium"  # the most they may have
    assert wanted_level(without(two, {"run-a", "run-b"}), quota_tib=2.0, ceiling="Ultra") == "Standard"


def test_a_holder_that_joins_never_lowers_the_level() -> None:
    """Three runs of 125 MiB/s on 2 TiB: no level feeds 375 MiB/s, so they get the ceiling — not less than the
    two had (Ultra), nor less than any one was promised."""
    record = None
    levels = []
    for name in ("a", "b", "c"):
        record = joined(record, f"run-{name}", hold(f"train-{name}"), on("Standard"))
        levels.append(wanted_level(record, quota_tib=2.0, ceiling="Ultra"))
    assert levels == ["Premium", "Ultra", "Ultra"]
    needy = ThroughputNeed(workers=8, images_per_second_per_worker=200, bytes_per_image=256 * 1024)  # 500 MiB/s
    alone = joined(None, "run-big", hold("train-big", need=needy), on("Standard"))
    assert alone.holds["run-big"].level == "Ultra" and wanted_level(alone, 2.0, "Premium") == "Premium"


def test_the_level_never_drops_below_home() -> None:
    small = ThroughputNeed(workers=1, images_per_second_per_worker=1, bytes_per_image=MIB)
    record = joined(None, "run-a", hold("train-a", need=small), on("Premium"))
    assert record.holds["run-a"].level == "Standard" and wanted_level(record, 2.0, "Ultra") == "Premium"


def test_a_silent_holder_is_stale_and_a_renewal_never_brings_a_dropped_hold_back() -> None:
    record = joined(joined(None, "run-a", hold("train-a", renewed_at=1000.0), on("Standard")), "run-b",
                    hold("train-b", renewed_at=1500.0, ttl_s=60.0), on("Premium"))
    assert stale(record, now=1560.0) == set()
    assert stale(record, now=1561.0) == {"run-b"}  # each hold by its own lifetime: b's is a minute
    assert stale(record, now=1601.0) == {"run-a", "run-b"}  # a: 601 s silent
    record = renewed(record, "run-a", now=2000.0)
    assert stale(record, now=2101.0) == {"run-b"}
    dropped = without(record, {"run-a"})
    assert renewed(dropped, "run-a", now=3000.0) == dropped and renewed(None, "run-a", now=3000.0) is None


def test_a_holder_dropped_during_an_outage_takes_its_hold_back_as_it_was_first_taken() -> None:
    """Issue 49: b's renewals could not get through for longer than its hold's lifetime, another run's settle
    dropped it for dead and the volume would go down to what a alone needs; when b's renewal gets through again
    it still trains, and the level it needs comes back with its hold."""
    slow = ThroughputNeed(workers=1, images_per_second_per_worker=1, bytes_per_image=MIB)  # Standard
    first = hold("train-b", renewed_at=1000.0, ttl_s=60.0)
    record = joined(joined(None, "run-a", hold("train-a", need=slow), on("Standard")), "run-b", first, on("Premium"))
    assert wanted_level(record, 2.0, "Ultra") == "Premium"
    assert stale(record, now=1061.0) == {"run-b"}
    dropped = without(record, {"run-b"})
    assert wanted_level(dropped, 2.0, "Ultra") == "Standard"  # where the dropping settle takes the volume
    assert renewed(dropped, "run-b", now=1100.0) == dropped  # a renewal alone brings nothing back

    back = retaken(dropped, "run-b", first, now=1100.0, current_level=on("Ultra"))
    assert back.home == "Standard"  # the record's home, not the level the volume is on
    assert back.holds["run-b"] == first.model_copy(update={"renewed": 1100.0})  # its own need, renewed now
    assert back.holds["run-a"] == record.holds["run-a"]
    assert wanted_level(back, 2.0, "Ultra") == "Premium" and stale(back, now=1160.0) == set()
    # The last holder was dropped: the record went with the volume home; the first to hold again records home.
    alone = retaken(None, "run-b", first, now=1100.0, current_level=on("Standard"))
    assert alone.home == "Standard" and set(alone.holds) == {"run-b"}
    assert wanted_level(alone, 2.0, "Ultra") == "Premium"
    # A hold still in the record is only renewed, whatever the holder asks again.
    greedy = first.model_copy(update={"level": "Ultra", "mib_per_second": 500.0})
    assert retaken(record, "run-b", greedy, now=1100.0, current_level=on("Premium")) == renewed(record, "run-b", 1100.0)


def test_the_record_survives_its_json_form() -> None:
    record = joined(None, "1b4e28ba-2fa1-11d2-883f-0016d3cca427", hold("train-a"), on("Standard"))
    assert LevelRecord.model_validate_json(record.model_dump_json()) == record
