"""training.reachable_hosts: the operator's host list less the hosts horovodrun cannot reach yet, with real sockets
on loopback and a real discovery script."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

from training.reachable_hosts import main, reachable_lines


def test_only_hosts_that_resolve_and_listen_are_listed_in_their_order(tmp_path: Path, capsys) -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused, as a worker whose sshd is not up yet
        port = listening.getsockname()[1]
        lines = ["127.0.0.1:2", "no-such-worker.invalid", "", "localhost"]
        assert reachable_lines(lines, port=port) == ["127.0.0.1:2", "localhost"]
        assert reachable_lines(["127.0.0.1"], port=closed.getsockname()[1]) == []


def test_the_operators_script_is_run_and_its_failure_passed_on(tmp_path: Path, capsys) -> None:
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho no-such-worker-0.job.lanes.svc\necho no-such-worker-1.job.lanes.svc\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    assert main([str(script)]) == 0 and capsys.readouterr().out == ""  # neither resolves: none listed
    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    assert main([str(failing)]) == 3 and "broken" in capsys.readouterr().err
    assert main([]) == 2  # usage
