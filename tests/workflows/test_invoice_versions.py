"""The invoice workflow v2 asks the tracker whether another invoice of the tenant already has an
open approval task for the same sum (``check_duplicate``) and refuses to open a second one
(``not_a_duplicate``) until a supervisor says it is no duplicate; v1, without the check, is kept
beside it, and its runs finish on it. Over real HTTP to the simulated systems; after each test,
counted at the receivers: the run's own objects, and what must not exist."""

import json
from dataclasses import replace
from io import StringIO

import pytest
from django.core.management import call_command

from recovery.engine import transitions
from recovery.engine.transitions import run_start
from recovery.errors import NotPermitted, PolicyRefusal
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from recovery.workflow import GuardContext, get_workflow
from sandbox import faults
from sandbox import services as sandbox_services
from sandbox.models import Fault, Task
from tests.support.engine import drive, person
from tests.support.sandbox_api import run_sandbox
from workflows.invoice import workflow as invoice_module

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

TENANT = "tenant-42"
TEXT = "ACME Office Supply — 40 ergonomic chairs and 10 desks. Total due: EUR 1,840.00"
V1_STEPS = ["read_invoice", "classify", "create_approval_task", "notify_approver", "post_ledger_entry"]
NONE = {"tasks": 0, "messages": 0, "ledger_entries": 0, "tasks_cancelled": 0, "corrections": 0, "ledger_reversals": 0}
ONE_OF_EACH = {**NONE, "tasks": 1, "messages": 1, "ledger_entries": 1}


@pytest.fixture(autouse=True)
def sandbox(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    faults.clear()
    yield
    faults.clear()


def event(invoice_id: str, text: str = TEXT, tenant: str = TENANT) -> dict:
    return {"tenant": tenant, "invoice_id": invoice_id, "text": text}


def start(invoice_id: str, **changes) -> WorkflowRun:
    return run_start(workflow="invoice", data=event(invoice_id, **changes))[0]


def counts_of(run: WorkflowRun) -> dict[str, int]:
    """What the simulated systems hold under this run's keys and reference (``sandbox counts --run``)."""
    return json.loads(run_sandbox("counts", "--run", run.workflow_id, "--json"))


def step(run: WorkflowRun, name: str) -> StepExecution:
    return run.steps.get(step_name=name)


def open_task(invoice_id: str, *, key: str, amount="1840.00", currency="EUR", tenant=TENANT) -> dict:
    """An approval task made in the tracker by someone else (another run, a person)."""
    payload = {"tenant": tenant, "invoice_id": invoice_id, "amount": amount, "currency": currency}
    return sandbox_services.create_task(key=key, title=f"Approve {invoice_id}", assignee="x", payload=payload).body


def test_new_invoice_runs_start_on_v3_which_checks_for_a_duplicate_and_may_wait_for_the_approver():
    current, v2, kept = get_workflow("invoice"), get_workflow("invoice", 2), get_workflow("invoice", 1)
    assert (current.version, v2.version, kept.version) == (3, 2, 1)
    assert [s.name for s in v2.steps] == V1_STEPS[:2] + ["check_duplicate"] + V1_STEPS[2:]
    waits = ["watch_approval_task", "approver_decision"]
    assert [s.name for s in current.steps] == [s.name for s in v2.steps][:-1] + waits + V1_STEPS[-1:]
    assert [s.name for s in kept.steps] == V1_STEPS
    check = current.get_step("check_duplicate")
    assert (check.effect, check.rerun, check.retry) == ("none", "yes", invoice_module.READ_POLICY)
    assert not current.writes("check_duplicate")
    guards = [g.rule for g in current.guards_for(current.get_step("create_approval_task"))]
    assert "not_a_duplicate" in guards
    assert start("inv-1").workflow_version == 3


def test_a_v2_invoice_that_duplicates_another_invoices_open_task_stops_for_review_with_nothing_written(clock):
    """Rule 4 (decide, then execute): a refusal writes nothing and names the rule."""
    first = drive(start("inv-1"), clock)
    assert first.state == RunState.COMPLETED

    second = drive(start("inv-2"), clock)

    assert second.state == RunState.NEEDS_REVIEW
    assert second.status_reason.startswith("policy refused: not_a_duplicate: invoice inv-2 may duplicate inv-1")
    [first_task] = Task.objects.using("sandbox").all()
    assert step(second, "check_duplicate").result == {
        "duplicate_of": ["inv-1"],
        "tasks": [first_task.public_id],
        "amount": "1840.00",
        "currency": "EUR",
    }
    refused = step(second, "create_approval_task")
    assert (refused.state, refused.attempts, refused.intent) == (StepState.PENDING, 0, None)
    assert refused.refusal["rule"] == "not_a_duplicate"
    assert refused.refusal["values"]["duplicate_of"] == ["inv-1"]
    assert counts_of(second) == NONE  # no second task, no message, no ledger entry
    assert faults.counts() == ONE_OF_EACH  # the first invoice's, untouched
    assert step(second, "notify_approver").state == step(second, "post_ledger_entry").state == StepState.PENDING


def test_a_supervisor_overrides_not_a_duplicate_and_the_run_completes_with_one_task_message_and_entry(clock):
    drive(start("inv-1"), clock)
    second = drive(start("inv-2"), clock)
    assert second.state == RunState.NEEDS_REVIEW

    with pytest.raises(NotPermitted):
        transitions.perform(
            "override",
            workflow_id=second.workflow_id,
            step_name="create_approval_task",
            actor=person("olga", "operator"),
            reason="looks fine",
        )
    transitions.perform(
        "override",
        workflow_id=second.workflow_id,
        step_name="create_approval_task",
        actor=person("sam"),
        reason="two deliveries of chairs, two invoices: checked with the vendor",
    )
    second = drive(second, clock)

    assert second.state == RunState.COMPLETED
    assert counts_of(second) == ONE_OF_EACH
    assert faults.counts() == {**NONE, "tasks": 2, "messages": 2, "ledger_entries": 2}
    [override] = step(second, "create_approval_task").overrides
    assert (override["rule"], override["by"], override["values"]["duplicate_of"]) == (
        "not_a_duplicate",
        "sam",
        ["inv-1"],
    )
    assert AuditEvent.objects.filter(run=second, action="policy_override").count() == 1


def test_a_v2_invoice_with_no_other_open_task_for_its_sum_completes_with_one_task_one_message_one_entry(clock):
    """Only an open task of another invoice of the same tenant, amount and currency counts."""
    cancelled = open_task("inv-0", key="cancelled")
    sandbox_services.cancel_task(cancelled["id"], reason="withdrawn")
    open_task("other-tenant", key="other-tenant", tenant="tenant-7")
    open_task("other-currency", key="other-currency", currency="USD")
    open_task("other-amount", key="other-amount", amount="1840.01")

    run = drive(start("inv-1"), clock)

    assert run.state == RunState.COMPLETED
    assert step(run, "check_duplicate").result["duplicate_of"] == []
    assert counts_of(run) == ONE_OF_EACH
    assert Task.objects.using("sandbox").count() == 5  # the four made by others, and this run's one


def test_a_run_started_on_v1_completes_on_its_five_steps_and_never_asks_the_tracker_for_duplicates(clock):
    """A run executes to the end on the version it started on: v1 has no check, so its guard passes."""
    open_task("inv-1", key="someone-elses")
    run_sandbox("fault", "tasks", "find", "forbidden", "--times", "3")  # any search would be refused

    out = StringIO()
    call_command("start_workflow", "invoice", "--version", "1", "--input", json.dumps(event("inv-2")), stdout=out)
    run = drive(WorkflowRun.objects.get(workflow_id=out.getvalue().strip()), clock)

    assert (run.state, run.workflow_version) == (RunState.COMPLETED, 1)
    assert list(run.steps.order_by("position").values_list("step_name", flat=True)) == V1_STEPS
    assert not StepExecution.objects.filter(step_name="check_duplicate").exists()
    assert Fault.objects.using("sandbox").get().remaining == 3  # no search reached the tracker
    assert counts_of(run) == ONE_OF_EACH


def test_the_duplicate_check_failing_transiently_is_retried_then_the_run_completes(clock):
    """Rule 8: a 503 from a read is retried with bounded backoff; nothing is written twice."""
    run_sandbox("fault", "tasks", "find", "unavailable", "--times", "2")
    run = drive(start("inv-1"), clock)

    assert run.state == RunState.COMPLETED
    check = step(run, "check_duplicate")
    assert (check.state, check.attempts) == (StepState.SUCCEEDED, 3)
    assert check.result["duplicate_of"] == []
    assert AuditEvent.objects.filter(run=run, step_name="check_duplicate", action="step_fail").count() == 2
    assert Fault.objects.using("sandbox").get().remaining == 0  # both refusals were spent on the check
    assert counts_of(run) == ONE_OF_EACH


def test_the_guard_asks_the_tracker_again_when_the_decision_is_not_the_one_checked():
    """A check made for another sum (the decision changed since) is no proof of absence."""
    task = open_task("inv-1", key="first")
    guard = next(
        g for g in get_workflow("invoice").get_step("create_approval_task").guards if g.rule == "not_a_duplicate"
    )
    checked_for_another_sum = {"duplicate_of": [], "tasks": [], "amount": "184.00", "currency": "EUR"}
    ctx = GuardContext(
        workflow_id="invoice:tenant-42:inv-2",
        input=event("inv-2"),
        step="create_approval_task",
        idempotency_key="k",
        results={"check_duplicate": checked_for_another_sum},
        decision={"amount": "1840.00", "currency": "EUR"},
    )
    with pytest.raises(PolicyRefusal) as refused:
        guard.check(ctx)
    assert refused.value.values["tasks"] == [task["id"]]

    assert guard.check(replace(ctx, results={})) is None  # a v1 run: nothing was checked, nothing is refused


def test_the_issue_reproduction_a_deploy_without_v1_strands_no_run_and_v1_back_completes_it(clock, undeploy):
    """Issue 32's reproduction, through the commands: a v1 invoice waits on the ledger's 429; a
    deploy drops v1: the run is not sent to review, its sentence names the version, check_deploy
    lists it and exits non-zero; with v1 back, it completes with one object per step."""
    from django.core.management import CommandError

    from recovery import registry
    from recovery.engine.executor import advance
    from recovery.engine.loop import run_due
    from workflows.invoice.v1 import invoice_v1

    run_sandbox("fault", "ledger", "post", "rate_limit", "--times", "1", "--retry-after", "20")
    out = StringIO()
    call_command("start_workflow", "invoice", "--version", "1", "--input", json.dumps(event("dep-1")), stdout=out)
    run = WorkflowRun.objects.get(workflow_id=out.getvalue().strip())
    advance(run.pk)
    run.refresh_from_db()
    assert (run.state, run.workflow_version, run.current_step) == (RunState.WAITING, 1, "post_ledger_entry")

    undeploy("invoice", 1)  # the deploy: this code has invoice v2 and v3 only
    clock.set(run.next_wake_at)
    assert run_due(owner="v2-only") == 0
    shown = StringIO()
    call_command("show_run", run.workflow_id, stdout=shown)
    assert (
        "why: started under invoice v1; this deployment has v2 and v3: deploy v1 again, or move the run"
        in shown.getvalue()
    )
    listed = StringIO()
    with pytest.raises(CommandError, match="this deploy would strand 1 unfinished run"):
        call_command("check_deploy", stdout=listed)
    assert "invoice v1 at post_ledger_entry: 1 run(s) (waiting 1;" in listed.getvalue()
    assert "cannot move to v3: create_approval_task is step 3 of this run and step 4 of v3" in listed.getvalue()
    run.refresh_from_db()
    assert run.state == RunState.WAITING and not AuditEvent.objects.filter(run=run, action="review").exists()

    registry._REGISTRY["invoice"][1] = invoice_v1  # v1 deployed again
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and run.workflow_version == 1
    assert counts_of(run) == ONE_OF_EACH
    assert "check_duplicate" not in {s.step_name for s in run.steps.all()}
