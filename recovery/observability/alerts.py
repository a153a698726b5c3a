"""Alerts on stuck runs: which runs are overdue, and sending what was raised.

A workflow says when a stuck run is overdue (``Workflow(stuck_after=…)``, per cause or for any).
Every sweep — Celery beat's ``sweep`` task, or the embedded executor's loop (``run_executor``) —
raises an alert for each run stuck for a cause longer than that since its last change, once per
run and episode (a change of the run ends the episode), for its most specific overdue cause;
resolves the alerts whose run is no longer stuck for their cause; and sends what is due through
the configured channels:

- ``RECOVERY_ALERT_WEBHOOK_URL``: a POST of JSON (the run, the cause, the "why is this run not
  moving" sentence, the console's link), signed with HMAC-SHA256 of ``timestamp.body`` under
  ``RECOVERY_ALERT_WEBHOOK_SECRET`` (``X-Recovery-Signature: sha256=…``, ``X-Recovery-Timestamp``),
  with ``X-Recovery-Delivery`` for the receiver to drop a repeat: a delivery whose sender died
  mid-send is sent again;
- ``RECOVERY_ALERT_EMAILS``: an e-mail through Django's e-mail backend.

A failed attempt is retried with backoff (transitions.alerts.DELIVERY_ATTEMPTS). The raising,
each sending, a give-up and the resolution are audited on the run (the transitions do that)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings
from django.core.mail import send_mail
from django.db.models import Exists, F, OuterRef

from recovery import clock, counts
from recovery import why as why_sentence
from recovery.engine import transitions
from recovery.models import Alert, AlertDelivery, AlertState, WorkflowPause, WorkflowRun
from recovery.workflow import all_workflows

LIMIT = 100  # alerts raised, resolved or sent per sweep: a backlog is worked off over several
SEND_SECONDS = 5.0  # at most this long sending per sweep (a timeout counts whole)


def channels() -> list[str]:
    """The channels configured in settings, in the order they are tried."""
    found = []
    if settings.RECOVERY_ALERT_WEBHOOK_URL:
        found.append("webhook")
    if settings.RECOVERY_ALERT_EMAILS:
        found.append("email")
    return found


def sweep(now: datetime | None = None) -> dict[str, int]:
    """One round: raise what is overdue, resolve what moved on, send what is due."""
    now = now or clock.now()
    raised = raise_overdue(now) + raise_paused(now)
    return {"raised": raised, "resolved": resolve_moved(now) + resolve_released(now), "sent": send_due(now)}


def raise_paused(now: datetime) -> int:
    """One alert for each step that paused itself (``pause_after``) and has none yet: not one per
    run it stops."""
    paused = WorkflowPause.objects.filter(automatic=True, released_at=None, alert__isnull=True).order_by("pk")
    configured = channels()
    return sum(
        transitions.alert_raise_paused(pause_pk=pk, channels=configured, now=now) is not None
        for pk in paused.values_list("pk", flat=True)[:LIMIT]
    )


def resolve_released(now: datetime) -> int:
    """Resolve the alert of a step that paused itself once a supervisor released the pause."""
    released = Alert.objects.filter(
        state__in=[AlertState.FIRING, AlertState.SNOOZED], workflow_pause__released_at__isnull=False
    ).select_related("workflow_pause")
    return sum(
        transitions.alert_resolve(alert_pk=alert.pk, why=_released(alert.workflow_pause), now=now) is not None
        for alert in released.order_by("pk")[:LIMIT]
    )


def _released(pause: WorkflowPause) -> str:
    return f"{pause.scope} unpaused by {pause.released_by}: {pause.release_reason}"


def raise_overdue(now: datetime) -> int:
    """One alert per run and episode: for the first of its causes that is overdue, the specific
    ones (an unknown outcome, retries exhausted, a refusal …) before "needs review", which most of
    them also are — a run in review with its retries exhausted pages once, not twice."""
    raised = 0
    causes = sorted(counts.stuck_causes(now).items(), key=lambda item: item[0] == "needs_review")
    configured = channels()
    for workflow in all_workflows():
        for cause, (_, condition) in causes:
            after = workflow.overdue_after(cause)
            if after is None or raised >= LIMIT:
                continue
            alerted = Alert.objects.filter(run=OuterRef("pk"), revision=OuterRef("revision"), workflow_pause=None)
            snoozed = Alert.objects.filter(run=OuterRef("pk"), snoozed_until__gt=now)
            overdue = list(
                WorkflowRun.objects.filter(condition, workflow_name=workflow.name, updated_at__lte=now - after)
                .filter(~Exists(alerted), ~Exists(snoozed))
                .order_by("pk")[: LIMIT - raised]
            )
            why_sentence.for_page(overdue, now=now)
            for run in overdue:
                alert = transitions.alert_raise(
                    run_pk=run.pk, cause=cause, revision=run.revision, why=run.why, channels=configured, now=now
                )
                raised += alert is not None
    return raised


def resolve_moved(now: datetime) -> int:
    """Resolve the open alerts whose run changed since they were raised, or is no longer stuck
    for their cause: found in SQL (one query for the changed, one per cause), never by reading
    every open alert."""
    causes = counts.stuck_causes(now)
    # A paused step's alert is resolved with its pause (resolve_released), not when its run moves.
    open_alerts = Alert.objects.filter(
        state__in=[AlertState.FIRING, AlertState.SNOOZED], workflow_pause__isnull=True
    ).select_related("run")
    found = [
        (alert, f"the run changed (it is now {alert.run.state})")
        for alert in open_alerts.exclude(run__revision=F("revision")).order_by("pk")[:LIMIT]
    ]
    found += [
        (alert, f"{alert.cause} is no longer a stuck cause")
        for alert in open_alerts.exclude(cause__in=list(causes)).order_by("pk")[: LIMIT - len(found)]
    ]
    for cause, (label, condition) in causes.items():
        if len(found) >= LIMIT:
            break
        # NOT IN: the cause's few runs are read once (hashed), not once per alert as EXISTS did.
        still = WorkflowRun.objects.filter(condition).values("pk")
        moved_on = open_alerts.filter(cause=cause, run__revision=F("revision")).exclude(run_id__in=still)
        found += [
            (alert, f"no longer stuck ({label.lower()}): the run is {alert.run.state}")
            for alert in moved_on.order_by("pk")[: LIMIT - len(found)]
        ]
    return sum(transitions.alert_resolve(alert_pk=alert.pk, why=why, now=now) is not None for alert, why in found)


def send_due(now: datetime) -> int:
    """Send what is due, one delivery at a time, for at most SEND_SECONDS of this sweep: a receiver
    that hangs until its timeout delays the sweep (and the embedded executor's loop) by that
    much, not by one timeout per alert; what is left is sent by the next sweep."""
    sent = attempted = 0
    started = time.monotonic()
    while attempted < LIMIT and time.monotonic() - started < SEND_SECONDS:
        claimed = transitions.alert_deliveries_claim(limit=1, now=now)
        if not claimed:
            break
        delivery, attempted = claimed[0], attempted + 1
        try:
            SENDERS[delivery.channel](delivery, payload(delivery))
        except Exception as exc:  # noqa: BLE001 - any failure of a channel is retried, never fatal to the sweep
            transitions.alert_delivery_failed(delivery_pk=delivery.pk, error=f"{type(exc).__name__}: {exc}")
            continue
        transitions.alert_delivered(delivery_pk=delivery.pk)
        sent += 1
    return sent


def payload(delivery: AlertDelivery) -> dict[str, Any]:
    """What a channel says about an alert."""
    alert, run = delivery.alert, delivery.alert.run
    data = {
        "alert": alert.pk,
        "delivery": delivery.pk,
        "workflow_id": run.workflow_id,
        "workflow": run.workflow_name,
        "run_state": run.state,
        "cause": alert.cause,
        "cause_label": label(alert.cause),
        "why": alert.why,
        "stuck_since": alert.stuck_since.isoformat(),
        "raised_at": alert.raised_at.isoformat(),
        "url": f"{settings.RECOVERY_CONSOLE_URL}/runs/{quote(run.workflow_id, safe='')}",
    }
    if alert.workflow_pause_id is not None:  # a step paused itself: the incident, not this run
        data.update(paused=alert.workflow_pause.scope, url=f"{settings.RECOVERY_CONSOLE_URL}/dashboard#workflow-pauses")
    return data


def label(cause: str) -> str:
    """An alert's cause as the console and the channels say it."""
    return PAUSED_LABEL if cause == transitions.AUTO_PAUSED else counts.STUCK_LABELS.get(cause, cause)


PAUSED_LABEL = "Step paused by itself"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=`` and the HMAC-SHA256, under ``secret``, of ``timestamp.body``: what a receiver
    computes again to trust a webhook (and checks the timestamp is recent, against a replay)."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def _webhook(delivery: AlertDelivery, data: dict[str, Any]) -> None:
    body = json.dumps(data, sort_keys=True).encode()
    timestamp = str(int(clock.now().timestamp()))
    headers = {
        "Content-Type": "application/json",
        "X-Recovery-Delivery": str(delivery.pk),
        "X-Recovery-Timestamp": timestamp,
        "X-Recovery-Signature": signature(settings.RECOVERY_ALERT_WEBHOOK_SECRET, timestamp, body),
    }
    response = httpx.post(
        settings.RECOVERY_ALERT_WEBHOOK_URL, content=body, headers=headers, timeout=settings.RECOVERY_HTTP_TIMEOUT
    )
    if not response.is_success:
        raise RuntimeError(f"the webhook answered {response.status_code}")


def _email(delivery: AlertDelivery, data: dict[str, Any]) -> None:
    subject = f"[Recovery Console] {data['workflow_id']}: {data['cause_label'].lower()}"
    body = (
        f"Run {data['workflow_id']} ({data['workflow']}, {data['run_state']}) has been stuck since "
        f"{data['stuck_since']}: {data['cause_label'].lower()}.\n\nWhy it is not moving: {data['why']}\n\n"
        f"Open it: {data['url']}\n"
    )
    send_mail(subject, body, None, settings.RECOVERY_ALERT_EMAILS)


SENDERS = {"webhook": _webhook, "email": _email}
