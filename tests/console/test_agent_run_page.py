"""The run page of an agent step: its conversation as a timeline — each model turn with the
calls it asked for (arguments, key, remote reference, attempts, errors and refusals) — and the
operator's actions on a tool call, the same audited transitions as on any step."""

import pytest
from django.urls import reverse

from recovery.engine.transitions import run_start
from recovery.models import RunState
from tests.support import receivers
from tests.support.console import act, login
from tests.support.engine import drive

pytestmark = pytest.mark.django_db(transaction=True)


def page(client, run) -> str:
    return client.get(reverse("console:run", args=[run.workflow_id])).content.decode()


def turn(html: str, number: int) -> str:
    return html.split(f'data-turn="{number}"')[1].split("</li>")[0]


def test_the_conversation_shows_each_turn_with_its_calls_keys_references_and_refusals(clock):
    receivers.arm("ledger", "unavailable")
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": "page", "amount": 900})[0]
    run = drive(run, clock)
    html = page(login("viewer"), run)

    assert "Agent resolve: the conversation" in html and "3 of at most 5 turns" in html
    first = turn(html, 1)
    assert "find_invoice" in first and "&quot;invoice&quot;: &quot;inv-1&quot;" in first
    second = turn(html, 2)
    credit = run.steps.get(step_name="resolve:2:0:credit")
    assert credit.idempotency_key[:12] in second  # the key, shortened, whole in its title
    assert "refused by <code>credit_limit</code>" in second and "answered to the model; nothing sent" in second
    notify = run.steps.get(step_name="resolve:2:1:notify_customer")
    assert notify.remote_ref in second
    assert "Final answer" in turn(html, 3) and "&quot;refused&quot;" in turn(html, 3)


def test_an_operator_retries_a_failed_tool_call_from_the_console(clock):
    receivers.arm("ledger", "forbidden")
    run = run_start(workflow="test_agent", data={"tenant": "t", "order_id": "retry"})[0]
    run = drive(run, clock)
    assert run.state == RunState.FAILED

    operator = login("operator")
    response = act(operator, run, "retry", step="resolve:2:0:credit", reason="the ledger token was renewed")
    assert response.status_code == 200, response.content[:300]
    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 0, "message": 1, "ledger": 1, "model_call": 3}
