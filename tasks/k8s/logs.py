"""Following a container's log across reconnects and rotations, without losing or repeating lines (pure).

The kubelet rotates container logs (``containerLogMaxSize``, 10 MiB by default) and a plain read of
``pods/log`` then returns only the current file; counting lines already seen breaks at the first
rotation and re-reads the whole log on every poll. Instead the cluster platform follows the log
(``follow=true``: the kubelet keeps reading across rotations) with ``timestamps=true``, and when the
stream ends — idle, cut, or the container exited — opens it again with ``sinceSeconds`` covering
the last line it delivered. The overlap this re-sends is dropped here by timestamp.

A new stream reads only the container's current log file (the kubelet serves no rotated file), so lines
written and rotated away while the follower was reconnecting cannot be read again. The cursor notices:
the window always covers the last line delivered, so a stream that starts past it, without sending that
line again, starts after a gap. It records the gap for the caller to report (every training event is also
in the run's ``metrics.jsonl`` on the volume, which the pipeline reads for its records).

``sinceSeconds`` is whole seconds on the node's clock (the Python client has no ``sinceTime``), so the
window is widened by a margin; lines the window re-sends are recognised by their timestamps, which the
kubelet gives at nanosecond precision (RFC 3339 with up to nine fraction digits).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

#: Widening of the reconnect window: clock skew between this machine and the node it tolerates.
SINCE_MARGIN_S = 10
_STAMP = re.compile(r"^(?P<base>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(?P<fraction>\d{1,9}))?"
                    r"(?P<zone>Z|[+-]\d\d:\d\d)$")


class LogFormatError(ValueError):
    """A log line without the timestamp ``timestamps=true`` promises."""


def parse_timestamp(stamp: str) -> tuple[int, int]:
    """``(unix seconds, nanoseconds)`` of an RFC 3339 timestamp as the kubelet writes it (``RFC3339Nano``)."""
    match = _STAMP.match(stamp)
    if match is None:
        raise LogFormatError(f"'{stamp}' is not an RFC 3339 timestamp")
    zone = "+00:00" if match["zone"] == "Z" else match["zone"]
    seconds = int(datetime.fromisoformat(match["base"] + zone).timestamp())
    return seconds, int((match["fraction"] or "0").ljust(9, "0"))


def format_timestamp(stamp: tuple[int, int]) -> str:
    """RFC 3339 (UTC, nanoseconds) of a ``parse_timestamp`` result, for messages."""
    return datetime.fromtimestamp(stamp[0], tz=UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{stamp[1]:09d}Z"


def split_line(raw: str) -> tuple[tuple[int, int], str]:
    """``(timestamp, text)`` of one line of a ``timestamps=true`` log."""
    stamp, _, text = raw.rstrip("\r\n").partition(" ")
    return parse_timestamp(stamp), text


@dataclass
class LogCursor:
    """How far a follower got: the newest timestamp delivered and how many delivered lines carry it."""

    last: tuple[int, int] | None = None
    at_last: int = 0
    #: This machine's wall clock when the newest line arrived.
    received_at: float = 0.0
    #: Spans (newest stamp delivered before, first stamp after) of lines no stream could send.
    gaps: list[tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=list)
    _replayed_at_last: int = 0
    _source: str | None = None
    _expect_replay: bool = False

    def start_reading(self, source: str = "") -> None:
        """A new stream of ``source`` (a pod) starts: lines stamped exactly ``last`` come again and are
        counted afresh. Another source (a new pod) has nothing to replay."""
        self._replayed_at_last = 0
        self._expect_replay = self.last is not None and source == self._source
        self._source = source

    def accept(self, raw: str, now: float) -> str | None:
        """The line's text if it was not delivered before, else None (a reconnect's overlap)."""
        stamp, text = split_line(raw)
        if self.last is not None and stamp < self.last:
            return None
        if self._expect_replay:
            self._expect_replay = False
            if stamp > self.last:  # the window covered the last line, yet it did not come: rotated away
                self.gaps.append((self.last, stamp))
        if stamp == self.last:
            self._replayed_at_last += 1
            if self._replayed_at_last <= self.at_last:
                return None
            self.at_last += 1
        else:
            self.last, self.at_last, self._replayed_at_last = stamp, 1, 1
        self.received_at = now
        return text

    def since_seconds(self, now: float) -> int | None:
        """``sinceSeconds`` for the next stream: back to the newest delivered line, plus the margin.

        Measured both ways — from when that line arrived (covers a reader that fell behind) and from
        its own stamp (covers a node clock behind ours) — and the larger taken. None: from the start.
        """
        if self.last is None:
            return None
        stamp = self.last[0] + self.last[1] / 1e9
        return max(1, math.ceil(max(now - self.received_at, now - stamp)) + SINCE_MARGIN_S)
