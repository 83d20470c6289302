"""Which failures a task retries: transient ones only (DESIGN §2).

Retried: a resumable training stop, connection resets and timeouts, HTTP 429 and 5xx from any client
(kubernetes, Azure, httpx), an interrupted download. Never retried: validation errors, 4xx other than
429, a training job that refused its configuration or crashed, a stage past its deadline (another try
would wait as long again) — running those again changes nothing.
"""

from __future__ import annotations

import http.client
import os
from typing import Any

from prefect.tasks import exponential_backoff

from tasks.platforms.base import StageBlocked, StageDeadlineExceeded, TrainingFailed, TransientPlatformError
from training.data.fetch import TransientFetchError


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a client error, whichever client raised it."""
    for attr in ("status", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None)
    return value if isinstance(value, int) else None


def is_transient(exc: BaseException | None) -> bool:
    """True when the same call may succeed if made again later."""
    if exc is None or isinstance(exc, TrainingFailed | StageDeadlineExceeded | StageBlocked | ValueError
                                  | PermissionError | FileNotFoundError):
        return False
    if isinstance(exc, TransientPlatformError | TransientFetchError | ConnectionError | TimeoutError
                  | http.client.RemoteDisconnected | http.client.IncompleteRead):
        return True
    status = _status(exc)
    if status is not None:
        return status == 429 or status >= 500
    name = type(exc).__name__
    # httpx / urllib3 / requests transport failures, without importing each client here.
    return name in {"ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "ReadTimeout",
                    "ConnectTimeout", "PoolTimeout", "ProtocolError", "NewConnectionError", "MaxRetryError",
                    "ServiceRequestError", "ServiceResponseError"}


def retry_on_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry the failed task run only when its error is transient."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as error:  # the result itself could not be read: judge by that error
        exc = error
    return is_transient(exc if isinstance(exc, BaseException) else None)


def retry_policy(base_delay_s: float | None = None) -> dict[str, Any]:
    """``@task`` keyword arguments: 3 retries after base, 2x base, 4x base seconds, each with up to 50% jitter.

    The base is 10 s unless ``LANEFLOW_RETRY_DELAY_S`` says otherwise (the tests use 1 s).
    """
    base = base_delay_s if base_delay_s is not None else float(os.environ.get("LANEFLOW_RETRY_DELAY_S", "10"))
    return {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=base),
            "retry_jitter_factor": 0.5, "retry_condition_fn": retry_on_transient}


RETRY_POLICY = retry_policy()
