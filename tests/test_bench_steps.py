"""The step benches run and keep their promises: bench/train_step.py gives every figure against this machine's own
limit (never above it), bf16 steps compute every convolution and matrix product in bf16 (no silent fp32 fallback in
the hot loop) and the profiler's top ops are in its output; bench/gpu.py's dry run exercises every configuration."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench.limits import GemmLimit, over_limit
from tasks.processes import run_to_end

REPO = Path(__file__).resolve().parents[1]


def test_the_train_step_bench_measures_every_configuration_against_this_machines_limit(tmp_path: Path) -> None:
    out = tmp_path / "train_step.json"
    # Its own calibration cache: what auto resolves to is measured here, not read from an older run's cache.
    done = run_to_end([sys.executable, str(REPO / "bench" / "train_step.py"), "--preset", "cpu-demo", "--steps", "1",
                       "--skip-loop", "--json", str(out)], 300,
                      env={**os.environ, "LANEFLOW_CACHE_DIR": str(tmp_path / "cache")}, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    figures = json.loads(out.read_text())
    assert figures["valid"] is True and figures["problems"] == []
    rows = figures["rows"]
    assert [(r["precision"], r["memory_format"]) for r in rows] == [
        (p, m) for p in ("fp32", "bf16") for m in ("contiguous", "channels_last")]
    for row in rows:
        assert row["gflop"] > 0 and row["ms_per_step"] > 0 and row["tflops"] > 0, row
        # A step is no faster than a plain matrix product in its dtype: a share above 1 is a mismeasured limit.
        assert 0 < row["share_of_gemm"] <= 1, row
        # Under bf16 autocast every convolution and matrix product computes in bf16; fp32 steps in none.
        assert row["flops_in_bf16"] == (1.0 if row["precision"] == "bf16" else 0.0), row
    # The limit is the best of samples spread through the run (before, between and after the rounds).
    for dtype, sampled in figures["gemm_samples"].items():
        assert len(sampled["samples_tflops"]) == 3 and sampled["best_tflops"] == max(sampled["samples_tflops"])
        assert figures["gemm_tflops"][dtype] == sampled["best_tflops"]
    # The profiler's top ops of the auto step, led by the convolutions that do the work.
    ops = figures["top_ops"]
    assert len(ops) == 8 and all(0 < op["self_cpu_share"] <= 1 and op["calls"] > 0 for op in ops), ops
    assert any("convolution" in op["name"] for op in ops[:3]), ops
    assert f"auto resolves to {figures['auto']}" in done.stdout and "calibration measured now" in done.stdout
    assert "load average before" in done.stdout


def test_a_share_above_the_machines_limit_is_refused_with_the_reason() -> None:
    limit = GemmLimit(("fp32", "bf16"), sizes=(128,), repeats=1)
    limit.sample()
    limit.sample()
    assert set(limit.best()) == {"fp32", "bf16"} and all(rate > 0 for rate in limit.best().values())
    assert limit.record()["fp32"]["best_tflops"] == max(limit.record()["fp32"]["samples_tflops"])
    [problem] = over_limit({"fp32/contiguous": 0.66, "bf16/channels_last": 1.46}, limit)
    assert problem.startswith("bf16/channels_last: 146 % of the GEMM rate, more than this machine does")
    assert "2 samples" in problem and "rerun it on a quiet machine" in problem
    with pytest.raises(RuntimeError, match=r"before any sample\(\): measure the rate first"):
        GemmLimit(("fp32",)).best()
    with pytest.raises(ValueError, match="no GEMM rate for dtype fp8: use fp32, bf16, fp16"):
        GemmLimit(("fp32", "fp8"))


def test_the_gpu_bench_dry_run_exercises_every_configuration_on_cpu(tmp_path: Path) -> None:
    bench = REPO / "bench" / "gpu.py"
    done = run_to_end([sys.executable, str(bench), "--dry-run", "--json", str(tmp_path / "gpu.json")], 600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())["results"]
    assert [(r["precision"], r["memory_format"]) for r in results] == [
        (p, m) for p in ("fp32", "bf16", "fp16") for m in ("contiguous", "channels_last")]
    assert all(r["img_per_s"] > 0 and 0 <= r["input_stall"] <= 1 for r in results)
