"""Which Azure NetApp Files service level a training run needs (pure; DESIGN §7).

An ANF volume's throughput is its quota times its level's rate: Standard 16, Premium 64, Ultra 128 MiB/s
per TiB. Training needs ``workers x images/s per worker x bytes per image x headroom``. The cheapest
level that meets it, up to a configured ceiling, wins; when none does, the answer says what would.
"""

from __future__ import annotations

from dataclasses import dataclass

#: (level, MiB/s per TiB of quota), cheapest first.
SERVICE_LEVELS: tuple[tuple[str, float], ...] = (("Standard", 16.0), ("Premium", 64.0), ("Ultra", 128.0))
MIB = 1024 * 1024


@dataclass(frozen=True)
class ThroughputNeed:
    """What a run reads: images/s per worker measured by an earlier run (or given), at a safety headroom."""

    workers: int
    images_per_second_per_worker: float
    bytes_per_image: float
    headroom: float = 1.25

    def __post_init__(self) -> None:
        for name in ("workers", "images_per_second_per_worker", "bytes_per_image"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.headroom < 1:
            raise ValueError(f"headroom must be >= 1 (a safety factor), got {self.headroom}")

    def mib_per_second(self) -> float:
        return self.workers * self.images_per_second_per_worker * self.bytes_per_image * self.headroom / MIB


@dataclass(frozen=True)
class LevelOption:
    level: str
    available_mib_per_second: float
    meets: bool
    allowed: bool


@dataclass(frozen=True)
class TierChoice:
    level: str | None
    required_mib_per_second: float
    quota_tib: float
    ceiling: str
    options: tuple[LevelOption, ...]
    reason: str


def choose_service_level(need: ThroughputNeed, quota_tib: float, ceiling: str = "Ultra") -> TierChoice:
    """The cheapest level within ``ceiling`` whose throughput at ``quota_tib`` meets the need (>=), or None."""
    return choose_level_for(need.mib_per_second(), quota_tib, ceiling)


def choose_level_for(required: float, quota_tib: float, ceiling: str = "Ultra") -> TierChoice:
    """The cheapest level within ``ceiling`` that gives ``required`` MiB/s at ``quota_tib``, or None: for one
    run's need, or for the sum of what every run holding a volume reads."""
    levels = [name for name, _ in SERVICE_LEVELS]
    if ceiling not in levels:
        raise ValueError(f"ceiling '{ceiling}' is not a service level; choose one of {', '.join(levels)}")
    if quota_tib <= 0:
        raise ValueError(f"quota_tib must be > 0, got {quota_tib}")
    allowed_up_to = levels.index(ceiling)
    options = tuple(LevelOption(name, quota_tib * rate, quota_tib * rate >= required, index <= allowed_up_to)
                    for index, (name, rate) in enumerate(SERVICE_LEVELS))
    chosen = next((o for o in options if o.meets and o.allowed), None)
    if chosen is not None:
        reason = (f"{chosen.level} gives {chosen.available_mib_per_second:.1f} MiB/s at {quota_tib:g} TiB, "
                  f">= the {required:.1f} MiB/s needed; it is the cheapest level that does")
        return TierChoice(chosen.level, required, quota_tib, ceiling, options, reason)
    above_ceiling = next((o for o in options if o.meets), None)
    ceiling_rate = dict(SERVICE_LEVELS)[ceiling]
    quota_needed = required / ceiling_rate
    if above_ceiling is not None:
        reason = (f"only {above_ceiling.level} meets {required:.1f} MiB/s at {quota_tib:g} TiB, above the "
                  f"ceiling {ceiling}; raise the ceiling, or the quota to {quota_needed:.2f} TiB at {ceiling}")
    else:
        reason = (f"no level meets {required:.1f} MiB/s at {quota_tib:g} TiB (Ultra gives "
                  f"{options[-1].available_mib_per_second:.1f}); raise the quota to {quota_needed:.2f} TiB at "
                  f"{ceiling}, or train with fewer workers")
    return TierChoice(None, required, quota_tib, ceiling, options, reason)


def render_tier_markdown(choice: TierChoice, need: ThroughputNeed) -> str:
    """The reasoning, for the run's markdown artifact."""
    rows = "\n".join(
        f"| {o.level} | {o.available_mib_per_second:.1f} | {'yes' if o.meets else 'no'} | "
        f"{'yes' if o.allowed else 'no (above ceiling)'} |" for o in choice.options)
    return (f"# Service level: {choice.level or 'none fits'}\n\n"
            f"Required: {need.workers} workers x {need.images_per_second_per_worker:g} img/s x "
            f"{need.bytes_per_image / 1024:.0f} KiB x headroom {need.headroom:g} = "
            f"**{choice.required_mib_per_second:.1f} MiB/s**; quota {choice.quota_tib:g} TiB; "
            f"ceiling {choice.ceiling}.\n\n| level | MiB/s at this quota | meets | allowed |\n|---|---|---|---|\n"
            f"{rows}\n\n{choice.reason}.\n")
