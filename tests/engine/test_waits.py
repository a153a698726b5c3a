"""Durable waits (issue 38): a run that reaches a wait holds no worker and no lease until its event
comes (or its deadline); an event that comes first is kept and used; the same event twice is one;
one that comes after the deadline is recorded and never applied; the deadline's outcome is the
declared one; kills at every boundary leave one object per call. The run goes on from each."""

from __future__ import annotations

from datetime import timedelta

import pytest

from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.transitions import perform, run_deliver_event, run_start
from recovery.errors import EventConflict, EventRefused
from recovery.models import AuditEvent, RunEvent, RunState, StepState, WorkflowRun
from recovery.waiting import OnTimeout, WaitSpec
from tests.support import receivers
from tests.support.engine import assert_invariants, doomed_worker, drive, person
from tests.support.waits import approval as approval_step

pytestmark = pytest.mark.django_db

APPROVED = {"approved": True, "amount": 120, "by": "alice"}
THREE_DAYS = timedelta(days=3)


def started(order_id: str = "o-1") -> WorkflowRun:
    return run_start(workflow="test_approvals", data={"tenant": "t", "order_id": order_id})[0]


def deliver(run: WorkflowRun, payload=APPROVED, *, key: str = "tracker:1:approved", event: str = "approved", **kw):
    kw.setdefault("actor", "api:tracker")
    return run_deliver_event(workflow_id=run.workflow_id, event=event, key=key, payload=payload, **kw)


def step(run: WorkflowRun, name: str):
    return run.steps.get(step_name=name)


def written() -> tuple[int, int, int]:
    return (
        RunEvent.objects.count(),
        AuditEvent.objects.count(),
        sum(WorkflowRun.objects.values_list("revision", flat=True)),
    )


def test_a_run_waits_for_its_event_holding_nothing_then_goes_on_from_it(clock):
    run = drive(started(), clock)
    began = clock.now()
    assert (run.state, run.lease_owner, run.lease_expires_at, run.next_wake_at) == (
        RunState.WAITING,
        "",
        None,
        began + THREE_DAYS,
    )
    approval = step(run, "approval")
    assert (approval.state, approval.first_attempt_at, approval.next_attempt_at) == (
        StepState.WAITING,
        began,
        began + THREE_DAYS,
    )
    assert run.status_reason.startswith("approval: waiting for event 'approved' until ")
    assert run.status_reason.endswith("; then the run goes to review")
    assert receivers.counts()["task"] == 1 and receivers.counts()["ledger"] == 0

    # Not due: an executor that looks finds nothing to do, and writes nothing.
    before = written()
    clock.advance(3600)
    advance(run.pk, owner="idle")
    assert written() == before

    event, new = deliver(run)
    assert new and not event.late and event.step_name == "approval"
    run.refresh_from_db()
    assert (run.state, run.next_wake_at) == (RunState.WAITING, clock.now())  # due at once
    applied_at = clock.now()
    run = drive(run, clock)  # the cool-down sleeps an hour (drive moves the clock), then the posting
    assert run.state == RunState.COMPLETED
    approval = step(run, "approval")
    assert (approval.state, approval.result, approval.remote_ref) == (StepState.SUCCEEDED, APPROVED, event.key)
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 1, "model_call": 0}
    assert step(run, "post_approved").intent == {"amount": 120, "by": "alice"}
    woke = AuditEvent.objects.get(run=run, action="wait_timeout", step_name="cool_down")
    assert woke.at == applied_at + timedelta(hours=1)
    applied = AuditEvent.objects.get(run=run, action="event_applied")
    assert applied.reason.startswith("event 'approved' (tracker:1:approved) from api:tracker")
    received = AuditEvent.objects.get(run=run, action="event_received")
    assert (received.actor, received.step_name, received.after["late"]) == ("api:tracker", "approval", False)
    assert_invariants()


def test_an_event_that_comes_before_the_wait_is_kept_and_used_when_it_is_reached(clock):
    run = started()
    event, new = deliver(run)  # the run has not even asked yet
    assert new and not event.late and event.step_name == ""
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert step(run, "approval").remote_ref == event.key
    assert not AuditEvent.objects.filter(run=run, action="wait_begin", step_name="approval").exists()
    assert receivers.counts()["ledger"] == 1


def test_the_same_event_twice_is_one_and_a_second_one_is_recorded_not_applied(clock):
    run = drive(started(), clock)
    first, _ = deliver(run)
    again, new = deliver(run, dict(APPROVED))  # the sender's retry: the same key and payload
    assert (again.pk, new) == (first.pk, False)
    assert RunEvent.objects.count() == 1 and AuditEvent.objects.filter(action="event_received").count() == 1

    before = written()
    with pytest.raises(EventConflict, match="key 'tracker:1:approved' was used for another event"):
        deliver(run, {**APPROVED, "amount": 5})
    assert written() == before

    advance(run.pk, owner="test-executor")  # the first applied; the run sleeps its cool-down
    assert step(run, "cool_down").state == StepState.WAITING
    other, new = deliver(run, {**APPROVED, "amount": 5}, key="tracker:1:approved-again")
    assert new and other.late  # the wait ended with the first: recorded, shown, not applied
    run = drive(run, clock)
    assert step(run, "approval").result == APPROVED and run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 1


def test_an_event_after_the_deadline_is_recorded_not_applied_and_the_run_goes_to_review_as_declared(clock):
    run = drive(started(), clock)
    clock.advance(THREE_DAYS.total_seconds() + 1)
    late, _ = deliver(run)
    assert late.late
    received = AuditEvent.objects.get(action="event_received")
    assert "late, not applied (approval's deadline passed at " in received.reason
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert run.status_reason.startswith("approval: no event 'approved' by the deadline (")
    approval = step(run, "approval")
    assert (approval.state, approval.remote_ref, approval.result) == (StepState.FAILED, "", None)
    assert receivers.counts()["ledger"] == 0

    # The operator's way on: wait again (a fresh deadline); the late event is still not used.
    perform("retry", workflow_id=run.workflow_id, step_name="approval", actor=person("olga"), reason="asked again")
    run = drive(run, clock)
    assert (run.state, step(run, "approval").next_attempt_at) == (RunState.WAITING, clock.now() + THREE_DAYS)
    deliver(run, {**APPROVED, "amount": 90}, key="tracker:1:approved-2")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and step(run, "post_approved").intent["amount"] == 90
    assert receivers.counts()["ledger"] == 1


def test_a_wait_that_declares_a_default_goes_on_with_it_and_says_so(clock, monkeypatch):
    default = {"approved": False, "amount": 0, "by": "nobody"}
    wait = WaitSpec(event="approved", timeout=THREE_DAYS, on_timeout=OnTimeout.proceed(default))
    monkeypatch.setattr(approval_step, "wait", wait)
    run = drive(started(), clock)
    clock.advance(THREE_DAYS.total_seconds())
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert step(run, "approval").result == default and step(run, "post_approved").intent["amount"] == 0
    timed_out = AuditEvent.objects.get(action="wait_timeout", step_name="approval")
    assert timed_out.reason == "no event 'approved' by the deadline: went on with the declared default"


def escalated(clock, monkeypatch) -> WorkflowRun:
    """A run whose wait escalates to a supervisor for a day, past its three days with no event."""
    escalating = OnTimeout.escalate("supervisor", timeout=timedelta(days=1))
    monkeypatch.setattr(approval_step, "wait", WaitSpec(event="approved", timeout=THREE_DAYS, on_timeout=escalating))
    run = drive(started(), clock)
    clock.advance(THREE_DAYS.total_seconds() + 1)
    return drive(run, clock)


def test_a_wait_that_escalates_waits_on_for_the_other_role_then_goes_to_review(clock, monkeypatch):
    from recovery import inbox
    from recovery.errors import NotPermitted

    run = escalated(clock, monkeypatch)

    assert run.state == RunState.WAITING, run.status_reason
    assert (
        "(escalated to a supervisor) until" in run.status_reason and "then the run goes to review" in run.status_reason
    )
    assert AuditEvent.objects.filter(action="approval_escalated", step_name="approval").count() == 1
    [item] = inbox.items(clock.now(), kind="event")
    assert (item.role, item.overdue, item.then) == ("supervisor", True, "the run goes to review")
    with pytest.raises(NotPermitted, match="escalated, it waits for a supervisor"):
        deliver(run, actor=person("olga", "operator"))
    assert not RunEvent.objects.exists()

    deliver(run, actor=person("sue", "supervisor"))  # in time for the escalation: applied
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 1


def test_an_escalated_wait_with_no_event_goes_to_review_once_its_time_passes(clock, monkeypatch):
    run = escalated(clock, monkeypatch)
    clock.advance(timedelta(days=1, seconds=1).total_seconds())
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW and step(run, "approval").state == StepState.FAILED
    assert receivers.counts()["ledger"] == 0


@pytest.mark.parametrize(
    ("event", "payload", "key", "error", "message"),
    [
        (
            "rejected",
            APPROVED,
            "k",
            EventRefused,
            "test_approvals v1 waits for no event 'rejected' (it waits for: approved)",
        ),
        (
            "approved",
            {**APPROVED, "amount": -1},
            "k",
            EventRefused,
            "event 'approved' refused by approval: 1 validation",
        ),
        ("approved", {**APPROVED, "note": "x"}, "k", EventRefused, "event 'approved' refused by approval"),
        ("approved", ["not", "an", "object"], "k", EventRefused, "an event's payload is a JSON object"),
        ("approved", APPROVED, " ", EventRefused, "an event needs the sender's idempotency key"),
    ],
)
def test_an_event_the_run_cannot_take_is_refused_and_changes_nothing(clock, event, payload, key, error, message):
    run = drive(started(), clock)
    before = written()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        deliver(run, payload, key=key, event=event)
    assert written() == before


def test_no_event_for_an_unknown_or_a_finished_run(clock):
    with pytest.raises(WorkflowRun.DoesNotExist):
        run_deliver_event(workflow_id="approval:t:nope", event="approved", key="k", payload=APPROVED, actor="x")
    run = started()
    deliver(run)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    before = written()
    with pytest.raises(EventConflict, match="is completed: an event for it is not recorded"):
        deliver(run, key="another")
    assert written() == before


def test_an_event_delivered_while_an_executor_decides_to_wait_is_not_left_for_days(clock, monkeypatch):
    """The executor read no event and is about to write the wait; the event commits first. Its
    write misses (the delivery saved the run), and it decides again with the event in view."""
    original = transitions.wait_begin
    delivered = []

    def race(**kwargs):
        if not delivered:
            delivered.append(deliver(WorkflowRun.objects.get(pk=kwargs["lease"].run_pk)))
        return original(**kwargs)

    monkeypatch.setattr(transitions, "wait_begin", race)
    run = drive(started(), clock)
    assert delivered
    assert run.state == RunState.COMPLETED
    assert clock.now() <= delivered[0][0].received_at + timedelta(hours=1, minutes=5)  # the cool-down, not 3 days
    assert receivers.counts()["ledger"] == 1


@pytest.mark.parametrize(
    ("killed_at", "early"),
    [
        (("approval", "after_outcome"), False),
        (("approval", "after_outcome"), True),
        (("cool_down", "after_outcome"), False),
        (("post_approved", "before_call"), False),
        (("post_approved", "after_call"), False),
        (("ask", "after_call"), True),
    ],
)
def test_kills_at_each_boundary_leave_one_object_per_call_and_apply_the_event_once(
    clock, monkeypatch, killed_at, early
):
    def killed(name, at):
        if (name, at) == killed_at:
            raise failpoints.FailpointRaised(f"killed at {name}:{at}")

    run = started(f"{killed_at[0]}-{killed_at[1]}-{early}")
    if early:
        deliver(run)
    else:
        run = drive(run, clock)
        deliver(run)
    monkeypatch.setattr(failpoints, "hit", killed)
    doomed_worker(run, clock)
    monkeypatch.setattr(failpoints, "hit", lambda name, at: None)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 1, "model_call": 0}
    assert AuditEvent.objects.filter(run=run, action="event_applied").count() == 1
    assert step(run, "approval").result == APPROVED
    assert_invariants()


def test_a_restart_across_a_wait_waits_again_and_does_not_reuse_the_event_sent_before(clock):
    from recovery.engine.transitions import run_restart
    from recovery.models import RunRestart

    run = started()
    deliver(run)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 1
    run_restart(
        workflow_id=run.workflow_id,
        step_name="approval",
        actor=person("sam"),
        reason="the order is for 125 chairs",
        edited="input",
        value={**run.input, "text": "office chairs 125"},
    )
    effects = {e["step"]: e["text"] for e in RunRestart.objects.get(run=run).effects}
    assert effects["approval"] == "waits again for event 'approved': one sent before the restart is not used"
    run = drive(run, clock)  # the posting is reversed first, then the run waits again
    assert run.state == RunState.WAITING and step(run, "approval").state == StepState.WAITING
    assert receivers.compensations()["reversal"] == 1 and receivers.counts()["ledger"] == 1
    deliver(run, {**APPROVED, "amount": 125}, key="tracker:1:approved-after-restart")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 2 and step(run, "post_approved").intent["amount"] == 125


def test_the_why_sentence_says_what_the_run_waits_for_and_what_happens_at_the_deadline(clock):
    from recovery import why

    run = drive(started(), clock)
    said = why.why_not_moving(run, list(run.steps.order_by("position")), now=clock.now())
    assert said.startswith("approval: waiting for event 'approved' until ")
    assert said.endswith(" UTC; then the run goes to review")


def test_a_wait_step_cannot_be_paused_by_itself_its_runs_hold_nothing(clock):
    from recovery.engine.transitions import workflow_pause
    from recovery.errors import InvalidTransition

    with pytest.raises(InvalidTransition, match="step approval of test_approvals is a wait: it calls nothing"):
        workflow_pause(workflow="test_approvals", step_name="approval", actor=person("sam"), reason="outage")


def test_metrics_count_the_events_how_long_each_wait_lasted_and_the_waits_under_way(
    clock, django_capture_on_commit_callbacks
):
    from prometheus_client import REGISTRY

    from recovery.observability import exposition

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    waited = {"workflow": "test_approvals", "step": "approval", "outcome": "event"}
    slept = {"workflow": "test_approvals", "step": "cool_down", "outcome": "deadline"}
    received = {"workflow": "test_approvals", "event": "approved", "late": "false"}
    before = (
        value("recovery_wait_seconds_sum", **waited),
        value("recovery_wait_seconds_count", **slept),
        value("recovery_wait_seconds_sum", **slept),
        value("recovery_events_received_total", **received),
    )
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(started(), clock)
        gauge = 'recovery_waiting_steps{cause="wait",step="approval",workflow="test_approvals"} 1.0'
        assert gauge in exposition.render().decode()
        clock.advance(7200)
        deliver(run)
        deliver(run)  # the sender's retry: the same event, not counted again
        run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    after = (
        value("recovery_wait_seconds_sum", **waited),
        value("recovery_wait_seconds_count", **slept),
        value("recovery_wait_seconds_sum", **slept),
        value("recovery_events_received_total", **received),
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [7200.0, 1.0, 3600.0, 1.0]
    assert "recovery_waiting_steps{" not in exposition.render().decode()


def test_show_run_lists_the_events_with_what_became_of_each(clock):
    import io
    import json

    from django.core.management import call_command

    run = drive(started(), clock)
    deliver(run)
    advance(run.pk, owner="test-executor")  # applied; the run sleeps its cool-down
    deliver(run, {**APPROVED, "amount": 5}, key="tracker:1:approved-again")
    out = io.StringIO()
    call_command("show_run", run.workflow_id, "--json", stdout=out)
    events = [(e["key"], e["sent_by"], e["late"], e["fate"]) for e in json.loads(out.getvalue())["events"]]
    assert events == [
        ("tracker:1:approved", "api:tracker", False, "applied by approval"),
        ("tracker:1:approved-again", "api:tracker", True, "late: recorded, not applied"),
    ]


def test_an_event_after_the_wait_timed_out_is_recorded_late(clock):
    run = drive(started(), clock)
    clock.advance(THREE_DAYS.total_seconds())
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW
    late, new = deliver(run)
    assert new and late.late and late.step_name == "approval"
    assert "late, not applied (the wait for it ended)" in AuditEvent.objects.get(action="event_received").reason
    assert drive(run, clock).state == RunState.NEEDS_REVIEW and step(run, "approval").remote_ref == ""
