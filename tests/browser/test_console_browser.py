"""The console in a real browser (Debian's Chromium driven by Playwright): what an operator
does at 3 a.m., end to end. Screenshots are saved under var/screenshots/ for a human look."""

import csv
import io
import json
from pathlib import Path

import pytest

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.browser.conftest import needs_chromium, shot
from tests.support import receivers, workflows
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    needs_chromium,
]


def unknown_run(clock, monkeypatch):
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "unknown-1"})[0], clock)
    monkeypatch.undo()  # the messenger answers again: a reconcile by key will find the message
    return run


def failed_run(clock, order_id):
    receivers.arm("task", "forbidden")
    return drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0], clock)


def test_operator_filters_stuck_runs_and_reconciles_an_unknown_outcome(page_as, clock, monkeypatch, live_server):
    run = unknown_run(clock, monkeypatch)
    failed_run(clock, "other-1")
    page = page_as("operator")
    page.get_by_role("link", name="Unknown outcome").click()
    page.wait_for_url("**/?stuck=unknown")
    assert page.locator("table.runs tbody tr").count() == 1
    shot(page, "runs-stuck-unknown")
    page.get_by_role("link", name=run.workflow_id).click()
    assert page.locator(".state").first.inner_text() == "Needs Review"

    form = page.locator("form.action", has=page.locator('[data-action="reconcile:notify"]'))
    form.locator("input[name=reason]").fill("messenger is back; look it up")
    form.locator("button").click()
    page.wait_for_selector("text=reconcile (notify) recorded")
    shot(page, "run-after-reconcile")
    first_row = page.locator("table.history tbody tr").first
    assert "operator" in first_row.inner_text() and "reconcile" in first_row.inner_text()
    assert "messenger is back" in first_row.inner_text()
    run.refresh_from_db()
    assert run.state == RunState.PENDING and run.steps.get(step_name="notify").state == StepState.UNKNOWN
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["message"] == 1


def test_viewer_sees_no_action_and_a_forged_post_gets_403(page_as, clock):
    run = failed_run(clock, "viewer-1")
    page = page_as("viewer")
    page.goto(f"{page.url}runs/{run.workflow_id}")
    assert page.locator("[data-action]").count() == 0
    assert page.get_by_text("needs the operator role").is_visible()
    shot(page, "run-as-viewer")
    token = page.locator("input[name=csrfmiddlewaretoken]").first.input_value()
    status = page.evaluate(
        """async ([url, token]) => {
            const body = new URLSearchParams({action: "retry", step: "create_task", reason: "forged"});
            const r = await fetch(url, {method: "POST", body, headers: {"X-CSRFToken": token}});
            return r.status;
        }""",
        [f"/runs/{run.workflow_id}/act", token],
    )
    assert status == 403
    assert not AuditEvent.objects.filter(run=run, action="retry").exists()
    run.refresh_from_db()
    assert run.state == RunState.FAILED


def test_supervisor_bulk_resumes_three_runs_with_one_reason(page_as, clock):
    runs = [failed_run(clock, f"bulk-{i}") for i in range(3)]
    page = page_as("supervisor")
    for run in runs:
        page.locator(f'input[name=run][value="{run.workflow_id}"]').check()
    page.locator("select[name=action]").select_option("resume")
    page.locator("input[name=reason][placeholder^='reason (recorded']").fill("tracker restored")
    page.get_by_role("button", name="Check first (dry run)").click()
    page.wait_for_selector("[data-dry-run]")
    assert "3 of 3 selected runs would be changed" in page.locator("[data-dry-run]").inner_text()
    assert AuditEvent.objects.filter(action="resume").count() == 0
    shot(page, "bulk-dry-run")
    page.locator("[data-action=confirm-bulk]").click()
    page.wait_for_selector("text=3 runs changed")
    shot(page, "bulk-result")
    assert AuditEvent.objects.filter(action="resume", reason="tracker restored").count() == 3
    assert set(WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("state", flat=True)) == {
        RunState.PENDING
    }


def test_the_audit_export_downloads_and_parses(page_as, clock):
    run = failed_run(clock, "export-1")
    page = page_as("viewer")
    page.goto(f"{page.url}runs/{run.workflow_id}")
    with page.expect_download() as download:
        page.get_by_role("link", name="CSV").last.click()
    content = Path(download.value.path()).read_text()
    *rows, trailer, total = csv.DictReader(io.StringIO(content))  # the trailer: the run's row, the total's
    assert rows and {r["workflow_id"] for r in rows} == {run.workflow_id}
    assert rows[0]["action"] == "start"
    assert len(rows) == AuditEvent.objects.filter(run=run).count()
    assert (trailer["at"], trailer["workflow_id"], trailer["after"]) == (
        "trailer",
        run.workflow_id,
        f'{{"events":{len(rows)}}}',
    )
    assert total["at"] == "trailer_total"


def test_supervisor_changes_a_refused_decision_in_the_json_form_and_the_run_completes_once(page_as, clock):
    """A guard refused the model's approver; the supervisor edits the prefilled decision, the
    run goes on and makes one task, one message and one entry, for the corrected approver."""
    receivers.MODEL_SCRIPT.append(json.dumps({"category": "office", "amount": 120, "approver": "mallory"}))
    run = drive(run_start(workflow="test_policy", data={"tenant": "t", "order_id": "refused-1"})[0], clock)
    assert run.state == RunState.NEEDS_REVIEW and receivers.counts()["task"] == 0
    page = page_as("supervisor")
    page.get_by_role("link", name="Policy refused").click()
    page.wait_for_url("**/?stuck=policy_refused")
    page.get_by_role("link", name=run.workflow_id).click()
    refusal = page.locator("[data-refusal=create_task]")
    assert "approver_policy" in refusal.inner_text() and "mallory" in refusal.inner_text()

    editor = page.locator("textarea[name=decision]")
    decision = json.loads(editor.input_value())
    assert decision == {"category": "office", "amount": 120, "approver": "mallory"}  # prefilled
    editor.fill(json.dumps({**decision, "approver": "alice"}))
    form = page.locator("form.decision-edit")
    form.locator("input[name=reason]").fill("alice approves office orders under 1000")
    shot(page, "run-decision-edit")
    form.locator("button").click()
    page.wait_for_selector("text=change the decision (decide) recorded")
    first_row = page.locator("table.history tbody tr").first
    assert "decision replaced" in first_row.inner_text() and "supervisor" in first_row.inner_text()

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert run.steps.get(step_name="create_task").intent["approver"] == "alice"


def test_the_run_page_follows_the_run_without_a_reload_and_keeps_a_half_typed_reason(page_as, clock):
    """Item 6 of the console issue: the page refreshes its live parts while the run can move;
    the operator's half-typed reason stays; once the run is finished the polling stops."""
    receivers.arm("task", "unavailable")
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "live-1"})[0]
    from recovery.engine.executor import advance

    advance(run.pk)  # waiting to retry create_task
    page = page_as("supervisor")
    page.goto(f"{page.url}runs/{run.workflow_id}")
    assert "Retrying" in page.locator('[data-step="create_task"]').inner_text()
    reason = page.locator("form.action", has=page.locator('[data-action="terminate"]')).locator("input[name=reason]")
    reason.fill("half-typed")

    drive(run, clock)  # the executor finishes the run meanwhile
    page.locator("#run-head .state-completed").wait_for(timeout=30_000)
    assert page.locator('[data-step="post_entry"] .step-succeeded').count() == 1
    assert reason.input_value() == "half-typed"
    assert "has changed since the page was loaded" in page.locator("#actions-note").inner_text()
    page.wait_for_function("() => !document.querySelector('#run-poll[hx-trigger]')", timeout=30_000)
    shot(page, "run-live-completed")


def test_the_dashboard_draws_its_bars_to_scale(page_as, clock, live_server):
    for order_id in ("d1", "d2", "d3"):
        drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0], clock)
    failed_run(clock, "d4")
    page = page_as("viewer")
    page.goto(f"{live_server.url}/dashboard")
    bars = page.locator('svg[aria-label="runs by state"] rect.bar')
    widths = {bars.nth(i).get_attribute("width"): bars.nth(i).bounding_box()["width"] for i in range(bars.count())}
    # Completed (3 runs) spans the chart's 300 units, Failed (1) a third of it: drawn, not squashed
    # (a legend's CSS width once made every bar a 10 px square).
    assert widths["300.0"] == pytest.approx(300, abs=2) and widths["100.0"] == pytest.approx(100, abs=2)
    shot(page, "dashboard")
