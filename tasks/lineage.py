"""Lineage: what a model was made from, recorded with every run and snapshot, and rendered for people.

The same record backs the run's lineage artifact in the Prefect UI, the snapshot's labels, and
``laneflow lineage <run-or-snapshot>``, so the three always agree.
"""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def code_version(root: Path = PROJECT_ROOT) -> str:
    """The code that ran: ``$LANEFLOW_CODE_VERSION`` (set in images), else the git commit (+dirty), else the package."""
    if os.environ.get("LANEFLOW_CODE_VERSION"):
        return os.environ["LANEFLOW_CODE_VERSION"]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return f"git:{commit}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        try:
            return f"laneflow=={metadata.version('laneflow')}"
        except metadata.PackageNotFoundError:
            return "unknown"


def dataset_name(dataset: dict, evaluation: dict) -> str:
    """Which dataset a run trained on: the preparation's own word when its summary carries the manifest's
    ``dataset``, else the evaluation's, which chose its metric from that manifest (``training.evaluate``'s
    ``dataset_kind``): ``culane`` when it scored by CULane's metric, ``tusimple`` otherwise."""
    if dataset.get("dataset"):
        return str(dataset["dataset"])
    return "culane" if evaluation.get("metric") == "culane" else "tusimple"


def dataset_label(lineage: dict) -> str:
    """A run's dataset for people: its name and version (``culane dv1``); a record from before the name was
    kept says only its version."""
    name, version = lineage.get("dataset"), lineage.get("dataset_version")
    return f"{name} {version}" if name else str(version)


def build_lineage(*, run: str, flow_run_id: str, flow_run_name: str, platform: str, volume: str, dataset: dict,
                  code: str, parameters: dict, training: dict, evaluation: dict, snapshot: str | None,
                  service_level: dict | None = None) -> dict:
    """One flat, JSON-safe record: everything needed to say where a model came from and to reproduce it."""
    return {
        "run": run,
        "flow_run_id": flow_run_id,
        "flow_run_name": flow_run_name,
        "platform": platform,
        "volume": volume,
        # The dataset's name (``tusimple`` or ``culane``) beside its version: a version is a hash of the data,
        # which says which data but not which benchmark it is.
        "dataset": dataset_name(dataset, evaluation),
        "dataset_version": dataset.get("dataset_version"),
        "dataset_dir": dataset.get("dataset_dir"),
        "artifacts": dataset.get("artifacts"),
        # Where the artifacts came from when the run's source was a dataset index: index, version, published.
        "dataset_release": dataset.get("release"),
        "dataset_counts": {k: dataset.get("counts", {}).get(k) for k in ("read", "kept", "quarantined")},
        "code_version": code,
        "parameters": parameters,
        "training": training,
        "metrics": evaluation,
        "snapshot": snapshot,
        # The storage level the volume trained on, its home level and quota (None where levels do not
        # apply): what a comparison bills the volume at.
        "service_level": service_level,
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _counts(counts: dict) -> str:
    return ", ".join(f"{key} {counts.get(key)}" for key in ("read", "kept", "quarantined"))


def render_lineage_markdown(lineage: dict) -> str:
    """The lineage as markdown (the UI artifact and the CLI print exactly this)."""
    metrics = lineage.get("metrics") or {}
    params = lineage.get("parameters") or {}
    lines = [
        f"# Lineage of `{lineage.get('run')}`",
        "",
        "| | |",
        "|---|---|",
        f"| run | `{lineage.get('run')}` |",
        f"| flow run | {lineage.get('flow_run_name')} (`{lineage.get('flow_run_id')}`) |",
        f"| platform / volume | {lineage.get('platform')} / `{lineage.get('volume')}` |",
        *([f"| dataset | {lineage['dataset']} |"] if lineage.get("dataset") else []),
        f"| dataset version | `{lineage.get('dataset_version')}` |",
        *([f"| dataset index | {release.get('index')}: version `{release.get('version')}` (published "
           f"{release.get('published')}) |"] if (release := lineage.get("dataset_release")) else []),
        *(f"| artifact `{a.get('name')}` ({a.get('kind')}) | sha256 `{a.get('sha256')}` |"
          for a in lineage.get("artifacts") or []),
        *([f"| archive sha256 | `{lineage['archive_sha256']}` |"] if lineage.get("archive_sha256") else []),
        f"| dataset records | {_counts(lineage.get('dataset_counts') or {})} |",
        f"| code version | `{lineage.get('code_version')}` |",
        *([f"| numerics | {_cell(numerics.get('precision'))}, {_cell(numerics.get('memory_format'))}"
           f"{', compiled' if numerics.get('compile') else ''}"
           f"{': ' + _cell(numerics['numerics_reason']) if numerics.get('numerics_reason') else ''} |"]
          if (numerics := (lineage.get("training") or {}).get("numerics")) else []),
        f"| snapshot | `{lineage.get('snapshot') or 'none'}` |",
        "",
        "## Metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {key} | {_cell(value)} |" for key, value in metrics.items()),
        "",
        "## Parameters",
        "",
        "| parameter | value |",
        "|---|---|",
        *(f"| {key} | {_cell(value)} |" for key, value in sorted(params.items())),
    ]
    return "\n".join(lines) + "\n"
