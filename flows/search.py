"""What a searching sweep searches (issue 20): a ``space`` naming ``TrainParams`` fields, each a range or a
set of choices, checked against the field's own type and limits before anything trains (pure).

    {"lr": {"low": 0.001, "high": 0.3, "log": true}, "batch_size": {"choices": [2, 4, 8]},
     "epochs": {"low": 1, "high": 5, "step": 1}}

A range fits a number field (an integer field takes whole bounds and steps); choices fit any searchable
field and are each validated as a value of it (strictly: ``"4"`` is not a batch size). Fields that say
where or what a run trains on rather than how (the dataset, platform, volume, the split scored, what is
kept afterwards) are not searched: a trial that changes them is not comparable with the others.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from flows.params import TrainParams

#: Fields a sweep never searches: each trial must train on the same data, be scored the same way and keep the
#: same things.
NOT_SEARCHABLE = ("source", "platform", "volume", "eval_split", "eval_every", "snapshot", "package", "promote",
                  "timeout_minutes", "images_per_second_per_worker", "bytes_per_image")


class SearchSpaceError(ValueError):
    """A ``space`` that cannot be searched; the message names the key and what to change."""


class SearchRange(BaseModel):
    """Numbers from ``low`` to ``high`` (both included), on a log scale or in steps of ``step``."""

    model_config = ConfigDict(extra="forbid")

    low: float = Field(description="smallest value")
    high: float = Field(description="largest value")
    log: bool = Field(False, description="sample on a log scale (low must be above 0)")
    step: float | None = Field(None, gt=0, description="values low, low + step, ... (not with log)")


class SearchChoices(BaseModel):
    """One of the listed values."""

    model_config = ConfigDict(extra="forbid")

    choices: list[Any] = Field(min_length=1, description="the values to choose from")


def searchable_fields() -> list[str]:
    return [name for name in TrainParams.model_fields if name not in NOT_SEARCHABLE]


SearchDimension = SearchRange | SearchChoices
#: A searchable field's name: as a Literal, the deployment's schema refuses any other key when a run is created.
SearchableField = Literal[tuple(searchable_fields())]  # type: ignore[valid-type]
SearchSpace = dict[SearchableField, SearchDimension]  # type: ignore[valid-type]
SearchStrategy = Literal["grid", "random", "tpe"]


def _field_adapter(name: str) -> TypeAdapter:
    info = TrainParams.model_fields[name]
    annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return TypeAdapter(annotation)


def _number_kind(name: str) -> type | None:
    annotation = TrainParams.model_fields[name].annotation
    if annotation is bool or typing.get_origin(annotation) is Literal:
        return None
    return annotation if annotation in (int, float) else None


def _limits_error(exc: ValidationError) -> str:
    return "; ".join(error["msg"] for error in exc.errors())


def check_space(space: dict[str, Any]) -> dict[str, SearchDimension]:
    """``space`` as dimensions, or ``SearchSpaceError`` naming the first key that cannot be searched."""
    if not space:
        raise SearchSpaceError("space is empty: name the TrainParams fields to search, e.g. "
                               '{"lr": {"low": 0.001, "high": 0.3, "log": true}}')
    dimensions: dict[str, SearchDimension] = {}
    for key, raw in space.items():
        where = f"space[{key!r}]"
        if key not in TrainParams.model_fields:
            raise SearchSpaceError(f"{where}: TrainParams has no field {key!r}; searchable: "
                                   + ", ".join(searchable_fields()))
        if key in NOT_SEARCHABLE:
            raise SearchSpaceError(f"{where}: {key} is the same for every trial of a sweep (set it on the sweep "
                                   "itself); searchable: " + ", ".join(searchable_fields()))
        dimension = _parse(where, raw)
        adapter = _field_adapter(key)
        if isinstance(dimension, SearchRange):
            _check_range(where, key, dimension, adapter)
        else:
            for value in dimension.choices:
                try:
                    adapter.validate_python(value, strict=True)
                except ValidationError as exc:
                    raise SearchSpaceError(f"{where}: choice {value!r} is not a valid {key}: "
                                           f"{_limits_error(exc)}") from None
            if any(a == b for i, a in enumerate(dimension.choices) for b in dimension.choices[i + 1:]):
                raise SearchSpaceError(f"{where}: the choices repeat a value")
        dimensions[key] = dimension
    return dimensions


def _parse(where: str, raw: Any) -> SearchDimension:
    if isinstance(raw, SearchRange | SearchChoices):
        return raw
    if not isinstance(raw, dict):
        raise SearchSpaceError(f'{where}: expected a range {{"low": ..., "high": ...}} or {{"choices": [...]}}, '
                               f"got {raw!r}")
    model = SearchChoices if "choices" in raw else SearchRange
    try:
        return model.model_validate(raw, strict=True)  # "0.001" or true is not a bound
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        raise SearchSpaceError(f"{where}: {problems}") from None


def _check_range(where: str, key: str, dimension: SearchRange, adapter: TypeAdapter) -> None:
    kind = _number_kind(key)
    if kind is None:
        raise SearchSpaceError(f"{where}: {key} is not a number: give its values as choices, not a range")
    low, high, step = dimension.low, dimension.high, dimension.step
    if not (math.isfinite(low) and math.isfinite(high)):
        raise SearchSpaceError(f"{where}: low and high must be finite numbers")
    if low >= high:
        raise SearchSpaceError(f"{where}: low ({low:g}) must be below high ({high:g})")
    if dimension.log and low <= 0:
        raise SearchSpaceError(f"{where}: a log range must stay above 0 (low is {low:g})")
    if dimension.log and step is not None:
        raise SearchSpaceError(f"{where}: give log or step, not both (a log range has no fixed step)")
    if kind is int and not all(float(v).is_integer() for v in (low, high, step or 1)):
        raise SearchSpaceError(f"{where}: {key} is a whole number: low, high and step must be whole numbers")
    if step is not None and step > high - low:
        raise SearchSpaceError(f"{where}: step ({step:g}) is larger than the range ({low:g} to {high:g})")
    for name, bound in (("low", low), ("high", high)):
        try:
            adapter.validate_python(int(bound) if kind is int else bound)
        except ValidationError as exc:
            raise SearchSpaceError(f"{where}: {name} {bound:g} is outside what {key} allows: "
                                   f"{_limits_error(exc)}") from None


def distributions(dimensions: dict[str, SearchDimension]) -> dict[str, Any]:
    """The dimensions as Optuna distributions (for ``study.ask``)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    found: dict[str, Any] = {}
    for key, dimension in dimensions.items():
        if isinstance(dimension, SearchChoices):
            found[key] = CategoricalDistribution(dimension.choices)
        elif _number_kind(key) is int:
            found[key] = IntDistribution(int(dimension.low), int(dimension.high), log=dimension.log,
                                         step=int(dimension.step or 1))
        else:
            found[key] = FloatDistribution(dimension.low, dimension.high, log=dimension.log, step=dimension.step)
    return found
