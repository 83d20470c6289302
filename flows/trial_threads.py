"""A stopped sweep stops its trials at once, in its own process, before it exits.

A sweep's trials run as ``train_pipeline`` subflows in the threads of its ``ThreadPoolTaskRunner``. When the
sweep's process is told to stop — SIGTERM from its worker (a cancel from the UI: Prefect's bridge raises
``TerminationSignal`` in the main thread, ``prefect.utilities.engine.capture_sigterm``) or Ctrl-C — only the
main thread hears it. Unwinding, the flow engine leaves the task runner, whose exit joins its threads
(``ThreadPoolTaskRunner.__exit__``: ``executor.shutdown``, which waits), and every trial thread is still in its
training's wait loop: the sweep cannot exit until its trainings end, its worker's grace (30 s,
``prefect.runner``'s cancellation manager) runs out, and the trials train on meanwhile.

So the sweep raises what it heard in each trial's thread too, and waits a while for them to unwind. A trial's
subflow then ends the way it would in a process of its own: its wait loop stops its training, and its engine
marks it Cancelled (a cancel: the runner's intent is the whole process's, ``prefect._internal.control_listener``)
or Crashed, its own hook handing back the volume's level and its ``gpu`` slot (``flows.train.stop_training``).
The sweep's ``stop_trials`` hook still runs after it, for what a killed process could not do.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator

from prefect.exceptions import TerminationSignal

#: How long a stopped sweep waits for its trials' threads to unwind: well inside its worker's 30 s grace.
UNWIND_TIMEOUT_S = 20.0


class SweepStopped(TerminationSignal):
    """What a trial's thread is sent when its sweep heard SIGTERM: Prefect's own termination signal, so the
    trial's flow engine treats it as it treats SIGTERM in a process (cancellation under a cancel intent).
    Raised in another thread it cannot take arguments (``PyThreadState_SetAsyncExc`` raises a class)."""

    def __init__(self) -> None:
        super().__init__(signal=signal.SIGTERM)


_threads: dict[str, set[threading.Thread]] = {}
_changed = threading.Condition()


@contextlib.contextmanager
def trial_thread(sweep_id: str) -> Iterator[None]:
    """Marks the calling thread as running a trial of sweep ``sweep_id`` for as long as the block runs."""
    thread = threading.current_thread()
    with _changed:
        _threads.setdefault(sweep_id, set()).add(thread)
    try:
        yield
    finally:
        with _changed:  # a stop sent while this thread was listed is raised by the next line run at the latest
            _threads[sweep_id].discard(thread)
            if not _threads[sweep_id]:
                del _threads[sweep_id]
            _changed.notify_all()


def _raise_in(thread: threading.Thread, exception: type[BaseException]) -> None:
    """Raise ``exception`` in ``thread`` at its next Python instruction (a blocking call returns first)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exception))


@contextlib.contextmanager
def trials_stop_with_the_sweep(sweep_id: str, timeout_s: float = UNWIND_TIMEOUT_S) -> Iterator[None]:
    """Around the sweep's wait for its trials: a SIGTERM (``TerminationSignal``) or Ctrl-C the sweep hears is
    raised in every running trial's thread too, and the sweep waits up to ``timeout_s`` for them to unwind
    before it goes on unwinding itself (its study lease, its task runner)."""
    try:
        yield
    except (TerminationSignal, KeyboardInterrupt) as heard:
        stop = SweepStopped if isinstance(heard, TerminationSignal) else KeyboardInterrupt
        with _changed:
            for thread in _threads.get(sweep_id, ()):
                _raise_in(thread, stop)
            _changed.wait_for(lambda: sweep_id not in _threads, timeout=timeout_s)
        raise
