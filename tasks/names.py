"""Names for what the pipeline creates: validated early, derived deterministically from the flow run.

Volumes, jobs and snapshots become Kubernetes object names and label values on a cluster, so every
platform holds them to the same rule (DNS-1123 label, at most 63 characters) and a bad name is refused
before anything is created.
"""

from __future__ import annotations

import re
from uuid import UUID

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63


class InvalidName(ValueError):
    """A name that cannot become a volume, job or snapshot name."""


def validate_name(value: str, what: str) -> str:
    """``value`` if it is a DNS-1123 label, else an error that says what is wrong and how to fix it."""
    if not isinstance(value, str) or not value:
        raise InvalidName(f"{what} name must be a non-empty string")
    if len(value) > MAX_NAME:
        raise InvalidName(f"{what} name '{value}' has {len(value)} characters; at most {MAX_NAME} are allowed")
    if not DNS_LABEL.match(value):
        raise InvalidName(f"{what} name '{value}' is not a DNS-1123 label: use lowercase letters, digits and '-', "
                          "starting and ending with a letter or digit")
    return value


def run_name(flow_run_id: UUID | str, prefix: str = "train") -> str:
    """The training run's name for a flow run: a retry of any task (or of the flow run) maps to the same run."""
    return validate_name(f"{prefix}-{UUID(str(flow_run_id)).hex[:12]}", "run")


def snapshot_name(volume: str, run: str) -> str:
    """One snapshot per run and volume; shortened with a stable suffix when the pair is too long."""
    name = f"{volume}-{run}"
    if len(name) > MAX_NAME:
        name = f"{volume[:MAX_NAME - len(run) - 1].rstrip('-')}-{run}"
    return validate_name(name, "snapshot")
