"""Kubernetes quantities (``8Gi``, ``500m``) as the emulated API server reads them, and how it refuses a bad
one in an object it receives (kubernetes/apimachinery ``pkg/api/resource``).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from tests.cluster.apierrors import bad_request, invalid, invalid_status

# apimachinery pkg/api/resource/quantity.go: ``splitRE`` and the errors ParseQuantity returns; suffix.go: the
# suffixes it knows. Core kinds decode quantities in Go, so a bad one fails the whole request with 400;
# a CRD (MPIJob) has controller-gen's pattern for resource.Quantity in its schema, so it is a 422 cause.
QUANTITY_SPLIT = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
FORMAT_WRONG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "": 1,
                     "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6,
                     "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
CRD_QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
                        r"(\.[0-9]*)?)|(\.[0-9]+))))?$")


def quantity_value(text: str) -> tuple[Decimal | None, str | None]:
    """(value, None) of a quantity as ParseQuantity reads it, or (None, the error it returns)."""
    match = QUANTITY_SPLIT.match(text)
    if match is None:
        return None, FORMAT_WRONG
    number, suffix = match.groups()
    if number.count(".") > 1 or number.lstrip("+-") in ("", "."):
        return None, "unable to parse numeric part of quantity"
    if suffix in QUANTITY_SUFFIXES:
        return Decimal(number) * Decimal(QUANTITY_SUFFIXES[suffix]), None
    exponent = re.fullmatch(r"[eE]([+-]?[0-9]+)", suffix)
    if exponent is None:
        return None, "unable to parse quantity's suffix"
    return Decimal(number) * Decimal(10) ** int(exponent[1]), None


def _pod_spec_paths(obj: dict) -> list[tuple[str, dict]]:
    """(path, pod spec) of every pod spec an object carries."""
    spec = obj.get("spec") or {}
    kind = obj["kind"]
    if kind == "Pod":
        return [("spec", spec)]
    if kind == "Job":
        return [("spec.template.spec", (spec.get("template") or {}).get("spec") or {})]
    if kind == "MPIJob":
        return [(f"spec.mpiReplicaSpecs.{role}.template.spec",
                 ((replica or {}).get("template") or {}).get("spec") or {})
                for role, replica in (spec.get("mpiReplicaSpecs") or {}).items()]
    return []


def _quantities(obj: dict) -> list[tuple[str, Any]]:
    """(path, value) of every quantity field laneflow's kinds carry."""
    found: list[tuple[str, Any]] = []
    if obj["kind"] == "PersistentVolumeClaim":
        resources = (obj.get("spec") or {}).get("resources") or {}
        for part in ("requests", "limits"):
            found += [(f"spec.resources.{part}.{name}", value) for name, value in (resources.get(part) or {}).items()]
    for path, pod in _pod_spec_paths(obj):
        for group in ("initContainers", "containers"):
            for index, container in enumerate(pod.get(group) or []):
                resources = container.get("resources") or {}
                for part in ("requests", "limits"):
                    found += [(f"{path}.{group}[{index}].resources.{part}.{name}", value)
                              for name, value in (resources.get(part) or {}).items()]
        for index, volume in enumerate(pod.get("volumes") or []):
            limit = (volume.get("emptyDir") or {}).get("sizeLimit")
            if limit is not None:
                found.append((f"{path}.volumes[{index}].emptyDir.sizeLimit", limit))
    return found


def check_quantities(obj: dict, kind: str, group: str, version: str) -> None:
    bad = [(path, value, quantity_value(str(value))[1]) for path, value in _quantities(obj)
           if not isinstance(value, int | float) and quantity_value(str(value))[1]]
    if not bad:
        return
    if kind == "MPIJob":
        name = (obj.get("metadata") or {}).get("name", "")
        raise invalid_status(kind, group, name, [invalid(path, value, f"{path} in body should match "
                                                                     f"'{CRD_QUANTITY_PATTERN}'")
                                                 for path, value, _ in bad])
    raise bad_request(f'{kind} in version "{version}" cannot be handled as a {kind}: {bad[0][2]}')


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity (``8Gi``, ``500M``) in bytes, read as the API server reads it
    (``quantity_value``, apimachinery's ParseQuantity)."""
    value, error = quantity_value(str(quantity))
    if error is not None:
        raise ValueError(f"{error}: {quantity!r}")
    return int(value)
