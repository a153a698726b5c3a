"""Rule 10 and failure tests 6–7: compensate, don't pretend to roll back."""

import pytest
from django.conf import settings

from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import InvalidTransition, NotPermitted
from recovery.models import AuditEvent, RunState, StepState
from recovery.workflow import CompensationPolicy
from tests.support import receivers, workflows
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t7", "order_id": "o-77", "text": "office chairs 120"}


@pytest.fixture
def automatic(monkeypatch):
    monkeypatch.setattr(workflows.orders, "compensation", CompensationPolicy.AUTOMATIC)


@pytest.fixture
def supervisor():
    return person("sam")


def start():
    return run_start(workflow="test_orders", data=EVENT)[0]


def states(run):
    return {s.step_name: s.state for s in run.steps.all()}


def test_late_permanent_failure_compensates_earlier_effects_in_reverse_order(clock, automatic):
    """failure test 6: the ledger refuses (403) after a task and a message exist."""
    receivers.arm("ledger", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.COMPENSATED
    assert states(run) == {
        "read": StepState.SUCCEEDED,
        "decide": StepState.SUCCEEDED,
        "create_task": StepState.COMPENSATED,
        "notify": StepState.COMPENSATED,
        "post_entry": StepState.FAILED,
    }
    done = AuditEvent.objects.filter(run=run, action="compensation_succeed").order_by("at", "id")
    assert [e.step_name for e in done] == ["notify", "create_task"]
    start_event = AuditEvent.objects.get(run=run, action="compensate")
    assert start_event.actor == "executor" and "post_entry failed permanently" in start_event.reason
    assert start_event.after["order"] == ["notify", "create_task"]
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 0, "model_call": 1}
    assert receivers.compensations() == {"task_cancel": 1, "correction": 1, "reversal": 0}
    assert run.steps.get(step_name="create_task").compensation_ref.startswith("cancel-")
    assert_invariants()


def test_operator_policy_waits_and_the_operator_compensates_the_whole_run(clock, supervisor):
    receivers.arm("ledger", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.FAILED
    assert not AuditEvent.objects.filter(run=run, action="compensate").exists()

    transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="vendor blocked")
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED
    event = AuditEvent.objects.get(run=run, action="compensate")
    assert (event.actor, event.reason, event.before["run"]) == ("sam", "vendor blocked", RunState.FAILED)
    assert receivers.compensations()["task_cancel"] == 1 and receivers.compensations()["correction"] == 1


def test_failed_compensation_stays_visible_and_is_not_reported_as_rolled_back(clock, automatic, supervisor):
    """failure test 7: the task service refuses the cancel."""
    receivers.arm("ledger", "forbidden")
    receivers.arm("task_cancel", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.COMPENSATION_FAILED
    assert states(run)["notify"] == StepState.COMPENSATED
    assert states(run)["create_task"] == StepState.COMPENSATION_FAILED
    assert "compensation failed" in run.status_reason
    assert receivers.compensations()["task_cancel"] == 0 and receivers.compensations()["correction"] == 1
    assert AuditEvent.objects.filter(run=run, action="compensation_fail", step_name="create_task").count() == 1
    assert not AuditEvent.objects.filter(run=run, action="compensation_done").exists()
    assert advance(run.pk) is None  # it stays there until someone acts

    transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="token fixed")
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED
    assert receivers.compensations()["task_cancel"] == 1 and receivers.compensations()["correction"] == 1


def test_transient_compensation_errors_are_retried_with_backoff(clock, automatic):
    receivers.arm("ledger", "forbidden")
    receivers.arm("task_cancel", "unavailable", times=2)
    run = drive(start(), clock)
    assert run.state == RunState.COMPENSATED
    task = run.steps.get(step_name="create_task")
    assert task.compensation_attempts == 3
    assert AuditEvent.objects.filter(run=run, action="compensation_retry").count() == 2
    assert receivers.compensations()["task_cancel"] == 1


def test_a_crash_during_compensation_runs_it_again_under_the_same_key_once(clock, automatic, monkeypatch):
    receivers.arm("ledger", "forbidden")
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "create_task.compensate:after_call=raise")
    run = start()
    with pytest.raises(failpoints.FailpointRaised):
        for _ in range(5):
            advance(run.pk)
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert receivers.compensations()["task_cancel"] == 1
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED
    assert run.steps.get(step_name="create_task").compensation_attempts == 2
    assert receivers.compensations()["task_cancel"] == 1
    assert_invariants()


def test_technical_errors_never_compensate_by_themselves(clock, automatic):
    receivers.arm("ledger", "unavailable", times=10)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert not AuditEvent.objects.filter(run=run, action="compensate").exists()
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 0, "model_call": 1}
    assert receivers.compensations() == {"task_cancel": 0, "correction": 0, "reversal": 0}


def test_compensation_waits_until_unknown_outcomes_are_reconciled(clock, supervisor, monkeypatch):
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW and states(run)["notify"] == StepState.UNKNOWN
    with pytest.raises(InvalidTransition, match="reconcile notify first"):
        transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="undo")
    run.refresh_from_db()
    assert run.state == RunState.NEEDS_REVIEW and states(run)["create_task"] == StepState.SUCCEEDED


def test_single_step_compensation_respects_reverse_order_and_keeps_the_rest(clock, supervisor):
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    with pytest.raises(InvalidTransition, match="compensate notify, post_entry first"):
        transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="x", step_name="create_task")
    with pytest.raises(InvalidTransition, match="declares no compensation"):
        transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="x", step_name="decide")

    transitions.run_compensate(
        workflow_id=run.workflow_id, actor=supervisor, reason="wrong amount", step_name="post_entry"
    )
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED  # the task and the message stand
    assert "post_entry" not in run.status_reason and "create_task, notify stand" in run.status_reason
    assert states(run)["post_entry"] == StepState.COMPENSATED
    assert receivers.compensations() == {"task_cancel": 0, "correction": 0, "reversal": 1}


def test_rolled_back_only_when_every_compensation_truly_restored_the_previous_state(clock, automatic, monkeypatch):
    from recovery.workflow import Outcome

    receivers.arm("ledger", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.COMPENSATED and run.status_reason == "every completed effect was compensated"

    for spec in (workflows.create_task, workflows.notify):
        monkeypatch.setattr(spec, "compensation_fn", lambda ctx: Outcome(remote_ref="undone", restored=True))
    receivers.arm("ledger", "forbidden")
    other = drive(run_start(workflow="test_orders", data={**EVENT, "order_id": "o-78"})[0], clock)
    assert other.state == RunState.COMPENSATED and other.status_reason == "rolled back"


def test_each_compensation_needs_the_role_its_contract_names(clock):
    """``@step.compensate(who=…)`` is enforced, not only shown: an operator may send the
    correction of a message (who="operator") but not cancel the task (who="supervisor"), from
    every surface (the transition checks it; the console and the command go through it)."""
    receivers.arm("ledger", "forbidden")  # the task and the message exist; the run stops failed
    run = drive(start(), clock)
    assert run.state == RunState.FAILED
    olga, viewer = person("olga", "operator"), person("vera", "viewer")
    events = AuditEvent.objects.filter(run=run).count()

    with pytest.raises(NotPermitted, match=r"^olga \(operator\) may not compensate create_task \(supervisor\): "):
        transitions.perform("compensate", workflow_id=run.workflow_id, actor=olga, reason="undo all")
    with pytest.raises(NotPermitted, match=r"^vera \(viewer\) may not compensate: that needs the operator role$"):
        transitions.perform("compensate", workflow_id=run.workflow_id, step_name="notify", actor=viewer, reason="x")
    assert AuditEvent.objects.filter(run=run).count() == events
    assert states(run)["notify"] == StepState.SUCCEEDED

    transitions.perform("compensate", workflow_id=run.workflow_id, step_name="notify", actor=olga, reason="wrong")
    run = drive(run, clock)
    assert states(run)["notify"] == StepState.COMPENSATED
    assert receivers.compensations() == {"task_cancel": 0, "correction": 1, "reversal": 0}
    with pytest.raises(NotPermitted, match=r"create_task \(supervisor\)"):
        transitions.perform("compensate", workflow_id=run.workflow_id, step_name="create_task", actor=olga, reason="x")
    transitions.perform(
        "compensate", workflow_id=run.workflow_id, step_name="create_task", actor=person("sam"), reason="x"
    )
    run = drive(run, clock)
    assert receivers.compensations() == {"task_cancel": 1, "correction": 1, "reversal": 0}
