"""Numeric precision, memory format, compilation and gradient compression: settings resolved for the machine.

- ``precision``: ``fp32`` | ``bf16`` | ``fp16`` | ``auto``. Mixed precision runs the forward pass under
  ``torch.autocast`` (weights, optimizer state and the loss stay fp32). ``fp16`` needs a gradient scaler
  (its loss scale is part of every checkpoint, so a resumed run keeps it); ``bf16`` has fp32's range and
  needs none.
- ``memory_format``: ``contiguous`` | ``channels_last`` | ``auto``: the layout of the activations. The
  weights stay contiguous whatever it says: Horovod allreduces only contiguous tensors (``mpi_ops.py``
  ``_check_function``), and oneDNN and cuDNN run a convolution channels-last when its input is.
- ``compile``: ``on`` | ``off`` | ``auto``: ``torch.compile`` of the network (``resolve_compile``).
- ``compression``: ``none`` | ``fp16`` — Horovod's gradient compression for the allreduce.

``auto`` is the fastest numerically safe choice on the machine the rank runs on:
- on a GPU, bf16 where it is native (Ampere and newer), fp16 elsewhere, and channels-last (cuDNN's
  convolutions prefer NHWC);
- on a CPU, the fast path the CPU should have — bf16 autocast and channels-last where it does bf16 natively
  (``training.cpu_features``), fp32 and channels-last elsewhere — once a short calibration (``training.calibration``,
  cached per machine and model) confirms it is at least ``MIN_GAIN`` times faster a step than fp32/contiguous;
  otherwise fp32/contiguous, so noise never moves a run off the plain path. A CPU that would emulate bf16 keeps
  fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from training.cpu_features import CpuFeatures, this_cpu

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")
COMPILES = ("auto", "on", "off")
COMPRESSIONS = ("none", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: How much faster than fp32/contiguous a calibrated candidate must be to be chosen.
MIN_GAIN = 1.1

#: A (precision, memory format) pair, e.g. ("bf16", "channels_last").
Combo = tuple[str, str]


@dataclass(frozen=True)
class Device:
    """What matters about the device for these choices."""

    type: str  # "cpu" | "cuda"
    bf16: bool  # bf16 arithmetic is native (Ampere and newer GPUs; CPUs with AMX, AVX512-BF16 or Arm BF16)
    name: str = ""  # the GPU's or CPU's model, for the reason a choice gives

    @classmethod
    def of(cls, device: torch.device, cpu: CpuFeatures | None = None) -> Device:
        if device.type == "cuda":
            return cls("cuda", bool(torch.cuda.is_bf16_supported()), torch.cuda.get_device_name(device))
        cpu = cpu or this_cpu()
        return cls(device.type, bool(cpu.native_bf16), cpu.model)


@dataclass(frozen=True)
class Numerics:
    """How a run computes, resolved from its settings on its device, with the reason (logged and recorded)."""

    precision: str
    memory_format: str  # "contiguous" | "channels_last"
    compile: bool = False
    reason: str = ""

    @property
    def torch_memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.memory_format == "channels_last" else torch.contiguous_format

    def record(self) -> dict[str, Any]:
        """The start event's and the lineage's fields."""
        return {"precision": self.precision, "memory_format": self.memory_format, "compile": self.compile,
                "numerics_reason": self.reason}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Numerics:
        return cls(str(record["precision"]), str(record["memory_format"]), bool(record.get("compile")),
                   str(record.get("numerics_reason") or ""))


@dataclass(frozen=True)
class Calibration:
    """Seconds per training step of each candidate on this machine, and where the figures came from."""

    seconds: Mapping[Combo, float]
    source: str  # "measured now" | "cached <path>"


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"setting '{name}' must be one of {', '.join(allowed)}, got '{value}'")
    return value


def cpu_candidates(precision: str, memory_format: str, device: Device) -> list[Combo]:
    """What a CPU calibration compares: the plain path (fp32, contiguous, where they are ``auto``) and the fast
    path the CPU should have (bf16 where native, channels-last) — the settings given staying as given. Two
    candidates, not every mix: a calibration under load (a busy CI machine) then costs seconds, not a minute."""
    slow = (precision if precision != "auto" else "fp32", memory_format if memory_format != "auto" else "contiguous")
    fast = (precision if precision != "auto" else "bf16" if device.bf16 else "fp32",
            memory_format if memory_format != "auto" else "channels_last")
    return [slow] if fast == slow else [slow, fast]


def label(combo: Combo) -> str:
    return f"{combo[0]}/{combo[1]}"


def fastest(calibration: Calibration, candidates: list[Combo]) -> tuple[Combo, str]:
    """The candidate to run with and why: the fastest, when it beats the baseline (the first) by ``MIN_GAIN``."""
    baseline = candidates[0]
    times = calibration.seconds
    best = min(candidates, key=lambda combo: times[combo])
    gain = times[baseline] / times[best]
    figures = ", ".join(f"{label(c)} {times[c] * 1000:.0f} ms" for c in sorted(candidates, key=lambda c: times[c]))
    if best == baseline or gain < MIN_GAIN:
        return baseline, (f"{label(baseline)}: nothing measured at least {MIN_GAIN}x faster a step ({figures}; "
                          f"calibration {calibration.source})")
    return best, f"{label(best)}: {gain:.2f}x faster a step than {label(baseline)} ({figures}; " \
                 f"calibration {calibration.source})"


def resolve(precision: str, memory_format: str, device: Device,
            calibrate: Callable[[list[Combo]], Calibration]) -> Numerics:
    """The precision and memory format a run uses on ``device``; ``calibrate`` times CPU candidates (called only
    when there is more than one). Explicit settings win."""
    _choice("precision", precision, PRECISIONS)
    _choice("memory_format", memory_format, MEMORY_FORMATS)
    if device.type == "cuda":
        chosen = precision if precision != "auto" else "bf16" if device.bf16 else "fp16"
        layout = memory_format if memory_format != "auto" else "channels_last"
        why = ("set" if precision != "auto" else f"{chosen} autocast: the fastest this GPU ({device.name}) does "
               f"{'natively' if device.bf16 else 'with a loss scale'}")
        return Numerics(chosen, layout, reason=f"{label((chosen, layout))}: {why}")
    candidates = cpu_candidates(precision, memory_format, device)
    if len(candidates) == 1:
        why = "set" if precision != "auto" else f"this CPU ({device.name}) has no native bf16 (it would be emulated, " \
                                                 "slower than fp32)"
        return Numerics(*candidates[0], reason=f"{label(candidates[0])}: {why}")
    chosen_combo, why = fastest(calibrate(candidates), candidates)
    if precision == "auto" and not device.bf16:
        why += f"; no bf16: this CPU ({device.name}) would emulate it"
    return Numerics(*chosen_combo, reason=why)


#: What ``compile: auto`` answers on CPUs from: ``bench/train_step.py --compile`` on a 2-core Intel Xeon with AMX,
#: torch 2.13, 2026-12-06 (bench/results/compile-cpu-demo-2026-12-06.json, docs/performance.md). The compiled step
#: was slower than eager, so compiling never pays back, whatever the run's length. Measure again with the bench
#: (``--compile --preset P``) before turning ``auto`` on for a CPU.
CPU_COMPILE_MEASURED = ("cpu-demo, bf16/channels_last, batch 4: compiled 94 ms a step against eager 58 ms after 127 s "
                        "of compiling (bench/results/compile-cpu-demo-2026-12-06.json)")


def resolve_compile(setting: str, device_type: str, elastic: bool) -> tuple[bool, str]:
    """Whether the network runs through ``torch.compile``, and why.

    ``auto`` is off: on CPUs the compiled step measured slower than eager (``CPU_COMPILE_MEASURED``; SCNN and UFLD
    alike in earlier runs), so the compile never pays back; on GPUs it is not measured yet. ``on`` is refused in
    elastic runs: a rank that joins would compile (minutes) while the others wait in the reset.
    """
    _choice("compile", setting, COMPILES)
    if setting == "on":
        if elastic:
            raise ValueError("setting 'compile=on' cannot be used with elastic=1: a rank that joins the run would "
                             "compile its graph while the others wait in their reset; use compile=off (or auto)")
        return True, "compile=on: set"
    if setting == "off":
        return False, "compile=off: set"
    if device_type == "cuda":
        return False, "compile=auto: off, not yet measured on GPUs (bench/gpu.py --compile measures it; set on to try)"
    return False, f"compile=auto: off, the compiled step measured slower than eager on a CPU ({CPU_COMPILE_MEASURED})"


def validate(precision: str, memory_format: str, compression: str, compile_setting: str = "auto") -> None:
    _choice("precision", precision, PRECISIONS)
    _choice("memory_format", memory_format, MEMORY_FORMATS)
    _choice("compression", compression, COMPRESSIONS)
    _choice("compile", compile_setting, COMPILES)


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
