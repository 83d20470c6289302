"""Synthetic TuSimple-format data: road scenes with labelled lanes, made offline and deterministically.

This is the stand-in for TuSimple in the demo and the tests. It writes the public layout
(``clips/<date>/<id>/20.jpg`` and the four label files) so that everything downstream handles real
TuSimple unchanged, and can pack it as a ``train_set.zip``-like archive whose bytes (and therefore
sha256) depend only on the seed and the options.

Scenes are rendered through a pinhole camera over a flat road: 2-5 lane boundaries with heading and
curvature, solid and dashed, white and yellow marks, tree shadows, cars occluding the marks, and
varied lighting. Labels are the exact projected lane centres at TuSimple's h_samples.

    python -m training.data.synthetic --out data/synth --train 200 --val 40 --test 40 --archive synth.zip
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from training.data.fetch import sha256_of
from training.data.labels import h_samples_for

log = logging.getLogger("laneflow.data.synthetic")

LANE_WIDTH_M = 3.7
CAMERA_HEIGHT_M = 1.5
MARK_WIDTH_M = 0.15
DASH_PERIOD_M = 12.0
DASH_ON_M = 3.0
ZIP_DATE = (1980, 1, 1, 0, 0, 0)

#: Which label file (and clip date folder) each split's images go to, as in the public release: the
#: test clips share date folders with training clips (0531, 0601), under other clip ids.
SPLIT_LAYOUT: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (("label_data_0313.json", "0313-1"), ("label_data_0601.json", "0601")),
    "val": (("label_data_0531.json", "0531"),),
    "test": (("test_label.json", "0530"), ("test_label.json", "0531"), ("test_label.json", "0601")),
}
_SPLIT_SEED = {"train": 0, "val": 1, "test": 2}
#: Clip ids start here per split, so splits sharing a date folder never share a clip.
_FIRST_CLIP_ID = {"train": 1000, "val": 1000, "test": 20000}
#: The three artifacts the benchmark ships (DESIGN §4).
TRAIN_ARCHIVE, TEST_ARCHIVE, TEST_LABELS, TEST_TASKS = "train_set.zip", "test_set.zip", "test_label.json", \
    "test_tasks_0627.json"


@dataclass(frozen=True)
class Scene:
    """The random choices behind one image (all in world units where it matters)."""

    horizon: float          # image row of the horizon
    focal: float            # focal length in px
    center_x: float         # principal point column
    camera_offset: float    # lateral offset of the camera inside the ego lane (m)
    heading: float          # dX/dz: yaw of the road relative to the camera
    curvature: float        # d2X/dz2 / 2
    max_depth: float        # how far the marks are visible (m)
    boundaries: tuple[float, ...]  # lateral positions of the lane boundaries (m), left to right
    styles: tuple[tuple[str, tuple[int, int, int]], ...]  # ("solid"|"dashed", BGR colour) per boundary
    dash_phase: float



def make_scene(rng: np.random.Generator, width: int, height: int) -> Scene:
    n_lanes = int(rng.integers(2, 6))
    left = [-LANE_WIDTH_M / 2]
    right = [LANE_WIDTH_M / 2]
    for _ in range(n_lanes - 2):
        if len(left) < 3 and (rng.random() < 0.5 or len(right) >= 3):
            left.insert(0, left[0] - LANE_WIDTH_M)
        else:
            right.append(right[-1] + LANE_WIDTH_M)
    boundaries = tuple(left + right)
    styles = []
    for i in range(len(boundaries)):
        outer = i in (0, len(boundaries) - 1)
        kind = "solid" if outer and rng.random() < 0.7 else ("dashed" if rng.random() < 0.75 else "solid")
        yellow = i == 0 and rng.random() < 0.3
        colour = (40, 190, 230) if yellow else tuple(int(v) for v in rng.integers(200, 256, size=3))
        styles.append((kind, colour))
    return Scene(
        horizon=height * float(rng.uniform(0.33, 0.42)),
        focal=width * float(rng.uniform(0.8, 1.0)),
        center_x=width / 2 + width * float(rng.uniform(-0.03, 0.03)),
        camera_offset=float(rng.uniform(-0.6, 0.6)),
        heading=float(rng.uniform(-0.04, 0.04)),
        curvature=float(rng.uniform(-0.0012, 0.0012)),
        max_depth=float(rng.uniform(55.0, 90.0)),
        boundaries=boundaries,
        styles=tuple(styles),
        dash_phase=float(rng.uniform(0, DASH_PERIOD_M)),
    )


def depth_at_row(scene: Scene, y: np.ndarray) -> np.ndarray:
    """Distance along the road seen at image row ``y`` (inf at or above the horizon)."""
    dy = y - scene.horizon
    with np.errstate(divide="ignore"):
        return np.where(dy > 0, scene.focal * CAMERA_HEIGHT_M / np.maximum(dy, 1e-9), np.inf)


def lateral_to_column(scene: Scene, lateral: float, z: np.ndarray) -> np.ndarray:
    """Image column of a boundary at lateral offset ``lateral`` seen at depth ``z``."""
    world_x = lateral - scene.camera_offset + scene.heading * z + scene.curvature * z * z
    return scene.center_x + scene.focal * world_x / z


def lane_labels(scene: Scene, width: int, height: int) -> list[list[int]]:
    """x of every boundary at the h_samples; -2 where beyond the visible depth or outside the image."""
    ys = np.asarray(h_samples_for(height), dtype=np.float64)
    z = depth_at_row(scene, ys)
    visible = np.isfinite(z) & (z <= scene.max_depth)
    lanes = []
    for lateral in scene.boundaries:
        xs = lateral_to_column(scene, lateral, np.where(visible, z, 1.0))
        xi = np.round(xs).astype(np.int64)
        ok = visible & (xi >= 0) & (xi < width)
        lanes.append([int(x) if good else -2 for x, good in zip(xi, ok, strict=True)])
    return lanes


def _road_polygon(scene: Scene, rows: np.ndarray, z: np.ndarray, lateral: float) -> np.ndarray:
    return np.stack([lateral_to_column(scene, lateral, z), rows], axis=1)


def render(scene: Scene, rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Render a BGR road image for ``scene``."""
    img = np.empty((height, width, 3), dtype=np.uint8)
    horizon = int(scene.horizon)
    # Sky: vertical gradient with a random tint.
    sky_top = rng.integers(150, 235, size=3)
    sky_bottom = np.minimum(sky_top + rng.integers(10, 40, size=3), 255)
    t = np.linspace(0, 1, max(horizon, 1), dtype=np.float32)[:, None]
    img[:horizon] = (sky_top * (1 - t) + sky_bottom * t).astype(np.uint8)[:, None, :]
    # Ground beside the road: grass or dirt.
    ground = rng.integers(40, 110, size=3)
    img[horizon:] = ground.astype(np.uint8)
    # A tree line at the horizon.
    tree_colour = tuple(int(v) for v in rng.integers(20, 70, size=3))
    for _ in range(int(rng.integers(8, 20))):
        cx = int(rng.integers(0, width))
        r = int(rng.integers(height // 40, height // 12))
        cv2.circle(img, (cx, horizon), r, tree_colour, -1)

    rows = np.arange(horizon + 1, height + 4, 3, dtype=np.float64)
    z = depth_at_row(scene, rows)
    near = z <= scene.max_depth * 2.5
    rows, z = rows[near], z[near]
    shoulder = float(rng.uniform(0.8, 2.5))
    left_edge = _road_polygon(scene, rows, z, scene.boundaries[0] - shoulder)
    right_edge = _road_polygon(scene, rows, z, scene.boundaries[-1] + shoulder)
    road = np.concatenate([left_edge, right_edge[::-1]]).round().astype(np.int32)
    asphalt = int(rng.integers(70, 140))
    cv2.fillPoly(img, [road], (asphalt, asphalt, asphalt + int(rng.integers(-8, 8))))

    # Lane marks as quads between consecutive rows; dashes gated by world distance.
    for lateral, (kind, colour) in zip(scene.boundaries, scene.styles, strict=True):
        xs = lateral_to_column(scene, lateral, z)
        half = np.maximum(scene.focal * MARK_WIDTH_M / 2 / z, 0.5)
        quads = []
        for i in range(len(rows) - 1):
            if z[i + 1] > scene.max_depth:
                continue
            if kind == "dashed" and ((z[i] + scene.dash_phase) % DASH_PERIOD_M) > DASH_ON_M:
                continue
            quads.append([[xs[i] - half[i], rows[i]], [xs[i] + half[i], rows[i]],
                          [xs[i + 1] + half[i + 1], rows[i + 1]], [xs[i + 1] - half[i + 1], rows[i + 1]]])
        if quads:
            cv2.fillPoly(img, list(np.round(np.asarray(quads)).astype(np.int32)), colour)

    # Cars occluding the marks.
    for _ in range(int(rng.integers(0, 3))):
        lane = int(rng.integers(0, len(scene.boundaries) - 1))
        lateral = (scene.boundaries[lane] + scene.boundaries[lane + 1]) / 2
        depth = float(rng.uniform(12.0, scene.max_depth * 0.8))
        row = scene.horizon + scene.focal * CAMERA_HEIGHT_M / depth
        col = float(lateral_to_column(scene, lateral, np.asarray(depth)))
        w = scene.focal * 1.9 / depth
        h = scene.focal * 1.5 / depth
        body = tuple(int(v) for v in rng.integers(0, 255, size=3))
        p1 = (int(col - w / 2), int(row - h))
        p2 = (int(col + w / 2), int(row))
        cv2.rectangle(img, p1, p2, body, -1)
        cv2.rectangle(img, (p1[0] + int(w * 0.15), p1[1] + int(h * 0.15)),
                      (p2[0] - int(w * 0.15), p1[1] + int(h * 0.45)), (30, 30, 30), -1)

    # Tree shadows across the road.
    shadow = np.zeros((height, width), dtype=np.uint8)
    for _ in range(int(rng.integers(0, 4))):
        cy = int(rng.uniform(scene.horizon + 10, height))
        cx = int(rng.uniform(0, width))
        axes = (int(rng.uniform(width * 0.05, width * 0.3)), int(rng.uniform(height * 0.02, height * 0.08)))
        cv2.ellipse(shadow, (cx, cy), axes, float(rng.uniform(-20, 20)), 0, 360, 1, -1)
    if shadow.any():
        darkness = float(rng.uniform(0.4, 0.75))
        img[shadow.astype(bool)] = (img[shadow.astype(bool)] * darkness).astype(np.uint8)

    # Lighting: gain, gamma and sensor noise, then a slight blur.
    gain = float(rng.uniform(0.6, 1.3))
    gamma = float(rng.uniform(0.7, 1.4))
    lut = np.clip(255.0 * ((np.arange(256) / 255.0) ** gamma) * gain, 0, 255).astype(np.uint8)
    img = cv2.LUT(img, lut)
    noise = rng.normal(0.0, float(rng.uniform(2.0, 7.0)), size=(height, width, 1)).astype(np.int16)
    img = np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return cv2.GaussianBlur(img, (3, 3), 0)


def generate_image(seed: int, split: str, index: int, width: int, height: int) -> tuple[np.ndarray, list[list[int]]]:
    """One (image, lanes) pair, determined by (seed, split, index) alone."""
    rng = np.random.default_rng([seed, _SPLIT_SEED[split], index])
    scene = make_scene(rng, width, height)
    return render(scene, rng, width, height), lane_labels(scene, width, height)


def generate(out: str | Path, *, train: int, val: int, test: int, seed: int = 0,
             width: int = 1280, height: int = 720, jpeg_quality: int = 90) -> dict[str, int]:
    """Write a TuSimple-layout dataset under ``out``; returns the number of images per label file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    h_samples = h_samples_for(height)
    written: dict[str, int] = {}
    for split, count in (("train", train), ("val", val), ("test", test)):
        layout = SPLIT_LAYOUT[split]
        lines: dict[str, list[str]] = {label_file: [] for label_file, _ in layout}
        for index in range(count):
            label_file, date = layout[index % len(layout)]
            raw_file = f"clips/{date}/{_FIRST_CLIP_ID[split] + index}/20.jpg"
            image, lanes = generate_image(seed, split, index, width, height)
            path = out / raw_file
            path.parent.mkdir(parents=True, exist_ok=True)
            ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
            if not ok:
                raise RuntimeError(f"could not encode {raw_file}")
            path.write_bytes(encoded.tobytes())
            lines[label_file].append(json.dumps({"lanes": lanes, "h_samples": h_samples, "raw_file": raw_file}))
        for label_file, label_lines in lines.items():
            (out / label_file).write_text("".join(line + "\n" for line in label_lines), encoding="utf-8")
            written[label_file] = len(label_lines)
    log.info("wrote %s images to %s", sum(written.values()), out)
    return written


def pack_archive(dataset_dir: str | Path, archive: str | Path, entries: dict[str, Path] | None = None) -> str:
    """Pack a TuSimple-layout folder as a zip with fixed timestamps; returns the archive's sha256.

    ``entries`` (archive name -> file) packs those instead of the whole folder. Entries are sorted and
    dated 1980-01-01 so equal inputs give byte-identical archives.
    """
    dataset_dir, archive = Path(dataset_dir), Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    if entries is None:
        entries = {p.relative_to(dataset_dir).as_posix(): p for p in dataset_dir.rglob("*") if p.is_file()}
    with zipfile.ZipFile(tmp, "w") as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.external_attr = 0o644 << 16
            # JPEGs are already compressed: storing them keeps packing and extraction fast.
            info.compress_type = zipfile.ZIP_STORED if name.endswith(".jpg") else zipfile.ZIP_DEFLATED
            with entries[name].open("rb") as src, zf.open(info, "w") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    tmp.replace(archive)
    return sha256_of(archive)



def _images_of(dataset_dir: Path, label_files: list[str]) -> list[str]:
    return [json.loads(line)["raw_file"] for name in label_files
            for line in (dataset_dir / name).read_text().splitlines() if line.strip()]


def pack_artifacts(dataset_dir: str | Path, out: str | Path) -> list[dict[str, str]]:
    """Pack a generated folder as the benchmark ships it: ``train_set.zip`` (training and validation clips
    with their three label files), ``test_set.zip`` (test clips and ``test_tasks_0627.json``: the test
    images' h_samples without lanes) and ``test_label.json`` as a file. Returns each artifact's path,
    sha256 and kind, in that order."""
    dataset_dir, out = Path(dataset_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_labels = ["label_data_0313.json", "label_data_0601.json", "label_data_0531.json"]
    tasks = [{key: record[key] for key in ("h_samples", "raw_file")} | {"lanes": []}
             for record in map(json.loads, (dataset_dir / TEST_LABELS).read_text().splitlines())]
    (out / TEST_TASKS).write_text("".join(json.dumps(task) + "\n" for task in tasks), encoding="utf-8")

    def entries(names: list[str]) -> dict[str, Path]:
        return {name: dataset_dir / name for name in names}

    train_sha = pack_archive(dataset_dir, out / TRAIN_ARCHIVE,
                             entries([*train_labels, *_images_of(dataset_dir, train_labels)]))
    test_sha = pack_archive(dataset_dir, out / TEST_ARCHIVE, {TEST_TASKS: out / TEST_TASKS,
                                                              **entries(_images_of(dataset_dir, [TEST_LABELS]))})
    labels = out / TEST_LABELS
    labels.write_bytes((dataset_dir / TEST_LABELS).read_bytes())
    return [{"path": str(out / TRAIN_ARCHIVE), "sha256": train_sha, "kind": "archive"},
            {"path": str(out / TEST_ARCHIVE), "sha256": test_sha, "kind": "archive"},
            {"path": str(labels), "sha256": sha256_of(labels), "kind": "file"}]


def labelled_video(data_root: str | Path, label_file: str, video: str | Path, count: int | None = None,
                   fps: float = 10.0) -> Path:
    """A lossless (FFV1) video of the labelled images of ``label_file`` (the first ``count``), and beside it
    ``<video>.labels.json``: their TuSimple label lines with ``raw_file`` renamed to the frames' names as
    ``laneflow predict`` gives them (``<video name>#<index>``). Returns the label file's path."""
    data_root, video = Path(data_root), Path(video)
    records = [json.loads(line) for line in (data_root / label_file).read_text().splitlines() if line.strip()]
    records = records[:count] if count else records
    if not records:
        raise ValueError(f"{data_root / label_file} has no labelled images to make a video of")
    first = cv2.imread(str(data_root / records[0]["raw_file"]))
    video.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"FFV1"), fps, (first.shape[1], first.shape[0]))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write an FFV1 video to {video}")
    for record in records:
        writer.write(cv2.imread(str(data_root / record["raw_file"])))
    writer.release()
    labels = video.with_name(video.name + ".labels.json")
    labels.write_text("".join(json.dumps({**record, "raw_file": f"{video.name}#{index}"}) + "\n"
                              for index, record in enumerate(records)), encoding="utf-8")
    return labels


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size '{text}' must look like WIDTHxHEIGHT, e.g. 1280x720") from None
    if width < 64 or height < 64:
        raise argparse.ArgumentTypeError(f"size '{text}' is too small; use at least 64x64")
    return width, height


def cached_archive(directory: Path, train: int, val: int, test: int, seed: int = 0) -> tuple[Path, str]:
    """A synthetic ``train_set.zip``-like archive in ``directory`` and its sha256: made once, then reused."""
    archive = directory / f"train_set-seed{seed}-{train}-{val}-{test}.zip"
    checksum_file = archive.with_name(archive.name + ".sha256")
    if not (archive.exists() and checksum_file.exists()):
        source_dir = directory / f"synthetic-seed{seed}-{train}-{val}-{test}"
        generate(source_dir, train=train, val=val, test=test, seed=seed)
        checksum_file.write_text(pack_archive(source_dir, archive) + "\n")
    return archive.resolve(), checksum_file.read_text().strip()


def cached_artifacts(directory: Path, train: int, val: int, test: int, seed: int = 0) -> list[dict[str, str]]:
    """The three synthetic artifacts (``pack_artifacts``) in ``directory``, as ``url``/``sha256``/``kind``
    dicts: made once, then reused."""
    folder = directory / f"artifacts-seed{seed}-{train}-{val}-{test}"
    index = folder / "artifacts.json"
    if not index.exists():
        source_dir = directory / f"synthetic-seed{seed}-{train}-{val}-{test}"
        if not (source_dir / TEST_LABELS).exists():
            generate(source_dir, train=train, val=val, test=test, seed=seed)
        packed = pack_artifacts(source_dir, folder)
        index.write_text(json.dumps(packed))
    return [{"url": Path(item["path"]).resolve().as_uri(), "sha256": item["sha256"], "kind": item["kind"]}
            for item in json.loads(index.read_text())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.data.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write the TuSimple layout into")
    parser.add_argument("--train", type=int, default=200, help="training images (default 200)")
    parser.add_argument("--val", type=int, default=40, help="validation images (default 40)")
    parser.add_argument("--test", type=int, default=40, help="test images (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=parse_size, default=(1280, 720), help="WIDTHxHEIGHT (default 1280x720)")
    parser.add_argument("--archive", type=Path, help="also pack the folder as this zip (train_set.zip-like)")
    parser.add_argument("--artifacts", type=Path, help="also pack it as the benchmark ships it, into this folder: "
                                                       "train_set.zip, test_set.zip and test_label.json")
    args = parser.parse_args(argv)
    for name in ("train", "val", "test"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    counts = generate(args.out, train=args.train, val=args.val, test=args.test, seed=args.seed,
                      width=args.size[0], height=args.size[1])
    print(json.dumps({"out": str(args.out), "images": counts}))
    if args.archive:
        digest = pack_archive(args.out, args.archive)
        print(json.dumps({"archive": str(args.archive), "sha256": digest}))
    if args.artifacts:
        print(json.dumps({"artifacts": pack_artifacts(args.out, args.artifacts)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
