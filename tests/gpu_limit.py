"""The operator's ``gpu`` concurrency limit, set for one test and put back as it was after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from uuid import UUID

from prefect import get_client
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

from flows.train import GPU_LIMIT


def active_gpu_slots() -> int:
    """Slots of the ``gpu`` limit held right now (what the UI's concurrency page shows as active)."""
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots


@contextlib.contextmanager
def operator_gpu_limit(slots: int) -> Iterator[None]:
    """The ``gpu`` limit at ``slots`` while inside, as an operator sets it; afterwards as it was (gone when it
    did not exist)."""
    with get_client(sync_client=True) as client:
        try:
            before: int | None = client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit
        except ObjectNotFound:
            before = None
        client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, slots)
    try:
        yield
    finally:
        with get_client(sync_client=True) as client:
            if before is None:
                client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
            else:
                client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, before)


def lease_released(lease_id: str) -> bool:
    """Whether the server has let go of a ``gpu`` lease: renewing it is refused with 410 Gone, as Prefect's
    API answers for a lease that was revoked or has expired (a live one is renewed, for one minute)."""
    with get_client(sync_client=True) as client:
        try:
            client.renew_concurrency_lease(UUID(lease_id), lease_duration=60)
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code == 410:
                return True
            raise
    return False
