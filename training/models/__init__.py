"""The lane models laneflow can train, by name: the built-in ones and those other packages register.

A team's own detector is a ``training.models.base.LaneModel`` subclass in its own package, registered in the
entry-point group ``laneflow.models``::

    [project.entry-points."laneflow.models"]
    mynet = "mypackage.lanes:MyNet"

Once that package is installed beside laneflow, ``model=mynet`` trains it (docs: "Add your model").
"""

from __future__ import annotations

import importlib
from dataclasses import is_dataclass
from functools import cache
from importlib.metadata import entry_points

from training.models.base import LaneModel, ModelSettings

__all__ = ["DEFAULT_MODEL", "ENTRY_POINT_GROUP", "LaneModel", "get_model", "model_for", "model_names"]

ENTRY_POINT_GROUP = "laneflow.models"
DEFAULT_MODEL = "scnn"
#: Built-in models: name -> "module:class".
BUILT_IN = {"scnn": "training.models.scnn:SCNNModel", "ufld": "training.models.row_anchor:RowAnchorModel"}


def _registered() -> dict[str, str]:
    """Entry points of the group (a built-in name cannot be taken over by a package)."""
    return {point.name: point.value for point in entry_points(group=ENTRY_POINT_GROUP) if point.name not in BUILT_IN}


def model_names() -> list[str]:
    """Every model a run may choose: the built-in ones first, then the registered ones by name."""
    return [*BUILT_IN, *sorted(_registered())]


@cache
def get_model(name: str) -> LaneModel:
    """The model called ``name``; an unknown name, or a registration that is not a LaneModel, is refused saying
    which models there are."""
    target = BUILT_IN.get(name) or _registered().get(name)
    if target is None:
        raise ValueError(f"unknown model '{name}'; choose one of {', '.join(model_names())} (a model of your own "
                         f"registers in the entry-point group '{ENTRY_POINT_GROUP}')")
    module_name, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model '{name}' is registered as {target}, which cannot be loaded: {exc}") from exc
    model = found() if isinstance(found, type) else found
    if not isinstance(model, LaneModel) or not is_dataclass(model.settings_type) or model.name != name:
        raise ValueError(f"model '{name}' ({target}) is not a training.models.base.LaneModel whose name is "
                         f"'{name}' and whose settings_type is a dataclass")
    if name not in BUILT_IN:  # saved settings name their model by their type (model_for): a type must be one model's
        for built_in in BUILT_IN:
            if get_model(built_in).settings_type is model.settings_type:
                raise ValueError(f"model '{name}' ({target}) uses {built_in}'s settings type "
                                 f"{model.settings_type.__name__}: give it a settings dataclass of its own (a "
                                 f"subclass of {model.settings_type.__name__} keeps its fields), or a checkpoint of "
                                 f"it would load as {built_in}")
    return model


def model_for(settings: ModelSettings) -> LaneModel:
    """The model whose settings these are (the settings' type says which): the model of exactly that type first —
    a team's model whose settings subclass a built-in one's (``class Mine(ModelConfig)``) is its own, not SCNN —
    else one whose settings type it subclasses."""
    models = []
    for name in model_names():
        try:
            models.append(get_model(name))
        except ValueError:  # another package's broken registration is not this model's business
            continue
    for model in [m for m in models if type(settings) is m.settings_type] + \
            [m for m in models if isinstance(settings, m.settings_type)]:
        return model
    raise ValueError(f"no registered model has settings of type {type(settings).__name__}")
