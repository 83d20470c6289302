"""The installed toolchain works as the trainer will use it: Horovod with PyTorch over Gloo (local runs) and,
where OpenMPI is installed, over MPI (what the training image's launcher runs), 2 processes each."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.processes import run_to_end

BIN = Path(sys.executable).parent


def test_horovod_check_build_lists_pytorch_and_gloo():
    out = run_to_end([str(BIN / "horovodrun"), "--check-build"], 600)
    assert out.returncode == 0, out.stderr
    assert "[X] PyTorch" in out.stdout and "[X] Gloo" in out.stdout


def _allreduce_script(tmp_path: Path) -> Path:
    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import horovod.torch as hvd, torch
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
        print(f"rank={hvd.rank()} size={hvd.size()} total={total.item():g}", flush=True)
    """))
    return script


@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_horovodrun_two_processes_allreduce(tmp_path: Path, controller: str) -> None:
    if controller == "--mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI is not installed (scripts/bootstrap.sh installs openmpi-bin as root)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    out = run_to_end([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", controller, sys.executable,
                      str(_allreduce_script(tmp_path))], 600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "size=2 total=3" in out.stdout
    assert "rank=0" in out.stdout and "rank=1" in out.stdout
    if controller == "--mpi":  # mpirun --tag-output: the prefix tasks/launch.py reads on a cluster
        assert "[1,0]<stdout>:rank=0" in out.stdout


def test_horovod_is_built_with_mpi_where_openmpi_is_installed() -> None:
    if shutil.which("mpicc") is None:
        pytest.skip("OpenMPI's development files are not installed: Horovod is built with Gloo only")
    out = run_to_end([str(BIN / "horovodrun"), "--check-build"], 600)
    assert "[X] MPI" in out.stdout, out.stdout
