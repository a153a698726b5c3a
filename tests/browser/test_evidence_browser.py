"""An operator's evidence in Chromium (issue 33): "it succeeded, remote id X" on an unknown
outcome. Another run's message id is refused on the page, naming why, and nothing is recorded; the
run's own id records what the messenger answers, and the run completes with one object per step."""

import pytest
from playwright.sync_api import expect

from recovery.models import AuditEvent, RunState, StepExecution, StepState
from tests.browser.conftest import needs_chromium, shot
from tests.support import receivers
from tests.support.console import unknown_run
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    needs_chromium,
]


def message_of(run) -> str:
    key = StepExecution.objects.get(run=run, step_name="notify").idempotency_key
    return f"msg-{receivers.RemoteObject.objects.get(kind='message', client_ref=key).pk}"


def test_evidence_is_checked_at_the_receiver_and_the_right_id_completes_the_run(
    page_as, clock, monkeypatch, live_server
):
    run = unknown_run(clock, monkeypatch, "ev-1")
    other = unknown_run(clock, monkeypatch, "ev-2")
    theirs, mine = message_of(other), message_of(run)
    page = page_as("operator", username="olga")
    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    page.locator("details.more-actions > summary").click()
    form = page.locator("form.action", has=page.locator('button[data-action="resolve_happened:notify"]'))
    item = page.locator('[data-item="resolve_happened:notify"]')
    expect(item).to_contain_text("looked up at the receiver and must be this step's")

    form.locator("input[name=remote_ref]").fill(theirs)
    form.locator("input[name=reason]").fill("the messenger shows it")
    form.locator("button").click()
    flash = page.locator("#flash")
    expect(flash).to_contain_text(f"{theirs} is not notify's object")
    expect(flash).to_contain_text("nothing recorded")
    shot(page, "evidence-refused")
    assert StepExecution.objects.get(run=run, step_name="notify").state == StepState.UNKNOWN
    assert not AuditEvent.objects.filter(run=run, action="resolve").exists()

    form.locator("input[name=remote_ref]").fill(mine)
    form.locator("button").click()
    expect(page.locator("#run-body .flash.ok")).to_be_visible()
    notify = StepExecution.objects.get(run=run, step_name="notify")
    assert (notify.state, notify.remote_ref) == (StepState.SUCCEEDED, mine)
    assert notify.result == {"message_id": int(mine.removeprefix("msg-"))}
    shot(page, "evidence-recorded")

    monkeypatch.undo()
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    # this run: one task, one message, one ledger entry; the other run (still waiting): its task and message
    assert {k: v for k, v in receivers.counts().items() if k != "model_call"} == {"task": 2, "message": 2, "ledger": 1}
    page.reload()
    expect(page.locator("#run-head h1")).to_contain_text("Completed")
