"""A run's model settings (``TrainParams.model_settings``): the chosen model's own typed settings (ufld's
``cells``, ``backbone``...), checked against that model before anything runs, and how sweeps name one of them
(``model_settings.<name>`` in a grid, a run or a search space).

The trainer takes them as ``--set model.<name>=value`` (``training.config.parse_overrides``); here they are
checked the same way — the setting must be one the model lets a run override, of its type, and the model's
own settings must accept the value — so a typo fails the flow run at once, naming the setting and the model's
valid ones, instead of a training job minutes later. A model this process cannot load (one a package
registers only in the training image) is checked by the trainer instead.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import GetJsonSchemaHandler, StringConstraints

#: One model setting's value as a run's parameters hold it.
ModelSettingValue = str | int | float | bool
#: How a sweep (grid, runs, search space) names one model setting: ``model_settings.cells``.
PREFIX = "model_settings."
#: What a ``model_settings.<name>`` key's name part may be (a Python identifier, as a dataclass field).
NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
#: A setting's name in ``TrainParams.model_settings``: checked even for a model this process cannot load, as it
#: becomes ``--set model.<name>=...`` on the trainer's command line.
SettingName = Annotated[str, StringConstraints(pattern=rf"^{NAME_PATTERN}$")]


class NoOtherKeys:
    """A mapping's schema refuses keys its pattern does not match (pydantic gives the pattern alone, and the
    server, checking a run's parameters against the deployment's schema, would pass any key)."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        schema = handler(core_schema)
        return {**schema, "additionalProperties": False} if "patternProperties" in schema else schema


def overridable(model: str) -> dict[str, str] | None:
    """The settings ``model`` lets a run override, name -> ``int``, ``float`` or ``str``; None when this process
    cannot load the model (not installed here: the trainer checks its settings)."""
    try:
        from training.models import get_model
    except ImportError:  # no torch where this flow runs: the trainer checks
        return None
    try:
        return get_model(model).overridable_settings()
    except Exception:  # not registered here, or a package whose import fails here: the trainer checks, loudly
        return None


def convert(model: str, name: str, value: Any, kind: str) -> int | float | str:
    """``value`` as a ``kind`` (``int``, ``float``, ``str``); text is read as the trainer reads ``--set`` (a form
    may give ``"32"``). A bool, or a value of another type, is refused naming the setting."""
    problem = f"model setting '{name}' of model '{model}' needs {'an' if kind == 'int' else 'a'} {kind}, got {value!r}"
    if isinstance(value, bool):
        raise ValueError(problem)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(problem)
        return value
    if isinstance(value, str):
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            raise ValueError(problem) from None
    if kind == "int":
        if not isinstance(value, int):
            raise ValueError(problem)
        return value
    if isinstance(value, int | float):
        return float(value)
    raise ValueError(problem)


def check_model_settings(model: str, preset: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` converted to their types, or ValueError naming the first unknown or bad one and the model's
    valid settings. The model's settings are built from ``preset`` with them, so the model's own checks (a
    backbone it has, an input size its stride divides) run too. Unchecked when the model is not known here."""
    if not settings:
        return {}
    kinds = overridable(model)
    if kinds is None:
        return dict(settings)
    valid = ", ".join(f"{key} ({kind})" for key, kind in sorted(kinds.items()))
    for name in settings:
        if name not in kinds:
            raise ValueError(f"model '{model}' has no setting '{name}'; its settings: {valid}")
    typed = {name: convert(model, name, value, kinds[name]) for name, value in settings.items()}
    from training.models import get_model

    try:
        get_model(model).settings(preset, **typed)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model '{model}' refuses model_settings {typed}: {exc}") from None
    return typed


def is_setting_key(key: str) -> bool:
    """Whether a sweep's key names a model setting (``model_settings.<name>``)."""
    return key.startswith(PREFIX) and len(key) > len(PREFIX)


def with_changes(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a ``TrainParams.model_dump()``) with a sweep trial's ``changes`` on top: ``model_settings.<name>``
    keys set that one setting, over the base's own ``model_settings``."""
    fields = {key: value for key, value in changes.items() if not is_setting_key(key)}
    settings = {key[len(PREFIX):]: value for key, value in changes.items() if is_setting_key(key)}
    merged = {**base, **fields}
    if settings:
        merged["model_settings"] = {**(merged.get("model_settings") or {}), **settings}
    return merged


def flat(dumped: dict[str, Any]) -> dict[str, Any]:
    """A ``TrainParams.model_dump()`` as a sweep names its values: each model setting as its own
    ``model_settings.<name>`` key instead of the one dict."""
    settings = dumped.get("model_settings") or {}
    return {**{key: value for key, value in dumped.items() if key != "model_settings"},
            **{f"{PREFIX}{name}": value for name, value in sorted(settings.items())}}
