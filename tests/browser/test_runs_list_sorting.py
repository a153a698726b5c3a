"""The runs list in a browser (issue 33): an operator types the business key the run page shows,
clicks a column's header to sort by it (and again for the other way), reads how many runs match,
and a bulk dry run says per run what stays made."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from recovery.engine.transitions import run_start
from recovery.models import RunState, WorkflowRun
from tests.browser.conftest import needs_chromium, shot
from tests.support import receivers
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


def start(tenant: str, order_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(
        workflow_id=run_start(workflow="test_orders", data={"tenant": tenant, "order_id": order_id})[0]
    )


def shown(page) -> list[str]:
    return page.locator("table.runs tbody tr td:nth-child(2) > a").all_inner_texts()


def test_the_operator_filters_by_business_key_sorts_by_a_header_and_reads_the_total(page_as, clock):
    receivers.arm("ledger", "forbidden")  # a task and a message made, then the ledger refuses
    made = drive(run_start(workflow="test_orders", data={"tenant": "acme", "order_id": "INV-1002"})[0], clock)
    receivers.clear()
    pending = [start("acme", f"INV-20{i}") for i in range(3)]
    start("globex", "INV-1")
    page = page_as("supervisor")
    expect(page.locator("[data-total]")).to_have_text("5 runs")  # fetched with the counts

    page.fill("input[name=key]", "ACME:inv-1002")  # as the run page shows it, in another case
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    assert shown(page) == [made.workflow_id]
    expect(page.locator("[data-total]")).to_have_text("1 run matches the filters")

    page.fill("input[name=key]", "acme")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("[data-total]")).to_have_text("4 runs match the filters")
    newest_first = [r.workflow_id for r in [made, *pending]][::-1]
    assert shown(page) == newest_first
    page.locator("th a[data-sort=state]").click()  # A to Z: failed before pending
    expect(page.locator("th[aria-sort=ascending]")).to_have_text("State")
    assert shown(page) == [made.workflow_id, *[r.workflow_id for r in pending]]
    page.locator("th a[data-sort=state]").click()  # and the other way
    expect(page.locator("th[aria-sort=descending]")).to_have_text("State")
    assert shown(page) == [r.workflow_id for r in pending][::-1] + [made.workflow_id]
    assert "key=acme" in page.url and "sort=-state" in page.url  # the filter is kept
    shot(page, "runs-sorted-by-state")

    # A bulk dry run of terminate: the effects the failed run made stay made.
    page.locator(f'input[name=run][value="{made.workflow_id}"]').check()
    bulk = page.locator("#bulk-actions")
    bulk.locator("select[name=action]").select_option("terminate")
    bulk.locator("input[name=reason]").fill("duplicate batch")
    bulk.get_by_role("button", name="Check first (dry run)").click()
    row = page.locator(f'tr[data-run="{made.workflow_id}"]')
    task, message = (made.steps.get(step_name=n).remote_ref for n in ("create_task", "notify"))
    expect(row.locator("[data-facts-state]")).to_have_text("Failed")
    expect(row.locator("[data-facts-causes]")).to_have_text("Failed, effects stand")
    expect(row.locator("[data-facts-effects]")).to_have_text(f"{task} and {message} stay made")
    shot(page, "bulk-dry-run-effects-stand")
    assert WorkflowRun.objects.get(pk=made.pk).state == RunState.FAILED  # a dry run changes nothing
