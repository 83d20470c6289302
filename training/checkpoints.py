"""The run's checkpoints under ``<run-dir>/checkpoints/``: atomic writes, the newest few kept, resume.

Kept apart from the training loop: what a checkpoint holds and how the newest valid one is found is
the retry contract (rank 0 writes, a truncated file is skipped), read by tests and tools on its own.

Nothing here is unpickled: a checkpoint lies on a volume others can write to (another pod on the claim, an NFS
client the export admits, a restored snapshot), so it is read with ``weights_only=True`` — tensors, numbers,
strings and containers of them, which is all the trainer writes. A file whose pickle names anything else (code
to run on load) is refused and the run fails naming it, rather than skipped: skipping would quietly start the run
over.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import asdict
from pathlib import Path

import torch

from training.models import DEFAULT_MODEL
from training.models.base import ModelSettings

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


class UnsafeCheckpoint(ValueError):
    """A file on the run's volume whose pickle holds more than data: loading it could run code."""


def load_weights(path: Path, map_location: torch.device | str = "cpu") -> object:
    """``torch.load`` of data only; a pickle that names code raises ``UnsafeCheckpoint`` naming the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only load failed" not in str(exc).lower():
            raise  # a damaged file, not a refused one
        refused = str(exc).split("\n\n")[1:2] or [str(exc)[:300]]
        raise UnsafeCheckpoint(
            f"{path} holds objects other than tensors and plain data ({refused[0].strip()[:300]}): laneflow does not "
            "load it, since loading it could run code. laneflow never writes such a file; if you did not put it "
            "there, someone with write access to the volume did: check who can write to it, then delete the file "
            "(training resumes from the checkpoint before it, or starts over)") from None


def load_latest_checkpoint(run_dir: Path) -> dict | None:
    """The newest checkpoint that loads; unreadable (e.g. truncated) ones are skipped with a warning, one that
    would run code on load stops the run (``UnsafeCheckpoint``)."""
    for path in sorted((run_dir / "checkpoints").glob("step-*.pt"), reverse=True):
        try:
            state = load_weights(path)
            if not isinstance(state, dict) or "model" not in state or "step" not in state:
                raise ValueError("not a laneflow checkpoint")
            return state | {"path": str(path)}
        except UnsafeCheckpoint:
            raise
        except Exception as exc:
            log.warning("skipping unreadable checkpoint %s (%s)", path, exc)
    return None


def recorded_model(state: dict) -> str:
    """The model a checkpoint or ``model.pt`` was written by: its ``model_name``; SCNN's before there were others."""
    return str(state.get("model_name") or DEFAULT_MODEL)


def check_compatible(state: dict, model_name: str, model_cfg: ModelSettings, path: str) -> None:
    if recorded_model(state) != model_name:
        raise ValueError(f"checkpoint {path} was written by model '{recorded_model(state)}'; this run trains "
                         f"'{model_name}'. Use a new run dir, or the model it was trained with.")
    saved = state.get("model_config")
    if saved != asdict(model_cfg):
        raise ValueError(f"checkpoint {path} was written for a different model ({saved}); this run uses "
                         f"{asdict(model_cfg)}. Use a new run dir, or the preset and overrides it was trained with.")


def check_same_data(state: dict, dataset_version: str | None, path: str) -> None:
    """A run resumed on other data than its checkpoint was trained on would be recorded as trained on the new data
    alone (a run key reused after a new dataset drop): refused. Checkpoints from before versions were kept, and
    data without a manifest, say nothing and resume."""
    saved = state.get("dataset_version")
    if saved and dataset_version and saved != dataset_version:
        raise ValueError(f"checkpoint {path} was trained on dataset version {saved}; this run trains on version "
                         f"{dataset_version}, and its lineage would say it was trained on that alone. Train in a new "
                         "run (another run_key), or on the dataset version it was trained on")
