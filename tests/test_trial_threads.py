"""A sweep that hears SIGTERM or Ctrl-C stops its own trials' threads (and only those) and waits for them to
unwind before it unwinds itself. The whole cancel from the UI runs in test_deployments."""

from __future__ import annotations

import threading
import time

import pytest
from prefect.exceptions import TerminationSignal

from flows.trial_threads import SweepStopped, trial_thread, trials_stop_with_the_sweep


class Trial(threading.Thread):
    """A trial's thread: registered for ``sweep``, busy in Python code (as a wait loop is) until stopped."""

    def __init__(self, sweep: str) -> None:
        super().__init__(daemon=True)
        self.sweep, self.started, self.unwound, self.stop = sweep, threading.Event(), threading.Event(), False
        self.heard: BaseException | None = None

    def run(self) -> None:
        try:
            with trial_thread(self.sweep):
                self.started.set()
                while not self.stop:
                    time.sleep(0.01)
        except BaseException as exc:  # what a trial's flow engine sees
            self.heard = exc
        finally:
            self.unwound.set()


def started(*trials: Trial) -> None:
    for trial in trials:
        trial.start()
        assert trial.started.wait(10)


@pytest.mark.parametrize(("heard", "sent"), [(TerminationSignal(15), SweepStopped),
                                             (KeyboardInterrupt(), KeyboardInterrupt)])
def test_what_the_sweep_hears_is_raised_in_its_trials_and_it_waits_for_them(heard: BaseException,
                                                                              sent: type) -> None:
    ours, theirs = [Trial("sweep-a"), Trial("sweep-a")], Trial("sweep-b")
    started(*ours, theirs)
    try:
        with pytest.raises(type(heard)) as raised, trials_stop_with_the_sweep("sweep-a"):
            raise heard
        assert raised.value is heard  # the sweep itself goes on unwinding with what it heard
        # It returned only once both trials had unwound, each with the stop raised in its own thread.
        assert all(trial.unwound.is_set() and type(trial.heard) is sent for trial in ours)
        if sent is SweepStopped:  # Prefect's flow engine reads it as the SIGTERM it handles in a process
            assert isinstance(ours[0].heard, TerminationSignal) and ours[0].heard.signal == 15
        assert not theirs.unwound.is_set() and theirs.heard is None  # another sweep's trial trains on
    finally:
        theirs.stop = True
        for trial in (*ours, theirs):
            trial.stop = True
            trial.join(10)


def test_an_error_of_the_sweep_itself_leaves_its_trials_alone() -> None:
    """Only a stop of the sweep's process is passed on: an exception is the sweep's to handle (its trials'
    rows, its leaderboard); the runner's exit still waits for the trials."""
    trial = Trial("sweep-c")
    started(trial)
    try:
        with pytest.raises(ValueError), trials_stop_with_the_sweep("sweep-c"):
            raise ValueError("a bad row")
        assert not trial.unwound.is_set()  # (a stop passed on is waited for: it would have unwound by now)
    finally:
        trial.stop = True
        trial.join(10)
    assert trial.heard is None
