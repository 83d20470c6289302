"""The elastic training loop (``--set elastic=1``): Horovod's elastic mode, for workers that come and go.

Spot GPU nodes are reclaimed with seconds of notice. In a fixed-size run (``training.train``) a lost worker ends
the job and a retry resubmits it from the last durable checkpoint: every rank stops, the pods are rescheduled,
the data is read again. Here the ranks that are left go on (horovod 0.28.1 ``horovod/common/elastic.py``
``run_fn``, ``horovod/torch/elastic``):

- the loop runs under ``hvd.elastic.run`` with a ``TorchState`` (model, optimizer, sampler, step, hosts) that
  every rank commits in memory every ``commit_every`` steps. A rank that is lost makes the others' next
  collective fail (``HorovodInternalError``): they go back to their last commit — at most ``commit_every``
  steps are done again — and re-form the job without it. A host that comes back (the launcher retries it
  after its cooldown) is announced to the ranks, who stop at their next commit (``HostsUpdatedInterrupt``)
  and take the newcomer in; it gets rank 0's state (``TorchState.sync``);
- progress is counted in images: what is left of the epoch is partitioned over the ranks present
  (``ElasticSampler``), the learning rate is the base rate times the ranks present, and the poly schedule is
  planned again over the steps left at the new size;
- a stop signal to some ranks (their pod told to stop: a spot node reclaimed, a drain) makes every rank commit
  at the next stop check, and those ranks leave with exit 75 (a non-zero exit: Horovod takes the host out for
  its cooldown, and an exit 0 would end the whole job as a success): the others go back to that commit, a step
  or so. A signal to every rank (the whole job stopped), or to so many that fewer than ``min_workers`` would be
  left, is handled as in the fixed loop: a durable checkpoint, exit 75, resubmission;
- whoever is rank 0 writes the durable checkpoints (with the sampler's position, so a resubmitted run resumes
  mid-epoch) and the records. Every ``step`` event says how many ``workers`` there are; every change of the
  world is a ``workers`` event: step, workers, hosts, lost, joined (``joined_warm``: those a warm spare of the
  launcher became, ``training.warm``), and ``redone_steps`` (the steps the survivors went back over).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass

from training.dataset import DataError, make_loader, poly_lr
from training.ranks import STARTED_WARM_ENV
from training.run_parts import EXIT_PREEMPTED, RunParts, StepWindow, stop_as_requested
from training.stop_request import STOP_CHECK_MOST_EVERY, read_stop_request

log = logging.getLogger("laneflow.train")


@dataclass(frozen=True)
class Plan:
    """How much training a run is: ``epochs`` passes over ``images``, at most ``max_steps`` steps (0: no cap)."""

    images: int
    epochs: int
    batch_size: int
    max_steps: int = 0

    def steps_per_epoch(self, world_size: int) -> int:
        """Full batches per rank in one whole epoch at this size (``ElasticSampler`` pads each rank's share to
        ``ceil(images / size)``; the loader drops the last partial batch)."""
        return math.ceil(self.images / world_size) // self.batch_size

    def total_steps(self, step: int, epoch: int, processed: int, world_size: int) -> int:
        """The run's last step, planned from ``step`` at this world size: the rest of this epoch (``processed``
        images of it done), then the epochs left. A change of size plans again."""
        rest_of_epoch = math.ceil(max(0, self.images - processed) / world_size) // self.batch_size
        later_epochs = max(0, self.epochs - epoch - 1) * self.steps_per_epoch(world_size)
        total = step + (rest_of_epoch + later_epochs if epoch < self.epochs else 0)
        return min(total, self.max_steps) if self.max_steps else total


def sampler_position(checkpoint: dict | None, images: int, batch_size: int) -> tuple[int, int]:
    """(epoch, images of it done) to resume from: an elastic checkpoint's own sampler state, or the position a
    fixed-size run's checkpoint stands for (its step at its world size)."""
    if checkpoint is None:
        return 0, 0
    if "sampler" in checkpoint:
        return int(checkpoint["sampler"]["epoch"]), int(checkpoint["sampler"]["processed_num"])
    world_size = int(checkpoint.get("world_size") or 1)
    per_epoch = max(1, (images // world_size) // batch_size)
    step = int(checkpoint["step"])
    return step // per_epoch, (step % per_epoch) * batch_size * world_size


def world_change(before: list[str], now: list[str]) -> tuple[list[str], list[str]]:
    """(hosts lost, hosts joined) from one world to the next (hosts in rank order)."""
    return [host for host in before if host not in now], [host for host in now if host not in before]


def this_host() -> str:
    """The host name horovodrun gave this rank's slot (what its discovery script listed)."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def started_warm() -> bool:
    """Whether this worker is a warm spare the launcher kept (``training.warm``), not a process started cold."""
    return os.environ.get(STARTED_WARM_ENV) == "1"


def _state_class(hvd: object) -> type:
    """``hvd.elastic.TorchState`` with two fixes to horovod 0.28.1's:

    - it syncs the optimizer before the model. Horovod syncs the model first, then gives a newcomer's still empty
      optimizer its state by one local step on zero gradients (``broadcast_optimizer_state``), and with weight
      decay that step moves the newcomer's weights away from rank 0's: the replicas would differ from then on.
      Synced after, the model is rank 0's on every rank;
    - it syncs after every change of hosts. Horovod skips the sync when the notices it acted on only removed
      hosts (``HostsUpdatedInterrupt(skip_sync)``, ``horovod/common/elastic.py`` ``check_host_updates``), but the
      world is formed later, at the rendezvous, from the hosts listed then: a lost worker's replacement listed
      meanwhile joins that world and waits in its sync for ranks that skipped theirs — the job hangs (horovod
      issue #3494, open). Seen here when a spot worker's replacement came back while the survivor reset."""
    from horovod.common.elastic import ObjectState
    from horovod.common.exceptions import HostsUpdatedInterrupt

    class TorchState(hvd.elastic.TorchState):  # type: ignore[attr-defined,name-defined]
        def sync(self) -> None:
            for name in sorted(self._handlers, key=lambda name: name == "model"):
                self._handlers[name].sync()
            ObjectState.sync(self)

        def check_host_updates(self) -> None:
            try:
                super().check_host_updates()
            except HostsUpdatedInterrupt as interrupt:
                if interrupt.skip_sync:  # every rank agrees (the decision was broadcast): all sync instead
                    raise HostsUpdatedInterrupt(skip_sync=False) from interrupt
                raise

    return TorchState


def train_elastic(parts: RunParts) -> int:
    import horovod.torch as hvd
    from horovod.common.exceptions import HostsUpdatedInterrupt

    if not hvd.gloo_built():
        raise ValueError("elastic training needs Horovod built with Gloo (HOROVOD_WITH_GLOO=1): this one has none; "
                         "rebuild it (scripts/install_horovod.sh) or train without elastic")
    config, dist = parts.config, parts.dist
    plan = Plan(len(parts.dataset), config.epochs, config.batch_size, config.max_steps)
    optimizer = parts.distributed_optimizer(grouped=False)
    sampler = hvd.elastic.ElasticSampler(parts.dataset, shuffle=True, seed=config.seed)
    checkpoint = parts.resume(optimizer) if parts.is_main else None  # the others get rank 0's state at sync
    epoch, processed = sampler_position(checkpoint, plan.images, config.batch_size)
    sampler.load_state_dict({"epoch": epoch, "processed_num": processed})
    step = int(checkpoint["step"]) if checkpoint else 0
    if parts.is_main:  # a process that joins later is never rank 0: the ranks that were there come first
        parts.write_config()
        parts.start_event(step, plan.total_steps(step, epoch, processed, dist.size), checkpoint is not None,
                          elastic=True)
    loader = make_loader(parts.dataset, config.batch_size, sampler, config.num_workers, parts.device.type == "cuda")
    # The loss scale (fp16) too: ranks that unscale averaged gradients by different scales apply different updates.
    state = _state_class(hvd)(model=parts.model, optimizer=optimizer, sampler=sampler, step=step, hosts=[],
                              scaler=parts.mixed.state_dict())
    furthest = [step]  # the furthest step this process reached: how many steps a roll-back redoes

    def position(state: hvd.elastic.TorchState) -> tuple[int, int]:
        return state.sampler.epoch, state.sampler.processed_num

    def commit(state: hvd.elastic.TorchState) -> None:
        state.scaler = parts.mixed.state_dict()
        state.commit()
        furthest[0] = state.step

    def checkpoint_now(state: hvd.elastic.TorchState) -> None:
        parts.checkpoint(state.step, optimizer, sampler=state.sampler.state_dict())

    def note_world(state: hvd.elastic.TorchState) -> None:
        """Every rank, on (re)entering the loop: who is here; rank 0 records a change of the world."""
        world = hvd.allgather_object((this_host(), furthest[0], started_warm()), name="world")
        hosts = [host for host, _, _ in world]
        if state.hosts and hosts != state.hosts:
            lost, joined = world_change(state.hosts, hosts)
            redone = max(0, max(reached for _, reached, _ in world) - state.step)
            if parts.is_main:
                parts.record("workers", state.step, step=state.step, workers=len(hosts), hosts=hosts, lost=lost,
                             joined=joined, joined_warm=[host for host, _, warm in world if warm and host in joined],
                             redone_steps=redone,
                             total_steps=plan.total_steps(state.step, *position(state), len(hosts)))
            log.info("the run goes on with %d worker(s) from step %d (lost %s, joined %s; %d step(s) redone)",
                     len(hosts), state.step, lost or "none", joined or "none", redone)
        state.hosts = hosts
        furthest[0] = max(furthest[0], state.step)
        if state.scaler is not None:
            parts.mixed.load_state_dict(state.scaler)
        # What was synced or restored is this world's first commit: a failure before the next one comes back here
        # (a newcomer's own saved state would otherwise be the one it was made with, and the hosts the old ones).
        state.save()

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> int:
        note_world(state)
        size = dist.size
        if plan.steps_per_epoch(size) == 0:
            raise DataError(f"the train split has {plan.images} images: too few for {size} worker(s) x batch size "
                            f"{config.batch_size}; lower batch_size or add data")
        total_steps = plan.total_steps(state.step, *position(state), size)
        window = StepWindow()
        while state.sampler.epoch < plan.epochs and state.step < total_steps:
            fetch_start, used_up = time.perf_counter(), True
            for images, masks, exist in loader:
                window.waited += time.perf_counter() - fetch_start
                for group in optimizer.param_groups:
                    group["lr"] = poly_lr(state.step, total_steps, config.lr * size, config.warmup_steps)
                loss, loss_parts = parts.step(images, masks, exist, optimizer, state.step)
                state.step += 1
                furthest[0] = max(furthest[0], state.step)
                state.sampler.record_batch(0, config.batch_size)
                window.images += images.shape[0]
                window.losses.append(loss.item())
                if state.step % config.log_every == 0 or state.step == total_steps:
                    parts.record("step", state.step, **window.event(
                        parts, state.step, state.sampler.epoch, optimizer.param_groups[0]["lr"], loss_parts,
                        workers=size))
                    window = StepWindow()
                if config.eval_every and state.step % config.eval_every == 0 and state.step < total_steps:
                    window.started += parts.validate(state.step)
                # Every fifth step, by the step count alone: a rank that joins agrees at once on when the next check is
                # (the paced cadence of the fixed loop hung joins here, not understood yet).
                if state.step % STOP_CHECK_MOST_EVERY == 0 and (stopped := stop_check(state, total_steps)) is not None:
                    return stopped
                if state.step % config.checkpoint_every == 0:
                    checkpoint_now(state)
                if state.step % config.commit_every == 0:
                    commit(state)
                if state.step >= total_steps:
                    used_up = False
                    break
                fetch_start = time.perf_counter()
            parts.record("epoch", state.step, epoch=state.sampler.epoch, step=state.step)
            if used_up:  # the epoch's data is: the next one starts
                state.sampler.set_epoch(state.sampler.epoch + 1)
            if state.step % config.checkpoint_every:
                checkpoint_now(state)
            commit(state)
        return parts.finish(state.step)

    def stop_check(state: hvd.elastic.TorchState, total_steps: int) -> int | None:
        """Agree on the stop signals and requests; what this rank exits with when it stops (None: go on)."""
        request = read_stop_request(parts.run_dir) if parts.is_main else None
        signalled, asked = dist.count((parts.stop.requested, request is not None), "stop")
        if signalled and dist.size - signalled < config.min_workers:
            # The whole job is being stopped, or too few would be left to go on: a durable checkpoint, exit 75,
            # and the run is resubmitted (horovodrun would wait for min_workers and then fail without one).
            checkpoint_now(state)
            parts.record("preempted", state.step, step=state.step)
            dist.any((False,), "checkpointed")  # nobody exits before rank 0 has written it
            return EXIT_PREEMPTED
        if asked and state.step < total_steps:  # at its end a run finishes: nothing is saved by stopping
            return stop_as_requested(parts, state.step, optimizer, request, sampler=state.sampler.state_dict())
        if not signalled:
            return None
        # Some ranks were told to stop (their worker is going away): commit here, so the others go back to
        # this very step, and let those ranks go.
        try:
            commit(state)
        except HostsUpdatedInterrupt:
            if not parts.stop.requested:
                raise
        if parts.stop.requested:
            log.warning("leaving the run at step %d: this worker was told to stop; the others go on without it",
                        state.step)
            return EXIT_PREEMPTED
        return None

    # Every reset (a lost rank, a host listed or no longer listed) re-partitions the data over the ranks present.
    state.register_reset_callbacks([state.sampler.reset])
    return loop(state)
