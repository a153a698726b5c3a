"""Issue 37 in a real browser (Debian's Chromium driven by Playwright): a supervisor pauses the
ledger step from the dashboard during an incident, sees it at the top of the runs list with the
run it holds, releases a canary, reads its outcome, then releases the rest; every run completes
with one entry. Then a posting restarted with a corrected amount. The page raises no policy
violation. Screenshots under var/screenshots/."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from recovery.engine.transitions import run_start
from recovery.models import RunRestart, RunState, WorkflowPause, WorkflowRun
from tests.browser.conftest import needs_chromium, shot
from tests.support import receivers
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


def test_a_supervisor_pauses_a_step_from_the_dashboard_then_releases_a_canary_and_the_rest(page_as, clock, live_server):
    page = page_as("supervisor")
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if m.type == "error" else None)
    page.goto(f"{live_server.url}/dashboard")
    form = page.locator("form.pause-workflow")
    form.locator("select[name=target]").select_option("test_orders:post_entry")
    form.locator("input[name=reason]").fill("ledger outage")
    form.get_by_role("button", name="Pause").click()
    row = page.locator('tr[data-pause="test_orders:post_entry"]')
    expect(row).to_contain_text("step post_entry of test_orders")
    expect(row).to_contain_text("ledger outage")

    runs = [
        drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": f"i-{i}"})[0], clock) for i in range(2)
    ]
    assert [r.state for r in runs] == [RunState.PAUSED] * 2
    page.goto(f"{live_server.url}/")
    banner = page.locator("#paused-banner")
    expect(banner).to_contain_text("step post_entry of test_orders, by supervisor at ")
    expect(banner).to_contain_text("2 runs held.")
    shot(page, "incident-runs-list-banner")

    page.goto(f"{live_server.url}/dashboard")
    release = page.locator('tr[data-pause="test_orders:post_entry"] form.release')
    release.locator("select[name=release]").select_option("canary")
    release.locator("input[name=canary]").fill("1")
    release.locator("input[name=reason]").fill("ledger back?")
    release.get_by_role("button", name="Unpause step post_entry of test_orders").click()
    assert drive(WorkflowRun.objects.get(pk=runs[0].pk), clock).state == RunState.COMPLETED
    page.reload()
    expect(page.locator('tr[data-pause="test_orders:post_entry"] td[data-canary]')).to_have_text("1 completed")
    shot(page, "incident-dashboard-canary")

    release = page.locator('tr[data-pause="test_orders:post_entry"] form.release')
    release.locator("input[name=reason]").fill("ledger back")
    release.get_by_role("button", name="Unpause step post_entry of test_orders").click()
    expect(page.locator("#workflow-pauses")).to_contain_text("None: every workflow runs.")
    assert WorkflowPause.objects.get().released_by == "supervisor"
    assert drive(WorkflowRun.objects.get(pk=runs[1].pk), clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 2, "model_call": 2}
    assert violations == []


def test_a_supervisor_restarts_a_posting_with_a_corrected_amount_after_seeing_the_difference(
    page_as, clock, live_server
):
    """From the run page to the restart page: the posting's intent loaded, the amount corrected,
    the difference and the reversal shown, a confirmation without a reason refused by the browser's
    form, then with one; the run ends with the first entry reversed and the corrected one posted."""
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "fix-1", "text": "120"})[0], clock)
    page = page_as("supervisor")
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if m.type == "error" else None)
    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    page.get_by_role("link", name="Restart from a step with a corrected input…").click()

    choice = page.locator("form.restart-choice")
    choice.locator("select[name=step]").select_option("post_entry")
    choice.get_by_label("the step's intent").check()
    choice.get_by_role("button", name="Load what the run holds").click()
    correction = page.locator("textarea[data-correction]")
    expect(correction).to_contain_text('"amount": 120')
    correction.fill('{"amount": 125}')
    page.get_by_role("button", name="Show the difference").click()
    expect(page.locator("code[data-change]")).to_have_text("amount: 120 → 125")
    expect(page.locator('li[data-effect="post_entry:undo"]')).to_contain_text("is undone first")
    shot(page, "restart-difference")
    assert receivers.compensations()["reversal"] == 0  # shown, nothing done
    page.get_by_role("button", name="Restart from post_entry").click()  # no reason: the form asks for one
    expect(page.locator("section[data-plan]")).to_be_visible()
    assert not RunRestart.objects.exists()

    page.get_by_label("reason for the restart").fill("amount misread")
    page.get_by_role("button", name="Restart from post_entry").click()
    expect(page.locator("section[data-restarts]")).to_contain_text("amount misread")
    run = drive(WorkflowRun.objects.get(pk=run.pk), clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 2 and receivers.compensations()["reversal"] == 1
    page.reload()
    expect(page.locator("section[data-restarts] code")).to_have_text("amount: 120 → 125")
    shot(page, "restart-record")
    assert violations == []
