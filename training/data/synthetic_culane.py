"""Synthetic CULane-format data: road scenes in CULane's layout and scenarios, made offline and deterministically.

The CULane stand-in for the demo and the tests, as ``training.data.synthetic`` is TuSimple's: the same road
scenes (``make_scene``, ``render``) at 1640×590, written as the dataset ships (``training.data.culane``): frames
under ``driver_*_*frame/<clip>.MP4/``, a ``.lines.txt`` next to each, the segmentation labels of the training and
validation frames under ``laneseg_label_w16/``, and ``list/`` with ``train_gt.txt``, ``val_gt.txt``, ``test.txt``
and the nine scenario lists of ``test_split/``. Frames take the scenarios in turn, each made visible the way it
looks on the road: crowd (more cars), hlight (a glare), shadow (strong shadows), noline (worn marks, lanes still
labelled), arrow (an arrow painted in the ego lane), curve (a stronger bend), cross (a crossroads: no lanes) and
night (dark, bluish, noisy).

    python -m training.data.synthetic_culane --out data/culane-synth --train 90 --val 18 --test 27
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import sys
import tarfile
from pathlib import Path

import cv2
import numpy as np

from training.data.culane import (
    HEIGHT,
    LIST_DIR,
    SCENARIOS,
    SEG_LABEL_DIR,
    TEST_LIST,
    TEST_SPLIT_DIR,
    WIDTH,
    GtEntry,
    Point,
    existence_for,
    format_lines,
    gt_list_line,
    lines_path_for,
    seg_label,
    seg_label_path_for,
)
from training.data.fetch import sha256_of
from training.data.synthetic import LANE_WIDTH_M, Scene, depth_at_row, lateral_to_column, make_scene, render

log = logging.getLogger("laneflow.data.synthetic_culane")

#: The drivers' folders each split's frames go to, as in the release (training and validation share some).
DRIVERS = {"train": ("driver_23_30frame", "driver_161_90frame", "driver_182_30frame"),
           "val": ("driver_23_30frame",),
           "test": ("driver_37_30frame", "driver_100_30frame", "driver_193_90frame")}
FRAMES_PER_CLIP = 5
#: Clip numbers start here per split, so splits sharing a driver folder never share a clip.
_FIRST_CLIP = {"train": 0, "val": 50000, "test": 0}
_SPLIT_SEED = {"train": 10, "val": 11, "test": 12}
#: Lateral offsets (in lane widths) of the four slots' boundaries: the left lane's left, the ego lane's two,
#: the right lane's right.
SLOT_OFFSETS = (-1.5, -0.5, 0.5, 1.5)
ROW_STEP = 10


def frame_path(split: str, index: int) -> str:
    """The dataset-relative path of a split's ``index``-th frame."""
    drivers = DRIVERS[split]
    clip, frame = divmod(index, FRAMES_PER_CLIP)
    driver = drivers[clip % len(drivers)]
    return f"{driver}/{_FIRST_CLIP[split] + clip:08d}_0000.MP4/{frame * 30:05d}.jpg"


def scenario_of(index: int) -> str:
    """The scenarios in turn: the ``index``-th frame of a split shows this one."""
    return SCENARIOS[index % len(SCENARIOS)]


def slot_lanes(scene: Scene, width: int, height: int) -> list[list[Point]]:
    """The four slots' lanes: each slot's boundary, where the scene has it, as points every ``ROW_STEP`` rows from
    the bottom up, while visible and inside the image; a slot with fewer than two such points is empty."""
    rows = np.arange(height, 0, -ROW_STEP, dtype=np.float64)
    depth = depth_at_row(scene, rows)
    visible = np.isfinite(depth) & (depth <= scene.max_depth)
    slots: list[list[Point]] = []
    for offset in SLOT_OFFSETS:
        lateral = next((b for b in scene.boundaries if abs(b - offset * LANE_WIDTH_M) < 1e-6), None)
        if lateral is None:
            slots.append([])
            continue
        columns = lateral_to_column(scene, lateral, np.where(visible, depth, 1.0))
        inside = visible & (columns >= 0) & (columns < width)
        lane = [(round(float(x), 3), float(y)) for x, y, keep in zip(columns, rows, inside, strict=True) if keep]
        slots.append(lane if len(lane) >= 2 else [])
    return slots


def _draw_car(image: np.ndarray, scene: Scene, lateral: float, depth: float, colour: tuple[int, int, int]) -> None:
    row = scene.horizon + scene.focal * 1.5 / depth
    column = float(lateral_to_column(scene, lateral, np.asarray(depth)))
    half_width, height = scene.focal * 1.9 / depth / 2, scene.focal * 1.5 / depth
    cv2.rectangle(image, (int(column - half_width), int(row - height)), (int(column + half_width), int(row)),
                  colour, -1)


def _arrow(scene: Scene, depth: float) -> np.ndarray:
    """An arrow painted in the middle of the ego lane (lateral 0) at ``depth``, pointing ahead: its outline in
    image pixels, from (lateral, metres ahead) corners."""
    outline = [(-0.15, 0.0), (-0.15, 3.0), (-0.5, 3.0), (0.0, 5.0), (0.5, 3.0), (0.15, 3.0), (0.15, 0.0)]
    points = []
    for lateral, ahead in outline:
        z = np.asarray(depth + ahead)
        row = scene.horizon + scene.focal * 1.5 / float(z)
        points.append((float(lateral_to_column(scene, lateral, z)), row))
    return np.round(np.asarray(points)).astype(np.int32)


def render_scenario(scene: Scene, scenario: str, rng: np.random.Generator, width: int,
                    height: int) -> np.ndarray:
    """The scene rendered as ``scenario`` shows it (see the module docstring)."""
    if scenario == "noline":
        scene = dataclasses.replace(scene, styles=tuple((kind, (105, 105, 105)) for kind, _ in scene.styles))
    image = render(scene, rng, width, height)
    if scenario == "crowd":
        for _ in range(int(rng.integers(4, 8))):
            lane = int(rng.integers(0, len(scene.boundaries) - 1))
            lateral = (scene.boundaries[lane] + scene.boundaries[lane + 1]) / 2
            _draw_car(image, scene, lateral, float(rng.uniform(8.0, scene.max_depth * 0.8)),
                      tuple(int(v) for v in rng.integers(0, 255, size=3)))
    elif scenario == "hlight":
        column, row = int(rng.uniform(0.3, 0.7) * width), int(scene.horizon + rng.uniform(0, 0.1) * height)
        ys, xs = np.mgrid[0:height, 0:width]
        glare = 255 * np.exp(-((xs - column) ** 2 + (ys - row) ** 2) / (2 * (0.08 * width) ** 2))
        image = np.clip(image.astype(np.float64) + glare[..., None], 0, 255).astype(np.uint8)
    elif scenario == "shadow":
        shade = np.zeros((height, width), dtype=np.uint8)
        for _ in range(int(rng.integers(2, 5))):
            centre = (int(rng.uniform(0, width)), int(rng.uniform(scene.horizon + 10, height)))
            axes = (int(rng.uniform(0.1, 0.35) * width), int(rng.uniform(0.04, 0.12) * height))
            cv2.ellipse(shade, centre, axes, float(rng.uniform(-25, 25)), 0, 360, 1, -1)
        image[shade.astype(bool)] = (image[shade.astype(bool)] * 0.3).astype(np.uint8)
    elif scenario == "arrow":
        cv2.fillPoly(image, [_arrow(scene, float(rng.uniform(10.0, 20.0)))], (235, 235, 235))
    elif scenario == "cross":
        top = int(scene.horizon + rng.uniform(0.08, 0.2) * height)
        image[top:top + int(0.12 * height)] = int(rng.integers(70, 140))  # the crossing road, unmarked
    elif scenario == "night":
        dark = image.astype(np.float64) * rng.uniform(0.15, 0.3) * np.array([1.3, 0.9, 0.8])
        dark += rng.normal(0.0, 6.0, size=(height, width, 1))
        image = np.clip(dark, 0, 255).astype(np.uint8)
    return image


def generate_frame(seed: int, split: str, index: int, width: int = WIDTH,
                   height: int = HEIGHT) -> tuple[np.ndarray, list[list[Point]], str]:
    """One frame, its four slots' lanes and its scenario, determined by (seed, split, index) alone."""
    rng = np.random.default_rng([seed, _SPLIT_SEED[split], index])
    scenario = scenario_of(index)
    scene = make_scene(rng, width, height)
    if scenario == "curve":
        scene = dataclasses.replace(scene, curvature=float(np.sign(scene.curvature) or 1.0) * rng.uniform(0.002, 0.003))
    image = render_scenario(scene, scenario, rng, width, height)
    slots = [[] for _ in SLOT_OFFSETS] if scenario == "cross" else slot_lanes(scene, width, height)
    return image, slots, scenario


def generate(out: str | Path, *, train: int, val: int, test: int, seed: int = 0,
             jpeg_quality: int = 90) -> dict[str, int]:
    """Write a CULane-layout dataset under ``out``; returns how many frames each list names."""
    out = Path(out)
    lists: dict[str, list[str]] = {"train_gt.txt": [], "val_gt.txt": [], "train.txt": [], "val.txt": [],
                                   TEST_LIST: []}
    split_lists: dict[str, list[str]] = {name: [] for name in SCENARIOS}
    for split, count in (("train", train), ("val", val), ("test", test)):
        for index in range(count):
            image_path = frame_path(split, index)
            image, slots, scenario = generate_frame(seed, split, index)
            _write(out / image_path, _jpeg(image, jpeg_quality))
            lanes = [slot for slot in slots if slot]
            _write(out / lines_path_for(image_path), format_lines(lanes).encode())
            if split == "test":
                lists[TEST_LIST].append(f"/{image_path}")
                split_lists[scenario].append(f"/{image_path}")
                continue
            mask_path = seg_label_path_for(image_path)
            ok, png = cv2.imencode(".png", seg_label(slots))
            if not ok:
                raise RuntimeError(f"could not encode {mask_path}")
            _write(out / mask_path, png.tobytes())
            lists[f"{split}_gt.txt"].append(gt_list_line(GtEntry(image_path, mask_path, existence_for(slots))))
            lists[f"{split}.txt"].append(f"/{image_path}")
    for name, lines in lists.items():
        _write(out / LIST_DIR / name, "".join(f"{line}\n" for line in lines).encode())
    for index, name in enumerate(SCENARIOS):
        _write(out / LIST_DIR / TEST_SPLIT_DIR / f"test{index}_{name}.txt",
               "".join(f"{line}\n" for line in split_lists[name]).encode())
    log.info("wrote %s frames to %s", train + val + test, out)
    return {name: len(lines) for name, lines in lists.items() if name.endswith("_gt.txt") or name == TEST_LIST}


def pack_tar(folder: Path, archive: Path) -> str:
    """``folder`` (and everything under it, as ``<folder name>/...``) as a ``.tar.gz`` whose bytes depend on the
    files alone: sorted entries, no owners, fixed times. Returns its sha256."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".tmp")
    with partial.open("wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in [folder, *sorted(folder.rglob("*"))]:
            info = tar.gettarinfo(str(path), arcname=path.relative_to(folder.parent).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_dir():
                tar.addfile(info)
            else:
                with path.open("rb") as handle:
                    tar.addfile(info, handle)
    partial.replace(archive)
    return sha256_of(archive)


def pack_artifacts(dataset_dir: str | Path, out: str | Path) -> list[dict[str, str]]:
    """Pack a generated folder as CULane is shipped: a ``.tar.gz`` per driver folder (frames and lines files),
    ``laneseg_label_w16.tar.gz`` and ``list.tar.gz``, each wrapping its one folder. Returns each archive's
    path, sha256 and kind."""
    dataset_dir, out = Path(dataset_dir), Path(out)
    folders = sorted(path for path in dataset_dir.iterdir() if path.is_dir() and
                     (path.name.startswith("driver_") or path.name in (SEG_LABEL_DIR, LIST_DIR)))
    return [{"path": str(out / f"{folder.name}.tar.gz"), "sha256": pack_tar(folder, out / f"{folder.name}.tar.gz"),
             "kind": "archive"} for folder in folders]


def cached_artifacts(directory: Path, train: int, val: int, test: int, seed: int = 0) -> list[dict[str, str]]:
    """The synthetic CULane archives (``pack_artifacts``) in ``directory`` as ``url``/``sha256``/``kind`` dicts:
    made once, then reused."""
    folder = directory / f"culane-artifacts-seed{seed}-{train}-{val}-{test}"
    index = folder / "artifacts.json"
    if not index.exists():
        source = directory / f"culane-seed{seed}-{train}-{val}-{test}"
        generate(source, train=train, val=val, test=test, seed=seed)
        index.write_text(json.dumps(pack_artifacts(source, folder)))
    return [{"url": Path(item["path"]).resolve().as_uri(), "sha256": item["sha256"], "kind": item["kind"]}
            for item in json.loads(index.read_text())]


def _jpeg(image: np.ndarray, quality: int) -> bytes:
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("could not encode a frame as JPEG")
    return encoded.tobytes()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.data.synthetic_culane",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=90)
    parser.add_argument("--val", type=int, default=18)
    parser.add_argument("--test", type=int, default=27)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--archives", type=Path, help="also pack it here as CULane ships it (.tar.gz per folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    written = generate(args.out, train=args.train, val=args.val, test=args.test, seed=args.seed)
    print(" ".join(f"{name}={count}" for name, count in written.items()))
    if args.archives:
        for artifact in pack_artifacts(args.out, args.archives):
            print(f"{artifact['path']} {artifact['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
