"""Preprocessing throughput: laneflow's preprocess vs the plain way a careful engineer writes it, on one set.

The baseline (``careful_baseline``) is what a good first script does, nothing wasted: the image size
from the JPEG header (Pillow reads only the header), a uint8 single-channel mask, the lanes drawn with
``cv2.line(mask, p[j], p[j+1], slot, 15)`` exactly as the seed's ``gen_seg_label`` does, written with
``cv2.imwrite``. It runs twice: serially, and with the same number of worker processes as laneflow, so
the two ratios separate what comes from the algorithm (ours vs the parallel baseline) from what comes
from parallelism (parallel baseline vs serial). The baseline's masks are checked to be identical to
laneflow's, so both did the same work. laneflow does more besides: it checks every record and image,
hashes every kept image into the dataset version and writes the manifest.

    .venv/bin/python bench/preprocess.py [--images 960] [--workers N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from training.data import labels
from training.data.preprocess import preprocess
from training.data.synthetic import generate

BASELINE = ("careful baseline: Pillow header read for the size, uint8 single-channel mask, cv2.line thickness 15 "
            "between consecutive points (the seed's gen_seg_label), cv2.imwrite PNG")
OUT = "baseline_seg_label"


def baseline_one(root: Path, text: str) -> str:
    """One label line → its mask on disk and its list line (the baseline's whole per-image work)."""
    record = json.loads(text)
    with Image.open(root / record["raw_file"]) as image:  # reads the header, not the pixels
        width, height = image.size
    mask = np.zeros((height, width), dtype=np.uint8)
    slots = labels.assign_slots(tuple(tuple(lane) for lane in record["lanes"]), tuple(record["h_samples"]))
    flags = []
    for slot, points in enumerate(slots, start=1):
        if len(points) < labels.MIN_POINTS_FOR_EXISTENCE:
            flags.append("0")
            continue
        for (x1, y1), (x2, y2) in itertools.pairwise(points):
            cv2.line(mask, (int(x1), int(y1)), (int(x2), int(y2)), slot, labels.thickness_for(width))
        flags.append("1")
    mask_file = labels.mask_path_for(record["raw_file"])
    target = root / OUT / mask_file
    target.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(target), mask)
    return f"/{record['raw_file']} /{mask_file} {' '.join(flags)}"


def _baseline_chunk(args: tuple[str, list[str]]) -> list[str]:
    root, lines = args
    return [baseline_one(Path(root), text) for text in lines]


def careful_baseline(root: Path, workers: int) -> int:
    """Every label line of every label file; ``workers`` > 1 spreads them over that many processes."""
    lines = [text for name in labels.LABEL_FILES if (root / name).exists()
             for text in (root / name).read_text().splitlines() if text.strip()]
    if workers <= 1:
        listed = [baseline_one(root, text) for text in lines]
    else:
        chunk = max(1, len(lines) // (workers * 8))
        chunks = [(str(root), lines[i:i + chunk]) for i in range(0, len(lines), chunk)]
        with ProcessPoolExecutor(workers, mp_context=get_context("forkserver")) as pool:
            listed = [line for part in pool.map(_baseline_chunk, chunks) for line in part]
    (root / OUT / "list.txt").write_text("\n".join(listed) + "\n")
    return len(listed)


def masks_identical(root: Path) -> bool:
    """The baseline's masks equal laneflow's, pixel for pixel (so both did the same work)."""
    ours = sorted((root / "seg_label").rglob("*.png"))
    return bool(ours) and all(
        np.array_equal(cv2.imread(str(path), cv2.IMREAD_UNCHANGED),
                       cv2.imread(str(root / OUT / path.relative_to(root)), cv2.IMREAD_UNCHANGED))
        for path in ours)


def timed(run) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=960, help="labelled images in the synthetic set")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laneflow-bench-") as tmp:
        root = Path(tmp) / "tusimple"
        n_val = n_test = args.images // 6
        generate(root, train=args.images - n_val - n_test, val=n_val, test=n_test, seed=0)
        for path in root.rglob("*.jpg"):  # warm the page cache for every contender alike
            path.read_bytes()

        serial_s, count = timed(lambda: careful_baseline(root, 1))
        shutil.rmtree(root / OUT)
        parallel_s, parallel_count = timed(lambda: careful_baseline(root, args.workers))
        ours_s, report = timed(lambda: preprocess(root, workers=args.workers, force=True))
        assert report.counts["kept"] == count == parallel_count, (report.counts, count, parallel_count)
        if not masks_identical(root):
            raise SystemExit("the baseline's masks differ from laneflow's: the comparison would be meaningless")

    def rate(seconds: float) -> float:
        return count / seconds

    print(f"baseline: {BASELINE}")
    print(f"labels                      : {count} at 1280x720 (masks identical to laneflow's: checked)")
    print(f"careful baseline, serial    : {rate(serial_s):8.1f} labels/s  ({serial_s:.2f} s, 1 process)")
    print(f"careful baseline, parallel  : {rate(parallel_s):8.1f} labels/s  ({parallel_s:.2f} s, "
          f"{args.workers} processes)")
    print(f"laneflow preprocess         : {rate(ours_s):8.1f} labels/s  ({ours_s:.2f} s, {args.workers} processes)")
    print(f"ratio vs parallel baseline  : {parallel_s / ours_s:8.2f}x  (same processes: the algorithm's share)")
    print(f"ratio vs serial baseline    : {serial_s / ours_s:8.2f}x  (algorithm and parallelism together)")
    print(f"parallel / serial baseline  : {serial_s / parallel_s:8.2f}x  (parallelism alone)")


if __name__ == "__main__":
    main()
