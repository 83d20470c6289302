"""Names of volumes, runs and snapshots: the Kubernetes name rule, stable run names, snapshot names that fit."""

from __future__ import annotations

from uuid import UUID

import pytest

from tasks.names import InvalidName, run_name, snapshot_name, validate_name


@pytest.mark.parametrize("bad", ["", "Upper", "under_score", "-lead", "trail-", "a" * 64, "dot.ted"])
def test_invalid_names_are_refused_with_the_rule(bad: str) -> None:
    with pytest.raises(InvalidName, match="volume name"):
        validate_name(bad, "volume")


def test_run_name_is_deterministic_per_flow_run() -> None:
    flow_run = UUID("7d2eaa95-c8df-43a7-b772-5e3435d03a6e")
    assert run_name(flow_run) == run_name(str(flow_run)) == "train-7d2eaa95c8df"
    assert run_name(flow_run, prefix="restore") == "restore-7d2eaa95c8df"
    assert run_name(flow_run, key="lanes-3") == run_name("00000000-0000-0000-0000-000000000000", key="lanes-3") \
        == "train-lanes-3"  # a keyed run is the same run whatever flow run resumes it
    for bad in ("Lanes", "-x", "a" * 25):
        with pytest.raises(ValueError, match="run_key"):
            run_name(flow_run, key=bad)


def test_snapshot_name_fits_63_characters_and_keeps_the_run() -> None:
    name = snapshot_name("v" * 60, "train-7d2eaa95c8df")
    assert len(name) <= 63 and name.endswith("-train-7d2eaa95c8df")
    assert snapshot_name("demo", "train-1") == "demo-train-1"
