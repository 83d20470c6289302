"""What a searching sweep searches (issue 20): a ``space`` naming ``TrainParams`` fields, each a range or a
set of choices, checked against the field's own type and limits before anything trains (pure).

    {"lr": {"low": 0.001, "high": 0.3, "log": true}, "batch_size": {"choices": [2, 4, 8]},
     "epochs": {"low": 1, "high": 5, "step": 1}}

A range fits a number field (an integer field takes whole bounds and steps); choices fit any searchable
field and are each validated as a value of it (strictly: ``"4"`` is not a batch size). Fields that say
where or what a run trains on rather than how (the dataset, platform, volume, the split scored, what is
kept afterwards) are not searched: a trial that changes them is not comparable with the others.

A model's own setting is searched as ``model_settings.<name>`` (``{"model_settings.cells": {"low": 25,
"high": 100, "step": 25}}``), checked against the model of every trial: the base run's, or each of the
``model`` choices when the space searches the model too (the setting must then be one of each of them).
"""

from __future__ import annotations

import math
import typing
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from flows.model_settings import (
    NAME_PATTERN,
    PREFIX,
    NoOtherKeys,
    check_model_settings,
    is_setting_key,
    overridable,
)
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
    """TrainParams fields a space may name (the model's settings are searched one by one: ``model_settings.<name>``)."""
    return [name for name in TrainParams.model_fields if name not in NOT_SEARCHABLE and name != "model_settings"]


SearchDimension = SearchRange | SearchChoices
#: A space's key: a searchable field, or one of the model's own settings (checked against the model by
#: ``check_space``). One pattern (a union of key types leaves the schema no rule on keys at all): with
#: ``NoOtherKeys`` the deployment's schema refuses any other key when a run is created.
SearchKey = Annotated[str, StringConstraints(
    pattern=rf"^(?:{'|'.join(searchable_fields())}|{PREFIX.replace('.', '[.]')}{NAME_PATTERN})$")]


SearchSpace = Annotated[dict[SearchKey, SearchDimension], NoOtherKeys]
SearchStrategy = Literal["grid", "random", "tpe"]


def _field_adapter(name: str) -> TypeAdapter:
    info = TrainParams.model_fields[name]
    annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return TypeAdapter(annotation)


def _trial_models(space: dict[str, Any], base: TrainParams | None) -> list[str]:
    """The models the trials may train: the space's ``model`` choices, else the base run's."""
    dimension = space.get("model")
    choices = dimension.choices if isinstance(dimension, SearchChoices) else \
        dimension.get("choices") if isinstance(dimension, dict) else None
    if isinstance(choices, list) and choices and all(isinstance(choice, str) for choice in choices):
        return list(choices)
    return [base.model if base is not None else TrainParams.model_fields["model"].default]


def _unknown_kind(dimension: SearchDimension) -> str | None:
    """The type of a setting no model here knows, as its range gives it: whole bounds with a whole step make an
    ``int``, any other range a ``float`` (a range's bounds are numbers: 0.0..1.0 and 0..1 read alike); choices name no
    type (the trainer checks them)."""
    if not isinstance(dimension, SearchRange):
        return None
    if dimension.step is None or dimension.log:  # 0.0..1.0 reads as whole numbers: only a whole step says int
        return "float"
    numbers = [dimension.low, dimension.high, dimension.step]
    return "int" if all(float(number).is_integer() for number in numbers) else "float"


def _setting_kind(where: str, key: str, models: list[str], dimension: SearchDimension) -> str | None:
    """A model setting's type (``int``, ``float``, ``str``), the same in every model of ``models`` that this process
    knows; when it knows none of them (a model installed only in the training image: the trainer checks), the
    type ``dimension``'s range gives. A setting one of them lacks is refused."""
    name, kinds = key[len(PREFIX):], set()
    for model in models:
        known = overridable(model)
        if known is None:
            continue
        if name not in known:
            raise SearchSpaceError(f"{where}: model '{model}' has no setting '{name}'; its settings: "
                                   + ", ".join(sorted(known)))
        kinds.add(known[name])
    if len(kinds) > 1:
        raise SearchSpaceError(f"{where}: '{name}' is a setting of other types in models {', '.join(models)}")
    return kinds.pop() if kinds else _unknown_kind(dimension)


def _check_setting_value(where: str, key: str, value: Any, kind: str | None, models: list[str],
                         base: TrainParams | None) -> None:
    """One value a model setting may take: of its type (strictly), and accepted by each model."""
    name = key[len(PREFIX):]
    strict = {"int": int, "float": int | float, "str": str}.get(kind or "")
    if isinstance(value, bool) or (strict is not None and not isinstance(value, strict)):
        raise SearchSpaceError(f"{where}: {value!r} is not a valid {name}: it is {'an' if kind == 'int' else 'a'} "
                               f"{kind} setting")
    preset = base.preset if base is not None else "cpu-demo"
    for model in models:
        try:
            check_model_settings(model, preset, {**(base.model_settings if base else {}), name: value})
        except ValueError as exc:
            raise SearchSpaceError(f"{where}: {value!r} is not a valid {name}: {exc}") from None


def _check_setting(where: str, key: str, dimension: SearchDimension, space: dict[str, Any],
                   base: TrainParams | None) -> None:
    models = _trial_models(space, base)
    kind = _setting_kind(where, key, models, dimension)
    if isinstance(dimension, SearchChoices):
        values = dimension.choices
    else:
        if kind not in ("int", "float"):
            raise SearchSpaceError(f"{where}: {key[len(PREFIX):]} is not a number setting of "
                                   f"{', '.join(models)}: give its values as choices, not a range")
        _check_bounds(where, key, dimension, int if kind == "int" else float)
        values = _range_values(dimension, kind)
    for value in values:
        _check_setting_value(where, key, value, kind, models, base)


#: A stepped range of a model setting is checked value by value up to this many values (a model may refuse values
#: between its bounds: an input size its stride does not divide); beyond, its bounds only.
MAX_CHECKED_VALUES = 1000


def _range_values(dimension: SearchRange, kind: str) -> list[int | float]:
    """The values of a range a model must accept: each step's when the range has steps (few enough), else its
    bounds."""
    low, high = (int(dimension.low), int(dimension.high)) if kind == "int" else (dimension.low, dimension.high)
    step = dimension.step if dimension.step is not None else (1 if kind == "int" and not dimension.log else None)
    if step is None:
        return [low, high]
    # As Optuna steps a range: low + k * step up to high, in decimal (0.1 + 0.2 is 0.3 here, as in its grid).
    first, stride = Decimal(str(low)), Decimal(str(step))
    count = int((Decimal(str(high)) - first) // stride) + 1
    picks = range(count) if count <= MAX_CHECKED_VALUES else (0, count - 1)
    values = [first + i * stride for i in picks]
    return [int(value) if kind == "int" else float(value) for value in values]


def _number_kind(name: str, kind: str | None = None) -> type | None:
    if is_setting_key(name):
        return {"int": int, "float": float}.get(kind or "")
    annotation = TrainParams.model_fields[name].annotation
    if annotation is bool or typing.get_origin(annotation) is Literal:
        return None
    return annotation if annotation in (int, float) else None


def _limits_error(exc: ValidationError) -> str:
    return "; ".join(error["msg"] for error in exc.errors())


def check_space(space: dict[str, Any], base: TrainParams | None = None) -> dict[str, SearchDimension]:
    """``space`` as dimensions, or ``SearchSpaceError`` naming the first key that cannot be searched; model
    settings are checked against the models of ``base`` (the sweep's base run) or of the space's ``model``."""
    if not space:
        raise SearchSpaceError("space is empty: name the TrainParams fields to search, e.g. "
                               '{"lr": {"low": 0.001, "high": 0.3, "log": true}}')
    dimensions: dict[str, SearchDimension] = {}
    for key, raw in space.items():
        where = f"space[{key!r}]"
        if is_setting_key(key):
            dimensions[key] = _parse(where, raw)
            _check_setting(where, key, dimensions[key], space, base)
            continue
        if key == "model_settings":
            raise SearchSpaceError(f"{where}: search the model's settings one by one, as {PREFIX}<name> (e.g. "
                                   f"{PREFIX}cells for ufld)")
        if key not in TrainParams.model_fields:
            raise SearchSpaceError(f"{where}: TrainParams has no field {key!r}; searchable: "
                                   + ", ".join(searchable_fields()) + f", {PREFIX}<name> (a setting of the model)")
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
    _check_base_settings_per_model(dimensions, base)
    return dimensions


def _check_base_settings_per_model(dimensions: dict[str, SearchDimension], base: TrainParams | None) -> None:
    """A space choosing the model keeps the base run's model settings for every trial: each model chosen must take
    them (a trial of another model would otherwise be refused only once Optuna asked for it)."""
    choices = dimensions.get("model")
    if base is None or not base.model_settings or not isinstance(choices, SearchChoices):
        return
    searched = {key[len(PREFIX):] for key in dimensions if is_setting_key(key)}
    settings = {name: value for name, value in base.model_settings.items() if name not in searched}
    for model in choices.choices:
        try:
            check_model_settings(model, base.preset, settings)
        except ValueError as exc:
            raise SearchSpaceError(f"space['model']: choice {model!r} cannot take the base run's model_settings "
                                   f"{settings}: {exc}; give the setting in the space, or sweep the models as "
                                   "listed runs") from None


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
    _check_bounds(where, key, dimension, kind)
    for name, bound in (("low", dimension.low), ("high", dimension.high)):
        try:
            adapter.validate_python(int(bound) if kind is int else bound)
        except ValidationError as exc:
            raise SearchSpaceError(f"{where}: {name} {bound:g} is outside what {key} allows: "
                                   f"{_limits_error(exc)}") from None


def _check_bounds(where: str, key: str, dimension: SearchRange, kind: type) -> None:
    """A range's own sense: finite, low below high, log above 0 and without a step, whole for a whole number."""
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


def distributions(dimensions: dict[str, SearchDimension], base: TrainParams | None = None) -> dict[str, Any]:
    """The dimensions (``check_space``'s, over the same ``base``) as Optuna distributions (for ``study.ask``)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    found: dict[str, Any] = {}
    for key, dimension in dimensions.items():
        kind = _setting_kind(f"space[{key!r}]", key, _trial_models(dimensions, base), dimension) \
            if is_setting_key(key) else None
        if isinstance(dimension, SearchChoices):
            found[key] = CategoricalDistribution(dimension.choices)
        elif _number_kind(key, kind) is int:
            found[key] = IntDistribution(int(dimension.low), int(dimension.high), log=dimension.log,
                                         step=int(dimension.step or 1))
        else:
            found[key] = FloatDistribution(dimension.low, dimension.high, log=dimension.log, step=dimension.step)
    return found
