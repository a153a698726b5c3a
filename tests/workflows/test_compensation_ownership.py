"""A compensation acts only on the run's own object (issue 34, item 8; SPEC rule 10). Before the
executor sends a compensation it asks the step's own look-up by the receiver's id
(``@lookup_ref``) about the object it is about to reverse. A run recorded before evidence was
checked may hold another tenant's ledger entry id (written here directly, as such a row is): the
supervisor's compensation — from the console or ``manage.py recover`` — reverses nothing, the run
is not ``compensated`` and says why. A ledger that cannot be asked sends nothing either: the
compensation is retried, and once the ledger answers the run's own entry is reversed once.

Over real HTTP to the simulated systems, with the fixtures of test_invoice_evidence."""

from io import StringIO

import pytest
from django.core.management import call_command

from recovery import clock as engine_clock
from recovery.engine.executor import advance
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from recovery.why import why_not_moving
from sandbox import faults
from sandbox.models import LedgerEntry
from tests.support.console import act, login
from tests.support.engine import drive, person
from tests.workflows.test_invoice_evidence import sandbox, start  # noqa: F401 - the live sandbox fixture
from workflows.invoice import workflow as invoice_module

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])


def ledger(run: WorkflowRun) -> dict[str, int]:
    """One run's entries and reversals in the sandbox's ledger (its reference, and the
    reversal's ``<reference>:reversal``)."""
    every = faults.counts(keys=[], reference_prefix=run.workflow_id)
    return {k: every[k] for k in ("ledger_entries", "ledger_reversals")}


POSTED = {"ledger_entries": 1, "ledger_reversals": 0}
REVERSED = {"ledger_entries": 1, "ledger_reversals": 1}


def two_tenants(clock) -> tuple[WorkflowRun, WorkflowRun, str]:
    """Two completed invoices of two tenants; acme's ledger step then holds globex's entry id, as
    a row recorded by "it succeeded, entry X" before evidence was checked does."""
    theirs = drive(start("globex", "GX-1"), clock)
    mine = drive(start("acme", "INV-1"), clock)
    assert (theirs.state, mine.state) == (RunState.COMPLETED, RunState.COMPLETED)
    entry = LedgerEntry.objects.using("sandbox").get(reference=theirs.workflow_id)
    StepExecution.objects.filter(run=mine, step_name="post_ledger_entry").update(
        remote_ref=entry.public_id,
        result={"entry_id": entry.public_id, "reference": theirs.workflow_id, "amount": str(entry.amount)},
    )
    return theirs, mine, entry.public_id


def recover_compensate(run, who: str, *, reason: str = "duplicate", step: str | None = "post_ledger_entry") -> None:
    """``manage.py recover compensate`` as ``who`` (the step's alone unless ``step`` is None)."""
    where = ["--step", step] if step else []
    call_command("recover", "compensate", run.workflow_id, *where, "--reason", reason, "--as", person(who).username,
                 stdout=StringIO())  # fmt: skip


def test_a_supervisors_compensation_never_reverses_another_tenants_entry_named_by_the_run(clock):
    theirs, mine, foreign = two_tenants(clock)
    sam = login("supervisor")

    assert act(sam, mine, "compensate", reason="duplicate invoice").status_code == 200
    mine = drive(mine, clock)

    # nothing reversed, for either tenant: their entry stands, and so does ours (visibly)
    assert ledger(theirs) == POSTED and ledger(mine) == POSTED
    assert not LedgerEntry.objects.using("sandbox").filter(reverses__isnull=False).exists()
    assert faults.counts()["tasks_cancelled"] == 0 and faults.counts()["corrections"] == 0  # stopped at the first
    step = mine.steps.get(step_name="post_ledger_entry")
    assert (mine.state, step.state) == (RunState.COMPENSATION_FAILED, StepState.COMPENSATION_FAILED)
    assert step.compensation_attempts == 0 and step.compensation_sent_at is None and step.compensation_ref == ""
    said = f"{foreign} is not post_ledger_entry's object: {foreign} was made by another request"
    assert said in mine.status_reason and "not sent" in mine.status_reason
    assert said in why_not_moving(mine, list(mine.steps.all()), now=engine_clock.now())
    refused = AuditEvent.objects.get(run=mine, action="compensation_refused")
    assert refused.step_name == "post_ledger_entry" and said in refused.reason
    assert not AuditEvent.objects.filter(run=mine, action__in=["compensation_begin", "compensation_done"]).exists()

    # again from the shell, for that one step: refused again, still nothing reversed
    recover_compensate(mine, "sue", reason="try again")
    mine = drive(mine, clock)
    assert mine.state == RunState.COMPENSATION_FAILED
    assert ledger(theirs) == POSTED and ledger(mine) == POSTED
    assert AuditEvent.objects.filter(run=mine, action="compensation_refused").count() == 2


def test_the_runs_own_entry_is_confirmed_and_reversed_exactly_once(clock):
    theirs = drive(start("globex", "GX-1"), clock)
    mine = drive(start("acme", "INV-1"), clock)
    recover_compensate(mine, "sam", step=None)
    mine = drive(mine, clock)
    assert mine.state == RunState.COMPENSATED
    assert ledger(mine) == REVERSED and ledger(theirs) == POSTED
    own = LedgerEntry.objects.using("sandbox").get(reference=mine.workflow_id)
    assert own.reversal.reference == f"{mine.workflow_id}:reversal"
    assert not AuditEvent.objects.filter(run=mine, action="compensation_refused").exists()


def test_a_ledger_that_cannot_be_asked_gets_nothing_sent_until_it_answers_then_one_reversal(clock):
    """The check faults (the ledger's GET by id is down): no reversal is sent unconfirmed; the
    compensation is retried like any transient failure and completes once the ledger answers."""
    mine = drive(start("acme", "INV-1"), clock)
    recover_compensate(mine, "sam")
    faults.set_fault("ledger", "get", "unavailable", times=2)

    advance(mine.pk)
    mine.refresh_from_db()
    step = mine.steps.get(step_name="post_ledger_entry")
    assert ledger(mine) == POSTED  # nothing sent
    assert (mine.state, step.state) == (RunState.COMPENSATING, StepState.COMPENSATING)
    assert step.next_attempt_at is not None and step.compensation_sent_at is None
    assert "could not confirm" in step.last_error and "HTTP 503" in step.last_error
    assert AuditEvent.objects.filter(run=mine, action="compensation_retry").count() == 1
    assert not AuditEvent.objects.filter(run=mine, action="compensation_begin").exists()

    mine = drive(mine, clock)
    assert mine.state == RunState.COMPLETED  # only the ledger step was undone: the others stand
    assert mine.steps.get(step_name="post_ledger_entry").state == StepState.COMPENSATED
    assert ledger(mine) == REVERSED
    assert AuditEvent.objects.filter(run=mine, action="compensation_begin").count() == 1


def test_a_ledger_that_never_answers_stops_the_compensation_visibly_with_nothing_sent(clock):
    mine = drive(start("acme", "INV-1"), clock)
    recover_compensate(mine, "sam")
    faults.set_fault("ledger", "get", "unavailable", times=50)
    mine = drive(mine, clock)
    step = mine.steps.get(step_name="post_ledger_entry")
    assert (mine.state, step.state) == (RunState.COMPENSATION_FAILED, StepState.COMPENSATION_FAILED)
    assert step.compensation_attempts == invoice_module.LEDGER_POLICY.maximum_attempts
    assert "not sent: could not confirm" in mine.status_reason
    assert ledger(mine) == POSTED
