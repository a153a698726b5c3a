"""Alerts on stuck runs: one webhook call (signed) and one e-mail per run, cause and episode,
retried with backoff, none once the run has moved on or a supervisor snoozed it; each audited
on the run, shown on the run page and on the dashboard."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail
from prometheus_client import REGISTRY

from recovery.engine.transitions import alert_raise, perform, run_start
from recovery.errors import InvalidTransition, NotPermitted
from recovery.models import Alert, AlertDelivery, AlertState, AuditEvent, DeliveryState, RunState
from recovery.observability import alerts
from recovery.workflow import Workflow
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "alert-webhook-secret-0123456789"


class Receiver:
    """A webhook receiver on 127.0.0.1: records every request; answers each with the next
    status of ``answers`` (200 once they run out)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.answers: deque[int] = deque()
        self.hang = 0.0  # seconds each answer is held (past the sender's timeout: it gives up)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append({"headers": dict(self.headers), "body": body})
                time.sleep(receiver.hang)
                self.send_response(receiver.answers.popleft() if receiver.answers else 200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/recovery"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver(settings):
    hook = Receiver()
    settings.RECOVERY_ALERT_WEBHOOK_URL = hook.url
    settings.RECOVERY_ALERT_WEBHOOK_SECRET = SECRET
    settings.RECOVERY_ALERT_EMAILS = ["ops@example.com"]
    settings.RECOVERY_CONSOLE_URL = "https://console.example.com"
    yield hook
    hook.server.shutdown()
    hook.server.server_close()


def in_review(clock, order_id: str = "stuck"):
    receivers.arm("ledger", "unavailable", times=10)  # post_entry runs out of retries
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0], clock)
    assert run.state == RunState.NEEDS_REVIEW
    receivers.clear()
    return run


def sent(channel: str) -> float:
    return REGISTRY.get_sample_value("recovery_alerts_sent_total", {"channel": channel}) or 0.0


def test_a_stuck_run_raises_one_webhook_call_and_one_email_and_none_after_it_is_resolved(clock, receiver):
    run = in_review(clock)
    webhooks, emails = sent("webhook"), sent("email")

    alerts.sweep()  # stuck, but not for 10 minutes yet
    assert receiver.requests == [] and mail.outbox == [] and not Alert.objects.exists()

    clock.advance(11 * 60)
    for _ in range(3):  # every sweep after the first finds it raised and sent
        alerts.sweep()
        clock.advance(30)
    assert len(receiver.requests) == 1 and len(mail.outbox) == 1
    (alert,) = Alert.objects.all()
    assert (alert.cause, alert.state, alert.run_id) == ("needs_review", AlertState.FIRING, run.pk)

    request = receiver.requests[0]
    body, headers = request["body"], request["headers"]
    assert headers["X-Recovery-Signature"] == alerts.signature(SECRET, headers["X-Recovery-Timestamp"], body)
    payload = json.loads(body)
    assert payload["workflow_id"] == run.workflow_id and payload["cause"] == "needs_review"
    assert payload["url"] == "https://console.example.com/runs/order%3At%3Astuck"
    assert "post_entry" in payload["why"] and headers["X-Recovery-Delivery"] == str(payload["delivery"])
    assert mail.outbox[0].to == ["ops@example.com"] and run.workflow_id in mail.outbox[0].subject
    assert payload["url"] in mail.outbox[0].body
    assert (sent("webhook") - webhooks, sent("email") - emails) == (1, 1)

    # An operator retries the step: the run moves on, the alert is resolved, nothing more is sent,
    # however long the clock runs.
    perform("retry", workflow_id=run.workflow_id, step_name="post_entry", actor=person("olga", "operator"), reason="up")
    alerts.sweep()
    drive(run, clock)
    for _ in range(3):
        clock.advance(2 * 60 * 60)
        alerts.sweep()
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED
    assert len(receiver.requests) == 1 and len(mail.outbox) == 1
    actions = list(AuditEvent.objects.filter(run=run, action__startswith="alert_").values_list("action", flat=True))
    assert actions == ["alert_raised", "alert_sent", "alert_sent", "alert_resolved"]


def test_a_new_episode_of_the_same_run_raises_a_new_alert(clock, receiver):
    """Sent once per run and cause *until it changes*: stuck again after a change, it alerts again."""
    run = in_review(clock)
    clock.advance(11 * 60)
    alerts.sweep()
    receivers.arm("ledger", "unavailable", times=10)  # the retry fails again: back in review
    perform("retry", workflow_id=run.workflow_id, step_name="post_entry", actor=person("olga", "operator"), reason="x")
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW
    alerts.sweep()
    assert list(Alert.objects.order_by("pk").values_list("state", flat=True)) == [AlertState.RESOLVED]
    clock.advance(11 * 60)
    alerts.sweep()
    assert list(Alert.objects.order_by("pk").values_list("state", flat=True)) == [
        AlertState.RESOLVED,
        AlertState.FIRING,
    ]
    assert len(receiver.requests) == 2


def test_a_failing_webhook_is_retried_with_backoff_and_sent_once(clock, receiver):
    receiver.answers.extend([500, 503])
    in_review(clock)
    clock.advance(11 * 60)
    alerts.sweep()
    delivery = AlertDelivery.objects.get(channel="webhook")
    assert (delivery.state, delivery.attempts, delivery.last_error) == (
        DeliveryState.PENDING,
        1,
        "RuntimeError: the webhook answered 500",
    )
    alerts.sweep()  # not due again yet
    assert len(receiver.requests) == 1
    for _ in range(4):
        clock.advance(5)
        alerts.sweep()
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts) == (DeliveryState.SENT, 3)
    assert len(receiver.requests) == 3  # 500, 503, 200: the receiver took it once
    assert len({r["headers"]["X-Recovery-Delivery"] for r in receiver.requests}) == 1


def test_a_webhook_that_never_answers_is_given_up_and_audited(clock, receiver):
    receiver.answers.extend([500] * 20)
    run = in_review(clock)
    clock.advance(11 * 60)
    for _ in range(12):  # the backoff doubles from 1 s: 64 s before the eighth attempt
        alerts.sweep()
        clock.advance(70)
    delivery = AlertDelivery.objects.get(channel="webhook")
    assert (delivery.state, delivery.attempts) == (DeliveryState.FAILED, 8)
    assert len(receiver.requests) == 8
    assert AuditEvent.objects.filter(run=run, action="alert_failed").count() == 1
    assert AlertDelivery.objects.get(channel="email").state == DeliveryState.SENT


def test_a_supervisor_snoozes_an_alert_with_a_reason_and_nothing_more_is_sent(clock, receiver):
    receiver.answers.extend([500])  # the first attempt fails: the webhook is still to be sent
    run = in_review(clock)
    clock.advance(11 * 60)
    alerts.sweep()
    assert len(receiver.requests) == 1

    with pytest.raises(NotPermitted):
        perform("snooze_alert", workflow_id=run.workflow_id, actor=person("olga", "operator"), reason="known")
    with pytest.raises(InvalidTransition, match="reason"):
        perform("snooze_alert", workflow_id=run.workflow_id, actor=person("sam"), reason=" ")
    perform("snooze_alert", workflow_id=run.workflow_id, actor=person("sue"), reason="ledger maintenance until 6")
    alert = Alert.objects.get()
    assert (alert.state, alert.snoozed_by, alert.snooze_reason) == (
        AlertState.SNOOZED,
        "sue",
        "ledger maintenance until 6",
    )
    assert alert.snoozed_until == clock.now() + timedelta(hours=24)
    for _ in range(3):
        clock.advance(60)
        alerts.sweep()
    assert len(receiver.requests) == 1  # the retry was cancelled
    assert AlertDelivery.objects.get(channel="webhook").state == DeliveryState.CANCELLED
    event = AuditEvent.objects.get(run=run, action="alert_snoozed")
    assert (event.actor, event.reason) == ("sue", "ledger maintenance until 6")
    with pytest.raises(InvalidTransition, match="no alert firing"):
        perform("snooze_alert", workflow_id=run.workflow_id, actor=person("sue2"), reason="again")


def test_two_sweepers_raise_one_alert(clock, receiver):
    run = in_review(clock)
    clock.advance(11 * 60)
    first = alert_raise(run_pk=run.pk, cause="needs_review", revision=run.revision, why="x", channels=["webhook"])
    second = alert_raise(run_pk=run.pk, cause="needs_review", revision=run.revision, why="x", channels=["webhook"])
    assert first is not None and second is None
    assert Alert.objects.count() == 1 and AuditEvent.objects.filter(action="alert_raised").count() == 1


def test_without_a_channel_an_alert_is_still_raised_audited_and_shown(clock, settings):
    settings.RECOVERY_ALERT_WEBHOOK_URL, settings.RECOVERY_ALERT_EMAILS = "", []
    run = in_review(clock)
    clock.advance(11 * 60)
    assert alerts.sweep() == {"raised": 1, "resolved": 0, "sent": 0}
    assert not AlertDelivery.objects.exists()
    supervisor = login("supervisor")
    page = supervisor.get(f"/runs/{run.workflow_id}")
    assert 'data-alert="needs_review"' in page.text and "no channel configured" in page.text
    assert 'data-action="snooze_alert"' in page.text  # a supervisor is offered the snooze
    assert 'data-action="snooze_alert"' not in login("operator").get(f"/runs/{run.workflow_id}").text
    dashboard = supervisor.get("/dashboard")
    assert 'data-alerts-firing="1"' in dashboard.text and run.workflow_id in dashboard.text


def test_stuck_after_names_only_known_causes():
    with pytest.raises(ValueError, match="no stuck cause stuck_forever"):
        Workflow("t_bad_alert", version=1, workflow_id=lambda i: "x", stuck_after={"stuck_forever": timedelta(1)})
    with pytest.raises(ValueError, match="positive"):
        Workflow("t_bad_alert2", version=1, workflow_id=lambda i: "x", stuck_after=timedelta(0))


def test_a_hanging_receiver_holds_a_sweep_for_its_sending_budget_not_a_timeout_per_alert(
    clock, receiver, settings, monkeypatch
):
    """Each call that hangs lasts at least the sender's timeout (RECOVERY_HTTP_TIMEOUT, 1 s in the
    tests), so a budget of 1.5 s lets at most two calls start, however slow the machine."""
    settings.RECOVERY_ALERT_EMAILS = []
    receiver.hang = 3.0
    for order_id in ("a", "b", "c", "d"):
        in_review(clock, order_id)
    clock.advance(11 * 60)
    monkeypatch.setattr(alerts, "SEND_SECONDS", 1.5)
    alerts.sweep()
    attempts = sorted(AlertDelivery.objects.values_list("attempts", flat=True))
    assert len(attempts) == 4 and 1 <= sum(attempts) <= 2 and attempts[:2] == [0, 0]


def test_a_run_stuck_for_several_causes_pages_once_for_the_most_specific(clock, receiver):
    """In review because its retries ran out: "retries exhausted", not a second alert for "needs review"."""
    run = in_review(clock)
    clock.advance(2 * 60 * 60)  # past both thresholds (needs review: 10 min; any other cause: 1 h)
    for _ in range(3):
        alerts.sweep()
        clock.advance(60)
    (alert,) = Alert.objects.all()
    assert (alert.run_id, alert.cause) == (run.pk, "exhausted")
    assert len(receiver.requests) == 1 and len(mail.outbox) == 1


def test_a_supervisor_chooses_how_long_a_snooze_lasts_and_a_bad_duration_changes_nothing(clock, receiver):
    run = in_review(clock)
    clock.advance(11 * 60)
    alerts.sweep()
    supervisor = login("supervisor")
    page = supervisor.get(f"/runs/{run.workflow_id}")
    assert '<option value="24" selected>for 24 h</option>' in page.text  # the default
    assert '<option value="1">for 1 h</option>' in page.text and '<option value="168">for a week</option>' in page.text

    act = f"/runs/{run.workflow_id}/act"
    for hours, message in [
        ("0", "more than 0 and at most 168 hours"),
        ("-2", "more than 0 and at most 168 hours"),
        ("168.5", "more than 0 and at most 168 hours"),
        ("nan", "more than 0 and at most 168 hours"),
        ("inf", "more than 0 and at most 168 hours"),
        ("four", "give the duration in hours as a number"),
    ]:
        refused = supervisor.post(act, {"action": "snooze_alert", "reason": "maintenance", "hours": hours})
        assert refused.status_code == 400 and message in refused.text, hours
    assert Alert.objects.get().state == AlertState.FIRING
    assert not AuditEvent.objects.filter(action="alert_snoozed").exists()
    with pytest.raises(InvalidTransition, match="retry takes no duration"):
        perform("retry", workflow_id=run.workflow_id, step_name="post_entry", actor=person("sam"), reason="x", hours=1)

    assert (
        supervisor.post(act, {"action": "snooze_alert", "reason": "ledger down until 4", "hours": "4"}).status_code
        == 302
    )
    alert = Alert.objects.get()
    assert (alert.state, alert.snoozed_until) == (AlertState.SNOOZED, clock.now() + timedelta(hours=4))
    event = AuditEvent.objects.get(action="alert_snoozed")
    assert event.after["until"] == (clock.now() + timedelta(hours=4)).isoformat()

    # The run is retried and stuck again (a new episode) while the snooze holds: no new alert until
    # the chosen four hours have passed.
    receivers.arm("ledger", "unavailable", times=10)
    perform("retry", workflow_id=run.workflow_id, step_name="post_entry", actor=person("olga", "operator"), reason="x")
    assert drive(run, clock).state == RunState.NEEDS_REVIEW
    clock.advance(11 * 60)
    assert alerts.sweep()["raised"] == 0
    clock.advance(4 * 3600)
    assert alerts.sweep()["raised"] == 1
    assert Alert.objects.filter(state=AlertState.FIRING).count() == 1
