"""A run's incident controls through the API (issue 37): a system with a token issued
``--may-pause`` pauses one run, unpauses it, and makes a step waiting for its retry try now —
the same transitions and checks as the console, audited as ``api:<token>``, the run going on from
each. Every refusal writes nothing."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from recovery import why
from recovery.api.tokens import issue_token
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start, run_version
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db


def client(token: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {token}"})


def post(c: Client, workflow_id: str, action: str, body) -> tuple[int, dict]:
    response = c.post(f"/api/runs/{workflow_id}/{action}", json.dumps(body), content_type="application/json")
    return response.status_code, response.json()


def started(order_id: str) -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def monitor() -> Client:
    return client(issue_token(name="monitor", workflow_name="test_orders", may_pause=True)[1])


def test_a_monitor_pauses_a_run_and_unpauses_it_and_the_run_goes_on_once(clock):
    ops, run = monitor(), started("p-1")
    status, body = post(ops, run.workflow_id, "pause", {"reason": "ledger outage"})
    assert (status, body["state"]) == (200, RunState.PAUSED)
    assert body["status"].startswith("paused by api:monitor at ")
    run.refresh_from_db()
    assert run.paused_by == "api:monitor"
    event = AuditEvent.objects.get(run=run, action="pause")
    assert (event.actor, event.actor_user_id, event.reason) == ("api:monitor", None, "ledger outage")
    assert "paused by api:monitor" in why.why_not_moving(run, list(run.steps.all()), now=clock.now())
    assert advance(run.pk) is None and receivers.counts()["task"] == 0

    status, body = post(ops, run.workflow_id, "unpause", {"reason": "ledger back", "expect": run_version(run)})
    assert (status, body["state"]) == (200, RunState.PENDING)
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def test_a_monitor_makes_a_step_waiting_for_its_retry_try_now(clock):
    receivers.arm("task", "unavailable")
    run = started("b-1")
    advance(run.pk)
    step = StepExecution.objects.get(run=run, step_name="create_task")
    assert (step.state, step.attempts) == (StepState.FAILED, 1) and step.next_attempt_at > clock.now()

    status, body = post(monitor(), run.workflow_id, "retry_now", {"step": "create_task", "reason": "tracker back"})
    assert (status, body["state"]) == (200, RunState.PENDING)
    assert AuditEvent.objects.get(run=run, action="retry_now").actor == "api:monitor"
    advance(run.pk)  # no clock moved: the attempt is now
    step.refresh_from_db()
    assert (step.state, step.attempts) == (StepState.SUCCEEDED, 2) and receivers.counts()["task"] == 1


def test_refusals_write_nothing(clock):
    ops = monitor()
    starter = client(issue_token(name="starter", workflow_name="test_orders")[1])
    other = client(issue_token(name="other", workflow_name="test_guarded", may_pause=True)[1])
    run, done = started("r-1"), drive(started("r-2"), clock)
    before = (AuditEvent.objects.count(), list(WorkflowRun.objects.order_by("pk").values_list("state", "revision")))
    cases = [
        (starter, run.workflow_id, "pause", {"reason": "x"}, 403, "may not pause or release 'test_orders' runs"),
        (other, run.workflow_id, "pause", {"reason": "x"}, 403, "may not pause"),
        (ops, "order:t:nope", "pause", {"reason": "x"}, 404, "no run 'order:t:nope'"),
        (ops, run.workflow_id, "terminate", {"reason": "x"}, 404, "no run action 'terminate'"),
        (ops, run.workflow_id, "pause", {}, 400, "reason (required)"),
        (ops, run.workflow_id, "pause", {"reason": "  "}, 400, "reason"),
        (ops, run.workflow_id, "pause", ["x"], 400, "must be a JSON object"),
        (ops, run.workflow_id, "pause", {"reason": "x", "why": "y"}, 400, "unknown field(s) why"),
        (ops, run.workflow_id, "retry_now", {"reason": "x"}, 400, "retry_now needs a step"),
        (ops, run.workflow_id, "unpause", {"reason": "x"}, 400, "is not paused"),
        (ops, done.workflow_id, "pause", {"reason": "x"}, 400, "only a run that moves by itself can be paused"),
        (ops, run.workflow_id, "pause", {"reason": "x", "expect": "1:stale"}, 409, ""),
    ]
    for c, workflow_id, action, body, status, words in cases:
        got, answer = post(c, workflow_id, action, body)
        assert (got, words in answer["error"]) == (status, True), (action, body, answer)
        assert (
            AuditEvent.objects.count(),
            list(WorkflowRun.objects.order_by("pk").values_list("state", "revision")),
        ) == before
    assert ops.get(f"/api/runs/{run.workflow_id}/pause").status_code == 405
    assert Client().post(f"/api/runs/{run.workflow_id}/pause", "{}", content_type="application/json").status_code == 401
