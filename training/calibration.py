"""A CPU's numeric candidates timed on the run's own model: the measurement behind ``precision: auto`` on CPUs.

A few training steps of each candidate (precision x memory format) on a fresh copy of the network, with
random data of the run's image size, decide what is fastest on *this* machine — the flags in /proc/cpuinfo
say what the CPU can do, not what oneDNN makes of it for this network. The figures are cached per machine
(CPU model, its kernel-relevant flags, the threads a rank uses, torch's version) and model (its name, its
settings, the batch measured), as JSON under ``$LANEFLOW_CACHE_DIR`` (default ``~/.cache/laneflow``), so a
machine pays for the calibration once per model. A cache that cannot be read or written costs a new
measurement or a warning, never the run. The run's random state is left as it was: a cached and a measured
calibration train the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training.cpu_features import CPUINFO_ENV, CpuFeatures, this_cpu
from training.models.base import LaneModel, ModelSettings
from training.precision import (
    MEMORY_FORMATS,
    PRECISIONS,
    Calibration,
    Combo,
    Device,
    MixedPrecision,
    Numerics,
    label,
    resolve,
    resolve_compile,
)
from training.step import train_step

if TYPE_CHECKING:
    from training.config import TrainConfig

log = logging.getLogger("laneflow.calibration")

#: Images a calibration step trains on: per-image cost is what differs between candidates, and a small batch
#: keeps the calibration of a large preset to seconds.
CALIBRATION_BATCH = 2
WARMUP_STEPS = 1
TIMED_STEPS = 2


def cache_dir() -> Path:
    explicit = os.environ.get("LANEFLOW_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "laneflow"


def calibration_inputs(cpu: CpuFeatures, lane_model: LaneModel, settings: ModelSettings, candidates: list[Combo],
                       batch_size: int) -> dict[str, Any]:
    """What a calibration's figures depend on: its cache key is their digest."""
    # Timings are this machine's even when its CPU is read from $LANEFLOW_CPUINFO: such figures are kept apart.
    override = os.environ.get(CPUINFO_ENV)
    machine = {**cpu.fingerprint(), **({"cpuinfo_from": override} if override else {})}
    return {"machine": machine,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "model": lane_model.name, "settings": json.loads(json.dumps(asdict(settings))),
            "batch": min(batch_size, CALIBRATION_BATCH), "candidates": [label(c) for c in candidates]}


def cache_path(inputs: dict[str, Any], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]
    return (folder or cache_dir()) / "calibration" / f"{inputs['model']}-{digest}.json"


def read_cached(path: Path, inputs: dict[str, Any], candidates: list[Combo]) -> dict[Combo, float] | None:
    """The cached step times for exactly these inputs; None when absent, unreadable or not for these inputs."""
    try:
        record = json.loads(path.read_text())
        seconds = {combo: float(record["seconds_per_step"][label(combo)]) for combo in candidates}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("inputs") != inputs or not all(value > 0 for value in seconds.values()):
        return None
    return seconds


def write_json_atomically(path: Path, record: dict[str, Any]) -> None:
    """A whole file or none: processes writing side by side each replace it with a complete one, the last stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(record, out, indent=2)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_cached(path: Path, inputs: dict[str, Any], seconds: dict[Combo, float]) -> None:
    write_json_atomically(path, {"inputs": inputs, "seconds_per_step": {label(c): s for c, s in seconds.items()},
                                 "measured_at": datetime.now(UTC).isoformat(timespec="seconds")})


def step_seconds(lane_model: LaneModel, settings: ModelSettings, candidates: list[Combo], batch: int,
                 timed: int = TIMED_STEPS,
                 summary: Callable[[list[float]], float] = statistics.median) -> dict[Combo, float]:
    """The median (or ``summary``) time of a training step (uint8 batch in, SGD step out) of a fresh network in each
    candidate: the loop's own step, so the calibration times what training runs (bench/train_step.py times it too,
    taking each candidate's best turn). The candidates take turns step by step, so a load that comes and goes on
    the machine falls on all of them."""
    height, width = settings.input_height, settings.input_width
    images = torch.randint(0, 256, (batch, height, width, 3), dtype=torch.uint8)
    masks = torch.randint(0, 5, (batch, height, width), dtype=torch.uint8)
    exist = torch.randint(0, 2, (batch, 4)).float()
    criterion = lane_model.criterion(settings, check_finite=False)
    runners = {}
    for combo in candidates:
        network = lane_model.network(settings).train()
        runners[combo] = (network, torch.optim.SGD(network.parameters(), lr=1e-3, momentum=0.9),
                          MixedPrecision(combo[0], "cpu"),
                          torch.channels_last if combo[1] == "channels_last" else torch.contiguous_format)
    timings: dict[Combo, list[float]] = {combo: [] for combo in candidates}
    for step in range(WARMUP_STEPS + timed):
        for combo, (network, optimizer, mixed, memory_format) in runners.items():
            started = time.perf_counter()
            train_step(network, images, masks, exist, criterion, optimizer, mixed, memory_format, distributed=False)
            if step >= WARMUP_STEPS:  # the first steps pick kernels and grow the allocator's pools
                timings[combo].append(time.perf_counter() - started)
    return {combo: summary(times) for combo, times in timings.items()}


def calibrate(cpu: CpuFeatures, lane_model: LaneModel, settings: ModelSettings, batch_size: int,
              candidates: list[Combo], folder: Path | None = None) -> Calibration:
    """Each candidate's step time on this machine: cached, or measured now (and cached)."""
    inputs = calibration_inputs(cpu, lane_model, settings, candidates, batch_size)
    path = cache_path(inputs, folder)
    if (cached := read_cached(path, inputs, candidates)) is not None:
        return Calibration(cached, f"cached in {path}")
    log.info("calibrating %s on this CPU (%s): a few training steps of %s, once per machine and model",
             lane_model.name, cpu.model, ", ".join(label(c) for c in candidates))
    with torch.random.fork_rng(devices=[]):  # the run trains from the same random state, calibrated or not
        seconds = step_seconds(lane_model, settings, candidates, inputs["batch"])
    try:
        write_cached(path, inputs, seconds)
        source = f"measured now, cached in {path}"
    except OSError as exc:
        log.warning("could not cache the calibration in %s (%s): the next run measures again; set "
                    "LANEFLOW_CACHE_DIR to a writable folder", path, exc)
        source = "measured now, not cached"
    return Calibration(seconds, source)


def resolve_numerics(config: TrainConfig, lane_model: LaneModel, settings: ModelSettings, device: torch.device,
                     dist: Any, run_dir: Path) -> Numerics:
    """The run's precision, memory format and compilation. In a fixed-size run rank 0 decides (calibrating if it
    must) and every rank uses its choice: one run, one numeric path. An elastic run fixes its choice once, in the run
    directory (``ELASTIC_CHOICE``): a rank that joins later reads it instead of calibrating while the others wait in
    their reset (and a collective here would wait for ranks already training)."""
    compiled, compile_why = resolve_compile(config.compile, device.type, bool(config.elastic))
    cpu = this_cpu()

    def decide() -> Numerics:
        return resolve(config.precision, config.memory_format, Device.of(device, cpu),
                       lambda candidates: calibrate(cpu, lane_model, settings, config.batch_size, candidates))

    if config.elastic:
        numerics = elastic_choice(run_dir / ELASTIC_CHOICE, decide, decides=dist.rank == 0)
    elif dist.size > 1:
        record = dist.hvd.broadcast_object(decide().record() if dist.rank == 0 else None, root_rank=0,
                                           name="numerics")
        numerics = Numerics.from_record(record)
    else:
        numerics = decide()
    return replace(numerics, compile=compiled, reason=f"{numerics.reason}; {compile_why}")


#: An elastic run's numeric choice, beside its checkpoints (JSON, read back checked: never code).
ELASTIC_CHOICE = "numerics.json"
#: How long an elastic rank that is not rank 0 waits for rank 0's choice before making its own.
ELASTIC_CHOICE_WAIT_S = 300.0


def _read_choice(path: Path) -> Numerics | None:
    try:
        record = json.loads(path.read_text())
        numerics = Numerics.from_record(record)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    chosen = (numerics.precision, numerics.memory_format)
    if "auto" in chosen or numerics.precision not in PRECISIONS or numerics.memory_format not in MEMORY_FORMATS:
        return None  # a choice names concrete settings, never "auto" or one this laneflow does not know
    return replace(numerics, reason=f"the run's choice ({path}): {numerics.reason}")


def elastic_choice(path: Path, decide: Callable[[], Numerics], decides: bool,
                   wait_s: float = ELASTIC_CHOICE_WAIT_S) -> Numerics:
    """The elastic run's numerics: the recorded choice when there is one; else rank 0 (``decides``) decides and
    records it, and the other ranks wait for it (deciding themselves only if it never comes)."""
    if (found := _read_choice(path)) is not None:
        return found
    if not decides:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if (found := _read_choice(path)) is not None:
                return found
        log.warning("no numeric choice from rank 0 in %s after %.0f s: deciding on this rank", path, wait_s)
        return decide()
    numerics = decide()
    write_json_atomically(path, numerics.record())
    return numerics
