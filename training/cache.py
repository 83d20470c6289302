"""Decoded-sample cache: images and masks of a split, resized to the network input, in two memory maps.

Decoding a 1280x720 JPEG and its mask PNG costs more than everything else a loader worker does, and a
training run decodes every image once per epoch. The cache decodes each image once, at the input
size, into ``images.u8`` (N x H x W x 3, BGR) and ``masks.u8`` (N x H x W) beside the dataset; loader
workers then read samples straight from the page cache. It is keyed by the dataset version (from
``manifest.json``), the split's list file and the input size, built in a staging folder and renamed
into place, and guarded by a file lock so concurrent ranks on one node build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from training.parallel import process_pool

log = logging.getLogger("laneflow.cache")

SCHEMA = 1


@dataclass(frozen=True)
class SampleCache:
    """Read-only views of a built cache."""

    path: Path
    images: np.ndarray  # (N, H, W, 3) uint8, memory-mapped
    masks: np.ndarray   # (N, H, W) uint8, memory-mapped


def cache_key(data_root: Path, split: str, size: tuple[int, int]) -> str:
    """Changes whenever what the cache would hold changes: dataset version, list file, input size."""
    manifest = json.loads((data_root / "manifest.json").read_text())
    listing = (data_root / "seg_label" / "list" / f"{split}_gt.txt").read_bytes()
    digest = hashlib.sha256(json.dumps([SCHEMA, manifest["dataset_version"], size]).encode() + listing)
    return f"{split}-{size[0]}x{size[1]}-{digest.hexdigest()[:16]}"


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_cache(path: Path) -> SampleCache:
    meta = json.loads((path / "meta.json").read_text())
    n, (width, height) = meta["count"], meta["size"]
    images = np.memmap(path / "images.u8", dtype=np.uint8, mode="r", shape=(n, height, width, 3))
    masks = np.memmap(path / "masks.u8", dtype=np.uint8, mode="r", shape=(n, height, width))
    return SampleCache(path, images, masks)


def ensure_cache(data_root: str | Path, split: str, samples: list, size: tuple[int, int],
                 read_flag: int, workers: int | None = None) -> SampleCache:
    """Open the split's cache, building it first if needed (once per node, whoever holds the lock)."""
    data_root = Path(data_root)
    cache_root = data_root / "cache"
    final = cache_root / cache_key(data_root, split, size)
    with _locked(cache_root / ".lock"):
        if not (final / "meta.json").is_file():
            _build(data_root, final, samples, size, read_flag, workers)
    return open_cache(final)


def _build(data_root: Path, final: Path, samples: list, size: tuple[int, int], read_flag: int,
           workers: int | None) -> None:
    width, height = size
    staging = final.with_name(final.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    n = len(samples)
    np.memmap(staging / "images.u8", dtype=np.uint8, mode="w+", shape=(n, height, width, 3)).flush()
    np.memmap(staging / "masks.u8", dtype=np.uint8, mode="w+", shape=(n, height, width)).flush()
    jobs = [(i, str(data_root / s.image), str(data_root / s.mask)) for i, s in enumerate(samples)]
    workers = max(1, min(workers or os.cpu_count() or 1, n))
    chunks = [jobs[i::workers] for i in range(workers)]
    args = [(str(staging), n, size, read_flag, chunk) for chunk in chunks]
    if workers == 1:
        _fill(*args[0])
    else:
        with process_pool(workers, preload=__name__) as pool:
            list(pool.map(_fill, *zip(*args, strict=True)))
    (staging / "meta.json").write_text(json.dumps({"schema": SCHEMA, "count": n, "size": [width, height],
                                                   "samples": [s.image for s in samples]}))
    os.replace(staging, final)
    log.info("cached %d decoded samples at %dx%d in %s", n, width, height, final)


def _fill(staging: str, n: int, size: tuple[int, int], read_flag: int, jobs: list[tuple[int, str, str]]) -> None:
    """Decode, resize and store a share of the samples (runs in a worker process)."""
    cv2.setNumThreads(1)
    width, height = size
    images = np.memmap(Path(staging) / "images.u8", dtype=np.uint8, mode="r+", shape=(n, height, width, 3))
    masks = np.memmap(Path(staging) / "masks.u8", dtype=np.uint8, mode="r+", shape=(n, height, width))
    for index, image_path, mask_path in jobs:
        image = cv2.imread(image_path, read_flag)
        mask = cv2.imread(mask_path, cv2.IMREAD_UNCHANGED)
        if image is None or mask is None:
            raise ValueError(f"cannot read {image_path} or its mask {mask_path}")
        images[index] = cv2.resize(image, size, interpolation=cv2.INTER_LINEAR)
        masks[index] = cv2.resize(mask, size, interpolation=cv2.INTER_NEAREST)
    images.flush()
    masks.flush()
