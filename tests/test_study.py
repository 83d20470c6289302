"""A sweep's study kept on the dataset volume (flows/study.py): Optuna's journal read back as it was written,
a half-written last line from a stopped sweep ignored, interrupted trials asked for again under their run
key; appended through the cluster platform's Jobs as through the local platform's files."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.trial import TrialState

from flows.params import DataSource, TrainParams
from flows.study import SweepStudy, journal_path
from tasks.platforms import LocalPlatform, VolumeRef
from tasks.study_lock import StudyBusy, StudyHolder, StudyLost, claimed, holding_study, record_key, released

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


def test_a_journal_write_on_a_cluster_leaves_the_study_to_the_trials_judges_meanwhile(emulator: tuple) -> None:
    """On a cluster every journal write is a Kubernetes Job; here one that cannot be scheduled yet (every node
    cordoned, as during an upgrade). While the sweep's tell waits for it, a running trial's judge can still take
    the study (its lock) to report — it must, or every trial would stall behind the sweep's bookkeeping. The write
    lands once a node takes its Job, and stock Optuna reads the journal."""
    from tests.cluster.node_lifecycle import cordon, uncordon
    from tests.cluster_platform_helpers import cluster_platform
    from tests.waiting import wait_until

    emu, cluster = emulator
    platform = cluster_platform(emu, scheduling_grace_s=600)
    volume = platform.ensure_volume("data")
    study = _open(platform, volume)
    asked = study.ask()
    for node in list(cluster.nodes):
        cordon(cluster, node)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        told = pool.submit(study.tell, asked, _row(asked.number), 0.5)
        try:
            wait_until("the journal write's Job to wait for a node", lambda: cluster.unschedulable, timeout_s=120)
            assert not told.done()
            assert study.lock.acquire(timeout=30), "the study's lock is held for the whole journal write"
            study.lock.release()
        finally:
            for node in list(cluster.nodes):
                uncordon(cluster, node)
        told.result(timeout=300)
    journal = cluster.claim_dir("lanes", "data") / journal_path("lanes")
    assert stock_optuna_values(journal) == [pytest.approx(0.5)]


def stock_optuna_values(path: Path) -> list[float | None]:
    """The trials' values as stock Optuna reads the journal file (``JournalFileBackend``, which
    optuna-dashboard uses too): no laneflow code involved."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    return [trial.value for trial in optuna.load_study(study_name="lanes", storage=storage).trials]


def test_a_journal_whose_last_line_has_no_newline_stays_readable_by_stock_optuna_through_later_sweeps(
        laneflow_home: Path) -> None:
    """A stop between a line's JSON and its newline (or a cluster append cut between chunks): that operation
    never was; the next sweep drops it from the file, and stock Optuna reads the journal at every point."""
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    _completed(_open(platform, volume), 0.5)
    path = Path(volume.location) / journal_path("lanes")
    path.write_bytes(path.read_bytes() + b'{"op_code": 4, "worker_id": "w", "study_id": 0}')  # whole, no newline
    assert stock_optuna_values(path) == [0.5]  # torn: stock Optuna skips the unfinished line
    for value in (0.6, 0.7):
        _completed(_open(platform, volume), value)
        assert stock_optuna_values(path) == pytest.approx([0.5, 0.6, 0.7][:int(value * 10) - 4])
    assert [t.value for t in _open(platform, volume).optuna_study.trials] == [0.5, 0.6, 0.7]
    assert path.read_bytes().endswith(b"\n")


def test_a_journal_an_earlier_laneflow_marked_torn_is_repaired_for_stock_optuna(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    _completed(_open(platform, volume), 0.5)
    path = Path(volume.location) / journal_path("lanes")
    mark = b'{"laneflow": "the line above was cut off when a sweep stopped; it is not part of the study"}'
    path.write_bytes(path.read_bytes() + b'{"op_code": 4, "worker_id"\n' + mark + b"\n")
    with pytest.raises(Exception):  # noqa: B017 - stock Optuna cannot read what the old mark left
        stock_optuna_values(path)
    _completed(_open(platform, volume), 0.6)
    assert stock_optuna_values(path) == pytest.approx([0.5, 0.6])
    assert mark not in path.read_bytes()


# --- one sweep per study (tasks.study_lock) ---------------------------------------------------------------

def _holder(sweep: str, renewed: float = 1000.0, ttl_s: float = 300.0) -> StudyHolder:
    return StudyHolder(sweep=sweep, name=f"sweep-{sweep}", since=renewed, renewed=renewed, ttl_s=ttl_s)


def test_a_study_is_taken_when_free_kept_by_its_holder_and_freed_by_a_holder_that_is_gone() -> None:
    me, other = _holder("me", 2000.0), _holder("other", 1900.0)
    alive = lambda holder: False  # noqa: E731
    assert claimed(None, me, 2000.0, alive) == me
    assert claimed(other, me, 2000.0, alive) is other  # a live holder keeps it
    assert claimed(other, me, 1900.0 + 301, alive) == me  # silent past its lifetime
    assert claimed(other, me, 2000.0, lambda holder: holder.sweep == "other") == me  # its process/run ended
    renewed = claimed(_holder("me", 1500.0), me, 2000.0, alive)
    assert (renewed.since, renewed.renewed) == (1500.0, 2000.0)  # mine: renewed, held since it was first taken
    assert released(other, "me") is other and released(me, "me") is None and released(None, "me") is None


def test_a_second_sweep_is_refused_naming_the_first_or_waits_for_it(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    said: list[str] = []
    with holding_study(platform, volume, "lanes", "sweep-a-id", "sweep-a", False, said.append,
                       gone=lambda holder: False):
        refused = r"study 'lanes' on volume 'tusimple' is held by sweep sweep-a \(flow run sweep-a-id, holding it since"
        with pytest.raises(StudyBusy, match=refused), holding_study(platform, volume, "lanes", "sweep-b-id", "sweep-b",
                                                                    False, said.append, gone=lambda holder: False):
            pass
        waiting = threading.Event()
        order: list[str] = []

        def second() -> None:
            with holding_study(platform, volume, "lanes", "sweep-b-id", "sweep-b", True,
                               lambda line: (said.append(line), waiting.set()), ttl_s=4.0, gone=lambda holder: False):
                order.append("b holds it")

        thread = threading.Thread(target=second)
        thread.start()
        assert waiting.wait(30)
        order.append("a lets go")
    thread.join(60)
    assert order == ["a lets go", "b holds it"]
    assert "study 'lanes' is held by sweep sweep-a (flow run sweep-a-id" in said[-1]
    assert platform.update_volume_record(volume, record_key("lanes"), lambda raw: raw) is None  # released


def test_a_dead_holder_is_taken_over_and_a_sweep_taken_for_dead_writes_nothing_more(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    said: list[str] = []
    with holding_study(platform, volume, "lanes", "old-id", "old", False, said.append,
                       gone=lambda holder: False) as old_lease:
        study = SweepStudy.open("lanes", SPACE, BASE, platform, volume, old_lease)
        _completed(study, 0.5)
        # The old sweep's run ended (cancelled, crashed) without letting go: the next sweep takes the study over.
        with holding_study(platform, volume, "lanes", "new-id", "new", False, said.append,
                           gone=lambda holder: holder.sweep == "old-id") as new_lease:
            assert "was held by sweep old (flow run old-id" in said[-1] and "which is gone" in said[-1]
            journal = Path(volume.location) / journal_path("lanes")
            before = journal.read_bytes()
            with pytest.raises(StudyLost, match=r"study 'lanes' is now held by sweep new \(flow run new-id"):
                _completed(study, 0.9)  # the old sweep, still running somewhere, writes nothing more
            assert journal.read_bytes() == before
            _completed(SweepStudy.open("lanes", SPACE, BASE, platform, volume, new_lease), 0.6)
    assert stock_optuna_values(journal) == pytest.approx([0.5, 0.6])


def test_a_volume_record_is_updated_atomically_by_writers_side_by_side(laneflow_home: Path) -> None:
    platform = LocalPlatform()
    volume = platform.ensure_volume("tusimple")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: platform.update_volume_record(
            volume, "counter", lambda raw: str(int(raw or 0) + 1)), range(200)))
    assert platform.update_volume_record(volume, "counter", lambda raw: raw) == "200"


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


def test_on_a_cluster_a_failed_read_is_retried_never_taken_for_a_missing_journal(emulator: tuple) -> None:
    """An API that fails every try of one reader Job (the platform's own retries exhausted): the read is tried
    again; one that keeps failing is an error naming the file, and no fresh study is written over the old."""
    from tasks.platforms.base import VolumeReadFailed
    from tests.cluster import Fault
    from tests.cluster_platform_helpers import cluster_platform

    emu, cluster = emulator
    platform = cluster_platform(emu, api_attempts=2, api_retry_delay_s=0.1)
    volume = platform.ensure_volume("data")
    platform.ensure_shared_access(volume)
    with pytest.raises(FileNotFoundError, match=r"studies/lanes\.journal does not exist on volume 'data'"):
        platform.read_file(volume, journal_path("lanes"))
    _completed(SweepStudy.open("lanes", SPACE, BASE, platform, volume), 0.5)
    journal = cluster.claim_dir("lanes", "data") / journal_path("lanes")
    written = journal.read_bytes()

    cluster.inject("POST", "jobs", *[Fault(503)] * 2)  # one reader Job never gets created
    assert [t.value for t in SweepStudy.open("lanes", SPACE, BASE, platform, volume).optuna_study.trials] == [0.5]

    cluster.inject("POST", "jobs", *[Fault(503)] * 6)  # every try fails
    with pytest.raises(VolumeReadFailed, match=r"studies/lanes.journal on volume 'data' could not be read .* it may "
                                               r"well be there, so nothing was assumed about it"):
        SweepStudy.open("lanes", SPACE, BASE, platform, volume)
    assert journal.read_bytes() == written
    cluster.faults.clear()

    # Who holds a study: a PV annotation written with a resourceVersion precondition.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: platform.update_volume_record(
            volume, "counter", lambda raw: str(int(raw or 0) + 1)), range(12)))
    assert platform.update_volume_record(volume, "counter", lambda raw: raw) == "12"
    platform.replace_file(volume, journal_path("lanes"), b'{"a": 1}\n')
    assert journal.read_bytes() == b'{"a": 1}\n'
    assert [p.name for p in journal.parent.iterdir()] == ["lanes.journal"]  # nothing left beside it
