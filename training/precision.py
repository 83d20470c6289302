"""Numeric precision, memory format and gradient compression: settings resolved for the device found.

- ``precision``: ``fp32`` | ``bf16`` | ``fp16`` | ``auto``. Mixed precision runs the forward pass under
  ``torch.autocast`` (weights, optimizer state and the loss stay fp32). ``fp16`` needs a gradient scaler
  (its loss scale is part of every checkpoint, so a resumed run keeps it); ``bf16`` has fp32's range and
  needs none. ``auto`` is the fastest safe choice: ``bf16`` on a GPU that supports it, ``fp16`` on other
  GPUs, ``fp32`` on CPUs (where autocast is slower than fp32 on most processors).
- ``memory_format``: ``contiguous`` | ``channels_last`` | ``auto`` (channels-last on GPUs, where cuDNN's
  convolutions prefer NHWC, contiguous on CPUs).
- ``compression``: ``none`` | ``fp16`` — Horovod's gradient compression for the allreduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")
COMPRESSIONS = ("none", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Device:
    """What matters about the device for these choices."""

    type: str  # "cpu" | "cuda"
    bf16: bool  # bf16 arithmetic is native (Ampere and newer GPUs)

    @classmethod
    def of(cls, device: torch.device) -> Device:
        if device.type == "cuda":
            return cls("cuda", bool(torch.cuda.is_bf16_supported()))
        return cls(device.type, False)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"setting '{name}' must be one of {', '.join(allowed)}, got '{value}'")
    return value


def resolve_precision(setting: str, device: Device) -> str:
    """The precision a run uses on ``device`` (``auto`` resolved)."""
    _choice("precision", setting, PRECISIONS)
    if setting != "auto":
        return setting
    if device.type == "cuda":
        return "bf16" if device.bf16 else "fp16"
    return "fp32"


def resolve_memory_format(setting: str, device: Device) -> torch.memory_format:
    _choice("memory_format", setting, MEMORY_FORMATS)
    if setting == "auto":
        setting = "channels_last" if device.type == "cuda" else "contiguous"
    return torch.channels_last if setting == "channels_last" else torch.contiguous_format


def validate(precision: str, memory_format: str, compression: str) -> None:
    _choice("precision", precision, PRECISIONS)
    _choice("memory_format", memory_format, MEMORY_FORMATS)
    _choice("compression", compression, COMPRESSIONS)


class MixedPrecision:
    """Autocast and (for fp16) loss scaling around a training step, with the scaler's state for checkpoints.

    With Horovod's ``DistributedOptimizer``, fp16 gradients are allreduced before the scaler looks at
    them (``synchronize``), so every rank agrees on whether a step overflowed and is skipped.
    """

    def __init__(self, precision: str, device_type: str) -> None:
        self.precision = precision
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        dtype = _DTYPES.get(self.precision)
        with torch.autocast(self.device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
            yield

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, distributed: bool) -> None:
        if not self.scaler.is_enabled():
            loss.backward()
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        if distributed:
            optimizer.synchronize()  # type: ignore[attr-defined]
            with optimizer.skip_synchronize():  # type: ignore[attr-defined]
                self.scaler.step(optimizer)
        else:
            self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        """The loss scaler's state (None without one): saved with every checkpoint."""
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state: dict[str, Any] | None) -> str:
        """Resume the scaler from a checkpoint written in any precision; returns what happened, for the log."""
        if not self.scaler.is_enabled():
            return "no loss scaler in this precision" + (" (the checkpoint's is dropped)" if state else "")
        if not state:
            return "the checkpoint has no loss scale (another precision): starting a fresh scaler"
        self.scaler.load_state_dict(state)
        return f"loss scale {self.scaler.get_scale():g} resumed"
