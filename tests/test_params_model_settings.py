"""A run's model settings (``TrainParams.model_settings``): checked against the chosen model before anything runs,
given to the trainer the same way on both platforms, kept in the record, and varied by sweeps as
``model_settings.<name>`` (grids, listed runs and search spaces)."""

from __future__ import annotations

import json
import shlex

import optuna
import pytest
from prefect.utilities.schema_tools.validation import ValidationError as SchemaRefusal
from prefect.utilities.schema_tools.validation import validate
from pydantic import TypeAdapter, ValidationError

from flows.params import SweepError, TrainParams, expand_sweep, params_from_record
from flows.search import SearchSpace, SearchSpaceError, check_space, distributions
from flows.study import SweepStudy, _check_same_study
from flows.sweep import sweep
from tasks.k8s.manifests import ClusterLayout, render_mpijob
from tasks.launch import horovodrun_command
from tasks.platforms.base import TrainingSpec, VolumeRef
from tests.unit_helpers import source
from training.config import parse_overrides
from training.models import get_model


def ufld(**changes: object) -> TrainParams:
    return TrainParams(source=source(), model="ufld", **changes)


def test_model_settings_are_typed_and_a_bad_one_is_refused_naming_the_model_and_its_settings() -> None:
    params = ufld(model_settings={"cells": "32", "backbone": "resnet34", "similarity_weight": 0})
    assert params.model_settings == {"cells": 32, "backbone": "resnet34", "similarity_weight": 0.0}
    refused = {
        "unknown": ({"cellz": 32}, r"model 'ufld' has no setting 'cellz'; its settings: .*backbone \(str\), "
                                   r"cells \(int\)"),
        "bool for an int": ({"cells": True}, r"model setting 'cells' of model 'ufld' needs an int, got True"),
        "fraction for an int": ({"cells": 1.5}, "needs an int, got 1.5"),
        "text that is no number": ({"hidden": "wide"}, "model setting 'hidden' of model 'ufld' needs an int"),
        "number for text": ({"backbone": 34}, "model setting 'backbone' of model 'ufld' needs a str"),
        "the model refuses it": ({"backbone": "resnet50"}, "unknown backbone 'resnet50'; choose one of resnet18, "
                                                           "resnet34"),
        "size off the stride": ({"input_width": 100}, "must be a multiple of 32"),
    }
    for case, (settings, message) in refused.items():
        with pytest.raises(ValidationError, match=message):
            ufld(model_settings=settings)
            pytest.fail(f"{case}: accepted")
    # A setting of one model is not one of another's.
    with pytest.raises(ValidationError, match=r"model 'scnn' has no setting 'cells'; its settings: .*mp_kernel"):
        TrainParams(source=source(), model_settings={"cells": 32})
    # A model this process cannot load (registered only where training runs) is left to the trainer to check.
    assert TrainParams(source=source(), model="elsewhere", model_settings={"depth": 3}).model_settings == {"depth": 3}


def test_model_settings_reach_the_trainer_the_same_on_both_platforms_and_stay_in_the_record() -> None:
    params = ufld(model_settings={"cells": 32, "backbone": "resnet34", "aux_weight": 0.5})
    settings = params.trainer_settings()
    assert {key: value for key, value in settings.items() if key.startswith("model.")} == {
        "model.aux_weight": "0.5", "model.backbone": "resnet34", "model.cells": "32"}
    spec = TrainingSpec(job_name="train-1", volume=VolumeRef(name="v", location="/v"),
                        data_dir="datasets/x", run_dir="runs/train-1", preset=params.preset, workers=2,
                        settings=settings)
    local = horovodrun_command("horovodrun", "python", spec, "/data", "/run")
    layout = ClusterLayout(namespace="lanes", image="train:1", data_image="data:1", storage_class="anf",
                           snapshot_class="snap")
    job = render_mpijob("train-1", layout, "data", params.preset, 2, "datasets/x", "runs/train-1", settings, {})
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    cluster = " ".join([*launcher.get("command", []), *launcher.get("args", [])])
    for argv in (local, shlex.split(cluster)):
        pairs = [argv[index + 1] for index, arg in enumerate(argv) if arg == "--set"]
        assert {"model=ufld", "model.cells=32", "model.backbone=resnet34", "model.aux_weight=0.5"} <= set(pairs)
        # What the trainer makes of them: the same settings, so the network it builds has them.
        config = parse_overrides(params.preset, pairs)
        trained = get_model(config.model).settings(config.preset, **config.model_overrides)
        assert (trained.cells, trained.backbone, trained.aux_weight) == (32, "resnet34", 0.5)
    again = params_from_record(params.for_record())
    assert again.model_settings == params.model_settings
    before = {key: value for key, value in params.for_record().items() if key != "model_settings"}
    assert params_from_record(before).model_settings == {}  # a record from before model settings


def test_a_grid_or_a_run_varies_one_model_setting_by_its_dotted_name() -> None:
    base = ufld(model_settings={"backbone": "resnet34"})
    sets = expand_sweep(base, {"model_settings.cells": [20, 40]}, [{"model": "scnn", "model_settings": {}}])
    assert [(p.model, p.model_settings) for p in sets] == [
        ("ufld", {"backbone": "resnet34", "cells": 20}), ("ufld", {"backbone": "resnet34", "cells": 40}),
        ("scnn", {})]
    with pytest.raises(SweepError, match=r"sweep run 1 .*model 'ufld' has no setting 'cellz'"):
        expand_sweep(base, {}, [{"model_settings.cells": 20}, {"model_settings.cellz": 20}])
    # scnn has no cells: a grid that gives them to it says so.
    with pytest.raises(SweepError, match=r"sweep run 0 .*model 'scnn' has no setting 'cells'"):
        expand_sweep(TrainParams(source=source()), {"model": ["scnn", "ufld"], "model_settings.cells": [20]}, [])


def test_a_search_space_searches_a_model_setting_checked_against_the_trials_models() -> None:
    base = ufld()
    dimensions = check_space({"model_settings.cells": {"low": 20, "high": 60, "step": 20},
                              "model_settings.similarity_weight": {"low": 0.0, "high": 1.0},
                              "model_settings.backbone": {"choices": ["resnet18", "resnet34"]}}, base)
    found = distributions(dimensions, base)
    assert type(found["model_settings.cells"]).__name__ == "IntDistribution"
    assert (found["model_settings.cells"].low, found["model_settings.cells"].step) == (20, 20)
    assert type(found["model_settings.similarity_weight"]).__name__ == "FloatDistribution"
    assert found["model_settings.backbone"].choices == ("resnet18", "resnet34")
    # What a trial asked of that space trains with.
    asked = expand_sweep(base, {}, [{"model_settings.cells": 40, "model_settings.backbone": "resnet34"}])[0]
    assert asked.trainer_settings()["model.cells"] == "40" and asked.model_settings["backbone"] == "resnet34"
    refused = {
        "unknown": ({"model_settings.cellz": {"choices": [1, 2]}}, base, r"model 'ufld' has no setting 'cellz'"),
        "text for an int": ({"model_settings.cells": {"choices": [20, "40"]}}, base,
                            r"'40' is not a valid cells: it is an int setting"),
        "past what the model takes": ({"model_settings.cells": {"low": 1, "high": 5}}, base,
                                      r"1 is not a valid cells: .*must be at least 2"),
        "range of text": ({"model_settings.backbone": {"low": 1, "high": 2}}, base,
                          "backbone is not a number setting of ufld: give its values as choices"),
        "a model without it": ({"model": {"choices": ["scnn", "ufld"]}, "model_settings.cells": {"choices": [20]}},
                               base, r"model 'scnn' has no setting 'cells'"),
        "the whole dict": ({"model_settings": {"choices": [{"cells": 20}]}}, base,
                           r"search the model's settings one by one, as model_settings.<name>"),
    }
    for case, (space, params, message) in refused.items():
        with pytest.raises(SearchSpaceError, match=message):
            check_space(space, params)
            pytest.fail(f"{case}: accepted")
    # The sweep flow's parameters take a model setting's dotted name, and no other unknown key: in Python and in
    # the deployment's schema, which the server checks a run's parameters against when the run is created.
    adapter = TypeAdapter(SearchSpace)
    assert "model_settings.cells" in adapter.validate_python({"model_settings.cells": {"choices": [20]}})
    with pytest.raises(ValidationError):
        adapter.validate_python({"model_settingscells": {"choices": [20]}})
    schema = sweep.parameters.model_dump_for_openapi()
    form = {"source": json.loads(source().model_dump_json())}
    validate({**form, "space": {"model_settings.cells": {"choices": [20]}, "lr": {"low": 0.1, "high": 0.2}}},
             schema, raise_on_error=True, ignore_required=True)
    for key in ("model_settingscells", "learning_rate", "volume"):
        with pytest.raises(SchemaRefusal, match=f"'{key}' does not match any of the regexes"):
            validate({**form, "space": {key: {"choices": [20]}}}, schema, raise_on_error=True, ignore_required=True)


def test_a_study_kept_before_model_settings_existed_continues() -> None:
    study = optuna.create_study(study_name="kept", direction="maximize")
    params = TrainParams(source=source())
    space = {"lr": optuna.distributions.FloatDistribution(0.01, 0.1)}
    _check_same_study(study, "kept", space, params)
    recorded = {key: value for key, value in study.user_attrs["base"].items() if key != "model_settings"}
    study.set_user_attr("base", recorded)  # as a study's first sweep recorded it before model settings
    _check_same_study(study, "kept", space, params)
    with pytest.raises(ValueError, match="was run with other model_settings"):
        _check_same_study(study, "kept", space, TrainParams(source=source(), model_settings={"mp_kernel": 3}))


def test_a_searched_trial_trains_with_the_model_setting_optuna_asked_for() -> None:
    base = ufld(model_settings={"backbone": "resnet34"})
    dimensions = check_space({"model_settings.cells": {"low": 20, "high": 60, "step": 20}, "lr": {"choices": [0.1]}},
                             base)
    study = SweepStudy.of_sweep("0123456789abcdef0123456789abcdef", distributions(dimensions, base), base)
    study.search_with("random", 3, trials=4, max_concurrent=1, pruner=optuna.pruners.NopPruner())
    asked = [study.ask() for _ in range(4)]
    for trial in asked:
        cells = trial.optuna_trial.params["model_settings.cells"]
        assert cells in (20, 40, 60) and trial.params.model_settings == {"backbone": "resnet34", "cells": cells}
        assert trial.params.trainer_settings()["model.cells"] == str(cells) and trial.params.eval_split == "val"


def test_a_space_is_refused_up_front_where_a_trial_would_be_refused_once_asked() -> None:
    """What Optuna may ask must be a run: the base's settings under every model the space chooses, and every step
    of a stepped range (a model may refuse values between its bounds); a model this process cannot load (a package
    installed only in the training image) is searched by the range's own type, and its trainer checks the values."""
    with pytest.raises(SearchSpaceError, match=r"choice 'scnn' cannot take the base run's model_settings "
                                               r"\{'backbone': 'resnet34'\}: model 'scnn' has no setting 'backbone'"):
        check_space({"model": {"choices": ["scnn", "ufld"]}}, ufld(model_settings={"backbone": "resnet34"}))
    check_space({"model": {"choices": ["scnn", "ufld"]}}, ufld())  # no base settings: nothing to carry over
    with pytest.raises(SearchSpaceError, match=r"272 is not a valid input_width: .*multiple of 32"):
        check_space({"model_settings.input_width": {"low": 256, "high": 512, "step": 16}}, ufld())
    check_space({"model_settings.input_width": {"low": 256, "high": 512, "step": 32}}, ufld())
    elsewhere = TrainParams(source=source(), model="a-model-of-the-training-image")
    found = distributions(check_space({"model_settings.channels": {"low": 4, "high": 16, "step": 4},
                                       "model_settings.weight": {"low": 0.0, "high": 1.0},
                                       "model_settings.rate": {"low": 1, "high": 4, "log": True}}, elsewhere),
                          elsewhere)
    assert type(found["model_settings.channels"]).__name__ == "IntDistribution"  # a whole step says int
    # 0.0..1.0 reads as 0..1 (a range's bounds are numbers): without a whole step it is searched as a float
    assert type(found["model_settings.weight"]).__name__ == "FloatDistribution"
    assert type(found["model_settings.rate"]).__name__ == "FloatDistribution"


def test_a_stepped_ranges_values_are_the_ones_optuna_samples() -> None:
    from flows.search import SearchRange, _range_values

    assert _range_values(SearchRange(low=0.1, high=0.3, step=0.1), "float") == [0.1, 0.2, 0.3]
    assert _range_values(SearchRange(low=0.0, high=1.0, step=0.3), "float") == [0.0, 0.3, 0.6, 0.9]
    assert _range_values(SearchRange(low=256, high=100_010, step=32), "int") == [256, 100_000]  # ends only


def test_a_trial_no_run_may_have_is_told_failed_and_the_next_one_asked() -> None:
    """A combination ``check_space`` cannot see (distributions given straight to the study): the trial is failed
    with the reason, never trained nor resumed, and the study asks again; a space that gives nothing else stops
    the sweep naming the reason."""
    base = ufld()
    mixed = {"model_settings.cells": optuna.distributions.IntDistribution(1, 2)}  # cells 1 is refused
    study = SweepStudy.of_sweep("0123456789abcdef0123456789abcdef", mixed, base)
    study.search_with("random", 3, trials=2, max_concurrent=1, pruner=optuna.pruners.NopPruner())
    study.optuna_study.enqueue_trial({"model_settings.cells": 1})  # what Optuna asks first
    assert study.ask().params.model_settings["cells"] == 2
    refused = [t for t in study.optuna_study.get_trials(deepcopy=False) if "refused" in t.user_attrs]
    assert refused and all(t.state == optuna.trial.TrialState.FAIL and t.params["model_settings.cells"] == 1
                           for t in refused), refused
    assert "at least 2" in refused[0].user_attrs["refused"] and "interrupted" not in refused[0].user_attrs
    never = SweepStudy.of_sweep("fedcba9876543210fedcba9876543210",
                                {"model_settings.cells": optuna.distributions.IntDistribution(0, 1)}, base)
    never.search_with("random", 3, trials=3, max_concurrent=1, pruner=optuna.pruners.NopPruner())
    with pytest.raises(ValueError, match=r"20 trials in a row that no run may have .*narrow the space"):
        never.ask()


def test_a_kept_study_continues_when_only_a_searched_settings_base_value_changed() -> None:
    study = optuna.create_study(study_name="kept-cells", direction="maximize")
    space = {"model_settings.cells": optuna.distributions.IntDistribution(20, 60, step=20)}
    _check_same_study(study, "kept-cells", space, ufld(model_settings={"cells": 20, "backbone": "resnet34"}))
    _check_same_study(study, "kept-cells", space, ufld(model_settings={"cells": 40, "backbone": "resnet34"}))
    with pytest.raises(ValueError, match="was run with other model_settings"):  # an unsearched one still counts
        _check_same_study(study, "kept-cells", space, ufld(model_settings={"cells": 40, "backbone": "resnet18"}))


def test_a_setting_name_is_a_name_even_for_a_model_this_process_cannot_load() -> None:
    """It becomes ``--set model.<name>=...`` on the trainer's command line: only an identifier passes, whichever
    model it is for."""
    with pytest.raises(ValidationError, match="String should match pattern"):
        TrainParams(source=source(), model="a-model-of-the-training-image", model_settings={"x; rm -rf /": 1})
    kept = TrainParams(source=source(), model="a-model-of-the-training-image", model_settings={"channels": 8})
    assert kept.trainer_settings()["model.channels"] == "8"


def test_refused_trials_do_not_count_towards_a_kept_studys_trials() -> None:
    base = ufld()
    study = SweepStudy.of_sweep("00112233445566778899aabbccddeeff",
                                {"model_settings.cells": optuna.distributions.IntDistribution(1, 2)}, base)
    study.search_with("random", 3, trials=2, max_concurrent=1, pruner=optuna.pruners.NopPruner())
    study.optuna_study.enqueue_trial({"model_settings.cells": 1})
    study.ask()  # one refused, one running
    assert study.counted() == 0


def test_the_deployments_schema_refuses_a_setting_name_that_is_not_a_name() -> None:
    """What the server checks a run's parameters against when the run is created (every deployment enforces its
    schema): a bad name is refused there, before a worker starts anything."""
    from flows.train import train_pipeline

    schema = train_pipeline.parameters.model_dump_for_openapi()
    form = {"source": json.loads(source().model_dump_json())}
    validate({**form, "model_settings": {"cells": 50}}, schema, raise_on_error=True, ignore_required=True)
    with pytest.raises(SchemaRefusal, match="'x; rm' does not match any of the regexes"):
        validate({**form, "model_settings": {"x; rm": 3}}, schema, raise_on_error=True, ignore_required=True)
