"""Platforms: where the DAG runs. Flows name one by its Prefect block name; ``local`` needs no setup."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.blocks.core import Block
from prefect.exceptions import MissingContextError

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
from tasks.platforms.cluster.kubeconfig import clear_credentials_warning
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
        return _warned(name, block)
    for kind in PLATFORM_TYPES:
        try:
            return _warned(name, kind.load(name))
        except ValueError:  # Prefect: "Unable to find block document named ..."
            continue
    if name == DEFAULT_PLATFORM:
        return LocalPlatform()
    slugs = ", ".join(kind.get_block_type_slug() for kind in PLATFORM_TYPES)
    raise UnknownPlatform(f"no platform block named '{name}' (looked in block types: {slugs}); save one first, "
                          f"e.g. LocalPlatform(home='/data/laneflow').save('{name}'), or use '{DEFAULT_PLATFORM}'")


def _warned(name: str, platform: Platform) -> Platform:
    """``platform``, once a stored kubeconfig with credentials in clear has been warned about (in the run's log)."""
    cluster = getattr(getattr(getattr(platform, "credentials", None), "cluster_config", None), "config", None)
    if (message := clear_credentials_warning(name, cluster)) is not None:
        try:
            get_run_logger().warning(message)
        except MissingContextError:
            logging.getLogger("laneflow").warning(message)
    return platform
