"""Training parameters: validation, lineage records, flow signatures, sweep expansion and search spaces."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.params import DataSource, SweepError, TrainParams, expand_sweep, params_from_record, takes_train_params
from tests.unit_helpers import SHA, source
from training.data.sources import Artifact, dataset_key

# --- parameters and sweeps ---------------------------------------------------------------------------

def test_params_validate_with_field_names() -> None:
    with pytest.raises(ValidationError, match="lr"):
        TrainParams(source=source(), lr=0)
    with pytest.raises(ValidationError, match="sha256"):
        DataSource(url="https://x/a.zip", sha256="nope")
    with pytest.raises(ValidationError, match="url"):
        DataSource(url="ftp://x/a.zip", sha256=SHA)
    with pytest.raises(ValidationError, match="volume"):
        TrainParams(source=source(), volume="Bad_Name")
    with pytest.raises(ValidationError, match="bogus"):
        TrainParams(source=source(), bogus=1)


def test_params_round_trip_through_a_lineage_record_without_the_secret() -> None:
    params = TrainParams(source=source(), epochs=7, lr=0.02)
    record = params.for_record()
    assert record["source_artifacts"] == [{"url": "https://mirror.example.org/train_set.zip", "sha256": SHA,
                                           "kind": "archive"}]
    rebuilt = params_from_record(record, volume="restored")
    assert (rebuilt.epochs, rebuilt.lr, rebuilt.volume) == (7, 0.02, "restored")
    assert rebuilt.source.to_artifacts() == [Artifact("https://mirror.example.org/train_set.zip", SHA)]
    # A record from before datasets were lists of artifacts: one archive.
    old = {**{k: v for k, v in record.items() if k != "source_artifacts"},
           "source_url": "https://mirror.example.org/train_set.zip", "source_sha256": SHA}
    assert params_from_record(old).source.to_artifacts() == rebuilt.source.to_artifacts()


def test_a_dataset_is_a_list_of_artifacts_and_one_archive_still_works() -> None:
    three = DataSource(artifacts=[{"url": "https://m.example/train_set.zip", "sha256": SHA},
                                  {"url": "https://m.example/test_set.zip", "sha256": "b" * 64},
                                  {"url": "https://m.example/test_label.json", "sha256": "c" * 64, "kind": "file"}])
    assert [a.kind for a in three.to_artifacts()] == ["archive", "archive", "file"]
    assert DataSource(url="https://m.example/train_set.zip", sha256=SHA).to_artifacts() == \
        [Artifact("https://m.example/train_set.zip", SHA, "archive")]
    with pytest.raises(ValidationError, match=r"artifacts\.1\.kind"):
        DataSource(artifacts=[{"url": "https://m.example/a.zip", "sha256": SHA},
                              {"url": "https://m.example/b", "sha256": SHA, "kind": "folder"}])
    with pytest.raises(ValidationError, match="at least 1 item"):
        DataSource(artifacts=[])
    keys = {dataset_key(three.to_artifacts()), dataset_key(list(reversed(three.to_artifacts())))}
    assert len(keys) == 1 and dataset_key([Artifact("https://m.example/train_set.zip", SHA)]) == SHA[:16]


def test_flows_take_the_fields_of_train_params_as_their_own_top_level_parameters() -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.nightly import nightly_retrain
    from flows.sweep import sweep
    from flows.train import train_pipeline

    fields = list(TrainParams.model_fields)
    nightly_extras = ["min_improvement", "gate_margin", "cross_fp_margin"]
    for flow, extras in ((train_pipeline, ["run_key"]), (nightly_retrain, nightly_extras),
                         (sweep, ["grid", "runs", "max_concurrent", "search", "space", "trials", "seed", "study",
                                  "pruner", "wait_for_study"])):
        schema = flow.parameters.model_dump_for_openapi()
        assert list(schema["properties"]) == fields + extras, flow.name
        assert all(schema["properties"][name].get("description") for name in fields )
    validated = train_pipeline.validate_parameters({"source": source().model_dump(), "lr": 0.02})
    assert TrainParams.from_flow_parameters(validated) == TrainParams(source=source(), lr=0.02)
    with pytest.raises(ParameterTypeError, match="volume"):
        train_pipeline.validate_parameters({"source": source().model_dump(), "volume": "Not_A_Name"})


def test_takes_train_params_refuses_a_flow_it_cannot_wrap() -> None:
    def clashes(params: TrainParams, lr: float) -> None: ...

    def takes_no_params(volume: str) -> None: ...

    with pytest.raises(TypeError, match=r"\['lr'\] clash"):
        takes_train_params(clashes)
    with pytest.raises(TypeError, match="first parameter"):
        takes_train_params(takes_no_params)


def test_sweep_expands_grid_then_runs() -> None:
    base = TrainParams(source=source())
    sets = expand_sweep(base, {"lr": [0.01, 0.02], "batch_size": [2, 4]}, [{"workers": 1}])
    assert [(p.batch_size, p.lr, p.workers) for p in sets] == [(2, 0.01, 2), (2, 0.02, 2), (4, 0.01, 2),
                                                               (4, 0.02, 2), (4, 0.05, 1)]
    assert len(expand_sweep(base, {}, [])) == 1
    with pytest.raises(SweepError, match=r"sweep run 1 .*epochs"):
        expand_sweep(base, {}, [{"epochs": 2}, {"epochs": 0}])
    with pytest.raises(SweepError, match="grid entry 'lr'"):
        expand_sweep(base, {"lr": []}, [])


# --- search spaces -----------------------------------------------------------------------------------

def test_a_search_space_is_checked_against_the_fields_it_names() -> None:
    from flows.search import SearchChoices, SearchRange, SearchSpaceError, check_space, distributions

    dimensions = check_space({"lr": {"low": 0.001, "high": 0.3, "log": True}, "batch_size": {"choices": [2, 4, 8]},
                              "epochs": {"low": 1, "high": 5, "step": 2}, "preset": {"choices": ["cpu-demo"]}})
    assert dimensions["lr"] == SearchRange(low=0.001, high=0.3, log=True)
    assert dimensions["batch_size"] == SearchChoices(choices=[2, 4, 8])
    found = distributions(dimensions)
    assert (found["lr"].low, found["lr"].high, found["lr"].log) == (0.001, 0.3, True)
    assert type(found["epochs"]).__name__ == "IntDistribution" and found["epochs"].step == 2
    assert found["batch_size"].choices == (2, 4, 8)
    refused = {
        "unknown": ({"learning_rate": {"low": 0.1, "high": 0.2}},
                    r"space\['learning_rate'\]: TrainParams has no field"),
        "not searched": ({"volume": {"choices": ["a", "b"]}}, r"space\['volume'\]: volume is the same for every trial"),
        "low >= high": ({"lr": {"low": 0.3, "high": 0.3}}, r"space\['lr'\]: low \(0.3\) must be below high"),
        "log at 0": ({"lr": {"low": 0, "high": 0.3, "log": True}}, r"space\['lr'\]: a log range must stay above 0"),
        "past a limit": ({"lr": {"low": 0.1, "high": 20}}, r"space\['lr'\]: high 20 is outside what lr allows"),
        "wrong type": ({"batch_size": {"choices": [2, "4"]}}, r"space\['batch_size'\]: choice '4' is not a valid"),
        "fractional int": ({"epochs": {"low": 1, "high": 2.5}}, r"space\['epochs'\]: epochs is a whole number"),
        "range of a literal": ({"preset": {"low": 0, "high": 1}}, r"space\['preset'\]: preset is not a number"),
        "typo in a range": ({"lr": {"low": 0.1, "hihg": 0.2}}, r"space\['lr'\]: .*hihg"),
        "log and step": ({"lr": {"low": 0.1, "high": 0.2, "log": True, "step": 0.05}}, r"log or step, not both"),
        "a bound as text": ({"lr": {"low": "0.001", "high": 0.2}}, r"space\['lr'\]: low: "),
        "repeated choice": ({"lr": {"choices": [0.1, 0.1]}}, r"the choices repeat a value"),
        "empty": ({}, "space is empty"),
    }
    for case, (space, message) in refused.items():
        with pytest.raises(SearchSpaceError, match=message):
            check_space(space)
            pytest.fail(f"{case}: accepted")
