"""The recommended action per stuck cause, in Chromium: for runs stuck for an unknown outcome,
exhausted retries, a refused policy and a failed compensation, the highlighted first button is the
one recommended for that cause, with its sentence; the rest are folded under "More actions";
"it did not happen" asks first (dismissed: nothing changes; accepted: it is performed); and the
command line the page shows performs the same transition."""

import shlex

import pytest
from django.core.management import call_command
from playwright.sync_api import expect

from recovery.models import AuditEvent, StepState
from tests.browser.conftest import needs_chromium, shot
from tests.support import stuck

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
]


def open_run(page, live_server, run) -> None:
    page.goto(f"{live_server.url}/runs/{run.workflow_id}")
    expect(page.locator("#run-head h1")).to_contain_text(run.workflow_id)


def recommended_first(page, item: str, sentence: str) -> None:
    """The first action of the page is ``item``, highlighted (a primary button, outside "More
    actions"), saying ``sentence``; every other action is folded until "More actions" is opened."""
    section = page.locator("section.actions")
    first = section.locator(".action-item").first
    expect(first).to_have_attribute("data-item", item)
    expect(first).to_have_class("action-item recommended")
    expect(first.locator("button[data-action]")).to_have_class("primary")
    expect(first.locator("button[data-action]")).to_be_visible()
    expect(first.locator("[data-does]")).to_contain_text(sentence)
    expect(section.locator("[data-advice]")).to_contain_text("Recommended")
    others = section.locator("details.more-actions .action-item button[data-action]")
    assert others.count() >= 1
    expect(others.first).to_be_hidden()
    section.locator("details.more-actions > summary").click()
    expect(others.first).to_be_visible()


def test_each_stuck_cause_has_its_recommended_action_first(clock, monkeypatch, page_as, live_server):
    page = page_as("supervisor", username="sam")
    cases = [
        (stuck.unknown(clock, monkeypatch), "reconcile:notify", "sends nothing: it looks notify up by its key"),
        (stuck.exhausted(clock), "retry:post_entry", "sends the same request again under the same key"),
        (stuck.compensation_failed(clock), "compensate", "undoes every completed effect of the run"),
    ]
    for run, item, sentence in cases:
        open_run(page, live_server, run)
        recommended_first(page, item, sentence)
    shot(page, "recommended-compensation-failed")

    refused = stuck.policy_refused(clock)
    open_run(page, live_server, refused)
    advice = page.locator("section.actions [data-advice]")
    expect(advice).to_have_attribute("data-recommended", "supersede:decide")
    expect(advice).to_contain_text("Change the decision decide: it replaces the model's decision")
    expect(advice.locator("a[href='#decision-decide']")).to_be_visible()
    operator = page_as("operator", username="olga")
    open_run(operator, live_server, refused)
    expect(operator.locator("section.actions [data-advice]")).to_contain_text("A supervisor can change the decision")


def test_it_did_not_happen_asks_first_and_the_command_line_performs_the_same(clock, monkeypatch, page_as, live_server):
    run = stuck.unknown(clock, monkeypatch)
    page = page_as("supervisor", username="sam")
    open_run(page, live_server, run)
    page.locator("details.more-actions > summary").click()
    form = page.locator("form.action", has=page.locator('button[data-action="resolve_absent:notify"]'))
    form.locator("input[name=reason]").fill("not in the mailer's log")

    asked: list[str] = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    form.locator('button[data-action="resolve_absent:notify"]').click()
    expect(page.locator("#run-body .flash.ok")).to_have_count(0)
    assert asked and "may happen a second time" in asked[0] and "a message to the approver" in asked[0]
    assert run.steps.get(step_name="notify").state == StepState.UNKNOWN  # dismissed: nothing changed
    assert not AuditEvent.objects.filter(run=run, action="resolve").exists()

    page.once("dialog", lambda d: d.accept())
    form.locator('button[data-action="resolve_absent:notify"]').click()
    expect(page.locator("#run-body .flash.ok")).to_be_visible()
    assert AuditEvent.objects.filter(run=run, action="resolve", actor="sam").count() == 1
    assert run.steps.get(step_name="notify").state != StepState.UNKNOWN

    # The exhausted run: the recommended button's command line, run as shown, retries the step.
    exhausted = stuck.exhausted(clock)
    open_run(page, live_server, exhausted)
    line = page.locator(".action-item.recommended [data-command]").inner_text()
    assert line == f"manage.py recover retry {exhausted.workflow_id} --step post_entry --reason '<reason>' --as sam"
    call_command(*[a.replace("<reason>", "ledger is back") for a in shlex.split(line)[1:]])
    retried = AuditEvent.objects.get(run=exhausted, action="retry")
    assert (retried.actor, retried.step_name, retried.reason) == ("sam", "post_entry", "ledger is back")
    assert exhausted.steps.get(step_name="post_entry").state != StepState.FAILED
