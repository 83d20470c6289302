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
import uuid
from typing import Any

from optuna.storages.journal import BaseJournalBackend

from tasks.platforms import Platform, VolumeRef

STUDIES_DIR = "studies"


def journal_path(study: str) -> str:
    return f"{STUDIES_DIR}/{study}.journal"


#: Written after the line a stopped sweep left unfinished (no newline: cut off, or whole but never
#: acknowledged), so that every later read skips that line, whatever it holds.
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
        lines = text.split("\n")
        # Without a final newline the last line was being written when a sweep stopped: that operation
        # never was. The next flush ends that line and marks it, so later reads skip it too.
        unfinished = lines.pop() if lines else ""
        self._prefix = "\n" + json.dumps(TORN_MARK) + "\n" if unfinished.strip() else ""
        self._logs: list[dict[str, Any]] = []
        self._unwritten: list[str] = []
        for number, line in enumerate(lines):
            if not line.strip() or _is_torn_mark(line):
                continue
            if number + 1 < len(lines) and _is_torn_mark(lines[number + 1]):
                continue  # a line an earlier stop left unfinished
            try:
                self._logs.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path} on volume '{volume.name}' is not an Optuna journal (line {number + 1}); "
                                 "move it away or name another study") from None

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        return self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        lines = [json.dumps(log, separators=(",", ":")) for log in logs]  # fails before anything is kept
        self._logs.extend(logs)
        self._unwritten.extend(lines)

    def flush(self) -> None:
        """The lines not on the volume yet, written there."""
        if self._unwritten:
            data = self._prefix + "\n".join(self._unwritten) + "\n"
            self.platform.append_file(self.volume, self.path, data.encode())
            self._prefix, self._unwritten = "", []


def recover_interrupted(study: Any) -> list[int]:
    """Trials an earlier sweep did not finish — left RUNNING by a killed sweep, or whose run was cancelled or
    crashed (marked ``interrupted``) — asked for again first, once each, with their run key. Returns their
    numbers."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    already = {trial.user_attrs.get("retry_of") for trial in trials}  # a finished trial cannot be marked
    retried = []
    for trial in trials:
        if trial.state == TrialState.FAIL and trial.user_attrs.get("interrupted") and trial.number not in already:
            study.enqueue_trial(trial.params, user_attrs={"run_key": trial.user_attrs.get("run_key"),
                                                          "retry_of": trial.number}, skip_if_exists=False)
            retried.append(trial.number)
    return retried


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


def run_key_for(study: Any, number: int) -> str:
    """``<study>-<nonce>-<trial>``: the nonce is the study's own (made when it was created), so a study
    started afresh under an old name (its journal moved away) never finds an old study's runs."""
    nonce = study.user_attrs.get("nonce")
    if nonce is None:
        nonce = uuid.uuid4().hex[:4]
        study.set_user_attr("nonce", nonce)
    return f"{study.study_name}-{nonce}-{number}"


#: Base settings a continued study may change: how often val is scored changes no trial's training (a
#: study can start pruning later).
NOT_COMPARED = {"eval_every"}


def check_same_study(study: Any, name: str, space: dict[str, Any], params: Any) -> None:
    """A continued study must search the same space over the same base run (same data, preset, budget):
    otherwise its trials do not compare and an interrupted one would resume a checkpoint of another
    setting. The first sweep records both on the study."""
    from optuna.distributions import distribution_to_json

    wanted_space = {key: distribution_to_json(value) for key, value in sorted(space.items())}
    wanted_base = {key: value for key, value in params.for_record().items()
                   if key not in space and key not in NOT_COMPARED}
    recorded_space, recorded_base = study.user_attrs.get("space"), study.user_attrs.get("base")
    if recorded_space is None:
        study.set_user_attr("space", wanted_space)
        study.set_user_attr("base", wanted_base)
        return
    if recorded_space != wanted_space:
        raise ValueError(f"study {name!r} searched {sorted(recorded_space)} with other ranges or choices: give "
                         f"the same space to continue it, or name a new study")
    defaults = {name: field.default for name, field in type(params).model_fields.items()}
    # A setting recorded before it existed was its default then.
    changed = sorted(key for key in (set(recorded_base) | set(wanted_base)) - NOT_COMPARED
                     if recorded_base.get(key, defaults.get(key)) != wanted_base.get(key, defaults.get(key)))
    if changed:
        raise ValueError(f"study {name!r} was run with other {', '.join(changed)}: its trials would not compare "
                         "with these; keep them to continue it, or name a new study")
