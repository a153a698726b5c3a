"""Restart from a step with corrected input (issue 37): a supervisor corrects a completed invoice's
posting (or the invoice itself), sees the difference and each effect's fate before confirming, and
the run ends with the corrected effect — the first one reversed (or, where the workflow lets it,
standing beside a second one, said so). Bad input is refused and changes nothing.

Over real HTTP to the simulated systems, with the fixtures of test_invoice_evidence."""

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from recovery.engine import transitions
from recovery.engine.transitions import run_restart, run_terminate
from recovery.errors import InvalidTransition, NotPermitted
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunRestart, RunState, StepExecution, StepState
from sandbox import faults
from sandbox.models import LedgerEntry, LedgerKind
from tests.support.engine import assert_invariants, crash_at, drive, person
from tests.workflows.test_invoice_evidence import TEXT, sandbox, start  # noqa: F401 - the live sandbox fixture

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

ONE_OF_EACH = {
    "tasks": 1,
    "tasks_cancelled": 0,
    "messages": 1,
    "corrections": 0,
    "ledger_entries": 1,
    "ledger_reversals": 0,
}


def completed(clock, invoice_id="INV-9"):
    run = drive(start("acme", invoice_id), clock)
    assert run.state == RunState.COMPLETED and faults.counts() == ONE_OF_EACH
    return run


def entries(run) -> list[tuple[str, str, str]]:
    """The run's postings and reversals: (kind, reference, amount), oldest first."""
    found = LedgerEntry.objects.using("sandbox").filter(reference__startswith=run.workflow_id).order_by("pk")
    return [(e.kind, e.reference, f"{e.amount:.2f}") for e in found]


def assert_corrected(run) -> None:
    """The run completed with its first posting reversed and the corrected one posted, once each;
    its task and message as they were."""
    assert run.state == RunState.COMPLETED, run.status_reason
    assert [(k, a) for k, _, a in entries(run)] == [
        (LedgerKind.ENTRY, "1840.00"),
        (LedgerKind.REVERSAL, "-1840.00"),
        (LedgerKind.ENTRY, "1850.00"),
    ]
    assert faults.counts() == {**ONE_OF_EACH, "ledger_entries": 2, "ledger_reversals": 1}


def written(run) -> tuple:
    """Everything a refused restart must leave as it was: the run, its steps, its audit, its record."""
    run.refresh_from_db()
    steps = list(StepExecution.objects.filter(run=run).order_by("pk").values())
    return (run.state, run.input, steps, AuditEvent.objects.filter(run=run).count(), RunRestart.objects.count())


def supervisor(name: str = "sue"):
    found = get_user_model().objects.filter(username=name).first()
    return found or person(name)


def restart(run, who="sue", *, step="post_ledger_entry", edited="intent", value=None, **more):
    return run_restart(
        workflow_id=run.workflow_id,
        step_name=step,
        actor=supervisor(who),
        reason=more.pop("reason", "amount misread from the scan"),
        edited=edited,
        value={"amount": "1850.00"} if value is None else value,
        **more,
    )


def test_a_corrected_amount_reverses_the_first_posting_and_posts_the_corrected_one(clock):
    run = completed(clock)
    first = StepExecution.objects.get(run=run, step_name="post_ledger_entry")
    situation = transitions.Situation.of(run, run.steps.all(), clock.now())

    plan = transitions.restart_preview(
        situation, "post_ledger_entry", actor=None, edited="intent", value={"amount": "1850.00"}
    )
    assert plan.diff == [{"path": "amount", "before": "1840.00", "after": "1850.00"}]
    assert [(e.step, e.rule, e.key_version) for e in plan.effects] == [("post_ledger_entry", "undo", 2)]
    assert plan.lines() == [
        "restart from post_ledger_entry, post_ledger_entry's intent corrected:",
        '  amount: "1840.00" → "1850.00"',
        f"  post_ledger_entry: {first.remote_ref} is undone first (Post a reversing ledger entry (never delete).), "
        "then made again under a new key",
    ]

    restart(run)
    run.refresh_from_db()
    assert run.state == RunState.COMPENSATING and "then restarting from post_ledger_entry" in run.status_reason
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert entries(run) == [
        (LedgerKind.ENTRY, run.workflow_id, "1840.00"),
        (LedgerKind.REVERSAL, f"{run.workflow_id}:reversal", "-1840.00"),
        (LedgerKind.ENTRY, f"{run.workflow_id}:v2", "1850.00"),
    ]
    assert faults.counts() == {**ONE_OF_EACH, "ledger_entries": 2, "ledger_reversals": 1}
    posted = StepExecution.objects.get(run=run, step_name="post_ledger_entry")
    assert (posted.state, posted.key_version, posted.restarts, posted.correction) == (
        StepState.SUCCEEDED,
        2,
        1,
        {"amount": "1850.00"},
    )
    assert posted.remote_ref != first.remote_ref and posted.intent["amount"] == "1850.00"
    assert posted.idempotency_key != first.idempotency_key
    record = RunRestart.objects.get(run=run)
    assert (record.requested_by, record.reason, record.edited, record.applied_at is not None) == (
        "sue",
        "amount misread from the scan",
        "intent",
        True,
    )
    assert record.before["amount"] == "1840.00" and record.after["amount"] == "1850.00"
    # Asked by sue, applied once the reversal was made: both in the audit trail, with the difference.
    asked, applied = AuditEvent.objects.filter(run=run, action="restart").order_by("id")
    assert (asked.actor, asked.reason, asked.after["diff"]) == ("sue", "amount misread from the scan", plan.diff)
    assert asked.after["undo_first"] == ["post_ledger_entry"]
    assert applied.actor == "executor" and applied.after["restart"] == record.pk
    assert_invariants()


def test_a_corrected_invoice_makes_every_effect_again_and_the_first_message_stands_where_asked(clock):
    run = completed(clock, "INV-10")
    corrected = {**run.input, "text": TEXT.replace("1,840.00", "1,850.00")}

    situation = transitions.Situation.of(run, run.steps.all(), clock.now())
    # Unless the supervisor lets it stand, the first message is corrected (its compensation) first.
    plan = transitions.restart_preview(situation, "read_invoice", actor=None, edited="input", value=corrected)
    assert {e.step: e.rule for e in plan.effects}["notify_approver"] == "undo"
    plan = transitions.restart_preview(
        situation, "read_invoice", actor=None, edited="input", value=corrected, effects_stand=True
    )
    told = {e.step: e.text for e in plan.effects}["notify_approver"]
    assert told.startswith("a second message goes to the approver; the first stands (")

    restart(run, step="read_invoice", edited="input", value=corrected, effects_stand=True, reason="rescanned")
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED and run.input["text"] == corrected["text"]
    assert faults.counts() == {
        "tasks": 2,
        "tasks_cancelled": 1,  # the first task, cancelled before the second was opened
        "messages": 2,  # the first message stands: a second one names the new task
        "corrections": 0,
        "ledger_entries": 2,
        "ledger_reversals": 1,
    }
    assert entries(run)[-1] == (LedgerKind.ENTRY, f"{run.workflow_id}:v2", "1850.00")
    decisions = ModelDecision.objects.filter(run=run, step_name="classify").order_by("version")
    assert [(d.state, d.accepted["amount"]) for d in decisions] == [
        (DecisionState.SUPERSEDED, "1840.00"),
        (DecisionState.ACCEPTED, "1850.00"),
    ]
    effects = {e["step"]: e["rule"] for e in RunRestart.objects.get(run=run).effects}
    assert effects == {
        "read_invoice": "again",
        "classify": "again",
        "check_duplicate": "again",
        "create_approval_task": "undo",
        "notify_approver": "stands",
        "watch_approval_task": "again",
        "approver_decision": "again",
        "post_ledger_entry": "undo",
    }
    assert_invariants()


def test_bad_corrections_are_refused_and_change_nothing(clock):
    run = completed(clock, "INV-11")
    before = written(run)
    refusals = [
        (dict(reason="  "), InvalidTransition, "reason"),
        (dict(step="no_such_step"), InvalidTransition, "no step 'no_such_step'"),
        (dict(value={"amount": "18,50"}), InvalidTransition, "does not match LedgerPosting"),
        (dict(value={"amont": "1850.00"}), InvalidTransition, "does not match LedgerPosting"),
        (dict(value={"amount": "1840.00"}), InvalidTransition, "nothing to restart with"),
        (dict(value=["1850.00"]), InvalidTransition, "must be a JSON object"),
        (
            dict(step="read_invoice", edited="input", value={**run.input, "invoice_id": "INV-12"}),
            InvalidTransition,
            "names another run (invoice:acme:INV-12)",
        ),
        (dict(step="read_invoice", edited="input", value={"tenant": "acme"}), InvalidTransition, "InvoiceEvent"),
    ]
    for arguments, error, words in refusals:
        with pytest.raises(error) as refused:
            restart(run, **arguments)
        assert words in str(refused.value), (arguments, str(refused.value))
        assert written(run) == before
    olga = person("olga", "operator")
    with pytest.raises(NotPermitted, match="needs the supervisor role"):
        transitions.perform(
            "restart",
            workflow_id=run.workflow_id,
            step_name="post_ledger_entry",
            actor=olga,
            reason="x",
            correction=("intent", {"amount": "1850.00"}),
        )
    assert written(run) == before
    assert faults.counts() == ONE_OF_EACH

    stopped = start("acme", "INV-12")
    run_terminate(workflow_id=stopped.workflow_id, actor=supervisor(), reason="withdrawn")
    with pytest.raises(InvalidTransition, match="was terminated: it stays stopped"):
        restart(stopped, step="read_invoice", edited="input", value={**stopped.input, "text": "EUR 1.00"})
    assert faults.counts() == ONE_OF_EACH and RunRestart.objects.count() == 0


def test_the_command_shows_the_difference_first_and_restarts_through_the_same_transition(clock, tmp_path):
    run = completed(clock, "INV-13")
    supervisor()
    corrected = tmp_path / "posting.json"
    corrected.write_text('{"amount": "1850.00"}')
    line = ["restart", run.workflow_id, "--step", "post_ledger_entry", "--intent-file", str(corrected)]

    out = StringIO()
    call_command("recover", *line, "--dry-run", "--reason", "r", "--as", "sue", stdout=out)
    assert f"{run.workflow_id}: restart from post_ledger_entry" in out.getvalue()
    assert '  amount: "1840.00" → "1850.00"' in out.getvalue()
    assert RunRestart.objects.count() == 0 and faults.counts() == ONE_OF_EACH

    corrected.write_text('{"amount": 1850}')
    with pytest.raises(CommandError, match="does not match LedgerPosting"):
        call_command("recover", *line, "--reason", "r", "--as", "sue", stdout=StringIO())
    with pytest.raises(CommandError, match="restart needs the corrected input"):
        call_command("recover", *line[:4], "--reason", "r", "--as", "sue", stdout=StringIO())
    assert RunRestart.objects.count() == 0

    corrected.write_text('{"amount": "1850.00"}')
    call_command("recover", *line, "--reason", "amount misread", "--as", "sue", stdout=StringIO())
    assert drive(run, clock).state == RunState.COMPLETED
    assert entries(run)[-1] == (LedgerKind.ENTRY, f"{run.workflow_id}:v2", "1850.00")


def test_an_executor_lost_between_the_reversal_and_the_restart_leaves_the_run_due_and_never_completed(
    clock, monkeypatch
):
    """The compensation's end is committed, the restart's application is not: the run is still
    compensating (never shown completed in between), due, and the next executor applies the
    restart; one reversal, one corrected posting."""
    run = completed(clock, "INV-14")
    restart(run)
    from recovery.engine import compensating

    real = transitions.restart_apply
    monkeypatch.setattr(compensating.transitions, "restart_apply", lambda **kw: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        drive(run, clock)
    monkeypatch.setattr(compensating.transitions, "restart_apply", real)
    run.refresh_from_db()
    assert (run.state, run.status_reason) == (
        RunState.COMPENSATING,
        "compensations done; restarting from post_ledger_entry",
    )
    assert RunRestart.objects.get(run=run).applied_at is None and not run.lease_owner
    assert drive(run, clock).state == RunState.COMPLETED
    assert [k for k, _, _ in entries(run)] == [LedgerKind.ENTRY, LedgerKind.REVERSAL, LedgerKind.ENTRY]
    assert RunRestart.objects.get(run=run).applied_at is not None


def test_a_reversal_that_fails_stops_the_restart_visibly_until_it_is_compensated_again(clock):
    """The ledger refuses the reversal (403): nothing is posted again, the run waits in
    compensation_failed, saying so; compensating the whole run is refused (the restart waits for
    its own compensations only); compensating the ledger step again reverses it once, and the
    restart goes on to the corrected posting."""
    run = completed(clock, "INV-15")
    faults.set_fault("ledger", "reverse", "forbidden")
    restart(run)
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATION_FAILED
    assert entries(run) == [(LedgerKind.ENTRY, run.workflow_id, "1840.00")]
    assert RunRestart.objects.get(run=run).applied_at is None

    before = written(run)
    with pytest.raises(InvalidTransition, match="a restart from post_ledger_entry waits for the compensation of "):
        transitions.run_compensate(workflow_id=run.workflow_id, actor=supervisor(), reason="undo it all")
    assert written(run) == before

    transitions.run_compensate(
        workflow_id=run.workflow_id, step_name="post_ledger_entry", actor=supervisor(), reason="ledger fixed"
    )
    run = drive(run, clock)
    assert_corrected(run)


@pytest.mark.parametrize(
    "point",
    [
        "post_ledger_entry.compensate:before_call",
        "post_ledger_entry.compensate:after_call",
        "post_ledger_entry:before_intent",
        "post_ledger_entry:before_call",
        "post_ledger_entry:after_call",
        "post_ledger_entry:after_outcome",
    ],
)
def test_a_crash_at_any_boundary_of_the_restart_leaves_one_reversal_and_one_corrected_entry(clock, point):
    """The executor dies at each boundary of the reversal and of the corrected posting (the
    answer lost after the receiver committed, for after_call); the next one takes the run over."""
    run = completed(clock, "INV-C" + point.split(":")[1].replace("_", ""))
    restart(run)
    with pytest.MonkeyPatch.context() as patch:
        crash_at(patch, point, lambda: drive(run, clock))
    run = drive(run, clock)
    assert_corrected(run)
    assert_invariants()
