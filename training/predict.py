"""Lanes on images and videos with a model package: TuSimple or CULane predictions, and overlays.

    python -m training.predict --package runs/train-1a2b3c4d5e6f/package --input dashcam.mp4 --out preds/
    python -m training.predict --package model.tar.gz --input 'clips/0530/*/20.jpg' --backend onnx --out preds/
    python -m training.predict --package culane-model/ --input CULane/driver_37_30frame --out preds/

Inputs: an image, a folder (its images, recursively), a glob, or a video file (OpenCV ``VideoCapture``).
Each frame goes through the package's input contract (``training.inference``), its lanes are read at
TuSimple's h_samples scaled to the frame's height, and one line per frame is written to
``predictions.json`` — ``raw_file``, ``lanes``, ``h_samples``, ``run_time`` — which ``training.metric``
scores. ``raw_file`` is the path relative to the input folder (or the glob's fixed part), so predicting a
dataset root gives lines its label files score; a video's frames are ``<video name>#<frame index>``.
A model evaluated on CULane (its package's metrics say so; ``--format`` chooses otherwise) writes CULane's
format instead, as the official tool and ``training.culane_eval --predictions`` read it: a ``.lines.txt`` per
frame under ``lines/``, at the frame's path with its suffix replaced (a video's frame ``clip.mp4#12`` as
``clip.mp4/00012.lines.txt``), its lanes by the model's CULane rule (SCNN's: ``culane_lanes``) in the frame's pixels.
Overlays (lanes coloured per slot) go to ``overlays/`` for images and ``<video stem>.overlay.mp4`` for
a video. An image that cannot be decoded, or a frame a video cannot give, is reported and skipped;
the rest are predicted.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from training.data.culane import format_lines, lines_path_for
from training.inference import draw_lanes, draw_point_lanes, h_samples_for, resize_for_model
from training.models import get_model
from training.models.base import image_outputs
from training.package import BACKENDS, Package, PackageError, load_package, open_backend
from training.signals import exit_on_sigterm

log = logging.getLogger("laneflow.predict")

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".m4v", ".webm")
#: The backend each device runs fastest, measured by bench/predict.py (docs/how-to/predict.md).
FASTEST_BACKEND = {"cpu": "onnx", "cuda": "torchscript"}
#: A video gives up after this many unreadable frames in a row (the rest of a truncated file).
MAX_BAD_FRAMES_IN_A_ROW = 5


class InputError(ValueError):
    """Nothing to predict on: a path that does not exist, or names no images or video."""


@dataclass
class Frame:
    name: str
    image: np.ndarray | None  # None: could not be read (``problem`` says why)
    problem: str = ""


@dataclass
class VideoInfo:
    path: Path
    fps: float
    size: tuple[int, int]
    frames: int  # as the container declares it (0 when unknown)


#: How predictions are written: TuSimple's JSON lines (``predictions.json``) or CULane's ``.lines.txt`` files.
FORMATS = ("tusimple", "culane")


def package_format(package: Package) -> str:
    """The format of the dataset the package's model was evaluated on: CULane's when its metrics are."""
    return "culane" if (package.manifest.get("metrics") or {}).get("metric") == "culane" else "tusimple"


def culane_lines_name(frame: str) -> str:
    """Where frame ``frame``'s ``.lines.txt`` goes under ``lines/``: at the image's path, its suffix replaced, as
    CULane's tool looks for it; a video's frame ``clip.mp4#12`` as ``clip.mp4/00012.lines.txt``."""
    video, sep, index = frame.rpartition("#")
    if sep and index.isdigit():
        return f"{video}/{int(index):05d}.lines.txt"
    return lines_path_for(frame)


def default_backend(device: str) -> str:
    return FASTEST_BACKEND["cuda" if device.startswith("cuda") else "cpu"]


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


def _read_image(path: Path, name: str) -> Frame:
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        return Frame(name, None, f"{path} is not a readable image (empty, truncated or not an image)")
    return Frame(name, image)


def image_frames(spec: str) -> Iterator[Frame]:
    """Frames of an image, a folder of images or a glob, named relative to their root."""
    path = Path(spec)
    if any(char in spec for char in "*?["):
        matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        fixed = []
        for part in path.parts:  # the pattern's leading folders without wildcards are the names' root
            if any(char in part for char in "*?["):
                break
            fixed.append(part)
        root = Path(*fixed) if fixed else Path(".")
        files = [p for p in matches if p.suffix.lower() in IMAGE_SUFFIXES]
        if not files:
            raise InputError(f"the pattern '{spec}' matches no images ({', '.join(IMAGE_SUFFIXES)})")
    elif path.is_dir():
        root = path
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise InputError(f"folder {path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    elif path.is_file():
        root, files = path.parent, [path]
    else:
        raise InputError(f"input {spec} does not exist (an image, a folder, a glob or a video file)")
    for file in files:
        yield _read_image(file, file.relative_to(root).as_posix())


def open_video(path: Path) -> tuple[cv2.VideoCapture, VideoInfo]:
    capture = cv2.VideoCapture(str(path))
    if not capture.isOpened():
        raise InputError(f"{path} could not be opened as a video")
    info = VideoInfo(path, capture.get(cv2.CAP_PROP_FPS) or 25.0,
                     (int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))),
                     max(0, int(capture.get(cv2.CAP_PROP_FRAME_COUNT))))
    return capture, info


def video_frames(capture: cv2.VideoCapture, info: VideoInfo) -> Iterator[Frame]:
    """The video's frames, named ``<video name>#<index>``; unreadable ones reported, not fatal."""
    index, bad_in_a_row = 0, 0
    while True:
        ok, image = capture.read()
        if ok and image is not None:
            bad_in_a_row = 0
            yield Frame(f"{info.path.name}#{index}", image)
        else:
            if info.frames and index >= info.frames:
                return
            bad_in_a_row += 1
            if bad_in_a_row > MAX_BAD_FRAMES_IN_A_ROW:
                yield Frame(f"{info.path.name}#{index}", None,
                            f"{info.path.name} ends early: frame {index} of {info.frames or 'an unknown number'} "
                            "could not be read (a truncated or damaged file); predicted what came before")
                return
            yield Frame(f"{info.path.name}#{index}", None, f"frame {index} of {info.path.name} could not be decoded")
            if not info.frames:
                return
        index += 1


@dataclass
class Summary:
    backend: str
    label_format: str = "tusimple"
    frames: int = 0
    predicted: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    predictions: str = ""
    overlay: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "format": self.label_format, "frames": self.frames,
                "predicted": self.predicted, "skipped": self.skipped, "predictions": self.predictions,
                "overlay": self.overlay,
                "img_per_s": round(self.predicted / self.seconds, 2) if self.seconds else 0.0}


def predict(package: Package, spec: str, out: Path, *, backend: str = "auto", device: str = "cpu",
            batch_size: int = 8, overlays: bool = True, label_format: str = "auto",
            progress: Callable[[int, int], None] | None = None) -> Summary:
    """Predict lanes for every frame of ``spec`` into ``out``; see the module's docstring."""
    name = default_backend(device) if backend == "auto" else backend
    if name not in BACKENDS:
        raise PackageError(f"unknown backend '{backend}'; choose auto or one of {', '.join(BACKENDS)}")
    written = package_format(package) if label_format == "auto" else label_format
    if written not in FORMATS:
        raise PackageError(f"unknown format '{label_format}'; choose auto or one of {', '.join(FORMATS)}")
    run = open_backend(package, name=name, device=device)
    config, lane_model = package.config, get_model(package.model_name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(backend=name, label_format=written,
                      predictions=str(out / ("lines" if written == "culane" else "predictions.json")))
    source = Path(spec)
    writer: cv2.VideoWriter | None = None
    total = 0
    if is_video(source) and source.is_file():
        capture, info = open_video(source)
        frames: Iterator[Frame] = video_frames(capture, info)
        total = info.frames
        if overlays:
            summary.overlay = str(out / f"{source.stem}.overlay.mp4")
            writer = cv2.VideoWriter(summary.overlay, cv2.VideoWriter_fourcc(*"mp4v"), info.fps, info.size)
    else:
        capture = None
        frames = image_frames(spec)
        if overlays:
            summary.overlay = str(out / "overlays")
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        lines = stack.enter_context((out / "predictions.json").open("w", encoding="utf-8")) \
            if written == "tusimple" else None
        batch: list[Frame] = []

        def flush() -> None:
            images = np.stack([resize_for_model(f.image, config.input_width, config.input_height) for f in batch])
            began = time.perf_counter()
            outputs = run(images)
            per_frame_ms = (time.perf_counter() - began) * 1000 / len(batch)
            for i, frame in enumerate(batch):
                height, width = frame.image.shape[:2]
                if written == "culane":
                    points = lane_model.culane_lanes(config, image_outputs(outputs, i), (width, height))
                    target = out / "lines" / culane_lines_name(frame.name)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(format_lines(lane for _, lane in points))
                else:
                    h_samples = h_samples_for(height)
                    lanes = lane_model.row_lanes(config, image_outputs(outputs, i), h_samples, (width, height))
                    lines.write(json.dumps({"raw_file": frame.name, "lanes": [lane for _, lane in lanes],
                                            "h_samples": h_samples, "run_time": per_frame_ms}) + "\n")
                if overlays:
                    drawn = (draw_point_lanes(frame.image, points) if written == "culane"
                             else draw_lanes(frame.image, lanes, h_samples))
                    if writer is not None:
                        writer.write(drawn)
                    else:
                        target = out / "overlays" / Path(frame.name).with_suffix(".jpg")
                        target.parent.mkdir(parents=True, exist_ok=True)
                        cv2.imwrite(str(target), drawn)
            summary.predicted += len(batch)
            batch.clear()

        for frame in frames:
            summary.frames += 1
            if frame.image is None:
                log.warning("skipped %s: %s", frame.name, frame.problem)
                summary.skipped.append({"frame": frame.name, "problem": frame.problem})
                continue
            batch.append(frame)
            if len(batch) == batch_size:
                flush()
                if progress:
                    progress(summary.frames, total)
        if batch:
            flush()
    if capture is not None:
        capture.release()
    if writer is not None:
        writer.release()
    summary.seconds = time.perf_counter() - started
    if progress:
        progress(summary.frames, total)
    log.info("predicted %d of %d frames with %s (%d skipped)", summary.predicted, summary.frames, name,
             len(summary.skipped))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.predict", description=__doc__.split("\n")[0])
    parser.add_argument("--package", required=True, help="a package folder or .tar.gz archive")
    parser.add_argument("--input", required=True, help="an image, a folder, a glob or a video file")
    parser.add_argument("--out", required=True, type=Path, help="folder for predictions.json and overlays")
    parser.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                        help="auto: the fastest for the device (onnx on CPUs, torchscript on GPUs)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-overlays", action="store_true")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="auto: the format of the dataset the model was evaluated on (its package's metrics)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    last = {"t": 0.0}

    def progress(done: int, total: int) -> None:
        if time.monotonic() - last["t"] > 10:
            last["t"] = time.monotonic()
            log.info("%d of %s frames", done, total or "?")

    try:
        summary = predict(load_package(args.package, unpack_to=args.out / ".package"), args.input, args.out,
                          backend=args.backend, device=device, batch_size=args.batch_size,
                          overlays=not args.no_overlays, label_format=args.format, progress=progress)
    except (PackageError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "predicted", **summary.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
