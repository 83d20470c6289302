"""Model packages: a trained run as one folder (and one archive) an inference team can use outside laneflow.

    runs/<run>/package/
        package.json            format version, model config, input contract, lineage, test metrics,
                                the parity check, and the sha256 of every other file
        weights.pt              the state dict (load with laneflow: ``training.package.open_backend``)
        model.torchscript.pt    TorchScript of the deployable module (``torch.jit.load``)
        model.onnx              ONNX (opset 17) of the same module, batch size dynamic
    runs/<run>/package.tar.gz   the folder as one file

The exported module is the lane model's deployable one (``training.models``; SCNN's is
``training.inference.DeployedSCNN``): uint8 BGR NHWC images in, the model's outputs (SCNN: softmax
probabilities and lane existence) out, normalisation inside. **Parity is proven before anything is
written**: on up to 20 images of the evaluated split, every output of TorchScript and ONNX Runtime equals the
eager model's within ``PROB_TOLERANCE`` and gives identical lanes; a failed export or parity
check is an error and leaves no package behind (it is built in a staging folder and renamed into place).
Loading a package checks its format version and every file's checksum.

    python -m training.package --run-dir R --data-root D --split test [--lineage JSON]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shutil
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from training.data.fetch import sha256_of
from training.dataset import DataError, read_list
from training.inference import h_samples_for, resize_for_model
from training.models import DEFAULT_MODEL, get_model, model_for
from training.models.base import ModelSettings, image_outputs, run_deployed
from training.signals import exit_on_sigterm

log = logging.getLogger("laneflow.package")

FORMAT_VERSION = 1
MANIFEST = "package.json"
WEIGHTS, TORCHSCRIPT, ONNX = "weights.pt", "model.torchscript.pt", "model.onnx"
ARCHIVE_SUFFIX = ".tar.gz"
PARITY_IMAGES = 20
#: Largest difference allowed between a backend's probabilities and the eager model's (float32 kernels
#: differ in summation order; measured differences are ~1e-7).
PROB_TOLERANCE = 1e-4
ONNX_OPSET = 17
BACKENDS = ("eager", "torchscript", "onnx")


class PackageError(ValueError):
    """A package that cannot be built or used; the message says which file or check and what to do."""


# --- building -------------------------------------------------------------------------------------------


def export_models(model: torch.nn.Module, config: ModelSettings, folder: Path) -> None:
    """Weights, TorchScript and ONNX of the deployable module into ``folder``; errors name the format."""
    lane_model = model_for(config)
    model = model.cpu().eval()
    deployed = lane_model.deployed(model).eval()
    example = torch.zeros((1, config.input_height, config.input_width, 3), dtype=torch.uint8)
    torch.save({"model": model.state_dict(), "model_name": lane_model.name, "model_config": asdict(config)},
               folder / WEIGHTS)
    # Without gradients the model runs plain tensor operations (not its training-time autograd
    # function), which is what tracing and the exporters follow.
    # torch 2.13 marks TorchScript deprecated (it still works, and inference teams still ask for it).
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        try:
            torch.jit.trace(deployed, example).save(str(folder / TORCHSCRIPT))
        except Exception as exc:
            raise PackageError(f"TorchScript export failed: {type(exc).__name__}: {exc}") from exc
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                # dynamo=False: the TorchScript-based exporter takes seconds where the dynamo one takes
                # minutes on this network's unrolled message passing, with the same parity.
                torch.onnx.export(deployed, (example,), str(folder / ONNX), dynamo=False, opset_version=ONNX_OPSET,
                                  input_names=["images"], output_names=list(lane_model.output_names),
                                  dynamic_axes={name: {0: "batch"} for name in ("images", *lane_model.output_names)})
        except Exception as exc:
            raise PackageError(f"ONNX export failed: {type(exc).__name__}: {exc}") from exc


@dataclass
class ParityImage:
    """One image the parity check runs: the model input, and what its lanes are measured against."""

    name: str
    batch: np.ndarray  # (H, W, 3) uint8 at the model's input size
    size: tuple[int, int]  # the source image's (width, height)
    h_samples: list[int]


def parity_images(data_root: Path, split: str, config: ModelSettings, count: int = PARITY_IMAGES) -> list[ParityImage]:
    """The first ``count`` images of a prepared split, through the input contract."""
    from training.evaluate import dataset_kind, ground_truth_for

    samples = read_list(data_root, split)[:count]
    gt = ground_truth_for(data_root, split, {s.image for s in samples})
    images = []
    for sample in samples:
        frame = cv2.imread(str(data_root / sample.image), cv2.IMREAD_COLOR)
        if frame is None or (sample.image not in gt and dataset_kind(data_root) != "culane"):
            continue
        # CULane has no h_samples: TuSimple's rows, scaled to the frame, are as good a place to compare lanes.
        rows = gt[sample.image]["h_samples"] if sample.image in gt else h_samples_for(frame.shape[0])
        images.append(ParityImage(sample.image, resize_for_model(frame, config.input_width, config.input_height),
                                  (frame.shape[1], frame.shape[0]), rows))
    if not images:
        raise DataError(f"split '{split}' of {data_root} has no readable labelled images to check parity on")
    return images


def check_parity(folder: Path, config: ModelSettings, images: list[ParityImage]) -> dict[str, Any]:
    """Every backend's outputs and lanes against the eager model's, on ``images``: per output
    ``max_abs_diff_<output>``, the largest of them ``max_abs_diff``."""
    lane_model = model_for(config)
    backends = {name: open_backend(folder, config, name) for name in BACKENDS}
    batch = np.stack([image.batch for image in images])
    outputs = {name: backend(batch) for name, backend in backends.items()}
    reference = outputs["eager"]
    report: dict[str, Any] = {"images": len(images), "tolerance": PROB_TOLERANCE, "backends": {}}
    for name in ("torchscript", "onnx"):
        same_lanes = all(
            lane_model.row_lanes(config, image_outputs(outputs[name], i), image.h_samples, image.size)
            == lane_model.row_lanes(config, image_outputs(reference, i), image.h_samples, image.size)
            for i, image in enumerate(images))
        differences = {f"max_abs_diff_{output}": float(np.abs(ours - theirs).max())
                       for output, ours, theirs in zip(lane_model.output_names, outputs[name], reference, strict=True)}
        report["backends"][name] = {**differences, "max_abs_diff": max(differences.values()),
                                    "identical_lanes": same_lanes}
    failures = []
    for name, result in report["backends"].items():
        worst = result["max_abs_diff"]
        if worst > PROB_TOLERANCE:
            failures.append(f"{name}: outputs differ by up to {worst:.3g} (> {PROB_TOLERANCE})")
        elif not result["identical_lanes"]:
            failures.append(f"{name}: lanes differ from the eager model's")
    report["passed"] = not failures
    if failures:
        raise PackageError("exported models do not match the eager model on "
                           f"{len(images)} images: {'; '.join(failures)}")
    return report


def build_package(model: torch.nn.Module, config: ModelSettings, images: list[ParityImage], out: Path, *,
                  lineage: dict | None = None, metrics: dict | None = None) -> dict[str, Any]:
    """Export, prove parity, describe, checksum and archive: ``out`` (a folder) and ``out``.tar.gz."""
    out = Path(out)
    staging = out.with_name(f".{out.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        lane_model = model_for(config)
        export_models(model, config, staging)
        parity = check_parity(staging, config, images)
        manifest = {
            "format_version": FORMAT_VERSION,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": {"name": lane_model.name, "architecture": lane_model.architecture, "config": asdict(config)},
            "contract": lane_model.contract(config),
            "lineage": lineage or {},
            "metrics": metrics or {},
            "parity": {**parity, "checked_on": [image.name for image in images]},
            "files": {name: sha256_of(staging / name) for name in (WEIGHTS, TORCHSCRIPT, ONNX)},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        archive = out.with_name(out.name + ARCHIVE_SUFFIX)
        partial = archive.with_name(archive.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            for name in (MANIFEST, WEIGHTS, TORCHSCRIPT, ONNX):
                tar.add(staging / name, arcname=f"{out.name}/{name}")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
        partial.rename(archive)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("packaged %s (parity on %d images: %s)", out, parity["images"],
             ", ".join(f"{k} {v['max_abs_diff']:.1e}" for k, v in parity["backends"].items()))
    return {"package": str(out), "archive": str(archive), "format_version": FORMAT_VERSION,
            "files": manifest["files"], "parity": manifest["parity"]}


def package_run(run_dir: Path, data_root: Path, split: str, lineage: dict | None = None) -> dict[str, Any]:
    """The package of a finished run (``model.pt``), checked on its evaluated split; with its test metrics."""
    from training.evaluate import load_model

    run_dir, data_root = Path(run_dir), Path(data_root)
    model_file = run_dir / "model.pt"
    if not model_file.is_file():
        raise PackageError(f"{model_file} does not exist: package a run that finished training")
    model, config = load_model(model_file, "cpu")
    metrics = {}
    for candidate in (run_dir / f"eval_{split}.json", run_dir / "eval.json"):  # the pipeline's, the trainer's
        if candidate.is_file() and json.loads(candidate.read_text()).get("split") == split:
            metrics = json.loads(candidate.read_text())
            break
    images = parity_images(data_root, split, config)
    return build_package(model, config, images, run_dir / "package", lineage=lineage, metrics=metrics)


# --- loading ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Package:
    """A verified package on disk."""

    folder: Path
    manifest: dict

    @property
    def model_name(self) -> str:
        """The lane model the package holds (SCNN's, for packages from before there were others)."""
        return str(self.manifest["model"].get("name") or DEFAULT_MODEL)

    @property
    def config(self) -> ModelSettings:
        return get_model(self.model_name).settings_from_record(self.manifest["model"]["config"])

    def path(self, name: str) -> Path:
        return self.folder / name


def load_package(path: str | Path, unpack_to: Path | None = None) -> Package:
    """A package folder or archive, after checking its format version and every file's checksum."""
    path = Path(path)
    if path.is_file() and path.name.endswith(ARCHIVE_SUFFIX):
        folder = _unpack(path, unpack_to)
    elif path.is_dir():
        folder = path
    else:
        raise PackageError(f"{path} is neither a package folder nor a {ARCHIVE_SUFFIX} package archive")
    manifest_file = folder / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PackageError(f"{folder} is not a laneflow package: {MANIFEST} is missing or unreadable ({exc})") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise PackageError(f"{folder} is a package of format {version!r}; this laneflow reads format {FORMAT_VERSION}"
                           + ("; upgrade laneflow to use it" if newer else "; rebuild it with this laneflow"))
    for name, expected in manifest.get("files", {}).items():
        file = folder / name
        if not file.is_file():
            raise PackageError(f"package {folder} lacks {name}")
        actual = sha256_of(file)
        if actual != expected:
            raise PackageError(f"package {folder}: {name} does not match its recorded checksum (sha256 {actual}, "
                               f"recorded {expected}); it was changed or truncated — rebuild or re-download it")
    return Package(folder, manifest)


def _unpack(archive: Path, into: Path | None) -> Path:
    """Extract a package archive (its one folder) into ``into`` (a new temporary folder by default)."""
    into = Path(into or tempfile.mkdtemp(prefix="laneflow-package-"))
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        tops = {member.name.split("/", 1)[0] for member in members}
        if len(tops) != 1 or any(not member.isfile() and not member.isdir() for member in members):
            raise PackageError(f"{archive} is not a laneflow package archive (one folder of plain files)")
        tar.extractall(into, filter="data")
    return into / tops.pop()


# --- backends -----------------------------------------------------------------------------------------------

def runs_on_gpu(runs_on: str) -> bool:
    """Whether a backend's ``runs_on`` (a torch device or an ONNX Runtime provider) is a GPU."""
    return runs_on.startswith("cuda") or runs_on in ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclass(frozen=True)
class Backend:
    """A callable from a uint8 BGR batch to the model's outputs as numpy arrays, and where it really runs:
    the torch device, or the ONNX Runtime execution provider that took the session (ONNX Runtime falls back
    to the CPU without a word when its CUDA provider is missing)."""

    name: str
    runs_on: str
    config: ModelSettings
    run: Callable[[np.ndarray], tuple[np.ndarray, ...]]

    @property
    def on_gpu(self) -> bool:
        return runs_on_gpu(self.runs_on)

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, ...]:
        config = self.config
        expected = (config.input_height, config.input_width, 3)
        if batch.ndim != 4 or batch.shape[1:] != expected or batch.dtype != np.uint8:
            raise PackageError(f"input batch is {batch.dtype} {tuple(batch.shape)}; the package expects uint8 BGR "
                               f"images of {config.input_width}x{config.input_height}, shaped (N, {expected[0]}, "
                               f"{expected[1]}, 3): resize them with training.inference.resize_for_model")
        return self.run(batch)


def open_backend(folder: Path | Package, config: ModelSettings | None = None, name: str = "eager",
                 device: str = "cpu") -> Backend:
    """The package's model behind backend ``name`` on ``device``; ``.runs_on`` says where it actually runs."""
    folder, config = (folder.folder, folder.config) if isinstance(folder, Package) else (Path(folder), config)
    assert config is not None
    if name == "eager":
        state = torch.load(folder / WEIGHTS, map_location=device, weights_only=True)
        lane_model = model_for(config)
        model = lane_model.network(config)
        model.load_state_dict(state["model"])
        module: Any = lane_model.deployed(model).to(device).eval()
    elif name == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=DeprecationWarning)
            module = torch.jit.load(str(folder / TORCHSCRIPT), map_location=device).eval()
    elif name == "onnx":
        import onnxruntime as ort

        wanted = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.startswith("cuda") else \
            ["CPUExecutionProvider"]
        providers = [p for p in wanted if p in ort.get_available_providers()] or ["CPUExecutionProvider"]
        session = ort.InferenceSession(str(folder / ONNX), providers=providers)
        runs_on = session.get_providers()[0]
        if device.startswith("cuda") and runs_on != "CUDAExecutionProvider":
            log.warning("ONNX Runtime has no CUDA execution provider here (installed: %s): the onnx backend runs "
                        "on the CPU, not on %s. Install onnxruntime-gpu for GPU inference, or use torchscript",
                        ", ".join(ort.get_available_providers()), device)
        return Backend(name, runs_on, config, lambda batch: tuple(session.run(None, {"images": batch})))
    else:
        raise PackageError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")

    def run(batch: np.ndarray) -> tuple[np.ndarray, ...]:
        return run_deployed(module, torch.from_numpy(batch).to(device))

    return Backend(name, str(torch.device(device)), config, run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.package", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="a finished run (with model.pt)")
    parser.add_argument("--data-root", required=True, type=Path, help="prepared dataset root (parity images)")
    parser.add_argument("--split", default="test", choices=("train", "val", "test"))
    parser.add_argument("--lineage", default="{}", help="the run's lineage record as JSON, kept in the package")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # exporters print; stdout carries the one result line
            summary = package_run(args.run_dir, args.data_root, args.split, json.loads(args.lineage))
    except (PackageError, DataError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "packaged", **summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
