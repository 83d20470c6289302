"""The run's checkpoints under ``<run-dir>/checkpoints/``: atomic writes, the newest few kept, resume.

Kept apart from the training loop: what a checkpoint holds and how the newest valid one is found is
the retry contract (rank 0 writes, a truncated file is skipped), read by tests and tools on its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from training.model import ModelConfig

log = logging.getLogger("laneflow.train")  # the trainer's logger, as before the split: its lines read the same

KEEP_CHECKPOINTS = 3


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}.pt"


def save_checkpoint(run_dir: Path, state: dict) -> Path:
    """Write atomically (temp file + rename) and keep the newest few."""
    path = checkpoint_path(run_dir, state["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    for old in sorted(path.parent.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(run_dir: Path) -> dict | None:
    """The newest checkpoint that loads; unreadable (e.g. truncated) ones are skipped with a warning."""
    for path in sorted((run_dir / "checkpoints").glob("step-*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or "model" not in state or "step" not in state:
                raise ValueError("not a laneflow checkpoint")
            return state | {"path": str(path)}
        except Exception as exc:
            log.warning("skipping unreadable checkpoint %s (%s)", path, exc)
    return None


def check_compatible(state: dict, model_cfg: ModelConfig, path: str) -> None:
    saved = state.get("model_config")
    if saved != asdict(model_cfg):
        raise ValueError(f"checkpoint {path} was written for a different model ({saved}); this run uses "
                         f"{asdict(model_cfg)}. Use a new run dir, or the preset and overrides it was trained with.")
