"""Azure NetApp Files: the real azure-mgmt-netapp client (and azure-identity) over TLS against an ARM
emulator on 127.0.0.1 with a throwaway CA; the volume's level held while runs train (side by side, preempted,
in a sweep) and returned however a run ends, no secrets out."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from pydantic import SecretStr

from flows.train import train_pipeline
from tasks.anf import AnfError, AnfVolume
from tasks.level_holds import LevelRecord
from tasks.platforms.cluster.volumes import LEVEL_RECORD_ANNOTATION
from tasks.processes import running
from tests.azure import TOKEN, Arm, ArmEmulator
from tests.cluster import KubernetesEmulator
from tests.cluster.runtime import pod_runtime_missing
from tests.cluster_platform_helpers import cluster_platform
from tests.conftest import PROJECT_ROOT
from tests.gpu_limit import active_gpu_slots, operator_gpu_limit
from tests.test_pipeline import params_for

SECRET = "s3cret-client-value-9d1e"
SUB, RG, ACCOUNT = "0000-sub", "rg-lanes", "anf-lanes"
POOLS = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.NetApp/netAppAccounts/{ACCOUNT}/capacityPools"


def anf_volume(emulator: ArmEmulator, **changes: object) -> AnfVolume:
    base = emulator.arm.base
    fields = {"subscription_id": SUB, "resource_group": RG, "account": ACCOUNT, "volume": "tusimple",
              "location": "westeurope",
              "pool_ids": {level: f"{POOLS}/pool-{level.lower()}" for level in ("Standard", "Premium", "Ultra")},
              "tenant_id": "tenant-1", "client_id": "laneflow-sp", "client_secret": SecretStr(SECRET),
              "authority_host": base.removeprefix("https://"), "arm_endpoint": base,
              "ca_bundle": str(emulator.ca_file), "polling_interval_s": 0.05, **changes}
    return AnfVolume(**fields)


ROLE = PROJECT_ROOT / "deployments" / "azure" / "laneflow-anf-role.json"
#: Every Microsoft.NetApp action Azure knows (its source is the file's first line).
REAL_OPERATIONS = Path(__file__).parent / "fixtures" / "azure-netapp-operations.txt"


def on_anf(k8s: KubernetesEmulator, state: Arm, imported: dict[str, str] | None = None) -> None:
    """Trident's Azure NetApp Files backend for the emulated cluster, on the ARM emulator: a claim gets an ANF
    volume of its own, named after its PV, in the Standard pool with the claim's size as quota (as Trident's
    azure-netapp-files driver creates it) — except a claim of ``imported`` (claim -> ANF volume; by default
    claim tusimple -> the ANF volume tusimple of the ``arm`` fixture), whose existing volume was imported into
    Trident (``tridentctl import volume``) and keeps its name."""
    imported = {"tusimple": "tusimple"} if imported is None else imported

    def provision(namespace: str, claim: str, pv_name: str, size_bytes: int) -> str:
        name = imported.get(claim, pv_name)
        with state.lock:
            volume = state.volumes.setdefault(name, {"pool": "pool-standard", "level": "Standard",
                                                     "quota": size_bytes})
        return f"{POOLS}/{volume['pool']}/volumes/{name}"

    k8s.cluster.anf_backend = provision


def level_record(emulator: KubernetesEmulator, claim: str = "tusimple", namespace: str = "lanes"
                 ) -> LevelRecord | None:
    """The service-level record as `kubectl get pvc` shows it: the annotation on the claim."""
    stored = emulator.cluster.objects["persistentvolumeclaims"][(namespace, claim)]
    raw = (stored["metadata"].get("annotations") or {}).get(LEVEL_RECORD_ANNOTATION)
    return LevelRecord.model_validate_json(raw) if raw else None


def role_actions() -> set[str]:
    """The custom role's actions; Azure matches actions case-insensitively."""
    return {action.lower() for action in json.loads(ROLE.read_text())["Actions"]}


def pool_changes(state: Arm) -> int:
    return sum(1 for method, path, _ in state.requests if method == "POST" and path.endswith("/poolChange"))


def test_pool_change_is_a_polled_long_running_operation_with_retries(arm: tuple) -> None:
    emulator, state = arm
    volume = anf_volume(emulator)
    assert volume.locate() == ("pool-standard", "Standard", 2.0)
    state.faults["pool_change"] += [429, 500]
    assert volume.change_level("Premium") is True
    assert state.volumes["tusimple"]["pool"] == "pool-premium" and volume.current_level() == "Premium"
    polls = [path for method, path, _ in state.requests if "/operationResults/" in path]
    assert len(polls) >= 2  # 202 + Azure-AsyncOperation, polled until Succeeded
    assert pool_changes(state) == 3  # 429, 500, then accepted
    assert volume.change_level("Premium") is False  # already there: no call
    assert pool_changes(state) == 3
    headers = [h for method, path, h in state.requests if path.startswith("/subscriptions/")]
    assert all(h.get("Authorization") == f"Bearer {TOKEN}" for h in headers)
    assert state.secrets_seen == [SECRET]  # the secret went to the token endpoint only, once


def test_every_action_of_the_azure_role_is_a_real_netapp_operation() -> None:
    real = {line.strip().lower() for line in REAL_OPERATIONS.read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    assert len(real) > 100
    unknown = role_actions() - real
    # Azure refuses a whole custom role over one action it does not know (InvalidActionOrNotAction).
    assert not unknown, f"not Microsoft.NetApp operations: {sorted(unknown)}"


def test_the_azure_role_grants_exactly_what_laneflows_calls_need(arm: tuple) -> None:
    emulator, state = arm
    volume = anf_volume(emulator)
    volume.change_level("Premium")  # get the volume, poolChange, poll operationResults
    volume.change_level("Standard")
    volume.create_snapshot("tusimple-train-1")  # get (adopt?), create, poll
    volume.list_snapshots()
    assert {action.lower() for action in state.actions} == role_actions()
    # The operation status was polled where the service points: .../locations/<loc>/operationResults/<id>.
    assert any(path.startswith(f"/subscriptions/{SUB}/providers/Microsoft.NetApp/locations/westeurope/"
                               "operationResults/") for _, path, _ in state.requests)


def test_a_failed_operation_names_the_operation_and_the_volume(arm: tuple) -> None:
    emulator, state = arm
    state.fail_operations.add("pool_change")
    with pytest.raises(AnfError, match=r"pool change of volume 'tusimple' from Standard \(pool-standard\) to Ultra "
                                       r"failed: PoolChangeFailed"):
        anf_volume(emulator).change_level("Ultra")
    assert state.volumes["tusimple"]["pool"] == "pool-standard"


def test_a_ca_bundle_given_as_pem_text_is_read_from_a_private_file_never_a_planted_one(arm: tuple) -> None:
    """The block's PEM text goes to a file the SDKs read. Another local user who plants a file of their own CA where
    that file used to go (a predictable name in the shared temporary folder) is not trusted: the file is this
    process's, in a folder only it may enter."""
    import hashlib
    import stat
    import tempfile

    import trustme

    emulator, _ = arm
    pem = emulator.ca.cert_pem.bytes().decode()
    digest = hashlib.sha256(pem.encode()).hexdigest()[:16]
    planted = Path(tempfile.gettempdir()) / f"laneflow-anf-ca-{digest}.pem"
    planted.write_text(trustme.CA().cert_pem.bytes().decode())  # someone else's CA
    try:
        volume = anf_volume(emulator, ca_bundle=pem)
        assert volume.locate() == ("pool-standard", "Standard", 2.0)  # TLS verified against the block's CA
        used = Path(volume._verify())
        assert used != planted and used.read_text() == pem
        assert stat.S_IMODE(used.parent.stat().st_mode) == 0o700 and used.parent.stat().st_uid == os.getuid()
    finally:
        planted.unlink(missing_ok=True)


def test_anf_snapshot_and_configuration_errors(arm: tuple) -> None:
    emulator, state = arm
    volume = anf_volume(emulator)
    snapshot_id = volume.create_snapshot("tusimple-train-1")
    assert snapshot_id.endswith("/volumes/tusimple/snapshots/tusimple-train-1")
    assert volume.create_snapshot("tusimple-train-1") == snapshot_id  # adopted, not created twice
    assert sum(1 for method, _, _ in state.requests if method == "PUT") == 1
    with pytest.raises(ValueError, match="no capacity pool configured for service level 'Ultra'"):
        anf_volume(emulator, pool_ids={"Standard": f"{POOLS}/pool-standard"}).change_level("Ultra")
    with pytest.raises(AnfError, match="in none of the configured capacity pools"):
        anf_volume(emulator, volume="elsewhere").locate()
    assert SECRET not in repr(volume) and SECRET not in str(volume.model_dump())


def test_a_snapshot_azure_is_still_taking_is_listed_as_not_ready(arm: tuple) -> None:
    emulator, state = arm
    state.operation_s = math.inf  # still being taken after any wait, until run_out
    volume = anf_volume(emulator, operation_timeout_s=0.5)
    with pytest.raises(AnfError, match="'tusimple-train-0123456789ab' of volume 'tusimple' was not created within"):
        volume.create_snapshot("tusimple-train-0123456789ab")
    (taking,) = volume.list_snapshots()
    assert (taking.name, taking.ready) == ("tusimple-train-0123456789ab", False)
    state.run_out()
    (taken,) = volume.list_snapshots()
    assert taken.ready and taken.created and taken.id.endswith("/snapshots/tusimple-train-0123456789ab")


def _everything_published(flow_run_id: object) -> str:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join([*(log.message for log in logs), *(str(a.data) for a in artifacts)])


@pytest.mark.slow
def test_training_failure_after_promotion_rolls_the_volume_back(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple, tmp_path: Path,
        capfd: pytest.CaptureFixture) -> None:
    from prefect.logging.handlers import APILogWorker

    emulator, state = arm
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        # Training fails for real: the workers' /dev/shm is too small for the loader workers.
        cluster_platform(k8s, anf=anf_volume(emulator), shm_size="64Ki").save("emu-anf", overwrite=True)
        # 1 worker x 200 img/s x 256 KiB x 1.25 = 62.5 MiB/s; 2 TiB: Standard 32, Premium 128 -> Premium.
        state_of_run = train_pipeline(**params_for(served_archive, platform="emu-anf", volume="tusimple",
                                                 promote=True, loader_workers=2, workers=1), return_state=True)
    assert state_of_run.is_failed()
    assert pool_changes(state) == 2  # promoted to Premium, then rolled back
    assert state.volumes["tusimple"]["pool"] == "pool-standard"
    APILogWorker.drain_all(timeout=30)
    published = _everything_published(state_of_run.state_details.flow_run_id)
    assert "Premium gives 128.0 MiB/s" in published  # the tier reasoning artifact
    captured = capfd.readouterr()
    for text in (published, captured.out, captured.err):
        assert SECRET not in text and TOKEN not in text



@pytest.mark.slow
def test_promoted_for_training_demoted_after_and_snapshotted_through_anf(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple,
        tmp_path: Path) -> None:
    from tasks.platforms import ClusterPlatform

    emulator, state = arm
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s as cluster:
        cluster_platform(k8s, anf=anf_volume(emulator), snapshotter="anf").save("emu-anf-ok", overwrite=True)
        result = train_pipeline(**params_for(served_archive, platform="emu-anf-ok", volume="tusimple",
                                           promote=True))
        assert cluster.count("volumesnapshots") == 0  # the ANF snapshotter, not CSI
        platform = ClusterPlatform.load("emu-anf-ok")
        lineage = platform.find_lineage(result["snapshot"])
        refs = platform.list_snapshots()
        listed = [ref.name for ref in refs]
        # Listed with their lineage (from the run's record on the volume) and Azure's readiness.
        assert [(ref.ready, ref.lineage["dataset_version"], ref.lineage["run"]) for ref in refs] == \
            [(True, result["dataset_version"], result["run"])]
        assert refs[0].lineage["created_at"] and lineage["ready"] is True
        # The run's name again, over other data (a run key reused after a new drop): refused, the record kept.
        volume = platform.ensure_volume("tusimple")
        with pytest.raises(FileExistsError, match=f"snapshot '{result['snapshot']}' already exists with dataset "
                                                  f"version {result['dataset_version']}"):
            platform.create_snapshot(volume, result["snapshot"], lineage["data_dir"], lineage["run_dir"],
                                     {**lineage, "dataset_version": "another-drop"})
        assert platform.find_lineage(result["snapshot"])["dataset_version"] == result["dataset_version"]
        with pytest.raises(ValueError, match="is an ANF snapshot"):
            platform.restore_snapshot(result["snapshot"], "restored")
        # compare reads the cluster run's own records on its volume and bills its storage at Premium.
        from flows.compare import RunRef, compare_runs
        from tasks.compare import Prices

        prices = Prices(worker_hour={"emu-anf-ok": 3.0}, tib_hour={"Premium": 0.4})
        (row,) = compare_runs(runs=[RunRef(name=result["snapshot"], platform="emu-anf-ok")], prices=prices)
        assert row["workers"] == 2 and row["steps"] == result["steps"] and "TiB-h Premium x 0.4" in row["cost basis"]
    assert lineage["service_level"] == {"training": "Premium", "home": "Standard", "quota_tib": 2.0}
    assert pool_changes(state) == 2 and state.volumes["tusimple"]["pool"] == "pool-standard"
    assert list(state.snapshots) == [result["snapshot"]] == listed
    assert lineage["run"] == result["run"] and lineage["dataset_version"] == result["dataset_version"]
    assert lineage["metrics"] == result["metrics"] and lineage["snapshotter"] == "anf"
    assert SECRET not in _everything_published(result["flow_run_id"])


def test_a_promotion_that_times_out_while_azure_moves_the_volume_still_ends_on_its_level(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple,
        tmp_path: Path) -> None:
    """The pool change outlives laneflow's wait (operation_timeout_s) but Azure carries on: the failed run
    waits for that move, then moves the volume back. A rollback hook would not help: Prefect registers it
    only for tasks that completed, and this one failed."""
    emulator, state = arm
    if missing := pod_runtime_missing():  # the promotion comes after the dataset stage, which runs in a pod
        pytest.skip(missing)
    state.operation_s = 5.0  # Azure's clock: the move ends 2 s after laneflow stopped waiting for it
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator, operation_timeout_s=3)).save("emu-anf-slow", overwrite=True)
        run = train_pipeline(**params_for(served_archive, platform="emu-anf-slow", volume="tusimple", promote=True),
                             return_state=True)
        assert level_record(k8s) is None  # home and unheld: forgotten
    assert run.is_failed() and "did not finish within 3 s; Azure carries on with it" in str(run.message)
    state.run_out()
    assert pool_changes(state) == 2  # Premium (finished by Azure after the timeout), then back
    assert state.volumes["tusimple"]["pool"] == "pool-standard"


def test_a_volume_that_cannot_be_returned_is_reported_with_the_command_and_the_next_run_returns_it(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple, tmp_path: Path,
        capfd: pytest.CaptureFixture) -> None:
    emulator, state = arm
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    state.operation_s = math.inf  # outlasts all laneflow waits for it (1 s, then 3 tries to return it), however slow
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator, operation_timeout_s=1)).save("emu-anf-stuck", overwrite=True)
        first = train_pipeline(**params_for(served_archive, platform="emu-anf-stuck", volume="tusimple",
                                            promote=True), return_state=True)
        assert first.is_failed()
        said = capfd.readouterr().out
        assert "laneflow: volume tusimple is NOT back on Standard: run Set-AzNetAppFilesVolumePool " \
               "-ResourceGroupName" in said and f"-NewPoolResourceId {POOLS}/pool-standard" in said
        state.run_out()
        assert state.volumes["tusimple"]["pool"] == "pool-premium"  # Azure finished the promotion: billed
        # The next run (promotion off, say) finds the record of the level it came from and returns it.
        state.operation_s = 0.2
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-anf-stuck", overwrite=True)
        second = train_pipeline(**params_for(served_archive, platform="emu-anf-stuck", volume="tusimple",
                                             promote=False, workers=1, max_steps=1, snapshot=False),
                                return_state=True)
        assert level_record(k8s) is None
    assert second.is_completed()
    assert state.volumes["tusimple"]["pool"] == "pool-standard"


def test_pools_of_another_netapp_account_are_refused_by_the_block_and_by_azure(arm: tuple) -> None:
    from azure.core.exceptions import HttpResponseError
    from azure.mgmt.netapp.models import PoolChangeRequest

    emulator, state = arm
    elsewhere = POOLS.replace(f"netAppAccounts/{ACCOUNT}", "netAppAccounts/anf-other") + "/pool-premium"
    with pytest.raises(ValueError, match=r"pool_ids\['Premium'\] is a pool of NetApp account 'anf-other' .* a "
                                         r"volume moves only between pools of its own NetApp account"):
        anf_volume(emulator, pool_ids={"Standard": f"{POOLS}/pool-standard", "Premium": elsewhere})
    with pytest.raises(ValueError, match="is not a capacity pool resource id"):
        anf_volume(emulator, pool_ids={"Standard": "pool-standard"})
    client = anf_volume(emulator)._client()  # what Azure answers to a request the block now refuses to make
    with pytest.raises(HttpResponseError, match="must be in the same NetApp account"):
        client.volumes.begin_pool_change(RG, ACCOUNT, "pool-standard", "tusimple",
                                         PoolChangeRequest(new_pool_resource_id=elsewhere)).result()
    assert state.volumes["tusimple"]["pool"] == "pool-standard"


def test_an_api_version_other_than_the_modelled_spec_is_refused(arm: tuple) -> None:
    import ssl
    import urllib.error
    import urllib.request

    emulator, _ = arm
    request = urllib.request.Request(f"{emulator.arm.base}/subscriptions/{SUB}/resourceGroups/{RG}/providers/"
                                     f"Microsoft.NetApp/netAppAccounts/{ACCOUNT}/capacityPools/pool-standard/volumes/"
                                     "tusimple?api-version=2017-08-15", headers={"Authorization": f"Bearer {TOKEN}"})
    context = ssl.create_default_context(cafile=str(emulator.ca_file))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, context=context, timeout=30)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["code"] == "NoRegisteredProviderFound"


@pytest.mark.slow
def test_runs_side_by_side_share_the_promotion_and_a_terminated_one_leaves_it(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple,
        tmp_path: Path) -> None:
    """A long run trains on the volume promoted to Premium; a second run trains beside it, so the volume feeds
    both on Ultra, and goes back to Premium — not home — when the second ends. Then SIGTERM to the first run's
    process (a drained node, a stopped worker): Prefect ends the run Crashed, and its hook stops the MPIJob and,
    as the last holder, takes the volume home to Standard — nothing left billed."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from tasks.platforms import ClusterPlatform

    emulator, state = arm
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    params = params_for(served_archive, platform="emu-anf-crash", volume="tusimple", promote=True, epochs=500)
    script = ("import json, sys\nfrom flows.train import train_pipeline\n"
              "train_pipeline.with_options(flow_run_name=sys.argv[2])(**json.loads(sys.argv[1]))")
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home)}
    output = tmp_path / "flow.log"
    with k8s as cluster, output.open("wb") as sink, operator_gpu_limit(4):  # two runs of two GPUs side by side
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-anf-crash", overwrite=True)
        with running([sys.executable, "-c", script, json.dumps(params, default=_json_default), "terminated-run"],
                     env=env, cwd=PROJECT_ROOT, stdout=sink, stderr=subprocess.STDOUT) as flow_process:
            deadline = time.monotonic() + 300
            while not any("launcher" in name and pod["status"].get("phase") == "Running"
                          for (_, name), pod in list(cluster.objects["pods"].items())):
                assert flow_process.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
                time.sleep(0.5)
            assert state.volumes["tusimple"]["pool"] == "pool-premium"  # promoted for the training window
            (first,) = level_record(k8s).holds.values()
            assert active_gpu_slots() == 2  # a slot for each of its two workers' GPUs
            beside = train_pipeline(**params_for(served_archive, platform="emu-anf-crash", volume="tusimple",
                                                 promote=True))
            assert flow_process.poll() is None, output.read_text()[-3000:]  # the first still trains
            assert state.volumes["tusimple"]["pool"] == "pool-premium"  # ... and still holds the volume
            assert [hold.run for hold in level_record(k8s).holds.values()] == [first.run]
            lineage = ClusterPlatform.load("emu-anf-crash").find_lineage(beside["snapshot"])
            flow_process.send_signal(signal.SIGTERM)
            flow_process.wait(timeout=240)
        deadline = time.monotonic() + 120  # Foreground: gone once its launcher and workers are
        while ("lanes", first.run) in cluster.objects["mpijobs"]:
            assert time.monotonic() < deadline, f"MPIJob {first.run} is still there"
            time.sleep(0.5)
        left = [name for (_, name) in cluster.objects["pods"] if name.startswith(first.run)]
        assert not left, left
        state.run_out()
        assert level_record(k8s) is None
    assert lineage["service_level"] == {"training": "Ultra", "home": "Standard", "quota_tib": 2.0}
    said = output.read_text()
    # The crash hook ran; the MPIJob is gone (above) whether the interrupted wait or the hook deleted it.
    assert re.search(r"training job train-\w+ (stopped|was not running) \(flow run crashed\)", said), said[-3000:]
    assert state.volumes["tusimple"]["pool"] == "pool-standard"
    assert [level for _, _, level in state.levels] == ["Premium", "Ultra", "Premium", "Standard"]
    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=["terminated-run"])))
    assert flow_run.state.is_crashed()


@pytest.mark.slow
def test_a_preempted_training_is_retried_on_the_promoted_level(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple,
        tmp_path: Path) -> None:
    """A worker evicted mid-training (a preemption): the training stage is retried and resumes from its
    checkpoint, on the level it was promoted to. Prefect rolls a failed attempt's transaction back before it
    retries; nothing of laneflow's hangs on that any more, so the volume goes home only when the run ends."""
    from tasks.platforms import ClusterPlatform
    from tests.test_pipeline import task_runs

    emulator, state = arm
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    evicted: list[str] = []

    def evict_after_first_checkpoint(cluster: object, namespace: str, pod: str, line: str) -> None:
        if '"event": "checkpoint"' in line and "-launcher" in pod and not evicted:
            evicted.append(pod)
            cluster.evict(namespace, pod.split("-launcher")[0] + "-worker-0")  # type: ignore[attr-defined]

    with k8s as cluster:
        cluster.on_log_line = evict_after_first_checkpoint
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-anf-preempt", overwrite=True)
        result = train_pipeline(**params_for(served_archive, platform="emu-anf-preempt", volume="tusimple",
                                             promote=True, epochs=2))
        lineage = ClusterPlatform.load("emu-anf-preempt").find_lineage(result["snapshot"])
    assert evicted and result["resumed_from"] >= 1
    (training,) = task_runs(UUID(result["flow_run_id"]))["wait_for_training"]
    assert training.run_count == 2  # interrupted once, retried once
    assert [level for _, _, level in state.levels] == ["Premium", "Standard"]
    (promoted_at, _, _), (home_at, _, _) = state.levels
    assert promoted_at < training.start_time.timestamp() and home_at > training.end_time.timestamp()
    assert lineage["service_level"] == {"training": "Premium", "home": "Standard", "quota_tib": 2.0}


@pytest.mark.slow
def test_every_trial_of_a_one_at_a_time_sweep_trains_promoted(
        prefect_server: dict, laneflow_home: Path, served_archive: tuple[str, str], arm: tuple,
        tmp_path: Path) -> None:
    """A grid sweep of two trials, one training at a time: each trial is promoted once it has its `gpu`
    slot, so each trains on Premium (the ARM emulator's record of levels, against each training stage's
    time in Prefect), and the volume is home after the sweep."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.sweep import sweep
    from tests.test_pipeline import task_runs

    emulator, state = arm
    if missing := pod_runtime_missing():
        pytest.skip(missing)
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-anf-sweep", overwrite=True)
        # One worker per trial: 62.5 MiB/s, still over Standard's 32 and within Premium's 128.
        swept = sweep(**params_for(served_archive, platform="emu-anf-sweep", volume="tusimple", promote=True,
                                   snapshot=False, workers=1), grid={"lr": [0.05, 0.02]}, max_concurrent=1,
                      return_state=True)
        assert level_record(k8s) is None
    table = swept.result()
    assert [row["state"] for row in table] == ["Completed"] * 2
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(swept.state_details.flow_run_id).name
        trials = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            any_=[f"{name}-{index}" for index in range(2)])))
    assert len(trials) == 2
    changes = [(at, level) for at, volume, level in state.levels if volume == "tusimple"]
    for trial in trials:
        (training,) = task_runs(trial.id)["wait_for_training"]
        start, end = training.start_time.timestamp(), training.end_time.timestamp()
        on_start = ([level for at, level in changes if at <= start] or ["Standard"])[-1]
        assert on_start == "Premium" and all(level == "Premium" for at, level in changes if start <= at <= end), \
            (trial.name, start, end, changes)
    assert state.volumes["tusimple"]["pool"] == "pool-standard"


def _json_default(value: object) -> object:
    return value.model_dump(mode="json")  # type: ignore[attr-defined]
