"""Issue 32 in a real browser (Debian's Chromium driven by Playwright): a supervisor opens a run
whose version this deployment lacks, reads why it does not move, sees per version whether a move
would continue it, moves it, and the run completes on the new version with one object per step.
A screenshot of the page before the move is kept under var/screenshots/."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, WorkflowRun
from recovery.workflow import get_workflow
from tests.browser.conftest import needs_chromium, shot
from tests.support import receivers
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


def test_a_supervisor_moves_a_stranded_run_from_its_page_and_it_completes_on_v2(page_as, clock, live_server, undeploy):
    run = run_start(workflow=get_workflow("test_versioned", 1), data={"tenant": "t", "order_id": "b-1"})[0]
    undeploy("test_versioned", 1)
    page = page_as("supervisor")
    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    expect(page.locator("#run-body")).to_contain_text(
        "started under test_versioned v1; this deployment has v2: deploy v1 again, or move the run"
    )
    form = page.locator("form.action", has=page.locator('button[data-action="move_version"]'))
    expect(form.locator("select[name=to_version] option[selected]")).to_have_text("v2: can move to v2 (adds check)")
    shot(page, "versions-move-offered")

    asked: list[str] = []

    def answer(dialog):
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", answer)
    form.locator("input[name=reason]").fill("v1 retired in tonight's deploy")
    form.locator('button[data-action="move_version"]').click()
    expect(page.locator("#run-body .flash.ok")).to_be_visible()
    assert len(asked) == 1 and asked[0].startswith("Move this run to the chosen version?"), asked
    expect(page.locator("#run-body")).to_contain_text("test_versioned v2")

    run = WorkflowRun.objects.get(pk=run.pk)
    assert run.workflow_version == 2
    assert AuditEvent.objects.get(run=run, action="move_version").actor == "supervisor"
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 1, "model_call": 0}
