"""The emulated API server's refusals, as the real one renders them: a Status body with its HTTP code, and
for an invalid object the field errors as its ``details.causes`` (kubernetes/apimachinery v0.36
``pkg/api/errors/errors.go`` ``NewInvalid``, ``pkg/util/validation/field/errors.go``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Rejection(Exception):
    """The API server's refusal: an HTTP status and its Status body."""

    code: int
    body: dict

    def __str__(self) -> str:
        return f"{self.code} {self.body.get('reason')}: {self.body.get('message')}"


@dataclass
class Cause:
    """One field error: apimachinery's ``field.Error`` as it appears in a Status's ``details.causes``."""

    reason: str   # FieldValueRequired, FieldValueInvalid, ...
    field: str
    message: str  # the error body without the field: 'Required value', 'Invalid value: "x": ...'

    def text(self) -> str:
        return f"{self.field}: {self.message}"


def quote(value: Any) -> str:
    """How field errors print a value: strings quoted, numbers and bools plain, the rest as JSON."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def required(path: str, detail: str = "") -> Cause:
    return Cause("FieldValueRequired", path, "Required value" + (f": {detail}" if detail else ""))


def invalid(path: str, value: Any, detail: str) -> Cause:
    return Cause("FieldValueInvalid", path, f"Invalid value: {quote(value)}: {detail}")


def not_supported(path: str, value: Any, supported: list[str]) -> Cause:
    options = ", ".join(json.dumps(option) for option in supported)
    return Cause("FieldValueNotSupported", path, f"Unsupported value: {quote(value)}: supported values: {options}")


def invalid_status(kind: str, group: str, name: str, causes: list[Cause]) -> Rejection:
    """422 Invalid, as ``errors.NewInvalid`` renders it."""
    qualified = f"{kind}.{group}" if group else kind
    texts = [cause.text() for cause in causes]
    aggregate = texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
    return Rejection(422, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"{qualified} {json.dumps(name)} is invalid: {aggregate}", "reason": "Invalid",
        "details": {"name": name, "group": group, "kind": kind,
                    "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]},
        "code": 422})


def bad_request(message: str) -> Rejection:
    return Rejection(400, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": "BadRequest", "code": 400})


def status_body(code: int, reason: str, message: str, **extra: Any) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code, **extra}
