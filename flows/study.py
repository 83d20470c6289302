"""A searching sweep's Optuna study, kept as a journal on the dataset volume (``studies/<study>.journal``)
so that running the sweep again with the same ``study`` carries on where it stopped (issue 20).

The journal is Optuna's own log format (``optuna.storages.JournalStorage``), one JSON line per storage
operation, on the volume through the platform (a file on the local platform, a short Job on a cluster's
claim), so it travels with the dataset and its snapshots. It is read once when the sweep starts and held
in memory; new lines go to the volume when the sweep asks for trials and when it tells a result
(``flush``). Only the sweep flow touches the study, one sweep per study at a time.

A trial still ``RUNNING`` in the journal was left by a sweep that crashed or was cancelled: it is marked
failed (``interrupted``) and its parameters are asked for again first, under the same run key, so the
retry's ``train_pipeline`` finds the interrupted run's folder and resumes from its checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

from optuna.storages.journal import BaseJournalBackend

from tasks.platforms import Platform, VolumeRef

STUDIES_DIR = "studies"


def journal_path(study: str) -> str:
    return f"{STUDIES_DIR}/{study}.journal"


#: Written after a line a stopped sweep left half-written, so that every later read skips that line.
TORN_MARK = {"laneflow": "the line above was cut off when a sweep stopped; it is not part of the study"}


def _is_torn_mark(line: str) -> bool:
    try:
        return json.loads(line) == TORN_MARK
    except json.JSONDecodeError:
        return False


class VolumeJournal(BaseJournalBackend):
    """Optuna's journal on a volume, read once and appended to in batches (``flush``)."""

    def __init__(self, platform: Platform, volume: VolumeRef, path: str) -> None:
        self.platform, self.volume, self.path = platform, volume, path
        try:
            text = platform.read_file(volume, path).decode()
        except FileNotFoundError:
            text = ""
        self._logs: list[dict[str, Any]] = []
        self._unwritten: list[str] = []
        lines = text.splitlines()
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                log = json.loads(line)
            except json.JSONDecodeError:
                following = lines[number + 1] if number + 1 < len(lines) else None
                if following is None and not text.endswith("\n"):
                    # The last line was being written when a sweep stopped: that operation never was. The next
                    # flush ends it and says so, so later reads skip it.
                    self._unwritten = ["", json.dumps(TORN_MARK)]
                    break
                if following is not None and _is_torn_mark(following):
                    continue
                raise ValueError(f"{path} on volume '{volume.name}' is not an Optuna journal (line {number + 1}); "
                                 "move it away or name another study") from None
            if log != TORN_MARK:
                self._logs.append(log)

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        return self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self._logs.extend(logs)
        self._unwritten.extend(json.dumps(log, separators=(",", ":")) for log in logs)

    def flush(self) -> None:
        """The lines not on the volume yet, written there."""
        if self._unwritten and self._unwritten != ["", json.dumps(TORN_MARK)]:
            self.platform.append_file(self.volume, self.path, ("\n".join(self._unwritten) + "\n").encode())
            self._unwritten = []


def recover_interrupted(study: Any) -> list[int]:
    """Trials a stopped sweep left running: failed (``interrupted``), their parameters asked for again first
    with the run key of the interrupted run. Returns their numbers."""
    from optuna.trial import TrialState

    interrupted = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"run_key": trial.user_attrs.get("run_key"),
                                                      "retry_of": trial.number}, skip_if_exists=False)
        interrupted.append(trial.number)
    return interrupted


def counted(study: Any) -> int:
    """Trials that count towards ``trials``: every finished one (complete, pruned or failed) but those stopped
    by an interruption, whose retry counts instead."""
    from optuna.trial import TrialState

    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for trial in study.get_trials(deepcopy=False, states=finished)
               if not trial.user_attrs.get("interrupted"))


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """A leaderboard row for every trial of the study that was not interrupted, from what the sweep recorded
    on it (``result``), earlier sweeps' included."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get("interrupted") or "result" not in trial.user_attrs:
            continue
        rows.append({**trial.user_attrs["result"], "index": trial.number, "params": dict(trial.params)})
    return rows
