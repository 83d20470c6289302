"""``compare``: runs side by side from their own records, as a table artifact, a report with scaling and
charts, and for ``laneflow compare`` a printed table.

Each run is named the way ``predict`` names models: a run (``train-1a2b3c4d5e6f``, on a volume) or a
snapshot, on any platform block, local and cluster in one comparison. What is read (``metrics.jsonl`` and
``lineage.json`` of the run, a local snapshot's own copy first; the nightly's ``champion-decision.json``
when the run was its challenger) and what each figure means is in ``tasks/compare.py``. Prices come from the
``prices`` parameter or the Prefect variable ``laneflow-prices``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.variables import Variable
from pydantic import BaseModel, ConfigDict, Field

from tasks.champion import DECISION_FILE
from tasks.compare import CompareError, Comparison, Prices, RunRecords, compare, parse_events
from tasks.compare_report import accuracy_chart_png, render_markdown, throughput_chart_png
from tasks.names import DNS_LABEL, MAX_NAME, validate_name
from tasks.platforms import Platform, VolumeRef, load_platform
from tasks.report import data_uri
from tasks.retry import RETRY_POLICY

PRICES_VARIABLE = "laneflow-prices"
DEFAULT_VOLUME = "tusimple"


class RunRef(BaseModel):
    """One run to compare: a run name on a volume, or a snapshot name, on a platform block."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_NAME, pattern=DNS_LABEL.pattern,
                      description="a run (train-1a2b3c4d5e6f) or a snapshot")
    volume: str = Field(DEFAULT_VOLUME, pattern=DNS_LABEL.pattern, description="the run's volume (a snapshot "
                                                                              "knows its own)")
    platform: str = Field("local", min_length=1, description="platform block name")

    @classmethod
    def parse(cls, text: str, volume: str = DEFAULT_VOLUME, platform: str = "local") -> RunRef:
        """``[PLATFORM:][VOLUME/]NAME`` (the CLI's form), the defaults filling what it leaves out."""
        if ":" in text:
            platform, text = text.split(":", 1)
        if "/" in text:
            volume, text = text.rsplit("/", 1)
        return cls(name=text, volume=volume, platform=platform)

    def label(self) -> str:
        return self.name if self.platform == "local" else f"{self.platform}:{self.name}"


def _read(platform: Platform, snapshot: str | None, volume: str, path: str) -> bytes:
    """A run file from the snapshot's own copy when it is one (and readable here), else from the volume."""
    if snapshot is not None:
        try:
            return platform.read_snapshot_file(snapshot, path)
        except FileNotFoundError:
            pass
    return platform.read_file(VolumeRef(name=volume, location=""), path)


def read_run_records(ref: RunRef) -> RunRecords:
    """The run's lineage and events, or a CompareError naming what is missing and what to do."""
    platform = load_platform(ref.platform)
    try:
        lineage: dict[str, Any] | None = platform.find_lineage(ref.name)
        snapshot, run, volume = ref.name, str(lineage.get("run")), str(lineage.get("volume") or ref.volume)
    except KeyError:
        lineage, snapshot, run, volume = None, None, ref.name, validate_name(ref.volume, "volume")
    try:
        metrics = _read(platform, snapshot, volume, f"runs/{run}/metrics.jsonl").decode()
    except FileNotFoundError:
        if snapshot is not None:
            raise CompareError(f"{ref.label()}: the snapshot's run '{run}' has no metrics.jsonl on volume "
                               f"'{volume}' (this platform reads a snapshot's files on its volume): restore the "
                               "snapshot (laneflow restore) and compare NEW-VOLUME/RUN") from None
        raise CompareError(f"{ref.label()}: no snapshot of that name on platform '{ref.platform}' and no run "
                           f"'{run}' with a metrics.jsonl on volume '{volume}' (runs are named like "
                           "train-1a2b3c4d5e6f; give the volume as VOLUME/RUN)") from None
    if lineage is None:
        try:
            lineage = json.loads(_read(platform, None, volume, f"runs/{run}/lineage.json"))
        except FileNotFoundError:
            raise CompareError(f"{ref.label()}: run '{run}' on volume '{volume}' has no lineage.json: it did not "
                               "finish (a failed run, or a sweep trial its pruner stopped: those keep none), or "
                               "it ran before laneflow recorded one") from None
        except json.JSONDecodeError as exc:
            raise CompareError(f"{ref.label()}: runs/{run}/lineage.json is not JSON ({exc.msg})") from None
    return RunRecords(name=ref.label(), lineage=lineage, events=parse_events(metrics, ref.label()),
                      decision=read_decision(platform, snapshot, volume, run, ref.label()))


def read_decision(platform: Platform, snapshot: str | None, volume: str, run: str, label: str
                  ) -> dict[str, Any] | None:
    """The nightly's decision on the run when it was a nightly's challenger (``runs/<run>/champion-decision.json``,
    written after its snapshot, so read on the volume), else None."""
    try:
        text = _read(platform, snapshot, volume, f"runs/{run}/{DECISION_FILE}")
    except FileNotFoundError:
        return None
    try:
        decision = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CompareError(f"{label}: runs/{run}/{DECISION_FILE} is not JSON ({exc.msg}): the nightly writes it whole, "
                           "so the file was changed by hand; remove it to compare the run without its decision"
                           ) from None
    if not isinstance(decision, dict) or "promoted" not in decision:
        raise CompareError(f"{label}: runs/{run}/{DECISION_FILE} is not a nightly's decision (no 'promoted'): "
                           "remove it to compare the run without one")
    return decision


@task(name="read_run_records", task_run_name="records-{ref.name}", cache_policy=NO_CACHE, **RETRY_POLICY)
def read_run_records_task(ref: RunRef) -> RunRecords:
    return read_run_records(ref)


def read_all(refs: list[RunRef], read: Any = read_run_records) -> list[RunRecords]:
    """Every run's records; all that are missing named in one error, before anything is published."""
    found, problems = [], []
    labels = [ref.label() for ref in refs]
    problems += [f"{label}: named more than once" for label in sorted(set(labels)) if labels.count(label) > 1]
    for ref in refs:
        try:
            found.append(read(ref))
        except (CompareError, ValueError) as exc:  # ValueError: a volume or platform name that cannot be one
            problems.append(str(exc) if isinstance(exc, CompareError) else f"{ref.label()}: {exc}")
    if problems:
        raise CompareError("cannot compare: " + " | ".join(problems))
    return found


def prices_setting() -> Prices | None:
    """The Prefect variable ``laneflow-prices`` (the same form as the ``prices`` parameter), if set."""
    value = Variable.get(PRICES_VARIABLE, default=None)
    if not value:
        return None
    try:
        return Prices.model_validate(json.loads(value) if isinstance(value, str) else value)
    except ValueError as exc:
        raise CompareError(f"Prefect variable {PRICES_VARIABLE} is not a price list: {exc}") from None


def chart_pngs(comparison: Comparison) -> dict[str, bytes]:
    """The report's charts by title, as PNG."""
    return {"Throughput vs workers": throughput_chart_png(comparison),
            "Val accuracy vs wall time": accuracy_chart_png(comparison)}


def charts(pngs: dict[str, bytes]) -> dict[str, str]:
    """The charts as data URIs, for the markdown report."""
    return {title: data_uri(png, "image/png") for title, png in pngs.items()}


@flow(name="compare")
def compare_runs(runs: Annotated[list[RunRef], Field(min_length=1)],
                 target_accuracy: Annotated[float, Field(gt=0, le=1)] = 0.9,
                 baseline: str | None = None, prices: Prices | None = None) -> list[dict[str, Any]]:
    """Compare runs and snapshots side by side: figures, speed-up and efficiency against the baseline
    (default: the run with the fewest workers), cost, and charts.

    Args:
        runs: each a run name on its volume, or a snapshot, on a platform block
        target_accuracy: the val accuracy (without the 200 ms rule) whose time to reach is reported
        baseline: the run (as named in runs) scaling is measured against
        prices: worker_hour by platform block, tib_hour by service level (else the variable laneflow-prices)
    """
    logger = get_run_logger()
    records = read_all(runs, read_run_records_task)
    chosen = prices or prices_setting()
    comparison = compare(records, target_accuracy, baseline, chosen)
    create_table_artifact(table=comparison.rows, key="compare",
                          description=f"{len(records)} run(s) against {comparison.baseline}")
    create_markdown_artifact(markdown=render_markdown(comparison, charts(chart_pngs(comparison))), key="compare-report",
                             description="scaling, cost, flags and charts of the comparison")
    for row in comparison.rows:
        logger.info("%s: %s worker(s), %s img/s, speed-up %s, efficiency %s, cost %s; %s", row["run"],
                    row["workers"], row["img/s"], row["speed-up"], row["efficiency"], row["cost"], row["comparable"])
    return comparison.rows
