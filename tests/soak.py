"""A seeded soak on the AKS-shaped emulated cluster: runs side by side, started from the Kubernetes work pool as the
UI starts them, while disruptions drawn from the seed hit them; then the invariants a user relies on.

``plan(seed, runs, disruptions)`` is pure: the same seed draws the same runs' kinds and the same disruptions (what,
and on which run at which of its training steps), so a seed that breaks an invariant can be replayed
(``make soak SEED=<seed>``). What each disruption is, as a cluster operator or the cloud does it:

- ``drain-flow-node`` / ``drain-launcher-node`` / ``drain-worker-node``: ``kubectl drain`` of the node that runs
  the run's flow pod, its MPI launcher, or one of its workers (a node-image upgrade, the autoscaler's scale-down),
  through the eviction API; the node is back in service (uncordoned) a few seconds later;
- ``preempt-spot``: Azure takes back a spot VM of the run's workers (``aks.preempt``: AKS node auto-drain, then the
  VM gone); the scale set brings a new VM into the pool a few seconds later;
- ``evict-worker``: one worker pod evicted (node pressure, a descheduler);
- ``lose-node``: a worker's node gone without a word (a host failure); its VM gone, a new one joins later;
- ``api-errors``: a burst of 500s, 429s and connection resets on the reads every client makes (pods, jobs,
  MPIJobs);
- ``restart-server``: the Prefect server stopped and started again on its database (an upgrade), while flow pods,
  the worker and the trainings go on;
- ``anf-slow`` / ``anf-errors``: Azure slow to move volumes between pools for a while (each pool change takes
  seconds), or answering pool changes with 500s and 429s (the SDK's retries), as every run's promotion and return
  of the shared volume meet them.

Runs are of five kinds: ``plain`` (2 workers), ``elastic`` (1 to 2), ``single`` (1 worker), a ``sweep`` (a random
search of two one-worker trials, one at a time, its study on the volume) and a ``nightly`` (train a challenger, score
it on val beside the champion). At most one sweep and one nightly per seed: a second nightly would be refused by the
deployment's own limit of one at a time, a second sweep of the study by its lease (each as designed; a later draw of
either is a ``plain`` run). Every run promotes the shared volume for its training (ANF).

Invariants (``broken_invariants``): every run ended Completed, or Failed with a reason laneflow classified (never a
bare exit code or a traceback); no resumption started before the last checkpoint recorded before it (no training
lost beyond that); no ``gpu`` slot held once the runs ended; no pod of theirs still running; nothing left once the
finished objects' TTL passed (laneflow's clean-up and the TTL controller); every ANF volume back on its home pool with
no level held; every study readable by stock Optuna.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

DISRUPTIONS = ("drain-flow-node", "drain-launcher-node", "drain-worker-node", "preempt-spot", "evict-worker",
               "lose-node", "api-errors", "restart-server", "anf-slow", "anf-errors")
RUN_KINDS = ("plain", "elastic", "single", "sweep", "nightly")
#: Kinds a seed runs at most once (a later draw of one is a plain run).
ONCE = ("sweep", "nightly")
#: The study a sweep of the soak searches (kept on the volume).
STUDY = "soak"
#: A failure message that says nothing a user can act on.
UNCLASSIFIED = re.compile(r"Traceback \(most recent call last\)|^exit code \d+$|failed with exit code \d+\)"
                          r"|Kubernetes job was deleted|No active or succeeded pods")


@dataclass(frozen=True)
class Disruption:
    kind: str
    run: int  # the index of the run it hits
    at_step: int  # when that run's launcher first reports this training step or a later one


@dataclass(frozen=True)
class Plan:
    seed: int
    runs: tuple[str, ...]
    disruptions: tuple[Disruption, ...]

    def replay(self) -> str:
        return f"make soak SEED={self.seed}"


def plan(seed: int, runs: int = 3, disruptions: int = 4, steps: int = 24) -> Plan:
    """What seed ``seed`` does: ``runs`` runs of drawn kinds and ``disruptions`` disruptions, each on a drawn run at a
    drawn step of its training (early enough that the run has not ended)."""
    draw = random.Random(seed)
    kinds: list[str] = []
    for _ in range(runs):
        kind = draw.choice(RUN_KINDS)
        kinds.append("plain" if kind in ONCE and kind in kinds else kind)
    hits = tuple(Disruption(draw.choice(DISRUPTIONS), draw.randrange(runs), draw.randrange(2, steps // 2))
                 for _ in range(disruptions))
    return Plan(seed, tuple(kinds), tuple(sorted(hits, key=lambda hit: (hit.run, hit.at_step))))


def run_parameters(kind: str) -> tuple[dict[str, object], dict[str, object]]:
    """The parameters of a run of ``kind`` (the deployment adds its source and platform): the training's (TrainParams),
    and the sweep's own."""
    # 8 training images: 2 steps an epoch on two workers (16 in all), each epoch ending in a checkpoint; every
    # disruption comes due by step 11 (``plan``). A one-worker trial takes 4 steps an epoch: 4 epochs, 16 steps.
    base: dict[str, object] = {"epochs": 8, "batch_size": 2, "loader_workers": 0, "snapshot": False, "promote": True}
    if kind == "elastic":
        return {**base, "workers": 2, "elastic": {"min_workers": 1, "max_workers": 2, "commit_every": 2}}, {}
    if kind == "sweep":
        return {**base, "epochs": 4, "workers": 1}, {
            "search": "random", "space": {"lr": {"low": 0.01, "high": 0.05}}, "trials": 2, "max_concurrent": 1,
            "seed": 0, "study": STUDY, "grid": None}
    return {**base, "workers": 1 if kind == "single" else 2}, {}


def deployment_of(kind: str) -> str:
    """The cluster deployment (deployments/prefect-kubernetes.yaml) a run of ``kind`` is started from."""
    return {"sweep": "sweep/sweep-k8s", "nightly": "nightly_retrain/nightly-k8s"}.get(kind, "train_pipeline/train-k8s")


@dataclass
class RunRecord:
    """One run as the soak saw it."""

    index: int
    kind: str
    flow_run_id: str
    state: str = ""
    message: str = ""
    attempts: int = 0
    hits: list[str] = field(default_factory=list)
    resumptions: list[tuple[int, int]] = field(default_factory=list)  # (resumed at, last checkpoint before)
    trainings: list[str] = field(default_factory=list)  # its training runs' names (a sweep's trials, a nightly's)


def resumptions(metrics: list[dict]) -> list[tuple[int, int]]:
    """(the step a resumed start began at, the step of the last checkpoint written before it) for every resumed
    start in a run's ``metrics.jsonl``: equal when no training was lost beyond the last checkpoint."""
    found, last_checkpoint = [], 0
    for event in metrics:
        if event["event"] == "checkpoint":
            last_checkpoint = event["step"]
        elif event["event"] == "start" and event.get("resumed"):
            found.append((event["step"], last_checkpoint))
    return found


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def broken_invariants(records: list[RunRecord], gpu_slots_held: int, left_running: list[str],
                      left_after_ttl: list[str], volumes_away: list[str] = (), studies_unreadable: list[str] = ()
                      ) -> list[str]:
    """What the soak found wrong, one line each (empty: every invariant holds)."""
    broken = []
    for record in records:
        if record.state not in ("Completed", "Failed"):
            broken.append(f"run {record.index} ({record.kind}) ended {record.state}: {record.message[:300]}")
        elif record.state == "Failed" and (not record.message or UNCLASSIFIED.search(record.message)):
            broken.append(f"run {record.index} ({record.kind}) failed without a classified reason: "
                          f"{record.message[:300]!r}")
        # Resuming later than the last checkpoint recorded is no loss (a stop's own checkpoint can be written after
        # the record's last line, by ranks stopped before they could add it); earlier is training lost.
        broken += [f"run {record.index} ({record.kind}) resumed at step {at}, but its last checkpoint before was at "
                   f"step {last}" for at, last in record.resumptions if at < last]
    if gpu_slots_held:
        broken.append(f"{gpu_slots_held} 'gpu' slot(s) still held after every run ended")
    if left_running:
        broken.append(f"still running after every run ended: {', '.join(left_running)}")
    if left_after_ttl:
        broken.append(f"left past their TTL: {', '.join(left_after_ttl)}")
    broken += [f"ANF volume not back home once no run held it: {away}" for away in volumes_away]
    broken += [f"study not readable by stock Optuna: {study}" for study in studies_unreadable]
    return broken


def table(plan_: Plan, records: list[RunRecord], broken: list[str]) -> str:
    """The seed's result as a Markdown table, and what broke with how to replay it."""
    lines = [f"seed {plan_.seed}: {len(records)} runs, {len(plan_.disruptions)} disruptions",
             "", "| run | kind | state | attempts | trainings | disruptions | resumed at (last checkpoint) |",
             "|---|---|---|---|---|---|---|"]
    for record in records:
        resumed = ", ".join(f"{at} ({last})" for at, last in record.resumptions) or "-"
        lines.append(f"| {record.index} | {record.kind} | {record.state} | {record.attempts} | "
                     f"{len(record.trainings)} | {', '.join(record.hits) or '-'} | {resumed} |")
    lines += [f"run {record.index} {record.state.lower()}: {record.message[:400]}" for record in records
              if record.state != "Completed"]
    if broken:
        lines += ["", "broken invariants:", *(f"- {line}" for line in broken), f"replay: {plan_.replay()}"]
    return "\n".join(lines)
