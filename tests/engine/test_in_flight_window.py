"""The in-flight window (contract rule 7), the heartbeat (rule 12) and a database that goes away.

A look-up that finds nothing proves that a call never took effect only once the request can no
longer commit: its in-flight bound has passed since it was sent. Receivers here commit late, on
the engine's clock (recovery.testing.Receivers), as real ones do after their caller gave up.
"""

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import OperationalError

from recovery import tasks
from recovery.engine import heartbeat, transitions
from recovery.engine.executor import advance
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import run_claim, run_start
from recovery.errors import DatabaseUnavailable, InvalidTransition, UnknownOutcome
from recovery.models import AuditEvent, OutboxMessage, RunState, StepState, WorkflowRun
from recovery.testing import Receivers, inject
from recovery.testing import drive as drive_with
from recovery.workflow import get_workflow
from tests.support import receivers
from tests.support.engine import assert_invariants, drive

pytestmark = pytest.mark.django_db(transaction=True)

ORDERS = get_workflow("test_orders")
NOTIFY = ORDERS.get_step("notify")


def start(order_id="o-1"):
    run, _ = run_start(workflow="test_orders", data={"tenant": "win", "order_id": order_id})
    return run


def notify_step(run):
    return run.steps.get(step_name="notify")


def test_a_miss_inside_the_window_keeps_the_step_unknown_and_looks_again_when_it_closes(clock):
    """The request commits late (half the bound after it was sent): the first look-up misses,
    the engine does not resend, and the look-up at the window's end finds the one message."""
    world = Receivers(clock=clock)
    run = start()
    world.run_pk = run.pk
    with inject(NOTIFY, "late_commit", "below", receivers=world):
        advance(run.pk)
        run.refresh_from_db()
        step = notify_step(run)
        sent_at, until = step.last_attempt_at, step.last_attempt_at + NOTIFY.in_flight_bound()
        assert (run.state, step.state, step.next_attempt_at, run.next_wake_at) == (
            RunState.WAITING,
            StepState.UNKNOWN,
            until,
            until,
        )
        assert run.status_reason == (
            f"notify: outcome unknown; looking again at {until:%H:%M:%S} UTC, when the receiver can no "
            f"longer commit the request sent at {sent_at:%H:%M:%S} UTC"
        )
        assert AuditEvent.objects.filter(run=run, action="reconcile_wait").count() == 1
        assert receivers.counts()["message"] == 0 and step.attempts == 1  # not sent a second time

        clock.set(until - timedelta(seconds=1))
        world.settle()  # the receiver commits the request it was still working on
        assert advance(run.pk) is None  # not due before the window closes
        run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["message"] == 1 and notify_step(run).attempts == 1
    assert notify_step(run).remote_ref
    assert_invariants()


def test_after_the_window_a_miss_is_absence_and_the_step_is_sent_again_once(clock):
    """A receiver that keeps its bound abandoned the request: after the window, the miss proves
    it, and the step is performed again with the same client reference."""
    world = Receivers(clock=clock)
    run = start()
    with inject(NOTIFY, "late_commit", "beyond", receivers=world):
        run = drive_with(run, clock, receivers=world, must_settle=True)
    world.settle(everything=True)
    assert run.state == RunState.COMPLETED
    step = notify_step(run)
    assert receivers.counts()["message"] == 1 and step.attempts == 2
    reset = AuditEvent.objects.get(run=run, action="reconciled_absent")
    assert "after the in-flight window closed" in reset.reason
    assert reset.at >= AuditEvent.objects.filter(run=run, action="step_begin", step_name="notify").first().at + (
        NOTIFY.in_flight_bound()
    )


def test_without_a_bound_a_miss_goes_to_an_operator_never_to_a_resend(clock, monkeypatch):
    monkeypatch.setattr(NOTIFY, "settle", None)
    world = Receivers(clock=clock)
    run = start()
    with inject(NOTIFY, "late_commit", "below", receivers=world):
        run = drive_with(run, clock, receivers=world, must_settle=True)
    assert run.state == RunState.NEEDS_REVIEW
    assert "no in-flight bound" in run.status_reason and "operator must reconcile" in run.status_reason
    assert notify_step(run).state == StepState.UNKNOWN and notify_step(run).attempts == 1
    world.settle(everything=True)
    assert receivers.counts()["message"] == 1  # the late one, and no other


def _person(name, group):
    user = User.objects.create_user(name, password="x")
    user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


def test_it_did_not_happen_inside_the_window_needs_a_supervisor_and_says_why(clock, monkeypatch):
    """Operator recovery uses the same rule: "it did not happen" while the request may still
    land would perform the step again beside it."""
    monkeypatch.setattr(NOTIFY, "lookup_fn", None)  # reconcile=LOOKUP without a look-up: review
    monkeypatch.setattr(NOTIFY, "reconcile", None)
    receivers.arm("message", "commit_then_drop")
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW and notify_step(run).state == StepState.UNKNOWN
    until = notify_step(run).last_attempt_at + NOTIFY.in_flight_bound()
    common = {"workflow_id": run.workflow_id, "step_name": "notify", "happened": False, "reason": "not in Slack"}
    with pytest.raises(InvalidTransition, match=f"may still commit until {until:%H:%M:%S} UTC; only a supervisor"):
        transitions.step_resolve(**common, actor=_person("otto", "operator"))
    assert notify_step(run).state == StepState.UNKNOWN  # nothing changed

    transitions.step_resolve(**common, actor=_person("sue", "supervisor"))
    event = AuditEvent.objects.get(run=run, action="resolve")
    assert event.after["evidence"] == {"happened": False, "in_flight_until": until.isoformat()}

    receivers.arm("message", "commit_then_drop")
    run2 = drive(start("o-2"), clock)
    clock.set(notify_step(run2).last_attempt_at + NOTIFY.in_flight_bound())  # once the window has closed…
    transitions.step_resolve(**{**common, "workflow_id": run2.workflow_id}, actor=User.objects.get(username="otto"))
    assert notify_step(run2).state == StepState.PENDING  # …an operator may say so


def test_the_heartbeat_keeps_the_lease_of_a_call_in_flight_and_never_revives_a_lost_one(clock):
    run = start()
    lease = run_claim(run_pk=run.pk)
    expires = WorkflowRun.objects.get(pk=run.pk).lease_expires_at
    with heartbeat.held_run(lease.run_pk, lease.generation):
        clock.advance(60)
        assert heartbeat.beat() == 0  # not a heartbeat interval of real time in flight yet
        assert heartbeat.beat(force=True) == 1
        assert WorkflowRun.objects.get(pk=run.pk).lease_expires_at == clock.now() + timedelta(seconds=5)
        assert run_claim(run_pk=run.pk, owner="rival") is None  # the lease is held

    stale = run_claim(run_pk=start("o-2").pk)
    clock.advance(60)
    assert run_claim(run_pk=stale.run_pk, owner="rival") is not None  # expired, taken over
    taken = WorkflowRun.objects.get(pk=stale.run_pk)
    with heartbeat.held_run(stale.run_pk, stale.generation):
        assert heartbeat.beat(force=True) == 0  # fenced by the generation
    assert WorkflowRun.objects.get(pk=stale.run_pk).lease_expires_at == taken.lease_expires_at
    assert expires < clock.now()


def test_a_lost_database_connection_lets_go_of_the_run_and_it_completes_without_an_operator(clock, monkeypatch):
    """A restart of the database under a held connection is a blip, not a review: the executor
    lets go (DatabaseUnavailable), the lease expires, the next claim reconciles the step."""
    real = transitions.step_succeed

    def dies(**kwargs):
        if kwargs["step_name"] == "notify":
            monkeypatch.setattr(transitions, "step_succeed", real)
            raise OperationalError("terminating connection due to administrator command")
        return real(**kwargs)

    monkeypatch.setattr(transitions, "step_succeed", dies)
    run = start()
    with pytest.raises(DatabaseUnavailable, match="terminating connection"):
        advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and notify_step(run).state == StepState.RUNNING  # as the crash left it
    assert not AuditEvent.objects.filter(run=run, action="review").exists()
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert AuditEvent.objects.filter(run=run, action="lease_takeover").count() == 1
    assert_invariants()


def test_a_parked_run_never_keeps_a_step_running(clock, monkeypatch):
    """An engine or workflow bug after the intent checkpoint sends the run to review; the step
    that may have been called is recorded unknown, not left running forever."""
    monkeypatch.setattr(transitions, "step_succeed", lambda **kw: (_ for _ in ()).throw(RuntimeError("bug")))
    run = start()
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.NEEDS_REVIEW and run.status_reason.startswith("executor error: RuntimeError: bug")
    read = run.steps.get(step_name="read")
    assert (read.state, read.last_error_kind) == (StepState.UNKNOWN, "unknown_outcome")
    assert AuditEvent.objects.get(run=run, action="review").after["steps_now_unknown"] == ["read"]


def test_a_celery_task_that_cannot_reach_the_database_is_retried_not_acknowledged(monkeypatch):
    calls = []

    def advance_run(run_pk):
        calls.append(run_pk)
        if len(calls) < 3:
            raise DatabaseUnavailable("database unavailable while advancing run 7: OperationalError")

    monkeypatch.setattr(tasks.executor, "advance", advance_run)
    monkeypatch.setattr(tasks, "database_backoff", lambda retries: 0)
    # apply(): this task's retry accounting in-process (Celery replays a retry at once there)
    assert tasks.advance_run.apply(args=[7]).successful()
    assert calls == [7, 7, 7]


def test_an_event_consumed_while_the_database_is_out_of_reach_is_retried_not_dropped(monkeypatch):
    calls = []
    real = transitions.run_start_claimed

    def run_start_once_down(**kwargs):
        calls.append(kwargs["data"]["order_id"])
        if len(calls) == 1:
            raise OperationalError("connection refused")
        return real(**kwargs)

    monkeypatch.setattr(transitions, "run_start_claimed", run_start_once_down)
    monkeypatch.setattr(tasks, "database_backoff", lambda retries: 0)
    result = tasks.start_run.apply(args=["test_orders", {"tenant": "win", "order_id": "q-1"}])
    assert result.successful() and calls == ["q-1", "q-1"]
    assert WorkflowRun.objects.filter(workflow_id="order:win:q-1").count() == 1


def test_the_database_backoff_grows_and_is_capped():
    from recovery.tasks import database_backoff

    assert [round(database_backoff(n) * 2) >= 2**n for n in range(5)] == [True] * 5
    assert max(database_backoff(20) for _ in range(50)) <= 60


def test_an_unknown_compensation_is_not_sent_again_before_its_window_closes(clock):
    """A correction whose answer was lost: the compensation looks before it sends, and that
    look is only proof after the window. Exactly one correction."""
    run = drive(start(), clock)
    receivers.arm("correction", "commit_then_drop")
    transitions.run_compensate(workflow_id=run.workflow_id, actor=_person("sue", "supervisor"), reason="wrong")
    for _ in range(3):  # post_entry is reversed first; then notify's correction is sent, its answer lost
        advance(run.pk)
    run.refresh_from_db()
    step = notify_step(run)
    assert (run.state, step.state, step.last_error_kind) == (
        RunState.COMPENSATING,
        StepState.COMPENSATING,
        UnknownOutcome.kind,
    )
    until = step.compensation_sent_at + NOTIFY.in_flight_bound()
    assert step.next_attempt_at == until and run.next_wake_at == until
    assert "compensation outcome unknown; trying again at" in run.status_reason
    assert receivers.compensations()["correction"] == 1
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED
    assert receivers.compensations() == {"task_cancel": 1, "correction": 1, "reversal": 1}
    assert notify_step(run).compensation_attempts == 2


def test_a_correction_committed_late_is_found_by_the_retry_not_sent_twice(clock):
    """The compensation looks before it sends (the messenger honours no key). Its first request
    lands LATE_SECONDS after it was sent, long after the caller gave up: a retry before the
    window closes would miss it and send a second correction."""
    assert receivers.LATE_SECONDS < NOTIFY.in_flight_bound().total_seconds()
    run = drive(start(), clock)
    receivers.arm("correction", "late_commit")
    transitions.run_compensate(workflow_id=run.workflow_id, actor=_person("sue", "supervisor"), reason="wrong")
    for _ in range(40):  # as production would: each time the run is due, late requests landing meanwhile
        receivers.land_late()
        advance(run.pk)
        run.refresh_from_db()
        if run.state != RunState.COMPENSATING:
            break
        clock.set(run.next_wake_at or clock.now() + timedelta(seconds=1))
    assert receivers.land_late(everything=True) == 0  # it had landed before the retry looked
    assert run.state == RunState.COMPENSATED, run.status_reason
    assert receivers.compensations() == {"task_cancel": 1, "correction": 1, "reversal": 1}
    assert notify_step(run).compensation_attempts == 2


def test_the_publisher_does_not_send_again_while_a_lost_attempt_may_still_be_delivered(clock):
    """The outbox publisher keeps the same rule: an attempt timed out, the receiver is still
    working on it; the next claim looks, misses, gives its attempt back and waits."""
    secrets_tell = get_workflow("test_secrets").get_step("tell")
    assert secrets_tell.outbox  # an outbox step of the engine's test workflows
    world = Receivers(clock=clock)
    run, _ = run_start(workflow="test_secrets", data={"tenant": "win", "order_id": "p-1", "text": "hi"})
    with inject(secrets_tell, "late_commit", "below", receivers=world):
        for _ in range(3):
            advance(run.pk)
            publish_due()
        message = OutboxMessage.objects.get(run=run)
        assert message.settle_from == message.last_attempt_at and message.attempts == 1
        clock.set(message.next_attempt_at)
        publish_due()
        message.refresh_from_db()
        until = message.settle_from + secrets_tell.in_flight_bound()
        assert (message.state, message.attempts, message.next_attempt_at) == ("pending", 1, until)
        assert AuditEvent.objects.filter(run=run, action="outbox_settle_wait").count() == 1
    assert [call for call in receivers.CALLS if call[0] == "tell"] == []  # nothing sent a second time


@pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])
def test_a_message_whose_delivery_is_in_flight_is_corrected_not_called_undelivered(clock, live_server, settings):
    """Compensating a message the publisher sent but never heard back about: the look-up misses
    while the messenger is still working on it. "Never delivered, nothing to correct" would
    leave the approver with a message nobody corrects; the engine waits for the window, finds it,
    and sends the correction."""
    from sandbox import faults
    from sandbox.models import Message, MessageKind

    settings.SANDBOX_URL = live_server.url
    faults.clear()
    invoice = get_workflow("invoice")
    notify = invoice.get_step("notify_approver")
    world = Receivers(clock=clock)
    event = {"tenant": "win", "invoice_id": "c-1", "text": "Desk lamp. Total due EUR 99.00"}
    run, _ = run_start(workflow="invoice", data=event)
    with inject(notify, "late_commit", "below", receivers=world):
        for _ in range(3):  # the steps run; the publisher's attempt times out, the messenger still on it
            advance(run.pk)
            publish_due()
        message = OutboxMessage.objects.get(run=run)
        assert (message.state, message.settle_from) == ("pending", message.last_attempt_at)
        transitions.run_compensate(workflow_id=run.workflow_id, actor=_person("sue", "supervisor"), reason="wrong")
        for _ in range(3):
            advance(run.pk)
        run.refresh_from_db()
        until = message.settle_from + notify.in_flight_bound()
        assert (run.state, run.next_wake_at) == (RunState.COMPENSATING, until)
        assert "notify_approver: message not found yet; looking again at" in run.status_reason
        run = drive_with(run, clock, receivers=world, must_settle=True)
    world.settle(everything=True)
    assert run.state == RunState.COMPENSATED, run.status_reason
    sent = Message.objects.using("sandbox")
    assert sent.filter(kind=MessageKind.MESSAGE).count() == 1
    assert sent.filter(kind=MessageKind.CORRECTION).count() == 1  # the message that landed is corrected
    faults.clear()
