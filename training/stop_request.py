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
from pathlib import Path

log = logging.getLogger("laneflow.train")  # the trainer's logger, as before the split: its lines read the same

#: Ranks agree on a stop request (one tiny allreduce) every this many steps, not every step.
STOP_CHECK_EVERY = 5
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
