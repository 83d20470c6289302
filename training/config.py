"""The run's configuration: ``TrainConfig``, its presets, and the ``--set key=value`` overrides.

Kept apart from the training loop so what a run is configured with can be read, parsed and checked
without the loop's machinery (Horovod, the data loader, TensorBoard, checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from training import precision
from training.models import DEFAULT_MODEL, get_model


@dataclass(frozen=True)
class TrainConfig:
    """Everything that shapes a run; presets give defaults, ``--set key=value`` overrides them."""

    preset: str = "cpu-demo"
    #: The lane model (``training.models``: ``scnn``, or one a package registers); ``model.<field>`` overrides
    #: its settings.
    model: str = DEFAULT_MODEL
    epochs: int = 3
    batch_size: int = 4
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    warmup_steps: int = 20
    checkpoint_every: int = 50
    num_workers: int = 2
    seed: int = 0
    eval_split: str = "val"
    max_steps: int = 0  # 0 = no limit beyond epochs
    #: Score the val split every this many steps (0: only at the end): the curve a sweep's pruner reads.
    eval_every: int = 0
    log_every: int = 10
    cache: int = 1  # 1: decode each image once into a cache on the data volume; 0: decode every epoch
    #: Gradient allreduce grouping: 0 = one allreduce per tensor as its gradient is ready (overlaps
    #: backward; best for big models on GPUs), N = N grouped allreduces (fewer negotiations; best on CPUs).
    #: Elastic runs allreduce per tensor whatever this says (``RunParts.distributed_optimizer``).
    allreduce_groups: int = 1
    #: Horovod coordination cycle in ms (0: Horovod's default). Longer cycles leave CPU cores to the
    #: training step when there is one grouped allreduce per step.
    cycle_time_ms: float = 25.0
    #: fp32 | bf16 | fp16 | auto (training.precision): mixed precision for the forward pass. ``auto``: the fastest
    #: safe one on the machine (bf16 where the GPU or CPU does it natively and, on a CPU, a calibration confirms).
    precision: str = "auto"
    #: contiguous | channels_last | auto: the activations' layout (auto: channels-last on GPUs; on CPUs
    #: whichever the calibration finds faster).
    memory_format: str = "auto"
    #: on | off | auto: run the network through ``torch.compile`` (auto: where it measured faster; not yet).
    compile: str = "auto"
    #: none | fp16: Horovod gradient compression. Off by default: slower on CPUs here, not yet measured
    #: on several GPUs (docs/performance.md).
    compression: str = "none"
    #: 1: elastic Horovod (``training.elastic``): ranks may leave and join while the run trains; the launcher
    #: is ``horovodrun --min-np/--max-np --host-discovery-script``.
    elastic: int = 0
    #: Elastic runs: the ranks commit their state in memory every this many steps; a lost worker costs at
    #: most this many steps of the others' work (they go back to the last commit).
    commit_every: int = 10
    #: Elastic runs: the fewest workers the run trains on; when a stop would leave fewer, every rank checkpoints.
    min_workers: int = 1
    model_overrides: dict = field(default_factory=dict)


TRAIN_PRESETS: dict[str, TrainConfig] = {
    # The seed's recipe: SGD (nesterov) lr 0.15 scaled by workers, poly decay with warm-up, 512x288.
    "tusimple": TrainConfig(preset="tusimple", epochs=30, batch_size=8, lr=0.15, warmup_steps=200,
                            checkpoint_every=500, num_workers=4, allreduce_groups=0, cycle_time_ms=0.0,
                            precision="auto"),
    # SCNN's CULane recipe (XingangPan/SCNN experiments/train.sh): 12 images a step at LR 0.01 for 60,000
    # steps — about 8 epochs of CULane's 88,880 training frames; here 12 a worker, the LR scaled by workers.
    "culane": TrainConfig(preset="culane", epochs=8, batch_size=12, lr=0.01, warmup_steps=200,
                          checkpoint_every=1000, num_workers=4, allreduce_groups=0, cycle_time_ms=0.0,
                          precision="auto"),
    "cpu-demo": TrainConfig(),
}


def parse_overrides(preset: str, pairs: list[str]) -> TrainConfig:
    """Apply ``key=value`` overrides to a preset, converting each value to the field's type."""
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"unknown preset '{preset}'; choose one of {', '.join(TRAIN_PRESETS)}")
    config = TRAIN_PRESETS[preset]
    types = {f.name: f.type for f in fields(TrainConfig)}
    changes: dict = {}
    model_pairs: list[tuple[str, str]] = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"override '{pair}' must look like key=value")
        if key.startswith("model."):
            model_pairs.append((key, value))
        elif key in types and key not in ("preset", "model_overrides"):
            changes[key] = _convert(key, value, types[key])
        else:
            raise ValueError(f"unknown setting '{key}'; known: {', '.join(sorted(set(types) - {'model_overrides'}))}")
    # The model's own settings, once it is known which model they are for (``model=`` may come after them).
    overridable = get_model(changes.get("model", config.model)).overridable_settings()
    model_changes: dict = {}
    for key, value in model_pairs:
        name = key[len("model."):]
        if name not in overridable:
            raise ValueError(f"unknown model setting '{name}'; this model's: {', '.join(sorted(overridable))}")
        model_changes[name] = _convert(key, value, overridable[name])
    config = replace(config, **changes, model_overrides={**config.model_overrides, **model_changes})
    validate(config)
    return config


def _convert(key: str, value: str, kind: str) -> object:
    try:
        return int(value) if kind == "int" else float(value) if kind == "float" else value
    except ValueError:
        raise ValueError(f"setting '{key}' needs a {kind}, got '{value}'") from None


def validate(config: TrainConfig) -> None:
    for name in ("epochs", "batch_size", "checkpoint_every", "log_every", "commit_every", "min_workers"):
        if getattr(config, name) < 1:
            raise ValueError(f"setting '{name}' must be >= 1, got {getattr(config, name)}")
    if config.lr <= 0:
        raise ValueError(f"setting 'lr' must be > 0, got {config.lr}")
    if min(config.num_workers, config.max_steps, config.warmup_steps, config.allreduce_groups,
           config.cycle_time_ms, config.eval_every) < 0:
        raise ValueError("num_workers, max_steps, warmup_steps, allreduce_groups, cycle_time_ms and eval_every "
                         "must be >= 0")
    if config.elastic not in (0, 1):
        raise ValueError(f"setting 'elastic' must be 0 or 1, got {config.elastic}")
    precision.validate(config.precision, config.memory_format, config.compression, config.compile)
    precision.resolve_compile(config.compile, "cpu", bool(config.elastic))  # refuses compile=on + elastic
    get_model(config.model).settings(config.preset, **config.model_overrides)
