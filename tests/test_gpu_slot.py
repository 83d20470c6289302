"""A run's slot of the operator's ``gpu`` limit against the real Prefect server: named on the flow run wherever it is
taken (a flow run's engine context or not), held while the block runs, given to the next run once revoked from
outside, and handed back when the block ends."""

from __future__ import annotations

import contextvars
import threading

import pytest
from prefect import flow, get_client

from tasks.gpu_slot import GPU_LEASE_LABEL, gpu_slot, release_slot_of
from tests.gpu_limit import active_gpu_slots, lease_released, operator_gpu_limit


@flow(name="holds-a-gpu")
def holds_a_gpu() -> None:
    """Only a flow for the server to make runs of: the slots here are taken by the test itself."""


def test_a_slot_taken_outside_a_flow_runs_engine_is_named_on_its_run_and_a_revoked_one_goes_to_the_next_run(
        prefect_server: dict) -> None:
    """Outside a flow run's engine (no ConcurrencyContext: where Prefect's own ``concurrency`` hides its lease's
    id) the slot is still named on the run, so a hook can revoke it; the run queued behind gets it then."""
    with get_client(sync_client=True) as client:
        first, second = (client.create_flow_run(holds_a_gpu) for _ in range(2))
    warnings: list[str] = []
    second_got_it, let_go = threading.Event(), threading.Event()

    def second_run() -> None:
        with gpu_slot(str(second.id), warnings.append):
            second_got_it.set()
            let_go.wait(120)

    with operator_gpu_limit(1):
        with gpu_slot(str(first.id), warnings.append):
            with get_client(sync_client=True) as client:
                lease = (client.read_flow_run(first.id).labels or {}).get(GPU_LEASE_LABEL)
            assert lease and not lease_released(lease) and active_gpu_slots() == 1, lease
            # With this test's Prefect settings (a context variable): a new thread starts without them.
            waiting = threading.Thread(target=contextvars.copy_context().run, args=(second_run,), daemon=True)
            waiting.start()
            assert not second_got_it.wait(3)  # one slot, taken: the second run waits
            assert release_slot_of(first.id)  # as the first run's hook does when its process was killed
            assert second_got_it.wait(120), "the revoked slot never reached the run waiting for it"
        let_go.set()
        waiting.join(120)
        assert not waiting.is_alive()
        assert active_gpu_slots() == 0
    with get_client(sync_client=True) as client:
        labels = [(client.read_flow_run(run.id).labels or {}).get(GPU_LEASE_LABEL) for run in (first, second)]
    assert labels == ["", ""], (labels, warnings)  # handed back: nothing named for a later attempt to revoke
    assert not warnings, warnings


def test_a_run_takes_a_slot_per_gpu_all_at_once_and_one_asking_more_than_the_limit_is_refused_at_once(
        prefect_server: dict) -> None:
    """Under a limit of 6: a 4-GPU run holds 4 slots; a 3-GPU run waits (it is told so, with the limit's figures)
    while a 2-GPU one fits beside it; an 8-GPU run is refused at once, saying how to fix it, never left waiting."""
    from tasks.gpu_slot import MoreSlotsThanTheLimit, refuse_more_than_the_limit

    with get_client(sync_client=True) as client:
        big, middle, small, huge = (client.create_flow_run(holds_a_gpu) for _ in range(4))
    warnings: list[str] = []
    heard: list[str] = []
    middle_got_it = threading.Event()

    def middle_run() -> None:
        with gpu_slot(str(middle.id), warnings.append, slots=3, waiting=heard.append):
            middle_got_it.set()

    with operator_gpu_limit(6):
        with gpu_slot(str(big.id), warnings.append, slots=4):
            assert active_gpu_slots() == 4
            waiting = threading.Thread(target=contextvars.copy_context().run, args=(middle_run,), daemon=True)
            waiting.start()
            with gpu_slot(str(small.id), warnings.append, slots=2):
                assert active_gpu_slots() == 6
            assert not middle_got_it.wait(3)  # 4 taken of 6: 3 do not fit
            assert heard == ["waiting for 3 of the 'gpu' limit's 6 slots (4 taken by other runs)"] or \
                heard == ["waiting for 3 of the 'gpu' limit's 6 slots (6 taken by other runs)"], heard
            refuse_more_than_the_limit(6)  # fits the limit, if not now
            with pytest.raises(MoreSlotsThanTheLimit, match=r"asks for 8 GPUs.*limit has 6 slots.*"
                                                            r"prefect gcl update gpu --limit 8"):
                refuse_more_than_the_limit(8)
            # The server's own refusal, for a limit lowered after the run's first check:
            with pytest.raises(MoreSlotsThanTheLimit, match="asks for 8 GPUs"), \
                    gpu_slot(str(huge.id), warnings.append, slots=8):
                pass
        assert middle_got_it.wait(120), "the freed slots never reached the run waiting for 3"
        waiting.join(120)
        assert active_gpu_slots() == 0
    assert not warnings, warnings
