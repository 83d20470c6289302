"""PID 1 of laneflow's MPI pods: the kubelet's stop signal turned into a checkpoint.

However a pod is told to stop — a drain or any other use of the eviction API, scheduler preemption, the
cluster autoscaler removing a node, graceful node shutdown, a spot node being reclaimed — the kubelet sends
SIGTERM to each container's PID 1 only, then SIGKILL after the pod's ``terminationGracePeriodSeconds``
(kubelet ``pkg/kubelet/kuberuntime/kuberuntime_container.go`` ``killContainer``; the runtime signals the
container's init process). When PID 1 exits, the kernel kills the rest of its PID namespace. With the MPI
operator's worker command, ``/usr/sbin/sshd -De``, PID 1 is sshd: it exits at once and takes the ranks with
it, nothing is saved, and mpirun reports a lost daemon.

So each pod runs this as PID 1, with its real command as its one child:

- ``worker`` (``laneflow-sshd``, the MPI workers' command): the child is sshd, which the launcher's mpirun
  reaches, with a host key of the worker's own made first (``worker_main``). SIGTERM goes on to the training
  processes of this pod — the topmost processes a launcher marked as ranks (``training.ranks``): not orted,
  not sshd, not a rank's data-loader workers. Every rank then stops at the next agreed check, rank 0
  checkpoints, they exit 75 (``training.train``). sshd stays up while they do, so orted can report their
  exits to mpirun; then sshd is stopped and this exits.
- ``launcher`` (``laneflow-launcher HOROVODRUN...``, the launcher's command): SIGTERM is not passed on:
  horovodrun has exec'd mpirun (through ``/bin/sh -c``: horovod ``runner/mpi_run.py``), and mpirun answers
  a SIGTERM by passing it to the ranks and killing them moments later (OpenMPI 4.1.4, as tried here: a rank
  that takes 3 s to save never finishes), before any checkpoint is written.
  mpirun is sent SIGUSR1 instead, which it forwards to every rank of the job
  (OpenMPI 4.1 ``mpirun(1)``, "Signal Propagation"): the ranks checkpoint and exit 75 as for SIGTERM.
  Before mpirun runs there is nothing to save: horovodrun gets the SIGTERM. An elastic horovodrun runs no
  mpirun, and stopping it ends its ssh sessions and the ranks with them: the ranks on every worker its host
  discovery script lists are asked first, over ssh (``stop-ranks``: SIGTERM to the worker's ranks, as its own
  PID 1 sends; every rank told makes a durable checkpoint and exits 75, ``training.elastic``), then horovodrun.

PID 1 also reaps the orphans the kernel hands it (ssh sessions' processes), as an init must. Its handlers are
the first thing it sets up: the kernel drops a signal sent to a PID namespace's first process while it has no
handler, and a pod deleted as it starts (the operator cleaning up a worker it just created) would otherwise
wait out its whole grace period. A stop heard before the command started means it never starts.

    laneflow-sshd                                         (console script: worker_main)
    laneflow-launcher python -m training.horovodrun -np 2 --hostfile ...     (console script: launcher_main)
    python -m training.mpi_entry worker|launcher -- COMMAND [ARG...]
    python -m training.mpi_entry stop-ranks [WAIT_S]      (run over ssh in a worker by an elastic launcher)
"""

from __future__ import annotations

# Only what PID 1 needs before its handlers are up, and cheap to import (no dataclasses, pathlib or subprocess:
# tens of milliseconds during which a SIGTERM would be dropped).
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

from training.ranks import is_rank, is_trainer_command

#: mpirun's names in OpenMPI 4 (``orterun``, linked as mpirun and mpiexec) and 5 (``prterun``).
MPIRUN_NAMES = frozenset({"mpirun", "mpiexec", "orterun", "prterun"})
#: The worker's one host key, made when it starts: the image keeps none (keys made when the image was built would
#: be one key pair shared by every worker of every job, readable by anyone who can pull the image). Ed25519 is
#: made in milliseconds (``ssh-keygen -A`` would add an RSA 3072 key: seconds on a busy node), and sshd must
#: listen at once: the launcher starts as soon as the workers run, and horovodrun tries ssh five times without a
#: pause (horovod ``runner/launch.py`` SSH_ATTEMPTS). Every OpenSSH client since 6.5 accepts Ed25519 host keys.
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"
SSHD = ["/usr/sbin/sshd", "-De", "-h", HOST_KEY]
#: After the ranks are gone, how long the worker keeps sshd up for orted and the ssh sessions to finish.
SESSIONS_LINGER_S = 10.0
POLL_S = 0.1
#: The flag that makes horovodrun elastic, and names its host discovery script.
DISCOVERY_FLAG = "--host-discovery-script"
#: How long an elastic launcher being stopped waits for the workers' ranks to checkpoint and exit: a step, the next
#: stop check and a checkpoint (the pod's grace period bounds it in any case).
RANKS_STOP_WAIT_S = 90.0
EXIT_SIGTERM = 128 + signal.SIGTERM


class Process(NamedTuple):
    """What this needs of one process of the container: its parent, its name, whether it is a rank."""

    pid: int
    parent: int
    name: str
    rank: bool


def read_processes(proc: str = "/proc") -> dict[int, Process]:
    """Every process of this PID namespace (its ``/proc``); ones that exit while being read are left out, and a
    zombie reads as no rank (its environment is gone)."""
    found = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as handle:
                stat = handle.read()
            rank = _is_rank_process(f"{proc}/{entry}")
        except OSError:
            continue
        # stat: "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ')'.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        found[int(entry)] = Process(int(entry), parent, name, rank)
    return found


def _is_rank_process(folder: str) -> bool:
    """Whether the process whose ``/proc`` folder this is is a rank: from its environment, or — the ranks run as
    laneflow's user, and this PID 1 as root has not the capability to read another user's environment
    (CAP_SYS_PTRACE: not among a container runtime's default capabilities; proc(5) /proc/pid/environ) — from its
    command line, which anyone may read."""
    try:
        with open(f"{folder}/environ", "rb") as handle:
            environ = handle.read()
    except PermissionError:
        with open(f"{folder}/cmdline", "rb") as handle:
            argv = [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
        return is_trainer_command(argv)
    env = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    return is_rank(_decoded(env))


def _decoded(env: Mapping[bytes, bytes]) -> dict[str, str]:
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in env.items()}


def topmost_ranks(processes: Mapping[int, Process], init: int = 1) -> list[int]:
    """The training processes to signal: ranks whose parent is not a rank (a rank's data-loader workers
    inherit its environment, and are the rank's to stop), nor ``init`` (PID 1 of the namespace, which the
    kernel hands the children of a rank that has ended: they are no rank, and go with the pod)."""
    return sorted(pid for pid, process in processes.items()
                  if process.rank and process.parent != init
                  and not (processes.get(process.parent) or _NOT_A_RANK).rank)


def mpiruns(processes: Mapping[int, Process]) -> list[int]:
    return sorted(pid for pid, process in processes.items() if process.name in MPIRUN_NAMES)


_NOT_A_RANK = Process(0, 0, "", False)


def _say(role: str, text: str) -> None:
    print(f"laneflow-{role}: {text}", file=sys.stderr, flush=True)


def _signal(pids: list[int], signum: int) -> list[int]:
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except ProcessLookupError:
            continue
    return sent


class Init:
    """PID 1 with one child (the pod's real command); what SIGTERM does depends on ``role``."""

    def __init__(self, role: str, argv: list[str], early: list[int] | None = None,
                 proc: str = "/proc") -> None:
        self.role, self.argv, self.proc = role, argv, proc
        self.early = early if early is not None else []
        self.child = 0
        self.child_code: int | None = None
        self.stopping_since: float | None = None
        self.stop_signal = signal.SIGTERM
        self.ranks_gone_at: float | None = None
        #: Ranks already asked to stop (a rank that appears later, orted still starting, is asked too).
        self.asked: set[int] = set()
        #: An elastic launcher told to stop: the ranks on the workers are to be asked before horovodrun stops.
        self.stop_elastic_ranks = False

    def run(self) -> int:
        stops = {signal.SIGTERM, signal.SIGINT}
        for signum in stops:
            signal.signal(signum, self._on_term)
        # No stop is handled between here and the fork: one that comes meanwhile waits, blocked, and is
        # handled once the child exists (or prevents the fork when it came before).
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        if self.early or self.stopping_since is not None:
            _say(self.role, f"signal {(self.early or [self.stop_signal])[0]} before {self.argv[0]} started: not "
                            "starting it")
            return EXIT_SIGTERM
        self.child = os.fork()
        if self.child == 0:
            self._exec_child(stops)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        while True:
            self._reap()
            if self.stop_elastic_ranks:
                self.stop_elastic_ranks = False
                stop_remote_ranks(self.argv)
                if self.child_code is None:
                    _say(self.role, "stopping horovodrun")
                    _signal([self.child], signal.SIGTERM)
            if self.stopping_since is None or self.role == "launcher":
                if self.child_code is not None:
                    return self.child_code
            elif self._worker_done():
                return EXIT_SIGTERM
            time.sleep(POLL_S)

    def _exec_child(self, stops: set[int]) -> None:
        """In the forked child: the signal dispositions a program expects (Python ignores SIGPIPE and SIGXFSZ,
        which an exec would pass on to sshd, mpirun and the ranks: subprocess restores them the same way),
        nothing blocked, then the command."""
        for signum in (*stops, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        try:
            os.execvp(self.argv[0], self.argv)
        except OSError as exc:
            _say(self.role, f"cannot run {self.argv[0]}: {exc.strerror}")
        os._exit(127)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.child:
                self.child_code = os.waitstatus_to_exitcode(status)
                if self.child_code < 0:
                    self.child_code = 128 - self.child_code

    def _on_term(self, signum: int, _frame: object) -> None:
        if self.stopping_since is not None:
            return
        self.stopping_since, self.stop_signal = time.monotonic(), signum
        if self.child == 0:  # not forked yet: run() does not start the command
            return
        processes = read_processes(self.proc)
        if self.role == "worker":
            sent = self._ask_ranks(processes)
            if sent:
                _say(self.role, f"signal {signum}: asked {len(sent)} training process(es) ({_pids(sent)}) to "
                                "checkpoint and stop; sshd stays up until they have")
            else:
                _say(self.role, f"signal {signum}: no training process runs here; stopping sshd")
            return
        sent = _signal(mpiruns(processes), signal.SIGUSR1)
        if sent:
            _say(self.role, f"signal {signum}: asked every rank, through mpirun ({_pids(sent)}), to checkpoint "
                            "and stop")
        elif self.child_code is None and DISCOVERY_FLAG in self.argv:
            # An elastic horovodrun runs no mpirun, and stopping it would end its ssh sessions and with them the
            # ranks, unsaved (the workers' pods are not told: a drain of the launcher's node leaves them be). So
            # every worker's ranks are asked first, over ssh, as their own PID 1 would ask them (every rank told: a
            # durable checkpoint, exit 75); run() does it, as a handler must not wait.
            _say(self.role, f"signal {signum}: no mpirun (an elastic horovodrun runs none): asking the ranks on "
                            "every worker, over ssh, to checkpoint and stop; then stopping horovodrun")
            self.stop_elastic_ranks = True
        elif self.child_code is None:
            command = self.argv[2] if self.argv[1:2] == ["-m"] else os.path.basename(self.argv[0])
            _say(self.role, f"signal {signum}: no mpirun (it has not started); stopping {command}")
            _signal([self.child], signal.SIGTERM)

    def _ask_ranks(self, processes: Mapping[int, Process]) -> list[int]:
        """SIGTERM to each rank not asked yet; the ones asked now."""
        sent = _signal([pid for pid in topmost_ranks(processes, os.getpid()) if pid not in self.asked],
                       signal.SIGTERM)
        self.asked.update(sent)
        return sent

    def _worker_done(self) -> bool:
        """After SIGTERM: ranks that appeared since (orted was still starting them) are asked too; once no
        rank is left and the ssh sessions ended (or lingered too long), sshd is stopped; done when it has
        exited."""
        processes = read_processes(self.proc)
        if topmost_ranks(processes, os.getpid()):
            if late := self._ask_ranks(processes):
                _say(self.role, f"asked {len(late)} more training process(es) ({_pids(late)}) to checkpoint and "
                                "stop")
            self.ranks_gone_at = None
            return False
        now = time.monotonic()
        if self.ranks_gone_at is None:
            self.ranks_gone_at = now
        others = [pid for pid in processes if pid not in (os.getpid(), self.child)]
        if self.child_code is None and (not others or now - self.ranks_gone_at > SESSIONS_LINGER_S):
            _signal([self.child], signal.SIGTERM)
            self._wait_child()
        return self.child_code is not None

    def _wait_child(self) -> None:
        deadline = time.monotonic() + 5
        while self.child_code is None and time.monotonic() < deadline:
            self._reap()
            time.sleep(POLL_S)
        if self.child_code is None:
            _signal([self.child], signal.SIGKILL)


def stop_remote_ranks(argv: list[str], wait_s: float = RANKS_STOP_WAIT_S) -> None:
    """From an elastic launcher being stopped: ``python -m training.mpi_entry stop-ranks`` on every worker its
    host discovery script lists, over the ssh horovodrun uses (the operator's key, the image's ssh settings), all
    at once; back when each has seen its ranks exit, or could not."""
    import subprocess  # here: PID 1 imports nothing it does not need before its handlers are up

    from training.reachable_hosts import host_of

    script = argv[argv.index(DISCOVERY_FLAG) + 1]  # a command line: horovodrun runs it through a shell too
    try:
        listed = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        _say("launcher", f"could not list the workers ({script}: {exc}); the ranks go unsaved")
        return
    hosts = sorted({host_of(line) for line in listed})
    stops = {host: subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, sys.executable,
                                     "-m", "training.mpi_entry", "stop-ranks", str(wait_s)])
             for host in hosts}
    for host, stop in stops.items():
        try:
            code = stop.wait(timeout=wait_s + 15)
        except subprocess.TimeoutExpired:
            stop.kill()
            code = None
        if code != 0:
            _say("launcher", f"the ranks on {host} did not report stopped (ssh exit {code})")


def stop_ranks(wait_s: float, proc: str = "/proc") -> int:
    """``python -m training.mpi_entry stop-ranks [WAIT_S]``, run over ssh in a worker by an elastic launcher that is
    being stopped: SIGTERM to this worker's topmost ranks (as its PID 1 sends on its own stop), then wait until
    none is left (each checkpointed with the others and exited) or ``wait_s`` passed. 0 when none is left."""
    asked: set[int] = set()
    deadline = time.monotonic() + wait_s
    while ranks := topmost_ranks(read_processes(proc)):
        asked.update(_signal([pid for pid in ranks if pid not in asked], signal.SIGTERM))
        if time.monotonic() > deadline:
            _say("worker", f"{len(ranks)} training process(es) still running {wait_s:.0f} s after being asked to stop")
            return 1
        time.sleep(POLL_S)
    _say("worker", f"asked {len(asked)} training process(es) to checkpoint and stop; none is left")
    return 0


def _pids(pids: list[int]) -> str:
    return "pid " + ", ".join(map(str, pids))


def hear_stops_early() -> list[int]:
    """Handlers before anything else (see the module docstring): the stop signals heard until ``Init`` runs."""
    heard: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _frame: heard.append(received))
    return heard


def worker_main(argv: list[str] | None = None) -> int:
    """``laneflow-sshd [SSHD-ARG...]``: the worker's host key, then sshd under this PID 1."""
    early = hear_stops_early()
    if not os.path.exists(HOST_KEY):
        import subprocess  # here: after the handlers

        made = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", HOST_KEY])
        if made.returncode != 0:
            _say("worker", f"ssh-keygen could not make {HOST_KEY} (exit code {made.returncode})")
            return made.returncode
    return Init("worker", [*SSHD, *(sys.argv[1:] if argv is None else argv)], early).run()


def launcher_main(argv: list[str] | None = None) -> int:
    """``laneflow-launcher COMMAND [ARG...]``: the launcher's horovodrun under this PID 1."""
    early = hear_stops_early()
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: laneflow-launcher COMMAND [ARG...]", file=sys.stderr)
        return 2
    return Init("launcher", args, early).run()


def main(argv: list[str] | None = None) -> int:
    early = hear_stops_early()
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["stop-ranks"]:
        return stop_ranks(float(args[1]) if len(args) > 1 else RANKS_STOP_WAIT_S)
    if len(args) < 3 or args[0] not in ("worker", "launcher") or args[1] != "--":
        print("usage: python -m training.mpi_entry worker|launcher -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    return Init(args[0], args[2:], early).run()


if __name__ == "__main__":
    sys.exit(main())
