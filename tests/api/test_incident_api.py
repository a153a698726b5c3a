"""Incident controls through the API (issue 37): a system with a token issued ``--may-pause`` pauses
a workflow's step, reads the pauses, releases a canary and then the rest in waves — the same
transitions as the console, audited as ``api:<token>``. Every refusal writes nothing."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

from recovery.api.tokens import issue_token
from recovery.engine.transitions import run_start
from recovery.models import ApiToken, RunState, WorkflowPause, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

BASE = "/api/workflows/test_orders"


def client(token: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {token}"})


def post(c: Client, path: str, body) -> tuple[int, dict]:
    response = c.post(f"{BASE}/{path}", json.dumps(body), content_type="application/json")
    return response.status_code, response.json()


def pauses() -> list[tuple]:
    return list(WorkflowPause.objects.order_by("pk").values_list("step_name", "released_at", "paused_by"))


def test_a_monitor_pauses_a_step_reads_it_releases_a_canary_then_the_rest_in_waves(clock):
    ops = client(issue_token(name="monitor", workflow_name="test_orders", may_pause=True)[1])
    status, body = post(ops, "pause", {"step": "post_entry", "reason": "ledger 5xx rate above 50%"})
    assert status == 201 and body["pause"]["paused_by"] == "api:monitor" and body["pause"]["step"] == "post_entry"
    runs = [
        drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": f"m-{i}"})[0], clock) for i in range(3)
    ]
    assert [r.state for r in runs] == [RunState.PAUSED] * 3
    listed = ops.get(f"{BASE}/pauses").json()["pauses"]
    assert [(p["step"], p["reason"], p["automatic"]) for p in listed] == [
        ("post_entry", "ledger 5xx rate above 50%", False)
    ]

    status, body = post(ops, "unpause", {"step": "post_entry", "reason": "try one", "canary": 1})
    assert (status, body["canary"], body["released"]) == (200, True, [runs[0].workflow_id])
    assert drive(runs[0], clock).state == RunState.COMPLETED

    status, body = post(ops, "unpause", {"step": "post_entry", "reason": "back", "wave_size": 1, "wave_seconds": 30})
    assert status == 200 and body["released"] == [r.workflow_id for r in runs[1:]]
    assert set(body["due"]) == {r.workflow_id for r in runs[1:]}
    assert [drive(r, clock).state for r in runs[1:]] == [RunState.COMPLETED] * 2
    assert receivers.counts()["ledger"] == 3
    unpaused = WorkflowRun.objects.get(pk=runs[2].pk).audit_events.get(action="unpause")
    assert (unpaused.actor, unpaused.reason) == ("api:monitor", "step post_entry of test_orders unpaused: back")


@pytest.mark.parametrize(
    ("token", "path", "body", "status", "error"),
    [
        (
            "starter",
            "pause",
            {"reason": "x"},
            403,
            "may not pause or release 'test_orders' (issue one with --may-pause)",
        ),
        ("other", "pause", {"reason": "x"}, 403, "may not pause or release 'test_orders'"),
        ("monitor", "pause", {"step": "nope", "reason": "x"}, 400, "has no step 'nope'"),
        ("monitor", "pause", {"step": "notify"}, 400, "reason (required) and step are strings"),
        ("monitor", "pause", {"reason": "x", "when": "now"}, 400, "unknown field(s) when"),
        ("monitor", "pause", ["x"], 400, "the body must be a JSON object"),
        (
            "monitor",
            "pause",
            {"step": "notify", "reason": "again"},
            409,
            "step notify of test_orders is paused already",
        ),
        ("monitor", "unpause", {"reason": "x"}, 409, "workflow test_orders is not paused"),
        ("monitor", "unpause", {"step": "notify", "reason": "x", "canary": "2"}, 400, "canary must be a whole number"),
        ("monitor", "unpause", {"step": "notify", "reason": "x", "wave_size": 2}, 400, "1 to 3600 seconds"),
        ("monitor", "unpause", {"step": "notify", "reason": "x", "canary": 1, "wave_size": 1}, 400, "not both"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(token, path, body, status, error):
    tokens = {
        "monitor": issue_token(name="monitor", workflow_name="test_orders", may_pause=True)[1],
        "starter": issue_token(name="starter", workflow_name="test_orders")[1],
        "other": issue_token(name="other", workflow_name="test_local", may_pause=True)[1],
    }
    post(client(tokens["monitor"]), "pause", {"step": "notify", "reason": "chat outage"})
    before = pauses()
    got, answer = post(client(tokens[token]), path, body)
    assert (got, error in answer["error"]) == (status, True), answer
    assert pauses() == before


def test_create_api_token_may_pause():
    out = StringIO()
    call_command("create_api_token", "monitor", "--workflow", "test_orders", "--may-pause", stdout=out)
    assert ApiToken.objects.get(name="monitor").may_pause
    status, _ = post(client(out.getvalue().strip()), "pause", {"reason": "from the monitor"})
    assert status == 201
