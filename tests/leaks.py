"""Which processes this test session started are still alive: the check behind ``conftest``'s session guard.

Every process the suite starts — directly, or as a grandchild a worker or ``horovodrun`` starts and that
outlives its parent (and so is re-parented away from us) — inherits this session's marker variable from
the environment. Reading ``/proc/<pid>/environ`` finds them wherever they went; process ancestry would
lose the orphans, which are the ones that matter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

MARKER = "LANEFLOW_TEST_SESSION"


def mark_session() -> str:
    """Put this session's marker into the environment every child inherits; returns its value."""
    os.environ[MARKER] = f"{os.getpid()}-{uuid.uuid4().hex}"
    return os.environ[MARKER]


@dataclass(frozen=True)
class Survivor:
    pid: int
    ppid: int
    state: str
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}, state {self.state}): {self.command}"


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def marked_processes(marker: str) -> list[Survivor]:
    """Live processes (zombies excluded: they run nothing) carrying ``marker``, this process excluded."""
    needle = f"{MARKER}={marker}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if needle not in environ:
            continue
        stat = _stat(int(entry.name))
        if stat is None or stat[0] in ("Z", "X"):
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        found.append(Survivor(int(entry.name), stat[1], stat[0], command[:300]))
    return found


#: multiprocessing's own helper processes of *this* interpreter (the forkserver preprocessing uses, the
#: resource tracker): they read a pipe from it and exit when it exits, so they cannot outlive the suite.
_INTERPRETER_HELPERS = ("from multiprocessing.forkserver import main",
                        "from multiprocessing.resource_tracker import main")


def outliving(survivors: list[Survivor]) -> list[Survivor]:
    """The processes that would still run after this interpreter exits."""
    return [s for s in survivors if not (s.ppid == os.getpid() and any(h in s.command for h in _INTERPRETER_HELPERS))]


def kill_all(survivors: list[Survivor]) -> None:
    """SIGKILL what is left (so one leaky run cannot slow or break the next one)."""
    for survivor in survivors:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(survivor.pid, signal.SIGKILL)
