"""PID 1 of the MPI pods (training.mpi_entry), run as the kubelet runs it: first process of a PID namespace of
its own, stopped by SIGTERM to it alone. The worker's passes the stop to its ranks (not to sshd's stand-in,
not to a rank's data-loader child) and outlives them; the launcher's asks the ranks through real mpirun."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.processes import running
from tests.conftest import PROJECT_ROOT
from tests.waiting import wait_until
from training.mpi_entry import Process, mpiruns, read_processes, topmost_ranks

#: A rank: marks itself ready, forks a "data-loader worker" with its environment, and on a stop signal
#: "checkpoints" for a second (marked after), then exits 75 as the trainer does. The loader marks a SIGTERM.
RANK = r"""
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from training.ranks import launcher_rank
from training.stop_request import StopRequest
out = Path({out!r})
rank = launcher_rank(os.environ)
loader = os.fork()
if loader == 0:
    signal.signal(signal.SIGTERM, lambda *_: (out / f"loader-{{rank}}-got-sigterm").touch())
    while True:
        time.sleep(0.1)
stop = StopRequest()
(out / f"ready-{{rank}}").touch()
while not stop.requested:
    time.sleep(0.05)
(out / f"stop-{{rank}}").touch()
time.sleep(1.0)
(out / f"checkpointed-{{rank}}").touch()
os.kill(loader, signal.SIGKILL)
os.waitpid(loader, 0)
sys.exit(75)
"""


def namespace_missing() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and util-linux's unshare (a PID namespace, as a container has)"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return None if done.returncode == 0 else f"PID namespaces refused: {done.stderr.decode().strip()}"


needs_namespace = pytest.mark.skipif(namespace_missing() is not None, reason=str(namespace_missing()))


def as_pid_one(role: str, command: list[str]) -> list[str]:
    """``training.mpi_entry`` as PID 1 of a new PID namespace with its own /proc, as a container's command."""
    return ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
            sys.executable, "-m", "training.mpi_entry", role, "--", *command]


def pid_one(unshare: subprocess.Popen) -> int:
    """The namespace's PID 1, as this machine numbers it (what the kubelet's runtime signals)."""
    def child() -> int | None:
        found = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()
        return int(found[0]) if found else None
    return wait_until("PID 1 of the namespace", child, timeout_s=30, every_s=0.05)


def write_rank(tmp_path: Path) -> Path:
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(root=str(PROJECT_ROOT), out=str(tmp_path)))
    return script


def test_topmost_ranks_are_the_processes_a_launcher_started_not_their_children_nor_orted() -> None:
    processes = {1: Process(1, 0, "python", False), 7: Process(7, 1, "sshd", False),
                 9: Process(9, 7, "orted", False), 11: Process(11, 9, "python", True),
                 12: Process(12, 11, "pt_data_worker", True), 13: Process(13, 9, "python", True),
                 20: Process(20, 1, "mpirun", False), 30: Process(30, 1, "python", True)}
    assert topmost_ranks(processes) == [11, 13]  # 30: a rank's child the kernel handed to PID 1, no rank
    assert mpiruns(processes) == [20]
    mine = read_processes()[os.getpid()]  # this machine's /proc: ppid and name read as ps reads them
    assert mine.parent == os.getppid() and mine.name == Path(f"/proc/{os.getpid()}/comm").read_text().strip()


@needs_namespace
def test_the_worker_entry_passes_sigterm_to_its_ranks_and_outlives_their_checkpoint(tmp_path: Path) -> None:
    rank = write_rank(tmp_path)
    # The stand-in for sshd starts the ranks, as sshd's sessions start orted and orted the ranks.
    sshd = ["sh", "-c", f"OMPI_COMM_WORLD_RANK=0 {sys.executable} {rank} & "
                        f"OMPI_COMM_WORLD_RANK=1 {sys.executable} {rank} & exec sleep 600"]
    with running(as_pid_one("worker", sshd), stderr=subprocess.PIPE, text=True, cwd=PROJECT_ROOT) as pod:
        init = pid_one(pod)
        wait_until("both ranks ready", lambda: all((tmp_path / f"ready-{r}").exists() for r in "01") or None,
                   timeout_s=60, every_s=0.1)
        os.kill(init, signal.SIGTERM)  # the kubelet: SIGTERM to the container's PID 1, nothing else
        code = pod.wait(timeout=60)
        said = pod.stderr.read()
    assert code == 128 + signal.SIGTERM, said
    for r in "01":
        assert (tmp_path / f"checkpointed-{r}").exists(), f"rank {r} was killed before its checkpoint: {said}"
        assert not (tmp_path / f"loader-{r}-got-sigterm").exists(), "a rank's data-loader child was signalled"
    assert "asked 2 training process(es)" in said and "sshd stays up until they have" in said, said


@needs_namespace
def test_the_worker_entry_with_no_rank_running_stops_sshd_at_once(tmp_path: Path) -> None:
    with running(as_pid_one("worker", ["sleep", "600"]), stderr=subprocess.PIPE, text=True,
                 cwd=PROJECT_ROOT) as pod:
        init = pid_one(pod)
        wait_until("the child started", lambda: Path(f"/proc/{init}/task/{init}/children").read_text() or None,
                   timeout_s=30, every_s=0.05)
        os.kill(init, signal.SIGTERM)
        code = pod.wait(timeout=30)
        said = pod.stderr.read()
    assert code == 128 + signal.SIGTERM and "no training process runs here; stopping sshd" in said, said


@needs_namespace
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI's mpirun")
def test_the_launcher_entry_asks_every_rank_through_mpirun_and_returns_mpiruns_code(tmp_path: Path) -> None:
    """SIGTERM to the launcher's PID 1 becomes SIGUSR1 to mpirun, which forwards it to each rank: both ranks
    checkpoint (the trainer's own StopRequest heard it), and the pod ends with mpirun's code."""
    rank = write_rank(tmp_path)
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np", "2", sys.executable,
              str(rank)]
    with running(as_pid_one("launcher", mpirun), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 cwd=PROJECT_ROOT) as pod:
        init = pid_one(pod)
        wait_until("both ranks ready", lambda: all((tmp_path / f"ready-{r}").exists() for r in "01") or None,
                   timeout_s=60, every_s=0.1)
        os.kill(init, signal.SIGTERM)
        code = pod.wait(timeout=60)
        said = pod.stdout.read()
    for r in "01":
        assert (tmp_path / f"checkpointed-{r}").exists(), said
    assert code == 75, said
    assert "asked every rank, through mpirun" in said and "Exit code:    75" in said, said


def test_a_stop_heard_before_the_command_started_means_it_never_starts(tmp_path: Path) -> None:
    """The kernel drops a signal PID 1 has no handler for, so the entry points listen first; a stop that came
    while the worker was still making its host key ends the pod without starting sshd."""
    marker = tmp_path / "started"
    code = ("import sys\nfrom training.mpi_entry import Init\n"
            f"sys.exit(Init('worker', ['touch', {str(marker)!r}], early=[15]).run())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and not marker.exists(), done.stderr
    assert "signal 15 before touch started: not starting it" in done.stderr


def test_a_rank_is_told_by_its_command_line_where_its_environment_cannot_be_read() -> None:
    """laneflow-sshd (root, without CAP_SYS_PTRACE) cannot read the environment of ranks running as laneflow's
    user: their command line says it — the trainer itself, never a shell whose -c string names it."""
    from training.ranks import is_trainer_command

    assert is_trainer_command(["/opt/venv/bin/python", "-m", "training.train", "--data-root", "/data/d"])
    assert not is_trainer_command(["bash", "-c", "cd /opt && python -m training.train --run-dir r"])
    assert not is_trainer_command(["python", "-m", "training.evaluate"]) and not is_trainer_command([])
