from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# Before anything imports the task modules: retry delays of 1 s, not 10 s, keep retry tests short.
os.environ.setdefault("LANEFLOW_RETRY_DELAY_S", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The suite runs two xdist workers' processes side by side on few cores, so every torch process with more
# than one OpenMP thread is oversubscribed: libgomp's default (active) wait spins a thread that waits at a
# barrier while the thread it waits for has no core, CPU the other worker's processes need. Passive waiting
# sleeps instead: bench/gpu.py --dry-run beside two busy loops took 45 s of CPU by default, 27 s passive
# (idle, 27 s and 27 s). Every process the tests start locally inherits it (read when libgomp loads, which
# is when torch is first imported: after this).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# For the same reason one OpenMP thread where a test runs torch itself (in this process, or a trainer or bench
# it starts directly): two xdist workers already keep the cores busy. The platforms' own launches set their
# threads themselves (threads per worker, all cores for evaluation), as they do for users.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A Prefect home of this session's own (profiles, local result storage, an ephemeral server's SQLite file):
# the suite's xdist workers run side by side, and neither should read a developer's ~/.prefect.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="laneflow-test-prefect-")

import pytest

from tasks.processes import stop_process
from tests import leaks
from tests.http_server import FileServer, RunningServer
from training.data.synthetic import generate, pack_archive, pack_artifacts

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PREFECT_HOME = Path(os.environ["PREFECT_HOME"])
#: Kept after the run (screenshots); CI can collect it.
TEST_OUTPUT = Path(os.environ.get("LANEFLOW_TEST_OUTPUT", PROJECT_ROOT / "test-output"))

SMALL_SIZE = (320, 180)

#: Every process this session starts inherits it; the session-finish check finds what is still alive. Under
#: pytest-xdist each worker is a session of its own with its own marker (the controller starts only workers).
SESSION_MARKER = leaks.mark_session()
#: pid -> the test after which it was first seen alive (who started what is left).
_first_seen: dict[int, str] = {}
#: (the process, the test after which it was first seen alive): found here, or reported by an xdist worker.
_left_running: list[tuple[str, str]] = []
#: Processes get this long to be reaped after the last teardown before they count as left running.
LEAK_GRACE_S = 15.0
#: The key under which an xdist worker hands its leftovers to the controller (``config.workeroutput``).
_WORKER_LEFTOVERS = "laneflow_left_running"


#: Set at configure time: an xdist controller runs no test and starts no process but its workers.
_controller = False


def pytest_configure(config: pytest.Config) -> None:
    global _controller
    # xdist gives each worker ``workerinput``; the controller is the process that distributes (``--dist``).
    _controller = not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Refuse to run a test that ``xdist_group`` should have grouped and did not: pytest-xdist's loadgroup
    marks a grouped test by appending ``@<group>`` to its node id on each worker, and a pytest whose node ids
    ignore that (9.2: pytest-dev/pytest-xdist#1386) spreads a module's tests over both workers without a
    word — each then builds the module's expensive fixture again, and tests meant to share one server no
    longer do."""
    if item.config.getoption("loadgroup", False) and "@" not in item.nodeid.rsplit("::", 1)[-1] \
            and any(True for _ in item.iter_markers("xdist_group")):
        pytest.fail(f"--dist loadgroup did not group this test marked xdist_group: this pytest "
                    f"({pytest.__version__}) and pytest-xdist disagree on node ids (pytest-dev/pytest-xdist#1386). "
                    "Install the versions scripts/constraints.txt pins (make install), or run with -n 0.",
                    pytrace=False)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if _controller:
        return
    for process in leaks.marked_processes(SESSION_MARKER):
        _first_seen.setdefault(process.pid, nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run, loudly, if any process the suite started outlived it (then kill it)."""
    shutil.rmtree(PREFECT_HOME, ignore_errors=True)
    if _controller:
        # Its workers checked their own processes and reported them (pytest_testnodedown).
        if _left_running:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    while (survivors := leaks.outliving(leaks.marked_processes(SESSION_MARKER))) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not survivors:
        return
    _left_running.extend((str(s), _first_seen.get(s.pid, "the session's end")) for s in survivors)
    leaks.kill_all(survivors)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its terminal is not shown, the controller's is
        session.config.workeroutput[_WORKER_LEFTOVERS] = list(_left_running)


#: Workers that died before their session's end: nobody checked what they had started.
_crashed_workers: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist's hook, on the controller: a worker has finished
    if error is not None:
        _crashed_workers.append(f"{node.gateway.id} died ({error})")
    _left_running.extend(tuple(item) for item in getattr(node, "workeroutput", {}).get(_WORKER_LEFTOVERS, []))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for crashed in _crashed_workers:
        terminalreporter.write_line(f"xdist worker {crashed}: the processes it started were not checked "
                                    f"(look for {leaks.MARKER} in /proc/*/environ)", red=True, bold=True)
    if not _left_running:
        return
    terminalreporter.section("processes left running by the suite", sep="!", red=True, bold=True)
    for survivor, seen_after in _left_running:
        terminalreporter.write_line(f"{survivor}  -- first seen alive after {seen_after}", red=True)
    terminalreporter.write_line(f"{len(_left_running)} process(es) outlived the tests that started them; they "
                                "were killed now. Stop every process a test starts (tasks.processes.stop_process).",
                                red=True, bold=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("LANEFLOW_KUBECONFIG"):
        return
    skip = pytest.mark.skip(reason="needs a real cluster: set LANEFLOW_KUBECONFIG")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    """A real HTTP server on 127.0.0.1 serving ``state.files``; faults are queued per request."""
    with RunningServer() as state:
        yield state


@pytest.fixture(scope="session")
def synthetic_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic TuSimple-layout folder (read-only for tests: copy before changing it)."""
    out = tmp_path_factory.mktemp("synthetic") / "tusimple"
    generate(out, train=8, val=3, test=3, seed=7, width=SMALL_SIZE[0], height=SMALL_SIZE[1])
    return out


@pytest.fixture(scope="session")
def synthetic_archive(synthetic_source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    archive = tmp_path_factory.mktemp("archive") / "train_set.zip"
    return archive, pack_archive(synthetic_source, archive)


@pytest.fixture(scope="session")
def served_archive(synthetic_archive: tuple[Path, str]) -> Iterator[tuple[str, str]]:
    """The synthetic archive over HTTP at the pod network's node address (url, sha256): what pods of the
    emulated cluster download (a pod has its own network and a private /tmp, as a container does: neither
    127.0.0.1 nor a file:// URL of this machine's /tmp means this machine there)."""
    from tests.cluster.network import node_address
    from tests.cluster.runtime import pod_runtime_missing

    if (missing := pod_runtime_missing()) is not None:
        pytest.skip(missing)
    archive, sha256 = synthetic_archive
    with RunningServer(host=node_address()) as state:
        state.files[archive.name] = archive.read_bytes()
        yield state.url(archive.name), sha256


@pytest.fixture(scope="session")
def synthetic_artifacts(synthetic_source: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """The same dataset as TuSimple ships it: train_set.zip, test_set.zip and test_label.json (url, sha256, kind)."""
    packed = pack_artifacts(synthetic_source, tmp_path_factory.mktemp("artifacts"))
    return [{"url": Path(item["path"]).as_uri(), "sha256": item["sha256"], "kind": item["kind"]} for item in packed]


@pytest.fixture
def dataset_copy(synthetic_source: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the synthetic dataset."""
    target = tmp_path / "tusimple"
    shutil.copytree(synthetic_source, target)
    return target


@dataclass
class SessionServer:
    """The session's Prefect server process, which a test may restart (as an operator upgrading it does)."""

    home: Path
    port: int
    process: subprocess.Popen
    #: One restart at a time (the soak's disruptions may come due together): a second start on the port would find
    #: the first one's server answering and keep its own process, which exits.
    restarting: threading.Lock = field(default_factory=threading.Lock)

    def restart(self) -> None:
        """Stop the server (SIGTERM to its group, SIGKILL after 30 s) and start it again on the same port and
        database; returns once it answers."""
        from flows.local_server import start_server

        with self.restarting:
            stop_process(self.process, grace_s=30)
            self.process = start_server(self.home, self.port, host=SESSION_SERVER_HOST)


_SESSION_SERVERS: list[SessionServer] = []
#: The session server listens on loopback only, as laneflow's local server does; the emulated cluster's pods (flow
#: runs the Kubernetes worker starts) reach it at the pod network's node address through a forwarder that lives
#: as long as that worker (tests.test_cluster_worker.kubernetes_worker).
SESSION_SERVER_HOST = "127.0.0.1"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real ``prefect server start`` (SQLite, UI included) on a free loopback port, for the whole session.

    Yields the environment that points a subprocess (worker, ``prefect deploy``, ``laneflow``) at it;
    this process talks to it through Prefect's settings context.
    """
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    from flows.local_server import free_port, server_env, start_server

    home = tmp_path_factory.mktemp("prefect-server")
    for attempt in range(3):
        port = free_port()
        try:
            server = SessionServer(home, port, start_server(home, port, host=SESSION_SERVER_HOST))
            break
        except RuntimeError:  # it exited: the other xdist worker's server may have taken the port meanwhile
            if attempt == 2:
                raise
    _SESSION_SERVERS.append(server)
    env = server_env(home, port)
    try:
        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_SERVER_ANALYTICS_ENABLED: False,
                                 PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}):
            yield env
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=30)  # while the server still answers
            EventsWorker.drain_all(timeout=30)
    finally:
        stop_process(server.process, grace_s=30)


@pytest.fixture
def session_server(prefect_server: dict) -> SessionServer:
    """The running session server, to restart."""
    return _SESSION_SERVERS[-1]


@pytest.fixture
def laneflow_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the local platform keeps volumes and snapshots for this test."""
    home = tmp_path / "laneflow-home"
    monkeypatch.setenv("LANEFLOW_HOME", str(home))
    return home


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[tuple]:
    """An emulated Kubernetes cluster whose pods really run (tests/cluster), or a skip saying why not here:
    (the emulator, its Cluster state)."""
    from tests.cluster import KubernetesEmulator
    from tests.cluster.runtime import pod_runtime_missing

    if missing := pod_runtime_missing():
        pytest.skip(missing)
    emulator = KubernetesEmulator(tmp_path / "cluster")
    with emulator as cluster:
        yield emulator, cluster


@contextmanager
def arm_with_tusimple(folder: Path, host: str = "127.0.0.1") -> Iterator[tuple]:
    """The ARM emulator (listening at ``host``) with a NetApp account of three pools and a 2 TiB volume
    ``tusimple`` on Standard: (the emulator, its state)."""
    from tests.azure import ArmEmulator

    emulator = ArmEmulator(folder, host=host)
    with emulator as state:
        state.pools = {"pool-standard": "Standard", "pool-premium": "Premium", "pool-ultra": "Ultra"}
        state.volumes["tusimple"] = {"pool": "pool-standard", "level": "Standard", "quota": 2 * 1024 ** 4}
        yield emulator, state


@pytest.fixture
def arm(tmp_path: Path) -> Iterator[tuple]:
    """``arm_with_tusimple`` on 127.0.0.1, for clients of this machine."""
    with arm_with_tusimple(tmp_path / "arm") as pair:
        yield pair
