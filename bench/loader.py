"""Input pipeline throughput: laneflow's loader vs a naive per-sample cv2 pipeline, same DataLoader settings.

Naive (the seed's transform chain): full-resolution decode, colour conversion, resize, rotation,
float32 normalization per sample in the worker. Ours: each image decoded once (at reduced JPEG scale)
into the decoded-sample cache, then per epoch only the rotation, with uint8 samples normalized per
batch in the consumer (included in the timing). Both run under the same DataLoader settings. The first
epoch (for ours including the one-time cache build) and the later epochs are reported apart.

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


def epoch_seconds(loader: DataLoader, normalize_batches: bool, epochs: int) -> list[float]:
    """Wall time of each epoch, from asking for the first batch to the last one normalized (the first epoch
    also starts the loader workers and reads the files into the page cache)."""
    seconds = []
    for _ in range(epochs):
        started = time.perf_counter()
        for batch, _, _ in loader:
            if normalize_batches:
                batch = normalize(batch)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--preset", default="tusimple")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3, help="epochs timed; the first is reported on its own")
    parser.add_argument("--prefetch", type=int, default=4, help="DataLoader prefetch_factor, both sides")
    args = parser.parse_args()
    config = model_config(args.preset)
    size = (config.input_width, config.input_height)
    with tempfile.TemporaryDirectory(prefix="laneflow-loader-") as tmp:
        root = Path(tmp) / "tusimple"
        generate(root, train=args.images, val=0, test=0, seed=0)
        preprocess(root)
        # The same DataLoader settings for both: workers, prefetch, persistence, shuffling, batches.
        common = {"batch_size": args.batch_size, "num_workers": args.workers, "persistent_workers": True,
                  "prefetch_factor": args.prefetch, "shuffle": True, "drop_last": True}
        naive = epoch_seconds(DataLoader(NaiveDataset(root, size), **common), False, args.epochs)
        started = time.perf_counter()
        ours_dataset = LaneDataset(root, "train", size, augment=True, cache=True)
        build_seconds = time.perf_counter() - started
        ours = epoch_seconds(DataLoader(ours_dataset, **common), True, args.epochs)
    per_epoch = args.images // args.batch_size * args.batch_size

    def rate(seconds: list[float]) -> float:
        return per_epoch * len(seconds) / sum(seconds)

    naive_first, naive_warm = rate(naive[:1]), rate(naive[1:])
    ours_first, ours_warm = per_epoch / (ours[0] + build_seconds), rate(ours[1:])
    print("baseline: the seed's transform chain per sample in the loader workers (full-resolution decode, "
          "colour conversion, resize, rotation, float32 normalization); both sides with the same DataLoader "
          f"settings: {args.workers} workers, prefetch_factor {args.prefetch}, persistent workers, batch "
          f"{args.batch_size}")
    print(f"input {size[0]}x{size[1]} from 1280x720 JPEGs, {per_epoch} images per epoch, {args.epochs} epochs")
    print(f"naive per-sample cv2  : first epoch {naive_first:7.1f} img/s | later epochs {naive_warm:7.1f} img/s")
    print(f"laneflow loader       : first epoch {ours_first:7.1f} img/s | later epochs {ours_warm:7.1f} img/s  "
          f"(the first includes building the decoded-sample cache: {build_seconds:.1f} s)")
    print(f"ratio                 : first epoch {ours_first / naive_first:7.2f}x    | later epochs "
          f"{ours_warm / naive_warm:7.2f}x")


if __name__ == "__main__":
    main()
