"""Waiting for something a test started (a server, a pod, a flow run) without a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T | None], timeout_s: float = 300, every_s: float = 1.0) -> T:
    """``check()``'s first truthy answer, asked every ``every_s``; a failed assertion naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(every_s)
    return found
