"""What the alert automations watch (flows/alerts.py), as Prefect's trigger model reads them: pure."""

from __future__ import annotations

from datetime import timedelta

from prefect.events.schemas.automations import Posture

from flows.alerts import PREFIX, AlertSettings, nightly_automations

BLOCK = "6a1c7d2e-0000-4000-8000-000000000002"


def test_each_alert_watches_the_nightlys_runs_for_its_own_condition() -> None:
    nightly = "0b8f0e6c-0000-4000-8000-000000000001"
    automations = {a.name.removeprefix(PREFIX): a for a in nightly_automations(
        nightly, BLOCK, AlertSettings("custom-webhook/x", 6, 45))}
    assert set(automations) == {"nightly failed", "nightly running too long", "nightly not started",
                                "champion decision"}
    for name in ("nightly failed", "nightly running too long", "nightly not started"):
        trigger = automations[name].trigger
        # Only runs of the nightly deployment (the server relates each flow-run event to its deployment).
        assert trigger.match_related.model_dump() == {"prefect.resource.id": f"prefect.deployment.{nightly}",
                                         "prefect.resource.role": "deployment"}
        assert all(str(action.block_document_id) == BLOCK for action in automations[name].actions)
    failed = automations["nightly failed"].trigger
    assert failed.posture == Posture.Reactive and failed.expect == {"prefect.flow-run.Failed",
                                                                    "prefect.flow-run.Crashed"}
    stalled = automations["nightly running too long"].trigger
    # Proactive: Running, then no final state within 6 h, counted per flow run.
    assert stalled.posture == Posture.Proactive and stalled.after == {"prefect.flow-run.Running"}
    assert stalled.within == timedelta(hours=6) and stalled.for_each == {"prefect.resource.id"}
    assert {"prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Crashed",
            "prefect.flow-run.Cancelled"} <= stalled.expect
    waiting = automations["nightly not started"].trigger
    assert waiting.after == {"prefect.flow-run.Late", "prefect.flow-run.Pending"}
    assert "prefect.flow-run.Running" in waiting.expect and waiting.within == timedelta(minutes=45)
    champion = automations["champion decision"]
    assert champion.trigger.expect == {"laneflow.champion.promoted", "laneflow.champion.kept"}
    assert "challenger_accuracy" in champion.actions[0].body and "champion_accuracy" in champion.actions[0].body
