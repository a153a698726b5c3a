"""A run waiting for an event, in the console (issue 38): its page says what it waits for and
until when; an operator sends the event in a person's stead (an approver who answered by phone),
validated by the wait's schema, one event however often the form is posted; the run goes on from
it, and the page lists each event with what became of it. A viewer cannot send one, a payload the
wait refuses is answered on the page, and neither writes anything."""

from __future__ import annotations

import html
import json

import pytest
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunEvent, RunState
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

APPROVED = {"approved": True, "amount": 120, "by": "alice"}


def text(response) -> str:
    return html.unescape(response.content.decode())


def waiting(clock):
    run = drive(run_start(workflow="test_approvals", data={"tenant": "t", "order_id": "c-1"})[0], clock)
    assert run.state == RunState.WAITING
    return run


def written() -> tuple[int, int]:
    return RunEvent.objects.count(), AuditEvent.objects.count()


def test_an_operator_sends_the_event_a_run_waits_for_and_the_run_goes_on_from_it(clock):
    run = waiting(clock)
    olga = login("operator")
    page = text(olga.get(reverse("console:run", args=[run.workflow_id])))
    assert "approval: waiting for event 'approved' until " in page
    section = page.split("data-events>")[1].split("</section>")[0]
    assert "<b>Send event approved</b> — approval waits for it now; its payload takes amount, approved, by." in section
    key = section.split('name="key" value="')[1].split('"')[0]
    assert key.startswith("console:")

    form = {"event": "approved", "key": key, "payload": json.dumps(APPROVED)}
    sent = olga.post(reverse("console:run-event", args=[run.workflow_id]), form, HTTP_HX_REQUEST="true")
    assert sent.status_code == 200 and "event approved sent: the run goes on from it" in text(sent)
    again = olga.post(reverse("console:run-event", args=[run.workflow_id]), form, HTTP_HX_REQUEST="true")
    assert "event approved was sent already (the same form): nothing new" in text(again)
    assert RunEvent.objects.get().sent_by == "u-operator"

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 1
    page = text(olga.get(reverse("console:run", args=[run.workflow_id])))
    row = page.split(f'data-event="{key}"')[1].split("</tr>")[0]
    assert "<td>u-operator</td>" in row and "<td data-fate>applied by approval</td>" in row
    assert "data-event-form" not in page  # nothing waits any more


def test_a_viewer_cannot_send_an_event_and_a_refused_payload_writes_nothing(clock):
    run = waiting(clock)
    where = reverse("console:run-event", args=[run.workflow_id])
    before = written()
    viewer = login("viewer")
    refused = viewer.post(where, {"event": "approved", "key": "console:x", "payload": json.dumps(APPROVED)})
    assert refused.status_code == 403
    assert "data-event-form" not in text(viewer.get(reverse("console:run", args=[run.workflow_id])))

    olga = login("operator")
    bad = olga.post(where, {"event": "approved", "key": "console:y", "payload": '{"approved": "perhaps"}'})
    assert bad.status_code == 400 and "event 'approved' refused by approval" in text(bad)
    not_json = olga.post(where, {"event": "approved", "key": "console:z", "payload": "{approved"})
    assert not_json.status_code == 400 and "the payload of event 'approved'" in text(not_json)
    unknown = olga.post(where, {"event": "rejected", "key": "console:w", "payload": "{}"})
    assert unknown.status_code == 400 and "waits for no event 'rejected'" in text(unknown)
    assert written() == before
    assert drive(run, clock).state == RunState.WAITING
