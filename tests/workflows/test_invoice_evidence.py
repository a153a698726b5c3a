"""The invoice workflow, over real HTTP to the simulated systems: the task service commits the
approval task and the answer is lost, and its look-up by key stays down, so the run waits for an
operator with ``create_approval_task`` unknown. The operator's "it succeeded, task X" is checked at
the tracker (GET /sandbox/tasks/X): another run's task, or an id it does not have, is refused and
nothing is recorded; the real one records the tracker's own answer and the run completes with one
task, one message and one ledger entry."""

import re

import pytest
from django.core.management import CommandError, call_command

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import InvalidTransition
from recovery.models import AuditEvent, RunState, StepExecution, StepState
from sandbox import faults
from sandbox.models import LedgerEntry, Task
from tests.support.engine import crash_at, drive, person, resolve_happened, unfolded

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

TEXT = "ACME Office Supply — 40 ergonomic chairs and 10 desks. Total due: EUR 1,840.00"
ONE_OF_EACH = {"tasks": 1, "messages": 1, "ledger_entries": 1, "tasks_cancelled": 0, "corrections": 0}


@pytest.fixture(autouse=True)
def sandbox(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    faults.clear()
    yield
    faults.clear()


def start(tenant: str, invoice_id: str):
    return run_start(workflow="invoice", data={"tenant": tenant, "invoice_id": invoice_id, "text": TEXT})[0]


def unknown_task_run(clock, monkeypatch, invoice_id="INV-77"):
    """As the issue reproduced it: the task committed, its answer lost, the tracker's search (the
    look-up by key) down — from just before the task is created (v2's duplicate check searches too)."""
    unfolded(monkeypatch)  # the faults are armed between the duplicate check's search and the task's call
    run = start("acme", invoice_id)
    crash_at(monkeypatch, "create_approval_task:before_intent", lambda: advance(run.pk))
    faults.set_fault("tasks", "create", "commit_then_drop")
    faults.set_fault("tasks", "find", "unavailable", times=12)
    run = drive(run, clock)
    task = StepExecution.objects.get(run=run, step_name="create_approval_task")
    assert (run.state, task.state) == (RunState.NEEDS_REVIEW, StepState.UNKNOWN)
    return run


def own_task(run) -> str:
    key = StepExecution.objects.get(run=run, step_name="create_approval_task").idempotency_key
    return Task.objects.using("sandbox").get(idempotency_key=key).public_id


def counts() -> dict[str, int]:
    every = faults.counts()
    return {k: every[k] for k in ONE_OF_EACH}


def test_the_real_task_id_records_the_trackers_answer_and_the_run_completes_once(clock, monkeypatch):
    run = unknown_task_run(clock, monkeypatch)
    task_id = own_task(run)

    resolve_happened(
        workflow_id=run.workflow_id,
        step_name="create_approval_task",
        actor=person("sue"),
        reason="found it in the tracker",
        remote_ref=task_id,
    )
    step = StepExecution.objects.get(run=run, step_name="create_approval_task")
    # the adapter's own result: the next step reads task_id from it (it failed with KeyError before)
    assert (step.state, step.remote_ref, step.result) == (
        StepState.SUCCEEDED,
        task_id,
        {"task_id": task_id, "status": "open"},
    )
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert counts() == ONE_OF_EACH
    notify = StepExecution.objects.get(run=run, step_name="notify_approver")
    assert f"task {task_id}" in notify.intent["text"]


def test_another_tenants_task_or_a_made_up_id_is_refused_at_the_tracker_and_nothing_recorded(clock, monkeypatch):
    other = drive(start("globex", "GX-1"), clock)  # completes: its task, message and ledger entry exist
    assert other.state == RunState.COMPLETED
    theirs, their_entry = own_task(other), LedgerEntry.objects.using("sandbox").get(reference=other.workflow_id)
    run = unknown_task_run(clock, monkeypatch)
    before = list(AuditEvent.objects.filter(run=run).values_list("pk", flat=True))
    sue = person("sue")

    for ref, said in [
        (theirs, f"{theirs} is not create_approval_task's object: {theirs} was made by another request"),
        ("no such thing!!", "the receiver has no no such thing"),
        ("task_999999", "the receiver has no task_999999"),
        (their_entry.public_id, f"the receiver has no {their_entry.public_id}"),  # not a task at all
    ]:
        with pytest.raises(InvalidTransition, match=said):
            resolve_happened(
                workflow_id=run.workflow_id, step_name="create_approval_task", actor=sue, reason="r", remote_ref=ref
            )
        step = StepExecution.objects.get(run=run, step_name="create_approval_task")
        assert (step.state, step.remote_ref, step.result) == (StepState.UNKNOWN, "", None)
        assert list(AuditEvent.objects.filter(run=run).values_list("pk", flat=True)) == before

    # the same from the shell: one line on stderr, a non-zero exit, nothing changed
    with pytest.raises(CommandError, match=f"{theirs} is not create_approval_task's object"):
        call_command(
            "recover",
            "resolve_happened",
            run.workflow_id,
            "--step",
            "create_approval_task",
            "--remote-ref",
            theirs,
            "--reason",
            "r",
            "--as",
            "sue",
        )
    assert list(AuditEvent.objects.filter(run=run).values_list("pk", flat=True)) == before


def test_another_runs_ledger_entry_is_not_this_runs_posting(clock, monkeypatch):
    """The guide's incident: a typed entry id was stored unchecked and the compensation reversed
    another tenant's entry. Now the ledger is asked, and the entry must carry this run's reference."""
    other = drive(start("globex", "GX-2"), clock)
    theirs = LedgerEntry.objects.using("sandbox").get(reference=other.workflow_id).public_id
    run = start("acme", "INV-78")  # the ledger's search goes down once its entry is about to be posted
    crash_at(monkeypatch, "post_ledger_entry:before_intent", lambda: advance(run.pk))
    faults.set_fault("ledger", "post", "commit_then_drop")
    faults.set_fault("ledger", "find", "unavailable", times=12)
    run = drive(run, clock)
    assert run.steps.get(step_name="post_ledger_entry").state == StepState.UNKNOWN
    said = re.escape(f"{theirs} was made by another request (its reference is 'invoice:globex:GX-2', not this step's)")
    with pytest.raises(InvalidTransition, match=said):
        resolve_happened(
            workflow_id=run.workflow_id,
            step_name="post_ledger_entry",
            actor=person("sue"),
            reason="r",
            remote_ref=theirs,
        )
    mine = LedgerEntry.objects.using("sandbox").get(reference=run.workflow_id).public_id
    resolve_happened(
        workflow_id=run.workflow_id, step_name="post_ledger_entry", actor=person("olga"), reason="r", remote_ref=mine
    )
    assert drive(run, clock).state == RunState.COMPLETED
    assert LedgerEntry.objects.using("sandbox").count() == 2  # one per run, nothing reversed


def test_the_tracker_unreachable_by_id_refuses_the_evidence_until_it_answers(clock, monkeypatch):
    run = unknown_task_run(clock, monkeypatch)
    task_id = own_task(run)
    faults.set_fault("tasks", "get", "unavailable")
    with pytest.raises(InvalidTransition, match="the receiver could not be asked for .*HTTP 503"):
        resolve_happened(
            workflow_id=run.workflow_id,
            step_name="create_approval_task",
            actor=person("sue"),
            reason="r",
            remote_ref=task_id,
        )
    assert StepExecution.objects.get(run=run, step_name="create_approval_task").state == StepState.UNKNOWN
