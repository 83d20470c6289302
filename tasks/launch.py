"""Pure pieces of launching Horovod training, shared by every platform's launcher.

The command line (``horovodrun ... python -m training.train ...``), the parsing of what the job prints,
and the reading of how a job ended: resumable (preempted, a worker killed) or not (bad configuration, a
crash). Two launch paths tag output differently, and both are read the same way:

- Gloo (``horovodrun --gloo``, the local platform): ``[<rank>]<stdout>:text``; a failed rank is reported
  as ``Process name: <rank>`` / ``Exit code: <code>`` (horovod ``runner/gloo_run.py``).
- OpenMPI (``horovodrun --hostfile`` with Horovod built with MPI, the MPI operator's launcher): horovod
  ``runner/mpi_run.py`` execs ``mpirun --allow-run-as-root --tag-output``, so lines are
  ``[<jobid>,<rank>]<stdout>:text`` (OpenMPI 4.1 ``orte/mca/iof/base/iof_base_output.c``:
  ``"[%s,%s]<%s>:"`` of the local job id and the rank; the tag is repeated after every chunk a read
  returns, so a long line can carry it again in its middle). A rank that exits non-zero is reported
  by mpirun on stderr as ``Process name: [[<family>,<jobid>],<rank>]`` / ``Exit code:    <code>`` (padded;
  ``orte/tools/orterun/help-orterun.txt`` ``orterun:non-zero-exit``), one killed by a signal as
  ``mpirun noticed that process rank <r> with PID <p> on node <n> exited on signal <s> (<name>).``
  (``orterun:proc-aborted-strsignal``); mpirun then exits with the rank's code (128 + signal).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the platforms import this module
    from tasks.platforms.base import TrainingSpec
    from training.data.sources import Artifact

EXIT_CONFIG_ERROR = 2  # training.train: bad setting, missing data root, empty split, mismatched checkpoint
EXIT_PREEMPTED = 75  # training.train: stopped by a signal after a checkpoint; resumable
STOPPED_ON_REQUEST = "stopped on request"  # training.train honoured a stop request: ended early, for good
#: MPIJob ``Failed`` reasons a new attempt can fix: workers evicted (a node drained, pods preempted), or
#: the launcher pod evicted — the operator appends the last failed launcher pod's reason to
#: ``BackoffLimitExceeded`` (kubeflow/mpi-operator ``updateMPIJobFailedStatus``).
EVICTED_REASONS = ("MPIJobEvicted", "BackoffLimitExceeded/Evicted")
_PREFIX = re.compile(r"^\[(?:(?P<job>\d+),)?(?P<rank>\d+)\]<(?P<stream>stdout|stderr|stddiag)>:")
#: How horovodrun (Gloo) and mpirun (OpenMPI) name the first process that failed, and with which code.
_PROCESS_NAME = re.compile(r"^Process name:\s*(?:\[\[\d+,\d+\],(?P<mpi_rank>\d+)\]|(?P<rank>\d+))\s*$")
_RANK_EXIT = re.compile(r"^Exit code:\s+(?P<code>-?\d+)\s*$")
_RANK_SIGNAL = re.compile(r"^mpirun noticed that process rank (?P<rank>\d+) with PID \d+ on node (?P<node>\S+) "
                          r"exited on signal (?P<signal>\d+)")


def trainer_args(preset: str, settings: dict[str, str], data_root: str, run_dir: str) -> list[str]:
    """``-m training.train`` and its arguments, for any launcher (data and run paths as the workers see them)."""
    args = ["-m", "training.train", "--data-root", data_root, "--run-dir", run_dir, "--preset", preset]
    for key, value in sorted(settings.items()):
        args += ["--set", f"{key}={value}"]
    return args


def prepare_args(artifacts: list[Artifact], volume_path: str) -> list[str]:
    """``-m training.data.prepare`` and its arguments (``--archive``/``--file URL SHA256`` each), for any
    platform: the dataset is always prepared by that command in its own process."""
    sources = [arg for artifact in artifacts for arg in (f"--{artifact.kind}", artifact.url, artifact.sha256)]
    return ["-m", "training.data.prepare", *sources, "--volume", volume_path]


def horovodrun_command(horovodrun: str, python: str, spec: TrainingSpec, data_root: str, run_dir: str,
                       hosts: str | None = None) -> list[str]:
    """The launcher's argument list (never a shell string): ``horovodrun -np N -H localhost:N --gloo python ...``."""
    return [horovodrun, "-np", str(spec.workers), "-H", hosts or f"localhost:{spec.workers}", "--gloo",
            python, *trainer_args(spec.preset, spec.settings, data_root, run_dir)]


@dataclass(frozen=True)
class OutputLine:
    rank: int | None
    text: str
    event: dict[str, Any] | None


def parse_output_line(line: str) -> OutputLine:
    """One line of launcher output: which rank said it, the text, and the JSON event if it is one."""
    line = line.rstrip("\n")
    rank = None
    match = _PREFIX.match(line)
    if match:
        rank, tag = int(match["rank"]), match.group(0)
        line = line[match.end():].replace(tag, "")  # OpenMPI repeats the tag after each chunk of a long line
    event = None
    if line.startswith("{") and '"event"' in line:
        try:
            decoded = json.loads(line)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict) and isinstance(decoded.get("event"), str):
            event = decoded
    return OutputLine(rank, line, event)


LOG_TAIL = 40


@dataclass
class JobOutput:
    """A training job's output as it arrives, sorted for every launcher: rank 0's JSON events go to
    ``on_event``, every other line to ``on_log`` and a bounded tail (for error messages), and
    horovodrun's per-rank ``Exit code:`` lines are kept for ``read_exit``."""

    on_event: Callable[[dict[str, Any]], None]
    on_log: Callable[[str], None]
    events: list[dict[str, Any]] = field(default_factory=list)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL))
    exit_lines: list[str] = field(default_factory=list)

    def feed(self, raw: str, may_be_event: bool = True) -> None:
        """One raw line; ``may_be_event`` False for a stream that never carries events (stderr)."""
        parsed = parse_output_line(raw)
        if may_be_event and parsed.event is not None and parsed.rank in (None, 0):
            self.events.append(parsed.event)
            self.on_event(parsed.event)
            return
        self.tail.append(parsed.text)
        if is_exit_report(parsed.text):
            self.exit_lines.append(parsed.text)
        self.on_log(parsed.text)


def is_exit_report(text: str) -> bool:
    """A line in which horovodrun or mpirun names a failed rank or its exit code."""
    text = text.strip()
    return bool(_PROCESS_NAME.match(text) or _RANK_EXIT.match(text) or _RANK_SIGNAL.match(text))


@dataclass(frozen=True)
class RankExit:
    """The first rank that failed, as the launcher reported it (rank None when it did not say)."""

    rank: int | None
    code: int


def first_rank_exit(lines: list[str]) -> RankExit | None:
    """The first failed rank and its code from horovodrun's or mpirun's report, None when there is none."""
    rank: int | None = None
    for raw in lines:
        text = parse_output_line(raw).text.strip()
        if named := _PROCESS_NAME.match(text):
            rank = int(named["mpi_rank"] if named["mpi_rank"] is not None else named["rank"])
        elif exited := _RANK_EXIT.match(text):
            return RankExit(rank, int(exited["code"]))
        elif signalled := _RANK_SIGNAL.match(text):
            return RankExit(int(signalled["rank"]), 128 + int(signalled["signal"]))
    return None


@dataclass(frozen=True)
class ExitReading:
    """How a training job ended and whether running it again (it resumes) can help."""

    succeeded: bool
    resumable: bool
    reason: str


def read_exit(launcher_code: int, lines: list[str], events: list[dict[str, Any]]) -> ExitReading:
    """Classify a finished job from its launcher's exit code, its output and the events it sent.

    horovodrun itself exits 1 whenever a rank fails and names the first failing rank's code in its
    output (``Exit code: N``); a plain (size 1) run exits with the trainer's own code.
    """
    names = [event.get("event") for event in events]
    if launcher_code == 0 and "done" in names:
        return ExitReading(True, False, "finished")
    if launcher_code == 0 and "stopped" in names:  # asked to stop (a pruned trial): checkpointed, ended on purpose
        return ExitReading(True, False, STOPPED_ON_REQUEST)
    reported = first_rank_exit(lines)
    code = reported.code if reported else launcher_code
    who = f" on rank {reported.rank}" if reported and reported.rank is not None else ""
    if "preempted" in names or code == EXIT_PREEMPTED:
        return ExitReading(False, True, f"preempted: it checkpointed and can resume{who}")
    if code < 0 or code in (128 + 9, 128 + 15):
        signal_no = -code if code < 0 else code - 128
        return ExitReading(False, True, f"a training process was killed by signal {signal_no}{who}")
    if code == EXIT_CONFIG_ERROR:
        return ExitReading(False, False, f"training refused its configuration or data (exit code 2){who}")
    if launcher_code == 0:
        return ExitReading(False, False, "the launcher exited 0 but training never reported 'done'")
    return ExitReading(False, False, f"training failed with exit code {code}{who}")


def read_mpijob_failure(reason: str, exit_lines: list[str], events: list[dict[str, Any]]) -> ExitReading:
    """Classify a ``Failed`` MPIJob: the operator's condition reason first, then the launcher's output.

    Reasons (kubeflow/mpi-operator ``pkg/controller/mpi_job_controller.go``): ``MPIJobEvicted`` (workers
    evicted: resumable), ``DeadlineExceeded`` (``runPolicy.activeDeadlineSeconds`` passed: running it
    again takes as long), ``BackoffLimitExceeded/<launcher pod reason>`` or ``MPIJobFailed`` (horovodrun
    failed: its output and exit codes decide).
    """
    if reason.startswith(EVICTED_REASONS):
        return ExitReading(False, True, "pods were evicted (a node drained or pods preempted); it can resume")
    if reason.startswith("DeadlineExceeded"):
        return ExitReading(False, False, "it ran longer than its active deadline (runPolicy.activeDeadlineSeconds)")
    return read_exit(1, exit_lines, events)
