"""The platforms' errors that storage clients raise too (tasks/anf.py), kept outside the ``tasks.platforms`` package:
importing that package loads every platform, and the cluster platform imports the ANF client, so a client that
imported its errors from there would meet itself half-made. ``tasks.platforms.base`` exports them with the rest."""

from __future__ import annotations


class TransientPlatformError(RuntimeError):
    """Worth retrying: the same call can succeed later (preemption, lost worker, 429/5xx, reset)."""


class ServiceLevelBusy(TransientPlatformError):
    """The storage refused a level change because another operation on the volume is running: wait for it,
    then decide again (the level wanted may have changed meanwhile)."""
