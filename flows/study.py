"""A searching sweep's Optuna study, kept as a journal on the dataset volume (``studies/<study>.journal``)
so that running the sweep again with the same ``study`` carries on where it stopped (issue 20).

The journal is Optuna's own log format (``optuna.storages.JournalStorage``), one JSON line per storage
operation, on the volume through the platform (a file on the local platform, a short Job on a cluster's
claim), so it travels with the dataset and its snapshots. It is read once when the sweep starts and held
in memory; new lines go to the volume when the sweep asks for trials and when it tells a result. Only the
sweep flow touches the study, one sweep per study at a time (held, ``tasks.study_lock``), and only through
``SweepStudy`` (open, recover, ask, tell, rows): the journal's I/O stays behind it.

A trial a sweep did not finish is asked for again first by the next sweep, under the same run key, so the
retry's ``train_pipeline`` finds the interrupted run's folder and resumes from its checkpoint: a cancelled
or crashed sweep's hook marks its running trials failed and ``interrupted`` (``record_interrupted``); one
killed outright leaves them ``RUNNING``, and the next sweep marks them so first.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, distribution_to_json
from optuna.storages.journal import BaseJournalBackend
from optuna.trial import TrialState
from pydantic import ValidationError

from flows.model_settings import PREFIX, with_changes
from flows.params import TrainParams
from tasks.platforms import Platform, VolumeRef
from tasks.study_lock import StudyLease

STUDIES_DIR = "studies"


def journal_path(study: str) -> str:
    return f"{STUDIES_DIR}/{study}.journal"


#: What an earlier laneflow wrote after a line a stopped sweep left unfinished. Stock Optuna cannot read a
#: journal with it (nor with the unfinished line before it), so a journal that has one is rewritten without
#: both when it is opened.
TORN_MARK = {"laneflow": "the line above was cut off when a sweep stopped; it is not part of the study"}


def _is_torn_mark(line: str) -> bool:
    try:
        return json.loads(line) == TORN_MARK
    except json.JSONDecodeError:
        return False


def journal_lines(text: str, where: str) -> tuple[list[str], bool]:
    """The journal's whole operations (as Optuna's own ``JournalFileBackend`` reads them) and whether the file
    needs repair: a last line without its newline (a write cut off when a sweep stopped: that operation never
    was), or a line an earlier laneflow marked as cut off (and its mark). A line that is not JSON elsewhere
    is not a torn write: the file is not a journal, and nothing is changed."""
    lines = text.split("\n")
    unfinished = lines.pop()  # "" when the file ends with its newline
    kept, repair = [], bool(unfinished)
    for number, line in enumerate(lines):
        if _is_torn_mark(line) or (number + 1 < len(lines) and _is_torn_mark(lines[number + 1])):
            repair = True
            continue
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{where} is not an Optuna journal (line {number + 1} is not JSON); move it away or "
                             "name another study") from None
        kept.append(line)
    return kept, repair


class VolumeJournal(BaseJournalBackend):
    """Optuna's journal on a volume, read once and appended to in batches (``flush``).

    Opened only by the sweep that holds the study (``tasks.study_lock``): ``before_write`` confirms the hold
    before every append, so no two writers' lines ever interleave. A write a stopped sweep left cut off is
    repaired when the journal is opened (the file rewritten whole without it), so the file stays what
    stock Optuna (``JournalFileBackend``, optuna-dashboard) reads.
    """

    def __init__(self, platform: Platform, volume: VolumeRef, path: str,
                 before_write: Callable[[], None] | None = None) -> None:
        self.platform, self.volume, self.path = platform, volume, path
        self._before_write = before_write or (lambda: None)
        try:
            text = platform.read_file(volume, path).decode()
        except FileNotFoundError:  # the only "no journal": a read that failed raised VolumeReadFailed
            text = ""
        lines, repair = journal_lines(text, f"{path} on volume '{volume.name}'")
        if repair:
            self._before_write()
            platform.replace_file(volume, path, "".join(f"{line}\n" for line in lines).encode())
        self._logs: list[dict[str, Any]] = [json.loads(line) for line in lines]
        self._unwritten: list[str] = []

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        return self._logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        lines = [json.dumps(log, separators=(",", ":")) for log in logs]  # fails before anything is kept
        self._logs.extend(logs)
        self._unwritten.extend(lines)

    def flush(self) -> None:
        """The lines not on the volume yet, written there (one append, after the hold is confirmed)."""
        lines = self.take_unwritten()
        try:
            self.write(lines)
        except BaseException:
            self.restore(lines)
            raise

    def take_unwritten(self) -> list[str]:
        """The lines not on the volume yet, to be ``write``-n (taken under the study's lock, with the operations)."""
        lines, self._unwritten = self._unwritten, []
        return lines

    def restore(self, lines: list[str]) -> None:
        """Taken lines that could not be written, put back before any taken since: the next write keeps the
        file's order."""
        self._unwritten[:0] = lines

    def write(self, lines: list[str]) -> None:
        """Append ``lines`` (taken by ``take_unwritten``) to the journal, after the hold is confirmed."""
        if lines:
            self._before_write()
            self.platform.append_file(self.volume, self.path, ("\n".join(lines) + "\n").encode())


def mark_interrupted(study: optuna.Study, why: str) -> list[int]:
    """Every trial still RUNNING marked failed and ``interrupted`` (``why`` kept beside it): the next sweep of
    the study asks for each again, under its run key. Returns their numbers."""
    marked = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
        study._storage.set_trial_user_attr(trial._trial_id, "interrupted_because", why)
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        marked.append(trial.number)
    return marked


def record_interrupted(platform: Platform, volume: VolumeRef, name: str, lease: StudyLease, why: str) -> list[int]:
    """For a sweep that was stopped from outside (its cancellation or crash hook, holding the study as that
    sweep): the trials it left running recorded as interrupted in the journal on ``volume``, so the study
    says what happened to them and the next sweep asks for them again. Returns their numbers."""
    optuna.logging.set_verbosity(logging.WARNING)
    journal = VolumeJournal(platform, volume, journal_path(name), lease.confirm)
    try:
        study = optuna.load_study(study_name=name, storage=optuna.storages.JournalStorage(journal))
    except KeyError:  # stopped before it wrote its study: nothing ran
        return []
    marked = mark_interrupted(study, why)
    journal.flush()
    return marked


#: The state a pruned trial's flow run ends in (a Completed state of that name).
PRUNED = "Pruned"
#: Child run states of a trial stopped from outside: its next sweep runs it again from its checkpoint.
INTERRUPTED_STATES = ("Cancelled", "Crashed")
#: What a trial's row keeps in the study (enough to rank it and to score the best on test later).
RECORDED = ("state", "run", "flow_run_id", "metrics", "steps", "resumed_from", "run_dir", "data_dir", "platform",
            "volume", "error", "stopped", "val")


#: How many trials in a row the space may give that no run may have (each told failed) before the sweep stops:
#: ``check_space`` refuses what it can see up front; this bounds what it cannot (a combination of two settings).
MAX_REFUSED_ASKS = 20


@dataclass(frozen=True)
class AskedTrial:
    """A trial Optuna asked for: its child run's parameters and the run key that run trains under."""

    optuna_trial: optuna.trial.Trial
    params: TrainParams
    run_key: str

    @property
    def number(self) -> int:
        return self.optuna_trial.number


class SweepStudy:
    """A searching sweep's Optuna study, with its journal on the volume (when it is kept) behind it: the sweep
    opens it, asks, tells and ranks, and never sees a journal line. Every use of the Optuna study holds
    ``lock`` (the trials' judges report to it from other threads); ask, tell and recover write what they
    changed to the volume before they return — after letting go of ``lock``: on a cluster a write is a
    Kubernetes Job (seconds), which the judges must not wait for. Writes keep their order (``_writing``)."""

    def __init__(self, study: optuna.Study, space: dict[str, BaseDistribution], base: TrainParams,
                 journal: VolumeJournal | None = None) -> None:
        self.optuna_study, self.space, self.base, self._journal = study, space, base, journal
        self.lock = threading.Lock()
        self._writing = threading.Lock()  # taken before ``lock``, never inside it
        self._told: list[dict[str, Any]] = []

    @classmethod
    def open(cls, name: str, space: dict[str, BaseDistribution], base: TrainParams, platform: Platform,
             volume: VolumeRef, lease: StudyLease | None = None) -> SweepStudy:
        """The study kept as ``studies/<name>.journal`` on ``volume``: continued if it is there (over the same
        space and base run only, see ``_check_same_study``), else started. ``lease`` is the sweep's hold on it
        (``tasks.study_lock.holding_study``), confirmed before every write."""
        optuna.logging.set_verbosity(logging.WARNING)
        journal = VolumeJournal(platform, volume, journal_path(name), lease.confirm if lease else None)
        study = optuna.create_study(study_name=name, storage=optuna.storages.JournalStorage(journal),
                                    direction="maximize", load_if_exists=True)
        _check_same_study(study, name, space, base)
        return cls(study, space, base, journal)

    @classmethod
    def of_sweep(cls, sweep_id: str, space: dict[str, BaseDistribution], base: TrainParams) -> SweepStudy:
        """A study of one sweep only, in memory, named after the sweep: its trials' run keys are its own."""
        optuna.logging.set_verbosity(logging.WARNING)
        study = optuna.create_study(study_name=f"s{uuid.UUID(sweep_id).hex[:10]}", direction="maximize")
        return cls(study, space, base)

    @property
    def name(self) -> str:
        return self.optuna_study.study_name

    @property
    def kept(self) -> bool:
        """Whether the study outlives the sweep (a journal on the volume)."""
        return self._journal is not None

    def recover(self) -> list[int]:
        """Trials an earlier sweep did not finish — left RUNNING by a killed sweep, or whose run was cancelled
        or crashed (marked ``interrupted``) — asked for again first, once each, with their run key. Returns
        their numbers."""
        study = self.optuna_study
        with self.lock:
            mark_interrupted(study, "its sweep stopped without ending it")
            trials = study.get_trials(deepcopy=False)
            already = {trial.user_attrs.get("retry_of") for trial in trials}  # a finished trial cannot be marked
            retried = []
            for trial in trials:
                interrupted = trial.state == TrialState.FAIL and trial.user_attrs.get("interrupted")
                if interrupted and trial.number not in already:
                    study.enqueue_trial(trial.params, user_attrs={"run_key": trial.user_attrs.get("run_key"),
                                                                  "retry_of": trial.number}, skip_if_exists=False)
                    retried.append(trial.number)
        self._write()
        return retried

    def search_with(self, strategy: str, seed: int | None, trials: int, max_concurrent: int,
                    pruner: optuna.pruners.BasePruner) -> None:
        """Optuna's sampler for ``strategy`` (random or tpe), and ``pruner``. A seeded sampler of a continued
        study starts past the trials it has (or it would ask those again)."""
        offset = None if seed is None else seed + len(self.optuna_study.trials)
        self.optuna_study.sampler = optuna.samplers.RandomSampler(seed=offset) if strategy == "random" else \
            optuna.samplers.TPESampler(seed=offset, n_startup_trials=min(10, max(2, trials // 3)),
                                       constant_liar=max_concurrent > 1)  # in-flight trials count as bad guesses
        self.optuna_study.pruner = pruner

    def counted(self) -> int:
        """Trials that count towards ``trials``: every finished one (complete, pruned or failed) but those
        stopped by an interruption, whose retry counts instead, and those refused when asked (never run)."""
        finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        return sum(1 for trial in self.optuna_study.get_trials(deepcopy=False, states=finished)
                   if not trial.user_attrs.get("interrupted") and "refused" not in trial.user_attrs)

    def ask(self) -> AskedTrial:
        """The next trial, scored on val (hyperparameters are never chosen on test), on the volume before its
        run starts: a sweep stopped from then on leaves it RUNNING, to be resumed by the next."""
        with self.lock:
            for _ in range(MAX_REFUSED_ASKS):
                trial = self.optuna_study.ask(self.space)
                try:
                    child = TrainParams.model_validate(with_changes(self.base.model_dump(),
                                                                    {**trial.params, "eval_split": "val"}))
                    break
                except ValidationError as exc:  # a combination no run may have: failed, never trained or resumed
                    trial.set_user_attr("refused", "; ".join(error["msg"] for error in exc.errors())[:500])
                    self.optuna_study.tell(trial, state=TrialState.FAIL)
            else:
                raise ValueError(f"the search space gave {MAX_REFUSED_ASKS} trials in a row that no run may have "
                                 f"(the last: {trial.user_attrs['refused']}): narrow the space")
            key = trial.user_attrs.get("run_key") or self._run_key(trial.number)
            trial.set_user_attr("run_key", key)
        self._write()
        return AskedTrial(trial, child, key)

    def tell(self, asked: AskedTrial, row: dict[str, Any], accuracy: float | None) -> None:
        """Optuna learns how the trial ended: its val ``accuracy``, pruned (at its last report), or failed — a
        run stopped from outside (cancelled, crashed) is marked to be resumed by the next sweep of the study.
        The row is kept for ``rows``."""
        trial = asked.optuna_trial
        with self.lock:
            trial.set_user_attr("result", {key: row[key] for key in RECORDED if key in row})
            if row["state"] in INTERRUPTED_STATES:
                trial.set_user_attr("interrupted", True)
                self.optuna_study.tell(trial, state=TrialState.FAIL)
            elif row["state"] == PRUNED:
                self.optuna_study.tell(trial, state=TrialState.PRUNED)
            elif accuracy is None:
                self.optuna_study.tell(trial, state=TrialState.FAIL)
            else:
                self.optuna_study.tell(trial, accuracy)
            self._told.append(row)
        self._write()

    def rows(self) -> list[dict[str, Any]]:
        """The rows to rank, by trial: a kept study's every trial that was not interrupted (earlier sweeps'
        included, from what each recorded), else the rows this sweep told."""
        if not self.kept:
            return sorted(self._told, key=lambda row: row["index"])
        rows = []
        for trial in self.optuna_study.get_trials(deepcopy=False):
            if trial.user_attrs.get("interrupted") or "result" not in trial.user_attrs:
                continue
            rows.append({**trial.user_attrs["result"], "index": trial.number, "params": dict(trial.params)})
        return sorted(rows, key=lambda row: row["index"])

    def test_metrics(self, number: int, score: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Trial ``number``'s test metrics: ``score()``d once and kept, so a later sweep of a kept study whose
        best is the same trial shows them without looking at the test set again."""
        key = f"test-{number}"
        with self.lock:
            metrics = self.optuna_study.user_attrs.get(key) if self.kept else None
        if metrics is None:
            metrics = score()
            if self.kept:
                with self.lock:
                    self.optuna_study.set_user_attr(key, metrics)
                self._write()
        return metrics

    def run_key(self, number: int) -> str:
        """``<study>-<nonce>-<trial>``: the nonce is the study's own (made when it was created), so a study
        started afresh under an old name (its journal moved away) never finds an old study's runs."""
        with self.lock:
            return self._run_key(number)

    def flush(self) -> None:
        """What changed outside ask, tell and recover (by hand), written to the volume."""
        self._write()

    def _run_key(self, number: int) -> str:
        nonce = self.optuna_study.user_attrs.get("nonce")
        if nonce is None:
            nonce = uuid.uuid4().hex[:4]
            self.optuna_study.set_user_attr("nonce", nonce)
        return f"{self.name}-{nonce}-{number}"

    def _write(self) -> None:
        """What the study's operations left unwritten, appended to the journal: taken under ``lock`` (with every
        operation before it), written outside it. Never called holding ``lock``."""
        if self._journal is None:
            return
        with self._writing:
            with self.lock:
                lines = self._journal.take_unwritten()
            try:
                self._journal.write(lines)
            except BaseException:
                with self.lock:  # put back where they were, before anything taken since
                    self._journal.restore(lines)
                raise


#: Base settings a continued study may change: how often val is scored changes no trial's training (a
#: study can start pruning later).
NOT_COMPARED = {"eval_every"}


def _check_same_study(study: optuna.Study, name: str, space: dict[str, BaseDistribution],
                      params: TrainParams) -> None:
    """A continued study must search the same space over the same base run (same data, preset, budget):
    otherwise its trials do not compare and an interrupted one would resume a checkpoint of another
    setting. The first sweep records both on the study."""
    wanted_space = {key: distribution_to_json(value) for key, value in sorted(space.items())}
    searched = {key.removeprefix(PREFIX) for key in space if key.startswith(PREFIX)}

    def unsearched(base: dict[str, Any] | None) -> dict[str, Any] | None:
        """The base without the model settings the space searches: every trial sets those itself."""
        if base is None or not isinstance(base.get("model_settings"), dict):
            return base
        return {**base, "model_settings": {name: value for name, value in base["model_settings"].items()
                                           if name not in searched}}

    wanted_base = unsearched({key: value for key, value in params.for_record().items()
                              if key not in space and key not in NOT_COMPARED})
    recorded_space, recorded_base = study.user_attrs.get("space"), unsearched(study.user_attrs.get("base"))
    if recorded_space is None:
        study.set_user_attr("space", wanted_space)
        study.set_user_attr("base", wanted_base)
        return
    if recorded_space != wanted_space:
        raise ValueError(f"study {name!r} searched {sorted(recorded_space)} with other ranges or choices: give "
                         f"the same space to continue it, or name a new study")
    defaults = {name: field.get_default(call_default_factory=True)
                for name, field in type(params).model_fields.items()}
    # A setting recorded before it existed was its default then.
    changed = sorted(key for key in (set(recorded_base) | set(wanted_base)) - NOT_COMPARED
                     if recorded_base.get(key, defaults.get(key)) != wanted_base.get(key, defaults.get(key)))
    if changed:
        raise ValueError(f"study {name!r} was run with other {', '.join(changed)}: its trials would not compare "
                         "with these; keep them to continue it, or name a new study")
