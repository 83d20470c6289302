"""The installed toolchain works as the trainer will use it: Horovod with PyTorch over Gloo, 2 processes."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from tasks.processes import run_to_end

BIN = Path(sys.executable).parent


def test_horovod_check_build_lists_pytorch_and_gloo():
    out = run_to_end([str(BIN / "horovodrun"), "--check-build"], 600)
    assert out.returncode == 0, out.stderr
    assert "[X] PyTorch" in out.stdout and "[X] Gloo" in out.stdout


def test_horovodrun_two_processes_allreduce(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import horovod.torch as hvd, torch
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
        print(f"rank={hvd.rank()} size={hvd.size()} total={total.item():g}", flush=True)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    out = run_to_end([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script)],
                     600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "size=2 total=3" in out.stdout
    assert "rank=0" in out.stdout and "rank=1" in out.stdout
