"""The alerts a supervisor silenced: who snoozed each, until when and why, for the dashboard.
A snoozed alert sends nothing until its time is up (recovery.engine.transitions.alerts): these
are the stuck runs nobody is being told about."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from recovery import counts
from recovery.models import Alert, AlertState
from recovery.observability.alerts import label

SNOOZED_SHOWN = 20


def snoozed(now: datetime) -> dict[str, Any]:
    """The snoozed alerts, the soonest to end first (at most SNOOZED_SHOWN), each with its cause's
    label and whether its snooze has ended (the next sweep decides again), and how many there
    are (capped). Two queries, on the alerts' state index."""
    alerts = Alert.objects.filter(state=AlertState.SNOOZED)
    (count, capped), *_ = counts.capped_counts([alerts])
    shown = list(alerts.select_related("run").order_by("snoozed_until", "pk")[:SNOOZED_SHOWN])
    for alert in shown:
        alert.label = label(alert.cause)
        alert.ended = alert.snoozed_until is not None and alert.snoozed_until <= now
    return {"count": count, "capped": capped, "alerts": shown, "more": count > len(shown)}
