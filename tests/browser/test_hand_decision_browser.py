"""Issue 33 in a real browser (Debian's Chromium driven by Playwright): an IN-5532-like invoice
whose model answers off schema every time pauses at ``classify`` with no accepted decision. A
supervisor reads every problem of the validation error on the run page, writes the decision by
hand in the prefilled form — a schema error is refused whole and changes nothing — and the run
completes with one task, one message and one ledger entry in the simulated systems. A screenshot
of the form is kept under var/screenshots/."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, DecisionState, ModelDecision, RunState
from sandbox import faults
from tests.browser.conftest import needs_chromium, shot
from tests.support.engine import drive
from tests.workflows.test_invoice_hand_decision import BY_HAND, EVENT, NOTHING, OFF_SCHEMA, ONE_OF_EACH

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


@pytest.fixture
def off_schema_model(settings, live_server, tmp_path):
    settings.SANDBOX_URL = live_server.url
    script = tmp_path / "model_script.json"
    script.write_text(json.dumps({EVENT["invoice_id"]: OFF_SCHEMA}))
    settings.MODEL_PROVIDER, settings.MODEL_SCRIPT = "scripted", str(script)
    faults.clear()
    yield
    faults.clear()


def test_a_supervisor_writes_the_decision_of_an_off_schema_invoice_in_the_console_and_it_completes_once(
    page_as, clock, live_server, off_schema_model
):
    run = drive(run_start(workflow="invoice", data=EVENT)[0], clock)
    assert run.state == RunState.NEEDS_REVIEW and faults.counts() == NOTHING

    page = page_as("supervisor")
    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    body = page.locator("#run-body")
    expect(body).to_contain_text("(the last one with 5 problems); write the decision by hand (supervisor)")

    # The validation error: its first line, every problem folded beneath it.
    error = page.locator("tr[data-step=classify] details.error-text")
    expect(error.locator("summary")).to_have_text("model output does not match InvoiceDecision: 5 problems")
    error.locator("summary").click()
    problems = error.locator("li")
    expect(problems).to_have_count(5)
    expect(problems.nth(4)).to_have_text("rationale: Field required")

    form = page.locator("form.decision-edit")
    expect(form.locator("table.schema-fields")).to_contain_text("confidence")
    editor = form.locator("textarea[name=decision]")
    prefilled = json.loads(editor.input_value())
    assert (prefilled["category"], prefilled["amount"], prefilled["currency"]) == ("bribes", "146.80", "")
    shot(page, "hand-decision-form")

    # A decision the schema refuses: every problem named, nothing changed, the text kept to fix.
    decisions, events = ModelDecision.objects.filter(run=run).count(), AuditEvent.objects.filter(run=run).count()
    bad = json.dumps({**BY_HAND, "category": "bribes", "confidence": 7})
    editor.fill(bad)
    form.locator("input[name=reason]").fill("taxi receipts: travel, per the policy")
    form.locator('button[data-action="supersede:classify"]').click()
    flash = page.locator("#flash .flash.error")
    expect(flash).to_contain_text("category: Input should be")
    expect(flash).to_contain_text("confidence: Input should be less than or equal to 1")
    assert editor.input_value() == bad
    assert ModelDecision.objects.filter(run=run).count() == decisions
    assert AuditEvent.objects.filter(run=run).count() == events

    editor.fill(json.dumps(BY_HAND))
    form.locator('button[data-action="supersede:classify"]').click()
    expect(page.locator("#run-body .flash.ok")).to_contain_text("change the decision (classify) recorded")
    expect(page.locator("#run-body")).to_contain_text("set by an operator")

    accepted = ModelDecision.objects.get(run=run, state=DecisionState.ACCEPTED)
    assert (accepted.proposal, accepted.accepted) == (None, BY_HAND)
    assert AuditEvent.objects.get(run=run, action="decision_supersede").actor == "supervisor"
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert faults.counts() == ONE_OF_EACH  # one task, one message, one ledger entry
