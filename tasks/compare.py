"""Compare runs side by side from their own records: the figures, scaling against a baseline, fairness
flags, cost and two charts (the functional core of ``flows/compare.py`` and ``laneflow compare``).

Every figure comes from what a run left on its volume: ``metrics.jsonl`` (the trainer's events, each with
its ``time``) and ``lineage.json`` (parameters, dataset version, evaluation, service level). Definitions,
as docs/how-to/compare.md gives them:

- *images seen*: every image the trainer fed the model, over all attempts (a resumed run repeats the
  steps after its checkpoint); each ``step`` event covers the steps since the one before it in its attempt,
  ``batch_size x world_size`` images a step.
- *training time*: the time inside those windows, each event's ``seconds`` (the trainer's own clock: val
  scoring is outside it, checkpoints and epoch ends inside).
- *throughput*: images seen / training time, in all and per worker; *input stall*: the share of training
  time spent waiting for data, weighted by window.
- *wall time*: first ``start`` to the last recorded event, restarts included: what the run took once its
  processes ran (their start-up, and a pod's scheduling and image pull, are before it).
- *time to target*: from the first ``start`` to the first val score (``eval_every`` or the trainer's final
  val evaluation) whose accuracy without the 200 ms rule reaches the target. The untimed score, because
  it measures what the model learned whatever the machine's speed, as model selection does.
- *worker-hours*: workers x wall time.
- *speed-up*: the baseline's wall time / the run's, when both did the same work (the same images seen,
  within ``SAME_WORK_TOLERANCE``): elapsed time for the same job, as the seed's headline reads (1 GPU
  12 h 45 min vs 3 GPUs 4 h 30 min: 2.83x). Runs that did different work have no speed-up: a ratio of
  their times would compare different jobs. *efficiency*: speed-up / (workers / the baseline's workers).
- *throughput ratio*: img/s / the baseline's, a scaling diagnostic only: it leaves out everything outside
  the step windows (start-up, val scoring, checkpoints between epochs), which elapsed time pays for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

NO_PRICES = "no prices given"
#: Two runs did "the same work" when their images seen differ by at most this share of the larger: a
#: distributed sampler pads each rank's share of an epoch to a whole number of images and drops the last
#: partial batch, so 1 and 3 workers over the same epochs see a few images more or less.
SAME_WORK_TOLERANCE = 0.02


class CompareError(LookupError):
    """A run or snapshot that cannot be compared: missing, or without the records a comparison needs."""


class Prices(BaseModel):
    """What compute and storage cost, for the cost columns (docs/how-to/compare.md shows the form).

    ``worker_hour`` is keyed by platform block name (``local``, or the name of a cluster block, one per GPU
    type), ``tib_hour`` by ANF service level; the volume's quota is billed at the level it trained on.
    """

    model_config = ConfigDict(extra="forbid")

    currency: str = Field("USD", min_length=1, max_length=8)
    worker_hour: dict[str, float] = Field(default_factory=dict, description="price of one worker for one hour, "
                                                                            "by platform block name")
    tib_hour: dict[str, float] = Field(default_factory=dict, description="price of one TiB of volume quota for "
                                                                         "one hour, by service level")


@dataclass(frozen=True)
class RunRecords:
    """What one named run left: its lineage and every event of ``metrics.jsonl``."""

    name: str
    lineage: dict[str, Any]
    events: list[dict[str, Any]]
    #: The nightly's decision when the run was its challenger (``champion-decision.json``), else None.
    decision: dict[str, Any] | None = None


@dataclass
class RunFigures:
    """One row of the comparison, before scaling and cost."""

    name: str
    run: str
    platform: str
    volume: str
    workers: int
    preset: str
    precision: str
    batch_size: int
    dataset_version: str
    steps: int
    images_seen: int
    wall_s: float | None
    training_s: float
    img_per_s: float
    img_per_s_per_worker: float
    input_stall: float
    val_accuracy: float | None
    val_untimed_accuracy: float | None
    test_accuracy: float | None
    test_untimed_accuracy: float | None
    time_to_target_s: float | str | None
    worker_hours: float | None
    service_level: str | None
    quota_tib: float | None
    #: (seconds since the first start, untimed val accuracy) of every val score, for the chart.
    val_curve: list[tuple[float, float]] = field(default_factory=list)
    #: What the evaluation measured: ``tusimple`` (accuracy), or ``culane``, whose "accuracy" figures are F1 at
    #: IoU 0.5 (``training.evaluate_culane``).
    metric: str = "tusimple"
    #: The lane model the run trained (``training.models``); runs from before there were others trained SCNN.
    model: str = "scnn"
    #: A CULane run's test figures per scenario list, as its evaluation gives them (``tp``, ``fp``, ``fn``,
    #: ``precision``, ``recall``, ``f1``, ``f1_75``, ``mean_f1``; None where a figure is undefined).
    test_scenarios: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The nightly's champion decision when the run was its challenger: ``promoted``, ``reason``, ``champion``
    #: (against which; None for the first), ``gates_summary`` and ``gates`` (each release gate's figures,
    #: ``tasks.champion.gates_table``). None for a run no nightly judged.
    champion_decision: dict[str, Any] | None = None


def parse_events(metrics_jsonl: str, name: str) -> list[dict[str, Any]]:
    """The events of a ``metrics.jsonl``; a line that is not JSON names the run and line."""
    events = []
    for number, line in enumerate(metrics_jsonl.splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise CompareError(f"{name}: metrics.jsonl line {number} is not JSON ({exc.msg})") from None
    return events


def _attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events split at each ``start``: one list per attempt."""
    attempts: list[list[dict[str, Any]]] = []
    for event in events:
        if event.get("event") == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(event)
    return attempts


def training_windows(events: list[dict[str, Any]], batch_size: int) -> list[tuple[int, float, float, int]]:
    """(images, seconds, input stall share, workers) of each ``step`` event's window, over every attempt. An
    elastic run's step events say how many workers trained them, and its ``workers`` events move the count of
    steps back to where the survivors resumed (the steps done again were trained too)."""
    windows = []
    for attempt in _attempts(events):
        start = attempt[0]
        world = int(start.get("world_size") or 1)
        previous = int(start.get("step") or 0) if start.get("event") == "start" else 0
        for event in attempt:
            if event.get("event") == "workers" and "step" in event:
                previous = int(event["step"])
            if event.get("event") != "step" or not event.get("img_per_s"):
                continue
            workers = int(event.get("workers") or world)
            images = (int(event["step"]) - previous) * batch_size * workers
            previous = int(event["step"])
            # The trainer's own clock for the window; a run from before it recorded one: its images at its rate.
            seconds = float(event["seconds"]) if "seconds" in event else images / float(event["img_per_s"])
            windows.append((images, seconds, float(event.get("input_stall") or 0.0), workers))
    return windows


def val_points(events: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(seconds since the first start, untimed accuracy, official accuracy) of every val score: the
    periodic ``val`` events and the trainer's final evaluation (an ``eval`` event of split val)."""
    starts = [event for event in events if event.get("event") == "start" and "time" in event]
    if not starts:
        return []
    origin = float(starts[0]["time"])
    points = []
    for event in events:
        is_val = event.get("event") == "val" or (event.get("event") == "eval" and event.get("split") == "val")
        if is_val and "time" in event and "accuracy" in event:
            points.append((float(event["time"]) - origin, float(event.get("untimed_accuracy", event["accuracy"])),
                           float(event["accuracy"])))
    return points


def run_figures(records: RunRecords, target_accuracy: float) -> RunFigures:
    """The row of one run, from its records alone."""
    lineage, events = records.lineage, records.events
    starts = [event for event in events if event.get("event") == "start"]
    if not starts:
        raise CompareError(f"{records.name}: its metrics.jsonl has no start event (did training begin?)")
    params = lineage.get("parameters") or {}
    batch_size = int(params.get("batch_size") or 0)
    if batch_size <= 0:
        raise CompareError(f"{records.name}: its lineage records no batch_size parameter")
    windows = training_windows(events, batch_size)
    images = sum(images for images, _, _, _ in windows)
    seconds = sum(seconds for _, seconds, _, _ in windows)
    workers = int(starts[-1].get("world_size") or params.get("workers") or 1)
    # An elastic run's workers came and went: its worker count is the one its training time had on average.
    worker_seconds = sum(seconds * count for _, seconds, _, count in windows)
    if seconds and any(count != workers for *_, count in windows):
        workers = max(1, round(worker_seconds / seconds))
    stamped = [float(event["time"]) for event in events if "time" in event]
    wall = (max(stamped) - float(starts[0]["time"])) if stamped and "time" in starts[0] else \
        (lineage.get("training") or {}).get("duration_s")
    trainer_eval = (lineage.get("training") or {}).get("trainer_eval") or {}
    metrics = lineage.get("metrics") or {}
    on_test = metrics.get("split") == "test"
    points = val_points(events)
    reached: float | str | None = next((at for at, untimed, _ in points if untimed >= target_accuracy), None)
    if "time" not in starts[0]:
        reached = "no time stamps"  # a run from before events carried their time
    level = lineage.get("service_level") or {}
    steps = [int(event["step"]) for event in events if event.get("event") in ("step", "eval", "stopped")
             and "step" in event]
    return RunFigures(
        name=records.name, run=str(lineage.get("run")), platform=str(lineage.get("platform")),
        volume=str(lineage.get("volume")), workers=workers, preset=str(params.get("preset")),
        precision=str(starts[-1].get("precision") or "fp32"), batch_size=batch_size,
        dataset_version=str(lineage.get("dataset_version")),
        steps=max(steps, default=int((lineage.get("training") or {}).get("steps") or 0)),
        images_seen=images, wall_s=float(wall) if wall is not None else None, training_s=seconds,
        img_per_s=images / seconds if seconds else 0.0,
        img_per_s_per_worker=images / worker_seconds if worker_seconds else 0.0,
        input_stall=sum(stall * seconds for _, seconds, stall, _ in windows) / seconds if seconds else 0.0,
        val_accuracy=_number(trainer_eval.get("accuracy")),
        val_untimed_accuracy=_number(trainer_eval.get("untimed_accuracy")),
        test_accuracy=_number(metrics.get("accuracy")) if on_test else None,
        test_untimed_accuracy=_number(metrics.get("untimed_accuracy")) if on_test else None,
        time_to_target_s=reached,
        worker_hours=(worker_seconds / seconds if seconds else workers) * float(wall) / 3600
        if wall is not None else None,
        service_level=level.get("training"), quota_tib=_number(level.get("quota_tib")),
        val_curve=[(at, untimed) for at, untimed, _ in points], metric=str(metrics.get("metric") or "tusimple"),
        test_scenarios=dict(metrics.get("scenarios") or {}) if on_test else {},
        model=str(params.get("model") or "scnn"), champion_decision=records.decision)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def choose_baseline(figures: list[RunFigures], baseline: str | None) -> RunFigures:
    """The named run (by the name it was given or its run name), else the one with the fewest workers
    (the first of those named)."""
    if baseline:
        for row in figures:
            if baseline in (row.name, row.run):
                return row
        raise CompareError(f"baseline {baseline!r} is not among the compared runs "
                           f"({', '.join(row.name for row in figures)})")
    return min(figures, key=lambda row: row.workers)


def unfair_because(row: RunFigures, baseline: RunFigures) -> list[str]:
    """What makes ``row`` not like for like with the baseline: it is still compared, and flagged."""
    reasons = []
    for label, mine, theirs in (("dataset version", row.dataset_version, baseline.dataset_version),
                                ("model", row.model, baseline.model),
                                ("preset", row.preset, baseline.preset),
                                ("batch size per worker", row.batch_size, baseline.batch_size)):
        if mine != theirs:
            reasons.append(f"{label} {mine} (baseline {baseline.name}: {theirs})")
    return reasons


def run_cost(row: RunFigures, prices: Prices | None) -> tuple[float | None, str]:
    """(cost, how it was made) of one run: worker-hours at its platform's price plus, where the run trained
    on a service level, the volume's quota at that level's price for the wall time."""
    if prices is None or not (prices.worker_hour or prices.tib_hour):
        return None, NO_PRICES
    if row.worker_hours is None:
        return None, "no wall time recorded"
    worker_price = prices.worker_hour.get(row.platform)
    if worker_price is None:
        return None, f"no worker_hour price for platform {row.platform!r}"
    cost, how = row.worker_hours * worker_price, [f"{row.worker_hours:.4f} worker-h x {worker_price:g}"]
    if row.service_level is not None and row.quota_tib is not None and row.wall_s is not None:
        level_price = prices.tib_hour.get(row.service_level)
        if level_price is None:
            return None, f"no tib_hour price for service level {row.service_level!r}"
        tib_hours = row.quota_tib * row.wall_s / 3600
        cost += tib_hours * level_price
        how.append(f"{tib_hours:.4f} TiB-h {row.service_level} x {level_price:g}")
    return cost, " + ".join(how)


def same_work(row: RunFigures, baseline: RunFigures) -> bool:
    """Whether two runs did the same job (same images seen, within ``SAME_WORK_TOLERANCE``)."""
    most = max(row.images_seen, baseline.images_seen)
    return most > 0 and abs(row.images_seen - baseline.images_seen) <= SAME_WORK_TOLERANCE * most


@dataclass(frozen=True)
class Scaling:
    """A run against the baseline: the elapsed-time speed-up when both did the same work (else None, and
    ``why_not`` says why), its efficiency, and the throughput ratio as a diagnostic."""

    speed_up: float | None
    efficiency: float | None
    throughput_ratio: float | None
    why_not: str = ""


def scaling(row: RunFigures, baseline: RunFigures) -> Scaling:
    """The speed-up of ``row`` over the baseline: the ratio of elapsed (wall) times for the same work."""
    workers = row.workers / baseline.workers
    throughput_ratio = row.img_per_s / baseline.img_per_s if baseline.img_per_s else None
    if not same_work(row, baseline):
        return Scaling(None, None, throughput_ratio, f"not the same work ({row.images_seen} images seen, baseline "
                                                     f"{baseline.images_seen})")
    if not row.wall_s or not baseline.wall_s:
        return Scaling(None, None, throughput_ratio, "no wall time recorded")
    speed_up = baseline.wall_s / row.wall_s
    return Scaling(speed_up, speed_up / workers, throughput_ratio)


@dataclass
class Comparison:
    """Every row with its scaling, cost and flags, and the baseline they are measured against."""

    baseline: str
    target_accuracy: float
    currency: str
    rows: list[dict[str, Any]]
    figures: list[RunFigures]
    #: Every run but the baseline, by name.
    scalings: dict[str, Scaling] = field(default_factory=dict)


def compare(records: list[RunRecords], target_accuracy: float = 0.9, baseline: str | None = None,
            prices: Prices | None = None) -> Comparison:
    """The comparison of these runs (at least one)."""
    if not records:
        raise CompareError("nothing to compare: name at least one run or snapshot")
    if not 0 < target_accuracy <= 1:
        raise CompareError(f"target accuracy {target_accuracy:g} is not a fraction: give one in (0, 1], e.g. 0.9")
    figures = [run_figures(item, target_accuracy) for item in records]
    base = choose_baseline(figures, baseline)
    judged = any(row.champion_decision is not None for row in figures)  # the decision's columns, for every row
    rows = []
    for row in figures:
        scaled = scaling(row, base)
        cost, how = run_cost(row, prices)
        flags = unfair_because(row, base)
        rows.append({
            "run": row.name, "platform": row.platform, "workers": row.workers, "model": row.model, "preset": row.preset,
            "precision": row.precision, "steps": row.steps, "images seen": row.images_seen,
            "wall time (s)": _round(row.wall_s, 1), "training time (s)": _round(row.training_s, 2),
            "img/s": _round(row.img_per_s, 2), "img/s per worker": _round(row.img_per_s_per_worker, 2),
            "input stall": _round(row.input_stall, 4),
            "val accuracy": _round(row.val_accuracy, 4), "val accuracy (untimed)": _round(row.val_untimed_accuracy, 4),
            "test accuracy": _round(row.test_accuracy, 4),
            "test accuracy (untimed)": _round(row.test_untimed_accuracy, 4),
            f"time to {target_accuracy:g} val (s)": _round(row.time_to_target_s, 1)
            if isinstance(row.time_to_target_s, float) else (row.time_to_target_s or "not reached"),
            "worker-hours": _round(row.worker_hours, 5),
            "speed-up": _round(scaled.speed_up, 3) if scaled.speed_up is not None else scaled.why_not,
            "efficiency": _round(scaled.efficiency, 3),
            "throughput ratio (diagnostic)": _round(scaled.throughput_ratio, 3),
            "cost": _round(cost, 4) if cost is not None else how, "cost basis": how if cost is not None else "",
            "dataset version": row.dataset_version,
            "comparable": "baseline" if row is base else ("yes" if not flags else "NO: " + "; ".join(flags)),
            **(decision_cells(row.champion_decision) if judged else {}),
        })
    return Comparison(baseline=base.name, target_accuracy=target_accuracy,
                      currency=prices.currency if prices else "", rows=rows, figures=figures,
                      scalings={row.name: scaling(row, base) for row in figures if row is not base})


def decision_cells(decision: dict[str, Any] | None) -> dict[str, str]:
    """The table's nightly columns of one run: what the nightly decided on it as a challenger and against whom,
    and its release gates in one line (how many passed, which failed, or why none were scored); empty for a run
    no nightly judged."""
    if decision is None:
        return {"nightly decision": "", "release gates": ""}
    against = decision.get("champion")
    if decision.get("stopped"):  # its training was stopped: nothing was judged, nothing kept in its place
        verdict = "not scored (stopped)"
        return {"nightly decision": f"{verdict}, champion {against}" if against else verdict,
                "release gates": str(decision.get("gates_summary") or "")}
    verdict = "promoted" if decision.get("promoted") else "kept"
    return {"nightly decision": f"{verdict} against {against}" if against else f"{verdict} (no champion before)",
            "release gates": str(decision.get("gates_summary") or "")}


def _round(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None
