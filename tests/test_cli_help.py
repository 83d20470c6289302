"""``laneflow --help`` and every command's ``--help`` as a user reads them: every command and option says what it
is for, in plain text (no reStructuredText markup leaking from docstrings), and no sentence stops midway."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from flows.cli import build_parser

LANEFLOW = Path(sys.executable).parent / "laneflow"
MARKUP = re.compile(r"``|:(func|class|mod|meth):`|\.\. ")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def test_every_command_and_option_has_its_help_in_plain_text() -> None:
    parser = build_parser()
    commands = _commands(parser)
    assert {"predict", "champion", "lineage", "compare", "snapshots", "serve", "deploy", "stop-server"} <= set(commands)
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in commands.items() for action in sub._actions
               if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert not missing, f"options without help: {missing}"
    for name, sub in commands.items():
        text = sub.format_help()
        assert not MARKUP.search(text), f"laneflow {name} --help shows markup:\n{text}"
        assert sub.description and sub.description.rstrip().endswith("."), (name, sub.description)


def test_the_installed_command_prints_a_whole_plain_description() -> None:
    done = subprocess.run([str(LANEFLOW), "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert not MARKUP.search(done.stdout), done.stdout
    description = " ".join(done.stdout.split("\n\n")[1].split())
    assert description.startswith("laneflow: lane-detection training as Prefect flows.") and \
        description.endswith("."), description
    for name in _commands(build_parser()):
        assert re.search(rf"^\s+{re.escape(name)}\b", done.stdout, re.MULTILINE), (name, done.stdout)
