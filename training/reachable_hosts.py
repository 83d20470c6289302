"""An elastic MPIJob's host discovery: the MPI operator's ``discover_hosts.sh``, less the workers not reachable yet.

    python -m training.reachable_hosts /etc/mpi/discover_hosts.sh      (what horovodrun polls, every second)

The operator lists every *Running* worker (mpi-operator ``updateDiscoverHostsInConfigMap``), but the job's headless
Service publishes a worker's name only once the pod is *Ready* (no ``publishNotReadyAddresses``), and the worker's
sshd listens only once its PID 1 has made its host key. horovodrun, told of a host it cannot reach yet, fails to
start its rank there (``ssh: Could not resolve hostname``) — and the ranks already re-formed to take it in wait for
it in Gloo's rendezvous until they time out (``HOROVOD_GLOO_TIMEOUT_SECONDS``, 30 s) and exit 255, taking the whole
job with them (seen here: a worker scheduled late, when a node joined the pool, killed a run that trained well). So
a host is listed only once its name resolves and its ssh port takes a connection; a moment later, it is.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SSH_PORT = 22
#: How long one host may take to answer: the script runs every second, and a slow answer is asked again then.
CONNECT_TIMEOUT_S = 0.8


def host_of(line: str) -> str:
    """The host of a discovery line: ``<host>`` or ``<host>:<slots>``."""
    return line.rsplit(":", 1)[0] if line.count(":") == 1 else line


def reachable(line: str, port: int = SSH_PORT, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the host of a discovery line resolves and accepts a connection."""
    try:
        with socket.create_connection((host_of(line), port), timeout=timeout_s):
            return True
    except OSError:  # not in DNS yet, nothing listening yet, or gone
        return False


def reachable_lines(lines: list[str], port: int = SSH_PORT) -> list[str]:
    """The discovery lines whose hosts are reachable, in their order (every host asked at once)."""
    hosts = [line for line in lines if line.strip()]
    if not hosts:
        return []
    with ThreadPoolExecutor(len(hosts)) as pool:
        answers = list(pool.map(lambda line: reachable(line.strip(), port), hosts))
    return [line.strip() for line, ok in zip(hosts, answers, strict=True) if ok]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m training.reachable_hosts DISCOVERY_SCRIPT [ARG...]", file=sys.stderr)
        return 2
    listed = subprocess.run(args, capture_output=True, text=True)
    if listed.returncode != 0:  # horovodrun reports a failing script with its code: pass both on
        sys.stderr.write(listed.stderr)
        return listed.returncode
    for line in reachable_lines(listed.stdout.splitlines()):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
