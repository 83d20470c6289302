"""How ``laneflow doctor`` reads the cluster: each read's failure is an answer to report (its status and message),
not an error to raise; and whether API discovery serves a resource."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from tasks.doctor import Check, api_served_verdict


def error_text(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message")
        except (TypeError, ValueError, AttributeError):
            message = None
        return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    return f"{type(exc).__name__}: {exc}"


def first_line(exc: BaseException) -> str:
    return (str(getattr(exc, "message", None) or exc).splitlines() or [""])[0]


def ask(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """What ``call`` read (None when the API says 404), or the error that kept it from reading."""
    try:
        return call(), None
    except ApiException as exc:
        return (None, None) if exc.status == 404 else (None, error_text(exc))
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        return None, error_text(exc)


def served_check(client: kubernetes.client.ApiClient, what: str, group: str, version: str, resource: str,
                 fix: str) -> Check:
    """Whether API discovery lists ``resource`` in ``group/version`` (GET /apis/<group>/<version>)."""
    try:
        listed = kubernetes.client.CustomObjectsApi(client).get_api_resources(group, version)
        served: list[str] | None = [item.name for item in listed.resources or []]
    except ApiException as exc:
        if exc.status != 404:
            return Check(f"{what} ({resource}.{group}/{version}) served", False, error_text(exc), fix)
        served = None
    return api_served_verdict(what, f"{group}/{version}", resource, served, fix)
