"""What a training loop works with, shared by the fixed-size loop (``training.train``) and the elastic one
(``training.elastic``): Horovod's few calls (``Distributed``), the model, optimizer, data and precision of a run
and rank 0's records (``RunParts``), and the windows a
``step`` event reports over. Both loops use this module; it uses neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from training.calibration import resolve_numerics
from training.checkpoints import check_compatible, check_same_data, load_latest_checkpoint, save_checkpoint
from training.config import TrainConfig
from training.data.preprocess import load_manifest
from training.dataset import LaneDataset
from training.evaluate import evaluate_run, score_split
from training.models import LaneModel, get_model
from training.models.base import Criterion, ModelSettings, TrainingDiverged
from training.precision import MixedPrecision, Numerics
from training.step import train_step
from training.stop_request import STOP_REQUEST, StopRequest, read_stop_request
from training.tensorboard_log import TENSORBOARD_DIR, TensorBoardLog

log = logging.getLogger("laneflow.train")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request, resumable


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
        self.local_rank = hvd.local_rank()  # fixed for the process: which GPU it drives

    @property
    def rank(self) -> int:
        """This process's rank now: in an elastic run it changes when workers leave or join."""
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()

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
        return tuple(count > 0 for count in self.count(flags, name))

    def count(self, flags: tuple[bool, ...], name: str) -> tuple[int, ...]:
        """For each flag, how many ranks raised it (one allreduce for all of them)."""
        return tuple(round(value) for value in self.sums(tuple(float(flag) for flag in flags), name))

    def sums(self, values: tuple[float, ...], name: str) -> tuple[float, ...]:
        """Each value summed over every rank (one allreduce for all of them); float32, so whole numbers below 2**24
        are exact and every rank reads the same."""
        if self.size == 1:
            return values
        summed = self.hvd.allreduce(torch.tensor(values, dtype=torch.float32), name=name, op=self.hvd.Sum)
        return tuple(float(value) for value in summed)


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def emit(event: str, **payload: object) -> None:
    """One JSON line for the orchestrator (rank 0 only, by the callers)."""
    print(json.dumps({"event": event, **payload}), flush=True)




def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` through ``torch.compile``, drawing random numbers as eager does (inductor's own generator would
    give dropout other masks): compiling changes a run's speed, not its results or what a resume continues."""
    import torch._inductor.config as inductor

    inductor.fallback_random = True
    return torch.compile(model)


@dataclass
class RunParts:
    """What a training loop works with, built the same way for a fixed-size run and an elastic one: the
    model, its optimizer (not yet Horovod's), the data, the precision, and rank 0's records."""

    config: TrainConfig
    data_root: Path
    run_dir: Path
    dist: Distributed
    stop: StopRequest
    device: torch.device
    numerics: Numerics
    mixed: MixedPrecision
    lane_model: LaneModel
    model_cfg: ModelSettings
    dataset: LaneDataset
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    criterion: Criterion
    closing: contextlib.ExitStack
    #: What runs the forward pass: the network, or its ``torch.compile``d wrapper (same parameters). Everything
    #: else — checkpoints, Horovod's hooks, scoring, export — works on ``model`` itself.
    forward: torch.nn.Module | None = None
    board: TensorBoardLog | None = None
    #: The data's version (its manifest's), kept in every checkpoint: a resume on other data is refused.
    dataset_version: str | None = None

    @classmethod
    def build(cls, config: TrainConfig, data_root: Path, run_dir: Path, weights: Path | None, stop: StopRequest,
              closing: contextlib.ExitStack) -> RunParts:
        dist = Distributed(config.cycle_time_ms)
        torch.manual_seed(config.seed)
        random.seed(config.seed + dist.rank)  # augmentation in the main process (loader workers are seeded by torch)
        device = torch.device(f"cuda:{dist.local_rank}" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick the fastest kernels once
        lane_model = get_model(config.model)
        model_cfg = lane_model.settings(config.preset, **config.model_overrides)
        numerics = resolve_numerics(config, lane_model, model_cfg, device, dist, run_dir)
        log.info("numerics (rank %d): %s", dist.rank, numerics.reason)
        dataset = LaneDataset(data_root, "train", (model_cfg.input_width, model_cfg.input_height), augment=True,
                              cache=config.cache)
        # Weights stay contiguous (Horovod allreduces only contiguous gradients); a channels-last batch makes
        # every convolution run channels-last.
        model = lane_model.network(model_cfg).to(device)
        if weights:
            count = lane_model.load_backbone(model, weights)
            log.info("loaded %d backbone tensors from %s", count, weights)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr * dist.size, momentum=config.momentum,
                                    weight_decay=config.weight_decay, nesterov=True)
        return cls(config, data_root, run_dir, dist, stop, device, numerics,
                   MixedPrecision(numerics.precision, device.type), lane_model, model_cfg, dataset, model, optimizer,
                   lane_model.criterion(model_cfg, check_finite=numerics.precision != "fp16"), closing,
                   forward=compiled(model) if numerics.compile else None,
                   dataset_version=(load_manifest(data_root) or {}).get("dataset_version"))

    @property
    def run_precision(self) -> str:
        return self.numerics.precision

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    def distributed_optimizer(self, grouped: bool = True) -> torch.optim.Optimizer:
        """The optimizer wrapped by Horovod: gradients averaged over the ranks at each step. Not ``grouped``
        (one allreduce per tensor): Horovod's grouping broadcasts the parameter order when the optimizer is made
        (horovod 0.28.1 ``torch/optimizer.py`` ``_register_hooks``), a collective an elastic run's newcomer would
        make alone while the others wait in their state sync."""
        config, hvd = self.config, self.dist.hvd
        compression = hvd.Compression.fp16 if config.compression == "fp16" else hvd.Compression.none
        return hvd.DistributedOptimizer(self.optimizer, named_parameters=self.model.named_parameters(),
                                        groups=(config.allreduce_groups or None) if grouped else None,
                                        compression=compression)

    def write_config(self) -> None:
        """Rank 0: the run's settings beside its checkpoints, and a stop request left by an earlier attempt
        dropped (the orchestrator asks again if it still wants)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps({
            "train": asdict(self.config), "model": asdict(self.model_cfg), "model_name": self.lane_model.name,
            "world_size": self.dist.size}, indent=2))
        if (stale := read_stop_request(self.run_dir)) is not None:
            log.warning("ignoring a stop request left from an earlier attempt: %s", stale)
            (self.run_dir / STOP_REQUEST).unlink(missing_ok=True)

    def record(self, event: str, step: int, /, **payload: object) -> None:
        """Rank 0: one event for the orchestrator (stdout), ``metrics.jsonl`` and TensorBoard (at ``step``)."""
        if not self.is_main:
            return
        if self.board is None:  # opened by the process that is rank 0 when it first records
            self.board = self.closing.enter_context(TensorBoardLog.open(self.run_dir / TENSORBOARD_DIR, step))
        # When it happened (Unix seconds): wall time, time to an accuracy and the curves over time of
        # `laneflow compare` come from these, whichever machine or pod the run's attempts ran on.
        stamped = {**payload, "time": round(time.time(), 3)}
        emit(event, **stamped)
        with (self.run_dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps({"event": event, **stamped}) + "\n")
        self.board.write(event, payload, step)

    def checkpoint(self, step: int, optimizer: torch.optim.Optimizer, **extra: object) -> None:
        """Every rank at the same step (BatchNorm statistics are averaged first: a collective); rank 0 writes."""
        self.dist.average_buffers(self.model)
        if self.is_main:
            path = save_checkpoint(self.run_dir, {
                "step": step, "model": self.model.state_dict(), "optimizer": optimizer.state_dict(),
                "model_name": self.lane_model.name, "model_config": asdict(self.model_cfg),
                "train_config": asdict(self.config),
                "world_size": self.dist.size, **self.numerics.record(), "scaler": self.mixed.state_dict(),
                "dataset_version": self.dataset_version, **extra})
            self.record("checkpoint", step, step=step, path=str(path))

    def resume(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """Rank 0: the newest checkpoint loaded into the model and ``optimizer`` (None when there is none)."""
        state = load_latest_checkpoint(self.run_dir)
        if state is None:
            return None
        check_compatible(state, self.lane_model.name, self.model_cfg, state["path"])
        check_same_data(state, self.dataset_version, state["path"])
        if "sampler" in state and not self.config.elastic:
            raise ValueError(f"checkpoint {state['path']} was written by an elastic run, whose steps do not say where "
                             "in the data it was: resume it as an elastic run, or train in a new run")
        self.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        log.info("resuming from %s at step %d (written in %s; %s)", state["path"], state["step"],
                 state.get("precision", "fp32"), self.mixed.load_state_dict(state.get("scaler")))
        return state

    def start_event(self, step: int, total_steps: int, resumed: bool, **extra: object) -> None:
        self.record("start", step, step=step, total_steps=total_steps, world_size=self.dist.size, resumed=resumed,
                    **self.numerics.record(), device=self.device.type,
                    model=self.lane_model.name, model_settings=asdict(self.model_cfg), **extra)

    def step(self, images: torch.Tensor, masks: torch.Tensor, exist: torch.Tensor, optimizer: torch.optim.Optimizer,
             step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """One SGD step; a diverged loss names the step and the learning rate it had (exit 2: running it again
        diverges again)."""
        try:
            distributed = optimizer is not self.optimizer  # Horovod's
            network = self.model if self.forward is None else self.forward
            return train_step(network, images, masks, exist, self.criterion, optimizer, self.mixed,
                              self.numerics.torch_memory_format, distributed=distributed,
                              normalisation=self.lane_model.normalisation())
        except TrainingDiverged as exc:
            raise TrainingDiverged(f"{exc} at step {step + 1}, learning rate {optimizer.param_groups[0]['lr']:.4g} "
                                   f"(lr {self.config.lr} x {self.dist.size} worker(s), poly schedule): lower lr") \
                from None

    def validate(self, step: int) -> float:
        """Every rank (BatchNorm statistics averaged first); rank 0 scores val. The seconds it took."""
        started = time.perf_counter()
        self.dist.average_buffers(self.model)
        if self.is_main:
            scores = score_split(self.model, self.model_cfg, self.data_root, "val", self.device)
            self.record("val", step, step=step, **{k: v for k, v in scores.items() if k != "split"})
        self.model.train()
        return time.perf_counter() - started

    def finish(self, step: int) -> int:
        """The end of a run trained to its end: BatchNorm statistics averaged, rank 0 writes ``model.pt``,
        scores it (``eval``) and says ``done``."""
        self.dist.average_buffers(self.model)
        if self.is_main and (late := read_stop_request(self.run_dir)) is not None:  # came after the last check
            log.info("a stop request came after the last check; the run trained to its end: %s", late)
            (self.run_dir / STOP_REQUEST).unlink(missing_ok=True)
        # Every rank reports what it ended with: diverged replicas would show here first.
        log.info("final weights sha256 %s (rank %d)", weights_digest(self.model), self.dist.rank)
        if self.is_main:
            model_cfg = asdict(self.model_cfg)
            torch.save({"model": self.model.state_dict(), "model_name": self.lane_model.name,
                        "model_config": model_cfg, "step": step},
                       self.run_dir / "model.pt.tmp")
            os.replace(self.run_dir / "model.pt.tmp", self.run_dir / "model.pt")
            result = evaluate_run(self.model, self.model_cfg, self.data_root, self.run_dir, self.config.eval_split,
                                  self.device)
            self.record("eval", step, **result)
            emit("done", step=step, weights_sha256=weights_digest(self.model))
        return 0


@dataclass
class StepWindow:
    """What a ``step`` event reports over the steps since the one before: a window runs across epoch ends
    (their checkpoint and the loader's restart are training time too), so summed, the windows cover every
    step of the attempt; time spent scoring val is left out (img/s counts training time only)."""

    started: float = field(default_factory=time.perf_counter)
    waited: float = 0.0
    images: int = 0
    losses: list[float] = field(default_factory=list)

    def event(self, parts: RunParts, step: int, epoch: int, lr: float, parts_loss: dict[str, float],
              **extra: object) -> dict[str, object]:
        elapsed = time.perf_counter() - self.started
        return dict(step=step, epoch=epoch, loss=parts.dist.average(sum(self.losses) / len(self.losses), "loss"),
                    lr=lr, img_per_s=self.images * parts.dist.size / elapsed, input_stall=self.waited / elapsed,
                    seconds=round(elapsed, 6), **extra, **parts_loss)



def stop_as_requested(parts: RunParts, step: int, optimizer: torch.optim.Optimizer, request: dict | None,
                      **extra: object) -> int:
    """The orchestrator asked this run to stop for good (a pruned trial): checkpoint, say ``stopped``, exit 0."""
    parts.checkpoint(step, optimizer, **extra)
    if parts.is_main:
        log.info("stopping at step %d as requested: %s", step, request)
        parts.record("stopped", step, step=step, **(request or {}))
        (parts.run_dir / STOP_REQUEST).unlink(missing_ok=True)
    return 0
