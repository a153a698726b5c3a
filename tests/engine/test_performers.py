"""Operator actions as one table and one body each (issue 36): every row of recovery.actions has
the transition that performs it (``@performs``, not a name looked up with getattr); a new action
is a row and a body, offered, performed and audited by the console and ``manage.py recover`` with
nothing else written; a four-eyes request is checked without performing its action; every audit
event carries a name of one vocabulary (recovery.states.AuditAction), labelled from it."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.urls import reverse

from recovery import actions
from recovery.actions import ACTIONS, OperatorAction, audit_label, audited
from recovery.engine.audit import export
from recovery.engine.transitions import approval_request, offers, perform, performers, run_start
from recovery.engine.transitions._core import _actor_fields, _audit_row, _snap
from recovery.engine.transitions.acting import operator_transition
from recovery.errors import InvalidTransition
from recovery.models import ApprovalRequest, AuditEvent, RunState, StepExecution
from recovery.states import TERMINAL_RUN_STATES, AuditAction
from tests.support import receivers
from tests.support.console import act, failed_run, login
from tests.support.engine import drive, person

pytestmark = pytest.mark.django_db


def test_every_action_of_the_table_has_the_one_transition_that_performs_it():
    assert set(performers.PERFORMERS) == set(ACTIONS)
    happened, absent = performers.PERFORMERS["resolve_happened"], performers.PERFORMERS["resolve_absent"]
    assert happened.transition is absent.transition  # one body, two rows: its fixed arguments differ
    assert (happened.options, absent.options) == ({"happened": True}, {"happened": False})
    assert all(not hasattr(action, "transition") for action in ACTIONS.values())  # no name to getattr


def test_a_row_without_a_body_and_a_body_without_a_row_fail_at_start(monkeypatch):
    monkeypatch.setitem(ACTIONS, "pause_workflow", OperatorAction("pause_workflow", "pause a workflow", "resume"))
    with pytest.raises(ImproperlyConfigured, match="no transition performs pause_workflow"):
        performers.check_complete()
    with pytest.raises(ImproperlyConfigured, match="'unpause_all'.*which recovery.actions lacks"):
        performers.performs("unpause_all", offered=offers.resumable)(lambda **arguments: None)
    with pytest.raises(ImproperlyConfigured, match="performed by run_resume already"):
        performers.performs("resume", offered=offers.resumable)(lambda **arguments: None)
    with pytest.raises(InvalidTransition, match="unknown action 'unpause_all'"):
        perform("unpause_all", workflow_id="w", actor=None, reason="r")


# --- the worked example of docs/architecture.md: a new action is one row and one body -----

NOTE = OperatorAction(
    "note",
    "add a note",
    "resume",  # an operator may
    does="records a note on the run for the next person; nothing else changes",
    sends="nothing",
    button="Add a note",
)


def _noted(situation, step_name, actor) -> str:
    run = situation.run
    return f"run {run.workflow_id} is {run.state}: its trail is closed" if run.state in TERMINAL_RUN_STATES else ""


@pytest.fixture
def note(monkeypatch):
    """The row and the body, registered for this test only."""
    monkeypatch.setitem(ACTIONS, "note", NOTE)
    monkeypatch.setitem(actions.PERMISSION_OF, "note", NOTE.permission)
    monkeypatch.setattr(performers, "PERFORMERS", dict(performers.PERFORMERS))

    @operator_transition("note", offered=_noted)
    def run_note(act):
        act.extra["note"] = act.reason

    return run_note


def test_a_new_action_is_offered_performed_and_audited_by_the_console_from_its_row_and_body(clock, note):
    run = failed_run(clock)
    operator = login("operator")
    page = operator.get(reverse("console:run", args=[run.workflow_id])).text
    assert 'data-action="note"' in page and "Add a note" in page and NOTE.does in page

    refused = act(operator, run, "note", reason="  ")
    assert refused.status_code == 400 and "reason is required" in refused.text
    stale = act(operator, run, "note", reason="late", version="stale")
    assert stale.status_code == 409
    assert not AuditEvent.objects.filter(action="note").exists()

    done = act(operator, run, "note", reason="the tracker team rotates its token at 10:00")
    assert done.status_code == 200
    event = AuditEvent.objects.get(run=run, action="note")
    assert (event.actor, event.after["note"]) == ("u-operator", "the tracker team rotates its token at 10:00")
    assert (event.before, event.after) == ({"run": "failed"}, {"run": "failed", "note": event.reason})
    assert audit_label("note") == "add a note"
    assert "add a note" in operator.get(reverse("console:run", args=[run.workflow_id])).text  # the trail's label

    viewer = act(login("viewer"), run, "note", reason="me too")
    assert viewer.status_code == 403 and AuditEvent.objects.filter(action="note").count() == 1


def test_a_new_action_runs_from_manage_py_and_is_refused_where_its_rule_says_no(clock, note):
    person("olga", "operator")
    run = failed_run(clock)
    call_command(
        "recover", "note", run.workflow_id, "--reason", "paged the ledger team", "--as", "olga", stdout=StringIO()
    )
    assert AuditEvent.objects.filter(run=run, action="note", actor="olga").count() == 1

    done = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "done"})[0], clock)
    assert done.state == RunState.COMPLETED
    situation = offers.Situation.of(done, done.steps.all(), clock.now())
    assert ("note", None) not in offers.offered(situation, person("sam", "supervisor"))
    with pytest.raises(CommandError, match="its trail is closed"):
        call_command("recover", "note", done.workflow_id, "--reason", "r", "--as", "olga", stderr=StringIO())
    assert not AuditEvent.objects.filter(run=done, action="note").exists()


# --- four-eyes: a request is checked, never performed and rolled back ---------------------


def test_a_four_eyes_request_checks_the_offer_and_its_arguments_without_performing_the_action(clock, monkeypatch):
    receivers.arm("task", "forbidden")
    run = drive(run_start(workflow="test_guarded", data={"tenant": "t", "order_id": "g-1"})[0], clock)
    alice = person("alice")
    terminate = performers.PERFORMERS["terminate"]

    def performed(**arguments):
        raise AssertionError("a request performed the action")

    monkeypatch.setitem(
        performers.PERFORMERS, "terminate", performers.Performer("terminate", performed, terminate.offered)
    )
    made = approval_request(workflow_id=run.workflow_id, action="terminate", actor=alice, reason="stop it")
    assert made.state == "pending" and ApprovalRequest.objects.count() == 1
    run.refresh_from_db()
    assert run.state == RunState.FAILED

    with pytest.raises(InvalidTransition, match="no completed step with a compensation"):
        approval_request(workflow_id=run.workflow_id, action="compensate", actor=alice, reason="undo")
    assert ApprovalRequest.objects.count() == 1


# --- one vocabulary of audit actions -----------------------------------------------------


def test_an_audit_event_of_a_name_outside_the_vocabulary_is_refused_before_it_is_written(clock):
    run = failed_run(clock)
    count = AuditEvent.objects.count()
    with pytest.raises(ValueError, match="'step_failed' is no audit action"):
        _audit_row(run, "step_failed", _actor_fields(None), "", "", {}, _snap(run), clock.now())
    assert AuditEvent.objects.count() == count
    assert all(audited(name) for name in AuditEvent.objects.values_list("action", flat=True))


def test_labels_come_from_the_vocabulary_and_the_action_table():
    assert audit_label(AuditAction.STEP_FAIL) == "attempt failed"
    assert audit_label("decision_supersede") == "decision replaced"
    assert audit_label("resolve_absent") == "mark not happened"  # an operator action's own label
    assert audit_label("retired_name") == "retired name"  # a name an old trail may hold, in words
    assert len(set(AuditAction.values)) == len(AuditAction.values)
    assert not set(AuditAction.values) & set(ACTIONS)  # an action audited under its own name is not listed twice


def test_the_audit_export_refuses_an_action_that_no_event_can_carry(clock):
    with pytest.raises(ValueError, match="no audit action 'step_failed'"):
        export.parse_filters({"action": "step_failed"})
    assert export.parse_filters({"action": "step_fail"}).action == "step_fail"
    assert export.parse_filters({"action": "retry"}).action == "retry"
    assert StepExecution.objects.count() == 0
