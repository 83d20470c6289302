"""Platforms: where the DAG runs. Flows name one by its Prefect block name; ``local`` needs no setup."""

from __future__ import annotations

from prefect.blocks.core import Block

from tasks.platforms.base import (
    Platform,
    SnapshotRef,
    StageBlocked,
    StageDeadlineExceeded,
    TrainingFailed,
    TrainingHandle,
    TrainingInterrupted,
    TrainingOutcome,
    TrainingSpec,
    TransientPlatformError,
    VolumeRef,
)
from tasks.platforms.cluster import ClusterPlatform
from tasks.platforms.local import LocalPlatform

DEFAULT_PLATFORM = "local"
#: Block types a bare platform name is looked up in, in order.
PLATFORM_TYPES: list[type[Platform]] = [LocalPlatform, ClusterPlatform]

__all__ = [
    "DEFAULT_PLATFORM",
    "PLATFORM_TYPES",
    "ClusterPlatform",
    "LocalPlatform",
    "Platform",
    "SnapshotRef",
    "StageBlocked",
    "StageDeadlineExceeded",
    "TrainingFailed",
    "TrainingHandle",
    "TrainingInterrupted",
    "TrainingOutcome",
    "TrainingSpec",
    "TransientPlatformError",
    "VolumeRef",
    "load_platform",
]


class UnknownPlatform(ValueError):
    """No saved platform block has the name a flow was given."""


def load_platform(name: str = DEFAULT_PLATFORM) -> Platform:
    """The platform block called ``name`` (``type-slug/name`` or a bare name); ``local`` works unsaved."""
    if "/" in name:
        block = Block.load(name)
        if not isinstance(block, Platform):
            raise UnknownPlatform(f"block '{name}' is a {type(block).__name__}, not a laneflow platform")
        return block
    for kind in PLATFORM_TYPES:
        try:
            return kind.load(name)
        except ValueError:  # Prefect: "Unable to find block document named ..."
            continue
    if name == DEFAULT_PLATFORM:
        return LocalPlatform()
    slugs = ", ".join(kind.get_block_type_slug() for kind in PLATFORM_TYPES)
    raise UnknownPlatform(f"no platform block named '{name}' (looked in block types: {slugs}); save one first, "
                          f"e.g. LocalPlatform(home='/data/laneflow').save('{name}'), or use '{DEFAULT_PLATFORM}'")
