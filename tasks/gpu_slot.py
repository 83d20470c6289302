"""A run's slot of the operator's ``gpu`` concurrency limit, handed back even when its process is gone.

Prefect's ``concurrency()`` holds a slot under a lease that the holding process renews and releases. A
process killed outright (a cancelled sweep: the worker sends SIGTERM, then SIGKILL, to the process its
trials run in) releases nothing, and the slot stays taken until the lease expires — five minutes in which
every other run waits for a slot nobody uses. Prefect 3.9 has no API that lists a limit's leases or their
holders, so the run writes its lease's id on its own flow run, as the label ``laneflow.io/gpu-lease``, and
whoever ends the run from outside its process (``release_slot_of``: the hooks of the run and of its sweep)
revokes that lease at once. Revoking a lease that was already released does nothing, so the normal path
and the hook never fight over it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency.context import ConcurrencyContext
from prefect.concurrency.sync import concurrency

GPU_LIMIT = "gpu"
#: The flow run label that names the lease of the run's ``gpu`` slot.
GPU_LEASE_LABEL = "laneflow.io/gpu-lease"


@contextmanager
def gpu_slot(flow_run_id: str, warn: Callable[[str], None]) -> Iterator[None]:
    """One slot of the ``gpu`` limit for the block (no limit: no wait, as with ``concurrency``), its lease
    named on flow run ``flow_run_id`` (and held in its name) so it can be released from outside."""
    # Prefect records each lease it grants on the run's ConcurrencyContext (to release it if the block is
    # cancelled before it can); that is the only place the lease's id is visible to the caller.
    _release_earlier_attempts_slot(flow_run_id, warn)
    context = ConcurrencyContext.get()
    before = set(context.cleanup_lease_ids) if context is not None else set()
    with concurrency(GPU_LIMIT, occupy=1, holder=ConcurrencyLeaseHolder(type="flow_run", id=UUID(flow_run_id))):
        granted = [lease for lease in (context.cleanup_lease_ids if context is not None else []) if lease not in before]
        if granted:
            try:
                with get_client(sync_client=True) as client:
                    client.update_flow_run_labels(UUID(flow_run_id), {GPU_LEASE_LABEL: str(granted[-1])})
            except Exception as exc:  # the slot is held all the same; only a release from outside is lost
                warn(f"could not name this run's '{GPU_LIMIT}' slot on its flow run ({exc}): if the run is killed, "
                     "its slot stays taken until Prefect's lease on it expires (5 minutes)")
        try:
            yield
        finally:
            if granted:  # handed back as the block ends: a later attempt of this run finds no lease named
                _name_lease(flow_run_id, "")


def _name_lease(flow_run_id: str, lease: str) -> None:
    """Name ``lease`` on the flow run ("": none); best effort once the slot is handed back (an old name only
    makes a later attempt revoke a lease that is already gone, which does nothing)."""
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(UUID(flow_run_id), {GPU_LEASE_LABEL: lease})
    except Exception:
        pass


def _release_earlier_attempts_slot(flow_run_id: str, warn: Callable[[str], None]) -> None:
    """A run takes its slot once per attempt, so a lease already named on it is an earlier attempt's: one whose
    process was killed before it could hand the slot back (the OOM killer, a lost node: no hook runs), and the
    run is now being retried. Without this the retry would wait for its own slot until Prefect's lease on it
    expired (5 minutes, with a limit of one). Revoking a lease that is already gone does nothing."""
    try:
        with get_client(sync_client=True) as client:
            lease = (client.read_flow_run(UUID(flow_run_id)).labels or {}).get(GPU_LEASE_LABEL)
            if not lease or not _lease_live(client, UUID(str(lease))):
                return
            client.release_concurrency_slots_with_lease(UUID(str(lease)))
        warn(f"this run's earlier attempt still held a '{GPU_LIMIT}' slot (its process was killed before it could "
             "hand it back): released")
    except Exception as exc:  # then the retry waits for that lease to expire, as without this
        warn(f"could not release the '{GPU_LIMIT}' slot of this run's earlier attempt ({exc}): this attempt waits "
             "until Prefect's lease on it expires (5 minutes) if no other slot is free")


def _lease_live(client: Any, lease: UUID) -> bool:
    """Whether the server still holds ``lease``: renewing one it let go of (released, expired) is refused with
    410 Gone (Prefect's ``/v2/concurrency_limits/leases/{id}/renew``); a live one is renewed for a minute."""
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        client.renew_concurrency_lease(lease, lease_duration=60)
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code in (404, 410):
            return False
        raise
    return True


def release_slot_of(flow_run_id: Any) -> bool:
    """Revoke the ``gpu`` lease flow run ``flow_run_id`` named (its process was stopped before it could release
    it); False when it named none (it never got a slot). The labels are read afresh: a hook's copy of the flow
    run may be older than the slot."""
    with get_client(sync_client=True) as client:
        lease = (client.read_flow_run(UUID(str(flow_run_id))).labels or {}).get(GPU_LEASE_LABEL)
        if not lease:
            return False
        client.release_concurrency_slots_with_lease(UUID(str(lease)))
    return True
