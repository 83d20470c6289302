"""``make clean`` removes caches only; ``make clean-work`` deletes the demo's work only when confirmed — run as a
user runs them, on a copy of the project's Makefile and script (never this checkout's own caches)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import PROJECT_ROOT


def _project(tmp_path: Path) -> tuple[Path, Path]:
    """A project copy with caches, and a demo folder with trained work in it (as make demo and make serve leave)."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "Makefile", root / "Makefile")
    shutil.copy(PROJECT_ROOT / "scripts" / "clean.py", root / "scripts" / "clean.py")
    for cache in (".pytest_cache/v", ".ruff_cache/0.1", "flows/__pycache__", "training/data/__pycache__"):
        (root / cache).mkdir(parents=True)
        (root / cache / "x").write_text("cached")
    (root / "flows" / "train.py").write_text("# code\n")
    demo = root / ".laneflow" / "demo"
    for work in ("home/volumes/tusimple/runs/train-1/checkpoints", "home/volumes/tusimple/datasets/v1",
                 "home/volumes/tusimple/downloads", "home/snapshots/snap-1/content", "prefect", "source",
                 "home/volumes/tusimple/__pycache__"):
        (demo / work).mkdir(parents=True)
    (demo / "prefect" / "prefect.db").write_text("history")
    return root, demo


def _make(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(root), *args], capture_output=True, text=True,
                          timeout=120)


def test_make_clean_removes_caches_and_keeps_volumes_snapshots_and_history(tmp_path: Path) -> None:
    root, demo = _project(tmp_path)
    done = _make(root, "clean")
    assert done.returncode == 0, done.stdout + done.stderr
    for cache in (".pytest_cache", ".ruff_cache", "flows/__pycache__", "training/data/__pycache__"):
        assert not (root / cache).exists(), cache
    assert (root / "flows" / "train.py").is_file()
    for work in ("home/volumes/tusimple/runs/train-1/checkpoints", "home/volumes/tusimple/datasets/v1",
                 "home/volumes/tusimple/downloads", "home/snapshots/snap-1/content", "prefect/prefect.db", "source",
                 "home/volumes/tusimple/__pycache__"):
        assert (demo / work).exists(), work
    assert "kept: volumes, snapshots and the Prefect history" in done.stdout


def test_make_clean_work_lists_what_it_would_delete_and_deletes_only_when_confirmed(tmp_path: Path) -> None:
    root, demo = _project(tmp_path)
    asked = _make(root, "clean-work")
    assert asked.returncode != 0
    assert "would delete" in asked.stdout and "volume tusimple: 1 run(s), 1 prepared dataset(s)" in asked.stdout
    assert "snapshot snap-1" in asked.stdout and "the Prefect server's history" in asked.stdout
    assert "make clean-work CONFIRM=yes" in asked.stderr
    assert (demo / "home" / "volumes" / "tusimple" / "runs" / "train-1").is_dir()
    assert (demo / "prefect" / "prefect.db").is_file()
    confirmed = _make(root, "clean-work", "CONFIRM=yes")
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    assert not (demo / "home" / "volumes" / "tusimple").exists()
    assert not (demo / "home" / "snapshots" / "snap-1").exists()
    assert not (demo / "prefect").exists() and not (demo / "source").exists()
    assert (root / ".pytest_cache").exists()  # caches are make clean's
