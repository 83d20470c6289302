"""Tier choice at its boundaries: exactly meeting a rate, a quota too small for any level, the ceiling."""

from __future__ import annotations

import pytest

from tasks.service_level import MIB, ThroughputNeed, choose_service_level, render_tier_markdown


def need_of(mib_per_second: float) -> ThroughputNeed:
    """A need of exactly ``mib_per_second`` (1 worker, 1 img/s, headroom 1)."""
    return ThroughputNeed(workers=1, images_per_second_per_worker=1.0, bytes_per_image=mib_per_second * MIB,
                          headroom=1.0)


def test_required_throughput_multiplies_workers_rate_size_and_headroom() -> None:
    need = ThroughputNeed(workers=8, images_per_second_per_worker=200, bytes_per_image=300 * 1024, headroom=1.5)
    assert need.mib_per_second() == pytest.approx(8 * 200 * 300 / 1024 * 1.5)


@pytest.mark.parametrize(("required", "quota", "level"), [
    (16.0, 1.0, "Standard"),     # exactly Standard's rate: Standard meets it
    (16.001, 1.0, "Premium"),    # a hair above: the next level
    (64.0, 1.0, "Premium"),
    (128.0, 1.0, "Ultra"),
    (64.0, 4.0, "Standard"),     # more quota, cheaper level
    (1.0, 0.0625, "Standard"),
])
def test_cheapest_level_that_meets_the_need(required: float, quota: float, level: str) -> None:
    assert choose_service_level(need_of(required), quota).level == level


def test_quota_too_small_for_any_level_says_what_would_do() -> None:
    choice = choose_service_level(need_of(300.0), 2.0)
    assert choice.level is None
    assert "no level meets 300.0 MiB/s at 2 TiB" in choice.reason and "2.34 TiB at Ultra" in choice.reason


def test_ceiling_caps_the_choice() -> None:
    assert choose_service_level(need_of(64.0), 1.0, ceiling="Premium").level == "Premium"
    capped = choose_service_level(need_of(100.0), 1.0, ceiling="Premium")
    assert capped.level is None and "above the ceiling Premium" in capped.reason
    assert "1.56 TiB at Premium" in capped.reason
    assert [o.allowed for o in capped.options] == [True, True, False]


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="ceiling 'Gold'"):
        choose_service_level(need_of(1.0), 1.0, ceiling="Gold")
    with pytest.raises(ValueError, match="quota_tib"):
        choose_service_level(need_of(1.0), 0)
    with pytest.raises(ValueError, match="workers"):
        ThroughputNeed(workers=0, images_per_second_per_worker=1, bytes_per_image=1)
    with pytest.raises(ValueError, match="headroom"):
        ThroughputNeed(workers=1, images_per_second_per_worker=1, bytes_per_image=1, headroom=0.5)


def test_reasoning_markdown_shows_every_level() -> None:
    need = ThroughputNeed(workers=4, images_per_second_per_worker=100, bytes_per_image=256 * 1024)
    text = render_tier_markdown(choose_service_level(need, 2.0), need)
    assert text.startswith("# Service level: Premium")
    assert "**125.0 MiB/s**" in text and "| Ultra | 256.0 | yes | yes |" in text
