"""Retry now (issue 37): an operator drops a waiting step's backoff. The next attempt is made now,
under the same key, and counts in the step's retry budget: no attempt is made beyond it, and an
attempt that fails again waits its backoff as before. Refused where an outcome is unknown. Reset
attempts: a supervisor gives a waiting step its whole budget back."""

from __future__ import annotations

import pytest

from recovery.engine.executor import advance
from recovery.engine.transitions import perform, run_pause, run_start, step_reset_attempts, step_retry_now
from recovery.errors import InvalidTransition, NotPermitted, TransientError
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.support import receivers, workflows
from tests.support.console import act, failed_run, login
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db


def waiting(order_id: str = "n-1", *, failures: int = 1) -> WorkflowRun:
    receivers.arm("task", "unavailable", times=failures)
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]
    advance(run.pk, owner="test-executor")
    run.refresh_from_db()
    assert run.state == RunState.WAITING
    return run


def test_retry_now_makes_the_next_attempt_now_within_the_same_budget(clock):
    olga = person("olga", "operator")
    run = waiting(failures=2)
    task = run.steps.get(step_name="create_task")
    due, budget = task.next_attempt_at, (task.budget_start_attempt, task.budget_started_at)
    assert due > clock.now() and task.attempts == 1

    step_retry_now(workflow_id=run.workflow_id, step_name="create_task", actor=olga, reason="tracker is back")
    advance(run.pk, owner="test-executor")  # the clock has not moved: the backoff is not waited for
    task.refresh_from_db()
    run.refresh_from_db()
    assert task.attempts == 2 and (task.budget_start_attempt, task.budget_started_at) == budget
    assert run.state == RunState.WAITING and task.next_attempt_at > clock.now()  # failed again: its backoff again
    assert receivers.counts()["task"] == 0
    event = AuditEvent.objects.get(run=run, action="retry_now")
    assert (event.actor, event.after["was_due_at"]) == ("olga", due.isoformat())

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and run.steps.get(step_name="create_task").attempts == 3
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert_invariants()


def test_retry_now_is_refused_where_nothing_waits_an_outcome_is_unknown_or_the_run_is_paused(clock, monkeypatch):
    olga = person("olga", "operator")
    failed = failed_run(clock, "n-failed")  # a permanent failure: nothing waits for a retry
    with pytest.raises(InvalidTransition, match="only a run waiting for a retry can try a step now"):
        step_retry_now(workflow_id=failed.workflow_id, step_name="create_task", actor=olga, reason="r")
    # notify's answer was lost after the messenger committed, and its look-up failed once: the run
    # waits to look it up again. Trying it now could send a second message: refused.
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(
        workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(TransientError("messenger 503"))
    )
    unknown = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "n-unknown"})[0]
    advance(unknown.pk, owner="test-executor")
    unknown.refresh_from_db()
    assert unknown.state == RunState.WAITING and unknown.steps.get(step_name="notify").state == StepState.UNKNOWN
    with pytest.raises(InvalidTransition, match="reconcile notify first: its outcome is unknown"):
        step_retry_now(workflow_id=unknown.workflow_id, step_name="notify", actor=olga, reason="r")
    assert receivers.counts()["message"] == 1
    run = waiting("n-2")
    with pytest.raises(InvalidTransition, match="notify is not waiting for a retry"):
        step_retry_now(workflow_id=run.workflow_id, step_name="notify", actor=olga, reason="r")
    run_pause(workflow_id=run.workflow_id, actor=olga, reason="incident")
    with pytest.raises(InvalidTransition, match="unpause it first"):
        step_retry_now(workflow_id=run.workflow_id, step_name="create_task", actor=olga, reason="r")
    assert not AuditEvent.objects.filter(action="retry_now").exists()
    assert run.steps.get(step_name="create_task").state == StepState.FAILED


def test_retry_now_from_the_run_page(clock):
    run = waiting("n-3")
    operator = login("operator")
    page = operator.get(f"/runs/{run.workflow_id}").text
    assert 'data-action="retry_now:create_task"' in page and "Try create_task now, same budget" in page
    assert act(operator, run, "retry_now", step="create_task", reason="tracker back").status_code == 200
    assert drive(run, clock).state == RunState.COMPLETED
    assert act(login("viewer"), run, "retry_now", step="create_task", reason="x").status_code == 403


def test_reset_attempts_gives_a_waiting_step_its_budget_back_and_keeps_it_due_when_it_was(clock):
    """Five failures in a row spend a budget of four: the run goes to review. A supervisor who
    gives the step its budget back after its third failure lets it reach the sixth attempt."""
    sam, olga = person("sam"), person("olga", "operator")
    control = waiting("r-control", failures=5)
    assert drive(control, clock).state == RunState.NEEDS_REVIEW
    receivers.clear()  # the fifth failure it had no attempt left for

    run = waiting("r-1", failures=5)
    task = run.steps.get(step_name="create_task")
    while task.attempts < 3:
        clock.set(task.next_attempt_at)
        advance(run.pk, owner="test-executor")
        task.refresh_from_db()
    due = task.next_attempt_at
    with pytest.raises(NotPermitted, match="may not reset attempts: that needs the supervisor role"):
        perform("reset_attempts", workflow_id=run.workflow_id, step_name="create_task", actor=olga, reason="r")
    step_reset_attempts(workflow_id=run.workflow_id, step_name="create_task", actor=sam, reason="tracker is flaky")
    task.refresh_from_db()
    run.refresh_from_db()
    assert (task.attempts, task.budget_start_attempt, task.next_attempt_at) == (3, 3, due)
    assert run.state == RunState.WAITING and run.next_wake_at == due
    event = AuditEvent.objects.get(run=run, action="reset_attempts")
    assert (event.actor, event.after["attempts_counted"]) == ("sam", 3)

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and run.steps.get(step_name="create_task").attempts == 6
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 2}  # the control's model call
    failed = failed_run(clock, "r-failed")  # nothing waits for a retry: refused, nothing written
    with pytest.raises(InvalidTransition, match="only a run waiting for a retry"):
        step_reset_attempts(workflow_id=failed.workflow_id, step_name="create_task", actor=sam, reason="r")
    assert AuditEvent.objects.filter(action="reset_attempts").count() == 1
