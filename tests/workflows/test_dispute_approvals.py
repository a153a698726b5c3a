"""A credit note above DISPUTE_CREDIT_APPROVAL_ABOVE waits for a supervisor (issue 38): nothing in
the ledger until a person approves, edits, rejects or answers it — each audited with who and why —
and the run goes on from the decision, over real HTTP to the simulated ledger and messenger."""

import json
from datetime import timedelta
from decimal import Decimal

import pytest

from recovery.engine import failpoints
from recovery.engine.transitions import already_decided, perform, run_start
from recovery.errors import InvalidTransition, NotPermitted
from recovery.models import AuditEvent, RunState, StepState
from recovery.waiting import OnTimeout, ToolApproval
from sandbox import faults
from sandbox.models import LedgerEntry, LedgerKind, Message
from tests.support.engine import assert_invariants, doomed_worker, drive, person
from workflows.dispute import agent as dispute_agent
from workflows.dispute.workflow import above_approval_limit, issue_credit_note
from workflows.integrations import adapters

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

CALL = "resolve_dispute:2:0:issue_credit_note"
HOURS = timedelta(hours=2)
EVENT = {
    "tenant": "tenant-42",
    "dispute_id": "d-7",
    "invoice_id": "inv-1847",
    "customer": "buyer@acme.example",
    "complaint": "Your invoice inv-1847 overcharged us by 600.00 EUR: the desks were on offer.",
}


@pytest.fixture(autouse=True)
def sandbox(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    settings.DISPUTE_CREDIT_APPROVAL_ABOVE = "500.00"
    faults.clear()
    adapters.post_entry(
        reference="invoice:tenant-42:inv-1847",
        amount="1840.00",
        currency="EUR",
        account="expenses:office_supplies",
        memo="invoice inv-1847",
    )
    yield live_server.url
    faults.clear()


@pytest.fixture
def asked(monkeypatch):
    """The conversation each turn of the offline agent was asked with."""
    seen: list[list[dict]] = []
    real = dispute_agent.RulesAgent.chat

    def recorded(self, **kwargs):
        seen.append(kwargs["messages"])
        return real(self, **kwargs)

    monkeypatch.setattr(dispute_agent.RulesAgent, "chat", recorded)
    return seen


def held(clock, **changes):
    """A dispute run driven until its credit note waits for a person."""
    run = drive(run_start(workflow="dispute", data={**EVENT, **changes})[0], clock)
    assert run.state == RunState.WAITING
    return run


def credit_notes() -> list[LedgerEntry]:
    return list(LedgerEntry.objects.using("sandbox").filter(kind=LedgerKind.ENTRY, amount__lt=0))


def decide(run, action, who="sam", reason="checked the delivery note", **more):
    actor = who if not isinstance(who, str) else person(who)
    return perform(action, workflow_id=run.workflow_id, step_name=CALL, actor=actor, reason=reason, **more)


def test_a_credit_note_above_the_limit_waits_for_a_supervisor_and_nothing_is_posted(clock):
    run = held(clock)

    call = run.steps.get(step_name=CALL)
    assert call.state == StepState.WAITING and call.attempts == 0 and call.intent["amount"] == "600.00"
    assert call.approval["role"] == "supervisor" and "decision" not in call.approval
    assert "waiting for a supervisor's approval until" in run.status_reason
    assert run.lease_owner == "" and run.next_wake_at == call.next_attempt_at
    assert credit_notes() == [] and Message.objects.using("sandbox").count() == 0
    assert AuditEvent.objects.filter(run=run, action="call_held").count() == 1


def test_approved_the_credit_note_is_posted_once_and_the_run_completes(clock):
    run = held(clock)
    decide(run, "approve_call")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    [note] = credit_notes()
    assert note.amount == Decimal("-600.00")
    call = run.steps.get(step_name=CALL)
    assert call.approval["decision"] == "approve" and call.approval["by"] == "sam"
    event = AuditEvent.objects.get(run=run, action="approve_call")
    assert event.reason == "checked the delivery note" and event.step_name == CALL
    assert Message.objects.using("sandbox").count() == 1
    assert_invariants()


def test_edited_to_a_lower_amount_one_credit_note_of_that_amount_and_the_change_in_the_audit(clock, asked):
    run = held(clock)
    decide(run, "edit_call", decision={"invoice_id": "inv-1847", "amount": "450.00", "reason": "overcharged"})
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    [note] = credit_notes()
    assert note.amount == Decimal("-450.00")
    event = AuditEvent.objects.get(run=run, action="edit_call")
    assert event.after["changes"] == {"amount": {"from": "600.00", "to": "450.00"}}
    assert run.steps.get(step_name="resolve_dispute").result["credit"] == "450.00"
    assert "450.00 EUR" in Message.objects.using("sandbox").get().text
    assert_invariants()


def test_rejected_with_a_message_nothing_is_posted_the_model_reads_it_and_the_run_completes(clock, asked):
    run = held(clock)
    decide(run, "reject_call", reason="the desks were not on offer that week")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert credit_notes() == []
    answered = [m for m in asked[-2] if m["role"] == "tool"][-1]
    assert json.loads(answered["content"]) == {"error": "rejected by sam: the desks were not on offer that week"}
    assert run.steps.get(step_name=CALL).state == StepState.SKIPPED
    assert run.steps.get(step_name="resolve_dispute").result["outcome"] == "escalated"
    assert Message.objects.using("sandbox").count() == 1
    assert_invariants()


def test_answered_in_the_tools_place_the_tool_is_not_called_and_the_model_reads_the_answer(clock, asked):
    run = held(clock)
    decide(run, "answer_call", decision={"entry_id": "manual-17", "amount": "-600.00"}, reason="posted by hand")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert credit_notes() == []
    answered = [m for m in asked[-2] if m["role"] == "tool"][-1]
    assert json.loads(answered["content"])["result"] == {"entry_id": "manual-17", "amount": "-600.00"}


def test_an_edit_the_guards_refuse_is_answered_to_the_model_and_nothing_is_posted(clock):
    run = held(clock)
    decide(run, "edit_call", decision={"invoice_id": "inv-1847", "amount": "1500.00", "reason": "all of it"})
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert credit_notes() == []
    assert run.steps.get(step_name=CALL).refusal["rule"] == "credit_limit"


def test_bad_decisions_are_refused_and_change_nothing(clock):
    run = held(clock)
    before = run.steps.get(step_name=CALL)
    with pytest.raises(InvalidTransition, match="arguments refused by CreditNote"):
        decide(run, "edit_call", decision={"invoice_id": "inv-1847", "amount": "lots", "reason": "x"})
    with pytest.raises(InvalidTransition, match="approve it instead"):
        decide(run, "edit_call", who="sue", decision=dict(before.intent))
    with pytest.raises(NotPermitted, match="it waits for a supervisor"):
        decide(run, "approve_call", who=person("olga", "operator"))
    with pytest.raises(InvalidTransition, match="has no step"):
        perform("approve_call", workflow_id=run.workflow_id, step_name="nope", actor=person("ann"), reason="x")
    after = run.steps.get(step_name=CALL)
    assert (after.state, after.intent, after.approval) == (before.state, before.intent, before.approval)
    assert not AuditEvent.objects.filter(run=run, action__endswith="_call").exists()

    decide(run, "approve_call", who="tom", key="chat:42")
    with pytest.raises(InvalidTransition, match="was decided already: approve by tom"):
        decide(run, "reject_call", who="una", key="chat:43")
    assert already_decided(run, CALL, "approve_call", "chat:42")
    assert not already_decided(run, CALL, "reject_call", "chat:42")
    assert AuditEvent.objects.filter(run=run, action__endswith="_call").count() == 1
    assert drive(run, clock).state == RunState.COMPLETED and len(credit_notes()) == 1


def test_no_decision_by_the_deadline_goes_to_review_and_the_call_can_still_be_decided(clock):
    run = held(clock)
    clock.advance(timedelta(days=3, seconds=1).total_seconds())
    run = drive(run, clock)

    assert run.state == RunState.NEEDS_REVIEW and "no decision by a supervisor by the deadline" in run.status_reason
    assert run.steps.get(step_name=CALL).state == StepState.FAILED and credit_notes() == []
    decide(run, "approve_call")
    assert drive(run, clock).state == RunState.COMPLETED and len(credit_notes()) == 1


def test_a_tool_that_escalates_waits_for_the_other_role_then_goes_to_review(clock, monkeypatch):
    escalating = ToolApproval(
        above_approval_limit,
        role="operator",
        timeout=timedelta(hours=4),
        on_timeout=OnTimeout.escalate("supervisor", timeout=timedelta(days=1)),
    )
    monkeypatch.setattr(issue_credit_note, "approval", escalating)
    run = held(clock)
    assert run.steps.get(step_name=CALL).approval["role"] == "operator"

    clock.advance(timedelta(hours=4, seconds=1).total_seconds())
    run = drive(run, clock)
    assert run.state == RunState.WAITING and "supervisor's approval (escalated)" in run.status_reason
    with pytest.raises(NotPermitted):
        decide(run, "approve_call", who=person("olga", "operator"))
    assert AuditEvent.objects.filter(run=run, action="approval_escalated").count() == 1

    clock.advance(timedelta(days=1, seconds=1).total_seconds())
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW and credit_notes() == []


@pytest.mark.parametrize(
    "killed_at",
    [(CALL, "before_intent"), (CALL, "before_call"), (CALL, "after_call"), (CALL, "after_outcome")],
)
def test_kills_around_the_approved_call_leave_one_credit_note(clock, monkeypatch, killed_at):
    run = held(clock)
    decide(run, "approve_call")

    def killed(name, at):
        if (name, at) == killed_at:
            raise failpoints.FailpointRaised(f"killed at {name}:{at}")

    monkeypatch.setattr(failpoints, "hit", killed)
    doomed_worker(run, clock)
    monkeypatch.setattr(failpoints, "hit", lambda name, at: None)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert len(credit_notes()) == 1 and Message.objects.using("sandbox").count() == 1
    assert AuditEvent.objects.filter(run=run, action="approve_call").count() == 1
    assert_invariants()


def test_a_credit_note_under_the_limit_goes_straight_through(clock):
    run = drive(run_start(workflow="dispute", data={**EVENT, "complaint": "overcharged by 120.00"})[0], clock)
    assert run.state == RunState.COMPLETED and len(credit_notes()) == 1
    assert run.steps.get(step_name="resolve_dispute:2:0:issue_credit_note").approval is None


def test_a_held_credit_note_past_its_deadline_is_stuck_waiting_for_approval(clock, monkeypatch):
    from recovery import counts
    from recovery.models import WorkflowRun

    def approval_stuck() -> list[str]:
        cause = counts.stuck_causes(clock.now())["approval"][1]
        return list(WorkflowRun.objects.filter(cause).values_list("workflow_id", flat=True))

    escalating = ToolApproval(
        above_approval_limit, timeout=timedelta(hours=4), on_timeout=OnTimeout.escalate("supervisor", timeout=HOURS)
    )
    monkeypatch.setattr(issue_credit_note, "approval", escalating)
    run = held(clock)
    assert approval_stuck() == []  # within its deadline: waiting as declared, nothing wrong
    clock.advance(timedelta(hours=4, seconds=1).total_seconds())
    run = drive(run, clock)
    assert approval_stuck() == [run.workflow_id]  # escalated: overdue
    clock.advance(HOURS.total_seconds() + 1)
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW and approval_stuck() == [run.workflow_id]  # nobody decided
    decide(run, "approve_call")
    assert approval_stuck() == []
