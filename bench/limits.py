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
