"""Stopping processes for good (tasks/processes.py) and the session's check that nothing outlives the suite
(tests/leaks.py): real processes that ignore signals, leave children behind, or need a second signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.processes import PREFECT_WORKER_SIGNALS, group_alive, running, stop_group, stop_process
from tests import leaks
from tests.conftest import PROJECT_ROOT, SESSION_MARKER
from tests.waiting import wait_until


def python(code: str, **kwargs) -> subprocess.Popen:
    """A Python child in a process group of its own that prints 'ready' once its handlers are in place."""
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    assert process.stdout.readline().strip() == "ready"
    return process


def with_a_child(parent_ignores_term: bool) -> str:
    """A parent that has started a child ignoring SIGTERM; the parent ignores it too, or dies of it."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if parent_ignores_term else "pass"
    return f"""
        import signal, subprocess, sys, time
        {ignore}
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); print('child', flush=True); time.sleep(600)"],
                                 stdout=subprocess.PIPE)
        child.stdout.readline()
        print("ready", flush=True)
        time.sleep(600)
    """


def test_a_process_that_ignores_the_stop_signal_is_killed_with_its_group() -> None:
    process = python(with_a_child(parent_ignores_term=True))
    assert stop_process(process, grace_s=1) == -signal.SIGKILL
    assert not group_alive(process.pid)  # the child it started went with it


def test_a_second_signal_is_sent_when_the_first_shutdown_hangs() -> None:
    """What ``prefect worker start`` does: the first SIGINT starts a shutdown that hangs, the second ends it."""
    process = python("""
        import signal, sys, time
        received = []
        def on_int(signum, frame):
            received.append(signum)
            if len(received) == 2:
                sys.exit(3)
        signal.signal(signal.SIGINT, on_int)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """)
    assert stop_process(process, PREFECT_WORKER_SIGNALS, grace_s=2) == 3  # it exited itself, no SIGKILL


def test_members_a_leader_leaves_behind_are_stopped_too() -> None:
    """The leader exits on SIGTERM at once; the grandchild it started ignores SIGTERM and would keep running."""
    process = python(with_a_child(parent_ignores_term=False))
    assert stop_process(process, grace_s=1) == -signal.SIGTERM
    assert not group_alive(process.pid)


def test_a_process_sharing_our_group_is_signalled_alone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # our process group
    assert os.getpgid(child.pid) == os.getpgrp()
    assert stop_process(child, grace_s=5) == -signal.SIGTERM  # and we are still here


def test_a_group_started_elsewhere_is_stopped_by_its_id() -> None:
    process = python(with_a_child(parent_ignores_term=True))
    assert stop_group(process.pid, grace_s=1) is True  # it had to be killed
    process.wait(timeout=30)
    assert not group_alive(process.pid)
    assert stop_group(process.pid) is False  # nothing left to stop


def test_running_stops_the_process_when_the_block_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), running([sys.executable, "-c", "import time; time.sleep(600)"],
                                                            grace_s=5) as process:
        raise RuntimeError("boom")
    assert process.returncode == -signal.SIGTERM and not group_alive(process.pid)


def test_the_session_check_finds_an_orphan_wherever_it_was_reparented() -> None:
    """A grandchild whose parent exited belongs to init (or a subreaper), not to us: the marker finds it."""
    parent = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True)
    orphan = int(done.stdout)
    try:
        # Read until it shows (a loaded machine may be slow to let /proc show it whole), or it is gone.
        found = wait_until("the orphan among the session's processes", lambda: (
            listed if orphan in (listed := {process.pid: process for process in leaks.marked_processes(SESSION_MARKER)})
            or not Path(f"/proc/{orphan}").exists() else None), timeout_s=30, every_s=0.2)
        assert orphan in found, f"the orphan {orphan} exited before it was found"
        assert "time.sleep(600)" in found[orphan].command and found[orphan].ppid != os.getpid()
    finally:
        stop_group(orphan, grace_s=5)
    assert orphan not in {process.pid for process in leaks.marked_processes(SESSION_MARKER)}


@pytest.mark.slow
def test_a_real_prefect_worker_is_stopped_and_leaves_nothing(prefect_server: dict, tmp_path: Path) -> None:
    """``prefect worker start`` idle on a pool, then stopped as laneflow stops it: gone with its group, whichever
    way its shutdown went (it may hang after the first SIGINT)."""
    from flows.serving import WORK_POOL, ensure_local_setup

    ensure_local_setup()
    log = tmp_path / "worker.log"
    prefect = str(Path(sys.executable).parent / "prefect")
    with log.open("wb") as sink, running([prefect, "worker", "start", "--pool", WORK_POOL, "--type", "process"],
                                         stop_signals=PREFECT_WORKER_SIGNALS, grace_s=20,
                                         env={**os.environ, **prefect_server}, cwd=PROJECT_ROOT, stdout=sink,
                                         stderr=subprocess.STDOUT) as worker:
        deadline = time.monotonic() + 300
        while "started" not in log.read_text().lower():  # "Worker '...' started!"
            assert worker.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
    assert worker.returncode is not None and not group_alive(worker.pid)
    assert worker.pid not in {process.pid for process in leaks.marked_processes(SESSION_MARKER)}


def test_only_multiprocessing_helpers_of_this_interpreter_are_left_to_it() -> None:
    """The forkserver and resource tracker exit with us; the same commands under another parent, or anything
    else under us, would outlive the suite."""
    ours, other = os.getpid(), os.getpid() + 1
    helper = "python -B -c from multiprocessing.forkserver import main; main(5, 6)"
    tracker = "python -B -c from multiprocessing.resource_tracker import main;main(52)"
    survivors = [leaks.Survivor(1, ours, "S", helper), leaks.Survivor(2, ours, "S", tracker),
                 leaks.Survivor(3, other, "S", helper), leaks.Survivor(4, ours, "S", "sleep 600")]
    assert [s.pid for s in leaks.outliving(survivors)] == [3, 4]


def test_ctrl_c_reaches_laneflow_serve_s_wait_when_another_thread_takes_the_signal() -> None:
    """The kernel delivers a process's SIGINT to any thread that does not block it (laneflow serve has the
    Prefect client's threads). Here the main thread blocks it, so a helper thread always takes it: the wait for
    the worker must still end in KeyboardInterrupt, not only once the worker exits."""
    waiter = python(f"""
        import signal, subprocess, sys, threading, time
        sys.path.insert(0, {str(PROJECT_ROOT)!r})
        from flows.serving import _wait_interruptibly
        # As laneflow serve does, whatever it inherited: a shell's background job starts with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=lambda: time.sleep(600), daemon=True).start()  # takes the signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT}})
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                  stdout=subprocess.DEVNULL)
        try:  # from "ready" on: the test's SIGINT may land on any line after it
            print("ready", flush=True)
            _wait_interruptibly(worker)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        worker.kill()
        worker.wait()
    """)
    try:
        os.kill(waiter.pid, signal.SIGINT)
        assert waiter.stdout.readline().strip() == "interrupted"
        assert waiter.wait(timeout=60) == 0
    finally:
        stop_process(waiter)
