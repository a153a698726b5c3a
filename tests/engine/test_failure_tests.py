"""The seed's failure tests (the failure tests) at engine level, against counting receivers.

Each arranges a fault, runs the workflow, resumes it the way production would, then asserts
the outcome AND counts what must not exist: tasks, messages, ledger entries, model calls.
"""

import pytest
from django.conf import settings

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import ErrorKind
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState, StepState, WorkflowRun
from tests.support import receivers
from tests.support.engine import advance_as_dying_workers, assert_invariants, crash_at, drive
from tests.support.workflows import FAST

pytestmark = pytest.mark.django_db(transaction=True)

EVENT = {"tenant": "t42", "order_id": "o-1847", "text": "office chairs 120"}
ONE_OF_EACH = {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def start():
    run, _ = run_start(workflow="test_orders", data=EVENT)
    return run


def step(run, name):
    return run.steps.get(step_name=name)


def test_happy_path_completes_with_one_object_per_side_effect(clock):
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_OF_EACH
    assert [s.state for s in run.steps.order_by("position")] == [StepState.SUCCEEDED] * 5
    assert all(s.attempts == 1 for s in run.steps.all())
    assert_invariants()


@pytest.mark.parametrize("name", ["create_task", "notify", "post_entry"])
def test_crash_before_the_external_request_performs_the_action_exactly_once(clock, monkeypatch, name):
    """failure test 1: the intent is checkpointed, the worker dies before calling."""
    run = start()
    crash_at(monkeypatch, f"{name}:before_call", lambda: advance(run.pk))
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and step(run, name).state == StepState.RUNNING

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_OF_EACH
    assert step(run, name).last_error_kind == ErrorKind.UNKNOWN_OUTCOME  # it was treated as unknown…
    assert AuditEvent.objects.filter(run=run, action="lease_takeover").count() == 1
    assert_invariants()


@pytest.mark.parametrize("name", ["create_task", "notify", "post_entry"])
def test_crash_after_receiver_commit_reconciles_to_exactly_one_object(clock, monkeypatch, name):
    """failure test 2: the receiver committed, the worker died before saving the response. The
    resumed run looks the object up by key (or resends the same key) instead of creating a
    second one."""
    run = start()
    crash_at(monkeypatch, f"{name}:after_call", lambda: advance(run.pk))
    before_resume = receivers.counts()

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_OF_EACH
    assert receivers.counts() == {**before_resume, **{k: 1 for k in ("task", "message", "ledger")}}
    assert step(run, name).remote_ref
    assert_invariants()


@pytest.mark.parametrize("kind,name", [("task", "create_task"), ("message", "notify"), ("ledger", "post_entry")])
def test_response_lost_after_commit_is_unknown_then_reconciled(clock, kind, name):
    """Rule 7: a timeout after the request was sent is `unknown`, never `failed`."""
    receivers.arm(kind, "commit_then_drop")
    run = start()
    advance(run.pk)
    run.refresh_from_db()
    assert step(run, name).state in (StepState.SUCCEEDED,)  # reconciled within the same claim
    assert AuditEvent.objects.filter(run=run, step_name=name, action="step_unknown").count() == 1
    assert not AuditEvent.objects.filter(run=run, step_name=name, action="step_fail").exists()
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_OF_EACH
    assert_invariants()


def test_rate_limit_twice_then_success_backs_off_and_completes(clock):
    """failure test 3: two 429s with Retry-After, then success."""
    receivers.arm("task", "rate_limit", times=2)
    run = start()
    t0 = clock.now()
    advance(run.pk)
    run.refresh_from_db()
    task = step(run, "create_task")
    assert run.state == RunState.WAITING and task.state == StepState.FAILED
    assert task.last_error_kind == ErrorKind.RATE_LIMITED
    first_wait = (task.next_attempt_at - t0).total_seconds()
    assert first_wait >= receivers.RETRY_AFTER  # Retry-After honoured over the 1 s backoff

    clock.set(run.next_wake_at)
    advance(run.pk)
    run.refresh_from_db()
    assert step(run, "create_task").attempts == 2 and run.state == RunState.WAITING

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    task = step(run, "create_task")
    assert task.attempts == 3
    assert receivers.counts() == ONE_OF_EACH
    assert AuditEvent.objects.filter(run=run, step_name="create_task", action="step_fail").count() == 2
    assert_invariants()


def test_permanent_auth_error_spends_no_retry_budget(clock):
    """failure test 4: a 403 stops the run at once; no transient retry is scheduled."""
    receivers.arm("message", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.FAILED
    notify = step(run, "notify")
    assert notify.state == StepState.FAILED and notify.attempts == 1
    assert notify.last_error_kind == ErrorKind.PERMANENT and notify.next_attempt_at is None
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 0, "model_call": 1}
    # nothing is due: the executor will not touch it again without an operator
    assert advance(run.pk) is None
    assert_invariants()


def test_transient_errors_until_the_budget_runs_out_go_to_review(clock):
    receivers.arm("ledger", "unavailable", times=FAST.maximum_attempts + 3)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    entry = step(run, "post_entry")
    assert entry.attempts == FAST.maximum_attempts
    assert entry.last_error_kind == ErrorKind.TRANSIENT
    assert receivers.counts()["ledger"] == 0
    assert_invariants()


def test_restart_after_decision_saved_reuses_the_accepted_decision(clock, monkeypatch):
    """failure test 5: the worker dies right after the decision is checkpointed; the re-run
    uses it and the model is not asked again (it would answer differently)."""
    run = start()
    crash_at(monkeypatch, "decide:after_outcome", lambda: advance(run.pk))
    accepted = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED)
    receivers.MODEL_SCRIPT.append('{"category": "travel", "amount": 999999, "approver": "mallory"}')

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_OF_EACH  # one model call in all
    assert ModelDecision.objects.filter(run=run).count() == 1
    from tests.support.models import RemoteObject

    entry = RemoteObject.objects.get(kind="ledger")
    assert entry.payload["amount"] == accepted.accepted["amount"] == 120
    assert_invariants()


def test_crash_between_intent_and_model_call_does_not_create_two_decisions(clock, monkeypatch):
    run = start()
    crash_at(monkeypatch, "decide:after_call", lambda: advance(run.pk))
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert ModelDecision.objects.filter(run=run, state=DecisionState.ACCEPTED).count() == 1
    assert_invariants()


def test_invalid_model_output_pauses_for_review_keeping_the_bad_output(clock):
    bad = ['{"category": "bribe", "amount": -1, "approver": "x"}', "this is not json"]
    receivers.MODEL_SCRIPT.extend(bad)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    decide = step(run, "decide")
    assert decide.last_error_kind == ErrorKind.INVALID_MODEL_OUTPUT
    kept = list(
        ModelDecision.objects.filter(run=run, state=DecisionState.INVALID).values_list("invalid_output", flat=True)
    )
    assert kept == bad
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 0, "model_call": FAST.maximum_format_failures}
    assert_invariants()


def test_same_event_started_twice_is_one_run_with_one_copy_of_each_effect(clock):
    """failure test 8 (sequential half; the concurrent half runs on PostgreSQL)."""
    first, created1 = run_start(workflow="test_orders", data=EVENT)
    second, created2 = run_start(workflow="test_orders", data=dict(EVENT))
    assert (created1, created2) == (True, False) and first.pk == second.pk
    drive(first, clock)
    run_start(workflow="test_orders", data=EVENT)
    assert WorkflowRun.objects.count() == 1
    assert advance(first.pk) is None  # completed: nothing to do
    assert receivers.counts() == ONE_OF_EACH


def test_worker_paused_past_its_lease_cannot_write_after_takeover(clock, monkeypatch):
    """A fenced write: the old lease's generation no longer matches, so the slow worker's
    outcome is refused and exactly one task exists."""
    from recovery.engine import transitions
    from recovery.errors import LeaseLost

    run = start()
    lease_a = transitions.run_claim(run_pk=run.pk, owner="A")
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    lease_b = transitions.run_claim(run_pk=run.pk, owner="B")
    assert lease_b is not None and lease_b.generation == lease_a.generation + 1
    with pytest.raises(LeaseLost):
        transitions.step_begin(lease=lease_a, step_name="read", intent={}, request_hash="x")
    run.refresh_from_db()
    assert run.lease_owner == "B" and step(run, "read").attempts == 0


def test_no_step_stays_running_past_its_lease(clock, monkeypatch):
    run = start()
    crash_at(monkeypatch, "notify:before_call", lambda: advance(run.pk))
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    from recovery.engine.loop import run_due

    assert run_due() == 1  # the stalled run is due: its lease expired
    assert_invariants()
    run.refresh_from_db()
    # The dead worker may have sent its request: not running, unknown, and looked up again once
    # that request can no longer commit (the in-flight window), not sent again before.
    assert (run.state, step(run, "notify").state) == (RunState.WAITING, StepState.UNKNOWN)
    assert receivers.counts()["message"] == 0
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["message"] == 1


def test_same_key_with_a_different_request_is_a_visible_conflict_not_a_replay(clock, monkeypatch):
    """Idempotency records keep a hash of the request: if a re-run would send the same key
    with a different payload (a non-deterministic intent, a changed deployment), the step
    stops with a conflict instead of sending it."""
    from tests.support import workflows

    receivers.arm("task", "unavailable")
    run = start()
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING and step(run, "create_task").attempts == 1

    real_intent = workflows.create_task.intent_fn
    monkeypatch.setattr(workflows.create_task, "intent_fn", lambda ctx: {**real_intent(ctx), "amount": 1})
    run = drive(run, clock)
    task = step(run, "create_task")
    assert run.state == RunState.FAILED
    assert task.last_error_kind == ErrorKind.PERMANENT and "different request" in task.last_error
    assert task.attempts == 1  # the conflicting request was never sent
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 0, "model_call": 1}
    assert_invariants()


def test_a_step_that_kills_its_worker_every_time_goes_to_review_not_round_forever(clock, monkeypatch):
    """Rule 9: no unbounded loop, even when every attempt dies before its outcome is saved."""
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "read:after_call=raise")
    run = advance_as_dying_workers(start(), clock, FAST.maximum_attempts + 2)
    assert run.state == RunState.NEEDS_REVIEW
    assert step(run, "read").attempts == FAST.maximum_attempts
    assert "without a recorded outcome" in run.status_reason
    assert_invariants()


def test_a_bug_in_a_step_result_goes_to_review_with_the_error(clock, monkeypatch):
    from tests.support import workflows

    monkeypatch.setattr(workflows.read, "call", lambda ctx: {"when": object()})  # not JSON-serialisable
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert "executor error" in run.status_reason
    assert receivers.counts()["model_call"] == 0


def test_a_run_started_under_a_version_this_deployment_lacks_waits_unclaimed_not_in_review(clock):
    """A deploy is not the run's fault: no executor here claims it, nothing is sent, and it does
    not go to an operator (tests/engine/test_versions.py has the whole story)."""
    run = start()
    WorkflowRun.objects.filter(pk=run.pk).update(workflow_version=99)
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.PENDING and run.lease_owner == ""
    assert not AuditEvent.objects.filter(run=run).exclude(action="start").exists()
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 0, "model_call": 0}
