"""Events for waiting runs through the API (issue 38): the system that sends a workflow's business
events delivers the event a run's durable wait waits for, under its idempotency key (in the body
or an Idempotency-Key header); the run goes on from it, once however often it is sent. Every
refusal answers its status and message and writes nothing."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client

from recovery.api import views as api
from recovery.api.tokens import issue_token
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunEvent, RunState, StepState, WorkflowRun
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

APPROVED = {"approved": True, "amount": 120, "by": "alice"}
KEY = "tracker:17:approved"


def client(token: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {token}"})


def tracker() -> Client:
    return client(issue_token(name="tracker", workflow_name="test_approvals")[1])


def post(c: Client, workflow_id: str, body, **headers) -> tuple[int, dict]:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    response = c.post(f"/api/runs/{workflow_id}/events", data, content_type="application/json", headers=headers)
    return response.status_code, response.json()


def event(payload=APPROVED, *, key: str | None = KEY, name: str = "approved") -> dict:
    return {"event": name, "payload": payload, **({"key": key} if key is not None else {})}


def started(order_id: str = "o-1") -> WorkflowRun:
    return run_start(workflow="test_approvals", data={"tenant": "t", "order_id": order_id})[0]


def written() -> tuple[int, int, int]:
    return (
        RunEvent.objects.count(),
        AuditEvent.objects.count(),
        sum(WorkflowRun.objects.values_list("revision", flat=True)),
    )


def test_an_event_is_recorded_201_and_the_run_goes_on_from_it_once(clock):
    run = drive(started(), clock)
    assert run.state == RunState.WAITING and receivers.counts()["ledger"] == 0

    status, body = post(tracker(), run.workflow_id, event())
    assert status == 201
    kept = RunEvent.objects.get()
    assert body == {
        "workflow_id": "approval:t:o-1",
        "event": "approved",
        "key": KEY,
        "late": False,
        "received_at": clock.now().isoformat(),
        "step": "approval",
        "duplicate": False,
    }
    assert (kept.sent_by, kept.payload, kept.late, kept.step_name) == ("api:tracker", APPROVED, False, "approval")
    received = AuditEvent.objects.get(run=run, action="event_received")
    assert (received.actor, received.actor_user_id, received.step_name) == ("api:tracker", None, "approval")

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert run.steps.get(step_name="approval").remote_ref == KEY
    assert receivers.counts()["ledger"] == 1


def test_the_same_key_again_is_200_duplicate_and_one_event(clock):
    run = drive(started(), clock)
    c = tracker()
    first_status, first = post(c, run.workflow_id, event())
    clock.advance(60)
    status, again = post(c, run.workflow_id, event(dict(APPROVED)))  # the sender's retry
    assert (first_status, status) == (201, 200)
    assert again == {**first, "duplicate": True}  # the first event's time and step, not the retry's
    assert RunEvent.objects.count() == 1
    assert AuditEvent.objects.filter(action="event_received").count() == 1

    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 1


def test_the_key_may_come_in_an_idempotency_key_header(clock):
    run = drive(started(), clock)
    c = tracker()
    status, body = post(c, run.workflow_id, event(key=None), **{"Idempotency-Key": KEY})
    assert (status, body["key"], body["duplicate"]) == (201, KEY, False)
    # The same key, in the body this time, or in both: the same event.
    assert post(c, run.workflow_id, event())[0] == 200
    assert post(c, run.workflow_id, event(), **{"Idempotency-Key": KEY})[0] == 200
    assert RunEvent.objects.get().key == KEY
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["ledger"] == 1


def test_an_event_before_its_wait_is_kept_and_one_after_its_deadline_is_late(clock):
    early = started("o-2")
    status, body = post(tracker(), early.workflow_id, event())
    assert (status, body["late"], body["step"]) == (201, False, "")  # kept until its wait is reached
    assert drive(early, clock).state == RunState.COMPLETED

    late = drive(started("o-3"), clock)
    clock.advance(timedelta(days=3).total_seconds() + 1)
    status, body = post(
        client(issue_token(name="tracker-2", workflow_name="test_approvals")[1]), late.workflow_id, event()
    )
    assert (status, body["late"], body["step"]) == (201, True, "approval")
    late = drive(late, clock)
    assert late.state == RunState.NEEDS_REVIEW  # as the wait declares; the late event is not applied
    assert late.steps.get(step_name="approval").state == StepState.FAILED
    assert receivers.counts()["ledger"] == 1


def test_refusals_answer_their_status_and_write_nothing(clock):
    c = tracker()
    other = client(issue_token(name="erp", workflow_name="test_orders")[1])
    waiting = drive(started("r-1"), clock)
    assert post(c, waiting.workflow_id, event(key="tracker:r-1:first"))[0] == 201
    done = started("r-2")
    post(c, done.workflow_id, event(key="tracker:r-2"))
    done = drive(done, clock)
    assert done.state == RunState.COMPLETED
    wid = waiting.workflow_id
    cases = [
        (c, wid, ["x"], {}, 400, "the body must be a JSON object"),
        (c, wid, "{not json", {}, 400, "the body is not valid JSON"),
        (c, wid, {**event(), "reason": "x"}, {}, 400, "unknown field(s) reason; allowed: event, key, payload"),
        (c, wid, {"key": KEY, "payload": APPROVED}, {}, 400, "event (required)"),
        (c, wid, event(key=17), {}, 400, "key is a string"),
        (c, wid, event(key=None), {}, 400, "an event needs the sender's idempotency key (1 to 200 characters)"),
        (c, wid, event(key="k" * 201), {}, 400, "an event needs the sender's idempotency key"),
        (c, wid, event(), {"Idempotency-Key": "tracker:other"}, 400, "the body's key and the Idempotency-Key header"),
        (c, wid, event(name="rejected"), {}, 400, "waits for no event 'rejected' (it waits for: approved)"),
        (c, wid, event({**APPROVED, "amount": -1}), {}, 400, "event 'approved' refused by approval: "),
        (c, wid, event({**APPROVED, "note": "x"}), {}, 400, "refused by approval: "),
        (c, wid, event(["x"]), {}, 400, "an event's payload is a JSON object"),
        (c, "approval:t:nope", event(), {}, 404, "no run 'approval:t:nope'"),
        (other, wid, event(), {}, 403, "this token may not send events to 'test_approvals' runs"),
        (c, wid, event({**APPROVED, "amount": 5}, key="tracker:r-1:first"), {}, 409, "was used for another event"),
        (c, done.workflow_id, event(key="tracker:r-2:again"), {}, 409, "is completed: an event for it is not recorded"),
        (client("rc_unknown"), wid, event(), {}, 401, "unknown or revoked token"),
        (Client(), wid, event(), {}, 401, "an Authorization: Bearer token is required"),
    ]
    before = written()
    for sender, workflow_id, body, headers, status, words in cases:
        got, answer = post(sender, workflow_id, body, **headers)
        assert (got, words in answer["error"]) == (status, True), (body, headers, answer)
        assert written() == before, (body, answer)

    response = c.post(f"/api/runs/{wid}/events", "x" * (api.MAX_BODY_BYTES + 1), content_type="application/json")
    assert (response.status_code, response.json()["error"]) == (413, "the event is larger than 256 KiB")
    for method in ("get", "put", "delete"):
        response = getattr(c, method)(f"/api/runs/{wid}/events")
        assert (response.status_code, response["Allow"]) == (405, "POST"), method
        assert response.json()["error"] == f"method {method.upper()} not allowed; POST the event"
    assert written() == before


def test_the_run_actions_are_still_routed_beside_the_events(clock):
    """The events route comes before the run actions' (a workflow id may hold colons and slashes):
    an action still reaches its own view, and a token that may only start runs may not pause one."""
    run = drive(started(), clock)
    response = tracker().post(f"/api/runs/{run.workflow_id}/pause", '{"reason": "x"}', content_type="application/json")
    assert response.status_code == 403 and "may not pause or release" in response.json()["error"]


@pytest.mark.django_db(transaction=True)
def test_a_database_out_of_reach_is_503_with_retry_after_and_the_same_event_later_is_recorded(clock, monkeypatch):
    from django.db import OperationalError

    from recovery.api import run_events

    def down(**kwargs):
        raise OperationalError("terminating connection due to administrator command")

    delivered = run_events.run_deliver_event
    run = drive(started(), clock)
    c = tracker()
    before = written()
    monkeypatch.setattr(run_events, "run_deliver_event", down)
    response = c.post(f"/api/runs/{run.workflow_id}/events", json.dumps(event()), content_type="application/json")
    assert response.status_code == 503 and response["Retry-After"] == str(api.RETRY_AFTER_SECONDS)
    assert "nothing was written: send the event again" in response.json()["error"]
    assert written() == before
    monkeypatch.setattr(run_events, "run_deliver_event", delivered)  # the database is back
    assert post(c, run.workflow_id, event())[0] == 201
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts()["ledger"] == 1
