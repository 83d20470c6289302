"""A run's slots of the operator's ``gpu`` concurrency limit — one per GPU it uses — handed back even when
its process is gone.

Prefect's ``concurrency()`` holds a slot under a lease that the holding process renews and releases. A
process killed outright (a cancelled sweep: the worker sends SIGTERM, then SIGKILL, to the process its
trials run in) releases nothing, and the slot stays taken until the lease expires — five minutes in which
every other run waits for a slot nobody uses. Prefect 3.9 has no API that lists a limit's leases or their
holders, so the run writes its lease's id on its own flow run, as the label ``laneflow.io/gpu-lease``, and
whoever ends the run from outside its process (``release_slot_of``: the hooks of the run and of its sweep)
revokes that lease at once. Revoking a lease that was already released does nothing, so the normal path
and the hook never fight over it.

The slot is taken through the client's lease API itself (increment with a lease, renew, release), not
``prefect.concurrency.sync.concurrency``: that one keeps the lease's id to itself (only a flow run's
cancellation clean-up list sees it, which is empty outside a run's engine context), and the id is the one
thing a release from outside needs.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

from tasks.renewal import renew_until

GPU_LIMIT = "gpu"
#: The flow run label that names the lease of the run's ``gpu`` slot.
GPU_LEASE_LABEL = "laneflow.io/gpu-lease"


#: How long the server keeps a slot whose holder stopped renewing it (Prefect's default for ``concurrency``).
LEASE_S = 300.0
#: The longest wait between two asks for a slot when the server names none (its Retry-After).
MAX_RETRY_WAIT_S = 30.0
_LOG = logging.getLogger("laneflow.gpu_slot")


class MoreSlotsThanTheLimit(ValueError):
    """A run asks for more ``gpu`` slots than the limit has: it could never start, so it is refused at once."""


@contextmanager
def gpu_slot(flow_run_id: str, warn: Callable[[str], None], slots: int = 1,
             waiting: Callable[[str], None] | None = None) -> Iterator[None]:
    """``slots`` slots of the ``gpu`` limit for the block — one per GPU it uses — (no such limit: no wait, as
    with Prefect's ``concurrency``), taken all at once (Prefect increments a limit by ``slots`` in one
    transaction, so two runs never each hold part of what the other needs); under one lease named on flow
    run ``flow_run_id`` so it can be released from outside, renewed while the block runs and released when
    it ends. ``waiting`` hears once that the run waits, with the limit's figures."""
    _release_earlier_attempts_slot(flow_run_id, warn)
    lease = _take_slot(ConcurrencyLeaseHolder(type="flow_run", id=UUID(flow_run_id)), slots, waiting)
    if lease is None:
        yield
        return
    stop = threading.Event()
    # In a copy of this context: the Prefect settings it holds (the API to talk to) are context variables.
    renewing = threading.Thread(target=contextvars.copy_context().run, args=(
        renew_until, stop, LEASE_S / 4, lambda: _renew(lease), f"this run's '{GPU_LIMIT}' slot (lease {lease})", _LOG),
        daemon=True, name="laneflow-gpu-slot")
    renewing.start()
    try:
        _name_lease(flow_run_id, str(lease), warn)
        yield
    finally:
        stop.set()
        renewing.join()
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease)
        except Exception as exc:  # the slot comes back when the lease expires
            warn(f"could not hand back this run's '{GPU_LIMIT}' slot ({exc}): it is free again once Prefect's lease "
                 f"on it expires ({LEASE_S / 60:.0f} minutes)")
        _name_lease(flow_run_id, "", None)  # handed back: a later attempt of this run finds no lease named


def _take_slot(holder: ConcurrencyLeaseHolder, slots: int,
               waiting: Callable[[str], None] | None) -> UUID | None:
    """``slots`` slots of the ``gpu`` limit under a lease of their own, waiting while they are not free (the
    server answers 423 with a Retry-After); None when there is no such limit. More than the limit has is
    refused (the server answers 422): waiting would be for ever."""
    told = False
    with get_client(sync_client=True) as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease([GPU_LIMIT], slots, "concurrency",
                                                                         LEASE_S, holder)
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code == 422 and "greater than the limit" in exc.response.text:
                    raise MoreSlotsThanTheLimit(_over_the_limit(client, slots)) from None
                if exc.response.status_code != 423:
                    raise
                if waiting is not None and not told:
                    told = True
                    limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
                    waiting(f"waiting for {slots} of the '{GPU_LIMIT}' limit's {limit.limit} slots "
                            f"({limit.active_slots} taken by other runs)")
                time.sleep(min(MAX_RETRY_WAIT_S, float(exc.response.headers.get("Retry-After") or 1.0)))
                continue
            granted = response.json()
            lease = UUID(str(granted["lease_id"]))
            if granted.get("limits"):
                return lease
            client.release_concurrency_slots_with_lease(lease)  # a lease over no limit holds nothing
            return None


def refuse_more_than_the_limit(slots: int) -> None:
    """Refuse a run asking for more ``gpu`` slots than the limit has before it prepares anything (taking them
    would refuse it too, after the dataset stage); no limit, no refusal."""
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            return
        if limit.active and slots > limit.limit:
            raise MoreSlotsThanTheLimit(_over_the_limit(client, slots))


def _over_the_limit(client: Any, slots: int) -> str:
    limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit
    return (f"this run asks for {slots} GPUs, one '{GPU_LIMIT}' slot each, but the '{GPU_LIMIT}' concurrency "
            f"limit has {limit} slot{'s' if limit != 1 else ''}, so it could never start: train on fewer workers "
            f"(an elastic run: a lower max_workers), or, where there are {slots} GPUs to train on, raise the "
            f"limit (the UI's Concurrency page, or `prefect gcl update {GPU_LIMIT} --limit {slots}`)")


def _renew(lease: UUID) -> bool:
    """Renew the slot's lease; False once the server no longer holds it (revoked from outside: the run is being
    stopped; or expired after renewals failed for a whole lifetime), which ends the renewals."""
    with get_client(sync_client=True) as client:
        if _lease_live(client, lease, LEASE_S):
            return True
    _LOG.warning("this run's '%s' slot (lease %s) is no longer held: it was released from outside or expired",
                 GPU_LIMIT, lease)
    return False


def _name_lease(flow_run_id: str, lease: str, warn: Callable[[str], None] | None) -> None:
    """Name ``lease`` on the flow run ("": none). Naming a slot just taken that fails is said (``warn``); once the
    slot is handed back it is best effort (an old name only makes a later attempt revoke a lease that is already
    gone, which does nothing)."""
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(UUID(flow_run_id), {GPU_LEASE_LABEL: lease})
    except Exception as exc:
        if warn is not None:
            warn(f"could not name this run's '{GPU_LIMIT}' slot on its flow run ({exc}): if the run is killed, its "
                 f"slot stays taken until Prefect's lease on it expires ({LEASE_S / 60:.0f} minutes)")


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


def _lease_live(client: Any, lease: UUID, renew_for_s: float = 60.0) -> bool:
    """Whether the server still holds ``lease``: renewing one it let go of (released, expired) is refused with
    410 Gone (Prefect's ``/v2/concurrency_limits/leases/{id}/renew``); a live one is renewed for ``renew_for_s``."""
    try:
        client.renew_concurrency_lease(lease, lease_duration=renew_for_s)
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
