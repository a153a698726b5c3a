"""Alerts on stuck runs: raised once per run and episode, audited on the run, delivered
through each configured channel with retries, resolved when the run moves on, snoozed by a
supervisor with a reason. None of these changes a run or a step: they write an alert's rows and
the run's audit trail (recovery.observability.alerts decides when; these record it)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from recovery import clock
from recovery.actions import MAX_SNOOZE_HOURS, SNOOZE_DEFAULT_HOURS
from recovery.engine import metrics
from recovery.errors import InvalidTransition
from recovery.models import Alert, AlertDelivery, AlertState, DeliveryState, WorkflowPause, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction

from . import offers
from ._core import _audit
from .acting import acting
from .performers import performs

ALERTS = "alerts"  # the actor of the alerts' own audit events
DELIVERY_ATTEMPTS = 8  # then the delivery is given up (failed): 1, 2, 4 … 64 s apart, about two minutes
CLAIM_SECONDS = 60.0  # a delivery being sent is not picked up again for this long (a sender that died)


def alert_raise(
    *, run_pk: int, cause: str, revision: int, why: str, channels: list[str], now: datetime | None = None
) -> Alert | None:
    """Raise the alert of a run stuck for ``cause`` since its revision ``revision``, with one
    delivery per channel. None when it is already raised for that episode, or the run changed
    since the sweep looked at it (the next sweep decides again)."""
    now = now or clock.now()
    try:
        with transaction.atomic():
            run = WorkflowRun.objects.select_for_update().get(pk=run_pk)
            if run.revision != revision:
                return None
            alert = Alert(run=run, cause=cause, revision=revision, stuck_since=run.updated_at)
            stuck = f"stuck since {run.updated_at:%Y-%m-%d %H:%M:%S} UTC ({cause})"
            return _raised(alert, why, channels, now, reason=stuck)
    except IntegrityError:  # another sweeper raised it first
        return None


AUTO_PAUSED = "auto_paused"  # the cause of a step's alert when it paused itself


def alert_raise_paused(*, pause_pk: int, channels: list[str], now: datetime | None = None) -> Alert | None:
    """Raise the one alert of a step that paused itself (``workflow_pause_if_failing``), on the run
    whose failure tripped it. None when it is raised already, or the pause was released."""
    now = now or clock.now()
    try:
        with transaction.atomic():
            pause = WorkflowPause.objects.select_for_update().get(pk=pause_pk)
            run = pause.trigger_run
            if pause.released_at is not None or run is None:
                return None
            why = f"{pause.scope} paused by itself: {pause.reason}"
            alert = Alert(run=run, cause=AUTO_PAUSED, revision=run.revision, stuck_since=pause.paused_at)
            alert.workflow_pause = pause
            return _raised(alert, why, channels, now, reason=f"{pause.scope} paused by itself")
    except IntegrityError:  # another sweeper raised it first
        return None


def _raised(alert: Alert, why: str, channels: list[str], now: datetime, *, reason: str) -> Alert:
    """Write ``alert`` (why, raised now) and one delivery per channel; audit it on its run."""
    alert.why, alert.raised_at = redact_text(why)[:2000], now
    alert.save(force_insert=True)
    AlertDelivery.objects.bulk_create(
        [AlertDelivery(alert=alert, channel=channel, next_attempt_at=now) for channel in channels]
    )
    state = {"run": alert.run.state, "alert": alert.cause}
    _audit(
        alert.run,
        AuditAction.ALERT_RAISED,
        actor=ALERTS,
        reason=f"{reason}: {alert.why}"[:2000],
        before=state,
        after={**state, "channels": channels},
        now=now,
    )
    return alert


def alert_resolve(*, alert_pk: int, why: str, now: datetime | None = None) -> Alert | None:
    """The run is no longer stuck for the alert's cause (or it changed): the alert is resolved
    and whatever was not sent yet never is."""
    now = now or clock.now()
    with transaction.atomic():
        alert = Alert.objects.select_for_update().select_related("run").filter(pk=alert_pk).first()
        if alert is None or alert.state == AlertState.RESOLVED:
            return None
        before = {"run": alert.run.state, "alert": alert.cause, "alert_state": alert.state}
        alert.state, alert.resolved_at = AlertState.RESOLVED, now
        alert.save(update_fields=["state", "resolved_at"])
        alert.deliveries.filter(state=DeliveryState.PENDING).update(state=DeliveryState.CANCELLED)
        after = {**before, "alert_state": alert.state}
        _audit(alert.run, AuditAction.ALERT_RESOLVED, actor=ALERTS, reason=why, before=before, after=after, now=now)
        return alert


@performs("snooze_alert", offered=offers.snoozable)
def alert_snooze(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
    hours: float | None = None,
) -> WorkflowRun:
    """A supervisor silences the run's firing alerts, with a reason, for ``hours`` (24; at most
    a week): what was not sent yet is not sent, and no new alert is raised for the run meanwhile."""
    if hours is None:
        hours = SNOOZE_DEFAULT_HOURS
    if not 0 < hours <= MAX_SNOOZE_HOURS:  # also refuses nan and inf
        raise InvalidTransition(f"a snooze lasts more than 0 and at most {MAX_SNOOZE_HOURS} hours (a week)")
    with acting(
        "snooze_alert",
        workflow_id=workflow_id,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
        audit_as=AuditAction.ALERT_SNOOZED,
    ) as act:
        run, until = act.run, act.now + timedelta(hours=hours)
        firing = list(Alert.objects.select_for_update().filter(run=run, state=AlertState.FIRING))
        who = actor.get_username() if actor is not None else ALERTS
        for alert in firing:
            alert.state, alert.snoozed_until, alert.snoozed_by = AlertState.SNOOZED, until, who
            alert.snooze_reason = redact_text(act.reason)
            alert.save(update_fields=["state", "snoozed_until", "snoozed_by", "snooze_reason"])
        AlertDelivery.objects.filter(alert__in=firing, state=DeliveryState.PENDING).update(
            state=DeliveryState.CANCELLED
        )
        causes = sorted(a.cause for a in firing)
        act.before = {"run": run.state, "alerts": causes, "alert_state": AlertState.FIRING}
        act.after = {**act.before, "alert_state": AlertState.SNOOZED, "until": until.isoformat()}
        return run


def alert_deliveries_claim(*, limit: int, now: datetime | None = None) -> list[AlertDelivery]:
    """Take up to ``limit`` deliveries that are due, each for CLAIM_SECONDS (another sweeper
    skips them meanwhile; if this one dies, they are due again after it), and count the attempt."""
    now = now or clock.now()
    with transaction.atomic():
        due = list(
            AlertDelivery.objects.select_for_update(skip_locked=True)
            .select_related("alert__run")
            .filter(state=DeliveryState.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at", "pk")[:limit]
        )
        for delivery in due:
            delivery.attempts += 1
            delivery.next_attempt_at = now + timedelta(seconds=CLAIM_SECONDS)
            delivery.save(update_fields=["attempts", "next_attempt_at"])
    return due


def alert_delivered(*, delivery_pk: int, now: datetime | None = None) -> None:
    now = now or clock.now()
    with transaction.atomic():
        delivery = AlertDelivery.objects.select_for_update().select_related("alert__run").get(pk=delivery_pk)
        if delivery.state != DeliveryState.PENDING:
            return
        delivery.state, delivery.sent_at, delivery.next_attempt_at = DeliveryState.SENT, now, None
        delivery.save(update_fields=["state", "sent_at", "next_attempt_at"])
        _audit_delivery(
            delivery, AuditAction.ALERT_SENT, f"sent by {delivery.channel} (attempt {delivery.attempts})", now
        )
        metrics.alert_sent(delivery.channel)


def alert_delivery_failed(*, delivery_pk: int, error: str, now: datetime | None = None) -> None:
    """An attempt failed: tried again with backoff, or given up after DELIVERY_ATTEMPTS (audited)."""
    now = now or clock.now()
    with transaction.atomic():
        delivery = AlertDelivery.objects.select_for_update().select_related("alert__run").get(pk=delivery_pk)
        if delivery.state != DeliveryState.PENDING:
            return
        delivery.last_error = redact_text(error)[:2000]
        if delivery.attempts >= DELIVERY_ATTEMPTS:
            delivery.state, delivery.next_attempt_at = DeliveryState.FAILED, None
            reason = f"not sent by {delivery.channel} after {delivery.attempts} attempts: {delivery.last_error}"
            _audit_delivery(delivery, AuditAction.ALERT_FAILED, reason[:2000], now)
        else:
            delivery.next_attempt_at = now + timedelta(seconds=2.0 ** (delivery.attempts - 1))
        delivery.save(update_fields=["state", "last_error", "next_attempt_at"])


def _audit_delivery(delivery: AlertDelivery, action: str, reason: str, now: datetime) -> None:
    """A delivery's outcome, audited on its alert's run (nothing of the run changes)."""
    alert = delivery.alert
    state = {"run": alert.run.state, "alert": alert.cause, "channel": delivery.channel}
    _audit(alert.run, action, actor=ALERTS, reason=reason, before=state, after=state, now=now)
