"""The simulated tracker calls a waiting run back (issue 38): a task created with the run's events
URL; its assignee approves (or rejects) it in the tracker; the tracker posts the decision to our
event API, signed as our alert webhook is; the run goes on from it. Over real HTTP (a live
server holds both the tracker and the event API). A forged or stale signature is refused, and
writes nothing."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import httpx
import pytest

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunEvent, RunState, StepState
from sandbox.models import Task
from tests.support import receivers
from tests.support.engine import drive

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])


@pytest.fixture(autouse=True)
def live(live_server, settings):
    settings.SANDBOX_URL = live_server.url
    settings.RECOVERY_CONSOLE_URL = live_server.url
    return live_server


def waiting(order_id: str, clock):
    run = drive(run_start(workflow="test_tracked_approval", data={"tenant": "t", "order_id": order_id})[0], clock)
    assert run.state == RunState.WAITING, run.status_reason
    return run


def decide(live, task: str, decision: str, by: str = "alice", note: str = "") -> httpx.Response:
    return receivers.decide_in_tracker(task, decision, by=by, note=note)


def test_the_assignee_approves_in_the_tracker_and_its_callback_completes_the_run(live, clock):
    run = waiting("cb-1", clock)
    task = run.steps.get(step_name="open_tracked_task").remote_ref
    assert Task.objects.using("sandbox").get().callback_url == f"{live.url}/api/runs/{run.workflow_id}/events"

    answered = decide(live, task, "approve")
    assert answered.status_code == 200 and answered.json()["callback_status"] == "201"
    event = RunEvent.objects.get()
    assert (event.name, event.key, event.sent_by, event.late) == (
        "task_decided",
        f"tracker:{task}:decided",
        "signed:tracker",
        False,
    )
    again = decide(live, task, "approve")  # the tracker's retry: the same event, nothing new
    assert again.json()["callback_status"] == "200" and RunEvent.objects.count() == 1
    assert decide(live, task, "reject").status_code == 409  # the first decision stands

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts()["ledger"] == 1
    assert run.steps.get(step_name="tracker_decision").result == {
        "task": task,
        "decision": "approved",
        "by": "alice",
        "note": "",
    }


def test_a_rejection_in_the_tracker_posts_nothing_and_says_who_rejected(live, clock):
    run = waiting("cb-2", clock)
    task = run.steps.get(step_name="open_tracked_task").remote_ref
    assert decide(live, task, "reject", by="bob", note="not ours").json()["callback_status"] == "201"
    run = drive(run, clock)
    assert run.state == RunState.NEEDS_REVIEW and receivers.counts()["ledger"] == 0
    assert f"{task} was rejected by bob" in run.status_reason
    assert run.steps.get(step_name="post_decided").state == StepState.PENDING


@pytest.mark.parametrize(
    ("secret", "age", "error"),
    [
        ("not-the-tracker-secret", 0, "the event's signature does not match its body"),
        (None, 3600, "more than 5 minutes away from now"),
    ],
)
def test_a_forged_or_stale_callback_is_refused_and_writes_nothing(live, clock, settings, secret, age, error):
    run = waiting(f"cb-forged-{age}", clock)
    body = json.dumps(
        {"event": "task_decided", "key": "forged", "payload": {"task": "task_1", "decision": "approved", "by": "x"}}
    ).encode()
    timestamp = str(int(time.time()) - age)
    key = (secret or settings.RECOVERY_EVENT_SIGNING_SECRET).encode()
    signature = "sha256=" + hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    before = (RunEvent.objects.count(), AuditEvent.objects.count())
    refused = httpx.post(
        f"{live.url}/api/runs/{run.workflow_id}/events",
        content=body,
        headers={
            "Content-Type": "application/json",
            "X-Recovery-Sender": "tracker",
            "X-Recovery-Timestamp": timestamp,
            "X-Recovery-Signature": signature,
        },
        timeout=30,
    )
    assert refused.status_code == 401 and error in refused.json()["error"]
    assert (RunEvent.objects.count(), AuditEvent.objects.count()) == before
