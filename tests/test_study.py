"""A sweep's study kept on the dataset volume (flows/study.py): Optuna's journal read back as it was written,
a half-written last line from a stopped sweep ignored, interrupted trials asked for again under their run
key; appended through the cluster platform's Jobs as through the local platform's files."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from flows.study import VolumeJournal, counted, journal_path, recover_interrupted
from tasks.platforms import LocalPlatform

SPACE = {"lr": FloatDistribution(0.01, 0.2, log=True)}


def _open(platform: LocalPlatform, volume: object) -> tuple[VolumeJournal, optuna.Study]:
    optuna.logging.set_verbosity(logging.WARNING)
    journal = VolumeJournal(platform, volume, journal_path("lanes"))
    study = optuna.create_study(study_name="lanes", storage=optuna.storages.JournalStorage(journal),
                                direction="maximize", load_if_exists=True)
    return journal, study


def test_a_study_on_the_volume_is_continued_and_its_interrupted_trial_asked_for_again(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    journal, study = _open(platform, volume)
    finished = study.ask(SPACE)
    finished.set_user_attr("run_key", "lanes-0")
    study.tell(finished, 0.7)
    running = study.ask(SPACE)
    running.set_user_attr("run_key", "lanes-1")
    journal.flush()  # the sweep stops here (killed): trial 1 stays RUNNING on the volume
    written = Path(volume.location) / "studies" / "lanes.journal"
    with written.open("a") as sink:
        sink.write('{"op_code": 5, "worker_id": "x", "trial_id"')  # the line being written when it died
    journal, study = _open(platform, volume)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    assert recover_interrupted(study) == [1] and counted(study) == 1
    retry = study.ask(SPACE)  # asked first, with what the interrupted trial had
    assert retry.params == running.params and retry.user_attrs["run_key"] == "lanes-1"
    study.tell(retry, 0.8)
    journal.flush()
    _, reopened = _open(platform, volume)
    assert counted(reopened) == 2 and reopened.best_value == pytest.approx(0.8)
    assert [t.user_attrs.get("interrupted", False) for t in reopened.trials] == [False, True, False]


def test_a_journal_that_is_not_one_is_refused_naming_it(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    platform.append_file(volume, journal_path("lanes"), b"not json\n{}\n")
    with pytest.raises(ValueError, match=r"studies/lanes.journal on volume 'tusimple' is not an Optuna journal"):
        VolumeJournal(platform, volume, journal_path("lanes"))


def test_the_cluster_platform_appends_to_a_file_on_the_claim(emulator: tuple) -> None:
    from tests.test_cluster_platform import cluster_platform

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
    journal, study = _open(platform, volume)
    study.tell(study.ask(SPACE), 0.5)
    journal.flush()
    path = Path(volume.location) / journal_path("lanes")
    path.write_bytes(path.read_bytes() + b'{"op_code": 4, "worker_id": "w", "study_id": 0}')  # whole, no newline
    for value in (0.6, 0.7):
        journal, study = _open(platform, volume)
        study.tell(study.ask(SPACE), value)
        journal.flush()
    _, study = _open(platform, volume)
    assert [t.value for t in study.trials] == [0.5, 0.6, 0.7]


def test_a_study_is_continued_only_over_the_same_space_and_base_run(laneflow_home: Path) -> None:
    from flows.params import DataSource, TrainParams
    from flows.study import check_same_study, run_key_for

    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    base = TrainParams(source=DataSource(url="https://m.example/train_set.zip", sha256="a" * 64), epochs=2)
    journal, study = _open(platform, volume)
    check_same_study(study, "lanes", SPACE, base)
    key = run_key_for(study, 3)
    journal.flush()
    _, study = _open(platform, volume)
    check_same_study(study, "lanes", SPACE, base.model_copy(update={"lr": 0.3}))  # lr is searched: any base lr
    assert run_key_for(study, 3) == key and key.startswith("lanes-") and key.endswith("-3")
    with pytest.raises(ValueError, match=r"study 'lanes' searched \['lr'\] with other ranges"):
        check_same_study(study, "lanes", {"lr": FloatDistribution(0.01, 0.5, log=True)}, base)
    with pytest.raises(ValueError, match=r"study 'lanes' was run with other epochs"):
        check_same_study(study, "lanes", SPACE, base.model_copy(update={"epochs": 3}))
    check_same_study(study, "lanes", SPACE, base.model_copy(update={"eval_every": 10}))  # pruning can start later
    # A study recorded before a setting existed recorded it at its default.
    study.set_user_attr("base", {k: v for k, v in study.user_attrs["base"].items() if k != "max_steps"})
    check_same_study(study, "lanes", SPACE, base)
    with pytest.raises(ValueError, match=r"study 'lanes' was run with other max_steps"):
        check_same_study(study, "lanes", SPACE, base.model_copy(update={"max_steps": 5}))
