"""Alerts as code: the Prefect automations that tell someone when the nightly retrain needs them.

``laneflow deploy`` and ``laneflow serve`` apply them after the deployments, idempotently (each automation
is found by its name and updated in place; applying twice leaves one of each). The Prefect server's
automation services evaluate them and send the message through a notification block the user made
(Slack webhook, Microsoft Teams webhook, a custom webhook...): laneflow never sends alerts itself.

Settings (environment first, then a Prefect variable of the same meaning, so a UI user can set them):

- ``LANEFLOW_ALERT_BLOCK`` / variable ``laneflow-alert-block``: ``<block-type-slug>/<block-name>``, e.g.
  ``slack-webhook/ml-alerts``; without it nothing is applied and the log says how to configure one;
- ``LANEFLOW_ALERT_RUNNING_HOURS`` / ``laneflow-alert-running-hours`` (default 12): a nightly run still
  Running after this long is reported as stalled;
- ``LANEFLOW_ALERT_NOT_STARTED_MINUTES`` / ``laneflow-alert-not-started-minutes`` (default 30): a nightly
  run Late or Pending this long without starting is reported.

Events (Prefect 3 docs, "Automations and triggers"; prefect.events.schemas.automations): the server
emits ``prefect.flow-run.<state name>`` for every flow run state, with the run's deployment as a related
resource of role ``deployment``; a reactive trigger fires when a matching event arrives, a proactive one
when an ``after`` event is not followed by an ``expect`` event ``within`` seconds (per run, ``for_each``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from prefect import get_client
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.exceptions import ObjectNotFound
from prefect.variables import Variable

NIGHTLY_DEPLOYMENT = "nightly_retrain/nightly"
#: Every automation laneflow owns starts with this: found by it, never confused with the user's own.
PREFIX = "laneflow alert: "
FINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled", "Cancelling", "Pruned", "Stopped")
DEFAULT_RUNNING_HOURS = 12.0
DEFAULT_NOT_STARTED_MINUTES = 30.0
HOW_TO_CONFIGURE = (
    "make a notification block (Prefect UI: Blocks -> + -> Slack Webhook, Microsoft Teams Webhook or Custom "
    "Webhook; or in Python, e.g. SlackWebhook(url=...).save('ml-alerts')), then set LANEFLOW_ALERT_BLOCK="
    "slack-webhook/ml-alerts (or the Prefect variable laneflow-alert-block) and run `laneflow deploy` again")


class AlertSetupError(ValueError):
    """The alert settings name something that does not exist or make no sense; says what to fix."""


@dataclass(frozen=True)
class AlertSettings:
    block: str | None
    running_hours: float = DEFAULT_RUNNING_HOURS
    not_started_minutes: float = DEFAULT_NOT_STARTED_MINUTES


def _setting(env_name: str, variable: str) -> str | None:
    value = os.environ.get(env_name)
    if value:
        return value
    stored = Variable.get(variable, default=None)
    return str(stored) if stored not in (None, "") else None


def _positive(raw: str | None, name: str, default: float) -> float:
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise AlertSetupError(f"{name}={raw!r}: must be a positive number")
    return value


def read_settings() -> AlertSettings:
    """The alert settings from the environment and Prefect variables (see the module docstring)."""
    return AlertSettings(
        block=_setting("LANEFLOW_ALERT_BLOCK", "laneflow-alert-block"),
        running_hours=_positive(_setting("LANEFLOW_ALERT_RUNNING_HOURS", "laneflow-alert-running-hours"),
                                "LANEFLOW_ALERT_RUNNING_HOURS", DEFAULT_RUNNING_HOURS),
        not_started_minutes=_positive(
            _setting("LANEFLOW_ALERT_NOT_STARTED_MINUTES", "laneflow-alert-not-started-minutes"),
            "LANEFLOW_ALERT_NOT_STARTED_MINUTES", DEFAULT_NOT_STARTED_MINUTES))


def _run_events(states: tuple[str, ...]) -> set[str]:
    return {f"prefect.flow-run.{state}" for state in states}


def _deployment_runs(deployment_id: str) -> dict[str, Any]:
    """Trigger fields matching flow runs of one deployment."""
    return {"match": {"prefect.resource.id": "prefect.flow-run.*"},
            "match_related": {"prefect.resource.id": f"prefect.deployment.{deployment_id}",
                              "prefect.resource.role": "deployment"}}


RUN_BODY = ("Flow run {{ flow_run.name }} of deployment {{ deployment.name }} is {{ flow_run.state.name }}: "
            "{{ flow_run.state.message }}\n{{ flow_run|ui_url }}")


def nightly_automations(nightly_deployment_id: str, block_document_id: str,
                        settings: AlertSettings) -> list[AutomationCore]:
    """The automations for the nightly retrain (pure: what to apply, given the ids they point at)."""
    notify = {"block_document_id": block_document_id}
    runs = _deployment_runs(nightly_deployment_id)
    running = timedelta(hours=settings.running_hours)
    waiting = timedelta(minutes=settings.not_started_minutes)
    return [
        AutomationCore(
            name=f"{PREFIX}nightly failed", description="A nightly retrain failed or crashed.",
            trigger=EventTrigger(**runs, expect=_run_events(("Failed", "Crashed")), posture=Posture.Reactive,
                                 threshold=1, within=timedelta(0)),
            actions=[SendNotification(**notify, subject="laneflow: nightly retrain {{ flow_run.state.name }}",
                                      body=RUN_BODY)]),
        AutomationCore(
            name=f"{PREFIX}nightly running too long",
            description=f"A nightly retrain still Running after {settings.running_hours:g} h.",
            trigger=EventTrigger(**runs, after=_run_events(("Running",)), expect=_run_events(FINAL_STATES),
                                 for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                                 within=running),
            actions=[SendNotification(
                **notify, subject="laneflow: nightly retrain stalled",
                body=f"Flow run {{{{ flow_run.name }}}} has been Running for over {settings.running_hours:g} h "
                     "(is it stuck?).\n{{ flow_run|ui_url }}")]),
        AutomationCore(
            name=f"{PREFIX}nightly not started",
            description=f"A nightly retrain Late or Pending for {settings.not_started_minutes:g} min.",
            trigger=EventTrigger(**runs, after=_run_events(("Late", "Pending")),
                                 expect=_run_events(("Running", *FINAL_STATES)), for_each={"prefect.resource.id"},
                                 posture=Posture.Proactive, threshold=1, within=waiting),
            actions=[SendNotification(
                **notify, subject="laneflow: nightly retrain not started",
                body=f"Flow run {{{{ flow_run.name }}}} was due but has not started within "
                     f"{settings.not_started_minutes:g} min (is a worker polling the work pool?).\n"
                     "{{ flow_run|ui_url }}")]),
        AutomationCore(
            name=f"{PREFIX}champion decision", description="The nightly promoted a new champion or kept the old one.",
            trigger=EventTrigger(match={"prefect.resource.id": "laneflow.champion.*"},
                                 expect={"laneflow.champion.promoted", "laneflow.champion.kept"},
                                 posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[SendNotification(
                **notify, subject="laneflow: champion {{ event.event.rsplit('.', 1)[1] }}",
                body="Champion {{ event.payload.champion }} (challenger {{ event.payload.challenger }}): "
                     "challenger val accuracy {{ event.payload.challenger_accuracy }}, previous champion "
                     "{{ event.payload.champion_accuracy }}. {{ event.payload.reason }}")]),
    ]


def notification_block_id(client: Any, block: str) -> str:
    """The id of the block ``<type-slug>/<name>``; AlertSetupError saying what exists when it does not."""
    slug, _, name = block.partition("/")
    if not slug or not name:
        raise AlertSetupError(f"alert block {block!r}: expected <block-type-slug>/<block-name>, e.g. "
                              "slack-webhook/ml-alerts")
    try:
        document = client.read_block_document_by_name(name, slug, include_secrets=False)
    except ObjectNotFound:
        raise AlertSetupError(f"alert block {block!r} does not exist on this Prefect server: "
                              f"{HOW_TO_CONFIGURE}") from None
    return str(document.id)


def apply_alerts(settings: AlertSettings | None = None) -> list[str]:
    """Create or update laneflow's automations; the names applied (none when no block is configured).

    Idempotent: an automation of the same name is updated in place, and extra copies (from an earlier
    concurrent apply) are deleted, so there is one of each."""
    settings = settings or read_settings()
    if not settings.block:
        print(f"laneflow: no alert block configured, so no alerts are applied: {HOW_TO_CONFIGURE}", flush=True)
        return []
    with get_client(sync_client=True) as client:
        block_id = notification_block_id(client, settings.block)
        nightly = client.read_deployment_by_name(NIGHTLY_DEPLOYMENT)
        wanted = nightly_automations(str(nightly.id), block_id, settings)
        for automation in wanted:
            existing = client.read_automations_by_name(automation.name)
            if existing:
                client.update_automation(existing[0].id, automation)
                for extra in existing[1:]:
                    client.delete_automation(extra.id)
            else:
                client.create_automation(automation)
    names = [automation.name for automation in wanted]
    print(f"laneflow: alerts applied through block {settings.block}: {', '.join(names)}", flush=True)
    return names
