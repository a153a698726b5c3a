"""States that agree, in a real browser (issue 33): a dispute whose agent a supervisor stops
from the console is listed under "Agent stopped" — its chip counts it, its filter lists it, no
"Retries exhausted" does —, its page says who stopped it, when and what to do, and its steps
table and conversation read the same state, with no next attempt in the past. Screenshots
under var/screenshots/."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.models import RunState, StepState
from tests.browser.conftest import needs_chromium, shot
from tests.browser.test_operator_console_items import LIVE, open_run, press
from tests.support import receivers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


def test_a_dispute_whose_agent_a_supervisor_stops_is_listed_and_explained_as_agent_stopped(page_as, clock, live_server):
    receivers.arm("ledger", "unavailable")  # the credit note fails once: its retry is scheduled
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": "stopped"})[0]
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING
    credit = run.steps.get(step_name="resolve:2:0:credit")
    clock.advance(17 * 60)  # the supervisor comes to it long after that retry was due
    page = page_as("supervisor", username="olga")
    open_run(page, live_server, run)
    press(page, "stop_agent:resolve", "the customer called", dialog="Stop resolve now?")
    run.refresh_from_db()
    assert run.state == RunState.NEEDS_REVIEW
    assert run.steps.get(step_name="resolve").refusal["rule"] == "agent_stopped"

    page.goto(f"{live_server.url}/")
    chip = page.locator('#counts a.chip[href="?stuck=agent_stopped"]')
    expect(chip).to_have_text(re.compile(r"Agent stopped\s+1"), timeout=LIVE)
    expect(page.locator('#counts a.chip[href="?stuck=exhausted"]')).to_have_text(re.compile(r"Retries exhausted\s+0"))
    chip.click()
    page.wait_for_url(re.compile(r"stuck=agent_stopped"))
    listed = page.locator("table.runs tbody tr")
    expect(listed).to_have_count(1)
    expect(listed.first).to_contain_text(run.workflow_id)
    expect(listed.first).to_contain_text("agent resolve stopped by olga at ")
    page.goto(f"{live_server.url}/?stuck=exhausted")
    expect(page.locator("td[data-empty]")).to_be_visible()

    open_run(page, live_server, run)
    at = run.steps.get(step_name="resolve").updated_at
    expect(page.locator("#run-head .why")).to_contain_text(
        f"agent resolve stopped by olga at {at:%H:%M:%S} UTC (the customer called): "
        "resume to let it go on, or fork it from a turn"
    )
    in_table = page.locator('#run-steps tr[data-step="resolve:2:0:credit"] [data-state]')
    in_conversation = page.locator('#run-steps tr[data-call="resolve:2:0:credit"] [data-state]')
    expect(in_table).to_have_text("Failed")
    expect(in_conversation).to_have_text("Failed")
    expect(page.locator('#run-steps tr[data-step="resolve:2:0:credit"] [data-next]')).to_have_text("—")
    expect(page.locator('#run-steps tr[data-step="resolve"] [data-state]')).to_have_text(
        "Stopped at turn 2 of at most 5"
    )
    # The steps table and the conversation's calls (not the timeline, whose axis may name that
    # second: the clock was moved to the retry's time before the supervisor stopped the agent).
    steps = "\n".join(page.locator("#run-steps table.steps, #run-steps table.calls").all_inner_texts())
    assert "credit" in steps
    assert "Retrying" not in steps and f"{credit.next_attempt_at:%H:%M:%S}" not in steps
    assert run.steps.get(step_name="resolve:2:0:credit").state == StepState.FAILED  # the row is as it was
    assert receivers.counts()["ledger"] == 0  # nothing more was sent
    shot(page, "agent-stopped-cause")
