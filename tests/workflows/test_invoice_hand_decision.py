"""Model output that never validated (issue 33): the demo's IN-5532, whose model answers off
schema every time, pauses at ``classify`` with no accepted decision. A supervisor writes the
decision by hand — checked by the schema, recorded as a new version set by a person, then by the
guards before the first write — or asks the model again; the run then goes on and makes one task,
one message and one ledger entry. Every problem of the validation error is stored and shown.
Over real HTTP to the simulated systems, with the demo's scripted model (SPEC rule 4, rule 8:
"repeated model format failures: pause after a small attempt budget")."""

import json
from decimal import Decimal
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import CommandError, call_command
from django.urls import reverse

from recovery.engine import transitions
from recovery.errors import ErrorKind
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState, StepState, WorkflowRun
from sandbox import faults
from sandbox.models import LedgerEntry, Message, Task
from tests.support.console import act, login
from tests.support.engine import drive
from workflows.invoice.policy import APPROVAL_POLICY

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

NOTHING = {
    "tasks": 0,
    "messages": 0,
    "ledger_entries": 0,
    "tasks_cancelled": 0,
    "corrections": 0,
    "ledger_reversals": 0,
}
ONE_OF_EACH = {**NOTHING, "tasks": 1, "messages": 1, "ledger_entries": 1}

EVENT = {
    "tenant": "initech",
    "invoice_id": "IN-5532",
    "text": "Initech — taxi receipts for the client visit in Lyon. Total due: EUR 146.80",
}
OFF_SCHEMA = '{"category": "bribes", "amount": "146.80"}'  # the demo's script (sandbox/demo_model_script.json)
TRAVEL_APPROVER = APPROVAL_POLICY.approver_for(category="travel", amount=Decimal("146.80"))
BY_HAND = {
    "category": "travel",
    "amount": "146.80",
    "currency": "EUR",
    "approver": TRAVEL_APPROVER,
    "confidence": 1,
    "rationale": "Taxi receipts, EUR 146.80, read by the supervisor.",
}
PROBLEMS = ["- category: Input should be", "- currency: Field required", "- approver: Field required"]
PROBLEMS += ["- confidence: Field required", "- rationale: Field required"]


@pytest.fixture
def model(settings, live_server, tmp_path):
    """The demo's scripted model (off schema for IN-5532) and the simulated systems over HTTP.
    ``model(text)`` rewrites what the model answers from then on."""
    settings.SANDBOX_URL = live_server.url
    script = tmp_path / "model_script.json"

    def answers(text: str) -> None:
        script.write_text(json.dumps({"IN-5532": text}))

    answers(OFF_SCHEMA)
    settings.MODEL_PROVIDER, settings.MODEL_SCRIPT = "scripted", str(script)
    faults.clear()
    yield answers
    faults.clear()


def paused(clock) -> WorkflowRun:
    run = drive(transitions.run_start(workflow="invoice", data=EVENT)[0], clock)
    classify = run.steps.get(step_name="classify")
    assert run.state == RunState.NEEDS_REVIEW
    assert (classify.state, classify.last_error_kind) == (StepState.FAILED, ErrorKind.INVALID_MODEL_OUTPUT)
    assert not ModelDecision.objects.filter(run=run).exclude(state=DecisionState.INVALID).exists()
    assert faults.counts() == NOTHING
    return run


def person(role: str, username: str | None = None):
    user = get_user_model().objects.create_user(username or role, password="pw")
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def recover(*args: str) -> str:
    out = StringIO()
    call_command("recover", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_a_supervisor_writes_the_decision_by_hand_and_the_run_completes_with_one_object_per_step(model, clock):
    run = paused(clock)
    person("supervisor", "sara")
    invalid = ModelDecision.objects.filter(run=run, state=DecisionState.INVALID).count()

    recover(
        "supersede", run.workflow_id, "--step", "classify", "--decision", json.dumps(BY_HAND),
        "--reason", "the model keeps inventing categories; travel per the receipts", "--as", "sara",
    )  # fmt: skip

    decision = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED)
    assert (decision.version, decision.proposal, decision.accepted) == (1, None, BY_HAND)  # set by a person
    assert ModelDecision.objects.filter(run=run, state=DecisionState.INVALID).count() == invalid  # kept
    event = AuditEvent.objects.get(run=run, action="decision_supersede")
    assert (event.actor, event.step_name) == ("sara", "classify")
    assert event.reason == "the model keeps inventing categories; travel per the receipts"
    assert event.before["decision"] is None and event.after["decision"] == BY_HAND
    assert (event.after["set_by"], event.after["decision_version"], event.after["step"]) == ("sara", 1, "succeeded")
    classify = run.steps.get(step_name="classify")
    assert (classify.state, classify.result, classify.remote_ref) == (StepState.SUCCEEDED, BY_HAND, "decision v1")
    assert WorkflowRun.objects.get(pk=run.pk).state == RunState.PENDING
    assert faults.counts() == NOTHING  # nothing sent yet: the executor goes on from here

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    task = Task.objects.using("sandbox").get()
    assert (task.assignee, task.payload["amount"], task.payload["currency"]) == (TRAVEL_APPROVER, "146.80", "EUR")
    assert Message.objects.using("sandbox").get().to == TRAVEL_APPROVER
    assert LedgerEntry.objects.using("sandbox").get().amount == Decimal("146.80")
    assert ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED).version == 1  # never asked the model


def test_the_guards_check_a_hand_written_decision_before_the_first_write(model, clock):
    run = paused(clock)
    supervisor = login("supervisor")
    wrong = {**BY_HAND, "approver": "mallory@example.com"}
    response = act(supervisor, run, "supersede", step="classify", decision=json.dumps(wrong), reason="by hand")
    assert response.status_code == 200, response.content

    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert run.status_reason.startswith("policy refused: approval_policy: mallory@example.com is not the approver")
    assert faults.counts() == NOTHING


def test_a_hand_written_decision_the_schema_refuses_changes_nothing_in_the_console_and_the_command(model, clock):
    run = paused(clock)
    person("supervisor", "sara")
    supervisor, operator = login("supervisor"), login("operator")
    classify = run.steps.get(step_name="classify")
    events, decisions = AuditEvent.objects.filter(run=run).count(), ModelDecision.objects.filter(run=run).count()
    bad = json.dumps({**BY_HAND, "category": "bribes", "confidence": 7, "currency": None})

    response = act(supervisor, run, "supersede", step="classify", decision=bad, reason="by hand")
    assert response.status_code == 400
    text = response.content.decode()
    for problem in ("category: Input should be", "confidence: Input should be less than or equal to 1", "currency:"):
        assert problem in text, text  # every problem, whole
    assert act(operator, run, "supersede", step="classify", decision=json.dumps(BY_HAND)).status_code == 403

    with pytest.raises(CommandError) as refused:
        recover("supersede", run.workflow_id, "--step", "classify", "--decision", bad, "--reason", "x", "--as", "sara")
    message = str(refused.value)
    assert "\n" not in message and "category: Input should be" in message and "confidence:" in message

    after = WorkflowRun.objects.get(pk=run.pk)
    assert (after.state, after.revision) == (RunState.NEEDS_REVIEW, run.revision)
    step = after.steps.get(step_name="classify")
    assert (step.state, step.result, step.format_failures) == (StepState.FAILED, None, classify.format_failures)
    assert AuditEvent.objects.filter(run=run).count() == events
    assert ModelDecision.objects.filter(run=run).count() == decisions
    assert faults.counts() == NOTHING


def test_asking_the_model_again_gives_it_a_fresh_budget_and_the_run_goes_on(model, clock):
    run = paused(clock)
    before = run.steps.get(step_name="classify")
    assert before.format_failures == 3

    model(json.dumps(BY_HAND))  # the prompt was fixed: the model now answers in schema
    response = act(login("supervisor"), run, "decide_again", step="classify", reason="prompt fixed in deploy 41")
    assert response.status_code == 200, response.content
    step = run.steps.get(step_name="classify")
    assert (step.state, step.format_failures, step.budget_start_attempt) == (StepState.PENDING, 0, before.attempts)
    assert AuditEvent.objects.get(run=run, action="decision_supersede").actor == "u-supervisor"

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    accepted = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED)
    assert accepted.proposal == BY_HAND and accepted.version == 1  # the model's own, this time


def test_asking_the_model_again_when_it_still_answers_off_schema_pauses_again_after_a_fresh_budget(model, clock):
    run = paused(clock)
    transitions.perform(
        "decide_again", workflow_id=run.workflow_id, step_name="classify", actor=person("supervisor"), reason="again"
    )
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert run.steps.get(step_name="classify").format_failures == 3  # a whole budget again, no more
    assert ModelDecision.objects.filter(run=run, state=DecisionState.INVALID).count() == 6
    assert faults.counts() == NOTHING


def test_every_problem_of_the_validation_error_is_stored_and_shown_by_show_run_and_the_run_page(model, clock):
    run = paused(clock)
    classify = run.steps.get(step_name="classify")
    assert classify.last_error.split("\n")[0] == "model output does not match InvoiceDecision: 5 problems"
    for problem in PROBLEMS:
        assert problem in classify.last_error
    assert all(d.validation_error == classify.last_error for d in ModelDecision.objects.filter(run=run))

    out = StringIO()
    call_command("show_run", run.workflow_id, stdout=out)
    shown = out.getvalue()
    assert "[invalid_model_output] model output does not match InvoiceDecision: 5 problems" in shown
    for problem in PROBLEMS:
        assert f"      {problem}" in shown, shown
    assert (
        "did not match its schema 3 times (the last one with 5 problems); write the decision by hand (supervisor) "
        "or ask the model again" in shown
    )

    page = login("supervisor").get(reverse("console:run", args=[run.workflow_id])).content.decode()
    assert '<details class="error-text"><summary>model output does not match InvoiceDecision: 5 problems' in page
    for problem in PROBLEMS:
        assert f"<li>{problem.removeprefix('- ')}" in page.replace("&#x27;", "'")


def test_the_run_page_offers_a_supervisor_the_hand_written_decision_prefilled_with_the_schema_fields(model, clock):
    run = paused(clock)
    page = login("supervisor").get(reverse("console:run", args=[run.workflow_id])).content.decode()
    assert 'data-action="supersede:classify"' in page and 'data-action="decide_again:classify"' in page
    assert "Write the decision of classify by hand" in page
    start = page.index('<textarea id="decision-classify"')
    prefilled = page[page.index(">", start) + 1 : page.index("</textarea>", start)].replace("&quot;", '"')
    assert json.loads(prefilled) == {  # the model's last output, with the fields it lacked
        "category": "bribes",
        "amount": "146.80",
        "currency": "",
        "approver": "",
        "confidence": 0,
        "rationale": "",
    }
    fields = page[page.index('data-schema-fields="classify"') : start]
    for name in ("category", "amount", "currency", "approver", "confidence", "rationale"):
        assert f"<code>{name}</code>" in fields
    assert "one of &quot;office_supplies&quot;" in fields and "matching ^[A-Z]{3}$" in fields

    operator_page = login("operator").get(reverse("console:run", args=[run.workflow_id])).content.decode()
    assert 'name="decision"' not in operator_page  # a supervisor's action (recovery.actions: supersede)
