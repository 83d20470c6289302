"""Input pipeline: prepared TuSimple list files -> batches of (uint8 image, mask, existence).

Fast where it matters on CPUs: JPEGs are decoded at reduced scale by libjpeg when the network input
is at most half the stored size (DCT scaling, several times cheaper than a full decode); samples stay
uint8 BGR until they reach the training step, which converts and normalizes them on the device in one
pass (4x less data through the DataLoader's shared memory); rotation and resizing are one affine warp;
OpenCV runs single-threaded inside each loader worker.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from training.cache import SampleCache, ensure_cache, open_cache

log = logging.getLogger("laneflow.dataset")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DataError(ValueError):
    """The prepared dataset is missing or unusable; the message says what to do."""


@dataclass(frozen=True)
class Sample:
    image: str
    mask: str
    existence: tuple[int, int, int, int]


def read_list(data_root: str | Path, split: str) -> list[Sample]:
    """Entries of ``seg_label/list/<split>_gt.txt``; clear errors for a missing root or an empty split."""
    root = Path(data_root)
    if not root.is_dir():
        raise DataError(f"data root {root} does not exist; prepare the dataset first "
                        "(python -m training.data.prepare ...)")
    path = root / "seg_label" / "list" / f"{split}_gt.txt"
    if not path.is_file():
        raise DataError(f"{path} does not exist: {root} is not a prepared dataset root "
                        "(it must hold seg_label/list/ and manifest.json)")
    samples = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 6 or any(flag not in ("0", "1") for flag in parts[2:]):
            raise DataError(f"{path}:{lineno}: expected '/<img> /<mask> e1 e2 e3 e4', got '{line}'")
        samples.append(Sample(parts[0].lstrip("/"), parts[1].lstrip("/"), tuple(int(f) for f in parts[2:])))
    if not samples:
        raise DataError(f"split '{split}' of {root} is empty ({path} lists no images); "
                        "check the preparation's quarantine report in manifest.json")
    return samples


def read_frames(data_root: Path, names: list[str]) -> list[np.ndarray]:
    """The frames ``names`` (relative to ``data_root``) as OpenCV decodes them (BGR); one that cannot be read is
    a clear error."""
    frames = []
    for name in names:
        frame = cv2.imread(str(Path(data_root) / name), cv2.IMREAD_COLOR)
        if frame is None:
            raise DataError(f"cannot read {Path(data_root) / name}")
        frames.append(frame)
    return frames


def reduced_read_flag(stored_width: int, target_width: int) -> tuple[int, int]:
    """The cheapest OpenCV colour read whose output is still at least ``target_width`` wide, and its factor."""
    for factor, flag in ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4),
                         (2, cv2.IMREAD_REDUCED_COLOR_2)):
        if stored_width // factor >= target_width:
            return flag, factor
    return cv2.IMREAD_COLOR, 1


class LaneDataset(Dataset):
    """Images resized to the network input, masks resized with nearest neighbour, optional small rotation."""

    def __init__(self, data_root: str | Path, split: str, input_size: tuple[int, int], *,
                 augment: bool = False, max_rotation_deg: float = 2.0, stored_width: int | None = None,
                 cache: bool = False):
        self.root = Path(data_root)
        self.samples = read_list(self.root, split)
        self.width, self.height = input_size
        self.augment = augment
        self.max_rotation_deg = max_rotation_deg
        if stored_width is None:
            first = cv2.imread(str(self.root / self.samples[0].image))
            if first is None:
                raise DataError(f"cannot read {self.root / self.samples[0].image}")
            stored_width = first.shape[1]
        self.read_flag, _ = reduced_read_flag(stored_width, self.width)
        self._cache_path: Path | None = None
        self._cache: SampleCache | None = None
        if cache:
            self._cache_path = self._prepare_cache(split)

    def _prepare_cache(self, split: str) -> Path | None:
        try:
            return ensure_cache(self.root, split, self.samples, (self.width, self.height), self.read_flag).path
        except (OSError, KeyError, ValueError) as exc:
            # A read-only volume or an unprepared root: decode on the fly, just slower.
            log.warning("decoded-sample cache unavailable (%s); decoding every epoch", exc)
            return None

    def _cached(self) -> SampleCache | None:
        # Opened lazily in each process: memory maps are not sent to loader workers, paths are.
        if self._cache is None and self._cache_path is not None:
            self._cache = open_cache(self._cache_path)
        return self._cache

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": None}

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int, rng: random.Random | None = None) -> tuple[np.ndarray, np.ndarray]:
        sample = self.samples[index]
        cached = self._cached()
        if cached is not None:
            image, mask = np.array(cached.images[index]), np.array(cached.masks[index])
        else:
            image = cv2.imread(str(self.root / sample.image), self.read_flag)
            mask = cv2.imread(str(self.root / sample.mask), cv2.IMREAD_UNCHANGED)
        if image is None or mask is None:
            raise DataError(f"cannot read {sample.image} or its mask {sample.mask} under {self.root}")
        size = (self.width, self.height)
        if not self.augment:
            if image.shape[:2] == (self.height, self.width):
                return image, mask
            return (cv2.resize(image, size, interpolation=cv2.INTER_LINEAR),
                    cv2.resize(mask, size, interpolation=cv2.INTER_NEAREST))
        # Rotation and resize in one pass each: a single affine map from source to network input.
        angle = (rng or random).uniform(-self.max_rotation_deg, self.max_rotation_deg)
        image = cv2.warpAffine(image, self._affine(image.shape, angle), size, flags=cv2.INTER_LINEAR,
                               borderMode=cv2.BORDER_REFLECT_101)
        mask = cv2.warpAffine(mask, self._affine(mask.shape, angle), size, flags=cv2.INTER_NEAREST, borderValue=0)
        return image, mask

    def _affine(self, shape: tuple[int, ...], angle: float) -> np.ndarray:
        """Scale a ``shape``-sized source to the input size, then rotate by ``angle`` about the centre."""
        scale = np.diag([self.width / shape[1], self.height / shape[0], 1.0])
        rotation = np.vstack([cv2.getRotationMatrix2D((self.width / 2, self.height / 2), angle, 1.0), [0, 0, 1]])
        return (rotation @ scale)[:2]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        image, mask = self.load(index)
        return (torch.from_numpy(image), torch.from_numpy(mask),
                torch.tensor(self.samples[index].existence, dtype=torch.float32))


def normalize(images: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format,
              mean_rgb: Sequence[float] = IMAGENET_MEAN, std_rgb: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """uint8 NHWC BGR batch (as OpenCV decodes) -> float NCHW RGB normalized with the model's statistics
    (``LaneModel.mean_rgb``/``std_rgb``; ImageNet's by default).

    One fused pass per channel (convert, reorder, scale, shift) on the batch's device, written straight into
    the layout the network runs in (no second copy for channels-last).
    """
    n, h, w, _ = images.shape
    out = torch.empty((n, 3, h, w), dtype=torch.float32, device=images.device, memory_format=memory_format)
    for rgb, (mean, std) in enumerate(zip(mean_rgb, std_rgb, strict=True)):
        torch.add(torch.tensor(-mean / std, device=images.device), images[..., 2 - rgb],
                  alpha=1.0 / (255.0 * std), out=out[:, rgb])
    return out


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start part-way through an epoch (resume after preemption)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, skip_batches: int = 0,
                 batch_size: int = 1):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = skip_batches * batch_size

    def __iter__(self):
        indices = list(super().__iter__())[self.skip:]
        self.skip = 0  # only the first (resumed) epoch is partial
        return iter(indices)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


def _worker_init(_: int) -> None:
    cv2.setNumThreads(1)


def make_loader(dataset: Dataset, batch_size: int, sampler: DistributedSampler | None, num_workers: int,
                pin_memory: bool) -> DataLoader:
    """Training loader: full batches only, so every rank takes the same number of steps."""
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False, drop_last=True,
                      num_workers=num_workers, pin_memory=pin_memory, worker_init_fn=_worker_init,
                      persistent_workers=num_workers > 0, prefetch_factor=4 if num_workers > 0 else None)


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return (num_samples // world_size) // batch_size


def poly_lr(step: int, total_steps: int, base_lr: float, warmup_steps: int, power: float = 0.9) -> float:
    """Linear warm-up to ``base_lr``, then polynomial decay to 0 at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * math.pow(1.0 - progress, power)
