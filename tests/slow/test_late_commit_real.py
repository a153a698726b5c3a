"""The issue's reproduction, with real processes: a messenger that commits a message long after
our publisher gave up, and a second executor that looks for it in between. One message.

contract rule 7: a look-up that finds nothing proves absence only once the request can no longer
commit. Timing-safe: the late commit comes LATE_MS after the request, far longer than a process
start; whether the second executor looked before or after it landed, exactly one message may
exist, and if it looked before, it must have waited (``outbox_settle_wait``) instead of sending.
"""

import json
import time

import pytest
from django.utils import timezone

from recovery.models import OutboxMessage, OutboxState, RunState, WorkflowRun
from sandbox import faults
from sandbox.models import Message

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=["default", "sandbox"])]

LATE_MS = 30_000  # the messenger commits 30 s after the request; our publisher waits 1 s (test settings)


@pytest.fixture
def manage(sandbox_manage):
    return sandbox_manage


def test_a_message_committed_after_the_publisher_gave_up_is_found_not_sent_again(manage):
    faults.set_fault("messages", "send", "late_commit", delay_ms=LATE_MS)
    event = {"tenant": "tz", "invoice_id": "dup-2", "text": "3 chairs. Total due EUR 300.00"}
    started = manage("start_workflow", "invoice", "--input", json.dumps(event))
    assert started.returncode == 0, started.stderr
    wid = started.stdout.strip()

    first = manage("run_executor", "--until-idle")  # the publisher times out: unknown
    assert first.returncode == 0, first.stderr
    message = OutboxMessage.objects.get(run__workflow_id=wid)
    assert (message.state, message.attempts, message.last_error_kind) == (
        OutboxState.PENDING,
        1,
        "unknown_outcome",
    )
    assert message.settle_from == message.last_attempt_at

    # A second executor, as soon as the retry is due: the look-up may find nothing yet.
    second_started = timezone.now()
    second = manage("run_executor", "--until-idle", at=message.next_attempt_at)
    assert second.returncode == 0, second.stderr

    deadline = time.monotonic() + 300  # a hang guard, not a timing assumption
    while not Message.objects.using("sandbox").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    landed = Message.objects.using("sandbox").get()  # the late one, and only it
    message.refresh_from_db()
    run = WorkflowRun.objects.get(workflow_id=wid)
    if landed.created_at > second_started:
        # It looked while the request was in flight: it must have waited, sending nothing.
        assert run.audit_events.filter(action="outbox_settle_wait").count() == 1
        assert message.next_attempt_at == message.settle_from + _bound()
        assert "looking it up again at" in run.status_reason

    # The next look-up (at the window's end, when it is due) finds the message.
    third = manage("run_executor", "--until-idle", at=max(message.next_attempt_at, timezone.now()))
    assert third.returncode == 0, third.stderr
    run.refresh_from_db()
    message.refresh_from_db()
    assert run.state == RunState.COMPLETED, (run.state, run.status_reason)
    assert message.state == OutboxState.DELIVERED and message.provider_ref == landed.public_id
    counted = json.loads(manage("sandbox", "counts", "--json").stdout)
    assert (counted["tasks"], counted["messages"], counted["ledger_entries"]) == (1, 1, 1), counted


def _bound():
    from recovery.workflow import get_workflow

    return get_workflow("invoice").get_step("notify_approver").in_flight_bound()
