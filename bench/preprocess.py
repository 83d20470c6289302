"""Preprocessing throughput: laneflow's preprocess vs a naive baseline, on the same synthetic set.

The baseline is what a first script usually does: serial, one image at a time, decode the whole
image to learn its size, draw the mask into a 3-channel float array, write it as PNG. Both produce
masks and list files for every label. Prints labels/s for each and the ratio (target >= 8x).

    .venv/bin/python bench/preprocess.py [--images 240] [--workers N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from training.data import labels
from training.data.preprocess import preprocess
from training.data.synthetic import generate


def naive_preprocess(root: Path) -> int:
    """The baseline: serial, full decode, float64 3-channel mask, default PNG writer."""
    out_dir = root / "naive_seg_label"
    lines = []
    for name in labels.LABEL_FILES:
        path = root / name
        if not path.exists():
            continue
        for text in path.read_text().splitlines():
            record = json.loads(text)
            image = cv2.imread(str(root / record["raw_file"]))
            height, width = image.shape[:2]
            mask = np.zeros((height, width, 3), dtype=np.float64)
            h_samples = record["h_samples"]
            lanes = tuple(tuple(lane) for lane in record["lanes"])
            slots = labels.assign_slots(lanes, tuple(h_samples))
            flags = []
            for slot, points in enumerate(slots):
                if len(points) < labels.MIN_POINTS_FOR_EXISTENCE:
                    flags.append("0")
                    continue
                for (x1, y1), (x2, y2) in itertools.pairwise(points):
                    cv2.line(mask, (int(x1), int(y1)), (int(x2), int(y2)), (slot + 1,) * 3, 15)
                flags.append("1")
            mask_path = out_dir / labels.mask_path_for(record["raw_file"])
            mask_path.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(mask_path), mask)
            lines.append(f"/{record['raw_file']} /{mask_path.relative_to(root)} {' '.join(flags)}")
    (out_dir / "list.txt").write_text("\n".join(lines) + "\n")
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=960, help="labelled images in the synthetic set")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laneflow-bench-") as tmp:
        root = Path(tmp) / "tusimple"
        n_val = n_test = args.images // 6
        generate(root, train=args.images - n_val - n_test, val=n_val, test=n_test, seed=0)
        # Warm the page cache for both contenders alike.
        for path in root.rglob("*.jpg"):
            path.read_bytes()

        started = time.perf_counter()
        naive_count = naive_preprocess(root)
        naive_seconds = time.perf_counter() - started
        shutil.rmtree(root / "naive_seg_label")

        started = time.perf_counter()
        report = preprocess(root, workers=args.workers, force=True)
        ours_seconds = time.perf_counter() - started
        assert report.counts["kept"] == naive_count, (report.counts, naive_count)

    naive_rate = naive_count / naive_seconds
    ours_rate = naive_count / ours_seconds
    print(f"labels                : {naive_count} at 1280x720")
    print(f"naive baseline        : {naive_rate:8.1f} labels/s  ({naive_seconds:.2f} s, serial)")
    print(f"laneflow preprocess   : {ours_rate:8.1f} labels/s  ({ours_seconds:.2f} s, {args.workers} workers)")
    print(f"ratio                 : {ours_rate / naive_rate:8.1f}x  (target >= 8x)")


if __name__ == "__main__":
    main()
