"""Names for what the pipeline creates: validated early, derived deterministically from the flow run.

Volumes, jobs and snapshots become Kubernetes object names and label values on a cluster, so every
platform holds them to the same rule (DNS-1123 label, at most 63 characters) and a bad name is refused
before anything is created.
"""

from __future__ import annotations

import re
from uuid import UUID

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: RFC 1035 label: like DNS-1123 but starting with a letter (Services and MPI worker host names).
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63
#: RFC 1123 subdomain: the names of storage classes, snapshot classes and service accounts.
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_SUBDOMAIN = 253


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


def validate_subdomain(value: str, what: str) -> str:
    """``value`` if it is a DNS-1123 subdomain (what Kubernetes requires of most object names)."""
    if not isinstance(value, str) or not value:
        raise InvalidName(f"{what} must be a non-empty string")
    if len(value) > MAX_SUBDOMAIN or not DNS_SUBDOMAIN.match(value):
        raise InvalidName(f"{what} '{value}' is not a DNS-1123 subdomain: use at most {MAX_SUBDOMAIN} lowercase "
                          "letters, digits, '-' and '.', starting and ending with a letter or digit")
    return value


def validate_mpijob_name(name: str, worker_replicas: int) -> str:
    """``name`` if the MPI operator will accept it for a job with ``worker_replicas`` worker pods.

    The operator (kubeflow/mpi-operator ``pkg/apis/kubeflow/validation/validation.go``,
    ``validateMPIJobName``) requires ``<name>-worker-<replicas-1>`` to be a DNS-1035 label of at most 63
    characters, because that is a pod host name and a Service's DNS name. It checks this in the
    controller, not at admission: a refused job gets only a Warning event and would never start, so
    the rule is checked here, before anything is submitted.
    """
    validate_name(name, "job")
    host = f"{name}-worker-{max(worker_replicas, 1) - 1}"
    if len(host) > MAX_NAME:
        raise InvalidName(f"job name '{name}' is too long for the MPI operator: its last worker's host name "
                          f"'{host}' has {len(host)} characters; at most {MAX_NAME} are allowed")
    if not DNS_1035_LABEL.match(host):
        raise InvalidName(f"job name '{name}' is refused by the MPI operator: worker host names like '{host}' must "
                          "be DNS-1035 labels (start with a lowercase letter; lowercase letters, digits and '-')")
    return name


def run_name(flow_run_id: UUID | str, prefix: str = "train", key: str | None = None) -> str:
    """The training run's name for a flow run: a retry of any task (or of the flow run) maps to the same run.
    With ``key`` the name is ``<prefix>-<key>`` whatever the flow run: a later flow run of the same key finds
    the run's folder and checkpoint and resumes it (a sweep's retried trial)."""
    if key is not None:
        if len(key) > MAX_RUN_KEY or not DNS_LABEL.fullmatch(key):
            raise ValueError(f"run_key {key!r} must be at most {MAX_RUN_KEY} lowercase letters, digits or '-', "
                             "starting and ending with a letter or digit")
        return validate_name(f"{prefix}-{key}", "run")
    return validate_name(f"{prefix}-{UUID(str(flow_run_id)).hex[:12]}", "run")


#: A run key leaves room in the run's name for the suffixes of its Jobs and snapshots (as a flow run id's 12).
MAX_RUN_KEY = 24


def snapshot_name(volume: str, run: str) -> str:
    """One snapshot per run and volume; shortened with a stable suffix when the pair is too long."""
    name = f"{volume}-{run}"
    if len(name) > MAX_NAME:
        name = f"{volume[:MAX_NAME - len(run) - 1].rstrip('-')}-{run}"
    return validate_name(name, "snapshot")
