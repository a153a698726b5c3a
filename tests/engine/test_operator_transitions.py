"""Rules 11 and 12: explicit, audited operator transitions through the same functions the
executor uses; finished runs do not move without one."""

import pytest

from recovery.engine import transitions
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import ErrorKind, InvalidTransition, LeaseLost
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState, StepState
from tests.support import receivers
from tests.support.engine import assert_invariants, crash_at, drive, person, resolve_happened

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t1", "order_id": "o-9", "text": "office desk 300"}


@pytest.fixture
def operator():
    return person("olga")


def start():
    return run_start(workflow="test_orders", data=EVENT)[0]


def test_a_terminal_run_refuses_resume_and_retry(clock, operator):
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    audit_before = AuditEvent.objects.count()
    with pytest.raises(InvalidTransition, match="finished run cannot be resumed"):
        transitions.run_resume(workflow_id=run.workflow_id, actor=operator, reason="try again")
    with pytest.raises(InvalidTransition):
        transitions.step_retry(workflow_id=run.workflow_id, step_name="notify", actor=operator, reason="again")
    with pytest.raises(InvalidTransition):
        transitions.run_terminate(workflow_id=run.workflow_id, actor=operator, reason="stop")
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    assert AuditEvent.objects.count() == audit_before
    assert advance(run.pk) is None
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def test_operator_retry_after_a_permanent_error_resends_the_same_key_once(clock, operator):
    receivers.arm("task", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.FAILED
    key = run.steps.get(step_name="create_task").idempotency_key

    transitions.step_retry(workflow_id=run.workflow_id, step_name="create_task", actor=operator, reason="token rotated")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    task = run.steps.get(step_name="create_task")
    assert task.idempotency_key == key and task.attempts == 2
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    event = AuditEvent.objects.get(run=run, action="retry")
    assert (event.actor, event.actor_user, event.reason) == ("olga", operator, "token rotated")
    assert event.before["run"] == RunState.FAILED and event.after["run"] == RunState.PENDING
    assert_invariants()


def test_operator_actions_need_a_reason_and_change_nothing_without_one(clock, operator):
    receivers.arm("task", "forbidden")
    run = drive(start(), clock)
    count = AuditEvent.objects.count()
    with pytest.raises(InvalidTransition, match="reason"):
        transitions.run_resume(workflow_id=run.workflow_id, actor=operator, reason="  ")
    run.refresh_from_db()
    assert run.state == RunState.FAILED and AuditEvent.objects.count() == count


def test_resume_gives_an_exhausted_step_a_fresh_budget(clock, operator):
    receivers.arm("ledger", "unavailable", times=4)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    transitions.run_resume(workflow_id=run.workflow_id, actor=operator, reason="ERP is back")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert run.steps.get(step_name="post_entry").attempts == 5
    assert receivers.counts()["ledger"] == 1


def test_terminate_fences_out_a_live_executor(clock, operator):
    run = start()
    lease = transitions.run_claim(run_pk=run.pk, owner="worker-1")
    transitions.run_terminate(workflow_id=run.workflow_id, actor=operator, reason="duplicate invoice")
    with pytest.raises(LeaseLost):
        transitions.step_begin(lease=lease, step_name="read", intent={}, request_hash="h")
    run.refresh_from_db()
    assert run.state == RunState.TERMINATED
    assert run.steps.get(step_name="read").attempts == 0
    assert advance(run.pk) is None
    with pytest.raises(InvalidTransition):
        transitions.run_resume(workflow_id=run.workflow_id, actor=operator, reason="oops")


def test_unknown_outcome_without_automatic_path_goes_to_review_and_reconciles_on_request(clock, operator, monkeypatch):
    """A look-up that keeps failing leaves the step `unknown` (never `failed`) and, once its
    budget is spent, hands the run to an operator; reconcile then finds the object."""
    from tests.support import workflows

    receivers.arm("message", "commit_then_drop")
    calls = {"n": 0}
    real_lookup = workflows.notify.lookup_fn

    def flaky_lookup(ctx):
        calls["n"] += 1
        if calls["n"] <= 4:
            from recovery.errors import TransientError

            raise TransientError("lookup: 503")
        return real_lookup(ctx)

    monkeypatch.setattr(workflows.notify, "lookup_fn", flaky_lookup)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    notify = run.steps.get(step_name="notify")
    assert notify.state == StepState.UNKNOWN and notify.last_error_kind == ErrorKind.UNKNOWN_OUTCOME
    assert receivers.counts()["message"] == 1

    with pytest.raises(InvalidTransition):
        transitions.step_reconcile(workflow_id=run.workflow_id, step_name="create_task", actor=operator, reason="x")
    transitions.step_reconcile(workflow_id=run.workflow_id, step_name="notify", actor=operator, reason="provider up")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert_invariants()


def test_superseding_a_decision_makes_a_new_version_with_its_reason(clock, operator, monkeypatch):

    run = start()
    crash_at(monkeypatch, "create_task:before_intent", lambda: advance(run.pk))
    with pytest.raises(InvalidTransition, match="running"):  # a live executor holds it
        transitions.decision_supersede(workflow_id=run.workflow_id, step_name="decide", actor=operator, reason="x")
    clock.advance(60)
    receivers.MODEL_SCRIPT.append('{"category": "office", "amount": 280, "approver": "bob"}')
    transitions.decision_supersede(
        workflow_id=run.workflow_id, step_name="decide", actor=operator, reason="amount misread: 280 not 300"
    )
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    decisions = ModelDecision.objects.filter(run=run).order_by("version")
    assert [(d.version, d.state) for d in decisions] == [(1, DecisionState.SUPERSEDED), (2, DecisionState.ACCEPTED)]
    assert decisions[0].superseded_reason == "amount misread: 280 not 300"
    assert run.steps.get(step_name="create_task").intent["amount"] == 280
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 2}
    with pytest.raises(InvalidTransition):  # finished, and later steps acted on it
        transitions.decision_supersede(workflow_id=run.workflow_id, step_name="decide", actor=operator, reason="y")


def test_terminating_a_run_whose_worker_died_mid_call_leaves_no_step_running(clock, operator):
    """Found by the state-machine property: the step a dead worker left `running` is recorded
    as unknown (its call may have landed), never left running forever."""
    run = start()
    crash_at_step = "create_task:after_call"
    from tests.support.engine import crash_at

    crash_at(pytest.MonkeyPatch(), crash_at_step, lambda: advance(run.pk))
    transitions.run_terminate(workflow_id=run.workflow_id, actor=operator, reason="duplicate order")
    run.refresh_from_db()
    task = run.steps.get(step_name="create_task")
    assert (run.state, task.state, task.last_error_kind) == (RunState.TERMINATED, StepState.UNKNOWN, "unknown_outcome")
    assert AuditEvent.objects.get(run=run, action="terminate").after["steps_now_unknown"] == ["create_task"]
    assert receivers.counts()["task"] == 1  # it did land: an operator can now see it…
    with pytest.raises(InvalidTransition, match="reconcile create_task first"):
        transitions.run_compensate(workflow_id=run.workflow_id, actor=operator, reason="undo")
    task_ref = f"task-{receivers.RemoteObject.objects.get(kind='task').pk}"
    resolve_happened(
        workflow_id=run.workflow_id,
        step_name="create_task",
        actor=operator,
        reason="found it in the tracker",
        remote_ref=task_ref,
    )
    run.refresh_from_db()
    assert run.state == RunState.TERMINATED  # …settle it without reviving the run…
    transitions.run_compensate(workflow_id=run.workflow_id, actor=operator, reason="undo the task")
    run = drive(run, clock)  # …and compensate it
    assert run.state == RunState.COMPENSATED and receivers.compensations()["task_cancel"] == 1


def test_every_operator_change_saves_a_version_naming_the_operator(clock, operator):
    """The run's and its steps' version histories (django-simple-history) record who changed
    them: after retry, resume, compensate and terminate by a named operator, each change left a
    version with that operator as ``history_user``; the executor's own checkpoints leave none."""
    receivers.arm("task", "forbidden")
    run = drive(start(), clock)  # failed at create_task
    executor_versions = run.history.count()
    assert not run.history.filter(history_user__isnull=False).exists()

    transitions.step_retry(workflow_id=run.workflow_id, step_name="create_task", actor=operator, reason="token rotated")
    task = run.steps.get(step_name="create_task")
    assert run.history.filter(history_user=operator, state=RunState.PENDING).exists()
    assert task.history.filter(history_user=operator, state=StepState.PENDING).exists()

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert run.history.count() == executor_versions + 1  # the executor's checkpoints saved none

    transitions.run_compensate(workflow_id=run.workflow_id, actor=operator, reason="vendor cancelled")
    assert run.history.filter(history_user=operator, state=RunState.COMPENSATING).exists()
    assert task.history.filter(history_user=operator, state=StepState.COMPENSATING).exists()

    other = run_start(workflow="test_orders", data={**EVENT, "order_id": "o-10"})[0]
    transitions.run_terminate(workflow_id=other.workflow_id, actor=operator, reason="duplicate order")
    assert other.history.filter(history_user=operator, state=RunState.TERMINATED).exists()

    receivers.arm("task", "forbidden")
    third = drive(run_start(workflow="test_orders", data={**EVENT, "order_id": "o-11"})[0], clock)
    transitions.run_resume(workflow_id=third.workflow_id, actor=operator, reason="token rotated")
    assert third.history.filter(history_user=operator, state=RunState.PENDING).exists()
