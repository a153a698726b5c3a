"""The dispute workflow: an agent step resolves a customer's complaint over real HTTP to the
simulated ledger and messenger — looks the invoice up, credits the overcharge with a credit note
(a reversing entry), tells the customer — with every turn journaled and every call made once."""

import json
from decimal import Decimal

import pytest

from recovery.engine.transitions import run_compensate, run_start
from recovery.models import RunState, StepState
from recovery.testing import fault_matrix
from recovery.workflow import compensation_key
from sandbox import faults
from sandbox.models import LedgerEntry, LedgerKind, Message
from tests.support.engine import assert_invariants, drive, person
from tests.support.model_server import API_KEY, function_calling
from workflows.dispute import agent as dispute_agent
from workflows.integrations import adapters

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])

EVENT = {
    "tenant": "tenant-42",
    "dispute_id": "d-1",
    "invoice_id": "inv-1847",
    "customer": "buyer@acme.example",
    "complaint": "Your invoice inv-1847 overcharged us by 120.00 EUR: the desks were on offer.",
}


@pytest.fixture(autouse=True)
def sandbox(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    faults.clear()
    yield live_server.url
    faults.clear()


@pytest.fixture
def posted():
    """The invoice the dispute is about, posted to the ledger (as the invoice workflow does)."""
    return adapters.post_entry(
        reference="invoice:tenant-42:inv-1847",
        amount="1840.00",
        currency="EUR",
        account="expenses:office_supplies",
        memo="invoice inv-1847",
    )


@pytest.fixture
def model_calls(monkeypatch):
    """The offline agent's turns, counted."""
    asked: list[int] = []
    real = dispute_agent.RulesAgent.chat

    def counted(self, **kwargs):
        asked.append(len(kwargs["messages"]))
        return real(self, **kwargs)

    monkeypatch.setattr(dispute_agent.RulesAgent, "chat", counted)
    return asked


def start(**changes):
    return run_start(workflow="dispute", data={**EVENT, **changes})[0]


def credit_notes(run=None) -> list[LedgerEntry]:
    notes = LedgerEntry.objects.using("sandbox").filter(kind=LedgerKind.ENTRY, amount__lt=0)
    return list(notes)


def test_an_overcharge_is_credited_once_and_the_customer_told_once(clock, posted, model_calls):
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    names = [s.step_name for s in run.steps.order_by("position", "id")]
    assert names == [
        "read_complaint",
        "resolve_dispute",
        "resolve_dispute:1",
        "resolve_dispute:1:0:look_up_invoice",
        "resolve_dispute:2",
        "resolve_dispute:2:0:issue_credit_note",
        "resolve_dispute:3",
        "resolve_dispute:3:0:notify_customer",
        "resolve_dispute:4",
    ]
    [note] = credit_notes()
    assert (note.amount, note.currency, note.account) == (Decimal("-120.00"), "EUR", "expenses:office_supplies")
    credit = run.steps.get(step_name="resolve_dispute:2:0:issue_credit_note")
    assert note.reference == credit.idempotency_key and credit.remote_ref == note.public_id
    [message] = Message.objects.using("sandbox").all()
    assert message.to == "buyer@acme.example" and "120.00 EUR" in message.text
    answer = run.steps.get(step_name="resolve_dispute").result
    assert answer["outcome"] == "credited" and answer["credit"] == "120.00"
    assert len(model_calls) == 4
    assert_invariants()


def test_a_credit_over_the_limit_is_refused_before_anything_is_written_and_the_dispute_escalated(
    clock, posted, model_calls
):
    run = drive(start(complaint="We were charged twice for invoice inv-1847."), clock)

    assert run.state == RunState.COMPLETED
    refused = run.steps.get(step_name="resolve_dispute:2:0:issue_credit_note")
    assert refused.state == StepState.SKIPPED and refused.refusal["rule"] == "credit_limit"
    assert credit_notes() == []
    assert run.steps.get(step_name="resolve_dispute").result["outcome"] == "escalated"
    assert Message.objects.using("sandbox").count() == 1


def test_a_dispute_about_an_invoice_not_in_the_ledger_is_rejected_without_a_credit_note(clock, model_calls):
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    assert run.steps.get(step_name="resolve_dispute").result["outcome"] == "rejected"
    assert credit_notes() == [] and Message.objects.using("sandbox").count() == 1


def test_a_credit_note_whose_answer_is_lost_is_found_by_its_key_not_posted_again(clock, posted, model_calls):
    faults.set_fault("ledger", "post", "commit_then_drop")
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    assert len(credit_notes()) == 1 and len(model_calls) == 4


def test_an_operator_compensates_the_credit_note_with_a_reversing_entry(clock, posted):
    run = drive(start(), clock)
    run_compensate(workflow_id=run.workflow_id, actor=person("sam"), reason="credited the wrong invoice")
    run = drive(run, clock)

    assert run.state == RunState.COMPENSATED
    [note] = credit_notes()
    reversal = LedgerEntry.objects.using("sandbox").get(kind=LedgerKind.REVERSAL)
    assert reversal.reverses_id == note.pk and reversal.amount == Decimal("120.00")


def dispute_effects(run) -> dict[str, int]:
    keys = dict(run.steps.filter(step_name__contains=":").values_list("step_name", "idempotency_key"))
    ledger = LedgerEntry.objects.using("sandbox").filter(kind=LedgerKind.ENTRY)
    messages = Message.objects.using("sandbox")
    return {
        name: ledger.filter(reference=key).count() + messages.filter(client_ref=key).count()
        for name, key in keys.items()
    }


def dispute_compensations(run) -> dict[str, int]:
    names = run.steps.filter(step_name__contains=":").values_list("step_name", flat=True)
    reversals = LedgerEntry.objects.using("sandbox").filter(kind=LedgerKind.REVERSAL)
    return {name: reversals.filter(reference=compensation_key(run.workflow_id, name, 1)).count() for name in names}


@pytest.fixture
def dispute_sandbox(live_server, settings):
    """Every case disputes the same posted invoice, each as its own dispute."""
    settings.SANDBOX_URL = live_server.url
    faults.clear()
    adapters.post_entry(
        reference="invoice:matrix:inv-m", amount="99.00", currency="EUR", account="expenses:other", memo="inv-m"
    )


test_dispute_fault_matrix = fault_matrix(
    "dispute",
    event=lambda n: {
        **EVENT,
        "tenant": "matrix",
        "dispute_id": f"m-{n}",
        "invoice_id": "inv-m",
        "complaint": "overcharged by 10.00",
    },
    effects=dispute_effects,
    compensations=dispute_compensations,
    fixtures=("dispute_sandbox",),
    databases=("default", "sandbox"),
)


def test_the_dispute_runs_against_an_openai_compatible_server_with_function_calling(clock, posted, stub, settings):
    settings.MODEL_PROVIDER, settings.OPENAI_BASE_URL, settings.OPENAI_API_KEY = "openai", stub.base_url, API_KEY
    stub.answer = function_calling
    run = drive(start(), clock)

    assert run.state == RunState.COMPLETED
    assert len(credit_notes()) == 1 and Message.objects.using("sandbox").count() == 1
    assert len(stub.requests) == 4  # one request per model turn
    first, second = stub.requests[0].body, stub.requests[1].body
    names = {tool["function"]["name"] for tool in first["tools"]}
    assert names == {"look_up_invoice", "issue_credit_note", "notify_customer"}
    assert first["tools"][1]["function"]["parameters"]["required"] == ["invoice_id", "amount", "reason"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    assert json.loads(second["messages"][3]["content"])["result"]["amount"] == "1840.00"
    assert stub.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
