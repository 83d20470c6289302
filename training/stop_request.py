"""Stop requests: the orchestrator's ``stop-request.json`` (stop for good) and SIGTERM or SIGUSR1 (checkpoint,
retry). SIGTERM reaches a rank from its worker pod's PID 1 (``training.mpi_entry``), or straight from the local
platform; SIGUSR1 from the launcher's, through mpirun, which forwards SIGUSR1 to every rank (OpenMPI 4.1
``mpirun(1)``, "Signal Propagation") and would end the job on a SIGTERM.

Kept apart from the training loop: the file's name and format are a contract with the orchestrator
(a sweep's pruner writes it), and the signal handling is one small piece the loop only polls.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger("laneflow.train")  # the trainer's logger, as before the split: its lines read the same

#: Ranks agree on stop signals and requests (one tiny allreduce) at least every this many steps, as they always have
#: (a fraction of a second where steps are fast: a GPU, a small model)... An elastic run checks at exactly every
#: this many steps, by the step count alone: a rank that joins knows at once when the next check is.
STOP_CHECK_MOST_EVERY = 5
#: ... and more often where steps are slow, so that a stop is heard within about this many seconds of training: a
#: pod told to stop has its grace period for the ranks to hear it, finish a step and checkpoint, and five steps of
#: a CPU run or a big model can be more than that (an elastic run's leaving worker may have even less: the host
#: discovery drops it as soon as its pod is marked for deletion).
STOP_HEARD_WITHIN_S = 2.0
#: In the run directory: asks the run to checkpoint and stop for good (JSON: reason, and the state the
#: orchestrator shows, e.g. "Pruned"). Removed by the run that honours it.
STOP_REQUEST = "stop-request.json"



def read_stop_request(run_dir: Path) -> dict | None:
    """The orchestrator's request to stop this run for good, if there is one. An empty file is a request
    still being written (looked at again at the next check); one that cannot be read as JSON still asks."""
    path = run_dir / STOP_REQUEST
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a volume hiccup must not stop rank 0 alone: the next check looks again
        log.warning("could not read %s (%s); looking again at the next check", path, exc)
        return None
    if not text:
        return None
    try:
        request = json.loads(text.splitlines()[-1])
    except ValueError:
        request = None
    if not isinstance(request, dict):
        return {"reason": f"{STOP_REQUEST} was found"}
    return {key: value for key, value in request.items() if key not in ("event", "step")}


def steps_between_checks(seconds_per_step: float, within_s: float = STOP_HEARD_WITHIN_S,
                         most: int = STOP_CHECK_MOST_EVERY) -> int:
    """How many steps go between two stop checks at this pace: as many as fit in ``within_s``, at least one."""
    if not seconds_per_step > 0:  # no pace measured (or a clock that did not move): check at the next step
        return 1
    return max(1, min(most, int(within_s // seconds_per_step)))


class Sums(Protocol):
    """What the cadence needs of the ranks: sums over every rank, one collective for all the values."""

    rank: int

    def sums(self, values: tuple[float, ...], name: str) -> tuple[float, ...]: ...


class StopCadence:
    """When the ranks next agree on a stop. Every rank must call the agreement at the same steps, so the next one is
    planned from rank 0's pace, which travels in the agreement's own allreduce (the other ranks add 0): no extra
    round trip, and every rank reads the same whole number."""

    def __init__(self, step: int) -> None:
        """The first check at the step after ``step`` (the run's start or its resume): no pace is known yet."""
        self.next_step, self._since = step + 1, (step, time.perf_counter())

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def agree(self, ranks: Sums, step: int, flags: tuple[bool, ...]) -> tuple[int, ...]:
        """For each flag, how many ranks raised it; and the next check planned."""
        last_step, last_time = self._since
        now = time.perf_counter()
        proposal = steps_between_checks((now - last_time) / max(1, step - last_step)) if ranks.rank == 0 else 0
        *counts, every = ranks.sums((*map(float, flags), float(proposal)), "stop")
        every = max(1, round(every))
        # On the multiples of the interval, as before the interval followed the pace: where steps are fast, the
        # checks fall on the same steps as they always did (every fifth), whatever happened since the start.
        self.next_step, self._since = (step // every + 1) * every, (step, now)
        return tuple(round(count) for count in counts)


#: The signals that ask a rank to checkpoint and exit 75 (see the module's docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Set by SIGTERM or SIGUSR1; checked between steps so a checkpoint is never written mid-step."""

    def __init__(self) -> None:
        self.requested = False
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        log.warning("received signal %d: checkpointing after this step", signum)
        self.requested = True
