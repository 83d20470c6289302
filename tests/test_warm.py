"""Warm spares of an elastic run's launcher (``training.warm``): the hosts it lists, a worker command handed to a
spare (its streams and exit code its own), and spares that cannot start (every host listed, workers cold).
Real processes: the launcher, its keeper, spares that import torch and Horovod, the worker command."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tasks.launch import describe_world_change, discovery_script
from tasks.processes import running
from tests.waiting import wait_until
from training.warm import LAUNCHER_POOL_ENV, hosts_text, listed_hosts

ROOT = Path(__file__).resolve().parents[1]


def test_hosts_in_use_are_listed_and_a_free_one_for_each_ready_spare() -> None:
    hosts = ["h0", "h1", "h2"]
    assert listed_hosts(hosts, set(), 0, every_host=False) == []
    assert listed_hosts(hosts, set(), 2, every_host=False) == ["h0", "h1"]
    # h0's worker was lost: h1 and h2 go on; h0 comes back only when a spare is ready to be its worker.
    assert listed_hosts(hosts, {"h1", "h2"}, 0, every_host=False) == ["h1", "h2"]
    assert listed_hosts(hosts, {"h1", "h2"}, 1, every_host=False) == hosts
    assert listed_hosts(hosts, {"h2"}, 5, every_host=False) == hosts
    assert listed_hosts(hosts, set(), 0, every_host=True) == hosts  # spares cannot be had: workers start cold
    assert hosts_text(["h0", "h1"], 2) == "h0:2\nh1:2\n"


def test_the_discovery_script_prints_the_hosts_file_while_the_keeper_lives_and_every_host_after(
        tmp_path: Path) -> None:
    hosts_file, script, lock = tmp_path / "it's hosts", tmp_path / "discover_hosts.sh", tmp_path / "hosts.lock"
    script.write_text(discovery_script(str(hosts_file), "a test", str(lock), "a:1\nb:1\n"))
    script.chmod(0o755)
    held = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # as the keeper holds it
    for text in ("", "a:1\n"):
        hosts_file.write_text(text)
        assert subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout == text
    os.close(held)  # the keeper is gone, however it ended: every host, the workers start cold
    assert subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout == "a:1\nb:1\n"


def test_a_joined_worker_is_said_to_come_from_a_warm_spare() -> None:
    event = {"event": "workers", "step": 40, "workers": 2, "lost": [], "joined": ["b"], "joined_warm": ["b"]}
    assert describe_world_change(event, 2) == ("b joined at step 40 (from a warm spare); training continues on 2 "
                                               "of 2 workers")


def _launch(hosts_file: Path) -> list[str]:
    """A launcher with a keeper of spares for hosts a and b; the launcher itself only waits (no horovodrun)."""
    return [sys.executable, "-m", "training.warm", "launch", "--hosts", "a,b", "--hosts-file", str(hosts_file), "--",
            sys.executable, "-c", "import time; time.sleep(600)"]


def _listed(hosts_file: Path) -> str:
    return hosts_file.read_text() if hosts_file.is_file() else ""


def _pool(launcher_pid: int) -> str:
    environ = Path(f"/proc/{launcher_pid}/environ").read_bytes().split(b"\0")
    return next(item.split(b"=", 1)[1].decode() for item in environ if item.startswith(LAUNCHER_POOL_ENV.encode()))


def _spares() -> set[int]:
    """The pids of warm spares now running (``python -m training.warm spare``)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().split(b"\0")[1:4] == [b"-m", b"training.warm", b"spare"]:
                found.add(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _of_pool(pool: str) -> set[int]:
    """Every process started for ``pool`` (the keeper, its spares): their environment names it."""
    marker = f"{LAUNCHER_POOL_ENV}={pool}".encode()
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except OSError:
            continue
    return found


def _keeper(hosts_file: Path) -> set[int]:
    """The keeper of the launcher for ``hosts_file``: the process forked from it before it became the launcher."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            parts = cmdline.read_bytes().split(b"\0")
            if parts[1:4] == [b"-m", b"training.warm", b"launch"] and str(hosts_file).encode() in parts:
                found.add(int(cmdline.parent.name))
    return found


def test_a_worker_command_is_handed_to_a_ready_spare_with_its_streams_and_exit_code(tmp_path: Path) -> None:
    hosts_file = tmp_path / "hosts"
    with running(_launch(hosts_file), cwd=ROOT) as launcher:
        wait_until("both spares ready", lambda: _listed(hosts_file) == "a:1\nb:1\n", timeout_s=300, every_s=0.2)
        pool = _pool(launcher.pid)
        spares = _spares() & _of_pool(pool)
        assert len(spares) == 2 and len(_keeper(hosts_file)) == 1
        worker = subprocess.run(
            [sys.executable, "-m", "training.warm", "run", "--", "-m", "training.train", "--data-root",
             str(tmp_path), "--run-dir", str(tmp_path / "run"), "--preset", "no-such-preset"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**_environ(), LAUNCHER_POOL_ENV: pool, "HOROVOD_HOSTNAME": "b"})
        # The trainer's own refusal, on the worker command's stderr, and its exit code (EXIT_CONFIG_ERROR).
        assert worker.returncode == 2, worker.stderr
        assert "no-such-preset" in worker.stderr
        # One of the two spares became that worker and ended with it. No worker is left (a job whose every
        # worker ended is over): no spare is warmed for it, and one host is listed for the spare that is left.
        assert len(spares - _spares()) == 1
        wait_until("one host listed", lambda: _listed(hosts_file) == "a:1\n", timeout_s=60, every_s=0.2)
        assert _spares() & _of_pool(pool) < spares
        # The launcher ends (horovodrun's end, as at the end of a run): its keeper and the spares go with it.
        os.kill(launcher.pid, signal.SIGKILL)
        wait_until("the keeper and its spares gone with the launcher",
                   lambda: not (_of_pool(pool) | _keeper(hosts_file)), timeout_s=60, every_s=0.2)


def test_spares_that_cannot_start_leave_every_host_listed_and_workers_start_cold(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    (broken / "horovod").mkdir(parents=True)
    (broken / "horovod" / "__init__.py").write_text("raise ImportError('this Horovod is broken')\n")
    hosts_file = tmp_path / "hosts"
    env = {**_environ(), "PYTHONPATH": f"{broken}:{ROOT}"}
    with running(_launch(hosts_file), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) as launcher:
        wait_until("every host listed", lambda: _listed(hosts_file) == "a:1\nb:1\n", timeout_s=300, every_s=0.2)
        pool = _pool(launcher.pid)
        wait_until("the last spare gone", lambda: not _spares() & _of_pool(pool), timeout_s=60, every_s=0.2)
        worker = subprocess.run(
            [sys.executable, "-m", "training.warm", "run", "--", "-m", "training.train", "--data-root",
             str(tmp_path), "--run-dir", str(tmp_path / "run"), "--preset", "no-such-preset"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, env={**env, LAUNCHER_POOL_ENV: pool})
        assert worker.returncode == 2 and "no-such-preset" in worker.stderr  # the trainer, started cold
    said = launcher.stderr.read()
    assert "3 spares died before they were workers" in said and "this Horovod is broken" in said
    wait_until("the keeper gone with the launcher", lambda: not _of_pool(pool), timeout_s=30, every_s=0.2)


def _environ() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != LAUNCHER_POOL_ENV}


def test_horovods_build_is_asked_once_per_installed_build(tmp_path: Path) -> None:
    from training.horovodrun import build_key, recorded_build

    record = tmp_path / "build.json"
    assert recorded_build(record) == {"gloo": True, "mpi": True}  # Horovod's own checks, of this install
    kept = json.loads(record.read_text())
    assert kept["key"] == build_key() and kept["key"]["size"] > 0
    # The kept answer is the one given while the build is the same ...
    record.write_text(json.dumps({**kept, "gloo": False}))
    assert recorded_build(record)["gloo"] is False
    # ... and asked again once it is another build (reinstalled: another size or time), or the record is damaged.
    record.write_text(json.dumps({**kept, "gloo": False, "key": {**kept["key"], "mtime_ns": 1}}))
    assert recorded_build(record)["gloo"] is True
    record.write_text("{not json")
    assert recorded_build(record)["gloo"] is True and json.loads(record.read_text())["key"] == build_key()
