"""Stopping a training run early from outside, on its validation curve (a searching sweep's pruner).

Whoever starts a run in this process may register a *judge* under the run's name. The run's wait loop
(``wait_for_training``) tells it every periodic val score the trainer reports (``eval_every``); when the
judge answers with a reason, the wait loop leaves a stop request in the run's directory on the volume,
which the trainer reads between steps on every platform alike (a file on the shared volume needs neither
a signal nor a way into a pod): it checkpoints, ends with exit 0 and a ``stopped`` event, and the flow run
ends in the state the request names ("Pruned") instead of failing or being retried.

The registry is in memory because a sweep's children run in the sweep's own process (as subflows).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: The trainer's ``training.stop_request.STOP_REQUEST``, as a literal: the orchestrator depends on the file's
#: name, not on the trainer's modules (tests/test_train.py pins the two equal).
STOP_REQUEST = "stop-request.json"


@dataclass(frozen=True)
class StopVerdict:
    """A judge's decision to stop a run: why, and the state name its flow run ends in."""

    reason: str
    state: str = "Stopped"

    def request(self, step: int) -> bytes:
        """The stop request's file content (one JSON line: a torn write still reads as a request)."""
        return (json.dumps({"reason": self.reason, "state": self.state, "requested_at_step": step}) + "\n").encode()


#: step, val score (accuracy without the 200 ms rule) -> a verdict to stop the run, or None to go on.
Judge = Callable[[int, float], StopVerdict | None]

_judges: dict[str, Judge] = {}
_lock = threading.Lock()


@contextmanager
def judged_by(run: str, judge: Judge) -> Iterator[None]:
    """``judge`` hears run ``run``'s val scores while the block runs."""
    with _lock:
        if run in _judges:
            raise ValueError(f"run {run} already has a judge: two trials cannot share a run")
        _judges[run] = judge
    try:
        yield
    finally:
        with _lock:
            _judges.pop(run, None)


def judge_of(run: str) -> Judge | None:
    with _lock:
        return _judges.get(run)


def stop_request_path(run_dir: str) -> str:
    return f"{run_dir.rstrip('/')}/{STOP_REQUEST}"
