"""Durable waits under real concurrency (PostgreSQL; on SQLite these skip: it serialises writers).
Deliveries lock the run's row; the executor's decisions are fenced by the run's revision. So the
same key sent at once by many senders is one event; many events at once leave one applied; and
an event racing the executor at the wait's deadline is either applied or recorded late — never
kept and ignored, never applied after the wait timed out."""

from __future__ import annotations

from collections import Counter

import pytest

from recovery.engine.audit import chain as audit_chain
from recovery.engine.executor import advance
from recovery.engine.transitions import run_deliver_event, run_start
from recovery.models import AuditEvent, RunEvent, RunState, StepState, WorkflowRun
from tests.engine.test_concurrency_postgres import in_threads
from tests.support import receivers
from tests.support.engine import drive

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

APPROVED = {"approved": True, "amount": 120, "by": "alice"}


def waiting(order_id: str, clock) -> WorkflowRun:
    run = drive(run_start(workflow="test_approvals", data={"tenant": "t", "order_id": order_id})[0], clock)
    assert run.state == RunState.WAITING
    return run


def deliver(run: WorkflowRun, key: str, amount: int = 120):
    return run_deliver_event(
        workflow_id=run.workflow_id, event="approved", key=key, payload={**APPROVED, "amount": amount}, actor="x"
    )


def test_the_same_key_sent_at_once_by_twenty_senders_is_one_event(postgres_only, clock):
    run = waiting("same", clock)
    results = in_threads(20, lambda i: deliver(run, "tracker:1:approved"))
    assert len({event.pk for event, _ in results}) == 1
    assert Counter(new for _, new in results) == Counter({True: 1, False: 19})
    assert RunEvent.objects.count() == 1 and AuditEvent.objects.filter(action="event_received").count() == 1
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["ledger"] == 1
    assert audit_chain.verify(audit_chain.stored_chains()).first is None


def test_ten_events_at_once_leave_one_applied_and_one_entry(postgres_only, clock):
    run = waiting("ten", clock)
    in_threads(10, lambda i: deliver(run, f"sender-{i}", amount=100 + i))
    assert RunEvent.objects.filter(run=run, late=False).count() == 10
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 1
    applied = run.steps.get(step_name="approval")
    first = RunEvent.objects.filter(run=run).order_by("received_at", "pk").first()
    assert (applied.remote_ref, applied.result["amount"]) == (first.key, first.payload["amount"])
    assert AuditEvent.objects.filter(run=run, action="event_applied").count() == 1


def test_an_event_racing_the_executor_at_the_deadline_is_applied_or_recorded_late_never_lost(postgres_only, clock):
    runs = [waiting(f"race-{i}", clock) for i in range(8)]
    clock.set(runs[0].steps.get(step_name="approval").next_attempt_at)  # every deadline is now (one clock)
    outcomes = Counter()
    for run in runs:
        in_threads(2, lambda i, run=run: advance(run.pk, owner="racer") if i == 0 else deliver(run, "at-deadline"))
        run.refresh_from_db()
        if run.steps.get(step_name="approval").state == StepState.WAITING:
            # The claim skipped the row the delivery held locked: the event is kept and the run due.
            assert not RunEvent.objects.get(run=run).late and run.next_wake_at <= clock.now()
            outcomes["claim skipped, due"] += 1
            advance(run.pk, owner="next")
            run.refresh_from_db()
        approval, event = run.steps.get(step_name="approval"), RunEvent.objects.get(run=run)
        if approval.state == StepState.FAILED:  # timed out first: the event came after, late
            assert run.state == RunState.NEEDS_REVIEW and event.late, (run.state, event.late)
            outcomes["timed out, event late"] += 1
        else:  # the event came first: applied, even at the deadline
            assert (approval.state, approval.remote_ref, event.late) == (StepState.SUCCEEDED, event.key, False)
            outcomes["applied"] += 1
    assert outcomes["applied"] + outcomes["timed out, event late"] == len(runs), outcomes
    assert receivers.counts()["ledger"] == 0  # nothing posted yet: the cool-down sleeps an hour


def test_an_event_committed_while_the_executor_times_the_wait_out_is_applied(postgres_only, clock, monkeypatch):
    """The executor read no event at the deadline and is about to write the timeout; another
    connection commits the event first (at the deadline: in time). The timeout's write, fenced by
    the run's revision, misses; decided again under the lock, the event is applied."""
    from recovery.engine import transitions

    run = waiting("fenced", clock)
    clock.set(run.steps.get(step_name="approval").next_attempt_at)
    original, raced = transitions.wait_time_out, []

    def racing(**kwargs):
        if not raced:
            raced.append(in_threads(1, lambda i: deliver(run, "in-time"))[0])
        return original(**kwargs)

    monkeypatch.setattr(transitions, "wait_time_out", racing)
    advance(run.pk, owner="racer")
    run.refresh_from_db()
    approval, event = run.steps.get(step_name="approval"), RunEvent.objects.get(run=run)
    assert raced and not event.late
    assert (approval.state, approval.remote_ref) == (StepState.SUCCEEDED, "in-time")
    assert not AuditEvent.objects.filter(run=run, action="wait_timeout", step_name="approval").exists()


def test_ten_people_deciding_one_held_call_at_once_make_one_decision_and_one_entry(postgres_only, clock):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from recovery.engine.transitions import perform
    from recovery.errors import InvalidTransition
    from tests.support.waits import HELD_CALL

    run = drive(run_start(workflow="test_held_calls", data={"tenant": "t", "order_id": "held"})[0], clock)
    assert run.state == RunState.WAITING
    group = Group.objects.get_or_create(name="operator")[0]
    people = [get_user_model().objects.create_user(f"op-{i}", password="pw") for i in range(10)]
    for user in people:
        user.groups.add(group)

    def decide(i: int) -> str:
        action = ("approve_call", "reject_call")[i % 2]
        try:
            perform(action, workflow_id=run.workflow_id, step_name=HELD_CALL, actor=people[i], reason=f"r{i}")
        except InvalidTransition as exc:
            return f"refused: {exc}"
        return action

    outcomes = in_threads(10, decide)
    made = [o for o in outcomes if not o.startswith("refused")]
    assert len(made) == 1, outcomes
    assert all("decided already" in o for o in outcomes if o.startswith("refused")), outcomes
    assert AuditEvent.objects.filter(run=run, action__in=["approve_call", "reject_call"]).count() == 1
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == (1 if made == ["approve_call"] else 0)


def test_a_decision_racing_the_executor_at_the_deadline_is_made_or_refused_never_both(postgres_only, clock):
    from recovery.engine.transitions import perform
    from recovery.errors import InvalidTransition
    from tests.support.engine import person
    from tests.support.waits import HELD_CALL

    olga = person("olga", "operator")
    outcomes = Counter()
    for i in range(6):
        run = drive(run_start(workflow="test_held_calls", data={"tenant": "t", "order_id": f"dl-{i}"})[0], clock)
        clock.set(run.steps.get(step_name=HELD_CALL).next_attempt_at)

        def race(j: int, run=run):
            if j == 0:
                return advance(run.pk, owner="racer")
            try:
                perform("approve_call", workflow_id=run.workflow_id, step_name=HELD_CALL, actor=olga, reason="ok")
            except InvalidTransition as exc:
                return f"refused: {exc}"
            return "approved"

        results = in_threads(2, race)
        call = run.steps.get(step_name=HELD_CALL)
        decided = AuditEvent.objects.filter(run=run, action="approve_call").count()
        timed_out = AuditEvent.objects.filter(run=run, action="wait_timeout", step_name=HELD_CALL).count()
        if results[1] == "approved":
            assert (decided, call.approval["decision"]) == (1, "approve"), results
            # decided first: no timeout; or the timeout came first and the call was decided in review after it
            outcomes["approved"] += 1
        else:
            assert decided == 0 and call.state in (StepState.FAILED, StepState.WAITING), (results, call.state)
            outcomes["refused while held"] += 1
        assert timed_out <= 1
        drive(run, clock)
    assert sum(outcomes.values()) == 6, outcomes
    assert receivers.counts()["ledger"] == outcomes["approved"]
