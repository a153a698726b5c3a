"""A held tool call decided by a system for a named person (issue 38): a chat bot with the
workflow's token lists the inbox and approves, edits, rejects or answers a call for a user whose
role is checked as in the console; the same decision under the same key again is the first one;
every refusal answers its status and message and writes nothing. The same list from
``manage.py inbox``, the same decisions from ``manage.py recover``."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from recovery.api.tokens import issue_token
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive, person
from tests.support.waits import HELD_CALL

pytestmark = pytest.mark.django_db


def bot(workflow: str = "test_held_calls", name: str = "chatbot", *, may_decide: bool = True) -> Client:
    token = issue_token(name=name, workflow_name=workflow, may_decide=may_decide)[1]
    return Client(headers={"Authorization": f"Bearer {token}"})


def held(clock, order_id: str = "h-1") -> WorkflowRun:
    run = drive(run_start(workflow="test_held_calls", data={"tenant": "acme", "order_id": order_id})[0], clock)
    assert run.state == RunState.WAITING and run.steps.get(step_name=HELD_CALL).state == StepState.WAITING
    return run


def decide(c: Client, run: WorkflowRun, **body) -> tuple[int, dict]:
    sent = {"call": HELD_CALL, "decision": "approve", "reason": "ok in chat", "as": "olga", **body}
    response = c.post(f"/api/runs/{run.workflow_id}/decisions", json.dumps(sent), content_type="application/json")
    return response.status_code, response.json()


def written() -> tuple[int, int]:
    return AuditEvent.objects.count(), sum(WorkflowRun.objects.values_list("revision", flat=True))


def test_a_bot_approves_for_a_named_operator_once_however_often_it_sends_it(clock):
    run = held(clock)
    person("olga", "operator")
    c = bot()

    status, body = decide(c, run, key="chat:1")
    assert status == 201 and body["decision"] == "approve" and body["by"] == "olga" and not body["duplicate"]
    status, again = decide(c, run, key="chat:1")
    assert status == 200 and again["duplicate"] and again["by"] == "olga"
    status, other = decide(c, run, key="chat:2", decision="reject")
    assert status == 409 and "decided already: approve by olga" in other["error"]

    [event] = AuditEvent.objects.filter(run=run, action="approve_call")
    assert event.actor == "olga" and event.reason == "ok in chat (via api:chatbot)"
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 1


def test_an_edit_from_the_bot_is_checked_by_the_tools_schema_and_lowers_the_credit(clock):
    run = held(clock)
    person("olga", "operator")
    c = bot()
    before = written()
    status, body = decide(c, run, decision="edit", arguments={"invoice": "inv-1", "amount": -5})
    assert status == 400 and "arguments refused by CreditArgs" in body["error"]
    assert written() == before

    status, _ = decide(c, run, decision="edit", arguments={"invoice": "inv-1", "amount": 90})
    assert status == 201
    assert drive(run, clock).state == RunState.COMPLETED
    [entry] = receivers.RemoteObject.objects.filter(kind="ledger")
    assert entry.payload["amount"] == 90


@pytest.mark.parametrize(
    ("headers_for", "body", "status", "says"),
    [
        ("none", {}, 401, "Bearer token is required"),
        ("other", {}, 403, "may not decide for 'test_held_calls' runs"),
        ("starter", {}, 403, "(issue one with --may-decide)"),
        ("bot", {"as": "nobody"}, 400, "no active user 'nobody'"),
        ("bot", {"as": "vic"}, 403, "may not approve the tool call"),
        ("bot", {"decision": "maybe"}, 400, "decision (required) is one of"),
        ("bot", {"reason": " "}, 400, "reason (required)"),
        ("bot", {"call": "resolve:9:0:credit"}, 400, "has no call 'resolve:9:0:credit'"),
        ("bot", {"decision": "answer"}, 400, "answer needs answer"),
        ("bot", {"extra": 1}, 400, "unknown field(s) extra"),
        ("bot", {"call": "resolve:1:0:find_invoice"}, 409, "not a tool call that waits"),
    ],
)
def test_bad_decisions_are_refused_with_their_status_and_write_nothing(clock, headers_for, body, status, says):
    run = held(clock)
    person("olga", "operator")
    person("vic", "viewer")
    c = {
        "none": Client,
        "other": lambda: bot("test_orders", "erp"),
        "starter": lambda: bot(name="erp", may_decide=False),  # the system that starts disputes: not a decider
        "bot": bot,
    }[headers_for]()
    before = written()
    answered, answer = decide(c, run, **body)
    assert (answered, says in answer["error"]) == (status, True), answer
    assert written() == before
    assert run.steps.get(step_name=HELD_CALL).approval.get("decision") is None


def test_an_unknown_run_is_a_404(clock):
    response = bot().post("/api/runs/held:acme:nope/decisions", "{}", content_type="application/json")
    assert response.status_code == 404


def test_the_inbox_lists_held_calls_for_the_tokens_workflows_and_the_command_the_same(clock):
    run = held(clock)
    waiting_elsewhere = drive(run_start(workflow="test_approvals", data={"tenant": "t", "order_id": "w"})[0], clock)
    assert waiting_elsewhere.state == RunState.WAITING

    c = bot()
    items = c.get("/api/inbox").json()["items"]
    assert [(i["kind"], i["workflow_id"], i["step"], i["role"]) for i in items] == [
        ("call", run.workflow_id, HELD_CALL, "operator")
    ]
    assert items[0]["what"] == 'credit {"amount": 120, "invoice": "inv-1"}' and items[0]["tenant"] == "acme"
    assert c.get("/api/inbox?kind=nope").status_code == 400

    out = StringIO()
    call_command("inbox", stdout=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and any(HELD_CALL in line and "tool call to approve" in line for line in lines)
    out = StringIO()
    call_command("inbox", "--kind", "event", "--json", stdout=out)
    assert [json.loads(line)["workflow_id"] for line in out.getvalue().splitlines()] == [waiting_elsewhere.workflow_id]


def test_manage_py_takes_and_decides_through_the_same_transitions(clock):
    run = held(clock)
    person("olga", "operator")
    call_command("recover", "take", run.workflow_id, "--step", HELD_CALL, "--reason", "mine", "--as", "olga")
    out = StringIO()
    call_command("inbox", "--json", stdout=out)
    assert json.loads(out.getvalue())["assignee"] == "olga"
    with pytest.raises(CommandError, match="arguments refused by CreditArgs"):
        call_command(
            "recover", "edit_call", run.workflow_id, "--step", HELD_CALL, "--decision", '{"amount": "x"}',
            "--reason", "r", "--as", "olga",
        )  # fmt: skip
    call_command(
        "recover", "reject_call", run.workflow_id, "--step", HELD_CALL, "--reason", "no credit: paid", "--as", "olga"
    )
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 0
    assert run.steps.get(step_name=HELD_CALL).last_error == "rejected by olga: no credit: paid"


def test_held_calls_are_counted_by_cause_and_their_time_to_decision_observed(clock, django_capture_on_commit_callbacks):
    from prometheus_client import REGISTRY

    from recovery.observability import exposition

    decided = {"workflow": "test_held_calls", "step": "credit", "outcome": "approve"}
    before = REGISTRY.get_sample_value("recovery_wait_seconds_sum", decided) or 0.0
    with django_capture_on_commit_callbacks(execute=True):
        run = held(clock)
        gauge = 'recovery_waiting_steps{cause="approval",step="credit",workflow="test_held_calls"} 1.0'
        assert gauge in exposition.render().decode()
        clock.advance(5400)
        person("olga", "operator")
        assert decide(bot(), run)[0] == 201
    assert (REGISTRY.get_sample_value("recovery_wait_seconds_sum", decided) or 0.0) - before == 5400.0
    assert "recovery_waiting_steps{" not in exposition.render().decode()


def test_a_run_terminated_while_its_call_is_held_is_neither_waiting_nor_in_the_inbox(clock):
    from recovery import clock as engine_clock
    from recovery import inbox
    from recovery.engine.transitions import perform
    from recovery.observability import exposition

    run = held(clock)
    perform("terminate", workflow_id=run.workflow_id, actor=person("sue", "supervisor"), reason="duplicate dispute")
    assert "recovery_waiting_steps{" not in exposition.render().decode()
    assert inbox.items(engine_clock.now()) == []


def test_manage_py_issues_a_token_that_may_decide_and_the_bot_decides_with_it(clock):
    run = held(clock)
    person("olga", "operator")
    out = StringIO()
    call_command("create_api_token", "chatbot", "--workflow", "test_held_calls", "--may-decide", stdout=out)
    c = Client(headers={"Authorization": f"Bearer {out.getvalue().strip()}"})
    assert decide(c, run)[0] == 201
