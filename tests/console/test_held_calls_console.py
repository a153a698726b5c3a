"""A tool call held for a person, in the console (issue 38): the run page shows the call with its
arguments, who may decide it, its deadline and what happens then; an operator of the tool's role
approves, edits, rejects or answers it there, or takes it from the Inbox, which lists everything
waiting for a person. A decision the tool's schema refuses is answered on the page and writes
nothing; a viewer sees the call but no form."""

from __future__ import annotations

import html

import pytest
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepState
from tests.support import receivers
from tests.support.console import login
from tests.support.engine import drive
from tests.support.waits import HELD_CALL

pytestmark = pytest.mark.django_db


def text(response) -> str:
    return html.unescape(response.content.decode())


def held(clock, order_id="c-1"):
    run = drive(run_start(workflow="test_held_calls", data={"tenant": "acme", "order_id": order_id})[0], clock)
    assert run.state == RunState.WAITING
    return run


def act(client, run, action, **form):
    data = {"action": action, "step": HELD_CALL, "reason": "checked", **form}
    return client.post(reverse("console:run-action", args=[run.workflow_id]), data, HTTP_HX_REQUEST="true")


def test_the_run_page_shows_the_held_call_and_an_operator_edits_it_the_run_goes_on(clock):
    run = held(clock)
    operator = login("operator")
    page = text(operator.get(reverse("console:run", args=[run.workflow_id])))
    assert "Waiting for a person" in page and "credit" in page and "waits for an operator's decision" in page
    assert '"amount": 120' in page and 'data-action="decide:resolve:2:0:credit"' in page
    assert "Turn 2 of at most 5: credit waits for an operator's approval until" in page  # not "waiting to call"

    refused = act(operator, run, "edit_call", decision='{"invoice": "inv-1", "amount": "lots"}')
    assert refused.status_code == 400 and "arguments refused by CreditArgs" in text(refused)
    assert not AuditEvent.objects.filter(action="edit_call").exists()

    done = act(operator, run, "edit_call", decision='{"invoice": "inv-1", "amount": 90}')
    assert done.status_code == 200 and "edit and approve the tool call (resolve:2:0:credit) recorded" in text(done)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert [e.payload["amount"] for e in receivers.RemoteObject.objects.filter(kind="ledger")] == [90]


def test_a_viewer_sees_the_held_call_but_no_form_and_cannot_post_one(clock):
    run = held(clock)
    viewer = login("viewer")
    page = text(viewer.get(reverse("console:run", args=[run.workflow_id])))
    assert "Waiting for a person" in page and 'data-action="decide:' not in page
    assert act(viewer, run, "approve_call").status_code == 403
    assert run.steps.get(step_name=HELD_CALL).state == StepState.WAITING


def test_the_inbox_lists_the_call_and_i_take_it(clock):
    run = held(clock)
    operator = login("operator")
    page = text(operator.get(reverse("console:inbox")))
    assert f'data-item="{run.workflow_id}|{HELD_CALL}"' in page and "tool call to approve" in page
    assert 'data-action="take:resolve:2:0:credit"' in page

    assert act(operator, run, "take", reason="taken from the inbox").status_code == 200
    page = text(operator.get(reverse("console:inbox")))
    assert "<td data-assignee>u-operator</td>" in page and 'data-action="take:' not in page
    assert "nothing waits" not in page.lower()
    filtered = text(operator.get(reverse("console:inbox") + "?workflow=test_orders"))
    assert "data-empty" in filtered
    [taken] = AuditEvent.objects.filter(action="take")
    assert taken.actor == "u-operator" and taken.after["assignee"] == "u-operator"


def test_rejected_from_the_page_the_model_reads_the_reason(clock):
    run = held(clock)
    act(login("operator"), run, "reject_call", reason="invoice was paid by card")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 0
    assert run.steps.get(step_name=HELD_CALL).last_error == "rejected by u-operator: invoice was paid by card"
    assert run.steps.get(step_name="resolve").result["resolution"] == "refused"


def test_a_held_call_the_agents_stop_left_out_is_no_longer_shown_as_waiting(clock):
    from recovery.engine.transitions import agent_stop
    from tests.support.engine import person

    run = held(clock)
    agent_stop(workflow_id=run.workflow_id, step_name="resolve", actor=person("sue"), reason="customer called")
    assert run.steps.get(step_name=HELD_CALL).state == StepState.SKIPPED
    page = text(login("supervisor").get(reverse("console:run", args=[run.workflow_id])))
    assert "Waiting for a person" not in page
