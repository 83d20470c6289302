"""The flows' typed parameters: the Prefect UI renders them as a form, and a bad value fails at once
with an error naming the field, before anything runs.

``TrainParams`` is the one definition of a training run's parameters. The flows take its fields as
their own top-level parameters (``takes_train_params``), because Prefect merges a run's parameters
with its deployment's only at the top level: ``--param lr=0.02`` then changes the learning rate and
keeps the deployment's dataset, which a single nested ``params`` object would have replaced whole.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.model_settings import ModelSettingValue, NoOtherKeys, SettingName, check_model_settings, with_changes
from tasks.dataset_index import check_index_url
from tasks.names import DNS_LABEL, MAX_NAME, validate_name
from tasks.platforms.base import ElasticWorkers
from training.data.redact import redact_url_in_text
from training.data.sources import Artifact


class DatasetArtifact(BaseModel):
    """One downloadable piece of the dataset; the checksum pins exactly which bytes."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="https://, http:// or file:// (mirrors work); stored under its file name",
                     min_length=1)
    sha256: str = Field(description="sha256 of the artifact (64 hex characters)", pattern=r"^[0-9a-fA-F]{64}$")
    kind: Literal["archive", "file", "update"] = Field(
        "archive", description="archive: a zip or tar extracted into the dataset (train_set.zip, test_set.zip); "
                               "file: placed at the dataset's root as it is (test_label.json); update: an archive "
                               "whose files replace the same paths of the others (CULane's annotations_new.tar.gz)")
    query_secret: str | None = Field(
        None, min_length=1, description="name of a Prefect Secret block holding the URL's query string (an Azure "
                                        "SAS token, a presigned URL's signature): read when the run starts, never "
                                        "kept in the run's parameters, which the UI shows and Prefect's database keeps")

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not value.startswith(("https://", "http://", "file://")):
            raise ValueError("must start with https://, http:// or file://")
        return value

    @model_validator(mode="after")
    def _one_query(self) -> DatasetArtifact:
        check_one_query(self.url, self.query_secret, "query_secret")
        return self

    def full_url(self) -> str:
        """The URL to download: with the query string of its Secret block when it names one."""
        return with_secret_query(self.url, self.query_secret, "query_secret of a dataset artifact")


def check_one_query(url: str, secret: str | None, field: str) -> None:
    """A URL's query string lives in the URL or in a Secret block, never both (which one would be meant?)."""
    if secret is not None and "?" in url:
        raise ValueError(f"url {redact_url_in_text(url)!r} has a query string and {field} {secret!r} names "
                         "another: keep the query string in the Secret block only")


def with_secret_query(url: str, secret: str | None, what: str) -> str:
    """``url`` with the query string of the Secret block ``secret`` (read now), or as it is without one."""
    return url if secret is None else f"{url}?{secret_query(secret, what)}"


def secret_query(block: str, what: str = "query_secret of a dataset artifact") -> str:
    """The query string a Prefect Secret block holds (a leading ``?`` dropped); a clear error when there is none."""
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(block).get()
    except ValueError as exc:
        raise ValueError(f"no Prefect Secret block named {block!r} ({what}): create it "
                         "with the URL's query string as its value, e.g. Secret(value='sv=...&sig=...')"
                         f".save({block!r}), or in the UI under Blocks") from exc
    query = str(value).strip().removeprefix("?")
    if not query:
        raise ValueError(f"the Prefect Secret block {block!r} ({what}) is empty: set it to the URL's query string")
    return query


def credentials_in_parameters(source: DataSource) -> list[str]:
    """The artifacts whose URL, as given in the run's parameters, carries a credential (a query string or
    ``user:password@``), redacted: the parameters are kept in Prefect's database and shown in its UI."""
    given = [item.url for item in source.artifacts or []] + ([source.index] if source.index else [])
    return [redact_url_in_text(url) for url in given if redact_url_in_text(url) != url]


class DataSource(BaseModel):
    """The dataset: its artifacts, or a dataset index to take the newest version from.

    TuSimple ships three artifacts: train_set.zip, test_set.zip and test_label.json; a single archive with
    the label files inside (one train_set.zip mirror) is a dataset too. An index (tasks/dataset_index.py)
    is read when the run starts; the run then trains on the artifacts of the newest version it lists, and
    its lineage names the index and the version.
    """

    model_config = ConfigDict(extra="forbid")

    artifacts: Annotated[list[DatasetArtifact], Field(min_length=1)] | None = Field(
        None, description="archives to extract and files to place")
    index: str | None = Field(None, min_length=1,
                              description="or: URL of a dataset index (https://, or file:// for a local one); the "
                                          "run trains on the newest version it lists")
    index_query_secret: str | None = Field(
        None, min_length=1, description="name of a Prefect Secret block holding the index URL's query string (a SAS "
                                        "token): read when the run starts, never kept in the run's parameters")

    @model_validator(mode="before")
    @classmethod
    def _one_archive(cls, value: Any) -> Any:
        """``{"url": ..., "sha256": ...}``, the one-archive form of earlier versions, is one archive artifact."""
        if isinstance(value, dict) and "artifacts" not in value and {"url", "sha256"} & set(value):
            return {"artifacts": [{**value, "kind": "archive"}]}
        return value

    @model_validator(mode="after")
    def _artifacts_or_index(self) -> DataSource:
        if (self.artifacts is None) == (self.index is None):
            raise ValueError("give the dataset's artifacts or an index, not both and not neither")
        if self.index is not None:
            check_index_url(self.index)
            check_one_query(self.index, self.index_query_secret, "index_query_secret")
        elif self.index_query_secret is not None:
            raise ValueError("index_query_secret names the query string of an index: give the index too")
        return self

    def index_url(self) -> str:
        """The index URL to read: with the query string of its Secret block when it names one."""
        if self.index is None:
            raise ValueError("this source lists its artifacts; it has no index")
        return with_secret_query(self.index, self.index_query_secret, "index_query_secret of a dataset source")

    def to_artifacts(self, with_secrets: bool = True) -> list[Artifact]:
        """The artifacts to download; ``with_secrets=False``: their URLs as the parameters hold them (for records,
        which drop query strings anyway), without reading any Secret block."""
        if self.artifacts is None:
            raise ValueError(f"the index source {self.index!r} is read first (tasks.dataset_index.resolve_source)")
        return [Artifact(item.full_url() if with_secrets else item.url, item.sha256.lower(), item.kind)
                for item in self.artifacts]


class TrainParams(BaseModel):
    """One training pipeline run: data, model preset, training knobs, and what to do afterwards."""

    model_config = ConfigDict(extra="forbid")

    source: DataSource = Field(description="the dataset: its artifacts, each a URL, its sha256 and its kind")
    preset: Literal["cpu-demo", "tusimple", "culane"] = Field("cpu-demo", description="model + training preset")
    model: str = Field("scnn", pattern=r"^[a-z][a-z0-9_-]{0,62}$",
                       description="lane model: scnn (SCNN), ufld (row anchors, 5-15x faster inference), or one "
                                   "a package registers in the entry-point group laneflow.models, installed where "
                                   "training runs (docs: Add your model)")
    model_settings: Annotated[dict[SettingName, ModelSettingValue], NoOtherKeys] = Field(
        {}, description="the model's own settings over its preset's (the trainer's "
                                          "model.<name>=value), e.g. {\"cells\": 100, \"backbone\": \"resnet34\"} "
                                          "for ufld; an unknown name or a bad value is refused before anything runs, "
                                          "naming the model's settings; a sweep varies one as model_settings.<name>")
    epochs: int = Field(3, ge=1, le=1000, description="passes over the training split")
    batch_size: int = Field(4, ge=1, le=1024, description="images per worker per step")
    workers: int = Field(2, ge=1, le=512, description="Horovod processes (one per GPU on a cluster)")
    lr: float = Field(0.05, gt=0, le=10, description="base learning rate; the trainer scales it by workers")
    max_steps: int = Field(0, ge=0, description="stop after this many steps (0: run every epoch)")
    eval_every: int = Field(0, ge=0, description="score val every this many steps (0: only at the end); a sweep's "
                                                 "pruner reads these scores")
    loader_workers: int = Field(2, ge=0, le=64, description="DataLoader worker processes per Horovod process")
    eval_split: Literal["val", "test"] = Field("test", description="split the evaluate stage scores")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="the forward pass's precision; auto: the fastest safe one on the machine (bf16 where "
                            "the GPU or CPU does it natively and, on a CPU, a short calibration confirms it)")
    memory_format: Literal["auto", "contiguous", "channels_last"] = Field(
        "auto", description="the activations' layout; auto: channels-last on GPUs, the faster one on a CPU")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="run the network through torch.compile; auto: only where measured faster (not yet: "
                            "off); on is refused with elastic")
    snapshot: bool = Field(True, description="capture dataset + run as a snapshot with lineage")
    package: bool = Field(True, description="export the model as a package (TorchScript, ONNX, contract, lineage)")
    promote: bool = Field(False, description="move the volume to a faster service level while training")
    images_per_second_per_worker: float = Field(
        200.0, gt=0, description="for choosing the service level: images/s one worker reads (from an earlier run)")
    bytes_per_image: int = Field(262_144, gt=0, description="for choosing the service level: bytes per image read")
    platform: str = Field("local", description="platform block name; 'local' needs no setup")
    volume: str = Field("tusimple", description="volume (folder or PVC) holding datasets and runs",
                        pattern=DNS_LABEL.pattern, max_length=MAX_NAME)
    timeout_minutes: float = Field(24 * 60, gt=0, description="give up on training after this long")
    elastic: ElasticWorkers | None = Field(
        None, description="elastic training (spot nodes): keep training when workers are lost and take them back "
                          "when they return, between min_workers and max_workers; it starts once `workers` are there "
                          "and takes every worker there is, up to max_workers")

    @model_validator(mode="after")
    def _model_settings(self) -> TrainParams:
        self.model_settings = check_model_settings(self.model, self.preset, self.model_settings)
        return self

    @model_validator(mode="after")
    def _elastic_start(self) -> TrainParams:
        if self.elastic is not None:
            self.elastic.check_start(self.workers)
            if self.compile == "on":
                raise ValueError("compile='on' cannot be used with elastic: a worker that joins would compile its "
                                 "graph while the others wait; use compile 'auto' or 'off'")
        return self

    @field_validator("volume")
    @classmethod
    def _volume_name(cls, value: str) -> str:
        return validate_name(value, "volume")

    @classmethod
    def from_flow_parameters(cls, parameters: dict[str, Any]) -> TrainParams:
        """The run's parameters from a flow run's (top-level) parameters; other flow parameters ignored."""
        return cls.model_validate({key: value for key, value in parameters.items() if key in cls.model_fields})

    def flow_parameters(self) -> dict[str, Any]:
        """Keyword arguments for a flow decorated with ``takes_train_params``."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def pinned_to(self, artifacts: list[dict[str, Any]]) -> TrainParams:
        """The same run on exactly these artifacts (an index source, once read)."""
        return self.model_copy(update={"source": DataSource(artifacts=artifacts)})

    @property
    def gpus(self) -> int:
        """The GPUs the run trains on, so the ``gpu`` slots it holds: one per Horovod process — an elastic run's
        ``max_workers``, since it takes every worker there is up to that many."""
        return self.elastic.max_workers if self.elastic else self.workers

    def trainer_settings(self) -> dict[str, str]:
        """The trainer's ``--set`` overrides these parameters stand for."""
        return {"epochs": str(self.epochs), "batch_size": str(self.batch_size), "lr": repr(self.lr),
                "max_steps": str(self.max_steps), "num_workers": str(self.loader_workers), "eval_split": "val",
                # only when set: a training image from before eval_every (or models) still takes every other setting
                **({"eval_every": str(self.eval_every)} if self.eval_every else {}),
                **({"model": self.model} if self.model != "scnn" else {}),
                **{f"model.{name}": str(value) for name, value in sorted(self.model_settings.items())},
                **{name: getattr(self, name) for name in ("precision", "memory_format", "compile")
                   if getattr(self, name) != "auto"},
                **({"elastic": "1", "commit_every": str(self.elastic.commit_every),
                    "min_workers": str(self.elastic.min_workers)} if self.elastic else {})}

    def for_record(self) -> dict[str, Any]:
        """Flat and safe to publish: the artifacts' URLs lose query strings and credentials."""
        record = self.model_dump()
        record.pop("source")
        given = zip(self.source.to_artifacts(with_secrets=False), self.source.artifacts or [], strict=True)
        artifacts = [{**{key: value for key, value in artifact.record().items() if key != "name"},
                      **({"query_secret": item.query_secret} if item.query_secret else {})}
                     for artifact, item in given]
        return {**record, "source_artifacts": artifacts}


def params_from_record(record: dict[str, Any], **changes: Any) -> TrainParams:
    """Rebuild parameters from a lineage record (``for_record``; also an earlier version's one-archive
    ``source_url``/``source_sha256``), with ``changes`` on top."""
    fields = {k: v for k, v in record.items() if k in TrainParams.model_fields and k != "source"}
    if "source_artifacts" in record:
        source: dict[str, Any] = {"artifacts": record["source_artifacts"]}
    else:
        source = {"url": record["source_url"], "sha256": record["source_sha256"]}
    return TrainParams.model_validate({**fields, "source": source, **changes})


class SweepError(ValueError):
    """A sweep definition that cannot produce valid runs; names the run and the field."""


def expand_sweep(base: TrainParams, grid: dict[str, list[Any]], runs: list[dict[str, Any]]) -> list[TrainParams]:
    """Every parameter set of a sweep: the grid's cartesian product, then the listed runs, each on top of ``base``;
    a ``model_settings.<name>`` key sets that one model setting."""
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
            expanded.append(TrainParams.model_validate(with_changes(base.model_dump(), changes)))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise SweepError(f"sweep run {index} ({changes}) is invalid: {problems}") from None
    return expanded


Returned = TypeVar("Returned")


def _field_parameter(name: str) -> inspect.Parameter:
    """``TrainParams.<name>`` as a keyword parameter: its type and constraints in the annotation (so
    Prefect's schema and validation see them), its default as the default."""
    info = TrainParams.model_fields[name]
    annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    # A factory's default (model_settings' {}) as its value: the form shows it, a run without it is valid.
    default = inspect.Parameter.empty if info.is_required() else info.get_default(call_default_factory=True)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _with_field_docs(doc: str | None) -> str:
    """``doc`` with the fields' descriptions in its ``Args:`` section: Prefect shows them in the form."""
    lines = [f"    {name}: {info.description}" for name, info in TrainParams.model_fields.items() if info.description]
    text = inspect.cleandoc(doc or "")
    return f"{text}\n" + "\n".join(lines) if "\nArgs:\n" in text else f"{text}\n\nArgs:\n" + "\n".join(lines)


def takes_train_params(fn: Callable[..., Returned]) -> Callable[..., Returned]:
    """Give ``fn(params: TrainParams, *, other...)`` the fields of TrainParams as top-level keyword
    parameters, ahead of its others; ``fn`` still receives one validated ``TrainParams``.

    Apply it under ``@flow``. The flow's signature, schema (the UI form) and validation come from
    TrainParams, so the two never drift apart; a value TrainParams refuses fails the run before any
    task starts, with pydantic's error naming the field.
    """
    own = inspect.signature(fn, eval_str=True)  # real types: the schema is built from this signature
    names = list(own.parameters)
    if not names or names[0] != "params":
        raise TypeError(f"{fn.__name__} must take 'params: TrainParams' as its first parameter")
    others = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in list(own.parameters.values())[1:]]
    clash = {parameter.name for parameter in others} & set(TrainParams.model_fields)
    if clash:
        raise TypeError(f"{fn.__name__}'s parameters {sorted(clash)} clash with fields of TrainParams")

    @functools.wraps(fn)
    def with_fields(**arguments: Any) -> Returned:
        fields = {key: value for key, value in arguments.items() if key in TrainParams.model_fields}
        rest = {key: value for key, value in arguments.items() if key not in TrainParams.model_fields}
        return fn(TrainParams.model_validate(fields), **rest)

    del with_fields.__wrapped__  # inspect.signature must report the fields, not fn's own parameters
    with_fields.__signature__ = own.replace(  # type: ignore[attr-defined]
        parameters=[_field_parameter(name) for name in TrainParams.model_fields] + others)
    with_fields.__doc__ = _with_field_docs(fn.__doc__)
    return with_fields
