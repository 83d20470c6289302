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
import shlex
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the platforms import this module
    from tasks.k8s.diagnose import PodEnd
    from tasks.platforms.base import TrainingSpec

EXIT_CONFIG_ERROR = 2  # training.train: bad setting, missing data root, empty split, mismatched checkpoint
EXIT_PREEMPTED = 75  # training.train: stopped by a signal after a checkpoint; resumable
STOPPED_ON_REQUEST = "stopped on request"  # training.train honoured a stop request: ended early, for good
#: MPIJob ``Failed`` reasons a new attempt can fix: workers evicted (a node drained, pods preempted), or
#: the launcher pod evicted — the operator appends the last failed launcher pod's reason to
#: ``BackoffLimitExceeded`` (kubeflow/mpi-operator ``updateMPIJobFailedStatus``).
EVICTED_REASONS = ("MPIJobEvicted", "BackoffLimitExceeded/Evicted")
_TAG = re.compile(r"\[(?:(?P<job>\d+),)?(?P<rank>\d+)\]<(?P<stream>stdout|stderr|stddiag)>:")
_PREFIX = re.compile("^" + _TAG.pattern)
#: How horovodrun (Gloo) and mpirun (OpenMPI) name the first process that failed, and with which code.
_PROCESS_NAME = re.compile(r"^Process name:\s*(?:\[\[\d+,\d+\],(?P<mpi_rank>\d+)\]|(?P<rank>\d+))\s*$")
_RANK_EXIT = re.compile(r"^Exit code:\s+(?P<code>-?\d+)\s*$")
_RANK_SIGNAL = re.compile(r"^mpirun noticed that process rank (?P<rank>\d+) with PID \d+ on node (?P<node>\S+) "
                          r"exited on signal (?P<signal>\d+)")
#: What a launcher prints when it could not reach a worker at start because of a race on a cluster (a worker's
#: name not in DNS yet, its sshd not listening yet, the network not yet routed): OpenSSH's client, horovodrun's
#: start timeout (horovod 0.28.1 ``runner/launch.py``: ``Timed out waiting for <activity>``), and ORTE's
#: ``[failed-daemon-launch]``/``[failed-daemon]`` (OpenMPI 4.1 ``help-errmgr-base.txt``). Running it again helps.
_START_RACE = re.compile(
    r"ssh: Could not resolve hostname|ssh: connect to host \S+ port \d+: (?:Connection refused|No route to host"
    r"|Connection timed out|Network is unreachable)|Timed out waiting for"
    r"|ORTE was unable to reliably start one or more daemons|An ORTE daemon has unexpectedly failed after launch")
#: horovodrun's ssh check failing for any reason (``ssh not successful for host <host>:`` then ssh's own words,
#: then ``could not connect to some hosts via ssh``): without a race above, a setting (host keys, the key, the
#: user) that running it again does not change.
_SSH_CHECK_FAILED = re.compile(r"ssh not successful for host|could not connect to some hosts via ssh")
#: What an elastic horovodrun says when it had fewer than ``--min-np`` workers for ``--elastic-timeout`` after the
#: run started (horovod 0.28.1 ``runner/elastic/registration.py``: ``failed to activate new hosts -> stop running``
#: around ``driver.py``'s ``Timed out waiting for minimum number of slots to become available``); it then exits
#: without a word from any rank. The durable checkpoint is still there: running it again resumes.
_ELASTIC_SHORT = re.compile(r"failed to activate new hosts|Timed out waiting for minimum number of slots")
#: What mpirun prints when a worker went away while the job ran (its node lost, its pod killed without a word
#: to the ranks): ORTE's ``[node-died]`` (``help-errmgr-base.txt``) and ssh's end of the orted session.
_LOST_WORKER = re.compile(r"ORTE has lost communication with a remote daemon"
                          r"|Connection to \S+ closed by remote host|Connection closed by \S+ port \d+")


def trainer_args(preset: str, settings: dict[str, str], data_root: str, run_dir: str) -> list[str]:
    """``-m training.train`` and its arguments, for any launcher (data and run paths as the workers see them)."""
    args = ["-m", "training.train", "--data-root", data_root, "--run-dir", run_dir, "--preset", preset]
    for key, value in sorted(settings.items()):
        args += ["--set", f"{key}={value}"]
    return args


def prepare_args(volume_path: str) -> list[str]:
    """``-m training.data.prepare`` and its arguments, for any platform: the dataset is always prepared by that
    command in its own process. The artifacts go in its environment (``training.data.sources.SOURCES_ENV``,
    ``sources_json``), never on its command line, where a credential in a URL would be public."""
    return ["-m", "training.data.prepare", "--sources-from-env", "--volume", volume_path]


def _launcher(horovodrun: str | Sequence[str]) -> list[str]:
    """horovodrun's own argument list: its path, or a command that is horovodrun (``python -m training.horovodrun``)."""
    return [horovodrun] if isinstance(horovodrun, str) else list(horovodrun)


def horovodrun_command(horovodrun: str | Sequence[str], python: str, spec: TrainingSpec, data_root: str,
                       run_dir: str, hosts: str | None = None) -> list[str]:
    """The launcher's argument list (never a shell string): ``horovodrun -np N -H localhost:N --gloo python ...``."""
    return [*_launcher(horovodrun), "-np", str(spec.workers), "-H", hosts or f"localhost:{spec.workers}", "--gloo",
            python, *trainer_args(spec.preset, spec.settings, data_root, run_dir)]


#: The script horovodrun polls (every second) for the hosts an elastic run may use: one line per host,
#: ``<host>`` or ``<host>:<slots>`` (horovod 0.28.1 ``runner/elastic/discovery.py`` ``HostDiscoveryScript``).
DISCOVERY_SCRIPT = "discover_hosts.sh"


@dataclass(frozen=True)
class ElasticLaunch:
    """How horovodrun runs an elastic job, besides the run's own bounds: where the host list comes from, the
    slots a listed host has when it does not say, how long a failed host is left out (``--blacklist-cooldown-
    range``: without it a host that failed once is never used again, and a replaced worker keeps its name —
    horovod#3319), how long to wait for enough hosts (``--elastic-timeout``), and the network interface the
    ranks talk over (given, so horovodrun needs no second host to find one at start)."""

    discovery_script: str
    slots_per_host: int
    cooldown_s: tuple[int, int]
    timeout_s: int
    network_interface: str


def elastic_horovodrun_args(workers: int, min_workers: int, max_workers: int, launch: ElasticLaunch) -> list[str]:
    """horovodrun's flags for an elastic run: ``-np N --min-np MIN --max-np MAX --host-discovery-script ...``. It
    starts once ``workers`` slots are listed and grows to ``max_workers`` as hosts appear (elastic runs use Gloo;
    horovodrun refuses elastic mode without it). ``--cache-capacity 0``: with Horovod's response cache, a world
    re-formed with a newcomer fails in Gloo (``op.preamble.length <= op.nbytes``), as seen here."""
    low, high = launch.cooldown_s
    return ["-np", str(workers), "--min-np", str(min_workers), "--max-np", str(max_workers),
            "--slots-per-host", str(launch.slots_per_host), "--host-discovery-script", launch.discovery_script,
            "--blacklist-cooldown-range", str(low), str(high), "--elastic-timeout", str(launch.timeout_s),
            "--network-interface", launch.network_interface, "--cache-capacity", "0"]


#: horovodrun, with how Horovod was built answered from a record instead of a torch import per launch
#: (``training.horovodrun``): how the local platform and the MPIJob launcher start it, after their python.
HOROVODRUN_MODULE = ["-m", "training.horovodrun"]
#: A worker started through a warm spare when one is ready (``training.warm``), else cold: the same trainer.
THROUGH_A_SPARE = ["-m", "training.warm", "run", "--"]


def elastic_horovodrun_command(horovodrun: str | Sequence[str], python: str, spec: TrainingSpec, data_root: str,
                               run_dir: str, launch: ElasticLaunch, through_spares: bool = False) -> list[str]:
    """The launcher's argument list for an elastic run of ``spec``: ``horovodrun <elastic flags> python ...``;
    with ``through_spares``, each worker is started by ``training.warm run`` (the launcher keeps spares)."""
    if spec.elastic is None:
        raise ValueError(f"training job {spec.job_name} is not elastic")
    bounds = (spec.workers, spec.elastic.min_workers, spec.elastic.max_workers)
    return [*_launcher(horovodrun), *elastic_horovodrun_args(*bounds, launch),
            python, *(THROUGH_A_SPARE if through_spares else []),
            *trainer_args(spec.preset, spec.settings, data_root, run_dir)]


def local_elastic_hosts(count: int) -> list[str]:
    """``count`` names of this machine, one per local elastic worker. horovodrun takes a failed worker's whole
    *host* out (``runner/elastic/registration.py``), so each local worker needs a host name of its own to be lost
    alone; and it starts a host's workers without ssh when the name resolves to an address of this machine
    (``runner/gloo_run.py`` ``_exec_command``). Each name is 127.0.0.1 with leading zeros in its last part, which
    the resolver reads as the same address (``inet_aton``: a part with a leading 0 is octal, and 01 is 1)."""
    return [f"127.0.0.{'0' * index}1" for index in range(count)]


def discovery_script(hosts_file: str, what: str, keeper_lock: str, every_host: str) -> str:
    """A host discovery script that prints ``hosts_file`` (``<host>:<slots>`` a line; its writer, the keeper of
    spares, replaces it whole, ``training.warm``) while the keeper lives — it holds a lock on ``keeper_lock`` —
    and ``every_host`` (the same format) once it is gone, whatever ended it."""
    quoted = shlex.quote
    return ("#!/bin/sh\n" + f"# {what}\n" +
            f"if flock -n {quoted(keeper_lock)} true 2>/dev/null; then printf %s {quoted(every_host)}; "
            f"else cat {quoted(hosts_file)}; fi\n")


def host_label(host: str) -> str:
    """A worker's name as a user knows it: the first label of its host name (``train-x-worker-1`` for the MPI
    operator's ``train-x-worker-1.train-x.ns.svc``); an address stays whole."""
    return host if host.replace(".", "").isdigit() else host.split(".", 1)[0]


def describe_world_change(event: dict[str, Any], max_workers: int | None) -> str:
    """What an elastic run's ``workers`` event says, for the run's log: who was lost or joined at which step,
    the steps done again, and how many workers train on."""
    step, workers = event.get("step"), event.get("workers")
    said = [f"{', '.join(map(host_label, event.get('lost') or []))} lost at step {step}"] if event.get("lost") else []
    if event.get("joined"):
        warm = " (from a warm spare)" if set(event["joined"]) <= set(event.get("joined_warm") or []) else ""
        said.append(f"{', '.join(map(host_label, event['joined']))} joined at step {step}{warm}")
    redone = int(event.get("redone_steps") or 0)
    again = f" ({redone} step{'s' if redone != 1 else ''} done again)" if redone else ""
    of = f" of {max_workers}" if max_workers else ""
    return f"{'; '.join(said) or f'the workers changed at step {step}'}{again}; training continues on {workers}{of} " \
           f"worker{'s' if (max_workers or workers) != 1 else ''}"


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
    return OutputLine(rank, line, decode_event(line))


def decode_event(text: str) -> dict[str, Any] | None:
    """The JSON event a line carries (``{"event": "<kind>", ...}``), None for any other text."""
    if not (text.startswith("{") and '"event"' in text):
        return None
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        return None
    return decoded if isinstance(decoded, dict) and isinstance(decoded.get("event"), str) else None


@dataclass
class RankLines:
    """Each rank's lines whole again, from a launcher's merged output.

    mpirun forwards a rank's output one read at a time, each piece behind the rank's tag, and ends a piece
    without a newline where the read did (OpenMPI 4.1 ``orte/mca/iof/base/iof_base_output.c``). So a line a
    rank wrote in two writes can be cut by another rank's piece — two ranks writing at once give
    ``[1,0]<stdout>:{"event": "st[1,1]<stdout>:rank one says 0`` and then ``[1,0]<stdout>:ep"}``. A
    piece that ends a physical line ends its rank's line; one that a tag cuts short waits for the rest of
    that rank's line. Untagged text (mpirun's own messages, a plain run) is its own rank, None.
    """

    _pending: dict[tuple[int | None, str], str] = field(default_factory=dict)

    def feed(self, raw: str) -> list[tuple[int | None, str]]:
        """The lines ``raw`` (one physical line) completes, as (rank, text)."""
        line = raw.rstrip("\n")
        tags = list(_TAG.finditer(line))
        pieces: list[tuple[int | None, str, str]] = []
        if not tags or tags[0].start() > 0:
            pieces.append((None, "", line[:tags[0].start()] if tags else line))
        for index, tag in enumerate(tags):
            end = tags[index + 1].start() if index + 1 < len(tags) else len(line)
            pieces.append((int(tag["rank"]), tag["stream"], line[tag.end():end]))
        complete = []
        for index, (rank, stream, text) in enumerate(pieces):
            whole = self._pending.pop((rank, stream), "") + text
            if index == len(pieces) - 1:
                complete.append((rank, whole))
            else:
                self._pending[(rank, stream)] = whole
        return complete

    def finish(self) -> list[tuple[int | None, str]]:
        """What ranks wrote last without a newline (the output has ended)."""
        left = [(rank, text) for (rank, _), text in self._pending.items() if text]
        self._pending.clear()
        return left


LOG_TAIL = 40


@dataclass
class JobOutput:
    """A training job's output as it arrives, sorted for every launcher: rank 0's JSON events go to
    ``on_event``, every other line to ``on_log`` and a bounded tail (for error messages), and what the
    launcher says of how it ended (a rank's ``Exit code:``, a worker it could not reach or lost) is kept for
    ``read_exit``."""

    on_event: Callable[[dict[str, Any]], None]
    on_log: Callable[[str], None]
    events: list[dict[str, Any]] = field(default_factory=list)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL))
    exit_lines: list[str] = field(default_factory=list)
    lines: RankLines = field(default_factory=RankLines)
    #: An elastic job: whoever is rank 0 now sends the events, and horovodrun tags a process's lines with the
    #: rank it was started as (``runner/gloo_run.py``), which is not rank 0 once the first rank 0 is lost.
    events_from_any_rank: bool = False
    #: horovodrun said a host's ssh check failed: ssh's own words follow, and are kept too.
    _ssh_words_next: bool = False

    def feed(self, raw: str, may_be_event: bool = True) -> None:
        """One raw line; ``may_be_event`` False for a stream that never carries events (stderr)."""
        for rank, text in self.lines.feed(raw):
            self._take(rank, text, may_be_event)

    def finish(self) -> None:
        """The output has ended: take the lines ranks left without a newline."""
        for rank, text in self.lines.finish():
            self._take(rank, text, may_be_event=True)

    def _take(self, rank: int | None, text: str, may_be_event: bool) -> None:
        event = decode_event(text) if may_be_event and (rank in (None, 0) or self.events_from_any_rank) else None
        if event is not None:
            self.events.append(event)
            self.on_event(event)
            return
        self.tail.append(text)
        if is_exit_report(text) or (self._ssh_words_next and text.strip()):
            self._ssh_words_next = bool(_SSH_CHECK_FAILED.search(text))
            self.exit_lines.append(text)
        self.on_log(text)


def is_exit_report(text: str) -> bool:
    """A line in which horovodrun or mpirun names a failed rank or its exit code, says it could not start on a
    worker, or that it lost one."""
    text = text.strip()
    return bool(_PROCESS_NAME.match(text) or _RANK_EXIT.match(text) or _RANK_SIGNAL.match(text)
                or _START_RACE.search(text) or _SSH_CHECK_FAILED.search(text) or _LOST_WORKER.search(text)
                or _ELASTIC_SHORT.search(text))


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


#: How a training job ended, by what a user does next.
FINISHED, STOPPED, PREEMPTED, START_FAILED, OUT_OF_MEMORY, REFUSED, DEADLINE, FAILED = (
    "finished", "stopped", "preempted", "start-failed", "out-of-memory", "refused", "deadline", "failed")


@dataclass(frozen=True)
class ExitReading:
    """How a training job ended and whether running it again (it resumes) can help.

    ``kind`` says which: ``preempted`` (resumable: stopped from outside, a checkpoint to resume from),
    ``start-failed`` (resumable: it never reached every worker, a start-up race; the cluster platform submits
    it once more itself and then gives up), ``out-of-memory``,
    ``refused`` (configuration or data), ``deadline``, ``failed`` (none of those resumable), or ``finished`` /
    ``stopped`` (succeeded)."""

    succeeded: bool
    resumable: bool
    reason: str
    kind: str = FAILED


def _checkpointed(launcher_code: int | None, lines: list[str], events: list[dict[str, Any]]) -> str | None:
    """What to say when the ranks stopped on a signal with a checkpoint (a ``preempted`` event, or exit 75
    reported for a rank), else None."""
    reported = first_rank_exit(lines)
    code = reported.code if reported else launcher_code
    if not any(event.get("event") == "preempted" for event in events) and code != EXIT_PREEMPTED:
        return None
    who = f" on rank {reported.rank}" if reported and reported.rank is not None else ""
    return f"preempted: it checkpointed and can resume{who}"


def read_exit(launcher_code: int, lines: list[str], events: list[dict[str, Any]]) -> ExitReading:
    """Classify a finished job from its launcher's exit code, its output and the events it sent.

    horovodrun itself exits 1 whenever a rank fails and names the first failing rank's code in its
    output (``Exit code: N``); a plain (size 1) run exits with the trainer's own code. A launcher that never
    reached every worker (training never said ``start``) failed to start, whatever its code.
    """
    names = [event.get("event") for event in events]
    if launcher_code == 0 and "done" in names:
        return ExitReading(True, False, "finished", FINISHED)
    if launcher_code == 0 and "stopped" in names:  # asked to stop (a pruned trial): checkpointed, ended on purpose
        return ExitReading(True, False, STOPPED_ON_REQUEST, STOPPED)
    reported = first_rank_exit(lines)
    code = reported.code if reported else launcher_code
    who = f" on rank {reported.rank}" if reported and reported.rank is not None else ""
    if (checkpointed := _checkpointed(launcher_code, lines, events)) is not None:
        return ExitReading(False, True, checkpointed, PREEMPTED)
    texts = [parse_output_line(line).text.strip() for line in lines]
    if "start" in names and (short := next((text for text in texts if _ELASTIC_SHORT.search(text)), None)):
        return ExitReading(False, True, f"an elastic run had fewer workers than its min_workers for its elastic "
                                        f"timeout ({short}); it can resume from its last checkpoint", PREEMPTED)
    if "start" not in names and (short := next((text for text in texts if _ELASTIC_SHORT.search(text)), None)):
        # Never had min_workers at all: its workers were still waiting for a node or an image, or did not answer.
        # Not an ssh race (horovodrun's own "Timed out waiting for" matches that too): submitting it again at once
        # meets the same cluster, so it is read as resumable — a task retry, after its back-off, tries again.
        return ExitReading(False, True, f"an elastic run never had its min_workers workers within its elastic "
                                        f"timeout ({short}): its workers were still waiting for a node or their image, "
                                        "or could not be reached (kubectl get pods shows which); lower min_workers, "
                                        "raise the block's elastic_timeout_s, or add GPU nodes", PREEMPTED)
    if "start" not in names and (race := next((text for text in texts if _START_RACE.search(text)), None)):
        return ExitReading(False, True, f"could not start on every worker ({race})", START_FAILED)
    if "start" not in names and (check := next((i for i, text in enumerate(texts) if _SSH_CHECK_FAILED.search(text)),
                                               None)) is not None:
        said = next((text for text in texts[check + 1:] if text and not _SSH_CHECK_FAILED.search(text)), texts[check])
        return ExitReading(False, False, f"could not log in to every worker over ssh ({said})")
    # Killed by a signal: SIGKILL, SIGTERM, or SIGUSR1 (what mpirun passes on from the launcher's PID 1) before
    # the trainer listened for it.
    signalled = code < 0 or code in (128 + 9, 128 + 15, 128 + 10)
    # A worker lost while training ran, unless a rank failed on its own first (its teardown can say so too).
    if (reported is None or signalled) and (lost := next((text for text in texts if _LOST_WORKER.search(text)), None)):
        return ExitReading(False, True, f"a worker was lost while it ran ({lost}); it can resume", PREEMPTED)
    if signalled:
        signal_no = -code if code < 0 else code - 128
        return ExitReading(False, True, f"a training process was killed by signal {signal_no}{who}", PREEMPTED)
    if code == EXIT_CONFIG_ERROR:
        return ExitReading(False, False, f"training refused its configuration or data (exit code 2){who}", REFUSED)
    if launcher_code == 0:
        return ExitReading(False, False, "the launcher exited 0 but training never reported 'done'")
    return ExitReading(False, False, f"training failed with exit code {code}{who}")


def read_mpijob_failure(reason: str, launcher_code: int | None, exit_lines: list[str], events: list[dict[str, Any]],
                        pods: list[PodEnd]) -> ExitReading:
    """Classify a ``Failed`` MPIJob: what its pods went through first, then the operator's reason, then the
    launcher's own exit code and output.

    A pod's own end says the most: OOMKilled (its memory ran out: running it again meets the same limit) or a
    disruption (evicted, preempted, its node shut down: resumable), whichever pod it was — the launcher only
    reports what followed. Reasons (kubeflow/mpi-operator ``pkg/controller/mpi_job_controller.go``):
    ``MPIJobEvicted`` (workers evicted), ``DeadlineExceeded`` (``runPolicy.activeDeadlineSeconds`` passed:
    running it again takes as long), ``BackoffLimitExceeded/<launcher pod reason>`` or ``MPIJobFailed``.
    """
    if oom := next((pod for pod in pods if pod.out_of_memory), None):
        return ExitReading(False, False, oom.describe(), OUT_OF_MEMORY)
    if disrupted := [pod for pod in pods if pod.disruption]:
        named = ", ".join(f"{pod.name} {pod.disruption}" for pod in disrupted)
        if (checkpointed := _checkpointed(launcher_code, exit_lines, events)) is not None:  # PID 1 passed it on
            return ExitReading(False, True, f"{checkpointed} (its pods were stopped from outside: {named})",
                               PREEMPTED)
        return ExitReading(False, True, f"its pods were stopped from outside ({named}); it can resume", PREEMPTED)
    if reason.startswith(EVICTED_REASONS):
        return ExitReading(False, True, "pods were evicted (a node drained or pods preempted); it can resume",
                           PREEMPTED)
    if reason.startswith("DeadlineExceeded"):
        return ExitReading(False, False, "it ran longer than its active deadline (runPolicy.activeDeadlineSeconds)",
                           DEADLINE)
    return read_exit(1 if launcher_code is None else launcher_code, exit_lines, events)
