"""The invoice workflow decides, then checks (issue: "Decide, then check"): the amount and
currency come from the invoice text (a deterministic parser), the approver from the approval
policy (data), and the ledger's current state is read before the task is opened. A model that
proposes otherwise is stopped before the first write, over real HTTP to the simulated systems,
and a supervisor fixes the decision from the console."""

import json
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState, StepState
from sandbox import faults
from sandbox import services as sandbox_services
from sandbox.models import LedgerEntry, Message, Task
from tests.support.console import act, login
from tests.support.engine import drive
from tests.support.model_server import API_KEY, Reply, completion
from workflows.invoice.model import CATEGORIES, InvoiceDecision, rules_decision
from workflows.invoice.policy import APPROVAL_POLICY, ApprovalPolicy, ApprovalRule, invoice_total

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
    "invoice_id": "IN-5531",
    "text": "Initech Hardware — 12 laptops and 12 monitors. Total due: EUR 18,960.00",
}
RIGHT = {
    "category": "hardware",
    "amount": "18960.00",
    "currency": "EUR",
    "approver": "cfo@example.com",  # above 10,000: the CFO, whatever the category
    "confidence": 0.9,
    "rationale": "Laptops and monitors; total EUR 18,960.00.",
}


# --- the parser and the policy: pure -------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "amount", "currency"),
    [
        ("EUR 1,840.00", "1840.00", "EUR"),
        ("1.840,00 €", "1840.00", "EUR"),
        ("USD 12,000", "12000.00", "USD"),
        ("Total due: EUR 18,960.00", "18960.00", "EUR"),
        ("GBP 2,310.50 for flights", "2310.50", "GBP"),
        ("Rechnung vom 05.03.2024, Betrag 1.125,40 EUR", "1125.40", "EUR"),
        ("12 laptops, invoice 2024-117, total 640", "640.00", "EUR"),  # no currency written: the default
    ],
)
def test_the_parser_reads_the_total_the_invoice_states(text, amount, currency):
    total = invoice_total(text)
    assert total is not None and (total.amount, total.currency) == (Decimal(amount), currency)


def test_the_parser_says_so_when_no_amount_can_be_read():
    assert invoice_total("40 chairs, delivered in 2024") is None


def test_the_approval_policy_is_data_first_match_wins():
    assert APPROVAL_POLICY.approver_for(category="hardware", amount=Decimal("18960.00")) == "cfo@example.com"
    assert APPROVAL_POLICY.approver_for(category="hardware", amount=Decimal("10000.00")) == "it-lead@example.com"
    assert APPROVAL_POLICY.approver_for(category="travel", amount=Decimal("2310.50")) == "travel-desk@example.com"
    assert APPROVAL_POLICY.approver_for(category="services", amount=Decimal("980")) == "finance@example.com"
    stricter = ApprovalPolicy(
        rules=(ApprovalRule("ceo@example.com", above=Decimal("500")), ApprovalRule("finance@example.com")),
        categories=("other",),
    )
    assert stricter.approver_for(category="other", amount=Decimal("501")) == "ceo@example.com"
    # The schema's categories are the policy's: a category the policy does not know is refused by both.
    assert set(CATEGORIES) == set(InvoiceDecision.model_fields["category"].annotation.__args__)


def test_the_rules_provider_decides_within_its_own_guards():
    """The offline default proposes what the guards accept (else `make run` would stop every run)."""
    decision = rules_decision(EVENT["text"])
    assert (decision["amount"], decision["currency"], decision["approver"]) == ("18960.00", "EUR", "cfo@example.com")


# --- the workflow, over HTTP, with an OpenAI-compatible model that gets it wrong -------------

pytestmark_db = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])


@pytest.fixture
def openai(stub, settings, live_server):
    settings.SANDBOX_URL = live_server.url
    settings.MODEL_PROVIDER = "openai"
    settings.OPENAI_BASE_URL, settings.OPENAI_API_KEY, settings.OPENAI_TIMEOUT = stub.base_url, API_KEY, 2
    faults.clear()
    yield stub
    faults.clear()


def proposes(stub, **changes) -> None:
    stub.reply(Reply(body=completion(json.dumps({**RIGHT, **changes}))))


def start():
    return run_start(workflow="invoice", data=EVENT)[0]


@pytestmark_db
@pytest.mark.parametrize(
    ("changes", "rule", "why"),
    [
        (
            {"approver": "it-lead@example.com"},
            "approval_policy",
            "it-lead@example.com is not the approver for hardware at 18960.00: the policy assigns cfo@example.com",
        ),
        (
            {"amount": "1896.00", "approver": "it-lead@example.com"},  # read tenfold too small
            "amount_matches_invoice",
            "the invoice states 18960.00 EUR, the decision says 1896.00 EUR",
        ),
        (
            {"currency": "USD"},
            "amount_matches_invoice",
            "the invoice states 18960.00 EUR, the decision says 18960.00 USD",
        ),
    ],
)
def test_a_wrong_proposal_stops_before_the_first_write_and_a_supervisor_fixes_it_from_the_console(
    openai, clock, changes, rule, why, capsys
):
    proposes(openai, **changes)
    run = drive(start(), clock)

    assert run.state == RunState.NEEDS_REVIEW
    assert run.status_reason == f"policy refused: {rule}: {why}"
    assert faults.counts() == NOTHING  # no task, no message, no ledger entry
    assert len(openai.requests) == 1
    task_step = run.steps.get(step_name="create_approval_task")
    assert (task_step.state, task_step.attempts, task_step.intent) == (StepState.PENDING, 0, None)

    # Named on the runs list (its own stuck cause), the run page and show_run.
    supervisor = login("supervisor")
    listed = supervisor.get(reverse("console:runs"), {"stuck": "policy_refused"})
    assert run.workflow_id in listed.content.decode()
    page = supervisor.get(reverse("console:run", args=[run.workflow_id])).content.decode()
    assert f"<code>{rule}</code>" in page and 'name="decision"' in page
    call_command("show_run", run.workflow_id)
    assert f"policy refused: {rule}" in capsys.readouterr().out

    # The supervisor corrects the decision from the console; the model is not asked again.
    response = act(supervisor, run, "supersede", step="classify", decision=json.dumps(RIGHT), reason="per policy")
    assert response.status_code == 200, response.content
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH
    assert len(openai.requests) == 1
    task = Task.objects.using("sandbox").get()
    assert (task.assignee, task.payload["amount"], task.payload["currency"]) == ("cfo@example.com", "18960.00", "EUR")
    assert Message.objects.using("sandbox").get().to == "cfo@example.com"
    entry = LedgerEntry.objects.using("sandbox").get()
    assert (entry.amount, entry.currency) == (Decimal("18960.00"), "EUR")
    versions = ModelDecision.objects.filter(run=run).exclude(state=DecisionState.INVALID).order_by("version")
    assert [(d.version, d.state) for d in versions] == [(1, DecisionState.SUPERSEDED), (2, DecisionState.ACCEPTED)]
    supersede = AuditEvent.objects.get(run=run, action="decision_supersede")
    assert supersede.actor == "u-supervisor" and supersede.after["decision"]["approver"] == "cfo@example.com"
    # The duplicate check read the tracker for the old decision: it was made again for the new one.
    assert supersede.after["read_again"] == ["check_duplicate"]
    check = run.steps.get(step_name="check_duplicate").result
    assert (check["amount"], check["currency"], check["duplicate_of"]) == ("18960.00", "EUR", [])


@pytestmark_db
def test_the_console_refuses_a_decision_that_breaks_the_schema_and_an_operator_cannot_change_it(openai, clock):
    proposes(openai, approver="it-lead@example.com")
    run = drive(start(), clock)
    operator, supervisor = login("operator"), login("supervisor")
    page = operator.get(reverse("console:run", args=[run.workflow_id])).content.decode()
    assert 'name="decision"' not in page  # the form is for supervisors only

    events = AuditEvent.objects.filter(run=run).count()
    refused = act(operator, run, "supersede", step="classify", decision=json.dumps(RIGHT), reason="x")
    assert refused.status_code == 403
    for bad, message in [
        ("{not json", "the decision is not valid JSON"),
        (json.dumps({**RIGHT, "category": "bribes"}), "category: Input should be"),
        (json.dumps([RIGHT]), "the decision must be a JSON object"),
    ]:
        response = act(supervisor, run, "supersede", step="classify", decision=bad, reason="x")
        assert response.status_code == 400 and message in response.content.decode(), response.content
    assert AuditEvent.objects.filter(run=run).count() == events
    assert ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED).version == 1


@pytestmark_db
def test_an_unknown_category_never_reaches_a_write(openai, clock):
    proposes(openai, category="bribes")
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    assert faults.counts() == NOTHING


@pytestmark_db
@pytest.mark.parametrize("reversed_", [False, True], ids=["posted", "cancelled"])
def test_an_invoice_already_posted_or_cancelled_in_the_ledger_gets_no_approval_task(openai, clock, reversed_):
    entry = sandbox_services.post_entry(
        reference="invoice:initech:IN-5531", amount=Decimal("18960.00"), currency="EUR", account="x", memo=""
    ).body
    if reversed_:
        sandbox_services.reverse_entry(entry["id"], reference="manual-reversal", memo="cancelled by finance")
    proposes(openai)
    run = drive(start(), clock)
    assert run.state == RunState.NEEDS_REVIEW
    state = f"cancelled: {entry['id']} was reversed by" if reversed_ else f"already posted as {entry['id']}"
    assert run.status_reason.startswith(f"policy refused: invoice_open_in_ledger: invoice IN-5531 is {state}")
    counts = faults.counts()
    assert (counts["tasks"], counts["messages"]) == (0, 0)
