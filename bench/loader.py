"""Input pipeline throughput: laneflow's loader vs a naive per-sample cv2 pipeline, same DataLoader settings.

Naive (the seed's transform chain): full-resolution decode, colour conversion, resize, rotation,
float32 normalization per sample in the worker. Ours: each image decoded once (at reduced JPEG scale)
into the decoded-sample cache, then per epoch only the rotation, with uint8 samples normalized per
batch in the consumer (included in the timing). Steady-state epochs are compared; the one-time cache
build is printed beside them. Target >= 3x.

    .venv/bin/python bench/loader.py [--images 200] [--preset tusimple] [--workers 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.dataset import IMAGENET_MEAN, IMAGENET_STD, LaneDataset, normalize, read_list
from training.model import model_config


class NaiveDataset(Dataset):
    def __init__(self, root: Path, size: tuple[int, int]):
        self.root, self.samples, self.size = root, read_list(root, "train"), size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        sample = self.samples[index]
        image = cv2.cvtColor(cv2.imread(str(self.root / sample.image)), cv2.COLOR_BGR2RGB)
        mask = cv2.imread(str(self.root / sample.mask), cv2.IMREAD_UNCHANGED)
        # The seed's order: resize, then rotate, then normalize, one sample at a time.
        image = cv2.resize(image, self.size)
        mask = cv2.resize(mask, self.size, interpolation=cv2.INTER_NEAREST)
        w, h = self.size
        rotation = cv2.getRotationMatrix2D((w / 2, h / 2), random.uniform(-2, 2), 1.0)
        image = cv2.warpAffine(image, rotation, (w, h))
        mask = cv2.warpAffine(mask, rotation, (w, h), flags=cv2.INTER_NEAREST)
        image = (image.astype(np.float32) / 255.0 - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD,
                                                                                                     np.float32)
        return (torch.from_numpy(image.transpose(2, 0, 1).copy()), torch.from_numpy(mask).long(),
                torch.tensor(sample.existence, dtype=torch.float32))


def throughput(loader: DataLoader, normalize_batches: bool, epochs: int) -> float:
    images = 0
    started = None
    for epoch in range(epochs + 1):
        for batch, _, _ in loader:
            if normalize_batches:
                batch = normalize(batch)
            if epoch == 0:
                continue  # warm-up epoch: workers start, page cache fills
            started = started or time.perf_counter()
            images += batch.shape[0]
    return images / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--preset", default="tusimple")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    config = model_config(args.preset)
    size = (config.input_width, config.input_height)
    with tempfile.TemporaryDirectory(prefix="laneflow-loader-") as tmp:
        root = Path(tmp) / "tusimple"
        generate(root, train=args.images, val=0, test=0, seed=0)
        preprocess(root)
        common = {"batch_size": args.batch_size, "num_workers": args.workers, "persistent_workers": True,
                  "shuffle": True, "drop_last": True}
        naive = throughput(DataLoader(NaiveDataset(root, size), **common), False, args.epochs)
        started = time.perf_counter()
        ours_dataset = LaneDataset(root, "train", size, augment=True, cache=True)
        build_seconds = time.perf_counter() - started
        ours = throughput(DataLoader(ours_dataset, prefetch_factor=4, **common), True, args.epochs)
    print(f"input {size[0]}x{size[1]} from 1280x720 JPEGs, batch {args.batch_size}, {args.workers} loader workers")
    print(f"naive per-sample cv2  : {naive:8.1f} img/s")
    print(f"laneflow loader       : {ours:8.1f} img/s  (cache built once in {build_seconds:.1f} s)")
    print(f"ratio                 : {ours / naive:8.1f}x  (target >= 3x)")


if __name__ == "__main__":
    main()
