"""Warm spares for elastic runs: a worker that joins a run starts in milliseconds, not seconds.

When an elastic run takes a worker back, Horovod starts that worker's process only once every surviving rank
has re-entered the rendezvous (horovod 0.28.1 ``runner/elastic/driver.py``: ``resume`` ->
``_activate_workers`` -> ``_start_worker_processes``), and the survivors wait there while it starts: the
interpreter, torch (and ``torch._dynamo``, which torch.optim imports for an optimizer's first parameter group,
``torch/_compile.py``), Horovod, OpenCV — seconds of every survivor's time, each time a worker joins. A spare is
that process started ahead: warm and idle until a worker is needed.

- ``launch -- horovodrun ...``: the run's launcher. It forks the *keeper* and then becomes horovodrun (the same
  process: the run's process group leader, as before). ``LAUNCHER_POOL_ENV`` names the keeper to the workers.
- the keeper keeps a warm spare for every worker slot not in use and writes the hosts file the run's discovery
  script prints: the hosts in use, and one free host for each spare ready to become its worker. So horovodrun
  takes a host (back) only when a spare is ready for it (and its cooldown is over). When spares cannot be had
  (they fail to start), every host is listed and workers start cold.
- ``run -- -m training.train ...``: the command horovodrun runs for a worker. It hands its arguments,
  environment, working directory and standard streams to a ready spare, which from then on *is* that worker;
  it passes on the signals it gets and exits with the worker's exit code. Killed, it takes the worker with it.
  With no spare ready (or none kept: no keeper), it becomes the trainer itself, a cold start as without spares.

Only the local platform keeps spares; on a cluster each worker pod starts its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.ranks import STARTED_WARM_ENV

#: Set by ``launch`` for horovodrun and the workers it starts: the keeper's name.
LAUNCHER_POOL_ENV = "LANEFLOW_WARM_POOL"
_CONTROL_FD_ENV = "LANEFLOW_WARM_CONTROL_FD"
#: Spares that die before they are ready, in a row, after which the keeper stops making them.
MAX_FAILED_STARTS = 3
#: How long a worker waits for the keeper's answer before it starts cold.
HANDSHAKE_TIMEOUT_S = 10.0
_TRAINER = ["-m", "training.train"]
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
_KILLED = 128 + signal.SIGKILL  # what a worker that ended without a word is reported as


def keeper_address(pool: str) -> str:
    """The keeper's socket: an abstract Unix socket (no file to leave behind, gone with the keeper)."""
    return f"\0laneflow-warm-{pool}"


# --- the pure part ------------------------------------------------------------------------------------
def listed_hosts(hosts: Sequence[str], in_use: set[str], ready: int, every_host: bool) -> list[str]:
    """The hosts the discovery file lists, in ``hosts``' order: those with a worker, and as many free ones as
    there are spares ready (or being handed over); every host when spares cannot be had (``every_host``)."""
    if every_host:
        return list(hosts)
    free = [host for host in hosts if host not in in_use]
    chosen = set(in_use) | set(free[:ready])
    return [host for host in hosts if host in chosen]


def hosts_text(hosts: Sequence[str], slots: int) -> str:
    """The discovery file's text: ``<host>:<slots>`` a line (horovod ``runner/elastic/discovery.py``)."""
    return "".join(f"{host}:{slots}\n" for host in hosts)


# --- messages: a 4-byte length, then JSON; file descriptors ride on a one-byte message of their own ----------
def _send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the other end closed the connection")
        data += chunk
    return data


def _receive(sock: socket.socket) -> dict:
    (size,) = struct.unpack("!I", _receive_exactly(sock, 4))
    return json.loads(_receive_exactly(sock, size))


def _send_fds(sock: socket.socket, fds: Sequence[int]) -> None:
    socket.send_fds(sock, [b"F"], list(fds))


def _receive_fds(sock: socket.socket, count: int) -> list[int]:
    data, fds, _, _ = socket.recv_fds(sock, 1, count)
    if not data:
        raise EOFError("the other end closed the connection")
    return list(fds)


# --- the worker command ---------------------------------------------------------------------------------
class _HandOverFailed(Exception):
    """The spare died while it was being handed the worker."""


def run_worker(trainer_argv: list[str]) -> int:
    """Be the worker horovodrun started: through a warm spare when the keeper has one ready, else cold."""
    pool, host = os.environ.get(LAUNCHER_POOL_ENV, ""), os.environ.get("HOROVOD_HOSTNAME", "")
    for _ in range(2):  # a spare that dies while it is handed the worker: ask again
        claimed = _claim(pool, host)
        if claimed is None:
            break
        connection, spare_pid = claimed
        if spare_pid is None:
            # Cold, with the keeper told: the connection stays open in the trainer, and its end tells the keeper
            # that this host's worker is gone.
            os.set_inheritable(connection.fileno(), True)
            break
        try:
            return _be_handed(connection, spare_pid, trainer_argv)
        except _HandOverFailed:
            connection.close()
    os.execvp(sys.executable, [sys.executable, *trainer_argv])  # a cold start, exactly as without spares
    return 1  # not reached


def _be_handed(connection: socket.socket, spare_pid: int, trainer_argv: list[str]) -> int:
    """Hand the worker (argv, environment, cwd, standard streams) to the spare, pass signals on, and return its
    exit code."""
    try:
        spare = os.pidfd_open(spare_pid)  # signals go to that process, never to one that reuses its pid
    except OSError:
        raise _HandOverFailed() from None

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(spare, signum)

    for signum in _FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    try:
        _send_fds(connection, [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)])
        _send(connection, {"argv": trainer_argv, "env": dict(os.environ), "cwd": os.getcwd()})
    except OSError:
        for signum in _FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        raise _HandOverFailed() from None
    try:
        return int(_receive(connection)["exit"])
    except (EOFError, OSError, ValueError, KeyError):
        return _KILLED  # the worker ended without saying how (killed)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _claim(pool: str, host: str) -> tuple[socket.socket, int | None] | None:
    """Tell the keeper this worker's host: a connection and the pid of the spare it was handed to, or of none
    (start cold, the keeper told); None: no keeper answered (start cold)."""
    if not pool:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(HANDSHAKE_TIMEOUT_S)
        connection.connect(keeper_address(pool))
        _send(connection, {"host": host})
        answer = _receive(connection)
        connection.settimeout(None)
    except (OSError, EOFError, ValueError):
        connection.close()
        return None
    return connection, (int(answer["spare"]) if "spare" in answer else None)


# --- the spare -----------------------------------------------------------------------------------------
def warm_up() -> None:
    """Import what a worker imports, and what its first optimizer does: the seconds a worker takes to start."""
    import horovod.torch  # noqa: F401
    import torch

    import training.elastic
    import training.train  # noqa: F401  (torch, OpenCV, the model, the data pipeline)

    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # imports torch._dynamo (about a second)


def serve_as_spare(control: socket.socket) -> int:
    """Warm up, say so, wait to be handed a worker, and be it: its exit code."""
    warm_up()
    _send(control, {"ready": os.getpid()})
    try:
        (handed,) = _receive_fds(control, 1)
    except (EOFError, OSError, ValueError):
        return 0  # the keeper is gone: the run is over
    connection = socket.socket(fileno=handed)
    connection.setblocking(True)
    try:
        _send(connection, {"spare": os.getpid()})
        stdio = _receive_fds(connection, 3)
        request = _receive(connection)
    except (EOFError, OSError, ValueError):
        return 0  # the worker command is gone before it said what to run
    # A session of its own, as horovodrun gives a worker started cold (safe_shell_exec's middleman calls
    # setsid): a stop signal to the launcher's process group is not one to this worker's data-loader processes,
    # which torch's loader takes for a crash when it comes from anyone but the worker. The worker is stopped
    # through its worker command, as a cold one is.
    os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((0, 1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[STARTED_WARM_ENV] = "1"
    os.chdir(request["cwd"])
    with contextlib.suppress(OSError):  # a keeper that is gone changes nothing for the worker
        _send(control, {"running": True})  # the keeper pinned the host when it handed the worker over
    # The worker command killed (SIGKILL cannot be passed on) kills its worker: the connection ends.
    done = threading.Event()
    threading.Thread(target=_die_with, args=(connection, done), daemon=True, name="laneflow-warm-watch").start()
    code = _run_trainer(request["argv"])
    sys.stdout.flush()
    sys.stderr.flush()
    done.set()
    with contextlib.suppress(OSError):
        _send(control, {"exit": code})
    with contextlib.suppress(OSError):
        _send(connection, {"exit": code})
    return code


def _die_with(connection: socket.socket, done: threading.Event) -> None:
    with contextlib.suppress(OSError):
        connection.recv(1)  # the worker command never sends anything after its request: this returns at its end
    if not done.is_set():
        os.kill(os.getpid(), signal.SIGKILL)


def _run_trainer(argv: list[str]) -> int:
    if argv[:2] != _TRAINER:
        print(f"error: a warm spare runs only {' '.join(_TRAINER)}, not {' '.join(argv[:2])}", file=sys.stderr)
        return 2
    from training.train import main

    sys.argv = ["training.train", *argv[2:]]
    try:
        return int(main(argv[2:]) or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


# --- the keeper ----------------------------------------------------------------------------------------
#: A spare that has not warmed up by then is taken for hung: killed, and counted as one that failed.
WARM_UP_DEADLINE_S = 300.0


@dataclass
class _Spare:
    process: subprocess.Popen
    control: socket.socket
    started: float
    state: str = "warming"  # warming -> ready -> handed (to a host's worker command) -> running (as its worker)
    host: str = ""


class Keeper:
    """Keeps a warm spare for each free slot and lists the hosts a spare is ready for (see the module's doc)."""

    def __init__(self, pool: str, hosts: list[str], slots: int, hosts_file: Path, launcher_pid: int) -> None:
        self.pool, self.hosts, self.slots, self.hosts_file = pool, hosts, slots, hosts_file
        self.launcher_pid = launcher_pid
        self.spares: dict[int, _Spare] = {}  # by the control socket's fd
        self.cold: dict[int, tuple[socket.socket, str]] = {}  # workers started cold: their connection, host
        self.failed_starts = 0
        self.every_host = False  # spares cannot be had (they keep dying, or the keeper failed): workers go cold
        self.had_workers = False
        self.finishing = False  # a worker ended 0: the run is ending, the hosts stay as they are
        self.listed_once = False
        self.selector = selectors.DefaultSelector()
        self.written: str | None = None

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to handle, not the workers' end
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(keeper_address(self.pool))
        listener.listen(64)
        self.selector.register(listener, selectors.EVENT_READ, None)
        try:
            while os.getppid() == self.launcher_pid:  # the launcher (horovodrun) is gone: so is the run
                try:
                    self._step(listener)
                except Exception as exc:  # never the end of the run's workers: they start cold from now on
                    if not self.every_host:
                        print(f"laneflow.warm: the keeper of spares failed ({exc!r}); workers start cold from now on",
                              file=sys.stderr, flush=True)
                    self.every_host = True
                    with contextlib.suppress(OSError):
                        self._write_hosts()
        finally:
            listener.close()
            for spare in self.spares.values():  # the launcher is gone: these are workers of nothing
                with contextlib.suppress(ProcessLookupError):
                    spare.process.kill()
                spare.process.wait()

    def _step(self, listener: socket.socket) -> None:
        self._top_up()
        self._write_hosts()
        for key, _ in self.selector.select(timeout=0.2):
            if key.data is None:
                self._hand_over(listener.accept()[0])
            elif isinstance(key.data, _Spare):
                self._on_control(key.data)
            else:
                self._cold_gone(key.fileobj)

    def _in_use(self) -> set[str]:
        handed = {spare.host for spare in self.spares.values() if spare.state in ("handed", "running")}
        return handed | {host for _, host in self.cold.values()}

    def _top_up(self) -> None:
        now = time.monotonic()
        for spare in self.spares.values():
            if spare.state == "warming" and now - spare.started > WARM_UP_DEADLINE_S:
                spare.process.kill()  # hung: its end comes through the control socket
        in_use = self._in_use()
        self.had_workers |= bool(in_use)
        if self.finishing or self.every_host or (self.had_workers and not in_use):
            return  # ending, cold from now on, or every worker gone (the job ends, or is being stopped)
        for _ in range(len(self.hosts) * self.slots - len(self.spares) - len(self.cold)):
            keeper_end, spare_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            process = subprocess.Popen([sys.executable, "-m", "training.warm", "spare"], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, pass_fds=[spare_end.fileno()],
                                       env={**os.environ, _CONTROL_FD_ENV: str(spare_end.fileno())})
            spare_end.close()
            spare = _Spare(process, keeper_end, now)
            self.spares[keeper_end.fileno()] = spare
            self.selector.register(keeper_end, selectors.EVENT_READ, spare)

    def _write_hosts(self) -> None:
        if self.finishing:  # the workers are ending one by one: the hosts stay as they were to the end
            return
        if not self.listed_once and not self.every_host and \
                any(spare.state == "warming" for spare in self.spares.values()):
            return  # the first spares are listed together: each one listed later would re-form the job again
        ready = sum(spare.state == "ready" for spare in self.spares.values())
        text = hosts_text(listed_hosts(self.hosts, self._in_use(), ready // self.slots, self.every_host), self.slots)
        if text != self.written:
            write_hosts_file(self.hosts_file, text)
            self.written, self.listed_once = text, True

    def _hand_over(self, connection: socket.socket) -> None:
        """A worker command asks for a spare for its host: hand it one, or tell it to start cold (and keep its
        connection: the host is in use until it ends)."""
        try:
            uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))[1]
            if uid != os.getuid():  # an abstract socket has no file permissions: only this user's processes
                connection.close()
                return
            connection.settimeout(HANDSHAKE_TIMEOUT_S)
            host = str(_receive(connection).get("host", ""))
            connection.setblocking(True)  # the flag belongs to the open file, which the spare shares once handed
            spare = next((spare for spare in self.spares.values() if spare.state == "ready"), None)
            if spare is not None:
                _send_fds(spare.control, [connection.fileno()])
                spare.state, spare.host = "handed", host
                connection.close()
                return
            _send(connection, {"cold": "no warm spare is ready"})
        except (OSError, EOFError, ValueError):
            connection.close()  # that worker command or spare is gone: the one starts cold, the other is reaped
            return
        self.cold[connection.fileno()] = (connection, host)
        self.selector.register(connection, selectors.EVENT_READ, "cold")

    def _cold_gone(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if connection.recv(1):
                return  # a cold worker never sends more: ignore it
        self.selector.unregister(connection)
        self.cold.pop(connection.fileno(), None)
        connection.close()

    def _on_control(self, spare: _Spare) -> None:
        try:
            message = _receive(spare.control)
        except (EOFError, OSError, ValueError):
            self._gone(spare)
            return
        if "ready" in message:
            spare.state = "ready"
        elif "running" in message:
            spare.state = "running"
        elif message.get("exit") == 0:
            self.finishing = True

    def _gone(self, spare: _Spare) -> None:
        self.selector.unregister(spare.control)
        del self.spares[spare.control.fileno()]
        spare.control.close()
        spare.process.wait()
        if spare.state in ("warming", "ready"):  # died before it was a worker
            self.failed_starts += 1
            if self.failed_starts >= MAX_FAILED_STARTS and not self.every_host:
                self.every_host = True
                print(f"laneflow.warm: {MAX_FAILED_STARTS} spares died before they were workers (the last: exit "
                      f"{spare.process.returncode}); workers start cold from now on", file=sys.stderr, flush=True)


def write_hosts_file(path: Path, text: str) -> None:
    """Replace the hosts file at once: the discovery script never reads half of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def keeper_lock(hosts_file: Path) -> Path:
    """The file the keeper holds a lock on while it lives: without it, the discovery script lists every host."""
    return hosts_file.with_name(f"{hosts_file.name}.lock")


def launch(hosts: list[str], slots: int, hosts_file: Path, launcher: list[str]) -> None:
    """Fork the keeper, then become ``launcher`` (horovodrun), which its workers' ``run`` reach it from."""
    pool = f"{os.getpid()}-{secrets.token_hex(4)}"
    os.environ[LAUNCHER_POOL_ENV] = pool
    write_hosts_file(hosts_file, "")  # horovodrun fails at once when its first discovery fails
    # Locked before horovodrun starts, held by the keeper alone (closed in horovodrun on exec): released when
    # the keeper ends, however it ends.
    lock = os.open(keeper_lock(hosts_file), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    launcher_pid = os.getpid()
    if os.fork() == 0:
        code = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # standard output carries the run's events: nothing of the keeper's
            Keeper(pool, hosts, slots, hosts_file, launcher_pid).run()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.execvp(launcher[0], launcher)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.warm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    launching = commands.add_parser("launch", help="fork the keeper of spares, then exec the launcher")
    launching.add_argument("--hosts", required=True, help="the run's host names, comma-separated")
    launching.add_argument("--slots", type=int, default=1, help="workers per host")
    launching.add_argument("--hosts-file", required=True, type=Path, help="the file the discovery script prints")
    launching.add_argument("launcher", nargs=argparse.REMAINDER, help="-- horovodrun ...")
    running = commands.add_parser("run", help="be a worker: through a warm spare, or cold")
    running.add_argument("trainer", nargs=argparse.REMAINDER, help="-- -m training.train ...")
    commands.add_parser("spare", help="(started by the keeper) a warm spare")
    args = parser.parse_args(argv)
    if args.command == "spare":
        return serve_as_spare(socket.socket(fileno=int(os.environ.pop(_CONTROL_FD_ENV))))
    command = args.launcher if args.command == "launch" else args.trainer
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error(f"{args.command}: nothing to run after --")
    if args.command == "run":
        return run_worker(command)
    launch([host for host in args.hosts.split(",") if host], args.slots, args.hosts_file, command)
    return 1  # not reached: launch execs


if __name__ == "__main__":
    sys.exit(main())
