"""The model interface (training.models): models found by name, the built-in SCNN and one a team ships in a
package of its own, installed beside laneflow with pip and found through its ``laneflow.models`` entry point —
trained, evaluated, packaged with export parity and run by ``training.predict``, with no change to laneflow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.params import TrainParams
from tests.conftest import PROJECT_ROOT
from tests.test_train import env, events, prepared, run, train_cmd  # noqa: F401 (prepared: a fixture)
from tests.unit_helpers import source
from training.checkpoints import load_weights
from training.config import parse_overrides
from training.model import ModelConfig
from training.models import get_model, model_for, model_names
from training.models.scnn import SCNNModel

EXAMPLE = PROJECT_ROOT / "docs" / "examples" / "tinylanes"


def test_scnn_is_the_built_in_model_and_an_unknown_one_is_refused_naming_the_known_ones() -> None:
    assert model_names()[0] == "scnn" and isinstance(get_model("scnn"), SCNNModel)
    assert model_for(get_model("scnn").settings("tusimple")) is get_model("scnn")
    with pytest.raises(ValueError, match=r"unknown model 'ufo'; choose one of scnn.*laneflow\.models"):
        parse_overrides("cpu-demo", ["model=ufo"])
    # A model's own settings are checked against that model: SCNN has mp_kernel, and it must be odd.
    assert parse_overrides("cpu-demo", ["model.mp_kernel=7"]).model_overrides == {"mp_kernel": 7}
    with pytest.raises(ValueError, match="unknown model setting 'channels'; this model's: dropout, fc_hidden"):
        parse_overrides("cpu-demo", ["model.channels=8"])
    # A record from before there were other models (no name) is SCNN's, read back field for field.
    record = {"input_height": 144, "input_width": 256, "stage_channels": [16, 32, 64, 96, 96]}
    assert get_model("scnn").settings_from_record(record) == ModelConfig(
        input_height=144, input_width=256, stage_channels=(16, 32, 64, 96, 96))
    with pytest.raises(ValueError, match="fields this laneflow does not know: heads"):
        get_model("scnn").settings_from_record({**record, "heads": 3})


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/examples/tinylanes installed by pip into a folder of its own (from a copy: pip builds in the tree)."""
    work = tmp_path_factory.mktemp("tinylanes")
    shutil.copytree(EXAMPLE, work / "source", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(work / "site"), str(work / "source")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return work / "site"


def with_plugin(site: Path) -> dict[str, str]:
    return {**env(), "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)])}


def test_a_model_from_its_own_package_is_found_by_its_entry_point_trains_packages_and_predicts(
        installed: Path, prepared: Path, tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    plugin = with_plugin(installed)
    listed = subprocess.run([sys.executable, "-c", "from training.models import model_names; print(model_names())"],
                            env=plugin, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert listed.stdout.strip() == "['scnn', 'ufld', 'tinylanes']", listed.stderr[-2000:]
    # Without the package, the name is unknown: refused at once, with the names there are.
    refused = run(train_cmd(prepared, tmp_path / "refused", "--set", "model=tinylanes"))
    assert refused.returncode == 2 and "unknown model 'tinylanes'; choose one of scnn" in refused.stderr

    run_dir = tmp_path / "run"
    trained = subprocess.run(train_cmd(prepared, run_dir, "--set", "model=tinylanes", "--set", "max_steps=4",
                                       "--set", "model.channels=8"),
                             env=plugin, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = events(trained.stdout)
    assert [e["step"] for e in done if e["event"] == "step"][-1] == 4
    (evaluated,) = [e for e in done if e["event"] == "eval"]
    assert evaluated["split"] == "val" and evaluated["images"] == 4
    saved = load_weights(run_dir / "model.pt")
    assert saved["model_name"] == "tinylanes" and saved["model_config"]["channels"] == 8
    assert json.loads((run_dir / "config.json").read_text())["model_name"] == "tinylanes"

    # Packaged: TorchScript and ONNX of its own deployable module, parity proven on each output.
    packaged = subprocess.run([sys.executable, "-m", "training.package", "--run-dir", str(run_dir), "--data-root",
                               str(prepared), "--split", "val"], env=plugin, cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=600)
    assert packaged.returncode == 0, packaged.stderr[-3000:]
    manifest = json.loads((run_dir / "package" / "package.json").read_text())
    assert manifest["model"]["name"] == "tinylanes" and manifest["model"]["architecture"] == "TinyLanes"
    assert manifest["parity"]["passed"] and set(manifest["parity"]["backends"]["onnx"]) >= {
        "max_abs_diff_probabilities", "max_abs_diff_existence", "max_abs_diff"}

    image = next(prepared.rglob("*.jpg"))
    predicted = subprocess.run([sys.executable, "-m", "training.predict", "--package", str(run_dir / "package"),
                                "--input", str(image), "--out", str(tmp_path / "out"), "--backend", "onnx"],
                               env=plugin, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    (line,) = (tmp_path / "out" / "predictions.json").read_text().splitlines()
    assert json.loads(line)["raw_file"] == image.name


def test_a_run_names_its_model_and_the_trainer_is_told_only_when_it_is_not_scnn() -> None:
    assert "model" not in TrainParams(source=source()).trainer_settings()  # an image from before models trains on
    assert TrainParams(source=source(), model="tinylanes").trainer_settings()["model"] == "tinylanes"
    with pytest.raises(ValueError, match="model"):
        TrainParams(source=source(), model="Tiny Lanes")


def test_a_models_settings_are_overridable_whether_or_not_its_module_postpones_annotations() -> None:
    """A package's settings dataclass holds classes as field types unless its module has ``from __future__ import
    annotations`` (then text): both say which settings a run may set."""
    import dataclasses

    real_types = dataclasses.make_dataclass("PlainSettings", [("input_width", int, 256), ("ratio", float, 0.5),
                                                              ("name", str, "x"), ("shape", tuple, (1,))],
                                            frozen=True)

    class Plain(SCNNModel):
        settings_type = real_types

    assert Plain().overridable_settings() == {"input_width": "int", "ratio": "float", "name": "str"}
    assert "mp_kernel" in get_model("scnn").overridable_settings()  # laneflow's own: annotations as text
