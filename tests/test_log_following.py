"""Following a container log: timestamps, the reconnect cursor and its gaps, and a resumed run's record."""

from __future__ import annotations

import json

import pytest

from tasks.k8s.logs import LogCursor, LogFormatError, format_timestamp, parse_timestamp
from tasks.platforms.base import last_attempt, outcome_from_events


def test_log_timestamps_parse_at_nanosecond_precision() -> None:
    assert parse_timestamp("2026-11-30T23:59:59.000000001Z") == (1796083199, 1)
    assert parse_timestamp("2026-11-30T23:59:59.5Z") == (1796083199, 500_000_000)
    assert parse_timestamp("2026-12-01T01:59:59.000000001+02:00") == (1796083199, 1)
    with pytest.raises(LogFormatError):
        parse_timestamp("not-a-time")


def test_a_reconnect_drops_the_overlap_and_keeps_lines_sharing_a_timestamp() -> None:
    lines = ["2026-11-30T10:00:00.100000000Z a\n", "2026-11-30T10:00:00.200000000Z b\n",
             "2026-11-30T10:00:00.200000000Z c\n", "2026-11-30T10:00:01.000000000Z d\n"]
    cursor = LogCursor()
    cursor.start_reading()
    assert [cursor.accept(line, 0.0) for line in lines[:3]] == ["a", "b", "c"]
    # The stream was cut; the new one (sinceSeconds is whole seconds) starts before what we have.
    cursor.start_reading()
    assert [cursor.accept(line, 0.0) for line in lines] == [None, None, None, "d"]
    # A line arriving later with the same timestamp as the last one delivered is new.
    cursor.start_reading()
    assert cursor.accept(lines[3], 0.0) is None
    assert cursor.accept("2026-11-30T10:00:01.000000000Z e\n", 0.0) == "e"


def test_a_reconnect_that_starts_past_the_last_line_records_the_gap_it_could_not_read() -> None:
    cursor = LogCursor()
    cursor.start_reading("launcher-a")
    assert cursor.accept("2026-11-30T10:00:00.100000000Z a\n", 0.0) == "a"
    cursor.start_reading("launcher-a")  # the window covers "a", but the file was rotated: it starts at "d"
    assert cursor.accept("2026-11-30T10:00:02.000000000Z d\n", 0.0) == "d"
    assert cursor.gaps == [(parse_timestamp("2026-11-30T10:00:00.100000000Z"),
                            parse_timestamp("2026-11-30T10:00:02.000000000Z"))]
    assert format_timestamp(cursor.gaps[0][0]) == "2026-11-30T10:00:00.100000000Z"
    cursor.start_reading("launcher-a")  # an ordinary reconnect: "d" comes again first, then "e"
    assert [cursor.accept(line, 0.0) for line in ("2026-11-30T10:00:02.000000000Z d\n",
                                                  "2026-11-30T10:00:03.000000000Z e\n")] == [None, "e"]
    cursor.start_reading("launcher-b")  # another pod (the launcher replaced) has nothing to replay
    assert cursor.accept("2026-11-30T10:00:09.000000000Z f\n", 0.0) == "f"
    assert len(cursor.gaps) == 1


def test_a_resumed_runs_record_is_read_from_its_newest_start() -> None:
    record = "\n".join(json.dumps(e) for e in [
        {"event": "start", "step": 0, "total_steps": 4}, {"event": "step", "step": 1},
        {"event": "preempted", "step": 1},
        {"event": "start", "step": 1, "total_steps": 4}, {"event": "step", "step": 4}, {"event": "done", "step": 4}])
    assert [e["event"] for e in last_attempt(record + "\n")] == ["start", "step", "done"]
    assert outcome_from_events("j", last_attempt(record), 1.0, []).resumed_from == 1


def test_an_attempt_that_resumed_at_its_last_step_ends_where_it_started() -> None:
    """An earlier attempt's ranks trained to the end, but its launcher was lost before it could report: the
    replacement resumes at the last step and trains none — it ended there, not at step 0."""
    events = [{"event": "start", "step": 16, "total_steps": 16, "resumed": True},
              {"event": "eval", "split": "val", "accuracy": 0.5}]
    outcome = outcome_from_events("j", events, 1.0, [])
    assert (outcome.resumed_from, outcome.steps, outcome.total_steps) == (16, 16, 16)


def test_the_reconnect_window_covers_the_last_line_on_either_clock() -> None:
    cursor = LogCursor()
    assert cursor.since_seconds(100.0) is None  # nothing yet: from the start
    stamp = parse_timestamp("2026-11-30T10:00:00.500000000Z")[0]
    cursor.start_reading()
    cursor.accept("2026-11-30T10:00:00.500000000Z x", now=stamp + 30.0)  # read 30 s late (a reader behind)
    assert cursor.since_seconds(stamp + 42.0) == 42 + 10  # from its stamp: 41.5 s ago, plus the margin
    assert cursor.since_seconds(stamp + 32.0) == 32 + 10
