"""Keeping a hold alive: a record that names this process (a volume's service-level hold, a sweep's study) is
renewed in the background, every quarter of its lifetime, until it is let go or somebody else took it.

Why a quarter: a renewal that fails (an API blip) is logged and tried again a period later, so a hold outlives
three failed renewals in a row before others may take it for dead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


def renew_until(stop: threading.Event, every_s: float, renew: Callable[[], bool], what: str,
                log: logging.Logger) -> None:
    """Call ``renew`` every ``every_s`` until ``stop`` is set or ``renew`` answers False (the hold is gone: it
    says why itself). A renewal that raises is logged to ``log`` as ``could not renew <what>`` and tried
    again."""
    while not stop.wait(every_s):
        try:
            held = renew()
        except Exception as exc:  # the next renewal may get through; the hold lasts four periods
            log.warning("could not renew %s: %s", what, exc)
            continue
        if not held:
            return
