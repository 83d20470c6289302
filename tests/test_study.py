"""A sweep's study kept on the dataset volume (flows/study.py): Optuna's journal read back as it was written,
a half-written last line from a stopped sweep ignored, interrupted trials asked for again under their run
key; appended through the cluster platform's Jobs as through the local platform's files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.trial import TrialState

from flows.params import DataSource, TrainParams
from flows.study import SweepStudy, journal_path
from tasks.platforms import LocalPlatform, VolumeRef

SPACE = {"lr": FloatDistribution(0.01, 0.2, log=True)}
BASE = TrainParams(source=DataSource(url="https://m.example/train_set.zip", sha256="a" * 64), epochs=2)


def _open(platform: LocalPlatform, volume: VolumeRef, space: dict[str, BaseDistribution] = SPACE,
          base: TrainParams = BASE) -> SweepStudy:
    return SweepStudy.open("lanes", space, base, platform, volume)


def _completed(study: SweepStudy, value: float) -> None:
    """The next trial asked for, told it reached ``value``."""
    trial = study.ask()
    study.tell(trial, _row(trial.number), value)


def _row(number: int) -> dict[str, Any]:
    return {"index": number, "state": "Completed"}


def test_a_study_on_the_volume_is_continued_and_its_interrupted_trial_asked_for_again(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    study = _open(platform, volume)
    _completed(study, 0.7)
    running = study.ask()  # on the volume now; the sweep stops here (killed): trial 1 stays RUNNING
    written = Path(volume.location) / "studies" / "lanes.journal"
    with written.open("a") as sink:
        sink.write('{"op_code": 5, "worker_id": "x", "trial_id"')  # the line being written when it died
    study = _open(platform, volume)
    assert [t.state for t in study.optuna_study.trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    assert study.recover() == [1] and study.counted() == 1
    retry = study.ask()  # asked first, with what the interrupted trial had
    assert retry.optuna_trial.params == running.optuna_trial.params and retry.run_key == running.run_key
    study.tell(retry, _row(retry.number), 0.8)
    reopened = _open(platform, volume)
    assert reopened.counted() == 2 and reopened.optuna_study.best_value == pytest.approx(0.8)
    assert [t.user_attrs.get("interrupted", False) for t in reopened.optuna_study.trials] == [False, True, False]


def test_a_journal_that_is_not_one_is_refused_naming_it(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    platform.append_file(volume, journal_path("lanes"), b"not json\n{}\n")
    with pytest.raises(ValueError, match=r"studies/lanes.journal on volume 'tusimple' is not an Optuna journal"):
        _open(platform, volume)


def test_the_cluster_platform_appends_to_a_file_on_the_claim(emulator: tuple) -> None:
    from tests.cluster_platform_helpers import cluster_platform

    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    platform.append_file(volume, "studies/s.journal", b'{"a": 1}\n')
    platform.append_file(volume, "studies/s.journal", b'{"b": 2}\n')
    assert (cluster.claim_dir("lanes", "data") / "studies" / "s.journal").read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert platform.read_file(volume, "studies/s.journal") == b'{"a": 1}\n{"b": 2}\n'


def test_a_journal_whose_last_line_has_no_newline_stays_readable_through_later_sweeps(laneflow_home: Path) -> None:
    """A stop between a line's JSON and its newline (or a cluster append cut between chunks): the line is
    dropped and marked, and the journal reads the same after every later flush."""
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    _completed(_open(platform, volume), 0.5)
    path = Path(volume.location) / journal_path("lanes")
    path.write_bytes(path.read_bytes() + b'{"op_code": 4, "worker_id": "w", "study_id": 0}')  # whole, no newline
    for value in (0.6, 0.7):
        _completed(_open(platform, volume), value)
    assert [t.value for t in _open(platform, volume).optuna_study.trials] == [0.5, 0.6, 0.7]


def test_a_study_is_continued_only_over_the_same_space_and_base_run(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    base = BASE
    study = _open(platform, volume, base=base)  # the first sweep records its space and base run
    key = study.run_key(3)
    study.flush()
    study = _open(platform, volume, base=base.model_copy(update={"lr": 0.3}))  # lr is searched: any base lr
    assert study.run_key(3) == key and key.startswith("lanes-") and key.endswith("-3")
    with pytest.raises(ValueError, match=r"study 'lanes' searched \['lr'\] with other ranges"):
        _open(platform, volume, space={"lr": FloatDistribution(0.01, 0.5, log=True)}, base=base)
    with pytest.raises(ValueError, match=r"study 'lanes' was run with other epochs"):
        _open(platform, volume, base=base.model_copy(update={"epochs": 3}))
    _open(platform, volume, base=base.model_copy(update={"eval_every": 10}))  # pruning can start later
    # A study recorded before a setting existed recorded it at its default.
    recorded = study.optuna_study.user_attrs["base"]
    study.optuna_study.set_user_attr("base", {k: v for k, v in recorded.items() if k != "max_steps"})
    study.flush()
    _open(platform, volume, base=base)
    with pytest.raises(ValueError, match=r"study 'lanes' was run with other max_steps"):
        _open(platform, volume, base=base.model_copy(update={"max_steps": 5}))
