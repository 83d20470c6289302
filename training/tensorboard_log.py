"""The run's TensorBoard log: the scalars rank 0 writes under ``<run-dir>/tensorboard/`` and the writer.

Kept apart from the training loop: which metrics.jsonl fields become which TensorBoard tags is a naming
the orchestrator's MLflow tracking mirrors (tasks/tracking.py, held to it by tests/test_tracking.py), and the
writer's failure handling (never stop training) stands on its own.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("laneflow.train")  # the trainer's logger, as before the split: its lines read the same

#: Where in the run directory rank 0 writes TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: TensorBoard tag -> the field of a ``step`` event it plots.
TRAIN_SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/images_per_second": "img_per_s"}
#: ``<split>/`` + suffix -> the field of a ``val`` or ``eval`` event it plots.
SCORE_SCALARS = {"accuracy": "accuracy", "untimed_accuracy": "untimed_accuracy", "fp": "fp", "fn": "fn"}


def tensorboard_scalars(event: str, payload: dict, step: int) -> list[tuple[str, float, int]]:
    """The TensorBoard scalars ``(tag, value, global step)`` of one metrics.jsonl record: the same numbers.

    ``step`` events give ``train/loss``, ``train/lr`` and ``train/images_per_second`` (``img_per_s``);
    ``val`` events (every ``eval_every`` steps) give ``val/accuracy``, ``val/untimed_accuracy``, ``val/fp`` and
    ``val/fn``; the final ``eval`` event gives the same four under its split's name (``val/...`` by default,
    ``eval_split``), at the run's last step (``step``: the record carries none). Other events give none.
    """
    if event == "step":
        wanted = TRAIN_SCALARS
    elif event in ("val", "eval"):
        wanted = {f"{payload.get('split', 'val')}/{suffix}": key for suffix, key in SCORE_SCALARS.items()}
    else:
        return []
    at = int(payload.get("step", step))
    return [(tag, float(payload[key]), at) for tag, key in wanted.items() if key in payload]


class TensorBoardLog:
    """Rank 0's TensorBoard writer (``torch.utils.tensorboard.SummaryWriter``); a no-op on other ranks.

    Writing it never fails training: if the writer cannot be made (tensorboard missing, folder not
    writable) or a write fails, one warning is logged and the run goes on without it. Opened with
    ``purge_step`` = the step the run starts from + 1, so the points a killed attempt wrote after the
    checkpoint this attempt resumes from are hidden (TensorBoard shows each step once). Flushed at each
    record (log interval, checkpoint, val), closed when ``train`` ends on any path.
    """

    def __init__(self, writer: object | None = None, where: Path | None = None) -> None:
        self._writer, self._where = writer, where

    @classmethod
    def open(cls, log_dir: Path, start_step: int) -> TensorBoardLog:
        try:
            from torch.utils.tensorboard import SummaryWriter

            return cls(SummaryWriter(str(log_dir), purge_step=start_step + 1), log_dir)
        except Exception as exc:  # curves are a convenience, never a reason to stop
            log.warning("not writing TensorBoard files to %s (%s); training goes on without them", log_dir, exc)
            return cls()

    def write(self, event: str, payload: dict, step: int) -> None:
        if self._writer is None:
            return
        try:
            for tag, value, at in tensorboard_scalars(event, payload, step):
                self._writer.add_scalar(tag, value, at)
            self._writer.flush()
        except Exception as exc:
            self._give_up(exc)

    def close(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.close()
        except Exception as exc:
            self._give_up(exc)
        self._writer = None

    def _give_up(self, exc: Exception) -> None:
        log.warning("stopped writing TensorBoard files to %s (%s); training goes on without them", self._where, exc)
        self._writer = None

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
