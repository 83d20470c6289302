"""Model packages and prediction: a trained cpu-demo run exported (TorchScript, ONNX), checked, loaded, and
run on images, folders, globs and videos made here with OpenCV; predictions score as the evaluation does."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from tasks.processes import run_to_end
from tests.conftest import PROJECT_ROOT
from training.data.preprocess import preprocess
from training.data.synthetic import generate, labelled_video
from training.evaluate import evaluate_run, load_model
from training.inference import h_samples_for, resize_for_model
from training.metric import parse_ground_truth, score_files, score_predictions
from training.package import (
    FORMAT_VERSION,
    MANIFEST,
    ONNX,
    PROB_TOLERANCE,
    PackageError,
    build_package,
    load_package,
    open_backend,
    package_run,
    parity_images,
)
from training.predict import predict

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("package")]


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A prepared synthetic dataset and a cpu-demo run trained on it for a few dozen steps: (data, run)."""
    root = tmp_path_factory.mktemp("trained")
    data = root / "tusimple"
    generate(data, train=32, val=4, test=8, seed=11, width=640, height=360)
    preprocess(data, workers=1)
    run_dir = root / "run"
    done = run_to_end(
        [sys.executable, "-m", "training.train", "--data-root", str(data), "--run-dir", str(run_dir), "--preset",
         "cpu-demo", "--set", "epochs=6", "--set", "batch_size=4", "--set", "num_workers=0", "--set", "log_every=8",
         "--set", "eval_split=test"], 1800, cwd=PROJECT_ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    return data, run_dir


@pytest.fixture(scope="session")
def packaged(trained: tuple[Path, Path]) -> dict:
    data, run_dir = trained
    return package_run(run_dir, data, "test", lineage={"run": "run", "dataset_version": "v1"})


def test_a_package_holds_models_contract_lineage_metrics_and_proven_parity(trained: tuple, packaged: dict) -> None:
    _, run_dir = trained
    folder = Path(packaged["package"])
    assert folder == run_dir / "package" and Path(packaged["archive"]) == run_dir / "package.tar.gz"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["contract"]["input"]["shape"] == ["batch", 144, 256, 3]
    assert manifest["contract"]["input"]["colour_order"].startswith("BGR")
    assert manifest["contract"]["lanes"]["existence_threshold"] == 0.5
    assert manifest["lineage"]["run"] == "run" and manifest["metrics"]["split"] == "test"
    parity = manifest["parity"]
    assert parity["passed"] and parity["images"] == 8 and len(parity["checked_on"]) == 8
    for backend in ("torchscript", "onnx"):
        assert parity["backends"][backend]["max_abs_diff_probabilities"] <= PROB_TOLERANCE
        assert parity["backends"][backend]["identical_lanes"] is True
    with tarfile.open(packaged["archive"]) as tar:
        assert sorted(tar.getnames()) == sorted(f"package/{name}" for name in ("package.json", "weights.pt",
                                                                              "model.torchscript.pt", "model.onnx"))


def test_all_three_backends_agree_on_new_images(trained: tuple, packaged: dict) -> None:
    data, _ = trained
    package = load_package(packaged["package"])
    config = package.config
    rng = np.random.default_rng(0)
    frames = [cv2.imread(str(p)) for p in sorted((data / "clips").rglob("20.jpg"))[:6]]
    batch = np.stack([resize_for_model(f, config.input_width, config.input_height) for f in frames] +
                     [rng.integers(0, 256, (config.input_height, config.input_width, 3), dtype=np.uint8)])
    eager, scripted, onnx = (open_backend(package, name=name)(batch) for name in ("eager", "torchscript", "onnx"))
    for other in (scripted, onnx):
        assert np.abs(other[0] - eager[0]).max() <= PROB_TOLERANCE and np.abs(other[1] - eager[1]).max() <= 1e-4
    with pytest.raises(PackageError, match=r"expects uint8 BGR images of 256x144"):
        open_backend(package, name="onnx")(np.zeros((1, 288, 512, 3), np.uint8))


def test_a_backend_says_where_it_really_runs(packaged: dict, caplog: pytest.LogCaptureFixture) -> None:
    """ONNX Runtime without a CUDA provider runs a 'cuda' session on the CPU without a word: laneflow says so."""
    import onnxruntime as ort

    package = load_package(packaged["package"])
    assert open_backend(package, name="eager").runs_on == "cpu"
    assert open_backend(package, name="onnx").runs_on == "CPUExecutionProvider"
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this ONNX Runtime has a CUDA provider: nothing falls back")
    with caplog.at_level("WARNING", logger="laneflow.package"):
        on_cuda = open_backend(package, name="onnx", device="cuda")
    assert on_cuda.runs_on == "CPUExecutionProvider" and not on_cuda.on_gpu
    assert "runs on the CPU, not on cuda" in caplog.text


def test_loading_refuses_a_changed_file_and_another_format(packaged: dict, tmp_path: Path) -> None:
    copy = tmp_path / "package"
    shutil.copytree(packaged["package"], copy)
    assert load_package(copy).config.input_width == 256
    unpacked = load_package(packaged["archive"], unpack_to=tmp_path / "unpacked")
    assert unpacked.manifest["files"] == load_package(copy).manifest["files"]
    with (copy / ONNX).open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\x01\x02")
    with pytest.raises(PackageError, match=r"model\.onnx does not match its recorded checksum"):
        load_package(copy)
    shutil.copyfile(Path(packaged["package"]) / ONNX, copy / ONNX)
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(PackageError, match=r"format 2; this laneflow reads format 1; upgrade laneflow"):
        load_package(copy)
    with pytest.raises(PackageError, match="is neither a package folder nor"):
        load_package(tmp_path / "nothing.zip")


def test_a_failed_export_check_leaves_no_package(trained: tuple, tmp_path: Path) -> None:
    data, run_dir = trained
    model, config = load_model(run_dir / "model.pt")
    images = parity_images(data, "test", config)
    images[0].batch = images[0].batch.astype(np.float32)  # not the contract's uint8: the parity check refuses it
    with pytest.raises(PackageError, match="the package expects uint8 BGR images of 256x144"):
        build_package(model, config, images, tmp_path / "package")
    assert list(tmp_path.iterdir()) == []  # no folder, no archive, no staging left


def test_predicting_a_dataset_root_scores_as_the_evaluation_stage(trained: tuple, packaged: dict,
                                                                  tmp_path: Path) -> None:
    data, run_dir = trained
    model, config = load_model(run_dir / "model.pt")
    evaluation = evaluate_run(model, config, data, tmp_path, "test", torch.device("cpu"))
    package = load_package(packaged["package"])
    for backend in ("eager", "torchscript", "onnx"):
        summary = predict(package, str(data / "clips"), tmp_path / backend, backend=backend, overlays=False)
        assert summary.predicted == summary.frames == 44  # every image under clips/: train, val and test
        lines = Path(summary.predictions).read_text().splitlines()
        ground_truth = parse_ground_truth((data / "test_label.json").read_text().splitlines())
        test_lines = [line for line in lines if "clips/" + json.loads(line)["raw_file"] in ground_truth]
        renamed = [json.dumps({**json.loads(line), "raw_file": "clips/" + json.loads(line)["raw_file"]})
                   for line in test_lines]
        score = score_predictions(renamed, ground_truth)
        assert (score.untimed.accuracy, score.untimed.fp, score.untimed.fn) == (
            evaluation["untimed_accuracy"], evaluation["untimed_fp"], evaluation["untimed_fn"]), backend
    assert evaluation["untimed_accuracy"] > 0  # the model finds lanes: the comparison means something


def test_predict_on_an_image_a_glob_and_a_folder_with_a_corrupt_image(trained: tuple, packaged: dict,
                                                                     tmp_path: Path) -> None:
    data, _ = trained
    package = load_package(packaged["archive"], unpack_to=tmp_path / "pkg")
    images = tmp_path / "images"
    for index, source in enumerate(sorted((data / "clips").rglob("20.jpg"))[:3]):
        (images / f"cam{index}").mkdir(parents=True)
        shutil.copyfile(source, images / f"cam{index}" / "frame.jpg")
    (images / "cam1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    summary = predict(package, str(images), tmp_path / "folder")
    assert (summary.frames, summary.predicted) == (4, 3)
    assert summary.skipped == [{"frame": "cam1/broken.jpg", "problem": f"{images / 'cam1' / 'broken.jpg'} is not a "
                                "readable image (empty, truncated or not an image)"}]
    lines = [json.loads(line) for line in Path(summary.predictions).read_text().splitlines()]
    assert [line["raw_file"] for line in lines] == ["cam0/frame.jpg", "cam1/frame.jpg", "cam2/frame.jpg"]
    assert all(line["h_samples"] == h_samples_for(360) and line["run_time"] > 0 for line in lines)
    assert sorted(p.relative_to(tmp_path / "folder" / "overlays").as_posix()
                  for p in (tmp_path / "folder" / "overlays").rglob("*.jpg")) == [
        "cam0/frame.jpg", "cam1/frame.jpg", "cam2/frame.jpg"]
    single = predict(package, str(images / "cam2" / "frame.jpg"), tmp_path / "one", overlays=False)
    assert single.predicted == 1
    globbed = predict(package, str(images / "cam*" / "frame.jpg"), tmp_path / "glob", overlays=False)
    assert [json.loads(line)["raw_file"] for line in Path(globbed.predictions).read_text().splitlines()] == [
        "cam0/frame.jpg", "cam1/frame.jpg", "cam2/frame.jpg"]


def write_video(path: Path, frames: list[np.ndarray], fourcc: str = "FFV1", fps: float = 10.0) -> Path:
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
    assert writer.isOpened(), f"OpenCV cannot write {fourcc}"
    for frame in frames:
        writer.write(frame)
    writer.release()
    return path


def test_predict_on_a_video_scores_as_the_evaluation_of_its_frames(trained: tuple, packaged: dict,
                                                                   tmp_path: Path) -> None:
    """A lossless video of the test images: its overlay video and prediction lines, and their score against
    the frames' ground truth is the evaluation stage's score on those images."""
    data, run_dir = trained
    model, config = load_model(run_dir / "model.pt")
    evaluation = evaluate_run(model, config, data, tmp_path, "test", torch.device("cpu"))
    video = tmp_path / "drive.avi"
    truth = labelled_video(data, "test_label.json", video)
    summary = predict(load_package(packaged["package"]), str(video), tmp_path / "out")
    assert (summary.frames, summary.predicted, summary.skipped) == (8, 8, [])
    capture = cv2.VideoCapture(summary.overlay)
    assert capture.isOpened() and int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == 8
    capture.release()
    score = score_files(summary.predictions, truth)
    assert (score.untimed.accuracy, score.untimed.fp, score.untimed.fn) == (
        evaluation["untimed_accuracy"], evaluation["untimed_fp"], evaluation["untimed_fn"])


def test_a_truncated_video_gives_what_it_holds_and_says_so(trained: tuple, packaged: dict, tmp_path: Path) -> None:
    data, _ = trained
    frames = [cv2.imread(str(p)) for p in sorted((data / "clips").rglob("20.jpg"))[:12]]
    video = write_video(tmp_path / "full.avi", frames, fourcc="MJPG")
    truncated = tmp_path / "cut.avi"
    truncated.write_bytes(video.read_bytes()[: video.stat().st_size * 2 // 3])
    summary = predict(load_package(packaged["package"]), str(truncated), tmp_path / "out", overlays=False)
    assert 0 < summary.predicted < 12
    assert summary.skipped and "cut.avi" in summary.skipped[-1]["problem"]
    assert len(Path(summary.predictions).read_text().splitlines()) == summary.predicted
