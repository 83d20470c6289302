"""SIGTERM ends the data-stage commands at once, also where they run as a container's PID 1.

Linux gives a PID namespace's first process no default signal actions: a SIGTERM it has no handler for
is dropped (Docker's ``docker run --init`` reference: "A process running as PID 1 inside a container is
treated specially by Linux: it ignores any signal with the default action"). A Kubernetes Job whose pod
runs ``python -m training.data.prepare`` is therefore deleted only after its whole grace period (30 s by
default), its download or extraction writing to the volume all that time after laneflow reported the
Job deleted. The trainer has its own handler (a checkpoint first); these commands have nothing to save.
"""

from __future__ import annotations

import signal
import types


def _exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)  # the code a process killed by the signal reports: 143


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(143) in the main thread: ``finally`` blocks run, partial files go."""
    signal.signal(signal.SIGTERM, _exit)
