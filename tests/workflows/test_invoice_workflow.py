"""The eight failure tests of the failure tests on the invoice workflow, over real HTTP to the simulated
systems (a live server) with their own database. After each: count tasks, messages and ledger
entries, and check leases, remote references and terminal states."""

import json
import threading

import pytest
from django.conf import settings
from django.db import connections

from recovery.engine import failpoints, transitions
from recovery.engine.executor import advance
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import run_start
from recovery.errors import ErrorKind, InvalidTransition
from recovery.models import (
    AuditEvent,
    DecisionState,
    ModelDecision,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.workflow import CompensationPolicy
from sandbox import faults
from sandbox.models import Fault
from tests.support.engine import crash_at, drive, lease_expired_running_steps, person
from workflows.invoice import workflow as invoice_module

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

EVENT = {
    "tenant": "tenant-42",
    "invoice_id": "inv-1847",
    "text": "ACME Office Supply — 40 ergonomic chairs and 10 desks. Total due: EUR 1,840.00",
}
NOTHING_COMPENSATED = {"tasks_cancelled": 0, "corrections": 0, "ledger_reversals": 0}
ONE_OF_EACH = {"tasks": 1, "messages": 1, "ledger_entries": 1, **NOTHING_COMPENSATED}


@pytest.fixture(autouse=True)
def sandbox(live_server, settings):
    """Point the adapters at the live server; start from an empty sandbox."""
    settings.SANDBOX_URL = live_server.url
    faults.clear()
    yield live_server.url
    faults.clear()


def start(**overrides):
    return run_start(workflow="invoice", data={**EVENT, **overrides})[0]


def step(run, name):
    return run.steps.get(step_name=name)


def assert_invariants():
    """No step `running` past its lease; no completed writing step without its remote reference."""
    assert lease_expired_running_steps() == []
    writing = [s.name for s in invoice_module.invoice.steps if invoice_module.invoice.writes(s.name)]
    for s in StepExecution.objects.filter(state=StepState.SUCCEEDED, step_name__in=writing):
        assert s.remote_ref, f"{s} succeeded without a remote reference"


def test_an_invoice_runs_end_to_end_with_one_task_one_message_one_ledger_entry(clock):
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    decision = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED).accepted
    assert decision["amount"] == "1840.00" and decision["category"] == "office_supplies"
    assert step(run, "create_approval_task").remote_ref.startswith("task_")
    assert step(run, "notify_approver").remote_ref.startswith("msg_")
    assert step(run, "post_ledger_entry").remote_ref.startswith("le_")
    assert run.workflow_id == "invoice:tenant-42:inv-1847"
    assert_invariants()


def test_1_crash_before_the_request_creates_the_task_exactly_once(clock, monkeypatch):
    run = start()
    crash_at(monkeypatch, "create_approval_task:before_call", lambda: advance(run.pk))
    assert faults.counts()["tasks"] == 0
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    assert_invariants()


@pytest.mark.parametrize(
    "service,operation,name",
    [
        ("tasks", "create", "create_approval_task"),  # look up by idempotency key
        ("ledger", "post", "post_ledger_entry"),  # look up by transaction reference
    ],
)
def test_2_receiver_commits_then_the_response_is_lost_reconciles_to_exactly_one_object(clock, service, operation, name):
    faults.set_fault(service, operation, "commit_then_drop")
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    s = step(run, name)
    assert s.attempts == 1  # reconciled by look-up, not re-sent
    assert AuditEvent.objects.filter(run=run, step_name=name, action="step_unknown").count() == 1
    assert AuditEvent.objects.filter(run=run, step_name=name, action="reconciled").count() == 1
    assert not AuditEvent.objects.filter(run=run, step_name=name, action="step_fail").exists()
    assert_invariants()


def test_2_messenger_commits_then_the_answer_is_lost_the_outbox_finds_it_and_never_resends(clock):
    """The messenger does not honour keys: the outbox's next attempt looks the message up by
    its client reference before sending again."""
    faults.set_fault("messages", "send", "commit_then_drop")
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    message = OutboxMessage.objects.get(run=run)
    assert (message.state, message.attempts) == (OutboxState.DELIVERED, 2)
    retry = AuditEvent.objects.get(run=run, action="outbox_retry")
    assert retry.after["error_kind"] == ErrorKind.UNKNOWN_OUTCOME
    delivered = AuditEvent.objects.get(run=run, action="outbox_delivered")
    assert delivered.reason == "found by key after a lost answer"
    assert step(run, "notify_approver").remote_ref == message.provider_ref
    assert message.provider_ref.startswith("msg_")
    assert_invariants()


def test_3_rate_limited_twice_then_success_backs_off_honouring_retry_after(clock):
    faults.set_fault("tasks", "create", "rate_limit", times=2, retry_after=30)
    run = start()
    t0 = clock.now()
    advance(run.pk)
    run.refresh_from_db()
    task = step(run, "create_approval_task")
    assert (run.state, task.last_error_kind) == (RunState.WAITING, ErrorKind.RATE_LIMITED)
    assert (task.next_attempt_at - t0).total_seconds() >= 30
    assert advance(run.pk) is None  # not due before Retry-After

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert step(run, "create_approval_task").attempts == 3
    assert faults.counts() == ONE_OF_EACH
    assert_invariants()


def test_4_permanent_authorisation_error_stops_without_spending_the_retry_budget(clock):
    faults.set_fault("tasks", "create", "forbidden", times=5)
    run = drive(start(), clock)
    assert run.state == RunState.FAILED
    task = step(run, "create_approval_task")
    assert (task.attempts, task.last_error_kind, task.next_attempt_at) == (1, ErrorKind.PERMANENT, None)
    assert "403" in task.last_error
    assert faults.counts() == {**ONE_OF_EACH, "tasks": 0, "messages": 0, "ledger_entries": 0}
    assert step(run, "notify_approver").state == StepState.PENDING
    assert advance(run.pk) is None
    assert_invariants()


def test_4_a_message_refused_for_good_stops_its_outbox_row_after_one_attempt_and_the_run_for_review(clock):
    """The outbox decouples delivery: the ledger entry is posted; the run does not complete
    while a message it owes was refused."""
    faults.set_fault("messages", "send", "forbidden", times=5)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    message = OutboxMessage.objects.get(run=run)
    assert (message.state, message.attempts, message.last_error_kind) == (OutboxState.FAILED, 1, ErrorKind.PERMANENT)
    assert "not delivered" in run.status_reason
    assert faults.counts() == {**ONE_OF_EACH, "messages": 0}
    assert_invariants()


def test_5_restart_after_the_decision_is_saved_reuses_it(clock, monkeypatch):
    run = start()
    crash_at(monkeypatch, "classify:after_outcome", lambda: advance(run.pk))

    class DifferentModel:
        name = "different"

        def propose(self, *, invoice_id, text):
            raise AssertionError("the model must not be asked again")

    monkeypatch.setattr(invoice_module, "get_provider", lambda: DifferentModel())
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert ModelDecision.objects.filter(run=run).count() == 1
    assert faults.counts() == ONE_OF_EACH
    from sandbox.models import LedgerEntry

    assert str(LedgerEntry.objects.get().amount) == "1840.00"
    assert_invariants()


@pytest.fixture
def automatic(monkeypatch):
    monkeypatch.setattr(invoice_module.invoice, "compensation", CompensationPolicy.AUTOMATIC)


def test_6_a_late_failure_after_two_effects_compensates_in_reverse_order(clock, automatic):
    faults.set_fault("ledger", "post", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.COMPENSATED
    order = AuditEvent.objects.filter(run=run, action="compensation_succeed").order_by("at", "id")
    assert [e.step_name for e in order] == ["notify_approver", "create_approval_task"]
    assert faults.counts() == {
        "tasks": 1,
        "messages": 1,
        "ledger_entries": 0,
        "tasks_cancelled": 1,
        "corrections": 1,
        "ledger_reversals": 0,
    }
    assert step(run, "create_approval_task").state == StepState.COMPENSATED
    assert step(run, "post_ledger_entry").state == StepState.FAILED
    assert "correction" in run.incident  # the correction marks the incident
    assert run.status_reason != "rolled back"  # a cancelled task and a correction restore nothing
    assert_invariants()


def test_7_a_failed_compensation_leaves_the_run_visible_not_rolled_back(clock, automatic):
    faults.set_fault("ledger", "post", "forbidden")
    faults.set_fault("tasks", "cancel", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.COMPENSATION_FAILED
    assert step(run, "create_approval_task").state == StepState.COMPENSATION_FAILED
    assert step(run, "notify_approver").state == StepState.COMPENSATED
    assert faults.counts() == {
        "tasks": 1,
        "messages": 1,
        "ledger_entries": 0,
        "tasks_cancelled": 0,
        "corrections": 1,
        "ledger_reversals": 0,
    }
    assert not AuditEvent.objects.filter(run=run, action="compensation_done").exists()

    supervisor = person("sam")
    transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="tracker permission fixed")
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED
    assert faults.counts()["tasks_cancelled"] == 1 and faults.counts()["corrections"] == 1
    assert_invariants()


def test_a_completed_run_is_compensated_on_request_with_a_reversing_entry(clock):
    run = drive(start(), clock)
    supervisor = person("sam")
    transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="duplicate invoice")
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED
    assert faults.counts() == {
        "tasks": 1,
        "messages": 1,
        "ledger_entries": 1,
        "tasks_cancelled": 1,
        "corrections": 1,
        "ledger_reversals": 1,
    }
    order = AuditEvent.objects.filter(run=run, action="compensation_succeed").order_by("at", "id")
    assert [e.step_name for e in order] == ["post_ledger_entry", "notify_approver", "create_approval_task"]
    assert advance(run.pk) is None
    with pytest.raises(InvalidTransition):
        transitions.run_resume(workflow_id=run.workflow_id, actor=supervisor, reason="again")


def test_8_the_same_event_delivered_concurrently_makes_one_run_and_one_of_each(postgres_only, monkeypatch, clock):
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "*:before_call=sleep(20)")
    barrier = threading.Barrier(12)
    errors = []

    def consume(i):
        try:
            barrier.wait()
            run, _ = run_start(workflow="invoice", data=dict(EVENT))
            for _ in range(6):
                advance(run.pk, owner=f"consumer-{i}")
                publish_due(owner=f"publisher-{i}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert WorkflowRun.objects.count() == 1
    assert drive(WorkflowRun.objects.get(), clock).state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    # Every step made its call once; the approver's wait (not needed at this amount) calls nothing.
    attempts = dict(StepExecution.objects.values_list("step_name", "attempts"))
    assert attempts.pop("approver_decision") == 0 and set(attempts.values()) == {1}


def test_unavailable_until_the_budget_runs_out_goes_to_review_not_compensation(clock, automatic, monkeypatch):
    # Without its pause_after policy (the next test), the ledger step spends its whole budget.
    monkeypatch.setattr(invoice_module.post_ledger_entry, "pause_after", None)
    faults.set_fault("ledger", "post", "unavailable", times=50)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert step(run, "post_ledger_entry").attempts == invoice_module.LEDGER_POLICY.maximum_attempts
    assert faults.counts() == {**ONE_OF_EACH, "ledger_entries": 0}
    assert_invariants()


def test_a_ledger_unavailable_for_every_call_pauses_its_step_before_the_budget_runs_out(clock, automatic):
    """The ledger step's policy: five failures of one kind within two minutes pause it for every
    run (its backoff puts one run's five failures within 75 s), one attempt short of review."""
    faults.set_fault("ledger", "post", "unavailable", times=50)
    run = drive(start(), clock)
    assert run.state == RunState.PAUSED
    assert run.status_reason.startswith("paused by auto-pause at ")
    assert step(run, "post_ledger_entry").attempts == 5 < invoice_module.LEDGER_POLICY.maximum_attempts
    assert faults.counts() == {**ONE_OF_EACH, "ledger_entries": 0}
    Fault.objects.using("sandbox").update(remaining=0)  # the ledger is back
    transitions.workflow_unpause(workflow="invoice", step_name="post_ledger_entry", actor=person("sam"), reason="up")
    assert drive(run, clock).state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    assert_invariants()


def test_a_slow_receiver_past_the_timeout_is_unknown_then_found(clock):
    faults.set_fault("tasks", "create", "slow", delay_ms=int((settings.RECOVERY_HTTP_TIMEOUT + 0.5) * 1000))
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    assert step(run, "create_approval_task").last_error_kind == ErrorKind.UNKNOWN_OUTCOME


def test_outbox_publisher_killed_before_sending_delivers_once_later(clock, monkeypatch):
    """The crash between the commit of the outbox row and the publish."""
    from recovery.engine.publisher import publish_due

    run = start()
    advance(run.pk)  # the run enqueues the message and goes on to the ledger
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "notify_approver:before_call=raise")
    with pytest.raises(failpoints.FailpointRaised):
        publish_due()
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert faults.counts()["messages"] == 0
    assert publish_due() == 0  # its claim has not expired: nobody else sends it meanwhile
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    assert OutboxMessage.objects.get(run=run).attempts == 2
    assert_invariants()


def test_outbox_publisher_killed_after_sending_never_sends_twice(clock, monkeypatch):
    from recovery.engine.publisher import publish_due

    run = start()
    advance(run.pk)
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "notify_approver:after_call=raise")
    with pytest.raises(failpoints.FailpointRaised):
        publish_due()
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert faults.counts()["messages"] == 1
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    assert AuditEvent.objects.get(run=run, action="outbox_delivered").reason == "found by key after a lost answer"
    assert_invariants()


def test_compensating_a_message_not_yet_delivered_cancels_it_instead_of_correcting(clock):
    run = start()
    advance(run.pk)  # task created, message enqueued, ledger posted; nothing published yet
    supervisor = person("sam")
    run.refresh_from_db()
    assert run.state == RunState.WAITING  # waiting for its outbox
    transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor, reason="duplicate invoice")
    for _ in range(5):
        advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.COMPENSATED
    assert OutboxMessage.objects.get(run=run).state == OutboxState.CANCELLED
    assert step(run, "notify_approver").compensation_ref.endswith("cancelled")
    assert faults.counts() == {
        "tasks": 1,
        "messages": 0,
        "ledger_entries": 1,
        "tasks_cancelled": 1,
        "corrections": 0,
        "ledger_reversals": 1,
    }
    from recovery.engine.publisher import publish_due

    assert publish_due() == 0 and faults.counts()["messages"] == 0  # never sent afterwards


def test_openai_provider_end_to_end_keeps_invalid_output_and_never_persists_the_api_key(clock, settings, stub):  # noqa: F811
    """Rule 6: checkpoints, audit events and history hold identifiers and decisions, never the
    model's credentials, even when the provider echoes the key back in an error."""
    from io import StringIO

    from django.core.management import call_command

    from tests.support.model_server import VALID_DECISION, Reply, completion

    key = "sk-planted-SECRET-0123456789abcdef"
    settings.MODEL_PROVIDER, settings.OPENAI_BASE_URL, settings.OPENAI_API_KEY = "openai", stub.base_url, key
    stub.reply(
        Reply(429, {"error": {"message": "slow down"}}, headers={"Retry-After": "2"}),
        Reply(200, completion("{not json")),
        Reply(200, completion(json.dumps(VALID_DECISION))),
    )
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert stub.requests[0].headers["authorization"] == f"Bearer {key}"
    kept = ModelDecision.objects.get(run=run, state=DecisionState.INVALID)
    assert kept.invalid_output == "{not json"
    accepted = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED).accepted
    assert accepted["category"] == "hardware" and accepted["amount"] == "1840.00"
    assert step(run, "classify").attempts == 3
    assert faults.counts() == ONE_OF_EACH

    stub.replies.clear()
    stub.reply(Reply(401, {"error": {"message": f"Incorrect API key provided: {key}"}}))
    other = drive(start(invoice_id="inv-401"), clock)
    assert other.state == RunState.FAILED
    assert "401" in step(other, "classify").last_error

    dump = StringIO()
    call_command("dumpdata", "recovery", stdout=dump)
    assert key not in dump.getvalue() and key[10:] not in dump.getvalue()
    assert "Incorrect API key" in dump.getvalue()  # the error itself is kept, redacted


def test_resume_after_a_refused_message_delivers_it_once_and_completes(clock):
    faults.set_fault("messages", "send", "forbidden")
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    operator = person("olga")
    transitions.run_resume(workflow_id=run.workflow_id, actor=operator, reason="messenger token rotated")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    message = OutboxMessage.objects.get(run=run)
    assert (message.state, message.attempts) == (OutboxState.DELIVERED, 2)
    assert AuditEvent.objects.get(run=run, action="resume").after["outbox_requeued"] == ["notify_approver"]
    assert faults.counts() == ONE_OF_EACH
    assert_invariants()


def test_the_sweeper_queues_an_outbox_message_once_per_due_time_not_once_per_sweep(clock, settings, monkeypatch):
    """Celery mode with the broker replaced by a list of what would be sent (tests/engine/test_dispatch.py)."""
    from recovery import tasks

    settings.RECOVERY_EXECUTOR = "celery"
    settings.RECOVERY_REDISPATCH_SECONDS = 60
    sent = []
    monkeypatch.setattr(tasks.advance_run, "delay", lambda pk: sent.append(("advance_run", pk)))
    monkeypatch.setattr(tasks.publish_outbox, "delay", lambda pk: sent.append(("publish_outbox", pk)))
    faults.set_fault("messages", "send", "unavailable")
    run = start()
    advance(run.pk)  # enqueues the message: one publish task queued on commit
    message = OutboxMessage.objects.get(run=run)
    assert sent.count(("publish_outbox", message.pk)) == 1
    assert tasks.sweep() == 0  # it is queued already

    assert publish_due() == 1  # a worker takes it: 503, a retry is due later
    clock.advance(600)
    assert tasks.sweep() >= 1
    clock.advance(5)
    tasks.sweep()
    assert sent.count(("publish_outbox", message.pk)) == 2  # once for the retry, not once per sweep

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
