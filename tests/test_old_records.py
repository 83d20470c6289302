"""Records from before the model interface (commit 705f611's parent) still work: a checkpoint and ``model.pt``
without ``model_name`` (and a checkpoint whose ``train_config`` has no ``model``), and a package whose manifest's
``model`` has no ``name`` and whose parity report has no ``max_abs_diff`` — as that code wrote them — are SCNN's:
the run resumes, its model evaluates, and the package loads and predicts what a package of today predicts."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tasks.processes import run_to_end
from tests.test_train import env, events, train_cmd
from training.data.fetch import sha256_of
from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.evaluate import load_model
from training.model import ModelConfig
from training.package import MANIFEST, WEIGHTS, load_package, package_run
from training.predict import predict

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def run(cmd: list[str]) -> tuple[int, str, str]:
    done = run_to_end(cmd, 600, env=env(), cwd=REPO)
    return done.returncode, done.stdout, done.stderr


def as_before_the_interface(path: Path) -> None:
    """A checkpoint or ``model.pt`` as the trainer wrote it before there were models: no ``model_name``, and the
    run's settings without ``model`` (``TrainConfig`` had only ``model_overrides``)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state.pop("model_name") == "scnn"
    if "train_config" in state:
        assert state["train_config"].pop("model") == "scnn"
    torch.save(state, path)


def old_package(package: Path, to: Path) -> Path:
    """``package`` as ``build_package`` wrote it before there were models: the manifest's ``model`` without
    ``name``, parity per backend only as ``max_abs_diff_probabilities`` / ``_existence``, ``model.pt`` without
    ``model_name``; the checksums of what changed recorded again. Also as its ``.tar.gz``."""
    shutil.copytree(package, to)
    as_before_the_interface(to / WEIGHTS)
    manifest = json.loads((to / MANIFEST).read_text())
    assert manifest["model"].pop("name") == "scnn"
    for result in manifest["parity"]["backends"].values():
        result.pop("max_abs_diff")
        assert set(result) == {"max_abs_diff_probabilities", "max_abs_diff_existence", "identical_lanes"}
    manifest["files"][WEIGHTS] = sha256_of(to / WEIGHTS)
    (to / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    archive = to.with_name(to.name + ".tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        for name in manifest["files"] | {MANIFEST: ""}:
            tar.add(to / name, arcname=f"{to.name}/{name}")
    return archive


def test_a_run_and_a_package_from_before_the_model_interface_resume_evaluate_load_and_predict(
        tmp_path: Path) -> None:
    data = tmp_path / "tusimple"
    generate(data, train=16, val=4, test=4, seed=3, width=320, height=180)
    preprocess(data, workers=1)
    run_dir = tmp_path / "run"
    code, _, err = run(train_cmd(data, run_dir, "--set", "max_steps=2", "--set", "checkpoint_every=2"))
    assert code == 0, err[-3000:]
    checkpoints = sorted((run_dir / "checkpoints").glob("*.pt"))
    assert checkpoints
    for path in [*checkpoints, run_dir / "model.pt"]:
        as_before_the_interface(path)

    # The old model.pt is SCNN's: it loads and the evaluation stage scores it.
    _, config = load_model(run_dir / "model.pt")
    assert isinstance(config, ModelConfig) and config.input_width == 256
    code, _, err = run([sys.executable, "-m", "training.evaluate", "--run-dir", str(run_dir), "--data-root",
                        str(data), "--split", "val"])
    assert code == 0, err[-3000:]
    assert json.loads((run_dir / "eval_val.json").read_text())["split"] == "val"

    # The run resumes from its old checkpoint (not from the start) and trains on.
    code, out, err = run(train_cmd(data, run_dir, "--set", "max_steps=4", "--set", "checkpoint_every=2"))
    assert code == 0, err[-3000:]
    start = next(event for event in events(out) if event["event"] == "start")
    assert start["step"] == 2 and start["model"] == "scnn", start
    assert torch.load(run_dir / "model.pt", weights_only=True)["step"] == 4

    # A package from before: it loads (folder and archive) and predicts what today's package of the same weights does.
    today = load_package(Path(package_run(run_dir, data, "test")["package"]))
    archive = old_package(today.folder, tmp_path / "old-package")
    images = data / "clips"
    assert images.is_dir()
    for source in (tmp_path / "old-package", archive):
        old = load_package(source, unpack_to=tmp_path / "unpacked")
        assert old.model_name == "scnn" and old.config == today.config
        for backend in ("eager", "torchscript", "onnx"):
            said = {}
            for name, package in (("today", today), ("old", old)):
                summary = predict(package, str(images), tmp_path / f"{name}-{source.name}-{backend}", backend=backend,
                                  overlays=False)
                assert summary.predicted > 0 and summary.skipped == [], (name, backend)
                said[name] = [(line["raw_file"], line["lanes"]) for line in
                              map(json.loads, Path(summary.predictions).read_text().splitlines())]
            assert said["old"] == said["today"], backend
