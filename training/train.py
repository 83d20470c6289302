"""Train a lane model with Horovod: ``python -m training.train`` (size 1) or under ``horovodrun -np N``.

Safe to retry: rank 0 alone writes checkpoints (atomically, every N steps and at epoch end) and the run
resumes from the newest valid one; a truncated checkpoint is skipped with a warning. SIGTERM (or SIGUSR1,
which mpirun forwards to every rank: ``training.stop_request``) makes every rank stop at the next agreed
check, rank 0 checkpoint, and the process exit with ``EXIT_PREEMPTED`` (75), which the orchestrator treats as
"retry me". A stop request left in the run directory (``stop-request.json``, written by the orchestrator: a
sweep's pruner) makes the run checkpoint and end with exit 0 and a ``stopped`` event instead: finished early
on purpose, not to be resumed. With ``eval_every`` rank 0 scores the val split every that many steps (``val``
events). Rank 0 prints one JSON object per line on stdout for the orchestrator (``step``, ``epoch``,
``checkpoint``, ``val``, ``eval``, ``preempted``, ``stopped``, ``done``), each recorded one with its ``time``
(Unix seconds); readable logs go to stderr. Rank 0 also writes the run's curves as TensorBoard scalars under
``<run-dir>/tensorboard/`` (``TensorBoardLog``).

    python -m training.train --data-root DIR --run-dir DIR --preset cpu-demo --set epochs=3 --set lr=0.05
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import cv2

from training.config import TRAIN_PRESETS, TrainConfig, parse_overrides
from training.dataset import DataError, ResumableDistributedSampler, make_loader, poly_lr, steps_per_epoch
from training.elastic import train_elastic
from training.ranks import launcher_rank
from training.run_parts import EXIT_PREEMPTED, RunParts, StepWindow, stop_as_requested
from training.stop_request import StopCadence, StopRequest, read_stop_request

log = logging.getLogger("laneflow.train")

__all__ = ["EXIT_CONFIG_ERROR", "EXIT_PREEMPTED", "main", "train"]

EXIT_CONFIG_ERROR = 2


def train(config: TrainConfig, data_root: Path, run_dir: Path, weights: Path | None = None) -> int:
    """Train (or resume) the run in ``run_dir``; what it opens (the TensorBoard writer) is closed on every
    way out: the end, a stop request, SIGTERM, an error such as divergence."""
    with contextlib.ExitStack() as closing:
        stop = StopRequest()  # first: a stop signal before its handler would end the process unsaved
        parts = RunParts.build(config, data_root, run_dir, weights, stop, closing)
        if config.elastic:
            return train_elastic(parts)
        return _train_fixed(parts)


def _train_fixed(parts: RunParts) -> int:
    """A run on a fixed number of ranks: every rank starts together and any rank's end ends the job."""
    config, dist, run_dir, stop = parts.config, parts.dist, parts.run_dir, parts.stop
    per_epoch = steps_per_epoch(len(parts.dataset), dist.size, config.batch_size)
    if per_epoch == 0:
        raise DataError(f"the train split has {len(parts.dataset)} images: too few for {dist.size} worker(s) "
                        f"x batch size {config.batch_size}; lower batch_size or add data")
    total_steps = per_epoch * config.epochs
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)
    lr = config.lr * dist.size  # linear scaling with the number of workers
    # Alone, there is nothing to reduce: skip Horovod's per-step round trip. Wrapped before the checkpoint is
    # loaded: Horovod's optimizer is a new one over the same parameters, without the momentum of the one it wraps.
    optimizer = parts.distributed_optimizer() if dist.size > 1 else parts.optimizer
    state = parts.resume(optimizer) if parts.is_main else None
    # Everyone learns rank 0's decision and starting point: the optimizer's state first (Horovod gives an empty
    # one its state by a local step, which moves the weights), then the weights, and the loss scale.
    step = int(dist.hvd.broadcast_object(state["step"] if state else 0, root_rank=0, name="resume_step"))
    dist.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dist.hvd.broadcast_parameters(parts.model.state_dict(), root_rank=0)
    parts.mixed.load_state_dict(dist.hvd.broadcast_object(parts.mixed.state_dict(), root_rank=0, name="scaler"))
    if parts.is_main:
        parts.write_config()
    parts.start_event(step, total_steps, state is not None)
    parts.model.train()
    sampler = ResumableDistributedSampler(parts.dataset, dist.size, dist.rank, config.seed, step % per_epoch,
                                          config.batch_size)
    loader = make_loader(parts.dataset, config.batch_size, sampler, config.num_workers, parts.device.type == "cuda")
    window, cadence = StepWindow(), StopCadence(step)
    while step < total_steps:
        epoch = step // per_epoch
        sampler.set_epoch(epoch)
        fetch_start = time.perf_counter()
        for images, masks, exist in loader:
            window.waited += time.perf_counter() - fetch_start
            for group in optimizer.param_groups:
                group["lr"] = poly_lr(step, total_steps, lr, config.warmup_steps)
            loss, loss_parts = parts.step(images, masks, exist, optimizer, step)
            step += 1
            window.images += images.shape[0]
            window.losses.append(loss.item())
            if step % config.log_every == 0 or step == total_steps:
                parts.record("step", step, **window.event(parts, step, epoch, optimizer.param_groups[0]["lr"],
                                                          loss_parts))
                window = StepWindow()
            if config.eval_every and step % config.eval_every == 0 and step < total_steps:
                window.started += parts.validate(step)
            if cadence.due(step):
                request = read_stop_request(run_dir) if parts.is_main else None
                signalled, asked = cadence.agree(dist, step, (stop.requested, request is not None))
                if signalled:
                    parts.checkpoint(step, optimizer)
                    parts.record("preempted", step, step=step)
                    # Every rank waits here until rank 0 has written it: mpirun ends the job when the first
                    # rank exits non-zero, which would kill rank 0 in the middle of its save.
                    dist.any((False,), "checkpointed")
                    return EXIT_PREEMPTED
                if asked and step < total_steps:  # at its end a run finishes: nothing is saved by stopping
                    return stop_as_requested(parts, step, optimizer, request)
            if step % config.checkpoint_every == 0:
                parts.checkpoint(step, optimizer)
            if step >= total_steps:
                break
            fetch_start = time.perf_counter()
        if step % per_epoch == 0 or step >= total_steps:
            parts.record("epoch", step, epoch=epoch, step=step)
            if step % config.checkpoint_every:
                parts.checkpoint(step, optimizer)
    return parts.finish(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", required=True, type=Path, help="prepared dataset root (with seg_label/)")
    parser.add_argument("--run-dir", required=True, type=Path, help="where checkpoints, metrics and model go")
    parser.add_argument("--preset", default="cpu-demo", help=f"one of {', '.join(TRAIN_PRESETS)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting, e.g. --set epochs=5 --set model.input_width=320")
    parser.add_argument("--weights", type=Path, help="backbone weights file for the run's model (optional): SCNN "
                        "takes VGG16-BN's, ufld torchvision's ResNet-18/34 (the model's load_backbone reads it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s rank" + launcher_rank(os.environ) + " %(name)s %(message)s")
    # OpenCV's own thread pool stays off in this process: loader workers are forked from it.
    cv2.setNumThreads(1)
    try:
        config = parse_overrides(args.preset, args.overrides)
        if args.weights and not args.weights.is_file():
            raise ValueError(f"weights file {args.weights} does not exist")
        return train(config, args.data_root, args.run_dir, args.weights)
    except (ValueError, DataError) as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
