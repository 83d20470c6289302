"""Train SCNN with Horovod: ``python -m training.train`` (size 1) or under ``horovodrun -np N``.

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
import hashlib
import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import cv2
import torch

from training import precision
from training.checkpoints import check_compatible, load_latest_checkpoint, save_checkpoint
from training.config import TRAIN_PRESETS, TrainConfig, parse_overrides
from training.dataset import (
    DataError,
    LaneDataset,
    ResumableDistributedSampler,
    make_loader,
    normalize,
    poly_lr,
    steps_per_epoch,
)
from training.evaluate import evaluate_run, score_split
from training.model import SCNN, SCNNLoss, TrainingDiverged, load_backbone_weights, model_config
from training.precision import MixedPrecision
from training.ranks import launcher_rank
from training.stop_request import STOP_CHECK_EVERY, STOP_REQUEST, StopRequest, read_stop_request
from training.tensorboard_log import TENSORBOARD_DIR, TensorBoardLog

log = logging.getLogger("laneflow.train")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request, resumable
EXIT_CONFIG_ERROR = 2


# --- distributed helpers -------------------------------------------------------------------------

class Distributed:
    """The little of Horovod the trainer needs; size 1 when run plainly."""

    def __init__(self, cycle_time_ms: float = 0.0) -> None:
        import horovod.torch as hvd

        if cycle_time_ms and "HOROVOD_CYCLE_TIME" not in os.environ:
            # Horovod's background thread coordinates ranks once per cycle even when idle; on a few
            # CPU cores that steals time from training. An explicit HOROVOD_CYCLE_TIME wins.
            os.environ["HOROVOD_CYCLE_TIME"] = str(cycle_time_ms)
        self.hvd = hvd
        hvd.init()
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()

    def average(self, value: float, name: str) -> float:
        if self.size == 1:
            return value
        return float(self.hvd.allreduce(torch.tensor([value]), name=name, op=self.hvd.Average))

    def average_buffers(self, model: torch.nn.Module) -> None:
        """Average BatchNorm running statistics: gradients keep parameters in step, not these buffers.

        Called before every checkpoint and at the end, so what is saved (and what every rank holds
        then) reflects all ranks' data.
        """
        if self.size == 1:
            return
        # One grouped collective, not one round trip per buffer: VGG16-BN has 26 of them, and each
        # synchronous allreduce waits out a Horovod cycle (half a second per checkpoint on CPUs).
        buffers = [buffer for buffer in model.buffers() if buffer.is_floating_point()]
        if buffers:
            self.hvd.grouped_allreduce_(buffers, op=self.hvd.Average, name="buffers")

    def any(self, flags: tuple[bool, ...], name: str) -> tuple[bool, ...]:
        """For each flag, whether any rank raised it (one allreduce for all of them)."""
        if self.size == 1:
            return flags
        summed = self.hvd.allreduce(torch.tensor([float(flag) for flag in flags]), name=name, op=self.hvd.Sum)
        return tuple(bool(value > 0) for value in summed)


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def emit(event: str, **payload: object) -> None:
    """One JSON line for the orchestrator (rank 0 only, by the callers)."""
    print(json.dumps({"event": event, **payload}), flush=True)



# --- training ------------------------------------------------------------------------------------
def train_step(model: torch.nn.Module, images: torch.Tensor, masks: torch.Tensor, exist: torch.Tensor,
               criterion: SCNNLoss, optimizer: torch.optim.Optimizer, mixed: MixedPrecision,
               memory_format: torch.memory_format, distributed: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """One SGD step on a uint8 batch: moved without blocking, normalised on the device, forward in the
    run's precision, loss in fp32. Shared with bench/gpu.py so the bench times what training runs."""
    device = next(model.parameters()).device
    batch = normalize(images.to(device, non_blocking=True)).contiguous(memory_format=memory_format)
    with mixed.autocast():
        logits, existence = model(batch)
    loss, parts = criterion(logits.float(), existence.float(), masks.to(device, non_blocking=True),
                            exist.to(device, non_blocking=True))
    optimizer.zero_grad()  # set_to_none is torch's default; Horovod's wrapper takes no arguments
    mixed.backward_and_step(loss, optimizer, distributed)
    return loss, parts


def train(config: TrainConfig, data_root: Path, run_dir: Path, weights: Path | None = None) -> int:
    """Train (or resume) the run in ``run_dir``; what it opens (the TensorBoard writer) is closed on every
    way out: the end, a stop request, SIGTERM, an error such as divergence."""
    with contextlib.ExitStack() as closing:
        return _train(config, data_root, run_dir, weights, closing)


def _train(config: TrainConfig, data_root: Path, run_dir: Path, weights: Path | None,
           closing: contextlib.ExitStack) -> int:
    stop = StopRequest()  # first: a stop signal before its handler would end the process unsaved
    dist = Distributed(config.cycle_time_ms)
    is_main = dist.rank == 0
    torch.manual_seed(config.seed)
    random.seed(config.seed + dist.rank)  # augmentation in the main process (loader workers are seeded by torch)
    device = torch.device(f"cuda:{dist.local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick the fastest kernels once
    found = precision.Device.of(device)
    run_precision = precision.resolve_precision(config.precision, found)
    memory_format = precision.resolve_memory_format(config.memory_format, found)
    mixed = MixedPrecision(run_precision, device.type)
    model_cfg = model_config(config.preset, **config.model_overrides)
    dataset = LaneDataset(data_root, "train", (model_cfg.input_width, model_cfg.input_height), augment=True,
                          cache=config.cache)
    per_epoch = steps_per_epoch(len(dataset), dist.size, config.batch_size)
    if per_epoch == 0:
        raise DataError(f"the train split has {len(dataset)} images: too few for {dist.size} worker(s) "
                        f"x batch size {config.batch_size}; lower batch_size or add data")
    total_steps = per_epoch * config.epochs
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)

    model = SCNN(model_cfg).to(device, memory_format=memory_format)
    if weights:
        count = load_backbone_weights(model, weights)
        log.info("loaded %d backbone tensors from %s", count, weights)
    lr = config.lr * dist.size  # linear scaling with the number of workers
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum,
                                weight_decay=config.weight_decay, nesterov=True)
    step = 0
    state = load_latest_checkpoint(run_dir) if is_main else None
    if is_main and state is not None:
        check_compatible(state, model_cfg, state["path"])
    # Everyone learns rank 0's decision and starting point.
    step = int(dist.hvd.broadcast_object(state["step"] if state else 0, root_rank=0, name="resume_step"))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        log.info("resuming from %s at step %d (written in %s; %s)", state["path"], step,
                 state.get("precision", "fp32"), mixed.load_state_dict(state.get("scaler")))
    dist.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    dist.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if dist.size > 1:  # alone, there is nothing to reduce: skip Horovod's per-step round trip
        compression = dist.hvd.Compression.fp16 if config.compression == "fp16" else dist.hvd.Compression.none
        optimizer = dist.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                  groups=config.allreduce_groups or None, compression=compression)

    criterion = SCNNLoss(check_finite=run_precision != "fp16")
    metrics_file = run_dir / "metrics.jsonl"
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({"train": asdict(config), "model": asdict(model_cfg),
                                                          "world_size": dist.size}, indent=2))
    board = closing.enter_context(TensorBoardLog.open(run_dir / TENSORBOARD_DIR, step) if is_main
                                  else TensorBoardLog())

    def record(event: str, **payload: object) -> None:
        if is_main:
            # When it happened (Unix seconds): wall time, time to an accuracy and the curves over time of
            # `laneflow compare` come from these, whichever machine or pod the run's attempts ran on.
            stamped = {**payload, "time": round(time.time(), 3)}
            emit(event, **stamped)
            with metrics_file.open("a") as handle:
                handle.write(json.dumps({"event": event, **stamped}) + "\n")
            board.write(event, payload, step)

    def checkpoint() -> None:
        dist.average_buffers(model)  # a collective: every rank calls checkpoint() at the same steps
        if is_main:
            path = save_checkpoint(run_dir, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "model_config": asdict(model_cfg), "train_config": asdict(config), "world_size": dist.size,
                "precision": run_precision, "scaler": mixed.state_dict(),
            })
            record("checkpoint", step=step, path=str(path))

    if is_main and (stale := read_stop_request(run_dir)) is not None:
        # Left by a request this run's previous attempt never saw: the orchestrator asks again if it still wants.
        log.warning("ignoring a stop request left from an earlier attempt: %s", stale)
        (run_dir / STOP_REQUEST).unlink(missing_ok=True)
    record("start", step=step, total_steps=total_steps, world_size=dist.size, resumed=state is not None,
           precision=run_precision, memory_format="channels_last" if memory_format == torch.channels_last
           else "contiguous", device=device.type)
    model.train()
    sampler = ResumableDistributedSampler(dataset, dist.size, dist.rank, config.seed, step % per_epoch,
                                          config.batch_size)
    loader = make_loader(dataset, config.batch_size, sampler, config.num_workers, device.type == "cuda")
    # A step event's window runs from the event before it, across epoch ends (their checkpoint and the
    # loader's restart are training time too): summed, the windows cover every step of the attempt.
    window_start, waited, images_seen, losses = time.perf_counter(), 0.0, 0, []
    while step < total_steps:
        epoch = step // per_epoch
        sampler.set_epoch(epoch)
        fetch_start = time.perf_counter()
        for images, masks, exist in loader:
            waited += time.perf_counter() - fetch_start
            for group in optimizer.param_groups:
                group["lr"] = poly_lr(step, total_steps, lr, config.warmup_steps)
            try:
                loss, parts = train_step(model, images, masks, exist, criterion, optimizer, mixed, memory_format,
                                         distributed=dist.size > 1)
            except TrainingDiverged as exc:  # exit 2: running it again diverges again
                raise TrainingDiverged(f"{exc} at step {step + 1}, learning rate {optimizer.param_groups[0]['lr']:.4g} "
                                       f"(lr {config.lr} x {dist.size} worker(s), poly schedule): lower lr") from None
            step += 1
            images_seen += images.shape[0]
            losses.append(loss.item())
            if step % config.log_every == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_start
                record("step", step=step, epoch=epoch, loss=dist.average(sum(losses) / len(losses), "loss"),
                       lr=optimizer.param_groups[0]["lr"], img_per_s=images_seen * dist.size / elapsed,
                       input_stall=waited / elapsed, seconds=round(elapsed, 6), **parts)
                window_start, waited, images_seen, losses = time.perf_counter(), 0.0, 0, []
            if config.eval_every and step % config.eval_every == 0 and step < total_steps:
                scoring_started = time.perf_counter()
                dist.average_buffers(model)  # a collective: every rank reaches it at the same step
                if is_main:
                    scores = score_split(model, model_cfg, data_root, "val", device)
                    record("val", step=step, **{k: v for k, v in scores.items() if k != "split"})
                model.train()
                window_start += time.perf_counter() - scoring_started  # img/s counts training time only
            if step % STOP_CHECK_EVERY == 0:
                request = read_stop_request(run_dir) if is_main else None
                signalled, asked = dist.any((stop.requested, request is not None), "stop")
                if signalled:
                    checkpoint()
                    record("preempted", step=step)
                    # Every rank waits here until rank 0 has written it: mpirun ends the job when the first
                    # rank exits non-zero, which would kill rank 0 in the middle of its save.
                    dist.any((False,), "checkpointed")
                    return EXIT_PREEMPTED
                if asked and step < total_steps:  # at its end a run finishes: nothing is saved by stopping
                    checkpoint()
                    if is_main:
                        log.info("stopping at step %d as requested: %s", step, request)
                        record("stopped", step=step, **request)
                        (run_dir / STOP_REQUEST).unlink(missing_ok=True)
                    return 0
            if step % config.checkpoint_every == 0:
                checkpoint()
            if step >= total_steps:
                break
            fetch_start = time.perf_counter()
        if step % per_epoch == 0 or step >= total_steps:
            record("epoch", epoch=epoch, step=step)
            if step % config.checkpoint_every:
                checkpoint()

    dist.average_buffers(model)
    if is_main and (late := read_stop_request(run_dir)) is not None:  # came after the last check: the run is done
        log.info("a stop request came after the last check; the run trained to its end: %s", late)
        (run_dir / STOP_REQUEST).unlink(missing_ok=True)
    # Every rank reports what it ended with: diverged replicas would show here first.
    log.info("final weights sha256 %s (rank %d)", weights_digest(model), dist.rank)
    if is_main:
        torch.save({"model": model.state_dict(), "model_config": asdict(model_cfg), "step": step},
                   run_dir / "model.pt.tmp")
        os.replace(run_dir / "model.pt.tmp", run_dir / "model.pt")
        result = evaluate_run(model, model_cfg, data_root, run_dir, config.eval_split, device)
        record("eval", **result)
        emit("done", step=step, weights_sha256=weights_digest(model))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", required=True, type=Path, help="prepared dataset root (with seg_label/)")
    parser.add_argument("--run-dir", required=True, type=Path, help="where checkpoints, metrics and model go")
    parser.add_argument("--preset", default="cpu-demo", help=f"one of {', '.join(TRAIN_PRESETS)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting, e.g. --set epochs=5 --set model.input_width=320")
    parser.add_argument("--weights", type=Path, help="VGG16-BN backbone weights file (optional)")
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
