"""A training job belongs to the flow run that started it: another run of the same run key (a user who types a
live trial's key, a sweep re-running a trial) neither adopts nor stops it — on a cluster (the MPIJob's
``laneflow.io/flow-run`` label, through the real kubernetes client against the emulated API server) and locally
(the run folder's launcher record)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.platforms import VolumeRef
from tasks.platforms.base import NotOurClaim, NotOurJob, TrainingFailed, TrainingSpec
from tasks.platforms.local import LocalPlatform
from tasks.platforms.local.files import write_json
from tasks.platforms.local.processes import LAUNCHER_RECORD
from tasks.processes import group_alive, stop_process
from tasks.retry import is_transient
from tests.cluster_platform_helpers import cluster_platform, create_rwo_claim, spec_for
from tests.waiting import wait_until

FIRST, SECOND = "0b5f7a8e-1111-4a4a-9c9c-000000000001", "0b5f7a8e-2222-4a4a-9c9c-000000000002"


def _owned(spec: TrainingSpec, flow_run: str) -> TrainingSpec:
    return spec.model_copy(update={"labels": {**spec.labels, "flow-run": flow_run}})


def test_an_mpijob_of_another_flow_run_is_neither_adopted_nor_stopped(emulator: tuple) -> None:
    """No nodes: the job stays pending, as a queued trial does; nothing of it runs."""
    emu, cluster = emulator
    cluster.nodes = {}
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("owned")
    spec = spec_for(volume.name, job="train-soak-0")
    first = platform.submit_training(_owned(spec, FIRST))
    assert not first.adopted
    with pytest.raises(NotOurJob, match=f"MPIJob train-soak-0 is still training for flow run {FIRST}, another run "
                                        "of the same run key"):
        platform.submit_training(_owned(spec, SECOND))
    with pytest.raises(NotOurJob, match=f"started by flow run {FIRST}, not {SECOND}"):
        platform.cancel_training("train-soak-0", volume, owner=SECOND)
    (job,) = cluster.objects["mpijobs"].values()
    assert not job["metadata"].get("deletionTimestamp")
    # Its own flow run (a retry, a rescheduled flow pod) adopts it and may stop it.
    assert platform.submit_training(_owned(spec, FIRST)).adopted
    assert platform.cancel_training("train-soak-0", volume, owner=FIRST) is True


def test_a_local_training_of_another_flow_run_is_neither_adopted_nor_stopped(tmp_path: Path) -> None:
    """A training another flow run started on this machine (its horovodrun's process group, recorded in the run's
    folder) is left running; the run that started it stops it."""
    platform = LocalPlatform(home=str(tmp_path / "home"))
    volume = VolumeRef(name="owned", location="")
    run_dir = platform.volume_path(volume) / "runs" / "train-soak-0"
    run_dir.mkdir(parents=True)
    launcher = tmp_path / "horovodrun"  # stands for the first run's horovodrun: its name and the run folder
    launcher.write_text("#!/bin/sh\nsleep 600\n")
    launcher.chmod(0o755)
    process = subprocess.Popen(["/bin/sh", str(launcher), str(run_dir)], start_new_session=True)
    try:
        write_json(run_dir / LAUNCHER_RECORD, {"job_name": "train-soak-0", "pid": process.pid, "pgid": process.pid,
                                               "exit_code": None, "owner": FIRST})
        spec = spec_for(volume.name, job="train-soak-0")
        with pytest.raises(NotOurJob, match=f"training train-soak-0 is still running for flow run {FIRST}"):
            platform.submit_training(_owned(spec, SECOND))
        with pytest.raises(NotOurJob, match=f"started by flow run {FIRST}, not {SECOND}"):
            platform.cancel_training("train-soak-0", volume, owner=SECOND)
        assert group_alive(process.pid)
        assert platform.cancel_training("train-soak-0", volume, owner=FIRST) is True
        process.wait(timeout=60)
        assert not group_alive(process.pid)
    finally:
        stop_process(process, grace_s=5)


def test_a_claim_laneflow_did_not_make_is_refused_unless_the_block_adopts_it(emulator: tuple) -> None:
    """A volume name typed by mistake must not take over another team's claim: nothing is patched, written or
    snapshotted on it. The seed's hand-made claim stays usable by naming it in the block's adopt_claims."""
    emu, cluster = emulator
    create_rwo_claim(emu, "their-data")
    cluster.requests.clear()
    with pytest.raises(NotOurClaim, match=r"PVC lanes/their-data exists but laneflow did not create it .*"
                                          r"add 'their-data' to the platform block's adopt_claims") as refused:
        cluster_platform(emu).ensure_volume("their-data")
    assert not is_transient(refused.value)  # the same answer every time: not retried
    assert not [r for r in cluster.requests if r.verb not in ("get", "list", "watch")]  # nothing touched
    adopting = cluster_platform(emu, adopt_claims=["their-data"])
    adopted = adopting.ensure_volume("their-data")
    assert not adopted.created and "patched to ReadWriteMany" in adopting.ensure_shared_access(adopted)
    ours = cluster_platform(emu).ensure_volume("ours")  # laneflow's own claim: any later run uses it
    assert ours.created and not cluster_platform(emu).ensure_volume("ours").created


def test_a_local_training_that_ended_before_anyone_waited_is_adopted_as_it_ended_not_started_again(
        tmp_path: Path) -> None:
    """The submit task starts a training and the train task adopts it. One that ended in between (a trial that met
    its stop request at once) was started again from its checkpoint and trained to its end (seen in CI): it is
    adopted as it ended — its output read, its end classified — and never started twice."""
    platform = LocalPlatform(home=str(tmp_path / "home"))
    spec = _owned(spec_for("quick", job="train-quick-0"), FIRST)  # no dataset: the trainer ends at once, failing
    first = platform.submit_training(spec)
    pid = first.details["pid"]

    def ended() -> bool:  # exited, not yet reaped: nobody has waited for it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

    wait_until("the launcher ended", ended, timeout_s=300)
    again = platform.submit_training(spec)
    assert again.adopted and again.details["pid"] == pid
    with pytest.raises(TrainingFailed, match="train-quick-0 failed"):
        platform.wait_for_training(again, lambda _: None, lambda _: None, timeout_s=300)
    record = json.loads((platform.volume_path(spec.volume) / spec.run_dir / LAUNCHER_RECORD).read_text())
    assert record["attempts"] == 1 and record["exit_code"] not in (None, 0)
