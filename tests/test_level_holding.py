"""Holding an ANF volume's service level (``tasks.holding``): the record on the claim's PV is updated atomically
through the real kubernetes client, holders that died are dropped, and the volume goes home only when the last
live holder has left. Real Prefect, the ARM emulator (azure-mgmt-netapp over TLS) and the API server of the
emulated cluster; the holders are real processes, killed for real. No pods: none of this runs in one."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.runtime import flow_run
from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

from tasks.level_holds import LevelHold, joined
from tasks.pipeline import demote_service_level, ensure_dataset_volume, ensure_shared_access, promote_service_level
from tasks.platforms import load_platform
from tasks.processes import running
from tasks.service_level import ThroughputNeed
from tests.cluster import KubernetesEmulator
from tests.cluster_platform_helpers import cluster_platform
from tests.conftest import PROJECT_ROOT
from tests.test_anf import ACCOUNT, POOLS, anf_volume, level_record, on_anf, pool_changes
from tests.waiting import wait_until

NEED = ThroughputNeed(workers=2, images_per_second_per_worker=200, bytes_per_image=256 * 1024)  # Premium at 2 TiB
#: A process that holds the volume's level with the pipeline's own tasks, then waits to be killed.
HOLDER = """
import sys, time
from prefect import flow
from prefect.runtime import flow_run
from tasks.pipeline import ensure_dataset_volume, ensure_shared_access, promote_service_level
from tasks.platforms import load_platform
from tasks.service_level import ThroughputNeed

@flow(name="hold-level")
def hold_level(platform_name: str, run: str) -> None:
    platform = load_platform(platform_name)
    volume = ensure_dataset_volume(platform, "tusimple")
    ensure_shared_access(platform, volume)
    need = ThroughputNeed(workers=2, images_per_second_per_worker=200, bytes_per_image=256 * 1024)
    promote_service_level(platform, volume, True, need, run, str(flow_run.id))
    print("holding", flush=True)
    time.sleep(3600)

hold_level(sys.argv[1], sys.argv[2])
"""


@flow(name="settle-level")
def settle_with_promotion_off(platform_name: str, claim: str = "tusimple", wanted: bool = False) -> dict | None:
    """What a run with promotion off does before it trains: settle the volume, hold nothing (``wanted``: what
    a run with promotion on does)."""
    platform = load_platform(platform_name)
    volume = ensure_dataset_volume(platform, claim)
    ensure_shared_access(platform, volume)
    return promote_service_level(platform, volume, wanted, NEED, "train-promotion-off", str(flow_run.id))


@flow(name="hold-and-leave")
def hold_then_leave(platform_name: str, run: str, joined_event: threading.Event, leave: threading.Event,
                    claim: str = "tusimple") -> dict:
    platform = load_platform(platform_name)
    volume = ensure_dataset_volume(platform, claim)
    ensure_shared_access(platform, volume)
    promote_service_level(platform, volume, True, NEED, run, str(flow_run.id))
    joined_event.set()
    assert leave.wait(120)
    return demote_service_level(platform, volume, str(flow_run.id), run)


def _hold(run: str) -> LevelHold:
    return LevelHold(run=run, mib_per_second=1.0, level="Standard", renewed=time.time(), ttl_s=600.0)


def test_an_update_made_on_a_stale_read_is_refused_and_made_again(arm: tuple, tmp_path: Path) -> None:
    """Another writer changes the PV between this update's read and its write: the API server refuses the write
    (409, its resourceVersion is stale) and the update reads again and redoes its change on the new record."""
    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        platform = cluster_platform(k8s, anf=anf_volume(emulator))
        other = cluster_platform(k8s, anf=anf_volume(emulator))  # another process: a block and client of its own
        volume = platform.ensure_volume("tusimple")
        platform.ensure_shared_access(volume)
        seen: list[set[str]] = []

        def change(record):
            seen.append(set(record.holds) if record else set())
            if len(seen) == 1:  # the other writer gets in between this read and this write
                other.update_level_record(volume, lambda r: joined(r, "run-other", _hold("train-other"),
                                                                   lambda: "Standard"))
            return joined(record, "run-mine", _hold("train-mine"), lambda: "Standard")

        written = platform.update_level_record(volume, change)
        assert seen == [set(), {"run-other"}]  # read, refused, read again: the other's hold is kept
        assert platform.level_record(volume) == written and sorted(written.holds) == ["run-mine", "run-other"]


def test_concurrent_updates_of_the_record_lose_nothing(arm: tuple, tmp_path: Path) -> None:
    """Two writers each add ten holds, each pausing between its read and its write: every hold is there after."""
    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        platform = cluster_platform(k8s, anf=anf_volume(emulator))
        volume = platform.ensure_volume("tusimple")
        platform.ensure_shared_access(volume)

        def add(writer: str) -> None:
            for index in range(10):
                def change(record, holder=f"{writer}-{index}"):
                    time.sleep(0.02)  # the other writer gets in between
                    return joined(record, holder, _hold(holder), lambda: "Standard")
                platform.update_level_record(volume, change)

        writers = [threading.Thread(target=add, args=(name,)) for name in ("a", "b")]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(120)
        record = platform.level_record(volume)
    assert record is not None and sorted(record.holds) == sorted(f"{w}-{i}" for w in "ab" for i in range(10))


def test_two_runs_leaving_at_once_take_the_volume_home_whichever_moves_last(
        prefect_server: dict, arm: tuple, tmp_path: Path) -> None:
    """Two holders at 125 MiB/s (Ultra together) leave at once. The first reads the record with the second still
    in it and decides on Premium; before its move, the second leaves, settles (Standard) and forgets the record.
    The first's move then lands on Premium, and its next read finds no record: nobody holds the volume, so it
    goes home. (Soak seed 11 ended on Premium with no holder: that settle stopped at the missing record.)
    Each run with a block and clients of its own, against the emulated API server and Azure (the
    level changes go to the test session's Prefect server as events)."""
    from tasks.holding import settle
    from tasks.level_holds import without

    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    log = logging.getLogger("test.level")
    with k8s:
        first = cluster_platform(k8s, anf=anf_volume(emulator))
        second = cluster_platform(k8s, anf=anf_volume(emulator))
        volume = first.ensure_volume("tusimple")
        first.ensure_shared_access(volume)
        for holder in ("run-first", "run-second"):
            hold = LevelHold(run=f"train-{holder}", mib_per_second=125.0, level="Premium", renewed=time.time(),
                             ttl_s=600.0)
            first.update_level_record(volume, lambda r, h=holder, hold=hold: joined(r, h, hold, lambda: "Standard"))
        settle(first, volume, "both joined", log)
        assert state.pool_of("tusimple") == "pool-ultra"

        class SecondLeavesFirst:
            """The first run's platform, whose first move waits until the second run has left and settled."""

            def __init__(self) -> None:
                self.moves: list[str] = []

            def __getattr__(self, name: str) -> object:
                return getattr(first, name)

            def change_service_level(self, volume_: object, level: str) -> bool:
                if not self.moves:
                    second.update_level_record(volume, lambda r: without(r, {"run-second"}))
                    settle(second, volume, "train-run-second left", log)
                    assert state.pool_of("tusimple") == "pool-standard" and level_record(k8s) is None
                self.moves.append(level)
                return first.change_service_level(volume_, level)

        racing = SecondLeavesFirst()
        first.update_level_record(volume, lambda r: without(r, {"run-first"}))
        record, level = settle(racing, volume, "train-run-first left", log)
        assert racing.moves == ["Premium", "Standard"]  # its stale decision, then home
        assert (record, level) == (None, "Standard") and state.pool_of("tusimple") == "pool-standard"
        assert level_record(k8s) is None


def test_two_holders_share_the_promotion_and_the_last_one_takes_it_home(
        prefect_server: dict, laneflow_home: Path, arm: tuple, tmp_path: Path) -> None:
    """Together the two read 250 MiB/s: Ultra; alone, one needs Premium; nobody: home (Standard)."""
    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-hold-two", overwrite=True)
        handles, results = _run_in_threads("emu-hold-two", {"train-first": "tusimple", "train-second": "tusimple"})
        events, threads = handles["events"], handles["threads"]
        threads["train-first"].start()
        assert events["train-first"][0].wait(120)
        assert state.pool_of("tusimple") == "pool-premium"
        threads["train-second"].start()
        assert events["train-second"][0].wait(120)
        assert state.pool_of("tusimple") == "pool-ultra"
        assert sorted(hold.run for hold in level_record(k8s).holds.values()) == ["train-first", "train-second"]
        events["train-first"][1].set()  # the first leaves: the second alone needs Premium
        threads["train-first"].join(120)
        assert results["train-first"] == {"training": "Ultra", "home": "Standard", "after": "Premium"}
        assert state.pool_of("tusimple") == "pool-premium"
        events["train-second"][1].set()
        threads["train-second"].join(120)
        assert results["train-second"] == {"training": "Premium", "home": "Standard", "after": "Standard"}
        assert state.pool_of("tusimple") == "pool-standard"
        assert level_record(k8s) is None  # home and unheld: nothing recorded
    assert [level for _, _, level in state.levels] == ["Premium", "Ultra", "Premium", "Standard"]


def _start_holder(platform_name: str, run: str, prefect_server: dict, laneflow_home: Path, output: Path):
    env = {**os.environ, **prefect_server, "LANEFLOW_HOME": str(laneflow_home)}
    return running([sys.executable, "-c", HOLDER, platform_name, run], env=env, cwd=PROJECT_ROOT,
                   stdout=output.open("wb"), stderr=subprocess.STDOUT)


def _wait_holding(process: subprocess.Popen, output: Path) -> None:
    deadline = time.monotonic() + 180
    while "holding" not in output.read_text():
        assert process.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(0.2)


def _flow_run_state(run_id: str) -> str:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state.type.value


def test_a_holder_whose_run_crashed_is_dropped_at_once(prefect_server: dict, laneflow_home: Path, arm: tuple,
                                                       tmp_path: Path) -> None:
    """SIGTERM: Prefect ends the holder's flow run Crashed (its process had no hook to leave). The next run to
    settle the volume sees the run is over and takes the volume home — long before the hold's ten minutes."""
    emulator, state = arm
    output = tmp_path / "holder.log"
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator)).save("emu-hold-crash", overwrite=True)
        with _start_holder("emu-hold-crash", "train-crashed", prefect_server, laneflow_home, output) as holder:
            _wait_holding(holder, output)
            (holder_id,) = level_record(k8s).holds
            assert state.pool_of("tusimple") == "pool-premium"
            holder.send_signal(signal.SIGTERM)
            holder.wait(120)
        assert _flow_run_state(holder_id) == "CRASHED"
        assert level_record(k8s).holds[holder_id].run == "train-crashed"  # it left nothing behind but its hold
        assert settle_with_promotion_off("emu-hold-crash") == {"home": "Standard", "training": "Standard",
                                                                "held": False}
        assert level_record(k8s) is None
    assert state.pool_of("tusimple") == "pool-standard"


def test_a_killed_holder_is_dropped_once_its_hold_runs_out(prefect_server: dict, laneflow_home: Path, arm: tuple,
                                                           tmp_path: Path) -> None:
    """SIGKILL: nothing tells Prefect, so the flow run stays Running for good; only its missing renewals say it
    is gone. Until its hold runs out it keeps the volume promoted; after, the next settle takes it home."""
    emulator, state = arm
    output = tmp_path / "holder.log"
    ttl_s = 6.0
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        platform = cluster_platform(k8s, anf=anf_volume(emulator, hold_ttl_s=ttl_s))
        platform.save("emu-hold-kill", overwrite=True)
        with _start_holder("emu-hold-kill", "train-killed", prefect_server, laneflow_home, output) as holder:
            _wait_holding(holder, output)
            (joined_at,) = (hold.renewed for hold in level_record(k8s).holds.values())
            deadline = time.monotonic() + 60
            while next(iter(level_record(k8s).holds.values())).renewed == joined_at:  # alive, and says so
                assert time.monotonic() < deadline, output.read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(30)
        (holder_id,) = level_record(k8s).holds
        assert _flow_run_state(holder_id) == "RUNNING"
        last_renewal = level_record(k8s).holds[holder_id].renewed
        while time.time() <= last_renewal + ttl_s:  # the hold runs out (a wait for a state, not a timing check)
            time.sleep(0.5)
        assert settle_with_promotion_off("emu-hold-kill")["training"] == "Standard"
        assert level_record(k8s) is None
    assert state.pool_of("tusimple") == "pool-standard"
    assert [level for _, _, level in state.levels] == ["Premium", "Standard"]


class ApiPath:
    """One holder's own way to the API server (its node's network, a proxy in between), which the test cuts and
    restores: while cut, every connection through it is dropped, a new one at once — the holder cannot reach the
    API, everyone else still does."""

    def __init__(self, target_url: str) -> None:
        target = urllib.parse.urlsplit(target_url)
        self._target = (target.hostname, target.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)  # so the accepting thread sees the path close
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._cut = False
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._pumps: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True, name="api-path")

    def __enter__(self) -> ApiPath:
        self._accepting.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._accepting.join(30)
        self.cut()
        for pump in self._pumps:
            pump.join(30)
        for sock in [*self._sockets, self._listener]:
            sock.close()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            for sock in self._sockets:
                _shut(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            try:
                server = socket.create_connection(self._target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
                if self._cut:
                    _shut(client)
                    _shut(server)
                    continue
                pumps = [threading.Thread(target=self._pump, args=pair, daemon=True, name="api-path-pump")
                         for pair in ((client, server), (server, client))]
                self._pumps += pumps
            for pump in pumps:
                pump.start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _shut(source)
            _shut(sink)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected any more
        sock.shutdown(socket.SHUT_RDWR)


def _credentials_through(k8s: KubernetesEmulator, url: str) -> KubernetesCredentials:
    """The emulator's kubeconfig, its server reached at ``url``."""
    config = k8s.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = url
    return KubernetesCredentials(cluster_config=KubernetesClusterConfig(config=config, context_name="emulator"))


def test_a_hold_dropped_in_an_outage_is_taken_again_once_the_api_answers(
        prefect_server: dict, laneflow_home: Path, arm: tuple, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 49. A holder's way to the API server is cut for longer than its hold's lifetime: its renewals fail,
    and another run's settle takes it for dead, drops its hold and takes the volume home. The holder still
    trains: once a renewal gets through again it holds the level again — Premium, its own need — says so, and
    leaves as usual when it has trained."""
    emulator, state = arm
    ttl_s = 6.0
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s, ApiPath(k8s.url) as path, caplog.at_level(logging.INFO, logger="laneflow.service_level"):
        anf = anf_volume(emulator, hold_ttl_s=ttl_s)
        cluster_platform(k8s, anf=anf, credentials=_credentials_through(k8s, path.url), api_attempts=2
                         ).save("emu-hold-outage", overwrite=True)
        cluster_platform(k8s, anf=anf).save("emu-hold-outage-others", overwrite=True)
        handles, results = _run_in_threads("emu-hold-outage", {"train-outage": "tusimple"})
        (joined_event, leave), thread = handles["events"]["train-outage"], handles["threads"]["train-outage"]
        thread.start()
        try:
            assert joined_event.wait(120)
            (holder_id,) = level_record(k8s).holds
            assert state.pool_of("tusimple") == "pool-premium"
            path.cut()
            wait_until("a renewal failing", lambda: any(
                r.getMessage().startswith("could not renew the hold on tusimple") for r in caplog.records),
                timeout_s=60, every_s=0.2)
            wait_until("the hold running out", lambda: (
                time.time() > level_record(k8s).holds[holder_id].renewed + ttl_s), timeout_s=60, every_s=0.2)
            assert settle_with_promotion_off("emu-hold-outage-others") == {"home": "Standard", "training": "Standard",
                                                                            "held": False}
            assert level_record(k8s) is None and state.pool_of("tusimple") == "pool-standard"
            path.restore()
            wait_until("the hold taken again and the volume back on Premium", lambda: (
                (record := level_record(k8s)) is not None and holder_id in record.holds
                and state.pool_of("tusimple") == "pool-premium"), timeout_s=60, every_s=0.2)
            record = level_record(k8s)
            assert record.home == "Standard" and [hold.run for hold in record.holds.values()] == ["train-outage"]
            assert record.holds[holder_id].level == "Premium"
            (said,) = [r for r in caplog.records if "was dropped by another run" in r.getMessage()]
            assert said.levelno == logging.WARNING
            assert said.getMessage().startswith(
                "service level of tusimple: the hold of train-outage (125.0 MiB/s, Premium) was dropped by another "
                "run (its renewals could not get through for ")
            assert "past the hold's 6 s lifetime: an API outage, taken for a death); the run still trains, so it " \
                   "holds the volume's level again" in said.getMessage()
        finally:
            leave.set()
            thread.join(120)
        assert results["train-outage"] == {"training": "Premium", "home": "Standard", "after": "Standard"}
        assert level_record(k8s) is None
    assert [level for _, _, level in state.levels] == ["Premium", "Standard", "Premium", "Standard"]


def test_a_platform_without_service_levels_keeps_no_record(tmp_path: Path) -> None:
    from tasks.platforms import LocalPlatform

    local = LocalPlatform(home=str(tmp_path / "home"))
    volume = local.ensure_volume("tusimple")
    assert local.current_service_level(volume) is None
    with pytest.raises(TypeError, match="LocalPlatform has no service levels"):
        local.level_record(volume)


def _run_in_threads(platform_name: str, holders: dict[str, str]) -> tuple[dict, dict]:
    """Each holder (run -> claim) in a thread of its own, joining at once and leaving when told."""
    events = {run: (threading.Event(), threading.Event()) for run in holders}
    results: dict[str, dict] = {}

    def hold(run: str) -> None:
        results[run] = hold_then_leave(platform_name, run, *events[run], claim=holders[run])

    # Each thread in a copy of this one's context: Prefect's settings (the test server) live in it.
    threads = {run: threading.Thread(target=contextvars.copy_context().run, args=(hold, run)) for run in holders}
    return {"events": events, "threads": threads}, results


def test_each_claim_moves_its_own_anf_volume(prefect_server: dict, laneflow_home: Path, arm: tuple,
                                            tmp_path: Path) -> None:
    """Two claims, two ANF volumes (Trident makes one per claim): tusimple, an existing volume imported into
    Trident, and nightly, a new 2 TiB volume Trident names after its PV. A run on each promotes its own volume
    only — neither needs Ultra, as they do not share one — and each goes home when its run leaves."""
    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")
    on_anf(k8s, state)
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator), volume_size="2Ti").save("emu-hold-claims", overwrite=True)
        handles, results = _run_in_threads("emu-hold-claims", {"train-tusimple": "tusimple",
                                                               "train-nightly": "nightly"})
        events, threads = handles["events"], handles["threads"]
        threads["train-tusimple"].start()
        assert events["train-tusimple"][0].wait(120)
        threads["train-nightly"].start()
        assert events["train-nightly"][0].wait(120)
        nightly = k8s.cluster.objects["persistentvolumeclaims"][("lanes", "nightly")]["spec"]["volumeName"]
        assert nightly.startswith("pvc-") and state.volumes[nightly]["quota"] == 2 * 1024 ** 4
        assert state.pool_of("tusimple") == "pool-premium" and state.pool_of(nightly) == "pool-premium"
        assert [h.run for h in level_record(k8s).holds.values()] == ["train-tusimple"]
        assert [h.run for h in level_record(k8s, claim="nightly").holds.values()] == ["train-nightly"]
        events["train-tusimple"][1].set()
        threads["train-tusimple"].join(120)
        assert state.pool_of("tusimple") == "pool-standard" and state.pool_of(nightly) == "pool-premium"
        events["train-nightly"][1].set()
        threads["train-nightly"].join(120)
    assert results["train-tusimple"]["training"] == results["train-nightly"]["training"] == "Premium"
    assert state.pool_of(nightly) == "pool-standard"
    assert [(volume, level) for _, volume, level in state.levels] == [
        ("tusimple", "Premium"), (nightly, "Premium"), ("tusimple", "Standard"), (nightly, "Standard")]


def test_a_claim_that_is_not_on_anf_is_refused_for_promotion_and_anf_snapshots(
        prefect_server: dict, laneflow_home: Path, arm: tuple, tmp_path: Path) -> None:
    """No ANF backend behind the claim (Trident's PV names no Azure volume), or one of another NetApp account:
    a run that asks for promotion fails saying so; one that does not is told it does not apply; ANF snapshots
    of it are refused the same way — and no volume of the block's account is touched."""
    from tasks.platforms.cluster.volumes import NotOnAnf

    emulator, state = arm
    k8s = KubernetesEmulator(tmp_path / "k8s")  # no ANF backend: Trident's PV carries no internalID
    with k8s:
        cluster_platform(k8s, anf=anf_volume(emulator), snapshotter="anf").save("emu-not-anf", overwrite=True)
        assert settle_with_promotion_off("emu-not-anf", claim="elsewhere") is None
        refused = settle_with_promotion_off("emu-not-anf", claim="elsewhere", wanted=True, return_state=True)
        assert refused.is_failed()
        assert "PVC lanes/elsewhere (PV pvc-" in str(refused.message)
        assert "is not an Azure NetApp Files volume provisioned by Trident" in str(refused.message)
        platform = load_platform("emu-not-anf")
        volume = platform.ensure_volume("elsewhere")
        with pytest.raises(NotOnAnf, match="cannot change its service level or take ANF snapshots"):
            platform.create_snapshot(volume, "elsewhere-train-0123456789ab", "datasets/x", "runs/x", {})
        # A volume of another NetApp account behind the claim: refused, naming both accounts.
        other = POOLS.replace(f"netAppAccounts/{ACCOUNT}", "netAppAccounts/anf-other")
        k8s.cluster.anf_backend = lambda namespace, claim, pv, size: f"{other}/pool-premium/volumes/{pv}"
        foreign = settle_with_promotion_off("emu-not-anf", claim="foreign", wanted=True, return_state=True)
        assert foreign.is_failed() and "of NetApp account 'anf-other'" in str(foreign.message)
        assert "the platform's ANF block is for account 'anf-lanes'" in str(foreign.message)
    assert pool_changes(state) == 0 and state.pool_of("tusimple") == "pool-standard"
