"""The invoice workflow, v3, waits for its approver (issue 38): an invoice above
INVOICE_APPROVAL_WAIT_ABOVE makes its approval task and notifies the approver, asks the tracker to
call the run back, and waits — holding no worker — for the approver's decision in the tracker. An
approval posts one ledger entry; a rejection posts nothing and stops the run for review, naming
who rejected it; an approver faster than the workflow is not lost. An invoice at or below the
limit goes straight through. Over real HTTP: a live server holds the tracker and the event API."""

from __future__ import annotations

from decimal import Decimal

import httpx
import pytest

from recovery.engine import failpoints
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunEvent, RunState, StepState
from sandbox import faults
from sandbox.models import LedgerEntry, LedgerKind, Message, Task
from tests.support import receivers
from tests.support.engine import assert_invariants, doomed_worker, drive

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

EVENT = {"tenant": "tenant-42", "invoice_id": "inv-1847", "text": "40 ergonomic chairs. Total due EUR 1,840.00"}


@pytest.fixture(autouse=True)
def live(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    settings.RECOVERY_CONSOLE_URL = live_server.url
    settings.INVOICE_APPROVAL_WAIT_ABOVE = "1000.00"
    faults.clear()
    yield live_server
    faults.clear()


def decide(live, task: str, decision: str, by: str = "cfo@example.com", note: str = "") -> httpx.Response:
    return receivers.decide_in_tracker(task, decision, by=by, note=note)


def entries() -> list[LedgerEntry]:
    return list(LedgerEntry.objects.using("sandbox").filter(kind=LedgerKind.ENTRY))


def waiting(clock, **changes):
    run = drive(run_start(workflow="invoice", data={**EVENT, **changes})[0], clock)
    assert run.state == RunState.WAITING, run.status_reason
    assert run.workflow_version == 3
    return run


def test_an_invoice_above_the_limit_waits_for_its_approver_and_the_trackers_callback_completes_it(live, clock):
    run = waiting(clock)
    task = run.steps.get(step_name="create_approval_task").remote_ref
    assert Task.objects.using("sandbox").get().callback_url == f"{live.url}/api/runs/{run.workflow_id}/events"
    assert "approver_decision: waiting for event 'task_decided' until" in run.status_reason
    assert entries() == [] and Message.objects.using("sandbox").count() == 1  # the approver was told

    assert decide(live, task, "approve").json()["callback_status"] == "201"
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    [entry] = entries()
    assert entry.amount == Decimal("1840.00")
    assert run.steps.get(step_name="approver_decision").result["decision"] == "approved"
    assert AuditEvent.objects.filter(run=run, action="event_applied").count() == 1
    assert_invariants()


def test_a_rejected_invoice_posts_nothing_and_stops_for_review_naming_who_rejected_it(live, clock):
    run = waiting(clock)
    task = run.steps.get(step_name="create_approval_task").remote_ref
    decide(live, task, "reject", note="not ours")
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW and entries() == []
    posting = run.steps.get(step_name="post_ledger_entry")
    assert posting.refusal["rule"] == "approved_by_approver"
    assert f"task {task} was rejected by cfo@example.com: not ours" in run.status_reason


def test_an_approver_faster_than_the_workflow_is_not_lost(live, clock, monkeypatch):
    """The approver decides while the worker that made the task is dead (before it asked for the
    callback): asked later, the tracker calls back at once; the event is kept for the wait."""
    run = run_start(workflow="invoice", data=EVENT)[0]

    def killed(name, at):
        if (name, at) == ("watch_approval_task", "before_call"):
            raise failpoints.FailpointRaised("killed before asking for the callback")

    monkeypatch.setattr(failpoints, "hit", killed)
    doomed_worker(run, clock)
    monkeypatch.setattr(failpoints, "hit", lambda name, at: None)
    task = Task.objects.using("sandbox").get()
    assert decide(live, task.public_id, "approve").json()["callback_status"] == ""  # nobody to call back yet

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and len(entries()) == 1
    assert RunEvent.objects.get(run=run).step_name == ""  # kept before the wait was reached, then applied


def test_an_invoice_at_or_below_the_limit_goes_straight_through(live, clock):
    run = drive(run_start(workflow="invoice", data={**EVENT, "text": "toner. Total due EUR 95.00"})[0], clock)
    assert run.state == RunState.COMPLETED and len(entries()) == 1
    skipped = run.steps.get(step_name="approver_decision")
    assert skipped.state == StepState.SUCCEEDED and skipped.result == {"decision": "not needed"}
    assert AuditEvent.objects.get(run=run, action="wait_skipped").reason.startswith(
        "not needed for this run (it waits only above INVOICE_APPROVAL_WAIT_ABOVE)"
    )
    assert Task.objects.using("sandbox").get().callback_url == ""
