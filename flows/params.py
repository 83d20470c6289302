"""The flows' typed parameters: the Prefect UI renders these pydantic models as forms, and a bad value
fails the flow run at once with an error naming the field, before anything runs."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tasks.names import validate_name
from training.data.prepare import redact_url


class DataSource(BaseModel):
    """Where the TuSimple-format archive comes from; the checksum pins exactly which bytes."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="archive URL: https://, http:// or file:// (mirrors of train_set.zip work)",
                     min_length=1)
    sha256: str = Field(description="sha256 of the archive (64 hex characters)", pattern=r"^[0-9a-fA-F]{64}$")

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not value.startswith(("https://", "http://", "file://")):
            raise ValueError("must start with https://, http:// or file://")
        return value


class TrainParams(BaseModel):
    """One training pipeline run: data, model preset, training knobs, and what to do afterwards."""

    model_config = ConfigDict(extra="forbid")

    source: DataSource
    preset: Literal["cpu-demo", "tusimple"] = Field("cpu-demo", description="model + training preset")
    epochs: int = Field(3, ge=1, le=1000)
    batch_size: int = Field(4, ge=1, le=1024, description="images per worker per step")
    workers: int = Field(2, ge=1, le=512, description="Horovod processes (one per GPU on a cluster)")
    lr: float = Field(0.05, gt=0, le=10, description="base learning rate; the trainer scales it by workers")
    max_steps: int = Field(0, ge=0, description="stop after this many steps (0: run every epoch)")
    loader_workers: int = Field(2, ge=0, le=64, description="DataLoader worker processes per Horovod process")
    eval_split: Literal["val", "test"] = Field("test", description="split the evaluate stage scores")
    snapshot: bool = Field(True, description="capture dataset + run as a snapshot with lineage")
    promote: bool = Field(False, description="move the volume to a faster service level while training")
    images_per_second_per_worker: float = Field(
        200.0, gt=0, description="for choosing the service level: images/s one worker reads (from an earlier run)")
    bytes_per_image: int = Field(262_144, gt=0, description="for choosing the service level: bytes per image read")
    platform: str = Field("local", description="platform block name; 'local' needs no setup")
    volume: str = Field("tusimple", description="volume (folder or PVC) holding datasets and runs")
    timeout_minutes: float = Field(24 * 60, gt=0, description="give up on training after this long")

    @field_validator("volume")
    @classmethod
    def _volume_name(cls, value: str) -> str:
        return validate_name(value, "volume")

    def trainer_settings(self) -> dict[str, str]:
        """The trainer's ``--set`` overrides these parameters stand for."""
        return {"epochs": str(self.epochs), "batch_size": str(self.batch_size), "lr": repr(self.lr),
                "max_steps": str(self.max_steps), "num_workers": str(self.loader_workers), "eval_split": "val"}

    def for_record(self) -> dict[str, Any]:
        """Flat and safe to publish: the source URL loses query strings and credentials."""
        record = self.model_dump()
        source = record.pop("source")
        return {**record, "source_url": redact_url(source["url"]), "source_sha256": source["sha256"]}


def params_from_record(record: dict[str, Any], **changes: Any) -> TrainParams:
    """Rebuild parameters from a lineage record (``for_record``), with ``changes`` on top."""
    fields = {k: v for k, v in record.items() if k in TrainParams.model_fields and k != "source"}
    source = {"url": record["source_url"], "sha256": record["source_sha256"]}
    return TrainParams.model_validate({**fields, "source": source, **changes})


class SweepError(ValueError):
    """A sweep definition that cannot produce valid runs; names the run and the field."""


def expand_sweep(base: TrainParams, grid: dict[str, list[Any]], runs: list[dict[str, Any]]) -> list[TrainParams]:
    """Every parameter set of a sweep: the grid's cartesian product, then the listed runs, each on top of ``base``."""
    sets: list[dict[str, Any]] = []
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid entry '{key}' must be a non-empty list of values")
    keys = sorted(grid)
    sets += [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))] \
        if keys else []
    sets += [dict(run) for run in runs]
    if not sets:
        sets = [{}]
    expanded = []
    for index, changes in enumerate(sets):
        try:
            expanded.append(TrainParams.model_validate({**base.model_dump(), **changes}))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise SweepError(f"sweep run {index} ({changes}) is invalid: {problems}") from None
    return expanded
