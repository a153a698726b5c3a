"""An agent step in a real browser (Debian's Chromium driven by Playwright): the conversation as
an operator reads it at 3 a.m., and stopping, resuming and forking the agent from the run page,
each checked against what must and must not exist afterwards. Screenshots under var/screenshots/."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.browser.conftest import needs_chromium, shot
from tests.browser.test_operator_console_items import offered, open_run, press
from tests.support import receivers
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


def waiting_agent(order_id: str) -> WorkflowRun:
    """A dispute whose credit note failed once (503): the run waits in turn 2, its message not sent."""
    receivers.arm("ledger", "unavailable")
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": order_id})[0]
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING
    return run


def test_the_conversation_shows_each_turn_its_calls_keys_and_a_refusal(page_as, clock, live_server):
    run = drive(run_start(workflow="test_agent", data={"tenant": "t", "order_id": "read", "amount": 900})[0], clock)
    page = page_as("viewer")
    open_run(page, live_server, run)

    conversation = page.locator('section.conversation[data-agent="resolve"]')
    expect(conversation.locator("li[data-turn]")).to_have_count(3)
    credit = conversation.locator('tr[data-call="resolve:2:0:credit"]')
    expect(credit).to_contain_text("refused by credit_limit")
    expect(credit).to_contain_text("answered to the model; nothing sent")
    key = run.steps.get(step_name="resolve:2:0:credit").idempotency_key
    expect(credit.locator(f'code[title="{key}"]')).to_be_visible()
    expect(conversation.locator('li[data-turn="3"]')).to_contain_text("Final answer")
    expect(page.locator(".refusal")).to_have_count(0)  # answered to the model: nothing holds the run
    shot(page, "agent-conversation")


def test_an_operator_stops_the_agent_and_resumes_it_from_the_run_page(page_as, clock, live_server):
    run = waiting_agent("stop")
    page = page_as("operator")
    open_run(page, live_server, run)
    assert "stop_agent:resolve" in offered(page)
    assert not any(a.startswith("fork_agent") for a in offered(page))  # a supervisor's

    press(page, "stop_agent:resolve", "the customer called", dialog="Stop resolve now?")
    run.refresh_from_db()
    assert run.state == RunState.NEEDS_REVIEW
    assert run.steps.get(step_name="resolve:2:1:notify_customer").state == StepState.SKIPPED
    expect(page.locator('.refusal[data-refusal="resolve"]')).to_contain_text(
        "Agent resolve stopped: stopped by operator"
    )
    expect(page.locator("#run-head")).to_contain_text("agent resolve stopped by operator at ")
    expect(page.locator("#run-head")).to_contain_text("(the customer called): resume to let it go on")
    shot(page, "agent-stopped")

    open_run(page, live_server, run)
    press(page, "resume", "checked with the customer")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 1, "model_call": 3}


def test_a_supervisor_forks_the_agent_from_a_turn(page_as, clock, live_server):
    run = waiting_agent("fork")
    page = page_as("supervisor")
    open_run(page, live_server, run)

    press(page, "fork_agent:resolve:2", "ask again", dialog="Ask the model again from before turn 2?")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert run.steps.get(step_name="resolve:3:0:credit").key_version == 2
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 4}
    assert AuditEvent.objects.get(run=run, action="agent_fork").actor == "supervisor"
    open_run(page, live_server, run)
    expect(page.locator('li[data-turn="2"]')).to_contain_text("Skipped")
    shot(page, "agent-forked")
