"""Whether this flow run's process is being stopped so that the run goes on in another one.

On a cluster the flow runs in a pod that prefect-kubernetes' worker made, under ``prefect flow-run execute``.
When that pod is stopped from outside — a drain of its node for a node-image upgrade or the autoscaler's
scale-down, a spot VM taken back — the kubelet sends SIGTERM to the supervisor, which (with the worker's
``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule``, set for Jobs whose ``backoffLimit`` is 0:
prefect_kubernetes ``worker.py`` ``_configure_eviction_handling``) records the intent ``reschedule`` on the
engine's control channel and proposes ``AwaitingRetry``; the flow's code then sees a ``TerminationSignal``
(prefect ``cli/flow_run.py`` ``_termination_intent``, ``flow_engine.py`` ``_SUPERVISOR_OWNED_INTENTS``).
``relinquish`` is the same hand-over to Kubernetes' own Job retries. A user's cancel is intent ``cancel``.

What a hand-over must not do is undo the work the next attempt is to carry on: an MPIJob that trains on GPU
nodes elsewhere is left running (the next attempt adopts it by name), and the volume's service-level hold stays.
A sweep's trial is the exception: its sweep's next attempt runs it again as a new flow run, which may not adopt
another run's job, so that attempt stops the job and the trial resumes from its checkpoint (``flows.sweep``).
"""

from __future__ import annotations

#: The supervisor's intents that hand the run to a later attempt (prefect ``_internal/attempt_control.py``).
HANDED_OVER = ("reschedule", "relinquish")


def handed_over(exc: BaseException) -> bool:
    """``exc`` is the flow process being stopped so that the run continues in another attempt."""
    from prefect.exceptions import TerminationSignal

    if not isinstance(exc, TerminationSignal):
        return False
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:  # a Prefect without the control channel: a plain SIGTERM, nothing handed over
        return False
    return get_intent() in HANDED_OVER
