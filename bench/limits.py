"""What a training step is measured against: its FLOPs by dtype (PyTorch's flop counter's formulas) and the
machine's own GEMM rate per dtype. Shared by bench/train_step.py (CPUs) and bench/gpu.py (GPUs)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

GEMM_SIZES = (2048, 3072, 4096)
CPU = torch.device("cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FlopsByDtype(TorchDispatchMode):
    """FLOPs of every op PyTorch's flop counter knows (convolutions, matrix products), summed by the dtype of
    the op's first tensor argument — the dtype the op computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            first = next(a for a in args if isinstance(a, torch.Tensor))
            self.flops[str(first.dtype).removeprefix("torch.")] += int(count(*args, **kwargs, out_val=out))
        return out


def gemm_tflops(dtype_name: str, device: torch.device = CPU, sizes: tuple[int, ...] = GEMM_SIZES,
                repeats: int = 4) -> tuple[float, int]:
    """The device's best square-matrix-product rate in ``dtype_name`` (TFLOP/s) over a few sizes (its kernels
    peak at different sizes per dtype), and the size that gave it."""
    rates = []
    for n in sizes:
        a = torch.randn(n, n, device=device).to(DTYPES[dtype_name])
        b = torch.randn(n, n, device=device).to(DTYPES[dtype_name])
        torch.mm(a, b)  # kernels chosen, memory touched
        best = min(timed(lambda: torch.mm(a, b), device) for _ in range(repeats))  # noqa: B023 (called at once)
        rates.append((2 * n**3 / best / 1e12, n))
    return max(rates)


def timed(work: Callable[[], object], device: torch.device = CPU) -> float:
    """Seconds ``work`` takes on ``device`` (a GPU's queue drained before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


class GemmLimit:
    """The machine's GEMM rate per dtype: the best of samples taken before, between and after a bench's timed steps.

    The limit is the most the machine's matrix units give PyTorch, so the best sample is the limit. One sample taken
    while other work loaded the machine reads low and makes a step look faster than the machine (a run under load
    once printed shares of 146 % and 154 %); samples spread through the run make that unlikely, and ``over_limit``
    catches what is left."""

    def __init__(self, dtypes: tuple[str, ...], device: torch.device = CPU, sizes: tuple[int, ...] = GEMM_SIZES,
                 repeats: int = 4) -> None:
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"no GEMM rate for dtype {', '.join(unknown)}: use {', '.join(DTYPES)}")
        self.device, self.sizes, self.repeats = device, sizes, repeats
        self.samples: dict[str, list[tuple[float, int]]] = {dtype: [] for dtype in dtypes}

    def sample(self) -> None:
        """One more measurement of every dtype's rate."""
        for dtype, taken in self.samples.items():
            taken.append(gemm_tflops(dtype, self.device, self.sizes, self.repeats))

    def best(self) -> dict[str, float]:
        """Each dtype's best rate (TFLOP/s) so far."""
        if not all(self.samples.values()):
            raise RuntimeError("GemmLimit.best() before any sample(): measure the rate first")
        return {dtype: max(taken)[0] for dtype, taken in self.samples.items()}

    def describe(self) -> str:
        return ", ".join(f"{dtype} {max(taken)[0]:.2f} TFLOP/s (n={max(taken)[1]}; {len(taken)} samples "
                         f"{min(taken)[0]:.2f}-{max(taken)[0]:.2f})" for dtype, taken in self.samples.items())

    def record(self) -> dict[str, dict[str, object]]:
        """For a bench's JSON: each dtype's best rate, the size that gave it, and every sample."""
        return {dtype: {"best_tflops": round(max(taken)[0], 3), "n": max(taken)[1],
                        "samples_tflops": [round(rate, 3) for rate, _ in taken]}
                for dtype, taken in self.samples.items()}


def over_limit(shares: dict[str, float], limit: GemmLimit) -> list[str]:
    """The figures (name -> share of its dtype's GEMM rate) that claim more than the machine does, each explained:
    a training step cannot beat a plain matrix product, so such a share means the limit was measured under load."""
    return [f"{name}: {100 * share:.0f} % of the GEMM rate, more than this machine does; the limit's samples "
            f"({limit.describe()}) were taken while other work loaded the machine: rerun it on a quiet machine"
            for name, share in shares.items() if share > 1.0]
