"""Guards (contract rule 4: the model proposes, the application decides): checks that run after
the decision is accepted and before a step's intent is checkpointed. A refusal writes no
intent and sends nothing; the run waits in review with the rule named, and an operator fixes
the decision (supersede) or a supervisor overrides the rule. Counted at the receivers."""

import json

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command

from recovery.console.selectors import STUCK_LABELS, RunFilters, run_document
from recovery.engine.transitions import perform, run_resume, run_start
from recovery.errors import ErrorKind, InvalidTransition, NotPermitted
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState, StepState
from recovery.workflow import get_workflow
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

WRITES = {"task": 0, "message": 0, "ledger": 0}


def writes() -> dict[str, int]:
    counts = receivers.counts()
    return {kind: counts[kind] for kind in WRITES}


def user(name: str, role: str) -> User:
    person = User.objects.create_user(name, password="pw")
    person.groups.add(Group.objects.get_or_create(name=role)[0])
    return person


def propose(**decision) -> None:
    receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "alice", **decision}))


def start(order_id: str = "1"):
    return run_start(workflow="test_policy", data={"tenant": "t", "order_id": order_id})[0]


def test_a_decision_the_policy_refuses_is_stopped_before_any_write_and_names_the_rule(clock):
    propose(approver="mallory")
    run = drive(start(), clock)

    assert run.state == RunState.NEEDS_REVIEW
    assert run.status_reason == "policy refused: approver_policy: mallory may not approve 120"
    assert writes() == WRITES  # no task, message or ledger entry
    assert receivers.counts()["model_call"] == 1
    task = run.steps.get(step_name="create_task")
    assert (task.state, task.attempts, task.intent, task.request_hash) == (StepState.PENDING, 0, None, "")
    assert task.last_error_kind == ErrorKind.POLICY_REFUSED
    assert task.refusal == {
        "rule": "approver_policy",
        "message": "mallory may not approve 120",
        "values": {"proposed": "mallory", "policy": "alice", "amount": 120},
    }
    event = AuditEvent.objects.get(run=run, action="policy_refused")
    assert event.step_name == "create_task" and event.after["refusal"]["rule"] == "approver_policy"
    assert not AuditEvent.objects.filter(run=run, action="step_begin", step_name="create_task").exists()
    # Its own stuck cause, and the run's document (show_run --json) names rule and values.
    assert "policy_refused" in STUCK_LABELS
    assert list(RunFilters(stuck="policy_refused").newest(clock.now(), limit=10)) == [run]
    doc = run_document(run.workflow_id, now=clock.now())
    assert next(s for s in doc["steps"] if s["name"] == "create_task")["refusal"]["values"]["policy"] == "alice"


def test_a_decision_within_the_policy_runs_to_completion_once(clock):
    propose(amount=1500, approver="boss")
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    assert writes() == {"task": 1, "message": 1, "ledger": 1}
    assert not run.steps.filter(refusal__isnull=False).exists()


def test_every_guarded_step_is_checked_not_only_the_first(clock):
    """The workflow's guard runs before each step that acts on the decision: a refusal that
    only appears later (here: the test changes the accepted decision behind the engine's back
    between steps) still stops the step before its write."""
    propose()
    run = start()
    drive_until = run.steps.get(step_name="notify")
    assert drive_until.state == StepState.PENDING
    from recovery.engine.executor import advance

    receivers.arm("message", "unavailable")  # stops the run after create_task, before notify's write
    advance(run.pk)
    run.refresh_from_db()
    assert writes()["task"] == 1 and writes()["message"] == 0
    decide = run.steps.get(step_name="decide")
    decide.result = {**decide.result, "approver": "mallory"}
    decide.save(update_fields=["result"])
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert run.steps.get(step_name="notify").refusal["rule"] == "approver_policy"
    assert writes() == {"task": 1, "message": 0, "ledger": 0}


def test_a_guard_reading_the_current_state_refuses_what_already_happened_elsewhere(clock):
    """A fresh read through an adapter: the order is already booked in the ledger, so no
    approval task is opened for it."""
    receivers.post_entry(reference="policy:t:1", payload={"amount": 120, "category": "office"})
    propose()
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert run.status_reason.startswith("policy refused: not_yet_booked: already booked as entry-")
    assert writes() == {"task": 0, "message": 0, "ledger": 1}  # the entry that was there before


def test_a_guard_whose_read_fails_checks_again_later_and_never_writes_meanwhile(clock):
    receivers.arm("ledger_read", "unavailable")
    propose()
    run = start()
    from recovery.engine.executor import advance

    assert advance(run.pk) == RunState.WAITING
    task = run.steps.get(step_name="create_task")
    assert (task.state, task.attempts, task.reconcile_attempts) == (StepState.PENDING, 0, 1)
    assert task.last_error == "guard not_yet_booked could not check: ledger_read: 503 service unavailable"
    assert writes()["task"] == 0
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert writes() == {"task": 1, "message": 1, "ledger": 1}


def test_a_guard_whose_read_keeps_failing_goes_to_review_without_a_write(clock):
    receivers.arm("ledger_read", "unavailable", times=20)
    propose()
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert "guard not_yet_booked could not check" in run.status_reason
    assert writes() == WRITES


def test_a_supervisor_overrides_the_refused_rule_for_the_run_and_it_completes_once(clock):
    propose(approver="mallory")
    run = drive(start(), clock)
    operator, supervisor = user("olga", "operator"), user("sam", "supervisor")

    with pytest.raises(NotPermitted, match=r"olga \(operator\) may not accept the refused proposal"):
        perform("override", workflow_id=run.workflow_id, step_name="create_task", actor=operator, reason="ok")
    perform("override", workflow_id=run.workflow_id, step_name="create_task", actor=supervisor, reason="CFO said so")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    # one of each; notify and post_entry were not stopped again by the rule overridden for the run
    assert writes() == {"task": 1, "message": 1, "ledger": 1}
    task = run.steps.get(step_name="create_task")
    assert task.refusal is None and task.last_error_kind == ""
    assert [(o["rule"], o["by"], o["reason"]) for o in task.overrides] == [("approver_policy", "sam", "CFO said so")]
    event = AuditEvent.objects.get(run=run, action="policy_override")
    assert event.actor == "sam" and event.after["override"]["values"]["proposed"] == "mallory"
    with pytest.raises(InvalidTransition, match="holds no refused proposal"):
        perform("override", workflow_id=run.workflow_id, step_name="create_task", actor=supervisor, reason="again")


def test_superseding_the_decision_with_an_edited_one_completes_the_run_with_the_corrected_values(clock):
    propose(approver="mallory")
    run = drive(start(), clock)
    supervisor = user("sam", "supervisor")
    corrected = {"category": "office", "amount": 120, "approver": "alice"}

    with pytest.raises(InvalidTransition, match="does not match Decision: amount: Input should be greater"):
        perform(
            "supersede",
            workflow_id=run.workflow_id,
            step_name="decide",
            decision={**corrected, "amount": -1},
            actor=supervisor,
            reason="typo",
        )
    assert ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED).version == 1  # nothing changed
    perform(
        "supersede",
        workflow_id=run.workflow_id,
        step_name="decide",
        decision=corrected,
        actor=supervisor,
        reason="approver per policy",
    )
    accepted = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED)
    assert (accepted.version, accepted.accepted, accepted.proposal) == (2, corrected, None)
    event = AuditEvent.objects.get(run=run, action="decision_supersede")
    assert event.before["decision"]["approver"] == "mallory" and event.after["decision"]["approver"] == "alice"
    assert event.after["decision_version"] == 2
    task = run.steps.get(step_name="create_task")
    assert task.refusal is None and task.last_error_kind == ""

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert writes() == {"task": 1, "message": 1, "ledger": 1}
    assert receivers.counts()["model_call"] == 1  # the model was not asked again
    task = run.steps.get(step_name="create_task")
    assert task.intent["approver"] == "alice"


def test_a_decision_cannot_change_once_a_later_step_sent_a_request_built_from_it(clock):
    propose()
    run = drive(start(), clock)
    assert run.state == RunState.COMPLETED
    supervisor = user("sam", "supervisor")

    def supersede(run):
        decision = {"category": "office", "amount": 120, "approver": "boss"}
        perform(
            "supersede",
            workflow_id=run.workflow_id,
            step_name="decide",
            decision=decision,
            actor=supervisor,
            reason="x",
        )

    with pytest.raises(InvalidTransition, match="finished run|stopped run"):
        supersede(run)
    receivers.arm("message", "forbidden")  # a run that stops after create_task sent its request
    propose()
    run = drive(start("2"), clock)
    assert run.state == RunState.FAILED
    events = AuditEvent.objects.filter(run=run).count()
    with pytest.raises(InvalidTransition, match="create_task already sent a request built from this decision"):
        supersede(run)
    assert AuditEvent.objects.filter(run=run).count() == events
    assert ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED).version == 1


def test_resume_runs_the_guards_again(clock):
    """A refusal of the current state (already booked) lifts when the state changes; resume
    checks again and records the refusal anew if it still holds."""
    receivers.post_entry(reference="policy:t:1", payload={"amount": 120, "category": "office"})
    propose()
    run = drive(start(), clock)
    assert run.steps.get(step_name="create_task").refusal["rule"] == "not_yet_booked"
    run_resume(workflow_id=run.workflow_id, actor=None, reason="look again")
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW  # still booked: refused again, still nothing sent
    assert AuditEvent.objects.filter(run=run, action="policy_refused").count() == 2
    assert writes()["task"] == 0


def test_the_contract_lists_each_steps_guards_and_check_warns_about_an_unguarded_decision():
    rows = {row["step"]: row["guards"] for row in get_workflow("test_policy").contract()}
    assert rows == {
        "read": "",
        "decide": "",
        "create_task": "approver_policy, not_yet_booked",
        "notify": "approver_policy",
        "post_entry": "approver_policy",
    }
    from recovery.checks import check_recovery_contracts

    warned = {e.msg.split(" ")[0] for e in check_recovery_contracts() if e.id == "recovery.W001"}
    assert {"test_orders.create_task", "test_orders.notify", "test_orders.post_entry"} <= warned
    assert not any(w.startswith(("test_policy.", "invoice.")) for w in warned)


def test_show_run_names_the_rule_and_its_values(clock, capsys):
    propose(approver="mallory")
    run = drive(start(), clock)
    call_command("show_run", run.workflow_id)
    out = capsys.readouterr().out
    assert "policy refused: approver_policy: mallory may not approve 120" in out
    # Sorted: jsonb keeps no key order.
    assert "refused by approver_policy: amount=120, policy=alice, proposed=mallory" in out
