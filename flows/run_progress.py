"""What ``laneflow run`` and ``laneflow sweep`` show while a flow run goes on: pure functions over what the API
returns (the run's task runs and its log lines), so the terminal's progress bar is tested without a terminal.

The training stage's own log lines carry the figures (``tasks.pipeline.wait_for_training``): "training started
at step S of T ..." and "step N: loss L, lr R, X img/s, ...". A sweep's trials are child flow runs: their
lines reach the sweep's own log only as the trials' summaries, so a sweep shows its stage and state.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

STARTED = re.compile(r"training started at step (\d+) of (\d+)")
STEP = re.compile(r"^step (\d+): loss ([0-9.eE+-]+|nan), lr \S+, ([0-9.]+) img/s")
BAR_WIDTH = 24


class OverrideError(ValueError):
    """A ``--set`` that is not ``KEY=VALUE``; the message names it and shows the form."""


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as parameters: a value that reads as JSON is that JSON (``epochs=2``, ``lr=0.02``,
    ``grid={"lr": [0.02, 0.05]}``, ``package=false``), anything else is the string as typed."""
    parameters: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        key = key.strip()
        if not equals or not key:
            raise OverrideError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set epochs=2 or "
                                "--set grid='{\"lr\": [0.02, 0.05]}'")
        try:
            parameters[key] = json.loads(text)
        except ValueError:
            parameters[key] = text
    return parameters


def unknown_parameters(overrides: dict[str, Any], schema: dict[str, Any],
                       current: frozenset[str] = frozenset()) -> str | None:
    """Why ``overrides`` cannot be a run of a deployment whose parameter schema is ``schema`` (the server's
    ``parameter_openapi_schema``): the keys it has no parameter for, each with the nearest names it has. None when
    every key is a parameter. The server's schema check passes an unknown key (Prefect's flow schema allows extra
    properties), and the run would only fail once a worker started it. A key among ``current`` (the parameters of
    this laneflow's flows) is one the deployment predates: applying it again is the fix."""
    import difflib

    known = sorted((schema or {}).get("properties") or {})
    unknown = [key for key in overrides if key not in known]
    if not known or not unknown:
        return None
    newer = [key for key in unknown if key in current]
    if newer:
        return (f"the deployment predates the parameter {', '.join(map(repr, newer))} of this laneflow: apply "
                "prefect.yaml's deployments again (laneflow deploy) where it was applied")
    said = []
    for key in unknown:
        near = difflib.get_close_matches(key, known, n=3)
        said.append(f"{key!r}" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
    return (f"no parameter {', '.join(said)}: the deployment's parameters are {', '.join(known)} "
            "(docs/reference/parameters.md)")


@dataclass(frozen=True)
class Progress:
    """Where a run is: its state, the stage running now, and training's latest figures."""

    state: str = "Scheduled"
    stage: str = ""
    step: int = 0
    total: int = 0
    loss: float | None = None
    img_per_s: float | None = None


def advance(progress: Progress, state: str, running_tasks: list[str], log_lines: list[str]) -> Progress:
    """``progress`` after the run's state, the task runs running now (by name) and its new log lines."""
    updated = replace(progress, state=state, stage=running_tasks[-1] if running_tasks else progress.stage)
    for line in log_lines:
        if match := STARTED.search(line):
            updated = replace(updated, step=int(match[1]), total=int(match[2]))
        elif match := STEP.search(line):
            updated = replace(updated, step=int(match[1]), loss=float(match[2]), img_per_s=float(match[3]))
    return updated


def render(progress: Progress) -> str:
    """One line: the stage, a bar of the steps trained (once training has said how many), the figures."""
    parts = [f"{progress.state:<10}", f"{progress.stage or 'starting':<22}"]
    if progress.total:
        done = min(BAR_WIDTH, BAR_WIDTH * progress.step // progress.total)
        parts.append(f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] step {progress.step}/{progress.total}")
    if progress.loss is not None:
        parts.append(f"loss {progress.loss:.4f}")
    if progress.img_per_s is not None:
        parts.append(f"{progress.img_per_s:.1f} img/s")
    return "  ".join(parts).rstrip()


def metrics_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The metrics table artifact's rows (``tasks.report.metrics_rows``: metric, value) as ``name: value`` lines."""
    lines = []
    for row in rows:
        name = row.get("metric") or row.get("name")
        if name is None:
            continue
        value = row.get("value")
        lines.append(f"{name}: {value:.4f}" if isinstance(value, float) else f"{name}: {value}")
    return lines
