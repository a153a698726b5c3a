"""Restart from a step with a corrected input, in the console (issue 37): a supervisor finds the
restart from the run page, loads what the run holds, sees the difference and each effect's fate,
and only then confirms; the run ends with the corrected effect and the first one undone, and the
run page keeps the restart's record. Refusals (no reason, bad JSON, a field of the wrong type, an
operator) are answered on the page and change nothing."""

from __future__ import annotations

import html
import json

import pytest
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunRestart, RunState, StepExecution
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive

pytestmark = pytest.mark.django_db


def text(response) -> str:
    return html.unescape(response.content.decode())


def completed(clock):
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "r-1", "text": "120"})[0], clock)
    assert run.state == RunState.COMPLETED
    return run


def written(run) -> tuple:
    run.refresh_from_db()
    steps = list(StepExecution.objects.filter(run=run).order_by("pk").values())
    return run.state, steps, AuditEvent.objects.filter(run=run).count(), RunRestart.objects.count()


def test_a_supervisor_sees_the_difference_and_the_effects_before_confirming_and_the_run_ends_corrected(clock):
    run = completed(clock)
    sam = login("supervisor")
    page = text(sam.get(reverse("console:run", args=[run.workflow_id])))
    assert "Restart from a step with a corrected input…" in page
    assert "from read, decide, create_task, notify, post_entry;" in page

    where = reverse("console:run-restart", args=[run.workflow_id])
    form = text(sam.get(where, {"step": "post_entry", "edit": "intent"}))
    shown = form.split("data-correction>")[1].split("</textarea>")[0]
    assert json.loads(shown) == {"amount": 120, "category": "office"}
    before = written(run)

    preview = sam.post(where, {"stage": "preview", "step": "post_entry", "edit": "intent", "json": '{"amount": 125}'})
    assert preview.status_code == 200
    shown = text(preview)
    assert "<code data-change>amount: 120 → 125</code>" in shown
    entry = StepExecution.objects.get(run=run, step_name="post_entry").remote_ref
    assert f"<b>post_entry</b>: {entry} is undone first (Post a reversing ledger entry.)" in shown
    assert written(run) == before  # a preview writes nothing

    confirm = {"stage": "confirm", "step": "post_entry", "edit": "intent", "json": '{"amount": 125}'}
    refused = sam.post(where, {**confirm, "reason": "  "})
    assert refused.status_code == 400 and "reason" in text(refused).split("data-error>")[1]
    assert written(run) == before

    done = sam.post(where, {**confirm, "reason": "amount misread"})
    assert done.status_code == 302 and done["Location"] == reverse("console:run", args=[run.workflow_id])
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 2 and receivers.compensations()["reversal"] == 1
    posted = StepExecution.objects.get(run=run, step_name="post_entry")
    assert (posted.key_version, posted.intent) == (2, {"amount": 125, "category": "office"})

    page = text(sam.get(reverse("console:run", args=[run.workflow_id])))
    record = page.split("data-restarts>")[1].split("</section>")[0]
    assert "<b>From post_entry</b>, post_entry's intent corrected by u-supervisor at " in record
    assert ": amount misread" in record and "<code>amount: 120 → 125</code>" in record
    assert 'data-effect="post_entry:undo"' in record and "waiting for its compensations" not in record


@pytest.mark.parametrize(
    ("json_text", "words"),
    [
        ('{"amount": "125"}', "amount: a number is expected, not a string"),
        ('{"amont": 125}', "amont: post_entry's intent has no such field (amount, category)"),
        ("{amount: 125}", "not valid JSON"),
        ('{"amount": 120}', "the same as the current one"),
    ],
)
def test_a_bad_correction_is_answered_on_the_page_and_writes_nothing(clock, json_text, words):
    run = completed(clock)
    sam = login("supervisor")
    before = written(run)
    where = reverse("console:run-restart", args=[run.workflow_id])
    for stage in ("preview", "confirm"):
        posted = sam.post(
            where, {"stage": stage, "step": "post_entry", "edit": "intent", "json": json_text, "reason": "r"}
        )
        assert posted.status_code == 400
        assert words in text(posted).split("data-error>")[1].split("</p>")[0]
    assert written(run) == before


def test_an_operator_is_not_offered_a_restart_and_cannot_post_one(clock):
    run = completed(clock)
    olga = login("operator")
    assert "Restart from a step" not in text(olga.get(reverse("console:run", args=[run.workflow_id])))
    where = reverse("console:run-restart", args=[run.workflow_id])
    before = written(run)
    assert olga.get(where).status_code == 403
    posted = olga.post(where, {"stage": "confirm", "step": "post_entry", "edit": "intent", "json": '{"amount": 1}'})
    assert posted.status_code == 403 and written(run) == before
