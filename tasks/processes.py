"""Stopping the processes laneflow starts, for good: the program's own stop signal first, then SIGKILL of
its whole process group after a grace period, and always a wait, so nothing is left running or unreaped.

Why escalate: programs do not all stop on one SIGTERM. ``prefect worker start`` (3.9) answers SIGTERM by
sending itself SIGINT and may then hang in its shutdown; a second SIGINT makes it kill itself. A trainer
checkpoints on SIGTERM and exits; ``horovodrun`` forwards it to its ranks. Whatever the program does, the
caller needs the same guarantee: when ``stop_process`` returns, the process and its group are gone.

A signal goes to the process group only when the process leads one of its own (started with
``start_new_session=True``): signalling the group of a process that shares ours would signal us.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

#: How often a wait checks whether a group is empty yet.
_POLL_S = 0.1
#: After SIGKILL a process ends as soon as the kernel gets to it; this only bounds a wait that cannot end
#: (a process in uninterruptible sleep on a dead NFS mount, say).
_KILL_WAIT_S = 30.0


def group_alive(pgid: int) -> bool:
    """Whether any live (not zombie) process is left in process group ``pgid``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def leads_own_group(pid: int) -> bool:
    """Whether ``pid`` is the leader of a process group other than ours (so signalling the group is safe)."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return False
    return pgid == pid and pgid != os.getpgrp()


def _signal(pid: int, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _wait_until(done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def stop_group(pgid: int, signals: Sequence[int] = (signal.SIGTERM,), grace_s: float = 15.0) -> bool:
    """Stop every process of group ``pgid``: each of ``signals`` in turn, ``grace_s`` apart, then SIGKILL.

    For groups this process did not start (a trainer started by an earlier worker process): nothing to
    reap here. True when the group had to be killed.
    """
    for sig in signals:
        if not group_alive(pgid):
            return False
        _signal(pgid, sig, group=True)
        if _wait_until(lambda: not group_alive(pgid), grace_s):
            return False
    _signal(pgid, signal.SIGKILL, group=True)
    _wait_until(lambda: not group_alive(pgid), _KILL_WAIT_S)
    return True


def stop_process(process: subprocess.Popen, signals: Sequence[int] = (signal.SIGTERM,),
                 grace_s: float = 15.0) -> int | None:
    """Stop ``process`` (and its process group, when it leads one): each of ``signals`` in turn, waiting
    ``grace_s`` after each for it to exit, then SIGKILL; always reaped. Returns its exit status.

    With a group, what the leader left behind in it (children it did not wait for) is killed too once the
    leader has exited, so the group is empty on return.
    """
    group = leads_own_group(process.pid)

    def finished() -> bool:
        return process.poll() is not None and (not group or not group_alive(process.pid))

    for sig in signals:
        if finished():
            break
        if process.poll() is None:
            _signal(process.pid, sig, group)
        elif group:  # the leader is gone, stragglers are left: they get the same signal
            _signal(process.pid, sig, True)
        if _wait_until(finished, grace_s):
            break
    else:
        if not finished():
            _signal(process.pid, signal.SIGKILL, group)
    if group and group_alive(process.pid):  # the leader exited on its own and left members behind
        _signal(process.pid, signal.SIGKILL, True)
    try:
        process.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        _signal(process.pid, signal.SIGKILL, group)
        process.wait()
    if group:
        _wait_until(lambda: not group_alive(process.pid), _KILL_WAIT_S)
    return process.returncode


#: How ``prefect worker start`` stops: Ctrl-C (SIGINT), and a second SIGINT when the first shutdown hangs.
PREFECT_WORKER_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGINT)


@contextlib.contextmanager
def running(argv: Sequence[str], stop_signals: Sequence[int] = (signal.SIGTERM,), grace_s: float = 15.0,
            **popen_kwargs) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(argv)`` in a process group of its own, stopped with ``stop_process`` on the way out
    whatever happens inside (an assertion, a timeout, Ctrl-C)."""
    process = subprocess.Popen(list(argv), start_new_session=True, **popen_kwargs)
    try:
        yield process
    finally:
        stop_process(process, stop_signals, grace_s)


def run_to_end(argv: Sequence[str], timeout_s: float, stop_signals: Sequence[int] = (signal.SIGTERM,),
               grace_s: float = 15.0, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` in a process group of its own.

    ``subprocess.run`` kills only the direct child on a timeout; a ``horovodrun`` killed that way leaves its
    ranks running. Here a timeout (or an interruption) stops the whole group with ``stop_process`` before
    ``TimeoutExpired`` is raised with what the process printed.
    """
    process = subprocess.Popen(list(argv), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, **popen_kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process(process, stop_signals, grace_s)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(list(argv), timeout_s, stdout, stderr) from None
    except BaseException:
        stop_process(process, stop_signals, grace_s)
        raise
    return subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)
